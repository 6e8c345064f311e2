// The DFlash / DFlash 2 speculative decoding driver on libllama.
//
// The loop (shape of mlx-lm's speculative_generate_step, mechanics of llama.cpp 0c1e570's
// common/speculative.cpp `draft-dflash`, acceptance of dflash 0.1.0's `_rejection_sample`):
//
//   begin:  prefill the target with the prompt while capturing the drafter's target features
//           (layer inputs lid = HF id + 1, or l_out-{lid-1} through cb_eval); inject them into the
//           drafter cache at their positions; sample the first token from the target.
//   step:   anchor = last committed token (not yet in the target cache), at position P.
//           1. draft the FULL trained block [anchor, mask x (bs-1)] at P..P+bs-1 (non-causal
//              unless the GGUF says causal), read drafts (v1: logits rows 1..; v2: walk the
//              selector lattice), truncate to n_max / p_min / budget, drop the block's K/V.
//           2. verify [anchor, d1..dk] in one target pass (logits of every row + features).
//           3. T = 0: accept the matching prefix, bonus = target argmax after it.
//              T > 0: accept d_i while u * q_i(d_i) < p_i(d_i) (p = target's processed
//              distribution, q = what d_i was drawn from); at the first rejection the bonus is
//              drawn from norm(max(p - q, 0)) (p itself when that is all zero); else from p_k.
//           4. roll the target cache back to P + a + 1, inject the features of rows 0..a into
//              the drafter at P..P+a; the bonus becomes the next anchor.
#include "driver.h"

#include "gguf.h"
#include "llama_ext_pinned.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <thread>

namespace dflash2 {

std::string check_libllama() {
    const char * v = llama_version();
    if (v == nullptr || std::strcmp(v, kPinnedLlamaVersion) != 0) {
        return std::string("loaded libllama reports version '") + (v ? v : "(null)") +
               "', expected '" + kPinnedLlamaVersion + "' (llama.cpp " + kPinnedLlamaCppCommit +
               "): reinstall with `pip install --force-reinstall llama-cpp-python==0.3.36` and "
               "rebuild dflash2-gguf against it";
    }
    return {};
}

namespace {

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// Target architectures whose graph records layer inputs (res->t_layer_inp[il]) at 0c1e570:
// the model classes in src/models/*.cpp that assign t_layer_inp, mapped to their arch names in
// src/llama-model.cpp / src/llama-arch.cpp. Any other architecture ABORTS the process inside
// libllama when layer-input extraction is enabled, so it gets the cb_eval path instead.
const std::set<std::string> & layer_inp_archs() {
    static const std::set<std::string> s = {
        "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "lfm2",
        "muse-glimmer", "gpt-oss", "deepseek4", "minimax-01", "minimax-m2", "bailingmoe3",
        "nemotron_h", "nanbeige", "hunyuan_vl", "mimo2", "gemma4",
    };
    return s;
}

std::string meta_str(const llama_model * m, const char * key) {
    char buf[512];
    const int32_t n = llama_model_meta_val_str(m, key, buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf);
}

// Drafter metadata read with gguf.h before anything is loaded (validation must precede the
// drafter context: libllama does not check the pairing and aborts inside ggml).
struct DrafterMeta {
    std::string arch;
    int64_t n_embd = -1, block_size = -1, top_k = 0, n_vocab = -1;
    std::vector<int32_t> target_layers;
};

int64_t gguf_int(const gguf_context * g, const char * key, int64_t dflt) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) return dflt;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8:   return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16:  return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(g, id);
        case GGUF_TYPE_INT64:  return gguf_get_val_i64(g, id);
        default: return dflt;
    }
}

DrafterMeta read_drafter_meta(const std::string & path) {
    gguf_init_params ip = {/*no_alloc*/ true, /*ctx*/ nullptr};
    gguf_context * g = gguf_init_from_file(path.c_str(), ip);
    if (!g) throw Error(kErrLoad, "cannot read drafter GGUF '" + path + "' (missing or not a GGUF file)");
    DrafterMeta m;
    const int64_t ia = gguf_find_key(g, "general.architecture");
    if (ia >= 0 && gguf_get_kv_type(g, ia) == GGUF_TYPE_STRING) m.arch = gguf_get_val_str(g, ia);
    m.n_embd     = gguf_int(g, "dflash.embedding_length", -1);
    m.block_size = gguf_int(g, "dflash.block_size", -1);
    m.top_k      = gguf_int(g, "dflash.selector_top_k", 0);
    const int64_t it = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (it >= 0 && gguf_get_kv_type(g, it) == GGUF_TYPE_ARRAY) m.n_vocab = (int64_t) gguf_get_arr_n(g, it);
    const int64_t il = gguf_find_key(g, "dflash.target_layers");
    if (il >= 0 && gguf_get_kv_type(g, il) == GGUF_TYPE_ARRAY) {
        const size_t n = gguf_get_arr_n(g, il);
        const gguf_type t = gguf_get_arr_type(g, il);
        const void * d = gguf_get_arr_data(g, il);
        for (size_t i = 0; i < n; ++i) {
            if (t == GGUF_TYPE_INT32) m.target_layers.push_back(((const int32_t *) d)[i]);
            else if (t == GGUF_TYPE_UINT32) m.target_layers.push_back((int32_t) ((const uint32_t *) d)[i]);
            else if (t == GGUF_TYPE_INT64) m.target_layers.push_back((int32_t) ((const int64_t *) d)[i]);
        }
    }
    gguf_free(g);
    return m;
}

