// The DFlash / DFlash 2 speculative decoding driver on libllama (see driver.cpp).
//
// One Engine owns a target model + context and, optionally, a Drafter (drafter.h: a dflash model
// + context whose `ctx_other` is the target context, so it borrows the target's token embeddings
// and LM head). The whole draft -> verify -> accept -> roll back loop runs in C++, from units
// listed at the top of driver.cpp; the binding (module.cpp) only converts types and releases the
// GIL. State kept across generations: the prompt cache (both caches' contents, the RAM cache),
// the cost model, the acceptance calibration and the drafter gate.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "error.h"
#include "acceptance.h"
#include "capture.h"
#include "context_drafter.h"
#include "draft_policy.h"
#include "drafter.h"
#include "prompt_cache.h"
#include "sampling.h"
#include "target_memory.h"

struct llama_model;
struct llama_context;
struct llama_batch_ext;

namespace dflash2 {

// Returns an empty string when the loaded libllama is the pinned build, otherwise a message that
// names what differs and how to fix it.
std::string check_libllama();

// The most context drafts a cycle verifies on a recurrent target with native rollback: each
// verified draft costs one recurrent-state snapshot (libllama's n_rs_seq).
constexpr int kRecurrentContextDrafts = 16;

// Construction options. Sizes are in tokens; n_gpu_layers as in llama.cpp (-1 = all).
struct EngineOptions {
    std::string target_path;
    std::string drafter_path;       // empty: target alone (same code path, no drafts)
    int  n_ctx              = 4096; // target context
    int  n_ctx_draft        = 0;    // 0: same as the target
    int  n_batch            = 512;  // target logical batch (prefill chunk)
    int  n_threads          = 0;    // 0: hardware concurrency
    int  n_threads_draft    = 0;    // 0: same as n_threads
    int  n_gpu_layers       = 0;
    int  n_gpu_layers_draft = 0;
    int  flash_attn         = -1;   // -1 auto, 0 off, 1 on (both contexts)
    bool kv_f32_draft       = false;// F32 drafter K/V cache (parity tests); default F16
    bool repack             = true; // llama.cpp --repack: CPU weight repacking (use_extra_bufts), both models
    std::string capture     = "auto"; // "auto" | "layer_inp" | "cb_eval"
    int  context_draft_max  = 64;   // the most context drafts a cycle verifies (context_drafter.h;
                                    // llama.cpp's --spec-ngram-mod-n-max default); a recurrent target
                                    // keeps max(min(this, kRecurrentContextDrafts), block - 1) state
                                    // snapshots and verifies at most that many drafts a cycle
    bool swa_full           = false;// llama.cpp --swa-full: a sliding-window target keeps every cell
                                    // (off: n_swa + n_batch cells, as llama-server; target_memory.h)
    int64_t cache_ram_mib   = 1024; // RAM prompt cache (llama-server --cache-ram): saved prefixes
                                    // (target KV + drafter state), MiB; 0 = off
};

// Loop parameters of one generation; the sampling options are one SamplingOptions (sampling.h).
struct GenParams {
    SamplingOptions sampling;
    int      n_predict   = 128;
    int      n_draft_max = -1;
    int      n_draft_min = 0;      // when the drafter runs, verify at least this many drafts (llama.cpp
                                   // --spec-draft-n-min): a floor under the adaptive choice     // drafts per cycle after the full block is drafted; -1: block-1
    float    p_min       = 0.0f;   // stop the walk at a row whose top probability (before the draw) is below p_min
    bool     use_drafter = true;
    bool     ignore_eog  = false;
    bool     cache_prompt = true;  // reuse the longest common prefix with the cached state
    bool     adaptive    = true;   // choose k per cycle (draft_policy.h); false: always n_max
    int      spec_types  = kSpecDflash;  // SpecType bits (context_drafter.h): which sources may draft
    // How drafts are accepted at T > 0 (greedy is the same either way):
    //   kAcceptRejection: rejection sampling with the drafts' q (acceptance.h): the target's
    //     distribution, more drafts accepted; a seed gives another text than the target alone.
    //   kAcceptTargetSample: llama-server's rule: each verify row draws the target's own token
    //     (one draw per committed token, as the target alone) and a draft is accepted only when
    //     it equals it; a seed gives the target-alone text, token for token.
    int      accept_mode = 0;
    // llama-server's --context-shift: when the context fills, drop n_discard tokens after the
    // first n_keep (-1: the whole prompt; a BOS is kept on top) and move the rest down, in the
    // target's and the drafter's caches; n_discard 0: half of what follows n_keep.
    bool     context_shift = false;
    int      n_keep      = 0;
    int      n_discard   = 0;
    NgramParams ngram;             // the context sources' parameters
    std::vector<std::string> stop; // stop strings (checked on the detokenized output)
    // TEST HOOK (negative controls of the lossless tests, acceptance.h TestFault). Never set it
    // outside tests: the output distribution is then wrong.
    int      test_fault = 0;
};

struct Stats {
    int64_t n_prompt      = 0;
    int64_t n_cached      = 0;  // prompt tokens reused from the prompt cache (not prefilled)
    int64_t n_cache_restored = 0; // of those, tokens restored from the RAM cache (0: the live cache)
    int64_t n_generated   = 0;  // committed tokens (including EOG when it ended the output)
    int64_t n_cycles      = 0;  // target verify passes after the prefill
    int64_t n_committed_cycles = 0; // tokens committed by those passes (accepted + bonus)
    int64_t n_drafted     = 0;  // drafts sent to verification (after n_max / p_min truncation)
    int64_t n_accepted    = 0;
    std::vector<int64_t> pos_reached;   // [i]: cycles in which draft i was verified with all earlier accepted
    std::vector<int64_t> pos_accepted;  // [i]: cycles in which draft i was accepted
    double t_prefill_ms   = 0;  // target prefill + its feature injection
    double t_target_ms    = 0;  // target verify passes (decode + logits)
    double t_draft_ms     = 0;  // drafter block passes + lattice walk / draft sampling
    double t_inject_ms    = 0;  // drafter feature injection after each cycle
    double t_sample_ms    = 0;  // acceptance + target sampling on the host
    double t_total_ms     = 0;  // begin() to the last step()
    std::string stop_reason;    // "length" | "eog" | "stop" | "context" | ""
    // adaptive draft length (draft_policy.h)
    std::vector<int64_t> k_hist;  // [k]: cycles that verified k drafts
    int64_t n_drafter_skipped = 0; // cycles that did not run the drafter (gate closed)
    double predicted_tokens = 0, predicted_ms = 0;  // sums over cycles, from the cost model
    double measured_ms = 0;     // wall time of those cycles (draft + verify + accept + inject)
    // rolling the target back (target_memory.h)
    std::string rollback;       // "kv" | "native" | "checkpoint"
    int64_t n_rollbacks = 0;    // cycles that dropped rejected drafts from the target's memory
    int64_t n_redecoded = 0;    // tokens decoded again after a checkpoint restore
    double t_rollback_ms = 0;   // checkpoint copies, restores, re-decodes and seq_rm calls
    int64_t n_checkpoints = 0;  // prompt checkpoints held after this generation
    int64_t n_ctx_shifts = 0;   // context shifts (GenParams::context_shift)
    // per draft source (draft_source.h source_name: 0 dflash, 1 ngram-simple, 2 ngram-mod)
    int64_t src_cycles[kNumSources] = {};    // cycles whose drafts came from the source
    int64_t src_drafted[kNumSources] = {};   // drafts it sent to verification
    int64_t src_accepted[kNumSources] = {};  // of those, accepted
    int64_t n_continued = 0;  // cycles whose context drafts the DFlash block continued (rows
                              // counted per source above: the context's, then draft-dflash's)
};

// Tokens committed by one call to begin() (the prefill's first token) or step() (one cycle).
struct Chunk {
    std::vector<int32_t> tokens;
    std::vector<uint8_t> from_draft; // 1 = accepted draft, 0 = sampled by the target (bonus)
    std::vector<TokenLogprob> logprobs; // per token when SamplingOptions::n_probs > 0
    bool done = false;
};

// Parity hook: one full-block draft pass from given features (see Engine::draft_from_features).
struct DraftProbe {
    int n_rows = 0, n_vocab = 0, n_embd = 0;
    std::vector<float> logits;    // [n_rows x n_vocab], block rows 0..bs-1 (row 0 = anchor)
    std::vector<float> lattice;   // [n_rows x n_embd] (DFlash 2 only; empty for v1)
    std::vector<int32_t> greedy;  // bs-1 greedy drafts (v1: argmax of rows 1..; v2: lattice walk)
};

class Engine {
  public:
    explicit Engine(const EngineOptions & opt);
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    void close();  // frees contexts then models; safe to call twice
    bool closed() const { return ctx_tgt_ == nullptr; }

