// Context drafts: tokens looked up in the context instead of drafted by a model (context_drafter.cpp).
//
// Agents' output repeats their context (a file shown and rewritten with a few lines changed,
// quoted tool output, JSON re-emitted with one field changed), and a draft looked up there costs
// no drafter pass. Two sources, as llama.cpp's n-gram speculative types at 0c1e570
// (common/speculative.cpp, common/ngram-map.cpp, common/ngram-mod.cpp):
//
//   ngram-simple  prompt lookup: the most recent earlier occurrence of the longest suffix of the
//                 context (prompt + committed output, the anchor last) of at least size_n tokens;
//                 the tokens that followed it are the drafts (at most size_m). llama.cpp's
//                 ngram-simple looks up exactly size_n tokens; the longest match is kept here
//                 because its length is what predicts acceptance (ContextCalibration).
//   ngram-mod     a pool of n_match-grams -> next token, hashed into a fixed table (4 Mi entries,
//                 16 MiB), filled from every request of the engine (shared across requests, as
//                 llama.cpp shares it across a slot's); drafts chain lookups up to n_max tokens.
//
// Every context draft is a point mass (q = 1 on the drafted token), which the rejection rule
// handles exactly (acceptance.h), so drafts from the context are as lossless as DFlash drafts.
// Which source drafts, and how many of its tokens are verified, is chosen per cycle by expected
// tokens per millisecond (driver.cpp, draft_policy.h), with each source's acceptance learnt
// online by match length (ContextCalibration).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace dflash2 {

// Speculative types (llama.cpp's --spec-type names); a generation takes any set of them.
enum SpecType : int {
    kSpecDflash      = 1,  // "draft-dflash": the DFlash drafter GGUF
    kSpecNgramSimple = 2,  // "ngram-simple": prompt lookup by longest suffix match
    kSpecNgramMod    = 4,  // "ngram-mod": hashed n-gram pool shared across requests
};
constexpr int kNumSources = 3;          // stats index: 0 dflash, 1 ngram-simple, 2 ngram-mod
const char * source_name(int index);

// Parameters of the context sources (llama.cpp's --spec-ngram-* flags; defaults: see the fields).
struct NgramParams {
    // llama.cpp's defaults at 0c1e570 (common/common.h) except simple_size_n: llama.cpp looks up
    // 12 tokens; here the longest suffix of at least 2 is looked up, and how far a short match is
    // trusted is learnt (ContextCalibration), so short matches (identifiers, JSON keys) draft too.
    int simple_size_n = 2;   // --spec-ngram-simple-size-n: the shortest suffix looked up
    int simple_size_m = 48;  // --spec-ngram-simple-size-m: the most drafts
    int mod_n_match   = 24;  // --spec-ngram-mod-n-match: pool n-gram length
    int mod_n_max     = 64;  // --spec-ngram-mod-n-max: the most drafts
    int mod_n_min     = 48;  // --spec-ngram-mod-n-min: fewer chained drafts than this: none
    void validate() const;   // std::invalid_argument naming the bad field
};

struct ContextDraft {
    std::vector<int32_t> tokens;
    int match_len = 0;       // tokens of the context that matched (the calibration key)
};

// One interface for the context sources, as llama.cpp's common_speculative_impl (begin with the
// prompt, then a draft per cycle): the engine asks every source its generation enables
// (spec_bit) for a draft each cycle and keeps the one that promises the most (driver.cpp).
class ContextSource {
  public:
    virtual ~ContextSource() = default;
    virtual int index() const = 0;     // stats index (source_name)
    virtual int spec_bit() const = 0;  // the SpecType bit that enables it
    // A generation starts from `history` (its prompt).
    virtual void begin(const std::vector<int32_t> & history, const NgramParams & p) { (void) history; (void) p; }
    // history: prompt + committed tokens (the anchor last); at most k_max drafts.
    virtual ContextDraft draft(const std::vector<int32_t> & history, const NgramParams & p, int k_max) = 0;
    virtual void clear() = 0;
};

// ngram-simple: the context's own n-gram index, rebuilt when a request's prompt does not extend
// the indexed tokens, extended as tokens are committed.
class PromptLookup : public ContextSource {
  public:
    int index() const override { return 1; }
    int spec_bit() const override { return kSpecNgramSimple; }
    ContextDraft draft(const std::vector<int32_t> & history, const NgramParams & p, int k_max) override;
    void clear() override;

  private:
    // Two n-gram indexes: size_n tokens, and kLong tokens (the candidates of a long match are
    // then few even where short n-grams repeat hundreds of times, as in code).
    static constexpr int kLong = 8;
    using Index = std::unordered_map<uint64_t, std::vector<int32_t>>;  // hash of n tokens -> end indices
    void index_to(const std::vector<int32_t> & history, int n);
    int search(const Index & idx, int n, const std::vector<int32_t> & history, int & best_m) const;
    int n_ = 0;                                   // the short index's n-gram length
    std::vector<int32_t> indexed_;                // tokens indexed so far (a prefix of history)
    Index short_, long_;
};

// ngram-mod: llama.cpp's common_ngram_mod table (hash of n tokens -> the token after them).
class NgramPool : public ContextSource {
  public:
    int index() const override { return 2; }
    int spec_bit() const override { return kSpecNgramMod; }
    void begin(const std::vector<int32_t> & history, const NgramParams & p) override { add(history, p); }
    // Add the n-grams of history not yet added (history extends what was added, else all again).
    void add(const std::vector<int32_t> & history, const NgramParams & p);
    ContextDraft draft(const std::vector<int32_t> & history, const NgramParams & p, int k_max) override;
    void clear() override;
    static constexpr size_t kEntries = (size_t) 4 << 20;

  private:
    size_t idx(const int32_t * t) const;
    int n_ = 0;
    size_t used_ = 0;
    std::vector<int32_t> table_;
    std::vector<int32_t> added_;   // the sequence whose n-grams were added last (prefix check)
};

// P(a context draft is accepted | reached) by source and match length (bins 1..kBins, the last
// open-ended), from decayed counts with a prior that grows with the match length. Draft i of a
// match of m tokens is keyed m + i: it is reached only when the i drafts before it extended the
// match (a copy that held for a while tends to hold).
class ContextCalibration {
  public:
    double predict(int source, int match_len) const;
    void observe(int source, int match_len, bool accepted);
    static constexpr int kBins = 48;
    static constexpr double kPrior = 2.0, kDecay = 0.995;
  private:
    static int bin(int m);
    double reached_[kNumSources][kBins] = {}, accepted_[kNumSources][kBins] = {};
};

}  // namespace dflash2