int argmax(const float * x, int n) {
    return (int) (std::max_element(x, x + n) - x);  // first maximum, as llama.cpp's greedy sampler
}

// The processed distribution: llama.cpp's sampler-chain order (top_k -> top_p -> min_p ->
// temperature, src/llama-sampler.cpp at 0c1e570), so that `top_p` and `min_p` act on the
// temperature-1 probabilities of the surviving candidates, exactly like llama-cpp-python's
// sampling with the same arguments. Output: dense probabilities (0 for removed tokens).
// dflash2_gguf/sampling.py::processed_probs is the Python twin used as the tests' oracle.
void processed_probs(const float * logits, int n, const GenParams & gp, std::vector<float> & out,
                     std::vector<int> & idx) {
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    auto by_logit = [logits](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    int m = n;
    if (gp.top_k > 0 && gp.top_k < n) {
        std::partial_sort(idx.begin(), idx.begin() + gp.top_k, idx.end(), by_logit);
        m = gp.top_k;
    } else if (gp.top_p < 1.0f) {
        std::sort(idx.begin(), idx.end(), by_logit);
    }
    if (gp.top_p < 1.0f) {
        if (gp.top_k > 0 && gp.top_k < n) std::sort(idx.begin(), idx.begin() + m, by_logit);
        const double mx = logits[idx[0]];
        double z = 0;
        for (int i = 0; i < m; ++i) z += std::exp((double) logits[idx[i]] - mx);
        double cum = 0;
        int keep = m;
        for (int i = 0; i < m; ++i) {
            cum += std::exp((double) logits[idx[i]] - mx) / z;
            if (cum >= gp.top_p) { keep = i + 1; break; }
        }
        m = keep;
    }
    float mx = -INFINITY;
    for (int i = 0; i < m; ++i) mx = std::max(mx, logits[idx[i]]);
    if (gp.min_p > 0.0f) {
        const float thr = mx + std::log(gp.min_p);
        int w = 0;
        for (int i = 0; i < m; ++i) if (logits[idx[i]] >= thr) idx[w++] = idx[i];
        m = w;
    }
    out.assign(n, 0.0f);
    double z = 0;
    for (int i = 0; i < m; ++i) z += std::exp(((double) logits[idx[i]] - mx) / gp.temperature);
    for (int i = 0; i < m; ++i) out[idx[i]] = (float) (std::exp(((double) logits[idx[i]] - mx) / gp.temperature) / z);
}

uint64_t splitmix64(uint64_t & x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

struct BatchGuard {
    llama_batch b;
    explicit BatchGuard(int n) : b(llama_batch_init(n, 0, 1)) {}
    ~BatchGuard() { llama_batch_free(b); }
};

}  // namespace

// cb_eval capture of `l_out-{il}` for targets whose graph does not record layer inputs.
struct Engine::Capture {
    int n_embd = 0;
    std::vector<int> slot_of_il;                // target layer index -> feature slot or -1
    std::vector<std::vector<float>> rows;       // per slot, rows appended in ubatch order
    std::string error;
    void reset() { for (auto & r : rows) r.clear(); error.clear(); }
};

static bool capture_cb(ggml_tensor * t, bool ask, void * ud) {
    auto * c = static_cast<Engine::Capture *>(ud);
    const char * name = t->name;
    if (std::strncmp(name, "l_out-", 6) != 0) return !ask;
    char * end = nullptr;
    const long il = std::strtol(name + 6, &end, 10);
    if (end == name + 6 || *end != '\0' || il < 0 || il >= (long) c->slot_of_il.size() || c->slot_of_il[il] < 0) {
        return !ask;
    }
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 || t->ne[0] != c->n_embd || !ggml_is_contiguous(t)) {
        c->error = std::string("cb_eval capture: unexpected layout of ") + name;
        return true;
    }
    auto & dst = c->rows[c->slot_of_il[il]];
    const size_t off = dst.size();
    dst.resize(off + (size_t) ggml_nelements(t));
    ggml_backend_tensor_get(t, dst.data() + off, 0, ggml_nbytes(t));
    return true;
}