    // Generation, step-wise: begin() prefills and returns the first token; each step() runs one
    // draft + verify cycle. generate() loops in C++ and calls on_chunk (if set) after each.
    Chunk begin(const std::vector<int32_t> & prompt, const GenParams & gp);
    Chunk step();
    std::vector<int32_t> generate(const std::vector<int32_t> & prompt, const GenParams & gp,
                                  const std::function<bool(const Chunk &)> & on_chunk);
    const Stats & stats() const { return stats_; }
    // Per generated token of the current/last generation: 1 = accepted draft, 0 = target sample.
    const std::vector<uint8_t> & from_draft() const { return gen_from_draft_; }

    // Introspection.
    bool has_drafter() const { return dft_ != nullptr; }
    int  block_size() const { return block_size_; }
    int  selector_top_k() const { return top_k_sel_; }
    int  n_vocab() const { return n_vocab_; }
    int  n_embd() const { return n_embd_; }
    int  n_ctx() const { return n_ctx_tgt_; }
    int  mask_token() const { return mask_token_; }
    std::string capture_path() const { return capture_; }
    // How rejected drafts leave the target's memory: "kv", "native" (recurrent-state snapshots,
    // n_rs_seq) or "checkpoint" (state copy, restore, re-decode); see target_memory.h.
    std::string rollback_mode() const { return mem_ ? rollback_name(mem_->rollback()) : "kv"; }
    bool recurrent_target() const { return mem_ && mem_->recurrent(); }
    int n_swa() const { return mem_ ? mem_->n_swa() : 0; }
    // Bytes of one copy of the target's recurrent state (a checkpoint; native rollback keeps
    // n_rs_seq more of them), 0 without one.
    size_t recurrent_state_bytes() const { return mem_ ? mem_->snapshot_bytes() : 0; }
    std::string target_arch() const { return arch_tgt_; }
    std::vector<int32_t> target_layers() const { return lids_; }
    llama_model * target_model() const { return model_tgt_; }
    // Cost model of the adaptive draft length: measured here (reps passes per row count after a
    // short synthetic prompt; clears the caches), or set from a saved measurement; both update
    // online as cycles run.
    CostModel measure_costs(int reps);
    // Row counts the cost model covers (1..cost_rows()): a DFlash block and the longest context
    // draft (EngineOptions::context_draft_max) + its anchor, the latter as far as n_ctx allows.
    // A cycle verifies at most cost_rows() - 1 drafts when the policy is adaptive.
    int cost_rows() const;
    void set_cost_model(const CostModel & c) { cost_ = c; }
    const CostModel & cost_model() const { return cost_; }
    // What the adaptive policy learnt (calibration counts, gate), to start a later process with.
    AcceptanceCalibration & calibration() { return calib_; }
    DraftGate & gate() { return gate_; }
    // Prompt cache: tokens the target holds now, and the RAM cache's entries / bytes.
    int n_cached_tokens() const { return n_past_; }
    const PromptCache * prompt_cache() const { return cache_.get(); }

