"""Context drafts (``spec_type`` ngram-simple / ngram-mod, native/context_drafter.h) stay lossless
and pay where the output repeats its context.

- Greedy: SmolLM2-135M asked to repeat a file it was shown gives the target-alone tokens with each
  source alone, with both, and with both beside the shipped DFlash drafter; the context sources
  draft and get accepted there.
- Sampling: the chi-square test of tests/native/test_driver_lossless.py with context drafts alone, on a
  prompt that repeats the token the tiny target most expects after it (so drafts are accepted
  often); negative control: drawing the token after a rejection from p instead of the residual
  fails it. The same with a one-token context draft continued by the DFlash block (the block
  sees the context token in place of its first mask token and drafts on; a v1 drafter: a random
  v2 drafter's candidates seldom hold the context token, where its walk has no path to continue
  from; the v2 walk is checked at T = 0 on SmolLM2); negative control: the wrong acceptance rule
  on the drafter's rows fails it.
- Penalties and a grammar with context drafts: greedy output equal to the target alone.
- A hybrid target (tiny qwen35) with context drafts alone rolls back natively and stays exact.
- ngram-mod's pool outlives a request: the same request again drafts its output from the start.
- The calibration by match length pools a long copy's evidence over neighbouring lengths (so the
  chooser verifies long copies a few dozen drafts at a time), carries a held copy's estimate to
  the longer lengths it has not reached yet, and a new request keeps what earlier ones taught only
  as a weak prior.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.native

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-dflash2.gguf"


def _copy_prompt():
    code = (Path(__file__).resolve().parents[2] / "dflash2_gguf" / "decoder" / "detok.py").read_text()[:1800]
    return [{"role": "user", "content": "Here is a Python file:\n```python\n" + code +
             "\n```\nRepeat the whole file exactly, changing nothing."}]


@pytest.fixture(scope="module")
def smol_alone(native_ext, smollm2_gguf):
    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(str(smollm2_gguf), None, n_ctx=2048, n_threads=1) as dec:
        yield dec.generate(messages=_copy_prompt(), max_tokens=120, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("spec_type, drafter", [
    ("ngram-simple", False), ("ngram-mod", False), ("ngram-simple,ngram-mod", False),
    (None, True),  # the default with a drafter: draft-dflash, ngram-simple, ngram-mod
])
def test_greedy_copy_task_identical(native_ext, smollm2_gguf, smol_alone, spec_type, drafter):
    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(str(smollm2_gguf), str(SHIPPED) if drafter else None, n_ctx=2048, n_threads=1) as dec:
        r = dec.generate(messages=_copy_prompt(), max_tokens=120, temperature=0, ignore_eos=True,
                         spec_type=spec_type, adaptive=False)
    assert r.tokens == smol_alone.tokens
    ctx = {k: v for k, v in r.stats.sources.items() if k.startswith("ngram")}
    assert sum(v["accepted"] for v in ctx.values()) > 20, r.stats.sources
    assert r.stats.acceptance_length > 1.5
    for name, v in r.stats.sources.items():
        if spec_type is not None and name not in spec_type:
            assert v["cycles"] == 0, (name, r.stats.sources)


def test_greedy_continued_by_dflash_identical(native_ext, smollm2_gguf, smol_alone):
    """Context drafts of at most 2 tokens, each continued by the shipped drafter's block (without
    adaptation a context draft shorter than the block is continued): the target-alone tokens,
    and the drafter's rows are drafted and accepted after context rows."""
    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(str(smollm2_gguf), str(SHIPPED), n_ctx=2048, n_threads=1) as dec:
        r = dec.generate(messages=_copy_prompt(), max_tokens=120, temperature=0, ignore_eos=True,
                         spec_type="draft-dflash,ngram-simple", adaptive=False, spec_ngram_simple_size_m=2)
    assert r.tokens == smol_alone.tokens
    src = r.stats.sources
    assert r.stats.n_continued > 10 and src["draft-dflash"]["accepted"] > 0 and src["ngram-simple"]["accepted"] > 0, src
    assert r.stats.n_drafted == src["draft-dflash"]["drafted"] + src["ngram-simple"]["drafted"]