Engine::Engine(const EngineOptions & opt) : opt_(opt) {
    llama_backend_init();
    const int n_thr_hw = (int) std::max(1u, std::thread::hardware_concurrency());
    const int n_threads = opt.n_threads > 0 ? opt.n_threads : n_thr_hw;
    const int n_threads_dft = opt.n_threads_draft > 0 ? opt.n_threads_draft : n_threads;
    if (opt.n_ctx < 8) throw std::invalid_argument("n_ctx must be >= 8");
    if (opt.capture != "auto" && opt.capture != "layer_inp" && opt.capture != "cb_eval") {
        throw std::invalid_argument("capture must be 'auto', 'layer_inp' or 'cb_eval'");
    }

    // 1. Drafter metadata (cheap, before loading anything big).
    DrafterMeta dm;
    const bool want_dft = !opt.drafter_path.empty();
    if (want_dft) {
        dm = read_drafter_meta(opt.drafter_path);
        if (dm.arch != "dflash") {
            throw Error(kErrIncompatible, "drafter '" + opt.drafter_path + "' has general.architecture '" + dm.arch +
                                              "', expected 'dflash'");
        }
    }

    // 2. Target model.
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = opt.n_gpu_layers;
    mp.use_extra_bufts = opt.repack;
    model_tgt_ = llama_model_load_from_file(opt.target_path.c_str(), mp);
    if (!model_tgt_) throw Error(kErrLoad, "failed to load target GGUF '" + opt.target_path + "'");
    try {
        arch_tgt_    = meta_str(model_tgt_, "general.architecture");
        n_vocab_     = llama_vocab_n_tokens(llama_model_get_vocab(model_tgt_));
        n_embd_      = llama_model_n_embd(model_tgt_);
        n_layer_tgt_ = llama_model_n_layer(model_tgt_);
        if (arch_tgt_ == "dflash") throw Error(kErrIncompatible, "the target is a dflash drafter; pass the target model first");

        // 3. Validate the pairing before the drafter context exists.
        if (want_dft) {
            if (llama_model_is_recurrent(model_tgt_) || llama_model_is_hybrid(model_tgt_)) {
                throw Error(kErrUnsupported, "target architecture '" + arch_tgt_ +
                    "' is recurrent/hybrid: rolling back rejected drafts needs state checkpoints, "
                    "which this driver does not implement; run this target without a drafter (-md none)");
            }
            if (dm.n_vocab != n_vocab_) {
                throw Error(kErrIncompatible, "vocabulary mismatch: drafter has " + std::to_string(dm.n_vocab) +
                    " tokens, target has " + std::to_string(n_vocab_));
            }
            if (dm.n_embd != n_embd_) {
                throw Error(kErrIncompatible, "hidden size mismatch: drafter dflash.embedding_length = " +
                    std::to_string(dm.n_embd) + ", target hidden size = " + std::to_string(n_embd_));
            }
            if (dm.target_layers.empty()) {
                throw Error(kErrIncompatible, "drafter has no dflash.target_layers");
            }
            for (int32_t lid : dm.target_layers) {
                // lid = HF layer id + 1 = the target's layer-input index; the last layer's output
                // (lid == n_layer) is neither recorded as a layer input nor unpruned in cb_eval.
                if (lid < 1 || lid >= n_layer_tgt_) {
                    throw Error(kErrIncompatible, "drafter target layer (HF id " + std::to_string(lid - 1) +
                        ", GGUF value " + std::to_string(lid) + ") is outside the target's usable layers: HF ids 0.." +
                        std::to_string(n_layer_tgt_ - 2) + " for a " + std::to_string(n_layer_tgt_) + "-layer target");
                }
            }
            if (dm.top_k > 0 && dm.n_embd < dm.top_k * (dm.top_k + 1)) {
                throw Error(kErrIncompatible, "DFlash 2 drafter too narrow: hidden size " + std::to_string(dm.n_embd) +
                    " < selector_top_k*(selector_top_k+1) = " + std::to_string(dm.top_k * (dm.top_k + 1)) +
                    " (the selector lattice is packed into the hidden-size output rows)");
            }
            if (dm.top_k > n_vocab_) throw Error(kErrIncompatible, "selector_top_k exceeds the vocabulary");
            if (dm.block_size < 2) throw Error(kErrIncompatible, "drafter has no usable dflash.block_size");
            lids_ = dm.target_layers;
            block_size_ = (int) dm.block_size;
            top_k_sel_ = (int) dm.top_k;

            const bool rec = layer_inp_archs().count(arch_tgt_) > 0;
            if (opt.capture == "layer_inp" && !rec) {
                throw Error(kErrUnsupported, "target architecture '" + arch_tgt_ +
                    "' does not record layer inputs in llama.cpp 0c1e570 (enabling them would abort the process); "
                    "use capture='cb_eval' or 'auto'");
            }
            capture_ = opt.capture == "auto" ? (rec ? "layer_inp" : "cb_eval") : opt.capture;
        }

        // 4. Target context.
        n_ctx_tgt_ = opt.n_ctx;
        n_batch_tgt_ = std::max(std::min(opt.n_batch, n_ctx_tgt_), 16);
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = (uint32_t) n_ctx_tgt_;
        cp.n_batch = (uint32_t) n_batch_tgt_;
        cp.n_ubatch = (uint32_t) n_batch_tgt_;
        cp.n_seq_max = 1;
        cp.n_threads = n_threads;
        cp.n_threads_batch = n_threads;
        cp.flash_attn_type = (llama_flash_attn_type) opt.flash_attn;
        cp.no_perf = true;
        if (capture_ == "cb_eval") {
            cap_ = std::make_unique<Capture>();
            cap_->n_embd = n_embd_;
            cap_->slot_of_il.assign(n_layer_tgt_, -1);
            cap_->rows.resize(lids_.size());
            for (size_t s = 0; s < lids_.size(); ++s) cap_->slot_of_il[lids_[s] - 1] = (int) s;
            cp.cb_eval = capture_cb;
            cp.cb_eval_user_data = cap_.get();
        }
        ctx_tgt_ = llama_init_from_model(model_tgt_, cp);
        if (!ctx_tgt_) throw Error(kErrLoad, "failed to create the target context (n_ctx " + std::to_string(n_ctx_tgt_) + ")");

        // 5. Drafter model + context (ctx_other = target context).
        if (want_dft) {
            llama_model_params dp = llama_model_default_params();
            dp.n_gpu_layers = opt.n_gpu_layers_draft;
            dp.use_extra_bufts = opt.repack;
            model_dft_ = llama_model_load_from_file(opt.drafter_path.c_str(), dp);
            if (!model_dft_) throw Error(kErrLoad, "failed to load drafter GGUF '" + opt.drafter_path + "'");
            if (llama_model_n_embd(model_dft_) != n_embd_ ||
                llama_vocab_n_tokens(llama_model_get_vocab(model_dft_)) != n_vocab_ ||
                llama_model_dflash_selector_top_k(model_dft_) != top_k_sel_) {
                throw Error(kErrIncompatible, "drafter model disagrees with its GGUF metadata");
            }
            mask_token_ = llama_vocab_mask(llama_model_get_vocab(model_dft_));
            if (mask_token_ < 0 || mask_token_ >= n_vocab_) {
                throw Error(kErrIncompatible, "drafter has no tokenizer.ggml.mask_token_id");
            }
            causal_dft_ = meta_str(model_dft_, "dflash.attention.causal") == "true";
            n_ctx_dft_ = opt.n_ctx_draft > 0 ? opt.n_ctx_draft : n_ctx_tgt_;
            n_ubatch_dft_ = std::max(block_size_, std::min(256, n_ctx_dft_));
            llama_context_params dc = llama_context_default_params();
            dc.n_ctx = (uint32_t) n_ctx_dft_;
            dc.n_batch = (uint32_t) n_ubatch_dft_;
            dc.n_ubatch = (uint32_t) n_ubatch_dft_;
            dc.n_seq_max = 1;
            dc.n_threads = n_threads_dft;
            dc.n_threads_batch = n_threads_dft;
            dc.flash_attn_type = (llama_flash_attn_type) opt.flash_attn;
            dc.no_perf = true;
            if (opt.kv_f32_draft) { dc.type_k = GGML_TYPE_F32; dc.type_v = GGML_TYPE_F32; }
            dc.ctx_other = ctx_tgt_;
            ctx_dft_ = llama_init_from_model(model_dft_, dc);
            if (!ctx_dft_) throw Error(kErrLoad, "failed to create the drafter context");
            if (top_k_sel_ > 0) llama_set_embeddings_nextn(ctx_dft_, true, /*masked*/ false);
            llama_set_causal_attn(ctx_dft_, causal_dft_);
            batch_dft_ = llama_batch_ext_init(ctx_dft_);
            if (capture_ == "layer_inp") {
                for (int32_t lid : lids_) llama_set_embeddings_layer_inp(ctx_tgt_, (uint32_t) lid, true);
            }
        }
    } catch (...) {
        close();
        throw;
    }
}

