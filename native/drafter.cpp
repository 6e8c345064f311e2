// The drafter (see drafter.h).
#include "drafter.h"

#include "error.h"
#include "llama.h"
#include "llama_ext_pinned.h"
#include "pairing.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace dflash2 {

Drafter::Drafter(const DrafterOptions & o, llama_context * ctx_tgt, int n_vocab, int n_embd)
    : o_(o), n_vocab_(n_vocab), n_embd_(n_embd) {
    try {
        model_ = load_gguf(o.path, o.n_gpu_layers, o.repack, "drafter");
        if (llama_model_n_embd(model_) != n_embd || llama_vocab_n_tokens(llama_model_get_vocab(model_)) != n_vocab ||
            llama_model_dflash_selector_top_k(model_) != o.top_k) {
            throw Error(kErrIncompatible, "drafter model disagrees with its GGUF metadata");
        }
        mask_ = llama_vocab_mask(llama_model_get_vocab(model_));
        if (mask_ < 0 || mask_ >= n_vocab) throw Error(kErrIncompatible, "drafter has no tokenizer.ggml.mask_token_id");
        const bool causal = meta_str(model_, "dflash.attention.causal") == "true";
        n_ctx_ = o.n_ctx;
        n_ubatch_ = std::max(o.block_size, std::min(256, n_ctx_));
        llama_context_params dc = llama_context_default_params();
        dc.n_ctx = (uint32_t) n_ctx_;
        dc.n_batch = (uint32_t) n_ubatch_;
        dc.n_ubatch = (uint32_t) n_ubatch_;
        dc.n_seq_max = 1;
        dc.n_threads = o.n_threads;
        dc.n_threads_batch = o.n_threads;
        dc.flash_attn_type = (llama_flash_attn_type) o.flash_attn;
        dc.no_perf = true;
        if (o.kv_f32) { dc.type_k = GGML_TYPE_F32; dc.type_v = GGML_TYPE_F32; }
        dc.ctx_other = ctx_tgt;
        ctx_ = llama_init_from_model(model_, dc);
        if (!ctx_) throw Error(kErrLoad, "failed to create the drafter context");
        if (o.top_k > 0) llama_set_embeddings_nextn(ctx_, true, /*masked*/ false);
        llama_set_causal_attn(ctx_, causal);
        batch_ = llama_batch_ext_init(ctx_);
    } catch (...) {
        this->~Drafter();
        throw;
    }
}

Drafter::~Drafter() {
    if (batch_) { llama_batch_ext_free(batch_); batch_ = nullptr; }
    if (ctx_) { llama_free(ctx_); ctx_ = nullptr; }
    if (model_) { llama_model_free(model_); model_ = nullptr; }
}

void Drafter::inject(const float * feats, int n_rows, int width, int pos0) {
    for (int off = 0; off < n_rows; off += n_ubatch_) {
        const int n = std::min(n_ubatch_, n_rows - off);
        llama_batch_ext_clear(batch_);
        for (int i = 0; i < n; ++i) {
            llama_embd e = {feats + (size_t) (off + i) * width, 1, (size_t) width};
            const int idx = llama_batch_ext_add_embd(batch_, 0, e);
            if (idx < 0) throw Error(kErrInternal, "llama_batch_ext_add_embd failed (" + std::to_string(idx) + ")");
            const llama_pos p = pos0 + off + i;
            const llama_pos pa[4] = {p, p, p, 0};
            llama_batch_ext_set_pos(batch_, idx, pa);
        }
        const int rc = llama_process(ctx_, LLAMA_PROCESS_TYPE_DECODE, batch_);
        if (rc != 0) throw Error(kErrDecode, "drafter feature injection failed (rc " + std::to_string(rc) + ")", rc);
    }
}

void Drafter::run_block(int32_t anchor, int pos0, const std::vector<int32_t> & prefix) {
    if ((int) prefix.size() >= o_.block_size) throw std::invalid_argument("a block prefix fills the whole block");
    llama_batch_ext_clear(batch_);
    for (int i = 0; i < o_.block_size; ++i) {
        const int32_t t = i == 0 ? anchor : i <= (int) prefix.size() ? prefix[i - 1] : mask_;
        const int idx = llama_batch_ext_add_token(batch_, 0, t);
        if (idx < 0) throw Error(kErrInternal, "llama_batch_ext_add_token failed (" + std::to_string(idx) + ")");
        const llama_pos p = pos0 + i;
        const llama_pos pa[4] = {p, p, p, 0};
        llama_batch_ext_set_pos(batch_, idx, pa);
        llama_batch_ext_set_output_logits(batch_, idx, true);
    }
    const int rc = llama_process(ctx_, LLAMA_PROCESS_TYPE_DECODE, batch_);
    if (rc != 0) throw Error(kErrDecode, "drafter block pass failed (rc " + std::to_string(rc) + ")", rc);
    llama_synchronize(ctx_);
}

void Drafter::remove_from(int pos) { llama_memory_seq_rm(llama_get_memory(ctx_), 0, pos, -1); }

void Drafter::clear() { llama_memory_clear(llama_get_memory(ctx_), true); }