def test_adaptive_choice_identical_and_counted(native_ext, smollm2_gguf, smol_alone):
    """The adaptive default (measured cost model) picks among the sources; same tokens."""
    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(str(smollm2_gguf), str(SHIPPED), n_ctx=2048, n_threads=1) as dec:
        r = dec.generate(messages=_copy_prompt(), max_tokens=120, temperature=0, ignore_eos=True)
    assert r.tokens == smol_alone.tokens
    assert r.stats.n_cycles == sum(r.stats.k_hist)
    assert sum(v["drafted"] for v in r.stats.sources.values()) == r.stats.n_drafted
    assert sum(v["accepted"] for v in r.stats.sources.values()) == r.stats.n_accepted


def test_calibration_pools_a_copy_across_match_lengths(native_ext):
    """A long copy is verified a few dozen drafts at a time, so each match length past ~16 is seen
    about once per copy: the calibration must pool neighbouring lengths to learn that a copy
    which held goes on. After one copy accepted at lengths 16..63 (each once), lengths 24..63
    predict above 0.95 (one bin per length, the prior 0.9 worth 2 observations and one
    acceptance, gives 0.93), and on Qwen2.5-Coder-1.5B's cost curve on this CPU (a pass over r rows:
    1 -> 34 ms, 5 -> 112, 16 -> 282, 48 -> 581, 64 -> 815) the chooser then verifies 24 or more
    drafts at a 40-token match, where the prior alone gives it a few (8 at most). Short matches that failed stay
    low, and each source keeps its own counts."""
    from dflash2_gguf._native_loader import native

    n = native()
    cal = n.ContextCalibration()
    fresh = n.ContextCalibration()
    for m in range(16, 64):
        cal.observe(1, m, True)
    for _ in range(20):
        cal.observe(1, 1, False)
    for m in (24, 32, 40, 50, 60):
        assert cal.predict(1, m) > 0.95, (m, cal.predict(1, m))
    assert cal.predict(1, 1) < 0.1
    assert cal.predict(2, 40) == fresh.predict(2, 40)  # ngram-mod's counts are its own
    pts = {1: 34.0, 5: 112.0, 16: 282.0, 48: 581.0, 64: 815.0}
    xs = sorted(pts)
    verify = list(np.interp(range(1, 65), xs, [pts[x] for x in xs]))
    cost = n.CostModel()
    cost.verify_ms = verify
    k_learnt, _ = n.choose_draft_length(cost, [cal.predict(1, 40 + i) for i in range(63)], 63)
    k_prior, _ = n.choose_draft_length(cost, [fresh.predict(1, 40 + i) for i in range(63)], 63)
    assert k_learnt >= 24 and k_prior <= 8, (k_learnt, k_prior)
    with pytest.raises(ValueError, match="source must be"):
        cal.predict(3, 1)