Engine::~Engine() { close(); }

void Engine::close() {
    if (batch_dft_) { llama_batch_ext_free(batch_dft_); batch_dft_ = nullptr; }
    if (ctx_dft_) { llama_free(ctx_dft_); ctx_dft_ = nullptr; }      // contexts before models,
    if (ctx_tgt_) { llama_free(ctx_tgt_); ctx_tgt_ = nullptr; }      // drafter (ctx_other user) first
    if (model_dft_) { llama_model_free(model_dft_); model_dft_ = nullptr; }
    if (model_tgt_) { llama_model_free(model_tgt_); model_tgt_ = nullptr; }
    active_ = false;
}

void Engine::require_open() const {
    if (ctx_tgt_ == nullptr) throw Error(kErrClosed, "the decoder is closed");
}

// ---------------------------------------------------------------------------------------------
// libllama calls

void Engine::decode_target(const int32_t * toks, int n, int pos0, bool all_logits, bool want_features) {
    BatchGuard g(n);
    for (int i = 0; i < n; ++i) {
        g.b.token[i] = toks[i];
        g.b.pos[i] = pos0 + i;
        g.b.n_seq_id[i] = 1;
        g.b.seq_id[i][0] = 0;
        g.b.logits[i] = all_logits || i == n - 1;
    }
    g.b.n_tokens = n;
    if (cap_) cap_->reset();
    const int rc = llama_decode(ctx_tgt_, g.b);
    if (rc != 0) throw Error(kErrDecode, "target llama_decode failed (rc " + std::to_string(rc) + ")", rc);
    llama_synchronize(ctx_tgt_);
    if (want_features && cap_) {
        if (!cap_->error.empty()) throw Error(kErrInternal, cap_->error);
        for (auto & r : cap_->rows) {
            if (r.size() != (size_t) n * n_embd_) {
                throw Error(kErrInternal, "cb_eval capture got " + std::to_string(r.size() / n_embd_) +
                    " rows for a batch of " + std::to_string(n));
            }
        }
    }
}

const float * Engine::feature_row(int slot, int row) const {
    if (cap_) return cap_->rows[slot].data() + (size_t) row * n_embd_;
    return llama_get_embeddings_layer_inp(ctx_tgt_, (uint32_t) lids_[slot]) + (size_t) row * n_embd_;
}

// Gather rows row0..row0+n-1 of the last target pass into feat_ ([n x n_lids*n_embd]) and
// inject them into the drafter cache at positions pos0...
void Engine::inject(int row0, int n_rows, int pos0) {
    const size_t n_enc = lids_.size() * (size_t) n_embd_;
    feat_.resize((size_t) n_rows * n_enc);
    for (size_t s = 0; s < lids_.size(); ++s) {
        for (int i = 0; i < n_rows; ++i) {
            std::memcpy(feat_.data() + i * n_enc + s * n_embd_, feature_row((int) s, row0 + i), n_embd_ * sizeof(float));
        }
    }
    for (int off = 0; off < n_rows; off += n_ubatch_dft_) {
        const int n = std::min(n_ubatch_dft_, n_rows - off);
        llama_batch_ext_clear(batch_dft_);
        for (int i = 0; i < n; ++i) {
            llama_embd e = {feat_.data() + (size_t) (off + i) * n_enc, 1, n_enc};
            const int idx = llama_batch_ext_add_embd(batch_dft_, 0, e);
            if (idx < 0) throw Error(kErrInternal, "llama_batch_ext_add_embd failed (" + std::to_string(idx) + ")");
            const llama_pos p = pos0 + off + i;
            const llama_pos pa[4] = {p, p, p, 0};
            llama_batch_ext_set_pos(batch_dft_, idx, pa);
        }
        const int rc = llama_process(ctx_dft_, LLAMA_PROCESS_TYPE_DECODE, batch_dft_);
        if (rc != 0) throw Error(kErrDecode, "drafter feature injection failed (rc " + std::to_string(rc) + ")", rc);
    }
}

