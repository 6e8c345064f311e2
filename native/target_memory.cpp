// Cutting the target's memory back (see target_memory.h).
#include "target_memory.h"

#include "error.h"
#include "llama.h"

#include <algorithm>

namespace dflash2 {

const char * rollback_name(Rollback r) {
    switch (r) {
        case Rollback::kKv: return "kv";
        case Rollback::kNative: return "native";
        case Rollback::kCheckpoint: return "checkpoint";
    }
    return "?";
}

namespace {
bool has_recurrent_state(const llama_model * m) { return llama_model_is_recurrent(m) || llama_model_is_hybrid(m); }
}  // namespace

void TargetMemory::configure(const llama_model * m, int n_rollback_max, llama_context_params & cp) {
    if (has_recurrent_state(m) && n_rollback_max > 0) cp.n_rs_seq = (uint32_t) n_rollback_max;
}

TargetMemory::TargetMemory(llama_context * ctx, const llama_model * m, int n_rollback_max) : ctx_(ctx) {
    recurrent_ = has_recurrent_state(m);
    n_swa_ = std::max(0, (int) llama_model_n_swa(m));
    if (recurrent_) {
        n_rs_ = (int) llama_n_rs_seq(ctx);
        rollback_ = n_rs_ >= n_rollback_max && n_rollback_max > 0 ? Rollback::kNative : Rollback::kCheckpoint;
    }
}

size_t TargetMemory::snapshot_bytes() const {
    return recurrent_ ? llama_state_seq_get_size_ext(ctx_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) : 0;
}

std::vector<uint8_t> TargetMemory::save_partial() const {
    std::vector<uint8_t> buf(llama_state_seq_get_size_ext(ctx_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY));
    const size_t n = llama_state_seq_get_data_ext(ctx_, buf.data(), buf.size(), 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    if (n == 0) throw Error(kErrInternal, "llama_state_seq_get_data_ext saved no target state");
    buf.resize(n);
    return buf;
}

void TargetMemory::restore_partial(const std::vector<uint8_t> & data) const {
    if (llama_state_seq_set_data_ext(ctx_, data.data(), data.size(), 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == 0) {
        throw Error(kErrInternal, "libllama refused a saved target state (llama_state_seq_set_data_ext)");
    }
}

void TargetMemory::before_verify(int P, int k) {
    verify_pos_ = -1;
    if (rollback_ != Rollback::kCheckpoint || k <= 0) return;
    // reuse the buffer: a state is the same size every cycle
    const size_t sz = llama_state_seq_get_size_ext(ctx_, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    verify_ckpt_.resize(sz);
    const size_t n = llama_state_seq_get_data_ext(ctx_, verify_ckpt_.data(), sz, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    if (n == 0) throw Error(kErrInternal, "llama_state_seq_get_data_ext saved no target state");
    verify_ckpt_.resize(n);
    verify_pos_ = P;
}

int TargetMemory::cut_after_verify(int P, int keep, int end) {
    if (keep >= end) return 0;
    llama_memory_t mem = llama_get_memory(ctx_);
    if (rollback_ == Rollback::kCheckpoint) {
        if (verify_pos_ != P) throw Error(kErrInternal, "no target checkpoint for this verify pass");
        restore_partial(verify_ckpt_);
        if (!llama_memory_seq_rm(mem, 0, P, -1)) throw Error(kErrInternal, "target seq_rm after a checkpoint restore failed");
        return keep - P;
    }
    if (!llama_memory_seq_rm(mem, 0, keep, -1)) {
        throw Error(kErrInternal, std::string("the target's memory refused to drop ") + std::to_string(end - keep) +
                                      " rejected tokens (" + rollback_name(rollback_) + " rollback)");
    }
    return 0;
}

bool TargetMemory::window_ok(int pos) const {
    if (n_swa_ <= 0) return true;
    if (pos <= 0) return true;
    const llama_pos pmin = llama_memory_seq_pos_min(llama_get_memory(ctx_), 0);
    return pmin >= 0 && pmin <= std::max(0, pos - n_swa_);
}

int TargetMemory::usable_prefix(int n_held, int want, const std::vector<StateCheckpoint> & ck, bool live) const {
    if (!needs_prompt_checkpoints() || want >= n_held) return std::min(want, n_held);
    if (live && !recurrent_ && window_ok(want)) return want;
    int best = 0;
    for (const auto & c : ck) {
        if (c.pos <= want) best = std::max(best, c.pos);
    }
    return best;
}

void TargetMemory::cut_to(int pos, int n_held) {
    llama_memory_t mem = llama_get_memory(ctx_);
    if (pos < n_held) {
        if (pos == 0) {
            llama_memory_seq_rm(mem, 0, -1, -1);
        } else if (!recurrent_ && window_ok(pos)) {
            if (!llama_memory_seq_rm(mem, 0, pos, -1)) throw Error(kErrInternal, "target seq_rm of a cached tail failed");
        } else {
            auto it = std::find_if(ckpts_.begin(), ckpts_.end(), [&](const StateCheckpoint & c) { return c.pos == pos; });
            if (it == ckpts_.end()) throw Error(kErrInternal, "no target checkpoint at position " + std::to_string(pos));
            restore_partial(it->data);
            if (!llama_memory_seq_rm(mem, 0, pos, -1)) throw Error(kErrInternal, "target seq_rm after a checkpoint restore failed");
        }
    }
    ckpts_.erase(std::remove_if(ckpts_.begin(), ckpts_.end(), [&](const StateCheckpoint & c) { return c.pos > pos; }),
                 ckpts_.end());
}

void TargetMemory::save_checkpoint(int pos) {
    if (!needs_prompt_checkpoints() || pos <= 0) return;
    ckpts_.erase(std::remove_if(ckpts_.begin(), ckpts_.end(), [&](const StateCheckpoint & c) { return c.pos >= pos; }),
                 ckpts_.end());
    if ((int) ckpts_.size() >= kMaxCheckpoints) ckpts_.erase(ckpts_.begin() + 1);  // keep the first (a shared system prompt)
    ckpts_.push_back({pos, save_partial()});
}

size_t TargetMemory::checkpoint_bytes() const {
    size_t b = 0;
    for (const auto & c : ckpts_) b += c.data.size();
    return b;
}

}  // namespace dflash2
