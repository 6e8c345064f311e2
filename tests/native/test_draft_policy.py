"""The adaptive draft length (native/draft_policy.h): the chooser's exact optimum, its choices on
a GPU-like and on this CPU's cost curves, and exactness with the choice varying every cycle.

Exactness: the choice uses timings and acceptances of earlier cycles and the drafter's
probabilities of this cycle's drafts, never this cycle's verification, so T = 0 stays the
target's text token for token and T > 0 keeps its distribution whatever k is chosen. The tests
below give the decoder a cost curve under which the choice varies (k_hist has several entries,
cycles without drafting happen), and check the text against the target alone.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytestmark = pytest.mark.native

# This 2-core CPU, SmolLM2-135M Q4_1 (bench's cost model there: a target pass over r rows in units of
# one row, r = 1..8), one decode = 12 ms; the drafter pass ~0.5 decode.
CPU_ROWS = [1.0, 1.86, 2.71, 3.26, 4.09, 4.9, 5.8, 6.70]
# Per-position conditional acceptance of the shipped drafter on GSM8K test prompts (tau 3.00 with
# the full block: models/smollm2-135m-dflash2.json, bench 30 prompts x 256 tokens, T = 0).
SHIPPED_ACCEPT = [0.62, 0.69, 0.70, 0.70, 0.67, 0.70, 0.68]


def _cost(rows, one_ms=12.0, draft_ms=6.0):
    from dflash2_gguf._native_loader import native

    c = native().CostModel()
    c.verify_ms = [one_ms * r for r in rows]
    c.draft_ms = draft_ms
    return c


def _brute(verify_ms, a, k_max, draft_ms):
    best, best_rate = 0, 1.0 / verify_ms[0]
    for k in range(1, min(k_max, len(a), len(verify_ms) - 1) + 1):
        e = 1.0 + sum(np.prod(a[: i + 1]) for i in range(k))
        r = e / (verify_ms[k] + draft_ms)
        if r >= best_rate:
            best, best_rate = k, r
    return best, best_rate


def test_chooser_returns_the_exact_optimum(native_ext):
    from dflash2_gguf._native_loader import native

    rng = np.random.default_rng(0)
    choose = native().choose_draft_length
    for _ in range(500):
        n = int(rng.integers(2, 17))
        verify = np.cumsum(rng.uniform(0.05, 2.0, size=n)) * 10
        a = rng.uniform(0, 1, size=n - 1).tolist()
        k_max = int(rng.integers(0, n))
        draft = float(rng.uniform(0, 20))
        c = _cost([1.0], 1.0, 0.0)
        c.verify_ms = verify.tolist()
        k, rate = choose(c, a, k_max, draft)
        kb, rb = _brute(verify.tolist(), a, k_max, draft)
        assert k == kb and rate == pytest.approx(rb, rel=1e-12)


def test_gpu_like_curve_and_high_confidence_drafts_the_full_block(native_ext):
    from dflash2_gguf._native_loader import native

    flat = _cost([1.0, 1.02, 1.04, 1.05, 1.06, 1.08, 1.1, 1.12], draft_ms=1.0)
    k, _ = native().choose_draft_length(flat, [0.9] * 7, 7, 1.0)
    assert k == 7


def test_this_cpu_curve_and_the_shipped_drafter_mostly_do_not_draft(native_ext):
    from dflash2_gguf._native_loader import native

    choose = native().choose_draft_length
    cpu = _cost(CPU_ROWS)
    # with the drafter pass still to pay, drafting loses to a plain decode
    assert choose(cpu, SHIPPED_ACCEPT, 7, cpu.draft_ms)[0] == 0
    # once paid (sunk), a short draft can still be worth verifying when the drafter is sure
    assert choose(cpu, [0.95, 0.9, 0.2, 0.1, 0.1, 0.1, 0.1], 7, 0.0)[0] in (1, 2)
    # and nothing when it is not
    assert choose(cpu, [0.3] * 7, 7, 0.0)[0] == 0


def _steep():
    # a curve under which the choice depends on the drafter's confidence: each row ~0.15 decode
    return {"verify_ms": [10.0 + 1.5 * i for i in range(16)], "draft_ms": 4.0}


def test_adaptive_varies_k_and_stays_exact(native_ext, smollm2_gguf):
    from pathlib import Path

    from dflash2_gguf import DFlashDecoder, SamplingParams

    shipped = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-dflash2.gguf"
    greedy = SamplingParams.greedy_params()
    qs = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
          "Write a short poem about the sea."]
    with DFlashDecoder(smollm2_gguf, shipped, n_ctx=512, n_threads=2, flash_attn=True, cost_model=_steep()) as dec:
        hist = np.zeros(8, dtype=int)
        for q in qs:
            msgs = [{"role": "user", "content": q}]
            on = dec.generate(messages=msgs, max_tokens=96, sampling=greedy, cache_prompt=False)
            off = dec.generate(messages=msgs, max_tokens=96, sampling=greedy, cache_prompt=False, use_drafter=False)
            assert on.tokens == off.tokens
            hist[: len(on.stats.k_hist)] += on.stats.k_hist
            assert on.stats.predicted_tokens_per_second > 0 and on.stats.measured_tokens_per_second > 0
        assert (hist > 0).sum() >= 3, hist          # the choice varies from cycle to cycle
        assert hist[1:].sum() > 0, hist             # and drafts are verified


def test_gate_skips_the_drafter_when_drafting_does_not_pay(native_ext, smollm2_gguf):
    """This CPU's curve with a drafter pass as costly as 3 decodes: after the first cycles the
    drafter stops running (features keep flowing to it in one batch when it probes again), and
    the text is still the target's."""
    from pathlib import Path

    from dflash2_gguf import DFlashDecoder, SamplingParams

    shipped = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-dflash2.gguf"
    costs = {"verify_ms": [12.0 * r for r in CPU_ROWS], "draft_ms": 36.0}
    greedy = SamplingParams.greedy_params()
    msgs = [{"role": "user", "content": "Describe the water cycle."}]
    with DFlashDecoder(smollm2_gguf, shipped, n_ctx=512, n_threads=2, flash_attn=True, cost_model=costs) as dec:
        on = dec.generate(messages=msgs, max_tokens=96, sampling=greedy, cache_prompt=False)
        # the next request reuses the drafter's features up to the target's KV (pending flushed)
        again = dec.generate(messages=msgs, max_tokens=8, sampling=greedy)
        assert again.stats.n_cached == again.stats.n_prompt - 1
        off = dec.generate(messages=msgs, max_tokens=96, sampling=greedy, cache_prompt=False, use_drafter=False)
        assert on.tokens == off.tokens and again.tokens == on.tokens[:8]
        st = on.stats
        assert st.n_drafter_skipped > st.n_cycles // 2, (st.n_drafter_skipped, st.n_cycles)
        assert st.k_hist[0] > st.n_cycles // 2
        # probes happened after skips: the drafter ran again (its pending features injected first)
        assert st.n_cycles - st.n_drafter_skipped >= 3