    // Text helpers on the target vocabulary.
    std::vector<int32_t> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string detokenize(const std::vector<int32_t> & tokens, bool special) const;
    // What llama-server's common_chat_templates_init reads of the target (common/chat.cpp at
    // 0c1e570): its chat templates, the BOS / EOS pieces (special tokens rendered) and whether
    // the tokenizer adds BOS / EOS itself.
    struct ChatInfo {
        bool has_template = false, has_tool_use = false;
        std::string chat_template, tool_use_template, bos, eos;
        bool add_bos = false, add_eos = false;
    };
    ChatInfo chat_info() const;
    bool is_eog(int32_t tok) const;

    // Parity hooks (tests): capture the drafter's target features of `tokens` from a fresh target
    // pass ([n x n_lids*n_embd] floats), and run one full-block draft pass on a fresh drafter
    // cache holding `features` at positions 0..n-1, block at n..n+bs-1 with `anchor`.
    std::vector<float> capture_features(const std::vector<int32_t> & tokens);
    DraftProbe draft_from_features(const std::vector<float> & features, int n_rows, int32_t anchor);
    // Target logits of every row of `tokens` from a fresh target pass ([n x n_vocab]).
    std::vector<float> target_logits(const std::vector<int32_t> & tokens);

  private:
    void require_open() const;
    void decode_target(const int32_t * toks, int n, int pos0, bool all_logits, bool want_features);
    void inject_rows(int row0, int n_rows, int pos0);  // last target pass's features -> drafter
    int  reuse_prefix(const std::vector<int32_t> & prompt);
    void forget_cache();
    void commit(Chunk & c, int32_t tok, bool from_draft, const float * raw_logits);
    const std::vector<float> & row_probs(int row, const SamplerState & st, bool penalties);
    int32_t greedy_token(const float * raw, const SamplerState & st);
    int32_t sample_row(int row, const SamplerState & st);