// One drafter pass over the full block [anchor, mask x (bs-1)] at pos0..pos0+bs-1, every row an
// output (flagging only some rows shifts llama_get_logits_ith by one).
void Engine::draft_block(int32_t anchor, int pos0) {
    llama_batch_ext_clear(batch_dft_);
    for (int i = 0; i < block_size_; ++i) {
        const int idx = llama_batch_ext_add_token(batch_dft_, 0, i == 0 ? anchor : mask_token_);
        if (idx < 0) throw Error(kErrInternal, "llama_batch_ext_add_token failed (" + std::to_string(idx) + ")");
        const llama_pos p = pos0 + i;
        const llama_pos pa[4] = {p, p, p, 0};
        llama_batch_ext_set_pos(batch_dft_, idx, pa);
        llama_batch_ext_set_output_logits(batch_dft_, idx, true);
    }
    const int rc = llama_process(ctx_dft_, LLAMA_PROCESS_TYPE_DECODE, batch_dft_);
    if (rc != 0) throw Error(kErrDecode, "drafter block pass failed (rc " + std::to_string(rc) + ")", rc);
    llama_synchronize(ctx_dft_);
}

// ---------------------------------------------------------------------------------------------
// sampling helpers

double Engine::uniform() {  // xoshiro256**, 53-bit uniform in [0, 1)
    auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
    const uint64_t r = rotl(rng_[1] * 5, 7) * 9;
    const uint64_t t = rng_[1] << 17;
    rng_[2] ^= rng_[0]; rng_[3] ^= rng_[1]; rng_[1] ^= rng_[2]; rng_[0] ^= rng_[3];
    rng_[2] ^= t; rng_[3] = rotl(rng_[3], 45);
    return (double) (r >> 11) * 0x1.0p-53;
}

int32_t Engine::draw(const std::vector<float> & probs) {
    double total = 0;
    for (float p : probs) total += p;
    const double u = uniform() * total;
    double cum = 0;
    int last = -1;
    for (size_t i = 0; i < probs.size(); ++i) {
        if (probs[i] <= 0) continue;
        cum += probs[i];
        last = (int) i;
        if (u < cum) return (int32_t) i;
    }
    return last;
}

void Engine::sample_target(const float * logits, std::vector<float> & probs) const {
    static thread_local std::vector<int> idx;
    processed_probs(logits, n_vocab_, gp_, probs, idx);
}

bool Engine::is_eog(int32_t tok) const { return llama_vocab_is_eog(llama_model_get_vocab(model_tgt_), tok); }

void Engine::push_commit(Chunk & c, int32_t tok, bool from_draft) {
    tokens_.push_back(tok);
    c.tokens.push_back(tok);
    c.from_draft.push_back(from_draft ? 1 : 0);
    gen_from_draft_.push_back(from_draft ? 1 : 0);
    stats_.n_generated++;
    if (!gp_.ignore_eog && is_eog(tok)) {
        done_ = true;
        stats_.stop_reason = "eog";
        return;
    }
    if (!gp_.stop.empty()) {
        char buf[256];
        int n = llama_token_to_piece(llama_model_get_vocab(model_tgt_), tok, buf, sizeof(buf), 0, false);
        if (n > 0) {
            const size_t old = gen_text_.size();
            gen_text_.append(buf, n);
            for (const auto & s : gp_.stop) {
                if (s.empty()) continue;
                const size_t from = old >= s.size() ? old - s.size() + 1 : 0;
                if (gen_text_.find(s, from) != std::string::npos) {
                    done_ = true;
                    stats_.stop_reason = "stop";
                    return;
                }
            }
        }
    }
    if (stats_.n_generated >= gp_.n_predict) {
        done_ = true;
        stats_.stop_reason = "length";
    }
}

// ---------------------------------------------------------------------------------------------
// the loop

