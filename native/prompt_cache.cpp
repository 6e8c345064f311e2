// The RAM prompt cache (see prompt_cache.h).
#include "prompt_cache.h"

#include "error.h"
#include "llama.h"

#include <algorithm>

namespace dflash2 {

int common_prefix(const std::vector<int32_t> & a, const std::vector<int32_t> & b, int nb) {
    const int n = std::min((int) a.size(), nb);
    int i = 0;
    while (i < n && a[i] == b[i]) ++i;
    return i;
}

namespace {
std::vector<uint8_t> seq_state(llama_context * ctx) {
    std::vector<uint8_t> buf(llama_state_seq_get_size(ctx, 0));
    const size_t n = llama_state_seq_get_data(ctx, buf.data(), buf.size(), 0);
    if (n == 0) throw Error(kErrInternal, "llama_state_seq_get_data saved nothing");
    buf.resize(n);
    return buf;
}
}  // namespace

size_t PromptCache::Entry::bytes() const {
    size_t b = tgt.size() + dft.size();
    for (const auto & c : ckpts) b += c.data.size();
    return b;
}

bool PromptCache::save(llama_context * tgt, llama_context * dft, const std::vector<int32_t> & tokens, int n_dft_valid,
                       const std::vector<StateCheckpoint> & ckpts) {
    if (tokens.empty()) return false;
    for (size_t i = 0; i < entries_.size();) {  // superseded: a prefix of what is saved now
        const auto & t = entries_[i].tokens;
        if (t.size() <= tokens.size() && common_prefix(t, tokens, (int) tokens.size()) == (int) t.size()) {
            bytes_ -= entries_[i].bytes();
            entries_.erase(entries_.begin() + i);
        } else {
            ++i;
        }
    }
    Entry e;
    e.tokens = tokens;
    e.tgt = seq_state(tgt);
    if (dft) e.dft = seq_state(dft);
    e.ckpts = ckpts;
    e.n_dft_valid = n_dft_valid;
    e.used = ++clock_;
    const size_t sz = e.bytes();
    if (sz > budget_) return false;
    evict_to(budget_ - sz);
    bytes_ += sz;
    entries_.push_back(std::move(e));
    return true;
}

int PromptCache::best(const std::vector<int32_t> & prompt, int & lcp, const Usable & usable) const {
    int bi = -1;
    lcp = 0;
    for (size_t i = 0; i < entries_.size(); ++i) {
        int l = common_prefix(entries_[i].tokens, prompt, (int) prompt.size());
        if (usable) l = usable(entries_[i].tokens, l, entries_[i].ckpts);
        if (l > lcp) { lcp = l; bi = (int) i; }
    }
    return bi;
}

void PromptCache::restore(int i, llama_context * tgt, llama_context * dft, std::vector<int32_t> & tokens, int & n_dft_valid,
                          std::vector<StateCheckpoint> * ckpts) {
    Entry & e = entries_.at(i);
    if (llama_state_seq_set_data(tgt, e.tgt.data(), e.tgt.size(), 0) == 0) {
        throw Error(kErrInternal, "libllama refused a saved target state (llama_state_seq_set_data)");
    }
    if (dft) {
        if (e.dft.empty()) {
            llama_memory_clear(llama_get_memory(dft), true);
            n_dft_valid = 0;
        } else {
            if (llama_state_seq_set_data(dft, e.dft.data(), e.dft.size(), 0) == 0) {
                throw Error(kErrInternal, "libllama refused a saved drafter state (llama_state_seq_set_data)");
            }
            n_dft_valid = e.n_dft_valid;
        }
    }
    tokens = e.tokens;
    if (ckpts) *ckpts = e.ckpts;
    e.used = ++clock_;
}

void PromptCache::evict_to(size_t budget) {
    while (bytes_ > budget && !entries_.empty()) {
        auto it = std::min_element(entries_.begin(), entries_.end(), [](const Entry & a, const Entry & b) { return a.used < b.used; });
        bytes_ -= it->bytes();
        entries_.erase(it);
    }
}

}  // namespace dflash2