def test_calibration_carries_a_held_copy_to_lengths_it_has_not_reached(native_ext):
    """From 12 tokens on, a length bin's prior is at least the estimate of the bin below it: a copy
    accepted at every length from 12 to 40 predicts above 0.97 at 48..127, where no draft was
    seen yet (the length prior alone gives 0.92-0.96 there), and the chooser then verifies 40 or
    more drafts at a 41-token match on Qwen2.5-Coder-1.5B's cost curve (47; with each bin on its
    own prior, 7). A longer bin's own rejections still pull it down, and bins under 12 tokens keep
    their own prior."""
    from dflash2_gguf._native_loader import native

    n = native()
    cal, fresh = n.ContextCalibration(), n.ContextCalibration()
    for m in range(12, 41):
        cal.observe(1, m, True)
    for m in (48, 70, 100, 127):
        assert cal.predict(1, m) > 0.97 and fresh.predict(1, m) < 0.965, (m, cal.predict(1, m), fresh.predict(1, m))
    pts = {1: 34.0, 5: 112.0, 16: 282.0, 48: 581.0, 64: 815.0}
    xs = sorted(pts)
    cost = n.CostModel()
    cost.verify_ms = list(np.interp(range(1, 65), xs, [pts[x] for x in xs]))
    k, _ = n.choose_draft_length(cost, [cal.predict(1, 41 + i) for i in range(63)], 63)
    assert k >= 40, k
    for _ in range(10):
        cal.observe(1, 50, False)
    assert cal.predict(1, 50) < 0.5 and cal.predict(1, 70) <= fresh.predict(1, 70) + 1e-12
    short = n.ContextCalibration()
    for _ in range(20):
        for m in range(1, 5):
            short.observe(1, m, True)
    assert short.predict(1, 5) == fresh.predict(1, 5)


def test_calibration_carries_a_weaker_prior_into_the_next_request(native_ext):
    """What a request taught (a copy of code accepted at every length) carries into the next one
    at most 4 drafts per bin: the acceptance stays high (nearer the prior), but one rejection in
    the new request moves it clearly, where the full evidence would barely notice it."""
    from dflash2_gguf._native_loader import native

    n = native()
    full, carried = n.ContextCalibration(), n.ContextCalibration()
    for cal in (full, carried):
        for _ in range(40):
            cal.observe(1, 12, True)
    before = carried.predict(1, 12)
    carried.new_request()
    assert 0.9 < carried.predict(1, 12) < before  # (4 + 2 * 0.75) / (4 + 2) with the prior
    for cal in (full, carried):
        cal.observe(1, 12, False)
    assert full.predict(1, 12) > 0.95 and carried.predict(1, 12) < 0.85, (full.predict(1, 12), carried.predict(1, 12))


def _repeat_prompt(target):
    """A prompt ending inside a repeating pattern of the target's own greedy output: the tiny
    target falls into such loops, so its likely next tokens are in the context and the context
    drafts get accepted often enough for the test to see acceptances and residual draws."""
    from dflash2_gguf import DFlashDecoder

    start = [1, 9, 30, 17, 22]
    with DFlashDecoder(target, None, n_ctx=64, n_threads=1) as dec:
        g = dec.generate(start, max_tokens=30, temperature=0, ignore_eos=True).tokens
    return start + g


def test_sampling_lossless_context_drafts(native_ext, tiny_llama):
    from test_driver_lossless import _run, _sp

    prompt = _repeat_prompt(tiny_llama)
    pvals, accepted_first = _run(tiny_llama, None, _sp(temperature=0.4), prompt=prompt, spec_type="ngram-simple,ngram-mod")
    print("p-values", pvals, "second token from a context draft", accepted_first)
    assert accepted_first > 0.05, accepted_first
    assert min(pvals) > 1e-3, pvals


def test_negative_control_residual_with_context_drafts(native_ext, tiny_llama):
    """A point-mass draft's q is 1, so the acceptance test alone cannot tell u < p from
    u * q < p; what a wrong rule breaks is the draw after a rejection (it must exclude the
    drafted token): drawing it from p instead fails the test."""
    from test_driver_lossless import _run, _sp

    pvals, _ = _run(tiny_llama, None, _sp(temperature=0.4), fault=5, prompt=_repeat_prompt(tiny_llama),
                    spec_type="ngram-simple")
    print("residual-from-p p-values", pvals)
    assert min(pvals[1:]) < 1e-6, pvals


# a one-token context draft (size_m 1) continued by the block; 4 tokens so that the first cycle
# may verify 2 drafts (tokens 2 and 3: the context draft, then the drafter's first row)
_CONTINUED = dict(n_tokens=4, spec_type="draft-dflash,ngram-simple", adaptive=False, spec_ngram_simple_size_m=1)