def test_n_draft_min_is_a_floor_when_the_drafter_runs(native_ext, smollm2_gguf):
    """llama.cpp's --spec-draft-n-min / speculative.n_min: under a curve where the policy would
    verify 0-2 drafts, every cycle that ran the drafter verifies >= 3 (unless the walk ends at
    the block or the budget), and the text is still the target's."""
    from pathlib import Path

    from dflash2_gguf import DFlashDecoder, SamplingParams

    shipped = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-dflash2.gguf"
    costs = {"verify_ms": [12.0 * r for r in CPU_ROWS], "draft_ms": 0.0}  # drafting free: the gate stays open
    greedy = SamplingParams.greedy_params()
    msgs = [{"role": "user", "content": "Describe the water cycle."}]
    with DFlashDecoder(smollm2_gguf, shipped, n_ctx=512, n_threads=2, flash_attn=True, cost_model=costs) as dec:
        free = dec.generate(messages=msgs, max_tokens=64, sampling=greedy, cache_prompt=False)
        floor = dec.generate(messages=msgs, max_tokens=64, sampling=greedy, cache_prompt=False, n_draft_min=3)
        off = dec.generate(messages=msgs, max_tokens=64, sampling=greedy, cache_prompt=False, use_drafter=False)
    assert free.tokens == floor.tokens == off.tokens
    assert sum(free.stats.k_hist[1:3]) > 0, free.stats.k_hist          # without the floor: short drafts
    h = floor.stats.k_hist
    ran = floor.stats.n_cycles - floor.stats.n_drafter_skipped
    assert sum(h[3:]) >= ran - 2, (h, ran)   # the last cycles may be cut by the 64-token budget
    assert sum(h[1:3]) <= 2, h


@pytest.mark.parametrize("version", [2])
def test_lossless_with_adaptation_varying_k(native_ext, tiny_llama, tiny_drafters, version):
    """T > 0 with a cost curve under which k varies: the marginals of 3 tokens still match the
    target alone's (same chi-square check as tests/native/test_driver_lossless.py)."""
    import dataclasses

    import test_driver_lossless as L

    from dflash2_gguf import DFlashDecoder

    sp = L._sp()
    with DFlashDecoder(tiny_llama, None, n_ctx=64, n_threads=1) as alone:
        exact = L._exact_marginals(alone, sp)
    counts = np.zeros_like(exact)
    ks = set()
    # a random drafter's first draft is accepted ~10-30% of the time: a curve where one extra row
    # costs 3% of a decode makes the choice hinge on its confidence
    costs = {"verify_ms": [10.0 + 0.3 * i for i in range(16)], "draft_ms": 0.0}
    with DFlashDecoder(tiny_llama, tiny_drafters[version], n_ctx=64, n_threads=1, cost_model=costs) as dec:
        for seed in range(L.N_RUNS):
            r = dec.generate(L.PROMPT, max_tokens=3, sampling=dataclasses.replace(sp, seed=seed), ignore_eos=True)
            for i, t in enumerate(r.tokens):
                counts[i, t] += 1
            ks.update(k for k, n in enumerate(r.stats.k_hist) if n)
    pvals = [L._chi2_pvalue(counts[i], exact[i]) for i in range(3)]
    print("p-values", pvals, "k chosen", sorted(ks))
    assert len(ks) >= 2, ks
    assert min(pvals) > 1e-3, pvals


