"""T > 0 is lossless: speculative sampling reproduces target-only sampling in distribution.

Tiny random llama target (vocab 48, ``tiny_models.py``) and random v1 / v2 drafters converted
with our converter. For a fixed prompt the driver generates 3 tokens with N different seeds;
token 1 comes from the prefill, tokens 2 and 3 from the first draft/verify cycles (accepted
drafts, residual draws or bonus draws). Their empirical marginals are compared by a chi-square
test with the EXACT marginals of the target alone, enumerated from libllama's target logits and
the processed distribution of ``dflash2_gguf.sampling.processed_probs`` (the numpy twin of the
driver's: this also checks that both agree).

Negative control: the same test with the deliberately wrong acceptance rule ``u < p`` (instead
of ``u * q < p``, test hook of the native driver) must fail decisively; otherwise the test
would not be able to see a broken acceptance rule.
"""

from __future__ import annotations

import numpy as np
import pytest


pytestmark = pytest.mark.native

PROMPT = [1, 9, 30, 17, 22]
N_RUNS = 2000


def _exact_marginals(dec, sp):
    """Exact P(t1), P(t2), P(t3) of target-only sampling with params ``sp`` (shape [3, V])."""
    from dflash2_gguf.sampling import processed_probs

    eng = dec.engine
    n = len(PROMPT)
    p1 = processed_probs(eng.target_logits(PROMPT)[n - 1], sp)
    V = p1.shape[0]
    m2 = np.zeros(V)
    m3 = np.zeros(V)
    for t1 in np.nonzero(p1)[0]:
        p2 = processed_probs(eng.target_logits(PROMPT + [int(t1)])[n], sp)
        m2 += p1[t1] * p2
        for t2 in np.nonzero(p2)[0]:
            p3 = processed_probs(eng.target_logits(PROMPT + [int(t1), int(t2)])[n + 1], sp)
            m3 += p1[t1] * p2[t2] * p3
    return np.stack([p1, m2, m3])


def _chi2_pvalue(counts, probs):
    from scipy.stats import chisquare

    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_b = list(counts[big]) + [counts[~big].sum()]
    exp_b = list(exp[big]) + [exp[~big].sum()]
    if exp_b[-1] < 1e-9:  # nothing merged
        if obs_b[-1] > 0:
            return 0.0
        obs_b, exp_b = obs_b[:-1], exp_b[:-1]
    return float(chisquare(obs_b, exp_b).pvalue)


def _run(target, drafter, sp, wrong=False):
    import dataclasses

    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(target, None, n_ctx=64, n_threads=1) as alone:
        exact = _exact_marginals(alone, sp)
    V = exact.shape[1]
    counts = np.zeros((3, V))
    from_draft = 0
    with DFlashDecoder(target, drafter, n_ctx=64, n_threads=1) as dec:
        for seed in range(N_RUNS):
            r = dec.generate(PROMPT, max_tokens=3, sampling=dataclasses.replace(sp, seed=seed), ignore_eos=True,
                             _test_fault=1 if wrong else 0)
            assert len(r.tokens) == 3
            for i, t in enumerate(r.tokens):
                counts[i, t] += 1
            from_draft += r.from_draft[1]
    pvals = [_chi2_pvalue(counts[i], exact[i]) for i in range(3)]
    return pvals, from_draft / N_RUNS


def _sp(**kw):
    from dflash2_gguf import SamplingParams

    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    base.update(kw)
    return SamplingParams(**base)


@pytest.mark.parametrize("version, params", [
    (1, {}),
    (2, {}),
    pytest.param(2, {"temperature": 0.8, "top_k": 12, "top_p": 0.9, "min_p": 0.05}, marks=pytest.mark.slow),
    pytest.param(1, {"temperature": 1.3, "top_k": 20, "top_p": 0.95, "min_p": 0.02}, marks=pytest.mark.slow),
])
def test_speculative_sampling_matches_target_distribution(native_ext, tiny_llama, tiny_drafters, version, params):
    pvals, accepted_first = _run(tiny_llama, tiny_drafters[version], _sp(**params))
    # the first draft must be accepted often enough for the test to exercise acceptance
    assert accepted_first > 0.05, accepted_first
    # deterministic seeds: a threshold of 1e-3 per marginal is a fixed, reproducible outcome
    print("p-values", pvals, "first draft accepted", accepted_first)
    assert min(pvals) > 1e-3, pvals


@pytest.mark.parametrize("version", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_negative_control_wrong_acceptance_rule_fails(native_ext, tiny_llama, tiny_drafters, version):
    pvals, _ = _run(tiny_llama, tiny_drafters[version], _sp(), wrong=True)
    assert pvals[0] > 1e-3  # the prefill token does not go through verification
    print("wrong-rule p-values", pvals)
    assert min(pvals[1:]) < 1e-6, pvals