Chunk Engine::begin(const std::vector<int32_t> & prompt, const GenParams & gp) {
    require_open();
    if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
    if (gp.n_predict < 1) throw std::invalid_argument("n_predict must be >= 1");
    if (!(gp.temperature >= 0.0f)) throw std::invalid_argument("temperature must be >= 0");
    if (!(gp.top_p > 0.0f && gp.top_p <= 1.0f)) throw std::invalid_argument("top_p must be in (0, 1]");
    if (!(gp.min_p >= 0.0f && gp.min_p <= 1.0f)) throw std::invalid_argument("min_p must be in [0, 1]");
    if (gp.top_k < 0) throw std::invalid_argument("top_k must be >= 0");
    for (int32_t t : prompt) {
        if (t < 0 || t >= n_vocab_) throw std::invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary");
    }
    if ((int) prompt.size() + 1 > n_ctx_tgt_) {
        throw Error(kErrContextFull, "prompt of " + std::to_string(prompt.size()) + " tokens does not fit n_ctx " +
                                         std::to_string(n_ctx_tgt_));
    }
    gp_ = gp;
    stats_ = Stats();
    stats_.n_prompt = (int64_t) prompt.size();
    const int bs = std::max(block_size_ - 1, 1);
    stats_.pos_reached.assign(bs, 0);
    stats_.pos_accepted.assign(bs, 0);
    uint64_t s = gp.seed;
    for (auto & r : rng_) r = splitmix64(s);
    gen_text_.clear();
    gen_from_draft_.clear();
    tokens_ = prompt;
    n_prompt_ = (int) prompt.size();
    done_ = false;
    active_ = true;
    const double t0 = now_ms();
    t_begin_ = t0;

    llama_memory_clear(llama_get_memory(ctx_tgt_), true);
    const bool feats = ctx_dft_ != nullptr && gp_.use_drafter;
    if (ctx_dft_) llama_memory_clear(llama_get_memory(ctx_dft_), true);

    const int n = (int) prompt.size();
    for (int off = 0; off < n; off += n_batch_tgt_) {
        const int m = std::min(n_batch_tgt_, n - off);
        decode_target(prompt.data() + off, m, off, false, feats);
        // a drafter context shorter than the target's keeps what fits (drafting stops later)
        const int fit = std::min(m, n_ctx_dft_ - off);
        if (feats && fit > 0) inject(0, fit, off);
    }
    n_past_ = n;
    Chunk c;
    const double t1 = now_ms();
    const float * logits = llama_get_logits_ith(ctx_tgt_, (n - 1) % n_batch_tgt_);
    int32_t tok;
    if (gp_.temperature <= 0.0f) {
        tok = argmax(logits, n_vocab_);
    } else {
        sample_target(logits, probs_);
        tok = draw(probs_);
    }
    stats_.t_sample_ms += now_ms() - t1;
    stats_.t_prefill_ms = t1 - t0;
    push_commit(c, tok, false);
    c.done = done_;
    stats_.t_total_ms = now_ms() - t_begin_;
    return c;
}

// Draft the full block, then read at most k_max drafts. Returns the number of drafts.
int Engine::cycle_draft(int32_t anchor, int pos0, int k_max) {
    const double t0 = now_ms();
    draft_block(anchor, pos0);
    drafts_.clear();
    const bool greedy = gp_.temperature <= 0.0f;
    const int nd = block_size_ - 1;
    if (top_k_sel_ > 0) {
        const int K = top_k_sel_;
        const float * lat = llama_get_embeddings_nextn(ctx_dft_);
        if (!lat) throw Error(kErrInternal, "DFlash 2 drafter produced no selector lattice");
        qcand_.resize(nd);
        qprob_.resize(nd);
        qsel_.assign(nd, 0);
        std::vector<float> sc(K);
        int pred = 0;  // row 1's scores repeat the anchor's for every predecessor slot
        for (int i = 1; i <= nd && (int) drafts_.size() < k_max; ++i) {
            const float * row = lat + (size_t) i * n_embd_;
            const float * scores = row + K + (size_t) pred * K;
            int j;
            if (greedy) {
                j = argmax(scores, K);
            } else {
                // q = softmax(S / T) over the k candidates (dflash CandidateSelector.select)
                const float mx = *std::max_element(scores, scores + K);
                double z = 0;
                for (int b = 0; b < K; ++b) { sc[b] = (float) std::exp(((double) scores[b] - mx) / gp_.temperature); z += sc[b]; }
                for (int b = 0; b < K; ++b) sc[b] = (float) (sc[b] / z);
                j = draw(sc);
                auto & cand = qcand_[i - 1];
                cand.resize(K);
                for (int b = 0; b < K; ++b) cand[b] = (int32_t) row[b];
                qprob_[i - 1] = sc;
            }
            if (gp_.p_min > 0.0f) {  // softmax(S) at the chosen candidate (temperature 1)
                double z = 0;
                for (int b = 0; b < K; ++b) z += std::exp((double) scores[b] - scores[j]);
                if (1.0 / z < gp_.p_min) break;
            }
            drafts_.push_back((int32_t) row[j]);
            qsel_[i - 1] = j;
            pred = j;
        }
    } else {
        q_.resize(nd);
        static thread_local std::vector<int> idx;
        for (int i = 1; i <= nd && (int) drafts_.size() < k_max; ++i) {
            const float * lg = llama_get_logits_ith(ctx_dft_, i);
            int32_t d;
            if (greedy) {
                d = argmax(lg, n_vocab_);
            } else {
                processed_probs(lg, n_vocab_, gp_, q_[i - 1], idx);  // the drafter's processed distribution
                d = draw(q_[i - 1]);
            }
            if (gp_.p_min > 0.0f) {
                const float mx = *std::max_element(lg, lg + n_vocab_);
                double z = 0;
                for (int v = 0; v < n_vocab_; ++v) z += std::exp((double) lg[v] - mx);
                if (std::exp((double) lg[d] - mx) / z < gp_.p_min) break;
            }
            drafts_.push_back(d);
        }
    }
    llama_memory_seq_rm(llama_get_memory(ctx_dft_), 0, pos0, -1);  // drop the block's K/V
    stats_.t_draft_ms += now_ms() - t0;
    return (int) drafts_.size();
}