def test_learnt_policy_outlives_the_decoder(native_ext, smollm2_gguf, tmp_path, monkeypatch):
    """cost_model="auto": close() saves the cost model with the acceptance calibration and the
    gate next to it; the next decoder of the same files restores them, so a gate that had closed
    stays closed from the first cycle (a fresh decoder runs the drafter on its first cycle)."""
    import json
    from pathlib import Path

    from dflash2_gguf import DFlashDecoder, SamplingParams

    monkeypatch.setenv("DFLASH2_GGUF_COST_MODELS", str(tmp_path / "cost-models.json"))
    shipped = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-dflash2.gguf"
    greedy = SamplingParams.greedy_params()
    msgs = [{"role": "user", "content": "Describe the water cycle."}]
    kw = dict(n_ctx=512, n_threads=2, flash_attn=True)
    with DFlashDecoder(smollm2_gguf, shipped, **kw) as dec:
        fresh = dec.generate(messages=msgs, max_tokens=24, sampling=greedy, cache_prompt=False)
        reached = [0, 0, 0, 0, 0, 0, 0, 400, 10, 2]
        accepted = [0, 0, 0, 0, 0, 0, 0, 100, 5, 2]
        dec.engine.set_policy_state(reached, accepted, 1e-6, 256)  # a gate closed by earlier losses
    assert fresh.stats.t_draft_s > 0  # no history: the drafter runs
    saved = json.loads((tmp_path / "cost-models.json").read_text())
    (entry,) = saved.values()
    pol = entry["policy"]
    # rows 1..65: the block of 8 and the longest context draft (64) + its anchor
    assert len(entry["verify_ms"]) == 65 and entry["draft_ms"] > 0
    assert pol["reached"][7] == 50.0 and pol["accepted"][7] == 12.5  # scaled to 50 reached, same ratio
    assert pol["reached"][8:] == [10.0, 2.0] and pol["gate_rate"] == 1e-6 and pol["gate_interval"] == 256
    with DFlashDecoder(smollm2_gguf, shipped, **kw) as dec:
        warm = dec.generate(messages=msgs, max_tokens=24, sampling=greedy, cache_prompt=False)
        off = dec.generate(messages=msgs, max_tokens=24, sampling=greedy, cache_prompt=False, use_drafter=False)
        state = dec.engine.policy_state()
    assert warm.tokens == off.tokens == fresh.tokens
    # closed from the first cycle: the drafter never ran (the last cycle has nothing to draft)
    assert warm.stats.t_draft_s == 0 and warm.stats.n_drafter_skipped == warm.stats.n_cycles - 1 > 0
    assert state["gate_interval"] == 256 and state["reached"][7] == 50.0


def test_damaged_saved_cost_model_is_measured_again(native_ext, smollm2_gguf, smollm2_drafters, tmp_path,
                                                    monkeypatch):
    """A saved entry with unmeasured rows (0 ms) or of the wrong shape is not an error: the
    decoder measures a whole model, and a fixed-k generation before the first adaptive one
    (cycles observe some row counts only) does not stand in for a measurement."""
    import json

    from dflash2_gguf import DFlashDecoder, SamplingParams

    monkeypatch.setenv("DFLASH2_GGUF_COST_MODELS", str(tmp_path / "cost-models.json"))
    greedy = SamplingParams.greedy_params()
    kw = dict(n_ctx=512, n_threads=1, flash_attn=True)
    for bad in ({"verify_ms": [11.5, 0, 0, 0, 0, 0, 0, 72.0], "draft_ms": 15.0}, {"verify_ms": "x"}):
        with DFlashDecoder(smollm2_gguf, smollm2_drafters[2], **kw) as dec:
            (tmp_path / "cost-models.json").write_text(json.dumps({dec._cost_key: bad}))
            dec.generate("Hello", max_tokens=6, sampling=greedy, adaptive=False, n_draft_max=3)
            dec.generate("Hello", max_tokens=6, sampling=greedy)
            cm = dec.cost_model
        assert len(cm["verify_ms"]) == 65 and all(x > 0 for x in cm["verify_ms"]), cm
    saved = json.loads((tmp_path / "cost-models.json").read_text())
    assert all(x > 0 for x in next(iter(saved.values()))["verify_ms"])
