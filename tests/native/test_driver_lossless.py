"""T > 0 is lossless: speculative sampling reproduces target-only sampling in distribution.

Tiny random llama target (vocab 48, ``tiny_models.py``) and random v1 / v2 drafters converted
with our converter. For a fixed prompt the driver generates 3 tokens with N different seeds;
token 1 comes from the prefill, tokens 2 and 3 from the first draft/verify cycles (accepted
drafts, residual draws or bonus draws). Their empirical marginals are compared by a chi-square
test with the EXACT marginals of the target alone, enumerated from libllama's target logits and
the processed distribution of ``dflash2_gguf.decoder.sampling.processed_probs`` (the numpy twin of the
driver's: this also checks that both agree).

Negative control: the same test with the deliberately wrong acceptance rule ``u < p`` (instead
of ``u * q < p``, test hook of the native driver) must fail decisively; otherwise the test
would not be able to see a broken acceptance rule.

With repetition penalties (the window sees the prompt and every earlier token) and with a GBNF
grammar, the exact marginals condition each position on the tokens before it (penalties through
``sampling.processed_probs(..., history)``, the grammar through the set of tokens it allows,
computed here from the tiny vocabulary's pieces). Two more negative controls must fail: the
penalty state advanced with all the drafts of a cycle before verifying (SGLang #33643's bug),
and the residual / bonus drawn without the penalties.
"""

from __future__ import annotations

import numpy as np
import pytest


pytestmark = pytest.mark.native

PROMPT = [1, 9, 30, 17, 22]
N_RUNS = 2000


# GRAMMAR allows the tokens spelled with its characters only (TINY_VOCAB pieces), and the end
# of generation once one character was emitted.
GRAMMAR = "root ::= [_abcdefg]+"
GRAMMAR_CHARS = set("_abcdefg")


def _allowed_mask(V, n_emitted):
    from tiny_models import TINY_VOCAB

    ok = np.array([all(c in GRAMMAR_CHARS for c in piece) for piece in TINY_VOCAB[:V]], dtype=float)
    ok[2] = 1.0 if n_emitted > 0 else 0.0  # </s>: the grammar may end after one character
    ok[[0, 1, 3]] = 0.0
    return ok


def _probs(eng, ctx, sp, grammar, prompt=PROMPT):
    from dflash2_gguf.decoder.sampling import processed_probs

    history = ctx if sp.penalize_prompt else ctx[len(prompt):]
    logits = np.array(eng.target_logits(ctx)[len(ctx) - 1], dtype=np.float32)
    if grammar:
        logits[_allowed_mask(logits.shape[0], len(ctx) - len(prompt)) == 0] = -np.inf
    return processed_probs(logits, sp, history)


def _exact_marginals(dec, sp, grammar=False, prompt=PROMPT):
    """Exact P(t1), P(t2), P(t3) of target-only sampling with params ``sp`` (shape [3, V])."""
    eng = dec.engine
    p1 = _probs(eng, prompt, sp, grammar, prompt)
    V = p1.shape[0]
    m2 = np.zeros(V)
    m3 = np.zeros(V)
    for t1 in np.nonzero(p1)[0]:
        p2 = _probs(eng, prompt + [int(t1)], sp, grammar, prompt)
        m2 += p1[t1] * p2
        for t2 in np.nonzero(p2)[0]:
            p3 = _probs(eng, prompt + [int(t1), int(t2)], sp, grammar, prompt)
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


def _run(target, drafter, sp, fault=0, prompt=PROMPT, n_tokens=3, **gen):
    """(p-values of the 3 marginals, fraction of runs whose second token came from a draft);
    ``gen``: more ``generate`` keywords (e.g. ``spec_type``). ``n_tokens`` > 3 lets the first
    cycle verify more drafts (its cap is the tokens left - 1); the first 3 tokens are tested."""
    import dataclasses

    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(target, None, n_ctx=64, n_threads=1) as alone:
        exact = _exact_marginals(alone, sp, grammar=bool(sp.grammar), prompt=prompt)
        if sp.grammar:  # the oracle's mask is the grammar's: same marginals from the driver alone
            r = alone.generate(prompt, max_tokens=3, sampling=sp, ignore_eos=True)
            assert all(_allowed_mask(exact.shape[1], i)[t] for i, t in enumerate(r.tokens))
    V = exact.shape[1]
    counts = np.zeros((3, V))
    from_draft = 0
    from tiny_models import FLAT_COSTS

    with DFlashDecoder(target, drafter, n_ctx=64, n_threads=1, cost_model=FLAT_COSTS) as dec:
        for seed in range(N_RUNS):
            r = dec.generate(prompt, max_tokens=n_tokens, sampling=dataclasses.replace(sp, seed=seed), ignore_eos=True,
                             _test_fault=fault, **gen)
            assert len(r.tokens) == n_tokens
            for i, t in enumerate(r.tokens[:3]):
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
    pvals, _ = _run(tiny_llama, tiny_drafters[version], _sp(), fault=1)
    assert pvals[0] > 1e-3  # the prefill token does not go through verification
    print("wrong-rule p-values", pvals)
    assert min(pvals[1:]) < 1e-6, pvals


PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5, repeat_penalty=1.3)


@pytest.mark.parametrize("version, params", [
    (2, PENALTIES),
    pytest.param(1, PENALTIES, marks=pytest.mark.slow),
    (2, {"grammar": GRAMMAR}),
    pytest.param(2, dict(PENALTIES, grammar=GRAMMAR, top_k=16, penalize_prompt=False), marks=pytest.mark.slow),
])
def test_lossless_with_penalties_and_grammar(native_ext, tiny_llama, tiny_drafters, version, params):
    pvals, accepted_first = _run(tiny_llama, tiny_drafters[version], _sp(**params))
    assert accepted_first > 0.05, accepted_first
    print("p-values", pvals, "first draft accepted", accepted_first)
    assert min(pvals) > 1e-3, pvals


@pytest.mark.parametrize("fault, name", [(2, "penalty state advanced with the drafts"),
                                         (3, "next token drawn without the penalties")])
def test_negative_controls_penalty_state(native_ext, tiny_llama, tiny_drafters, fault, name):
    pvals, _ = _run(tiny_llama, tiny_drafters[2], _sp(**PENALTIES), fault=fault)
    print(name, "p-values", pvals)
    assert pvals[0] > 1e-3  # the prefill token does not go through verification
    assert min(pvals[1:]) < 1e-6, (name, pvals)
