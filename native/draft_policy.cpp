// Draft-length policy (see draft_policy.h).
#include "draft_policy.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dflash2 {

namespace {
constexpr double kAlpha = 0.1;
double ema(double old, double x) { return old <= 0.0 ? x : (1.0 - kAlpha) * old + kAlpha * x; }
}  // namespace

void CostModel::observe_verify(int rows, double ms) {
    if (fixed || rows < 1 || ms <= 0.0) return;
    if ((int) verify_ms.size() < rows) verify_ms.resize(rows, 0.0);
    const double old = verify_ms[rows - 1];
    verify_ms[rows - 1] = ema(old, ms);
    // A one-row pass sets the level of the whole curve: what moves it (load on the machine, a
    // longer context) moves every row count alike, so the others follow by the same factor and
    // the shape (the ratios, which decide k) changes only where that row count is observed.
    // Otherwise a row count the policy stopped picking would keep the level it had then.
    if (rows == 1 && old > 0.0) {
        const double f = verify_ms[0] / old;
        for (size_t r = 1; r < verify_ms.size(); ++r) verify_ms[r] *= f;
    }
}

void CostModel::observe_draft(double ms) {
    if (!fixed && ms > 0.0) draft_ms = ema(draft_ms, ms);
}

void CostModel::observe_rollback(double ms) {
    if (!fixed && ms > 0.0) rollback_ms = ema(rollback_ms, ms);
}

double expected_tokens(const std::vector<double> & a, int k) {
    double e = 1.0, run = 1.0;
    for (int i = 0; i < k && i < (int) a.size(); ++i) {
        run *= std::clamp(a[i], 0.0, 1.0);
        e += run;
    }
    return e;
}

int choose_draft_length(const CostModel & cost, const std::vector<double> & a, int k_max, double draft_ms,
                        double * rate) {
    const int kk = std::min<int>({k_max, (int) a.size(), (int) cost.verify_ms.size() - 1});
    int best = 0;
    double best_rate = cost.valid() ? 1.0 / cost.verify_ms[0] : 0.0;
    double e = 1.0, run = 1.0;
    for (int k = 1; k <= kk; ++k) {
        run *= std::clamp(a[k - 1], 0.0, 1.0);
        e += run;
        const double t = cost.verify_ms[k] + draft_ms + cost.rollback_ms;
        if (cost.verify_ms[k] <= 0.0) continue;  // not measured: never chosen
        const double r = e / t;
        if (r >= best_rate) { best_rate = r; best = k; }  // ties: the longer draft (free rows)
    }
    if (rate) *rate = best_rate;
    return best;
}

double AcceptanceCalibration::predict(double c) const {
    c = std::clamp(c, 0.0, 1.0);
    const int b = std::min(kBins - 1, (int) (c * kBins));
    return (accepted_[b] + kPrior * c) / (reached_[b] + kPrior);
}

void AcceptanceCalibration::observe(double c, bool accepted) {
    c = std::clamp(c, 0.0, 1.0);
    const int b = std::min(kBins - 1, (int) (c * kBins));
    reached_[b] += 1.0;
    if (accepted) accepted_[b] += 1.0;
}

void AcceptanceCalibration::set(const std::vector<double> & reached, const std::vector<double> & accepted) {
    if ((int) reached.size() != kBins || (int) accepted.size() != kBins) {
        throw std::invalid_argument("a calibration has " + std::to_string(kBins) + " bins of reached and accepted counts");
    }
    for (int b = 0; b < kBins; ++b) {
        const double r = std::max(reached[b], 0.0), a = std::clamp(accepted[b], 0.0, r);
        const double scale = r > kMaxRestored ? kMaxRestored / r : 1.0;
        reached_[b] = r * scale;
        accepted_[b] = a * scale;
    }
}

void DraftGate::set(double rate, int interval) {
    rate_ = rate > 0.0 ? rate : -1.0;
    interval_ = std::clamp(interval, 4, kMaxInterval);
    skipped_ = 0;
}

bool DraftGate::open(const CostModel & cost) const {
    return rate_ < 0.0 || !cost.valid() || rate_ * cost.verify_ms[0] >= 1.0;
}

bool DraftGate::draft_now(const CostModel & cost) {
    if (open(cost)) {
        skipped_ = 0;
        interval_ = 4;
        return true;
    }
    if (++skipped_ >= interval_) {  // probe
        skipped_ = 0;
        interval_ = std::min(interval_ * 2, kMaxInterval);
        return true;
    }
    return false;
}

void DraftGate::observe_drafting(double rate) {
    constexpr double a = 0.3;  // faster than the cost EMA: a paying probe must reopen the gate
    rate_ = rate_ < 0.0 ? rate : (1.0 - a) * rate_ + a * rate;
}

void DraftGate::reset() {
    rate_ = -1.0;
    skipped_ = 0;
    interval_ = 4;
}

}  // namespace dflash2