def test_sampling_lossless_context_drafts_continued_by_dflash(native_ext, tiny_llama, tiny_drafters):
    import dataclasses

    from dflash2_gguf import DFlashDecoder
    from test_driver_lossless import _run, _sp

    prompt = _repeat_prompt(tiny_llama)
    sp = _sp(temperature=0.4)
    gen = {k: v for k, v in _CONTINUED.items() if k != "n_tokens"}
    with DFlashDecoder(tiny_llama, tiny_drafters[1], n_ctx=64, n_threads=1) as dec:
        runs = [dec.generate(prompt, max_tokens=4, sampling=dataclasses.replace(sp, seed=s), ignore_eos=True, **gen)
                for s in range(100)]
    cont = [r for r in runs if r.stats.n_continued > 0]
    assert len(cont) > 30 and sum(r.stats.sources["draft-dflash"]["accepted"] for r in cont) > 0
    pvals, from_draft = _run(tiny_llama, tiny_drafters[1], sp, prompt=prompt, **_CONTINUED)
    print("p-values", pvals, "second token from a draft", from_draft)
    assert min(pvals) > 1e-3, pvals


def test_negative_control_continued_wrong_rule(native_ext, tiny_llama, tiny_drafters):
    """Accepting the drafter's continuation rows with u < p (ignoring their q) must fail: the
    test sees the continued rows."""
    from test_driver_lossless import _run, _sp

    pvals, _ = _run(tiny_llama, tiny_drafters[1], _sp(temperature=0.4), fault=1, prompt=_repeat_prompt(tiny_llama),
                    **_CONTINUED)
    print("wrong-rule p-values", pvals)
    assert min(pvals[2:]) < 1e-6, pvals


@pytest.mark.parametrize("params", [dict(presence_penalty=1.5, frequency_penalty=0.5, repeat_penalty=1.3),
                                    dict(grammar='root ::= [a-z_ ():=\\n]+')])
def test_penalties_and_grammar_greedy(native_ext, smollm2_gguf, params):
    from dflash2_gguf import DFlashDecoder, SamplingParams

    sp = SamplingParams(temperature=0.0, **params)
    out = {}
    for spec in ("none", "ngram-simple,ngram-mod"):
        with DFlashDecoder(str(smollm2_gguf), None, n_ctx=2048, n_threads=1) as dec:
            r = dec.generate(messages=_copy_prompt(), max_tokens=80, sampling=sp, ignore_eos=True, spec_type=spec,
                             adaptive=False)
        out[spec] = r
    assert out["ngram-simple,ngram-mod"].stats.n_drafted > 0
    assert out["ngram-simple,ngram-mod"].tokens == out["none"].tokens


def test_hybrid_target_with_context_drafts(native_ext):
    from benchmarks.tiny_targets import tiny_target
    from benchmarks.upstream import UpstreamUnavailable
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from tiny_models import FLAT_COSTS

    try:
        t = tiny_target("qwen35")
    except UpstreamUnavailable as e:
        pytest.skip(str(e))
    sp = SamplingParams(temperature=0.0)
    prompt = [1] + [4, 5, 6, 7, 8, 9, 10] * 6
    with DFlashDecoder(t, None, n_ctx=512, n_threads=1) as alone:
        base = alone.generate(prompt, max_tokens=120, sampling=sp, ignore_eos=True)
    with DFlashDecoder(t, None, n_ctx=512, n_threads=1, cost_model=FLAT_COSTS) as dec:
        r = dec.generate(prompt, max_tokens=120, sampling=sp, ignore_eos=True, spec_type="ngram-simple", adaptive=False)
    assert r.stats.rollback == "native" and r.stats.sources["ngram-simple"]["drafted"] > 0
    assert r.stats.n_rollbacks > 0
    assert r.tokens == base.tokens


