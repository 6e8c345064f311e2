// Context drafts (see context_drafter.h).
#include "context_drafter.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace dflash2 {

const char * source_name(int index) {
    static const char * names[kNumSources] = {"draft-dflash", "ngram-simple", "ngram-mod"};
    return index >= 0 && index < kNumSources ? names[index] : "?";
}

void NgramParams::validate() const {
    auto in = [](int v, int lo, int hi, const char * name) {
        if (v < lo || v > hi) {
            throw std::invalid_argument(std::string(name) + " must be in " + std::to_string(lo) + ".." +
                                        std::to_string(hi) + ", got " + std::to_string(v));
        }
    };
    in(simple_size_n, 1, 1024, "spec_ngram_simple_size_n");
    in(simple_size_m, 1, 1024, "spec_ngram_simple_size_m");
    in(mod_n_match, 1, 1024, "spec_ngram_mod_n_match");
    in(mod_n_max, 1, 1024, "spec_ngram_mod_n_max");
    in(mod_n_min, 0, 1024, "spec_ngram_mod_n_min");
}

namespace {

uint64_t hash_tokens(const int32_t * t, int n) {
    uint64_t h = 1469598103934665603ULL;  // FNV-1a over the 4 bytes of each token
    for (int i = 0; i < n; ++i) {
        uint32_t v = (uint32_t) t[i];
        for (int b = 0; b < 4; ++b) { h ^= (v >> (8 * b)) & 0xff; h *= 1099511628211ULL; }
    }
    return h;
}

// True when `a` is a prefix of `b`.
bool extends(const std::vector<int32_t> & a, const std::vector<int32_t> & b) {
    return a.size() <= b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(int32_t)) == 0);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// the DraftSource face of a context source

int ContextSource::draft(const DraftRequest & r, DraftResult & out) {
    out.rows.clear();
    out.match_len = 0;
    if (r.history == nullptr || r.ngram == nullptr) throw std::invalid_argument("a context source needs history and ngram");
    if (r.k_max <= 0 || (r.prefix != nullptr && !r.prefix->empty())) return 0;
    const ContextDraft d = lookup(*r.history, *r.ngram, r.k_max);
    out.match_len = d.match_len;
    out.rows.resize(d.tokens.size());
    for (size_t i = 0; i < d.tokens.size(); ++i) {
        DraftRow & row = out.rows[i];
        row.token = d.tokens[i];
        row.cand.assign(1, d.tokens[i]);  // a point mass: q = 1 on the drafted token
        row.q.assign(1, 1.0f);
        row.slot = 0;
        row.conf = 1.0f;
    }
    return (int) out.rows.size();
}

// ---------------------------------------------------------------------------------------------
// ngram-simple

void PromptLookup::clear() {
    indexed_.clear();
    short_.clear();
    long_.clear();
    n_ = 0;
}

// Index the n-grams ending at 0-based positions e in [n - 1, len - 2] (an earlier occurrence needs
// a token after it), for n = n (short) and kLong.
void PromptLookup::index_to(const std::vector<int32_t> & history, int n) {
    if (n != n_ || !extends(indexed_, history)) {
        clear();
        n_ = n;
    }
    const int len = (int) history.size();
    const int old = (int) indexed_.size();
    for (int e = std::max(n - 1, old - 1); e <= len - 2; ++e) short_[hash_tokens(history.data() + e - n + 1, n)].push_back(e);
    if (n < kLong) {
        for (int e = std::max(kLong - 1, old - 1); e <= len - 2; ++e) {
            long_[hash_tokens(history.data() + e - kLong + 1, kLong)].push_back(e);
        }
    }
    indexed_.assign(history.begin(), history.end());
}

// The most recent of the (at most kMaxCandidates most recent) occurrences of the last n tokens
// that has the longest match with the end of history; -1 if none. best_m: that match's length.
int PromptLookup::search(const Index & idx, int n, const std::vector<int32_t> & history, int & best_m) const {
    const int len = (int) history.size();
    best_m = 0;
    if (len < n + 1) return -1;
    auto it = idx.find(hash_tokens(history.data() + len - n, n));
    if (it == idx.end()) return -1;
    constexpr int kMaxCandidates = 32, kMaxMatch = 256;
    int best_e = -1, seen = 0;
    const auto & ends = it->second;
    for (auto e_it = ends.rbegin(); e_it != ends.rend() && seen < kMaxCandidates; ++e_it, ++seen) {
        const int e = *e_it;
        int m = 0;  // the match length, ending at e and at len - 1
        while (m < kMaxMatch && e - m >= 0 && history[e - m] == history[len - 1 - m]) ++m;
        if (m >= n && m > best_m) { best_m = m; best_e = e; }  // ties: the most recent (seen first)
    }
    return best_e;
}

