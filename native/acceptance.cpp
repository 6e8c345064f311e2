// The rejection rule (see acceptance.h for the rule and its sources).
#include "acceptance.h"

namespace dflash2 {

AcceptResult accept_sampled(const std::vector<DraftRow> & drafts, int k, const ProbsOf & p_of, Rng & rng, int fault) {
    AcceptResult r;
    static thread_local std::vector<float> resid;
    for (int i = 0; i < k; ++i) {
        const DraftRow & d = drafts[i];
        const std::vector<float> & p = p_of(i, false);
        const double pd = p[d.token];
        const double u = rng.uniform();
        const bool ok = fault == kFaultWrongRule ? (u < pd) : (u * d.q_token() < pd);
        if (ok) { r.n_accepted++; continue; }
        // rejected: residual max(p - q, 0), renormalised by the draw; p itself if it is all zero
        const std::vector<float> & pn = p_of(i, true);
        resid = pn;
        if (d.cand.empty()) {
            for (size_t v = 0; v < resid.size(); ++v) resid[v] -= d.q[v];
        } else {
            for (size_t j = 0; j < d.cand.size(); ++j) resid[d.cand[j]] -= d.q[j];
        }
        double tot = 0;
        for (auto & x : resid) { if (x < 0) x = 0; tot += x; }
        r.next = rng.draw(tot > 0 && fault != kFaultResidualIsP ? resid : pn);
        return r;
    }
    r.next = rng.draw(p_of(k, true));
    return r;
}

AcceptResult accept_greedy(const std::vector<DraftRow> & drafts, int k, const std::function<int32_t(int)> & argmax_of) {
    AcceptResult r;
    for (; r.n_accepted < k; ++r.n_accepted) {
        const int32_t t = argmax_of(r.n_accepted);
        if (t != drafts[r.n_accepted].token) { r.next = t; return r; }
    }
    r.next = argmax_of(k);
    return r;
}

}  // namespace dflash2
