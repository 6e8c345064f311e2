// One interface for every drafting strategy (llama.cpp's common_speculative_impl at 0c1e570,
// common/speculative.cpp: begin with the prompt, then a draft per cycle): the DFlash block drafter
// (Drafter, drafter.h) and the context sources (context_drafter.h) implement it, and the
// engine asks each source its generation enables for a draft and keeps the one that promises the
// most expected tokens per millisecond (driver.cpp, Engine::step; draft_policy.h).
//
// Every draft a source returns is a DraftRow carrying exactly the distribution q its token was
// drawn from (a context source's drafts are point masses, q = 1), so the rejection rule verifies
// any source's drafts losslessly (acceptance.h).
#pragma once

#include "acceptance.h"
#include "sampling.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace dflash2 {

// Speculative types (llama.cpp's --spec-type names); a generation takes any set of them.
enum SpecType : int {
    kSpecDflash      = 1,  // "draft-dflash": the DFlash drafter GGUF
    kSpecNgramSimple = 2,  // "ngram-simple": prompt lookup by longest suffix match
    kSpecNgramMod    = 4,  // "ngram-mod": hashed n-gram pool shared across requests
};
constexpr int kNumSources = 3;          // stats index: 0 dflash, 1 ngram-simple, 2 ngram-mod
// The --spec-type name of a stats index ("?" out of range).
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

// Asked before draft i (0-based, counted over the whole cycle) is drawn, with the row's
// confidence (temperature-1 probability of its most likely allowed token); false ends the drafts
// there. Deciding before the draw keeps a variable draft length lossless at T > 0 (drafter.h).
using KeepDraft = std::function<bool(int i, float confidence)>;

// What a cycle asks of a source. The pointers are the engine's and outlive the call.
struct DraftRequest {
    const std::vector<int32_t> * history = nullptr;  // prompt + committed tokens, the anchor last
    int pos = 0;         // the anchor's position in the target's cache (drafts follow at pos + 1..)
    int k_max = 0;       // the most drafts, counted over the whole cycle (prefix included)
    // Drafts already chosen for this cycle (another source's, in front): a source that can
    // continue them (continues_drafts()) drafts after them; the rest ignore the request then.
    const std::vector<int32_t> * prefix = nullptr;
    const NgramParams * ngram = nullptr;          // context sources' parameters
    const SamplingOptions * sampling = nullptr;   // a model source draws under these
    const SamplerState * state = nullptr;         // the committed sampler state (grammar, penalties)
    Rng * rng = nullptr;                          // a model source's draws
    KeepDraft keep;                               // a model source asks it per draft (null: keep all)
};

// A source's drafts: rows[i] is the draft for position pos + 1 + prefix + i.
struct DraftResult {
    std::vector<DraftRow> rows;
    int match_len = 0;   // context sources: tokens of the context that matched (calibration key)
};

class DraftSource {
  public:
    virtual ~DraftSource() = default;
    virtual int index() const = 0;     // stats index (source_name)
    virtual int spec_bit() const = 0;  // the SpecType bit that enables it
    // True when drafting runs a model pass (its cost is CostModel::draft_ms); a context source's
    // lookup costs nothing the policy prices.
    virtual bool runs_model() const { return false; }
    // True when it can draft after another source's drafts (DraftRequest::prefix).
    virtual bool continues_drafts() const { return false; }
    // A generation starts from `history` (its prompt).
    virtual void begin(const std::vector<int32_t> & history, const NgramParams & p) { (void) history; (void) p; }
    // This cycle's drafts into `out` (cleared first); returns out.rows.size(). Throws Error on a
    // failed model pass.
    virtual int draft(const DraftRequest & r, DraftResult & out) = 0;
    // Forget everything learnt from earlier requests (the engine's caches were cleared).
    virtual void clear() = 0;
};

}  // namespace dflash2
