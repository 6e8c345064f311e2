// How many drafts to verify each cycle (draft_policy.cpp): a measured cost model and the
// drafter's own confidence, calibrated online against the acceptances seen so far.
//
// Expected tokens committed by a cycle that verifies k drafts whose conditional acceptance
// probabilities are a_1..a_k (a_i = P(draft i accepted | drafts before it accepted)):
//   E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j          (the bonus / next token always commits)
// (Leviathan et al. 2023, section 3.1, with per-position rates instead of one alpha). The cycle
// costs verify_ms[k] (a target pass over k + 1 rows) plus the drafter pass when one runs. The
// policy picks the k that maximises E(k) / cost(k); k = 0 is a plain target decode.
//
// Nothing here reads the current cycle's verification: the choice uses timings and acceptances
// of earlier cycles and the drafter's probabilities of this cycle's drafts, which are fixed
// before the target sees them. So the output stays exactly the target's at T = 0 and keeps its
// distribution at T > 0 whatever k is chosen (acceptance.cpp does not depend on k).
#pragma once

#include <cstdint>
#include <vector>

namespace dflash2 {

// Milliseconds of a target pass over r rows (verify_ms[r-1], r = 1..block size) and of a drafter
// block pass, on this machine and backend. Empty verify_ms = not measured yet.
struct CostModel {
    std::vector<double> verify_ms;
    double draft_ms = 0.0;
    // Extra milliseconds a cycle that verifies k > 0 drafts costs to roll the target back on a
    // recurrent target without native rollback (the state copy before the pass, and on a
    // rejection its restore plus the re-decode of the accepted tokens: target_memory.h); 0 else.
    double rollback_ms = 0.0;
    bool fixed = false;  // set by the caller: observe_* leave it as it is
    bool valid() const { return !verify_ms.empty() && verify_ms[0] > 0.0; }
    // Exponential moving average update with a new measurement (alpha 0.1; the first sets it).
    // A one-row measurement scales every row count by the factor it moved verify_ms[0] by.
    void observe_verify(int rows, double ms);
    void observe_draft(double ms);
    void observe_rollback(double ms);
};

// The exact argmax over k = 0..min(k_max, a.size()) of E(k) / (verify_ms[k] + (k > 0 ? draft_ms + rollback_ms : 0)),
// ties to the larger k (a flat cost curve then drafts the whole block). `rate` (if set) receives the best value in tokens per millisecond.
// draft_ms is what drafting still costs at decision time (0 once the drafter pass has run).
int choose_draft_length(const CostModel & cost, const std::vector<double> & a, int k_max, double draft_ms,
                        double * rate = nullptr);

// E(k) for the first k entries of a.
double expected_tokens(const std::vector<double> & a, int k);

// Per-position acceptance from the drafter's probability of each draft: 10 confidence bins,
// each estimating P(accepted | reached, confidence in bin) from the counts seen so far, with the
// confidence itself as a prior worth kPrior observations.
class AcceptanceCalibration {
  public:
    double predict(double confidence) const;
    void observe(double confidence, bool accepted);
    static constexpr int kBins = 10;
    static constexpr double kPrior = 4.0;
    // The counts per bin (drafts reached / accepted), to keep them across processes; set()
    // takes kBins of each (std::invalid_argument otherwise) and scales every bin down to at most
    // kMaxRestored reached, so that a restored calibration still follows what it sees next.
    std::vector<double> reached() const { return {reached_, reached_ + kBins}; }
    std::vector<double> accepted() const { return {accepted_, accepted_ + kBins}; }
    void set(const std::vector<double> & reached, const std::vector<double> & accepted);
    static constexpr double kMaxRestored = 50.0;
  private:
    double reached_[kBins] = {0}, accepted_[kBins] = {0};
};

// Whether to run the drafter this cycle: when its recent cycles delivered fewer expected tokens
// per millisecond than a plain decode, skip it, and probe again after 4, 8, ... kMaxInterval
// skipped cycles (doubling while probes keep losing). A probe costs one drafter pass (about one
// target decode for SmolLM2-135M on 2 CPU cores) plus the injection of the features that waited
// since the last one: that part grows with the gap, so a longer interval only thins out the
// drafter passes, which at kMaxInterval cost under 0.1% of the time.
class DraftGate {
  public:
    bool draft_now(const CostModel & cost);
    // True when the next cycle runs the drafter without a probe (no history yet, or paying).
    bool open(const CostModel & cost) const;
    void observe_drafting(double rate);  // the chosen k's predicted rate, cycles that drafted
    void reset();
    static constexpr int kMaxInterval = 1024;
    // State kept across processes: the drafting rate EMA (tokens/ms, -1 = none) and the probe
    // interval (clamped to 4..kMaxInterval); the skip count restarts at 0.
    double rate() const { return rate_; }
    int interval() const { return interval_; }
    void set(double rate, int interval);
  private:
    double rate_ = -1.0;   // EMA of drafting cycles' predicted tokens/ms (-1: none yet)
    int skipped_ = 0, interval_ = 4;
};

}  // namespace dflash2