def test_ngram_mod_pool_outlives_the_request(native_ext, smollm2_gguf):
    """The second identical request (no prompt cache) finds the first one's output in the pool."""
    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(str(smollm2_gguf), None, n_ctx=2048, n_threads=1) as dec:
        msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
        kw = dict(max_tokens=60, temperature=0, ignore_eos=True, spec_type="ngram-mod", adaptive=False,
                  cache_prompt=False, spec_ngram_mod_n_match=4, spec_ngram_mod_n_min=1)
        first = dec.generate(messages=msgs, **kw)
        second = dec.generate(messages=msgs, **kw)
    assert second.tokens == first.tokens
    assert second.stats.sources["ngram-mod"]["accepted"] > first.stats.sources["ngram-mod"]["accepted"] + 20


def test_bad_spec_type_is_refused(native_ext, tiny_llama):
    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(tiny_llama, None, n_ctx=64, n_threads=1) as dec:
        with pytest.raises(ValueError, match="ngram-map-k.*not available here.*ngram-simple"):
            dec.generate([1, 5], max_tokens=2, spec_type="ngram-map-k")
        with pytest.raises(ValueError, match="draft-dflash needs a drafter"):
            dec.generate([1, 5], max_tokens=2, spec_type="draft-dflash")


def test_target_sample_acceptance_gives_the_target_alone_text_for_a_seed(native_ext, smollm2_gguf):
    """spec_accept="target-sample" (llama-server's rule): at T = 1 with the shipped drafter and
    context drafts, every seed gives the target-alone text token for token; the default rejection
    sampling gives other texts of the same distribution (tests/native/test_driver_lossless.py)."""
    from dflash2_gguf import DFlashDecoder, SamplingParams

    msgs = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half "
                                        "as many clips in May. How many clips did Natalia sell altogether?"}]
    with DFlashDecoder(str(smollm2_gguf), None, n_ctx=1024, n_threads=1) as dec:
        alone = [dec.generate(messages=msgs, max_tokens=64, sampling=SamplingParams(temperature=1.0, seed=s)).tokens
                 for s in range(4)]
    with DFlashDecoder(str(smollm2_gguf), str(SHIPPED), n_ctx=1024, n_threads=1) as dec:
        same, other, accepted = [], [], 0
        for s in range(4):
            sp = SamplingParams(temperature=1.0, seed=s)
            r = dec.generate(messages=msgs, max_tokens=64, sampling=sp, spec_accept="target-sample", adaptive=False)
            same.append(r.tokens)
            accepted += r.stats.n_accepted
            other.append(dec.generate(messages=msgs, max_tokens=64, sampling=sp, adaptive=False).tokens)
        with pytest.raises(ValueError, match="spec_accept"):
            dec.generate(messages=msgs, max_tokens=4, spec_accept="greedy")
    assert same == alone
    assert accepted > 0  # drafts were accepted, not merely skipped
    assert other != alone


def test_small_context_measures_what_fits(native_ext, tiny_llama, tiny_drafters, tmp_path, monkeypatch):
    """n_ctx 64 leaves no room for a 65-row pass after the synthetic prompt: the cost model covers
    the block and as many context-draft rows as fit, and generation runs (no 'n_ctx is too small')."""
    from dflash2_gguf import DFlashDecoder

    monkeypatch.setenv("DFLASH2_GGUF_COST_MODELS", str(tmp_path / "cost-models.json"))
    prompt = [1] + [4, 5, 6, 7] * 4
    with DFlashDecoder(tiny_llama, None, n_ctx=64, n_threads=1) as alone:
        base = alone.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True).tokens
    with DFlashDecoder(tiny_llama, tiny_drafters[2], n_ctx=64, n_threads=1) as dec:
        rows, block = dec.engine.cost_rows(), dec.block_size
        r = dec.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True)
        assert len(dec.cost_model["verify_ms"]) == rows
    assert block <= rows < 65
    assert r.tokens == base
