// The drafter (drafter.cpp): a dflash GGUF whose context borrows the target's embeddings and LM
// head (ctx_other = the target context). It holds the injected target features in its KV cache
// and drafts a block: [anchor, mask x (bs-1)] at P..P+bs-1 in one non-causal pass (causal only
// when the GGUF says so), then reads the drafts:
//   DFlash 2: walks the candidate-selector lattice (row i: top-k candidate ids, then scores of
//             every (predecessor slot, candidate) pair; row 1 repeats the anchor's scores); greedy
//             takes the best candidate after the previous one, sampling draws from
//             softmax(S / T) over the candidates (dflash 0.1.0 CandidateSelector.select);
//   DFlash 1: the draft logits of rows 1.., greedy or drawn from the processed distribution.
// With a grammar, candidates the grammar rejects get q = 0 (q renormalised over the rest) and the
// walk stops where none is left. Each DraftRow carries exactly the q its token was drawn from.
// The block's K/V is removed before returning (only injected features stay in the cache).
#pragma once

#include "acceptance.h"
#include "draft_source.h"
#include "sampling.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

struct llama_model;
struct llama_context;
struct llama_batch_ext;

namespace dflash2 {

struct DrafterOptions {
    std::string path;
    int n_ctx = 0, n_threads = 1, n_gpu_layers = 0, flash_attn = -1;
    bool repack = true, kv_f32 = false;
    int block_size = 0, top_k = 0;  // from the validated metadata
};

// The DFlash block drafter, a DraftSource (draft_source.h) that runs a model pass and can
// continue another source's drafts (they take the place of the first mask tokens).
class Drafter : public DraftSource {
  public:
    // Loads the model and creates its context on top of ctx_tgt. Throws Error(kErrLoad /
    // kErrIncompatible).
    Drafter(const DrafterOptions & o, llama_context * ctx_tgt, int n_vocab, int n_embd);
    ~Drafter();
    Drafter(const Drafter &) = delete;
    Drafter & operator=(const Drafter &) = delete;

    // Inject n_rows feature rows ([n_rows x width] floats) at positions pos0.. (batched by ubatch).
    void inject(const float * feats, int n_rows, int width, int pos0);
    // One block pass at pos0 (every row an output: flagging only some rows shifts
    // llama_get_logits_ith by one). The caller reads logits / lattice, then calls drop_block.
    // `prefix` (fewer than block_size tokens) takes the place of the first mask tokens.
    void run_block(int32_t anchor, int pos0, const std::vector<int32_t> & prefix = {});
    // Draft at most k_max tokens after `anchor` at position pos0 into `out` (cleared first).
    // `prefix`: drafts already chosen for block positions 1..m (context drafts, m < block_size):
    // the block pass sees them instead of mask tokens and the walk continues after them, from
    // the slot of the prefix's last token among row m's candidates (none there: no drafts), so
    // `out` receives at most k_max - m rows for positions m + 1.. (keep() is asked with the
    // overall index m + j).
    // `state`: the committed sampler state (grammar / bias / penalties, cloned here; may be
    // without grammar). Before drawing draft i (0-based) the walk computes the row's confidence
    // (temperature-1 probability of its most likely allowed token, given the drafts before it)
    // and asks keep(i, confidence); false ends the drafts there. Deciding before the draw is what
    // keeps a variable draft length lossless at T > 0: whether position i is verified may depend
    // on the drafts before it, never on draft i itself (a rule that looked at the drawn token,
    // e.g. its own probability, would bias the output). Returns the number of drafts.
    int draft(int32_t anchor, int pos0, int k_max, const std::vector<int32_t> & prefix, const SamplingOptions & so,
              const SamplerState & state, Rng & rng, const KeepDraft & keep, std::vector<DraftRow> & out);
    // The same through the DraftSource interface: r.history's last token is the anchor at r.pos;
    // r.prefix, r.k_max, r.sampling, r.state, r.rng and r.keep as above (sampling, state and rng
    // are required: std::invalid_argument otherwise). out.match_len stays 0.
    int draft(const DraftRequest & r, DraftResult & out) override;
    int index() const override { return 0; }
    int spec_bit() const override { return kSpecDflash; }
    bool runs_model() const override { return true; }
    bool continues_drafts() const override { return true; }
    // Remove cells >= pos from the drafter cache (the block, or rows past a cached prefix).
    void remove_from(int pos);
    // Empty the drafter cache (the injected features; the engine injects them again).
    void clear() override;

    llama_context * ctx() const { return ctx_; }
    int n_ctx() const { return n_ctx_; }
    int block_size() const { return o_.block_size; }
    int top_k() const { return o_.top_k; }
    int mask_token() const { return mask_; }

  private:
    DrafterOptions o_;
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    llama_batch_ext * batch_ = nullptr;
    int n_vocab_ = 0, n_embd_ = 0, n_ctx_ = 0, n_ubatch_ = 0, mask_ = -1;
    std::vector<float> buf_;
    std::vector<uint8_t> ok_;
};

}  // namespace dflash2
