// Acceptance: the rejection rule of lossless speculative sampling, on its own (acceptance.cpp).
//
// Leviathan et al. 2023 (arXiv:2211.17192, Algorithm 1), Chen et al. 2023; dflash 0.1.0
// `_rejection_sample`. Given drafts d_1..d_k, each drawn from a known q_i, and the target's
// processed distribution p_i of verify row i-1 (conditioned on the committed text plus
// d_1..d_{i-1}), accept d_i while u * q_i(d_i) < p_i(d_i); at the first rejection draw the next
// token from norm(max(p_i - q_i, 0)) (p_i itself when that is all zero); when every draft is
// accepted, draw the bonus from p_{k+1}. Marginally every committed token is distributed as p.
// Greedy (T = 0): accept d_i while it is the argmax of the processed logits; the next token is
// that argmax.
#pragma once

#include "sampling.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace dflash2 {

// What one draft was drawn from. `cand` empty: `q` is dense over the vocabulary (DFlash 1);
// otherwise `q[j]` is the probability of candidate `cand[j]` (DFlash 2 selector path, zero for
// every other token). `slot` is the drawn index (cand[slot] == token), or the token for dense q.
struct DraftRow {
    int32_t token = -1;
    int slot = -1;
    std::vector<int32_t> cand;
    std::vector<float> q;
    float conf = 0.0f;  // the row's top temperature-1 probability before the draw (drafter.h)
    float q_token() const { return q[slot]; }
};

// GenParams::accept_mode values (driver.h).
enum AcceptMode : int { kAcceptRejection = 0, kAcceptTargetSample = 1 };

// TEST HOOKS for the negative controls of the lossless tests; never set outside tests.
enum TestFault : int {
    kFaultNone = 0,
    kFaultWrongRule = 1,             // accept when u < p (ignores q)
    kFaultPenaltyWithDrafts = 2,     // every verify row's p uses the state after ALL drafts
    kFaultBonusWithoutPenalty = 3,   // residual / bonus drawn from p computed without penalties
    kFaultNoRollback = 4,            // rejected drafts stay in the target's memory (driver.cpp)
    kFaultResidualIsP = 5,           // after a rejection the next token is drawn from p, not the residual
};

struct AcceptResult {
    int n_accepted = 0;    // drafts accepted (a prefix of the k drafts)
    int32_t next = -1;     // the token the target adds after them (residual or bonus draw)
};

// Rows are asked for in order 0, 1, ..., n_accepted (each at most once per purpose).
// p_of(i, for_next): the dense processed distribution of verify row i; for_next is true when the
// result is used to draw the next token (residual or bonus) rather than to test a draft.
using ProbsOf = std::function<const std::vector<float> &(int row, bool for_next)>;
AcceptResult accept_sampled(const std::vector<DraftRow> & drafts, int k, const ProbsOf & p_of, Rng & rng,
                            int fault);

// argmax_of(i): the argmax of verify row i's processed logits.
AcceptResult accept_greedy(const std::vector<DraftRow> & drafts, int k, const std::function<int32_t(int)> & argmax_of);

}  // namespace dflash2
