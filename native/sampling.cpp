// The target's processed distribution (see sampling.h for the order and its sources).
#include "sampling.h"

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace dflash2 {

void SamplingOptions::validate(int n_vocab) const {
    auto bad = [](const std::string & m) { throw std::invalid_argument(m); };
    if (!(temperature >= 0.0f)) bad("temperature must be >= 0");
    if (top_k < 0) bad("top_k must be >= 0");
    if (!(top_p > 0.0f && top_p <= 1.0f)) bad("top_p must be in (0, 1]");
    if (!(min_p >= 0.0f && min_p <= 1.0f)) bad("min_p must be in [0, 1]");
    if (!(repeat_penalty >= 0.0f) || !std::isfinite(repeat_penalty)) bad("repeat_penalty must be a finite number >= 0");
    if (repeat_last_n < -1) bad("repeat_last_n must be >= -1 (-1 = the context size, 0 = off)");
    if (!std::isfinite(presence_penalty)) bad("presence_penalty must be finite");
    if (!std::isfinite(frequency_penalty)) bad("frequency_penalty must be finite");
    for (const auto & b : logit_bias) {
        if (b.first < 0 || b.first >= n_vocab) {
            bad("logit_bias token id " + std::to_string(b.first) + " is outside the vocabulary (0.." +
                std::to_string(n_vocab - 1) + ")");
        }
        if (std::isnan(b.second) || b.second == INFINITY) bad("logit_bias values must be numbers < +inf (-inf bans a token)");
    }
    if (n_probs < 0) bad("n_probs must be >= 0");
}

// ---------------------------------------------------------------------------------------------
// Rng

namespace {
uint64_t splitmix64(uint64_t & x) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
}  // namespace

void Rng::seed(uint64_t s) {
    for (auto & r : s_) r = splitmix64(s);
}

double Rng::uniform() {
    auto rotl = [](uint64_t x, int k) { return (x << k) | (x >> (64 - k)); };
    const uint64_t r = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0]; s_[3] ^= s_[1]; s_[1] ^= s_[2]; s_[0] ^= s_[3];
    s_[2] ^= t; s_[3] = rotl(s_[3], 45);
    return (double) (r >> 11) * 0x1.0p-53;
}

int32_t Rng::draw(const std::vector<float> & w) {
    double total = 0;
    for (float p : w) total += p;
    const double u = uniform() * total;
    double cum = 0;
    int last = -1;
    for (size_t i = 0; i < w.size(); ++i) {
        if (w[i] <= 0) continue;
        cum += w[i];
        last = (int) i;
        if (u < cum) return (int32_t) i;
    }
    return last;
}

// ---------------------------------------------------------------------------------------------
// truncation + temperature

int argmax(const float * x, int n) {
    return (int) (std::max_element(x, x + n) - x);
}