ContextDraft PromptLookup::lookup(const std::vector<int32_t> & history, const NgramParams & p, int k_max) {
    ContextDraft d;
    const int n = p.simple_size_n;
    const int len = (int) history.size();
    if (k_max <= 0 || len < n + 1) return d;
    index_to(history, n);
    int m = 0, e = -1;
    if (n < kLong) e = search(long_, kLong, history, m);
    if (e < 0) e = search(short_, n, history, m);
    if (e < 0) return d;
    // the tokens after e; past the end of history the draft continues from its own tokens (a
    // match close to the end is a repeating pattern: it repeats on)
    const int n_draft = std::min(k_max, p.simple_size_m);
    d.tokens.reserve(n_draft);
    for (int j = 0; j < n_draft; ++j) {
        const int src = e + 1 + j;
        d.tokens.push_back(src < len ? history[src] : d.tokens[src - len]);
    }
    d.match_len = m;
    return d;
}

// ---------------------------------------------------------------------------------------------
// ngram-mod (llama.cpp's common_ngram_mod: the same multiplier and table size)

void NgramPool::clear() {
    std::fill(table_.begin(), table_.end(), -1);
    used_ = 0;
    added_.clear();
}

size_t NgramPool::idx(const int32_t * t) const {
    size_t r = 0;
    for (int i = 0; i < n_; ++i) r = r * 6364136223846793005ULL + (size_t) (uint32_t) t[i];
    return r % table_.size();
}

void NgramPool::add(const std::vector<int32_t> & history, const NgramParams & p) {
    if (table_.empty()) table_.assign(kEntries, -1);
    if (p.mod_n_match != n_) {
        n_ = p.mod_n_match;
        clear();
    }
    const int len = (int) history.size();
    int start = 0;
    if (extends(added_, history)) start = std::max(0, (int) added_.size() - n_);
    for (int i = start; i + n_ < len; ++i) {
        int32_t & slot = table_[idx(history.data() + i)];
        if (slot < 0) ++used_;
        slot = history[i + n_];
    }
    added_.assign(history.begin(), history.end());
    if ((double) used_ > 0.25 * (double) table_.size()) {  // llama.cpp resets past 25% occupancy
        std::fill(table_.begin(), table_.end(), -1);
        used_ = 0;
    }
}

ContextDraft NgramPool::lookup(const std::vector<int32_t> & history, const NgramParams & p, int k_max) {
    ContextDraft d;
    add(history, p);
    const int len = (int) history.size();
    k_max = std::min(k_max, p.mod_n_max);
    if (k_max <= 0 || len < n_) return d;
    std::vector<int32_t> buf(history.end() - n_, history.end());
    for (int i = 0; i < k_max; ++i) {
        const int32_t t = table_[idx(buf.data() + i)];
        if (t < 0) break;
        buf.push_back(t);
    }
    // fewer than n_min chained tokens: no draft, unless the chain ran to this cycle's cap
    if ((int) buf.size() - n_ < std::max(std::min(p.mod_n_min, k_max), 1)) return d;
    d.tokens.assign(buf.begin() + n_, buf.end());
    d.match_len = n_;
    return d;
}

// ---------------------------------------------------------------------------------------------
// calibration

int ContextCalibration::bin(int m) {  // the last edge <= m (lengths below 1 go to the first bin)
    return std::max(0, (int) (std::upper_bound(kEdges, kEdges + kBins, m) - kEdges) - 1);
}

double ContextCalibration::predict(int source, int m) const {
    // bin by bin up to m's: from kChainFrom on, a bin's prior is at least the estimate of the bin
    // below it (a copy that held this long holds at least as well as a shorter one)
    const int b = bin(m);
    double p = 0.0;
    for (int i = 0; i <= b; ++i) {
        const double lo = (double) kEdges[i];
        double prior = lo / (lo + 4.0);  // 0.2 for one token, 0.67 for 8, 0.94 for 64
        if (kEdges[i] >= kChainFrom) prior = std::max(prior, p);
        p = (accepted_[source][i] + kPrior * prior) / (reached_[source][i] + kPrior);
    }
    return p;
}

void ContextCalibration::observe(int source, int m, bool accepted) {
    for (int b = 0; b < kBins; ++b) {  // recent cycles weigh more: the context's character changes
        reached_[source][b] *= kDecay;
        accepted_[source][b] *= kDecay;
    }
    const int b = bin(m);
    reached_[source][b] += 1.0;
    if (accepted) accepted_[source][b] += 1.0;
}

void ContextCalibration::new_request() {
    for (int s = 0; s < kNumSources; ++s) {
        for (int b = 0; b < kBins; ++b) {
            if (reached_[s][b] > kCarried) {
                const double f = kCarried / reached_[s][b];
                reached_[s][b] *= f;
                accepted_[s][b] *= f;
            }
        }
    }
}

}  // namespace dflash2
