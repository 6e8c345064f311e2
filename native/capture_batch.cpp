// Batched greedy generation with target feature capture (see capture_batch.h).
#include "capture_batch.h"

#include "error.h"
#include "ggml.h"
#include "llama.h"
#include "pairing.h"
#include "sampling.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

namespace dflash2 {

namespace {

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// Largest finite float16 value: features beyond it cannot be stored in a shard
// (dflash2_gguf/train/data.py, format dflash2-gguf-features/1).
constexpr float kFloat16Max = 65504.0f;

}  // namespace

BatchCapture::BatchCapture(const BatchCaptureOptions & opt) : opt_(opt) {
    if (opt.n_parallel < 1) throw std::invalid_argument("n_parallel must be >= 1");
    if (opt.n_ctx_seq < 2) throw std::invalid_argument("n_ctx_seq must be >= 2");
    if (opt.n_batch < opt.n_parallel) throw std::invalid_argument("n_batch must be >= n_parallel (one row per running sequence)");
    if (opt.n_ubatch < 1) throw std::invalid_argument("n_ubatch must be >= 1");
    if (opt.target_layer_ids.empty()) throw std::invalid_argument("target_layer_ids is empty");
    if (opt.capture != "auto" && opt.capture != "layer_inp" && opt.capture != "cb_eval") {
        throw std::invalid_argument("capture must be 'auto', 'layer_inp' or 'cb_eval'");
    }
    llama_backend_init();
    model_ = load_gguf(opt.target_path, opt.n_gpu_layers, opt.repack, "target");
    try {
        const std::string arch = meta_str(model_, "general.architecture");
        n_vocab_ = llama_vocab_n_tokens(llama_model_get_vocab(model_));
        n_embd_ = llama_model_n_embd(model_);
        n_layer_ = llama_model_n_layer(model_);
        std::vector<int32_t> lids;  // layer-input indices = HF ids + 1 (capture.h)
        for (int32_t k : opt.target_layer_ids) {
            if (k < 0 || k > n_layer_ - 2) {
                throw Error(kErrIncompatible, "target layer id " + std::to_string(k) + " is outside HF ids 0.." +
                    std::to_string(n_layer_ - 2) + " of this " + std::to_string(n_layer_) +
                    "-layer target (the last layer's output is pruned to the logit rows)");
            }
            lids.push_back(k + 1);
        }
        const bool records = layer_inp_archs().count(arch) > 0;
        if (opt.capture == "layer_inp" && !records) {
            throw Error(kErrUnsupported, "target architecture '" + arch +
                "' does not record layer inputs in llama.cpp 0c1e570 (enabling them would abort the process); "
                "use capture='cb_eval' or 'auto'");
        }
        path_ = opt.capture == "auto" ? (records ? "layer_inp" : "cb_eval") : opt.capture;
        cap_ = std::make_unique<FeatureCapture>(path_, lids, n_embd_, n_layer_);

        const int n_thr = opt.n_threads > 0 ? opt.n_threads : (int) std::max(1u, std::thread::hardware_concurrency());
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = (uint32_t) opt.n_parallel * (uint32_t) opt.n_ctx_seq;
        cp.n_batch = (uint32_t) opt.n_batch;
        cp.n_ubatch = (uint32_t) std::min(opt.n_ubatch, opt.n_batch);
        cp.n_seq_max = (uint32_t) opt.n_parallel;
        cp.kv_unified = path_ == "cb_eval";  // batch row order in the callback (capture_batch.h)
        cp.n_threads = n_thr;
        cp.n_threads_batch = n_thr;
        cp.flash_attn_type = (llama_flash_attn_type) opt.flash_attn;
        cp.no_perf = true;
        cap_->configure(cp);
        ctx_ = llama_init_from_model(model_, cp);
        if (!ctx_) {
            throw Error(kErrLoad, "failed to create the target context (" + std::to_string(opt.n_parallel) + " sequences x " +
                std::to_string(opt.n_ctx_seq) + " cells)");
        }
        cap_->enable(ctx_);
    } catch (...) {
        close();
        throw;
    }
    slots_.resize(opt.n_parallel);
}

BatchCapture::~BatchCapture() { close(); }

void BatchCapture::close() {
    if (ctx_) { llama_free(ctx_); ctx_ = nullptr; }  // the context before the model
    if (model_) { llama_model_free(model_); model_ = nullptr; }
    cap_.reset();
    queue_.clear();
    slots_.clear();
}

void BatchCapture::require_open() const {
    if (ctx_ == nullptr) throw Error(kErrClosed, "the batch capture is closed");
}

void BatchCapture::submit(int64_t key, const std::vector<int32_t> & prompt, int max_new_tokens) {
    require_open();
    if (max_new_tokens < 1) throw std::invalid_argument("max_new_tokens must be >= 1");
    if (prompt.empty() || (int) prompt.size() >= opt_.n_ctx_seq) {
        throw std::invalid_argument("prompt " + std::to_string(key) + " has " + std::to_string(prompt.size()) +
            " tokens; it must have 1.." + std::to_string(opt_.n_ctx_seq - 1) + " (n_ctx_seq - 1): raise n_ctx_seq");
    }
    if ((int) prompt.size() > opt_.n_batch) {
        throw std::invalid_argument("prompt " + std::to_string(key) + " has " + std::to_string(prompt.size()) +
            " tokens, more than n_batch = " + std::to_string(opt_.n_batch) + ": raise n_batch");
    }
    for (int32_t t : prompt) {
        if (t < 0 || t >= n_vocab_) throw std::invalid_argument("prompt " + std::to_string(key) + " has a token outside the vocabulary");
    }
    queue_.push_back({key, prompt, max_new_tokens});
}

bool BatchCapture::idle() const {
    return queue_.empty() && std::none_of(slots_.begin(), slots_.end(), [](const Slot & s) { return s.used; });
}

void BatchCapture::clear() {
    require_open();
    queue_.clear();
    for (auto & s : slots_) s = Slot();
    llama_memory_clear(llama_get_memory(ctx_), true);
}

void BatchCapture::append_features(Slot & slot, int row0, int n_rows) {
    cap_->gather(ctx_, row0, n_rows, row_);
    for (float x : row_) {
        if (!(std::fabs(x) <= kFloat16Max)) {  // NaN fails the comparison too
            throw Error(kErrInternal, "a target feature is " + std::to_string(x) + ", beyond float16's range (" +
                "65504): this target needs a bfloat16/float32 shard format");
        }
    }
    auto & f = slot.seq.features;
    const size_t off = f.size();
    f.resize(off + row_.size());
    ggml_fp32_to_fp16_row(row_.data(), reinterpret_cast<ggml_fp16_t *>(f.data() + off), (int64_t) row_.size());
}

std::vector<CapturedSequence> BatchCapture::step() {
    require_open();
    std::vector<CapturedSequence> done;
    if (idle()) return done;
    const double t0 = now_ms();

    // The batch, in slot order (increasing seq ids: llama.cpp's split_equal takes runs of
    // consecutive seq ids per ubatch). Room for the running sequences' rows is kept first.
    llama_batch b = llama_batch_init(opt_.n_batch, 0, 1);
    struct Span { int slot, row0, n; bool logits; };
    std::vector<Span> spans;
    int n = 0;
    int room = opt_.n_batch;
    for (const auto & s : slots_) room -= s.used ? 1 : 0;
    auto add = [&](int32_t tok, int pos, int seq, bool logits) {
        b.token[n] = tok;
        b.pos[n] = pos;
        b.n_seq_id[n] = 1;
        b.seq_id[n][0] = seq;
        b.logits[n] = logits;
        ++n;
    };
    for (int s = 0; s < (int) slots_.size(); ++s) {
        Slot & slot = slots_[s];
        if (slot.used) {  // the last generated token (the final one of a finished sequence: no logits)
            add(slot.seq.response.back(), slot.n_fed, s, !slot.finished);
            spans.push_back({s, n - 1, 1, !slot.finished});
        } else if (!queue_.empty() && (int) queue_.front().prompt.size() <= room) {
            Pending p = std::move(queue_.front());
            queue_.pop_front();
            const int m = (int) p.prompt.size();
            for (int i = 0; i < m; ++i) add(p.prompt[i], i, s, i == m - 1);
            spans.push_back({s, n - m, m, true});
            room -= m;
            slot = Slot();
            slot.used = true;
            slot.max_new = p.max_new;
            slot.seq.key = p.key;
            slot.seq.prompt = std::move(p.prompt);
            slot.seq.features.reserve((size_t) (m + p.max_new) * width());
            stats_.n_prompt += m;
        }
    }
    b.n_tokens = n;
    const double t1 = now_ms();
    cap_->reset();
    const int rc = llama_decode(ctx_, b);
    llama_batch_free(b);
    if (rc != 0) {
        throw Error(kErrDecode, "target llama_decode failed (rc " + std::to_string(rc) + (rc == 1 ? ": no KV cells left" : "") +
                                ") on a batch of " + std::to_string(n) + " rows", rc);
    }
    llama_synchronize(ctx_);
    stats_.t_decode_ms += now_ms() - t1;
    ++stats_.n_decode;
    cap_->check(n);

    for (const Span & sp : spans) {
        Slot & slot = slots_[sp.slot];
        append_features(slot, sp.row0, sp.n);
        slot.n_fed += sp.n;
        if (!sp.logits) {  // the finished sequence's last row is in: hand it over, free the slot
            done.push_back(std::move(slot.seq));
            slot = Slot();
            llama_memory_seq_rm(llama_get_memory(ctx_), sp.slot, -1, -1);
            continue;
        }
        const int32_t tok = (int32_t) argmax(llama_get_logits_ith(ctx_, sp.row0 + sp.n - 1), n_vocab_);
        auto & seq = slot.seq;
        seq.response.push_back(tok);
        ++stats_.n_generated;
        if (is_eog(tok)) seq.stop_reason = "eog";
        else if ((int) seq.response.size() >= slot.max_new) seq.stop_reason = "length";
        else if ((int) (seq.prompt.size() + seq.response.size()) >= opt_.n_ctx_seq) seq.stop_reason = "context";
        slot.finished = !seq.stop_reason.empty();
    }
    stats_.t_total_ms += now_ms() - t0;
    return done;
}

std::vector<int32_t> BatchCapture::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    require_open();
    return tokenize_text(model_, text, add_special, parse_special);
}

bool BatchCapture::is_eog(int32_t tok) const { return llama_vocab_is_eog(llama_model_get_vocab(model_), tok); }

}  // namespace dflash2