void truncated_probs(const float * logits, int n, const SamplingOptions & so, std::vector<float> & out) {
    static thread_local std::vector<int> idx;
    idx.clear();
    for (int i = 0; i < n; ++i) if (logits[i] > -INFINITY) idx.push_back(i);  // grammar / bias bans
    auto by_logit = [logits](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    int m = (int) idx.size();
    const bool top_p_on = so.top_p > 0.0f && so.top_p < 1.0f;
    if (so.top_k > 0 && so.top_k < m) {
        std::partial_sort(idx.begin(), idx.begin() + so.top_k, idx.end(), by_logit);
        m = so.top_k;
    } else if (top_p_on) {
        std::sort(idx.begin(), idx.end(), by_logit);
    }
    if (top_p_on && m > 0) {
        const double mx = logits[idx[0]];
        double z = 0;
        for (int i = 0; i < m; ++i) z += std::exp((double) logits[idx[i]] - mx);
        double cum = 0;
        int keep = m;
        for (int i = 0; i < m; ++i) {
            cum += std::exp((double) logits[idx[i]] - mx) / z;
            if (cum >= so.top_p) { keep = i + 1; break; }
        }
        m = keep;
    }
    out.assign(n, 0.0f);
    if (m == 0) return;
    float mx = -INFINITY;
    for (int i = 0; i < m; ++i) mx = std::max(mx, logits[idx[i]]);
    if (so.min_p > 0.0f) {
        const float thr = mx + std::log(so.min_p);
        int w = 0;
        for (int i = 0; i < m; ++i) if (logits[idx[i]] >= thr) idx[w++] = idx[i];
        m = w;
    }
    double z = 0;
    for (int i = 0; i < m; ++i) z += std::exp(((double) logits[idx[i]] - mx) / so.temperature);
    for (int i = 0; i < m; ++i) out[idx[i]] = (float) (std::exp(((double) logits[idx[i]] - mx) / so.temperature) / z);
}

// ---------------------------------------------------------------------------------------------
// SamplerState

SamplerState::SamplerState(const llama_vocab * vocab, const SamplingOptions & so, int n_ctx)
    : vocab_(vocab), so_(&so) {
    last_n_ = so.has_penalties() ? (so.repeat_last_n < 0 ? n_ctx : so.repeat_last_n) : 0;
    if (!so.grammar.empty()) {
        grammar_ = llama_sampler_init_grammar(vocab, so.grammar.c_str(), "root");
        if (!grammar_) {
            throw std::invalid_argument("the grammar does not parse as GBNF with a 'root' rule "
                                        "(llama.cpp grammars/README.md); run with verbose=True to see libllama's parse error");
        }
    }
}

SamplerState::SamplerState(const SamplerState & o)
    : vocab_(o.vocab_), so_(o.so_), last_n_(o.last_n_), window_(o.window_), count_(o.count_),
      grammar_(o.grammar_ ? llama_sampler_clone(o.grammar_) : nullptr) {}

SamplerState & SamplerState::operator=(const SamplerState & o) {
    if (this == &o) return *this;
    if (grammar_) llama_sampler_free(grammar_);
    vocab_ = o.vocab_;
    so_ = o.so_;
    last_n_ = o.last_n_;
    window_ = o.window_;
    count_ = o.count_;
    grammar_ = o.grammar_ ? llama_sampler_clone(o.grammar_) : nullptr;
    return *this;
}

SamplerState::~SamplerState() {
    if (grammar_) llama_sampler_free(grammar_);
}

void SamplerState::push_window(int32_t tok) {
    if (last_n_ <= 0) return;
    count_[tok]++;
    window_.push_back(tok);
    if ((int) window_.size() > last_n_) {
        const int32_t old = window_.front();
        window_.pop_front();
        if (--count_[old] == 0) count_.erase(old);
    }
}

void SamplerState::accept_prompt(int32_t tok) {
    if (so_ && so_->penalize_prompt) push_window(tok);
}

void SamplerState::accept(int32_t tok) {
    push_window(tok);
    if (grammar_) llama_sampler_accept(grammar_, tok);
}

void SamplerState::process(const float * raw, int n_vocab, std::vector<float> & out, bool grammar, bool penalties) const {
    out.assign(raw, raw + n_vocab);
    if (so_) {
        for (const auto & b : so_->logit_bias) out[b.first] += b.second;
    }
    if (penalties && last_n_ > 0) {
        // llama.cpp src/llama-sampler.cpp llama_sampler_penalties_apply at 0c1e570
        const float rp = so_->repeat_penalty, fp = so_->frequency_penalty, pp = so_->presence_penalty;
        for (const auto & kv : count_) {
            float & l = out[kv.first];
            if (rp != 0.0f) {  // 0 means off, as 1
                if (l <= 0) l *= rp; else l /= rp;
            }
            l -= (float) kv.second * fp + (kv.second > 0 ? pp : 0.0f);
        }
    }
    if (grammar && grammar_) {
        static thread_local std::vector<llama_token_data> cand;
        cand.resize(n_vocab);
        for (int i = 0; i < n_vocab; ++i) cand[i] = {i, out[i], 0.0f};
        llama_token_data_array arr = {cand.data(), cand.size(), -1, false};
        llama_sampler_apply(grammar_, &arr);
        // the grammar sampler only writes -inf into logits, in place and in order
        for (size_t i = 0; i < arr.size; ++i) if (arr.data[i].logit == -INFINITY) out[arr.data[i].id] = -INFINITY;
    }
}

void SamplerState::allowed(const int32_t * ids, int n, std::vector<uint8_t> & ok) const {
    ok.assign(n, 1);
    if (!grammar_) return;
    static thread_local std::vector<llama_token_data> cand;
    cand.resize(n);
    for (int i = 0; i < n; ++i) cand[i] = {ids[i], 0.0f, 0.0f};
    llama_token_data_array arr = {cand.data(), (size_t) n, -1, false};
    llama_sampler_apply(grammar_, &arr);
    for (int i = 0; i < n; ++i) ok[i] = arr.data[i].logit == -INFINITY ? 0 : 1;
}

TokenLogprob token_logprob(const std::vector<float> & logits, int32_t tok, int n_top) {
    const int n = (int) logits.size();
    double mx = -INFINITY;
    for (float l : logits) mx = std::max(mx, (double) l);
    double z = 0;
    for (float l : logits) z += std::exp((double) l - mx);
    const double lz = mx + std::log(z);
    TokenLogprob r;
    r.token = tok;
    r.logprob = (float) ((double) logits[tok] - lz);
    if (n_top > 0) {
        n_top = std::min(n_top, n);
        std::vector<int> idx(n);
        std::iota(idx.begin(), idx.end(), 0);
        std::partial_sort(idx.begin(), idx.begin() + n_top, idx.end(), [&](int a, int b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        for (int i = 0; i < n_top; ++i) {
            if (logits[idx[i]] == -INFINITY) break;  // banned (grammar, bias): not an alternative
            r.top.emplace_back(idx[i], (float) ((double) logits[idx[i]] - lz));
        }
    }
    return r;
}

}  // namespace dflash2
