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

#include "draft_source.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace dflash2 {

struct ContextDraft {
    std::vector<int32_t> tokens;
    int match_len = 0;       // tokens of the context that matched (the calibration key)
};

// A context source (DraftSource without a model pass): looks the context up and returns its
// drafts as point masses (q = 1 on the drafted token, DraftRow::cand = {token}, slot 0), with
// the match length the engine's ContextCalibration keys acceptance by.
class ContextSource : public DraftSource {
  public:
    // r.history, r.ngram and r.k_max are read; a request with a prefix gets no drafts (a
    // context source does not continue another source's drafts).
    int draft(const DraftRequest & r, DraftResult & out) final;
    // The lookup itself: at most k_max tokens after `history` (prompt + committed, anchor last).
    virtual ContextDraft lookup(const std::vector<int32_t> & history, const NgramParams & p, int k_max) = 0;
};

// ngram-simple: the context's own n-gram index, rebuilt when a request's prompt does not extend
// the indexed tokens, extended as tokens are committed.
class PromptLookup : public ContextSource {
  public:
    int index() const override { return 1; }
    int spec_bit() const override { return kSpecNgramSimple; }
    ContextDraft lookup(const std::vector<int32_t> & history, const NgramParams & p, int k_max) override;
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
    ContextDraft lookup(const std::vector<int32_t> & history, const NgramParams & p, int k_max) override;
    void clear() override;
    static constexpr size_t kEntries = (size_t) 4 << 20;

  private:
    size_t idx(const int32_t * t) const;
    int n_ = 0;
    size_t used_ = 0;
    std::vector<int32_t> table_;
    std::vector<int32_t> added_;   // the sequence whose n-grams were added last (prefix check)
};

// P(a context draft is accepted | reached) by source and match length, from decayed counts with a
// prior that grows with the match length. Draft i of a match of m tokens is keyed m + i: it is
// reached only when the i drafts before it extended the match (a copy that held for a while tends
// to hold). The bins are one per length up to 4, then about two per doubling up to kEdges' last
// (open-ended): a long copy is verified a few dozen tokens at a time, so each length past ~16 is
// seen once per copy, and only wide bins gather the evidence that it goes on (acceptance 0.99 and
// more), which is what makes verifying 48 drafts at once pay. From kChainFrom tokens on, a bin's
// prior is at least the estimate of the bin below it: a copy that held for 40 tokens holds at
// least as well as one that held for 12, so the lengths a copy has not reached yet start where
// the shorter ones stand (a longer bin's own rejections still pull it down). After a copy
// accepted at every length from 12 to 40, the chooser verifies 47 drafts at a 41-token match on
// Qwen2.5-Coder-1.5B's cost curve, where each bin on its own prior gives 7 (code edits 42 vs 37
// tok/s in a same-process A/B, 6 prompts run twice on each).
class ContextCalibration {
  public:
    double predict(int source, int match_len) const;
    void observe(int source, int match_len, bool accepted);
    // A new request: what earlier requests taught is kept as a prior worth at most kCarried
    // drafts per bin (their acceptance rate, weaker), since another text may copy another way.
    void new_request();
    static constexpr double kCarried = 4.0;
    static constexpr int kBins = 17;
    // the shortest match length of each bin
    static constexpr int kEdges[kBins] = {1, 2, 3, 4, 5, 7, 9, 12, 16, 23, 32, 45, 64, 91, 128, 181, 256};
    static constexpr double kPrior = 2.0, kDecay = 0.995;
    static constexpr int kChainFrom = 12;
  private:
    static int bin(int m);
    double reached_[kNumSources][kBins] = {}, accepted_[kNumSources][kBins] = {};
};

}  // namespace dflash2
