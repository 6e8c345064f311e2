"""Pure sampling math (no native build): processed distribution and lossless rejection step."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2_gguf.decoder.sampling import SamplingParams, processed_probs, rejection_step, residual


def _sp(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    base.update(kw)
    return SamplingParams(**base)


def test_defaults_and_validation():
    sp = SamplingParams()
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed) == (0.8, 40, 0.95, 0.05, None)
    assert SamplingParams.greedy_params().greedy
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_plain_softmax_and_temperature():
    x = np.array([1.0, 2.0, 0.5, -1.0])
    p = processed_probs(x, _sp())
    np.testing.assert_allclose(p, np.exp(x) / np.exp(x).sum())
    p2 = processed_probs(x, _sp(temperature=0.5))
    np.testing.assert_allclose(p2, np.exp(2 * x) / np.exp(2 * x).sum())
    with pytest.raises(ValueError):
        processed_probs(x, SamplingParams.greedy_params())


def test_filters_in_llama_cpp_order():
    x = np.array([3.0, 2.0, 1.0, 0.0, -1.0, 2.0])
    # top_k keeps the k largest (tie 2.0 at ids 1 and 5: both kept with k=3)
    p = processed_probs(x, _sp(top_k=3))
    assert set(np.nonzero(p)[0]) == {0, 1, 5}
    # top_p on the temperature-1 probabilities of the survivors: smallest prefix reaching top_p
    q = np.exp(x) / np.exp(x).sum()
    order = np.argsort(-x, kind="stable")
    need = int(np.searchsorted(np.cumsum(q[order]), 0.8) + 1)
    p = processed_probs(x, _sp(top_p=0.8, temperature=2.0))
    assert set(np.nonzero(p)[0]) == set(order[:need].tolist())
    # min_p relative to the top probability (before temperature)
    p = processed_probs(x, _sp(min_p=0.3, temperature=3.0))
    assert set(np.nonzero(p)[0]) == set(np.nonzero(q >= 0.3 * q.max())[0].tolist())
    assert p.sum() == pytest.approx(1.0)


def _exact_output(p, q, wrong=False):
    """Exact distribution of the token one rejection step emits (draft ~ q)."""
    acc = np.minimum(1.0, p / np.where(q > 0, q, 1)) if not wrong else p
    acc = np.where(q > 0, acc, 0)
    p_acc = q * acc
    return p_acc + (1 - p_acc.sum()) * residual(p, q)


@pytest.mark.parametrize("seed", range(5))
def test_rejection_step_is_exactly_lossless(seed):
    rng = np.random.default_rng(seed)
    V = 30
    p = processed_probs(rng.normal(size=V) * 2, _sp(top_k=12))
    q = np.zeros(V)
    cand = rng.choice(V, 16, replace=False)           # a DFlash-2-like candidate set
    q[cand] = np.exp(rng.normal(size=16))
    q /= q.sum()
    np.testing.assert_allclose(_exact_output(p, q), p, atol=1e-12)
    assert np.abs(_exact_output(p, q, wrong=True) - p).sum() > 0.05  # u < p is not lossless


def test_rejection_step_monte_carlo_and_zero_residual():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.2, 0.0])
    q = np.array([0.1, 0.1, 0.1, 0.7])
    n = 20000
    counts = np.zeros(4)
    for _ in range(n):
        d = int(rng.choice(4, p=q))
        _, tok = rejection_step(d, p, q, rng)
        counts[tok] += 1
    np.testing.assert_allclose(counts / n, p, atol=0.015)
    # q == p: the residual is all zero, the fallback is p itself
    np.testing.assert_allclose(residual(p, p), p)