Chunk Engine::step() {
    require_open();
    if (!active_) throw Error(kErrInternal, "step() called before begin()");
    Chunk c;
    if (done_) { c.done = true; return c; }
    const int P = n_past_;
    const int32_t anchor = tokens_.back();
    const int remaining = (int) (gp_.n_predict - stats_.n_generated);
    if (P + 1 > n_ctx_tgt_) {
        done_ = true;
        stats_.stop_reason = "context";
        c.done = true;
        return c;
    }
    int k_max = 0;
    const bool drafting = ctx_dft_ != nullptr && gp_.use_drafter;
    if (drafting && P + block_size_ <= n_ctx_dft_) {
        k_max = block_size_ - 1;
        if (gp_.n_draft_max >= 0) k_max = std::min(k_max, gp_.n_draft_max);
        k_max = std::min(k_max, remaining - 1);
        k_max = std::min(k_max, n_ctx_tgt_ - 1 - P);
        k_max = std::max(k_max, 0);
    }
    const int k = k_max > 0 ? cycle_draft(anchor, P, k_max) : 0;

    // verify [anchor, d1..dk] in one target pass
    double t0 = now_ms();
    std::vector<int32_t> vt(k + 1);
    vt[0] = anchor;
    for (int i = 0; i < k; ++i) vt[i + 1] = drafts_[i];
    decode_target(vt.data(), k + 1, P, true, drafting);
    stats_.t_target_ms += now_ms() - t0;

    // accept
    t0 = now_ms();
    int a = 0;
    int32_t bonus = -1;
    if (gp_.temperature <= 0.0f) {
        for (; a < k; ++a) {
            if (argmax(llama_get_logits_ith(ctx_tgt_, a), n_vocab_) != drafts_[a]) break;
        }
        bonus = argmax(llama_get_logits_ith(ctx_tgt_, a), n_vocab_);
    } else {
        for (; a < k; ++a) {
            sample_target(llama_get_logits_ith(ctx_tgt_, a), probs_);
            const int32_t d = drafts_[a];
            const double p = probs_[d];
            double q;
            if (top_k_sel_ > 0) {
                q = qprob_[a][qsel_[a]];  // probability of the chosen candidate slot
            } else {
                q = q_[a][d];
            }
            const double u = uniform();
            const bool ok = gp_.wrong_acceptance_rule ? (u < p) : (u * q < p);
            if (ok) continue;
            // rejected: residual max(p - q, 0), renormalized; p itself if it is all zero
            resid_ = probs_;
            if (top_k_sel_ > 0) {
                const auto & cand = qcand_[a];
                const auto & qp = qprob_[a];
                for (size_t b = 0; b < cand.size(); ++b) resid_[cand[b]] -= qp[b];
            } else {
                for (int v = 0; v < n_vocab_; ++v) resid_[v] -= q_[a][v];
            }
            double tot = 0;
            for (auto & r : resid_) { if (r < 0) r = 0; tot += r; }
            bonus = draw(tot > 0 ? resid_ : probs_);
            break;
        }
        if (bonus < 0) {
            sample_target(llama_get_logits_ith(ctx_tgt_, a), probs_);
            bonus = draw(probs_);
        }
    }
    stats_.t_sample_ms += now_ms() - t0;

    stats_.n_cycles++;
    stats_.n_drafted += k;
    stats_.n_accepted += a;
    for (int i = 0; i < k && i <= a; ++i) {
        stats_.pos_reached[i]++;
        if (i < a) stats_.pos_accepted[i]++;
    }
    const int64_t before = stats_.n_generated;
    for (int i = 0; i < a && !done_; ++i) push_commit(c, drafts_[i], true);
    if (!done_) push_commit(c, bonus, false);
    stats_.n_committed_cycles += stats_.n_generated - before;

    // roll back: the target keeps anchor + accepted drafts; the bonus is the next anchor
    n_past_ = P + a + 1;
    llama_memory_seq_rm(llama_get_memory(ctx_tgt_), 0, n_past_, -1);
    const int fit = std::min(a + 1, n_ctx_dft_ - P);
    if (drafting && !done_ && fit > 0) {
        t0 = now_ms();
        inject(0, fit, P);
        stats_.t_inject_ms += now_ms() - t0;
    }
    c.done = done_;
    stats_.t_total_ms = now_ms() - t_begin_;
    return c;
}

std::vector<int32_t> Engine::generate(const std::vector<int32_t> & prompt, const GenParams & gp,
                                      const std::function<bool(const Chunk &)> & on_chunk) {
    Chunk c = begin(prompt, gp);
    if (on_chunk && !on_chunk(c)) return std::vector<int32_t>(tokens_.begin() + n_prompt_, tokens_.end());
    while (!c.done) {
        c = step();
        if (on_chunk && !on_chunk(c)) break;
    }
    return std::vector<int32_t>(tokens_.begin() + n_prompt_, tokens_.end());
}

// ---------------------------------------------------------------------------------------------
// text helpers

