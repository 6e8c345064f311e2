// How the target's memory is cut back: after a verify pass (rejected drafts) and when a prompt
// reuses a cached prefix (target_memory.cpp).
//
// A plain KV cache drops any tail with llama_memory_seq_rm. Targets with a recurrent state
// (llama_model_is_recurrent / llama_model_is_hybrid: Mamba, RWKV, Qwen3.5's Gated DeltaNet layers,
// LFM2's short convolutions, ...) cannot: the state after token t is overwritten by token t + 1.
// llama.cpp 0c1e570 offers two ways back, and this unit picks one after the target context exists:
//
//   native      llama_context_params.n_rs_seq = the most drafts a cycle verifies: the recurrent
//               memory keeps a per-token snapshot of the state for the last n_rs_seq tokens of the
//               last decoded batch, and seq_rm of up to that many trailing tokens restores one
//               (src/llama-memory-recurrent.cpp, seq_rm; the archs of llm_arch_supports_rs_rollback
//               in src/llama-arch.cpp). libllama sets n_rs_seq to 0 for the others, so the choice
//               is read back with llama_n_rs_seq() (common/common.cpp common_context_can_seq_rm).
//   checkpoint  the sequence's recurrent (and sliding-window) state is copied before a verify pass
//               (llama_state_seq_get_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), restored
//               when a draft is rejected, and the accepted tokens are decoded again; the attention
//               KV tail is removed with seq_rm as usual (tools/server/server-context.cpp,
//               use_ckpt_tgt).
//   kv          neither is needed (no recurrent state).
//
// Sliding-window attention (gemma3, gpt-oss, ...) needs nothing after a verify pass: the cells a
// verify pass may overwrite are those already masked for its first row (llama_kv_cache::find_slot
// masks against the sequence's max position before the batch), and the rows after any rollback
// sit later still. A prompt that reuses a prefix far back, though, may need cells that later tokens
// overwrote, so such targets keep prompt checkpoints like recurrent ones.
//
// Prompt checkpoints (llama-server's --ctx-checkpoints): the partial state after tokens [0, pos),
// kept for the live sequence (and with RAM-cache entries), so that a later prompt sharing a prefix
// restores the latest checkpoint at or before the shared length instead of prefilling everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

struct llama_context;
struct llama_context_params;
struct llama_model;

namespace dflash2 {

enum class Rollback { kKv, kNative, kCheckpoint };
const char * rollback_name(Rollback r);

// The partial state (recurrent / sliding-window) of sequence 0 after tokens [0, pos).
struct StateCheckpoint {
    int pos = 0;
    std::vector<uint8_t> data;
};

class TargetMemory {
  public:
    // Before the target context exists: request n_rs_seq = n_rollback_max snapshots when the target
    // has a recurrent state (nothing otherwise).
    static void configure(const llama_model * m, int n_rollback_max, llama_context_params & cp);
    // After: decide the mechanism (native when libllama kept n_rs_seq >= n_rollback_max).
    TargetMemory(llama_context * ctx, const llama_model * m, int n_rollback_max);

    Rollback rollback() const { return rollback_; }
    // The most drafts a verify pass may hold: native rollback's n_rs_seq, else no limit.
    int max_drafts() const { return rollback_ == Rollback::kNative ? n_rs_ : (1 << 30); }
    bool recurrent() const { return recurrent_; }
    int n_swa() const { return n_swa_; }
    // True when a prefix of the cached sequence cannot always be kept by cutting its tail
    // (recurrent state or sliding window): prompt reuse goes through checkpoints.
    bool needs_prompt_checkpoints() const { return recurrent_ || n_swa_ > 0; }
    // One copy of the sequence's recurrent state now (what a checkpoint holds; 0 without one).
    size_t snapshot_bytes() const;

    // --- verify passes
    // Before a pass that verifies k drafts at position P (checkpoint mode, k > 0: saves the state).
    void before_verify(int P, int k);
    // After it: keep positions [0, keep). Returns the number of leading rows of the verify pass
    // (from P) that the caller must decode again (checkpoint mode after a rejection), else 0.
    // Throws Error(kErrInternal) when libllama refuses the cut (the state would be wrong).
    int cut_after_verify(int P, int keep, int end);

    // --- prompt reuse
    // The longest prefix <= want that the memory can be brought back to, from a state holding
    // n_held tokens whose checkpoints are `ck` (want is already bounded by the common prefix).
    // `live`: that state is the one in the context now (a sliding window can then be checked).
    int usable_prefix(int n_held, int want, const std::vector<StateCheckpoint> & ck, bool live) const;
    // Bring the live sequence (n_held tokens) back to exactly `pos` (a value usable_prefix gave
    // for the live checkpoints): cut the tail, restoring a checkpoint when needed. Checkpoints past
    // pos are dropped.
    void cut_to(int pos, int n_held);
    // Save a checkpoint of the live state, which holds `pos` tokens (prompt checkpoints; at most
    // kMaxCheckpoints, the oldest beyond the first dropped).
    void save_checkpoint(int pos);
    std::vector<StateCheckpoint> & checkpoints() { return ckpts_; }
    size_t checkpoint_bytes() const;
    static constexpr int kMaxCheckpoints = 32;  // llama-server --ctx-checkpoints default

    // Partial state of the live sequence (for checkpoints and cost measurements).
    std::vector<uint8_t> save_partial() const;
    void restore_partial(const std::vector<uint8_t> & data) const;

  private:
    llama_context * ctx_ = nullptr;
    Rollback rollback_ = Rollback::kKv;
    bool recurrent_ = false;
    int n_swa_ = 0;
    int n_rs_ = 0;                      // llama_n_rs_seq of the context
    std::vector<uint8_t> verify_ckpt_;  // checkpoint mode: the state before the last verify pass
    int verify_pos_ = -1;               // its position (-1: none)
    std::vector<StateCheckpoint> ckpts_;
    bool window_ok(int pos) const;      // sliding window: cells [pos - n_swa, pos) still held
};

}  // namespace dflash2
