// Feature capture (see capture.h).
#include "capture.h"

#include "error.h"
#include "llama.h"
#include "llama_ext_pinned.h"

#include <cstring>

namespace dflash2 {

namespace {
bool capture_cb(ggml_tensor * t, bool ask, void * ud) {
    auto * c = static_cast<FeatureCapture *>(ud);
    const char * name = t->name;
    if (std::strncmp(name, "l_out-", 6) != 0) return !ask;
    char * end = nullptr;
    const long il = std::strtol(name + 6, &end, 10);
    if (end == name + 6 || *end != '\0' || il < 0 || il >= (long) c->slot_of_il.size() || c->slot_of_il[il] < 0) {
        return !ask;
    }
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 || t->ne[0] != c->n_embd_ || !ggml_is_contiguous(t)) {
        c->error = std::string("cb_eval capture: unexpected layout of ") + name;
        return true;
    }
    auto & dst = c->rows[c->slot_of_il[il]];
    const size_t off = dst.size();
    dst.resize(off + (size_t) ggml_nelements(t));
    ggml_backend_tensor_get(t, dst.data() + off, 0, ggml_nbytes(t));
    return true;
}
}  // namespace

FeatureCapture::FeatureCapture(const std::string & path, const std::vector<int32_t> & lids, int n_embd, int n_layer)
    : n_embd_(n_embd), path_(path), lids_(lids) {
    if (path_ == "cb_eval") {
        slot_of_il.assign(n_layer, -1);
        rows.resize(lids_.size());
        for (size_t s = 0; s < lids_.size(); ++s) slot_of_il[lids_[s] - 1] = (int) s;
    }
}

void FeatureCapture::configure(llama_context_params & cp) {
    if (path_ != "cb_eval") return;
    cp.cb_eval = capture_cb;
    cp.cb_eval_user_data = this;
}

void FeatureCapture::enable(llama_context * ctx_tgt) {
    if (path_ != "layer_inp") return;
    for (int32_t lid : lids_) llama_set_embeddings_layer_inp(ctx_tgt, (uint32_t) lid, true);
}

void FeatureCapture::reset() {
    for (auto & r : rows) r.clear();
    error.clear();
}

void FeatureCapture::check(int n_rows) const {
    if (path_ != "cb_eval") return;
    if (!error.empty()) throw Error(kErrInternal, error);
    for (const auto & r : rows) {
        if (r.size() != (size_t) n_rows * n_embd_) {
            throw Error(kErrInternal, "cb_eval capture got " + std::to_string(r.size() / n_embd_) +
                                          " rows for a batch of " + std::to_string(n_rows));
        }
    }
}

const float * FeatureCapture::row(llama_context * ctx_tgt, int slot, int i) const {
    if (path_ == "cb_eval") return rows[slot].data() + (size_t) i * n_embd_;
    return llama_get_embeddings_layer_inp(ctx_tgt, (uint32_t) lids_[slot]) + (size_t) i * n_embd_;
}

void FeatureCapture::gather(llama_context * ctx_tgt, int row0, int n, std::vector<float> & out) const {
    const size_t w = (size_t) width();
    out.resize((size_t) n * w);
    for (int s = 0; s < n_slots(); ++s) {
        for (int i = 0; i < n; ++i) {
            std::memcpy(out.data() + i * w + (size_t) s * n_embd_, row(ctx_tgt, s, row0 + i), n_embd_ * sizeof(float));
        }
    }
}

}  // namespace dflash2