    EngineOptions opt_;
    llama_model *   model_tgt_ = nullptr;
    llama_context * ctx_tgt_   = nullptr;
    std::unique_ptr<FeatureCapture> cap_;
    std::unique_ptr<Drafter> dft_;
    std::unique_ptr<PromptCache> cache_;
    std::unique_ptr<TargetMemory> mem_;

    std::string arch_tgt_, capture_;
    int n_vocab_ = 0, n_embd_ = 0, n_layer_tgt_ = 0, n_ctx_tgt_ = 0, n_ctx_dft_ = 0;
    int n_batch_tgt_ = 0;
    int block_size_ = 0, top_k_sel_ = 0, mask_token_ = -1;
    std::vector<int32_t> lids_;  // layer-input indices (HF id + 1), from dflash.target_layers

    // cached state (kept across generations: the prompt cache)
    std::vector<int32_t> tokens_;  // prompt + committed; tokens_[0, n_past_) are in the target KV
    int n_past_ = 0;               // tokens the target has in its KV cache
    int n_dft_valid_ = 0;          // leading positions whose features the drafter holds

    // generation state
    GenParams gp_;
    Stats stats_;
    SamplerState state_;           // committed text: penalty window + grammar
    Rng rng_;
    Rng rng_draft_;                // the drafter's draws under kAcceptTargetSample (rng_ stays the target's)
    int n_prompt_ = 0;
    bool active_ = false, done_ = false;
    std::string gen_text_;
    std::vector<uint8_t> gen_from_draft_;
    std::vector<int32_t> gen_tokens_;  // this generation's committed tokens (tokens_ loses some to a context shift)
    void shift_context();
    double t_begin_ = 0;

    // draft sources (draft_source.h): the DFlash drafter (when loaded) and the context sources
    PromptLookup lookup_;
    NgramPool pool_;               // shared across generations (llama.cpp shares it across a slot's)
    std::vector<DraftSource *> sources_;  // dft_ (if loaded), &lookup_, &pool_; set by the constructor
    DraftResult src_out_;          // per-cycle scratch of a source's drafts
    ContextCalibration ctx_calib_;
    std::vector<double> ctx_acc_;  // the chosen context drafts' predicted acceptance
    // DFlash cycles' expected tokens and drafts (EMA; -1: none yet), to price continuing context
    // drafts with the block (Engine::step)
    double dfl_tokens_ = -1.0, dfl_k_ = -1.0;
    int context_drafts(int k_cap, bool adaptive, int & source, int & match_len, double & rate);

    // adaptive draft length
    CostModel cost_;
    AcceptanceCalibration calib_;
    DraftGate gate_;
    std::vector<float> pending_;   // features of rows not yet injected: positions n_dft_valid_..
    int n_pending_ = 0;            // (kept across generations, like the injected ones)
    static constexpr size_t kMaxPendingBytes = (size_t) 256 << 20;
    void flush_pending();
    void add_pending(int row0, int n);
    void truncate_features(int n);

    // per-cycle scratch
    std::vector<DraftRow> drafts_;
    std::vector<float> probs_, logits_, lp_, feat_;
    std::vector<uint8_t> ok_;
};

}  // namespace dflash2
