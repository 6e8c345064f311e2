// The DFlash / DFlash 2 speculative decoding driver on libllama (see driver.cpp).
//
// One Engine owns a target model + context and, optionally, a dflash drafter model + context
// (the drafter's context has `ctx_other` = the target context, so it borrows the target's token
// embeddings and LM head). The whole draft -> verify -> accept -> roll back loop runs in C++;
// the binding (module.cpp) only converts types and releases the GIL.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

struct llama_model;
struct llama_context;
struct llama_batch_ext;

namespace dflash2 {

// Returns an empty string when the loaded libllama is the pinned build, otherwise a message that
// names what differs and how to fix it.
std::string check_libllama();

// Error categories carried by every Error (and by the Python exception it becomes).
enum ErrorCode : int {
    kErrLoad         = 1,  // a GGUF could not be read or loaded
    kErrIncompatible = 2,  // drafter/target pairing mismatch (vocab, hidden, layer ids, width)
    kErrUnsupported  = 3,  // a configuration this driver refuses (e.g. recurrent target)
    kErrDecode       = 4,  // llama_decode / llama_process returned non-zero (rc carried)
    kErrContextFull  = 5,  // prompt + generation does not fit the context
    kErrClosed       = 6,  // the engine was closed
    kErrInternal     = 7,  // an invariant of the driver failed
};

class Error : public std::runtime_error {
  public:
    Error(int code, const std::string & msg, int rc = 0) : std::runtime_error(msg), code_(code), rc_(rc) {}
    int code() const { return code_; }
    int rc() const { return rc_; }  // the libllama return code, when there is one
  private:
    int code_;
    int rc_;
};

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
};

// Sampling + loop parameters of one generation. Names follow llama-cpp-python.
struct GenParams {
    int      n_predict   = 128;
    float    temperature = 0.0f;   // <= 0: greedy
    int      top_k       = 0;      // <= 0: off
    float    top_p       = 1.0f;   // >= 1: off
    float    min_p       = 0.0f;   // <= 0: off
    uint64_t seed        = 0;
    int      n_draft_max = -1;     // drafts per cycle after the full block is drafted; -1: block-1
    float    p_min       = 0.0f;   // stop the walk at a draft whose probability is below p_min
    bool     use_drafter = true;
    bool     ignore_eog  = false;
    std::vector<std::string> stop; // stop strings (checked on the detokenized output)
    // TEST HOOK (negative control of the lossless test): accept a draft when u < p instead of
    // u * q < p. Never set it outside tests: the output distribution is then wrong.
    bool     wrong_acceptance_rule = false;
};

struct Stats {
    int64_t n_prompt      = 0;
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
};

// Tokens committed by one call to begin() (the prefill's first token) or step() (one cycle).
struct Chunk {
    std::vector<int32_t> tokens;
    std::vector<uint8_t> from_draft; // 1 = accepted draft, 0 = sampled by the target (bonus)
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
    bool has_drafter() const { return ctx_dft_ != nullptr; }
    int  block_size() const { return block_size_; }
    int  selector_top_k() const { return top_k_sel_; }
    int  n_vocab() const { return n_vocab_; }
    int  n_embd() const { return n_embd_; }
    int  n_ctx() const { return n_ctx_tgt_; }
    int  mask_token() const { return mask_token_; }
    std::string capture_path() const { return capture_; }
    std::string target_arch() const { return arch_tgt_; }
    std::vector<int32_t> target_layers() const { return lids_; }
    llama_model * target_model() const { return model_tgt_; }

    // Text helpers on the target vocabulary.
    std::vector<int32_t> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    std::string detokenize(const std::vector<int32_t> & tokens, bool special) const;
    std::string chat_template() const;  // "" when the GGUF has none
    bool is_eog(int32_t tok) const;

    // Parity hooks (tests): capture the drafter's target features of `tokens` from a fresh target
    // pass ([n x n_lids*n_embd] floats), and run one full-block draft pass on a fresh drafter
    // cache holding `features` at positions 0..n-1, block at n..n+bs-1 with `anchor`.
    std::vector<float> capture_features(const std::vector<int32_t> & tokens);
    DraftProbe draft_from_features(const std::vector<float> & features, int n_rows, int32_t anchor);
    // Target logits of every row of `tokens` from a fresh target pass ([n x n_vocab]).
    std::vector<float> target_logits(const std::vector<int32_t> & tokens);

    struct Capture;  // cb_eval capture state (driver.cpp)

  private:

    void require_open() const;
    void decode_target(const int32_t * toks, int n, int pos0, bool all_logits, bool want_features);
    const float * feature_row(int slot, int row) const;
    void inject(int row0, int n_rows, int pos0);
    void draft_block(int32_t anchor, int pos0);
    int  cycle_draft(int32_t anchor, int pos0, int k_max);
    void sample_target(const float * logits, std::vector<float> & probs) const;
    int32_t draw(const std::vector<float> & probs);
    double uniform();
    void push_commit(Chunk & c, int32_t tok, bool from_draft);

    EngineOptions opt_;
    llama_model *   model_tgt_ = nullptr;
    llama_model *   model_dft_ = nullptr;
    llama_context * ctx_tgt_   = nullptr;
    llama_context * ctx_dft_   = nullptr;
    ::llama_batch_ext * batch_dft_ = nullptr;
    std::unique_ptr<Capture> cap_;

    std::string arch_tgt_, capture_;
    int n_vocab_ = 0, n_embd_ = 0, n_layer_tgt_ = 0, n_ctx_tgt_ = 0, n_ctx_dft_ = 0;
    int n_batch_tgt_ = 0, n_ubatch_dft_ = 0;
    int block_size_ = 0, top_k_sel_ = 0, mask_token_ = -1;
    bool causal_dft_ = false;
    std::vector<int32_t> lids_;  // layer-input indices (HF id + 1), from dflash.target_layers

    // generation state
    GenParams gp_;
    Stats stats_;
    std::vector<int32_t> tokens_;  // prompt + committed
    int n_prompt_ = 0;
    int n_past_ = 0;               // tokens the target has in its KV cache
    bool active_ = false, done_ = false;
    uint64_t rng_[4] = {0, 0, 0, 0};
    std::string gen_text_;
    std::vector<uint8_t> gen_from_draft_;
    double t_begin_ = 0;

    // per-cycle scratch
    std::vector<int32_t> drafts_;
    std::vector<std::vector<float>> q_;      // v1: dense processed drafter dist per draft row
    std::vector<std::vector<int32_t>> qcand_;// v2: candidate ids per draft row
    std::vector<std::vector<float>> qprob_;  // v2: q over candidates per draft row
    std::vector<int> qsel_;                  // v2: chosen candidate slot per draft row
    std::vector<float> probs_, resid_, feat_;
};

}  // namespace dflash2