std::vector<int32_t> Engine::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    require_open();
    const llama_vocab * v = llama_model_get_vocab(model_tgt_);
    std::vector<int32_t> out(text.size() + 8);
    int n;
    try {  // libllama throws std::out_of_range for vocabularies without byte-fallback tokens
        n = llama_tokenize(v, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
        if (n < 0) {
            out.resize(-n);
            n = llama_tokenize(v, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
        }
    } catch (const std::exception & e) {
        throw std::invalid_argument(std::string("the target's tokenizer cannot encode this text: ") + e.what());
    }
    if (n < 0) throw Error(kErrInternal, "llama_tokenize failed");
    out.resize(n);
    return out;
}

std::string Engine::detokenize(const std::vector<int32_t> & tokens, bool special) const {
    require_open();
    const llama_vocab * v = llama_model_get_vocab(model_tgt_);
    std::string out(tokens.size() * 8 + 16, '\0');
    int n = llama_detokenize(v, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(v, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    }
    if (n < 0) throw Error(kErrInternal, "llama_detokenize failed");
    out.resize(n);
    return out;
}

std::string Engine::chat_template() const {
    require_open();
    const char * t = llama_model_chat_template(model_tgt_, nullptr);
    return t ? std::string(t) : std::string();
}

// ---------------------------------------------------------------------------------------------
// parity hooks

std::vector<float> Engine::capture_features(const std::vector<int32_t> & tokens) {
    require_open();
    if (!ctx_dft_) throw Error(kErrUnsupported, "capture_features needs a drafter (it defines the target layers)");
    if (tokens.empty() || (int) tokens.size() > n_ctx_tgt_) throw std::invalid_argument("bad token count");
    active_ = false;
    llama_memory_clear(llama_get_memory(ctx_tgt_), true);
    const size_t n_enc = lids_.size() * (size_t) n_embd_;
    std::vector<float> out(tokens.size() * n_enc);
    const int n = (int) tokens.size();
    for (int off = 0; off < n; off += n_batch_tgt_) {
        const int m = std::min(n_batch_tgt_, n - off);
        decode_target(tokens.data() + off, m, off, false, true);
        for (size_t s = 0; s < lids_.size(); ++s) {
            for (int i = 0; i < m; ++i) {
                std::memcpy(out.data() + (off + i) * n_enc + s * n_embd_, feature_row((int) s, i), n_embd_ * sizeof(float));
            }
        }
    }
    llama_memory_clear(llama_get_memory(ctx_tgt_), true);
    return out;
}

DraftProbe Engine::draft_from_features(const std::vector<float> & features, int n_rows, int32_t anchor) {
    require_open();
    if (!ctx_dft_) throw Error(kErrUnsupported, "draft_from_features needs a drafter");
    const size_t n_enc = lids_.size() * (size_t) n_embd_;
    if (n_rows < 1 || features.size() != (size_t) n_rows * n_enc) throw std::invalid_argument("features must be [n_rows x n_lids*n_embd]");
    if (n_rows + block_size_ > n_ctx_dft_) throw Error(kErrContextFull, "features do not fit the drafter context");
    if (anchor < 0 || anchor >= n_vocab_) throw std::invalid_argument("anchor outside the vocabulary");
    active_ = false;
    llama_memory_clear(llama_get_memory(ctx_dft_), true);
    // inject from the caller's buffer
    for (int off = 0; off < n_rows; off += n_ubatch_dft_) {
        const int n = std::min(n_ubatch_dft_, n_rows - off);
        llama_batch_ext_clear(batch_dft_);
        for (int i = 0; i < n; ++i) {
            llama_embd e = {features.data() + (size_t) (off + i) * n_enc, 1, n_enc};
            const int idx = llama_batch_ext_add_embd(batch_dft_, 0, e);
            const llama_pos p = off + i;
            const llama_pos pa[4] = {p, p, p, 0};
            llama_batch_ext_set_pos(batch_dft_, idx, pa);
        }
        const int rc = llama_process(ctx_dft_, LLAMA_PROCESS_TYPE_DECODE, batch_dft_);
        if (rc != 0) throw Error(kErrDecode, "drafter feature injection failed", rc);
    }
    draft_block(anchor, n_rows);
    DraftProbe pr;
    pr.n_rows = block_size_;
    pr.n_vocab = n_vocab_;
    pr.n_embd = n_embd_;
    pr.logits.resize((size_t) block_size_ * n_vocab_);
    for (int i = 0; i < block_size_; ++i) {
        std::memcpy(pr.logits.data() + (size_t) i * n_vocab_, llama_get_logits_ith(ctx_dft_, i), n_vocab_ * sizeof(float));
    }
    if (top_k_sel_ > 0) {
        const float * lat = llama_get_embeddings_nextn(ctx_dft_);
        pr.lattice.assign(lat, lat + (size_t) block_size_ * n_embd_);
        const int K = top_k_sel_;
        int pred = 0;
        for (int i = 1; i < block_size_; ++i) {
            const float * row = lat + (size_t) i * n_embd_;
            const int j = argmax(row + K + (size_t) pred * K, K);
            pr.greedy.push_back((int32_t) row[j]);
            pred = j;
        }
    } else {
        for (int i = 1; i < block_size_; ++i) pr.greedy.push_back(argmax(pr.logits.data() + (size_t) i * n_vocab_, n_vocab_));
    }
    llama_memory_clear(llama_get_memory(ctx_dft_), true);
    return pr;
}

std::vector<float> Engine::target_logits(const std::vector<int32_t> & tokens) {
    require_open();
    if (tokens.empty() || (int) tokens.size() > n_ctx_tgt_) throw std::invalid_argument("bad token count");
    active_ = false;
    llama_memory_clear(llama_get_memory(ctx_tgt_), true);
    std::vector<float> out(tokens.size() * (size_t) n_vocab_);
    const int n = (int) tokens.size();
    for (int off = 0; off < n; off += n_batch_tgt_) {
        const int m = std::min(n_batch_tgt_, n - off);
        decode_target(tokens.data() + off, m, off, true, false);
        for (int i = 0; i < m; ++i) {
            std::memcpy(out.data() + (size_t) (off + i) * n_vocab_, llama_get_logits_ith(ctx_tgt_, i), n_vocab_ * sizeof(float));
        }
    }
    llama_memory_clear(llama_get_memory(ctx_tgt_), true);
    return out;
}

}  // namespace dflash2