int Drafter::draft(const DraftRequest & r, DraftResult & out) {
    if (r.history == nullptr || r.history->empty() || r.sampling == nullptr || r.state == nullptr || r.rng == nullptr) {
        throw std::invalid_argument("the DFlash drafter needs history (the anchor last), sampling, state and rng");
    }
    static const std::vector<int32_t> none;
    static const KeepDraft keep_all = [](int, float) { return true; };
    out.match_len = 0;
    return draft(r.history->back(), r.pos, r.k_max, r.prefix ? *r.prefix : none, *r.sampling, *r.state, *r.rng,
                 r.keep ? r.keep : keep_all, out.rows);
}

int Drafter::draft(int32_t anchor, int pos0, int k_max, const std::vector<int32_t> & prefix, const SamplingOptions & so,
                   const SamplerState & state, Rng & rng, const KeepDraft & keep, std::vector<DraftRow> & out) {
    run_block(anchor, pos0, prefix);
    out.clear();
    const bool greedy = so.greedy();
    const int nd = o_.block_size - 1;
    const int m = (int) prefix.size();
    const int n_max = k_max - m;  // rows this walk may add
    SamplerState st = state;  // advanced with the drafts (grammar)
    if (st.has_grammar()) for (int32_t t : prefix) st.accept(t);
    if (o_.top_k > 0 && n_max > 0) {
        const int K = o_.top_k;
        const float * lat = llama_get_embeddings_nextn(ctx_);
        if (!lat) throw Error(kErrInternal, "DFlash 2 drafter produced no selector lattice");
        std::vector<int32_t> cand(K);
        int pred = 0;  // row 1's scores repeat the anchor's for every predecessor slot
        if (m > 0) {
            // continuing a prefix: the scores after its last token are those of that token's slot
            // among row m's candidates; a prefix that left the candidates has no path to continue
            const float * row = lat + (size_t) m * n_embd_;
            pred = -1;
            for (int b = 0; b < K && pred < 0; ++b) if ((int32_t) row[b] == prefix[m - 1]) pred = b;
        }
        for (int i = m + 1; pred >= 0 && i <= nd && (int) out.size() < n_max; ++i) {
            const float * row = lat + (size_t) i * n_embd_;
            const float * scores = row + K + (size_t) pred * K;
            for (int b = 0; b < K; ++b) cand[b] = (int32_t) row[b];
            st.allowed(cand.data(), K, ok_);
            float mx = -INFINITY;
            int best = -1;
            for (int b = 0; b < K; ++b) {
                if (ok_[b] && scores[b] > mx) { mx = scores[b]; best = b; }
            }
            if (best < 0) break;  // the grammar leaves no candidate
            DraftRow d;
            {  // confidence: temperature-1 probability of the best allowed candidate, BEFORE the draw
                double z = 0;
                for (int b = 0; b < K; ++b) if (ok_[b]) z += std::exp((double) scores[b] - mx);
                d.conf = (float) (1.0 / z);
                if (!keep(m + (int) out.size(), d.conf)) break;
            }
            int j = best;
            if (!greedy) {
                // q = softmax(S / T) over the allowed candidates
                d.q.assign(K, 0.0f);
                double z = 0;
                for (int b = 0; b < K; ++b) if (ok_[b]) z += std::exp(((double) scores[b] - mx) / so.temperature);
                for (int b = 0; b < K; ++b) if (ok_[b]) d.q[b] = (float) (std::exp(((double) scores[b] - mx) / so.temperature) / z);
                j = rng.draw(d.q);
                d.cand = cand;
            }
            d.token = cand[j];
            d.slot = j;
            out.push_back(std::move(d));
            if (st.has_grammar()) st.accept(cand[j]);
            pred = j;
        }
    } else if (n_max > 0) {
        for (int i = m + 1; i <= nd && (int) out.size() < n_max; ++i) {
            const float * lg = llama_get_logits_ith(ctx_, i);
            st.process(lg, n_vocab_, buf_, /*grammar*/ true);  // the target's bias / penalties / grammar
            DraftRow d;
            {  // confidence: temperature-1 probability of the most likely token, BEFORE the draw
                const float mx = *std::max_element(buf_.begin(), buf_.end());
                if (mx == -INFINITY) break;  // nothing allowed
                double z = 0;
                for (int v = 0; v < n_vocab_; ++v) z += std::exp((double) buf_[v] - mx);
                d.conf = (float) (1.0 / z);
                if (!keep(m + (int) out.size(), d.conf)) break;
            }
            int32_t t;
            if (greedy) {
                t = argmax(buf_.data(), n_vocab_);
            } else {
                truncated_probs(buf_.data(), n_vocab_, so, d.q);
                t = rng.draw(d.q);
            }
            if (t < 0 || buf_[t] == -INFINITY) break;  // nothing allowed
            d.token = t;
            d.slot = t;
            out.push_back(std::move(d));
            if (st.has_grammar()) st.accept(t);
        }
    }
    remove_from(pos0);  // drop the block's K/V
    return (int) out.size();
}

}  // namespace dflash2
