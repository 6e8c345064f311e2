"""Targets with a recurrent state or a sliding window: the driver stays exact on them.

Tiny random targets of four architectures (``benchmarks/tiny_targets.py``: transformers models
converted by llama.cpp's own converter at the pinned commit, cut to the 48-token test vocabulary,
built once and cached):

- ``qwen35`` (hybrid, Gated DeltaNet + attention): libllama rolls its state back natively
  (``n_rs_seq`` snapshots);
- ``qwen3next`` (hybrid) and ``mamba2`` (pure recurrent): no native rollback, so the driver copies
  the recurrent state before each verify pass, restores it on a rejection and decodes the accepted
  tokens again;
- ``gemma3`` (sliding-window attention, window 8, shorter than every generation here): a plain KV
  rollback, exact because a verify pass overwrites only cells already outside the window.

A random drafter is rejected almost every cycle, so nearly every cycle rolls back. For each
target: greedy output with a drafter equals the target alone (full block, and the adaptive
default), also with penalties and a grammar; sampling keeps the target's distribution (chi-square,
as tests/native/test_driver_lossless.py); a 3-turn chat through the prompt cache prefills only the new
tokens and gives the text of a cold run. Negative control: with the rollback switched off (test
hook) the greedy output is no longer the target's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.native]

#: arch -> the rollback the driver must pick for it.
ROLLBACK = {"qwen35": "native", "qwen3next": "checkpoint", "mamba2": "checkpoint", "gemma3": "kv"}
ARCHS = list(ROLLBACK)
PROMPTS = [[1, 5, 9, 14, 20, 7, 7, 33], [1, 40, 41, 42, 4, 4, 17], [1, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 12]]
N_GEN = 160
FAULT_NO_ROLLBACK = 4  # native/acceptance.h kFaultNoRollback


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    """arch -> (target GGUF, random 1-layer DFlash 2 drafter GGUF, block 6, target layers 1 and 3)."""
    from benchmarks.tiny_targets import tiny_target
    from benchmarks.upstream import UpstreamUnavailable
    from tiny_models import tiny_drafter

    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for arch in ARCHS:
        try:
            t = tiny_target(arch)
        except UpstreamUnavailable as e:  # the registry is unreachable: nothing to build them from
            pytest.skip(str(e))
        out[arch] = (t, tiny_drafter(root / arch, t, version=2, target_layer_ids=(0, 2), seed=3))
    return out


def _greedy(target, drafter, prompt, **kw):
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from tiny_models import FLAT_COSTS

    sp = kw.pop("sampling", SamplingParams(temperature=0.0))
    opts = dict(n_ctx=512, n_threads=1)
    if drafter is not None and kw.pop("flat", True):
        opts["cost_model"] = FLAT_COSTS
    with DFlashDecoder(target, drafter, **opts) as dec:
        r = dec.generate(prompt, max_tokens=kw.pop("max_tokens", N_GEN), sampling=sp, ignore_eos=True, **kw)
        return r, dec.rollback_mode


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_target_alone(native_ext, hybrid, arch):
    target, drafter = hybrid[arch]
    for prompt in PROMPTS:
        alone, mode0 = _greedy(target, None, prompt)
        full, mode = _greedy(target, drafter, prompt, adaptive=False)
        assert mode == ROLLBACK[arch] and full.stats.rollback == ROLLBACK[arch]
        assert mode0 == ROLLBACK[arch]  # the target alone keeps its snapshots for context drafts
        # the drafter ran every cycle and nearly every cycle rolled back
        assert full.stats.n_drafted >= 4 * full.stats.n_cycles
        assert full.stats.n_rollbacks >= full.stats.n_cycles // 2
        if ROLLBACK[arch] == "checkpoint":
            assert full.stats.n_redecoded >= full.stats.n_rollbacks
        assert full.tokens == alone.tokens, (arch, prompt)
        # the adaptive default (measured cost model) drafts fewer, still exact
        adaptive, _ = _greedy(target, drafter, prompt, flat=False)
        assert adaptive.tokens == alone.tokens, (arch, prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_context_drafts_continued_by_the_block(native_ext, hybrid, arch):
    """Two-token context drafts continued by the DFlash block (without adaptation) roll back
    like any draft on every memory kind: the target-alone tokens."""
    target, drafter = hybrid[arch]
    prompt = [1] + [5, 9, 14, 20, 7] * 8
    alone, _ = _greedy(target, None, prompt)
    r, _ = _greedy(target, drafter, prompt, adaptive=False, spec_type="draft-dflash,ngram-simple",
                   spec_ngram_simple_size_m=2)
    assert r.stats.n_continued > 0 and r.stats.n_rollbacks > 0, r.stats
    assert r.tokens == alone.tokens, arch


@pytest.mark.parametrize("arch", ARCHS)
def test_negative_control_without_rollback(native_ext, hybrid, arch):
    """The greedy test fails with the rollback off: other tokens, or libllama refuses the next
    batch (positions that no longer follow the memory's, as M-RoPE targets check)."""
    from dflash2_gguf.errors import DecodeError

    target, drafter = hybrid[arch]
    differ = 0
    for prompt in PROMPTS:
        alone, _ = _greedy(target, None, prompt)
        try:
            broken, _ = _greedy(target, drafter, prompt, adaptive=False, _test_fault=FAULT_NO_ROLLBACK)
            differ += broken.tokens != alone.tokens
        except DecodeError:
            differ += 1
    assert differ == len(PROMPTS), f"{arch}: output unchanged with the rollback off in {len(PROMPTS) - differ} prompts"


@pytest.mark.parametrize("arch", ARCHS)
def test_penalties_and_grammar_greedy(native_ext, hybrid, arch):
    from dflash2_gguf import SamplingParams

    from test_driver_lossless import GRAMMAR

    target, drafter = hybrid[arch]
    for params in (dict(presence_penalty=1.5, frequency_penalty=0.5, repeat_penalty=1.3), dict(grammar=GRAMMAR)):
        sp = SamplingParams(temperature=0.0, **params)
        alone, _ = _greedy(target, None, PROMPTS[0], sampling=sp, max_tokens=96)
        spec, _ = _greedy(target, drafter, PROMPTS[0], sampling=sp, max_tokens=96, adaptive=False)
        assert spec.stats.n_rollbacks > 0
        assert spec.tokens == alone.tokens, (arch, params)


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_lossless(native_ext, hybrid, arch):
    from test_driver_lossless import _run, _sp

    target, drafter = hybrid[arch]
    pvals, accepted_first = _run(target, drafter, _sp())
    print(arch, "p-values", pvals, "first draft accepted", accepted_first)
    assert accepted_first > 0.02, accepted_first
    assert min(pvals) > 1e-3, pvals


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_cache_three_turns(native_ext, hybrid, arch):
    """Turn t's prompt = turn t-1's prompt + its reply + a new message: the prefill covers only
    the new tokens (and the last reply token, never decoded), the text equals a cold run."""
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from tiny_models import FLAT_COSTS

    target, drafter = hybrid[arch]
    sp = SamplingParams(temperature=0.0)
    new_msgs = [[1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], [44, 45, 46, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]
    with DFlashDecoder(target, drafter, n_ctx=512, n_threads=1, cost_model=FLAT_COSTS) as dec:
        prompt: list = []
        for turn, msg in enumerate(new_msgs):
            held = len(prompt)
            prompt = prompt + msg
            warm = dec.generate(prompt, max_tokens=40, sampling=sp, ignore_eos=True, adaptive=False)
            if turn > 0:
                # all of the last turn is reused but its last reply token (not in the cache yet)
                assert warm.stats.n_cached == held - 1, (arch, turn, warm.stats.n_cached, held)
            with DFlashDecoder(target, drafter, n_ctx=512, n_threads=1, cost_model=FLAT_COSTS) as cold_dec:
                cold = cold_dec.generate(prompt, max_tokens=40, sampling=sp, ignore_eos=True, adaptive=False)
            assert cold.stats.n_cached == 0
            assert warm.tokens == cold.tokens, (arch, turn)
            prompt = prompt + warm.tokens
        # a prompt that shares only part of the history goes back to a prompt checkpoint (or the
        # start) and still matches a cold run
        side = prompt[:20] + [t for t in (16, 17, 18) if t != prompt[20]][:2]
        warm = dec.generate(side, max_tokens=40, sampling=sp, ignore_eos=True, adaptive=False)
        assert warm.stats.n_cached <= 20
        if ROLLBACK[arch] != "kv":
            assert warm.stats.n_cached == len(new_msgs[0]) - 4  # the checkpoint 4 tokens before turn 1's end
        with DFlashDecoder(target, drafter, n_ctx=512, n_threads=1, cost_model=FLAT_COSTS) as cold_dec:
            cold = cold_dec.generate(side, max_tokens=40, sampling=sp, ignore_eos=True, adaptive=False)
        assert warm.tokens == cold.tokens, arch


def test_sliding_window_past_its_cache(native_ext, hybrid):
    """gemma3 with window 8 and a 16-token batch: its sliding-window cache has 256 cells, so a
    400-token generation overwrites cells; verify passes stay exact, and a later prompt that shares
    only the first 20 tokens (their cells long overwritten) is not served from them."""
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from tiny_models import FLAT_COSTS

    target, drafter = hybrid["gemma3"]
    sp = SamplingParams(temperature=0.0)
    opts = dict(n_ctx=1024, n_batch=16, n_threads=1)
    prompt = PROMPTS[2]
    with DFlashDecoder(target, None, **opts) as alone:
        base = alone.generate(prompt, max_tokens=400, sampling=sp, ignore_eos=True)
    with DFlashDecoder(target, drafter, cost_model=FLAT_COSTS, **opts) as dec:
        spec = dec.generate(prompt, max_tokens=400, sampling=sp, ignore_eos=True, adaptive=False)
        assert spec.stats.rollback == "kv" and spec.stats.n_rollbacks > 100
        assert spec.tokens == base.tokens
        history = prompt + spec.tokens
        side = history[:20] + [t for t in (16, 17) if t != history[20]][:1]
        warm = dec.generate(side, max_tokens=60, sampling=sp, ignore_eos=True, adaptive=False)
        # the prompt checkpoint 4 tokens before the first prompt's end is the only usable state
        assert warm.stats.n_cached == len(prompt) - 4
    with DFlashDecoder(target, drafter, cost_model=FLAT_COSTS, **opts) as cold_dec:
        cold = cold_dec.generate(side, max_tokens=60, sampling=sp, ignore_eos=True, adaptive=False)
    assert warm.tokens == cold.tokens


@pytest.fixture(scope="module")
def qwen35_text(tmp_path_factory):
    """The tiny qwen35 target with SmolLM2's tokenizer and chat template (text prompts) and a
    random drafter for it."""
    from benchmarks.tiny_targets import random_drafter, tiny_target
    from benchmarks.upstream import UpstreamUnavailable

    try:
        t = tiny_target("qwen35", vocab="full")
    except UpstreamUnavailable as e:
        pytest.skip(str(e))
    return t, random_drafter(t, tmp_path_factory.mktemp("q35text") / "drafter.gguf")


def test_generate_serve_bench_on_qwen35(native_ext, qwen35_text, tmp_path, capsys):
    """The user's three entry points on a hybrid target with a drafter give the target's text at
    T = 0: `dflash2-gguf generate --json`, a chat request to `serve`, and `bench` (0 mismatches)."""
    import json

    httpx = pytest.importorskip("httpx")

    from dflash2_gguf import DFlashDecoder
    from dflash2_gguf.cli import main

    target, drafter = qwen35_text
    out = {}
    for md in ("none", str(drafter)):
        assert main(["generate", "-m", str(target), "-md", md, "-p", "Hello, how are", "-n", "48", "--temp", "0",
                     "--ignore-eos", "-t", "1", "--json", "--spec-draft-adaptive", "off"]) == 0
        out[md] = json.loads(capsys.readouterr().out)
    assert out[str(drafter)]["rollback"] == "native" and out[str(drafter)]["n_rollbacks"] > 0
    assert out[str(drafter)]["tokens"] == out["none"]["tokens"]

    from live_server import LiveServer

    from dflash2_gguf.server.app import ServerSettings

    chat = [{"role": "user", "content": "Name three colours."}]
    with DFlashDecoder(str(target), None, n_ctx=512, n_threads=1) as dec:
        ref = dec.generate(messages=chat, max_tokens=40, temperature=0, ignore_eos=True).text
    s = ServerSettings(model=str(target), model_draft=str(drafter), n_ctx=512, n_threads=1, adaptive=False)
    with LiveServer(s) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "messages": chat, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"] == ref
        assert body["timings"]["draft_n"] > 0

    rc = main(["bench", "-m", str(target), "-md", str(drafter), "--dataset", "gsm8k", "--n-prompts", "2",
               "--max-new-tokens", "32", "--out", str(tmp_path / "bench"), "--no-progress", "-t", "1",
               "--spec-draft-adaptive", "off"])
    assert rc == 0
    rep = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert rep["config"]["rollback"] == "native"
    assert rep["summary"]["mismatches"] == 0 and rep["summary"]["n_drafted"] > 0


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_ram_prompt_cache_keeps_checkpoints(native_ext, hybrid, arch):
    """A side request replaces the live state; the conversation comes back from the RAM cache with
    its prompt checkpoints, and the next turn prefills only its new tokens, as a cold run's text.

    Batches of at most 16 tokens: llama.cpp's Gated DeltaNet takes a chunked path for longer
    ubatches whose rounding differs from the per-token one, so a cold 100-token prefill of the
    tiny qwen35 and the same tokens decoded piecewise part at a near-tie after ~30 greedy tokens,
    with the target alone as much as with a drafter (the attention targets' README note on batch
    shapes, larger here)."""
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from tiny_models import FLAT_COSTS

    target, drafter = hybrid[arch]
    sp = SamplingParams(temperature=0.0)
    kw = dict(max_tokens=40, sampling=sp, ignore_eos=True, adaptive=False)
    convo = [1] + [4 + (7 * i) % 40 for i in range(60)]
    opts = dict(n_ctx=512, n_batch=16, n_threads=1, cost_model=FLAT_COSTS)
    with DFlashDecoder(target, drafter, **opts) as dec:
        first = dec.generate(convo, **kw)
        dec.generate([1, 44, 45, 46, 47], **kw)  # the side request: the conversation goes to RAM
        turn2 = convo + first.tokens + [9, 10, 11]
        warm = dec.generate(turn2, **kw)
        assert warm.stats.n_cache_restored > 0
        assert warm.stats.n_cached == len(convo) + len(first.tokens) - 1
        # and a prompt that leaves the conversation early comes back through a checkpoint
        early = convo[:30] + [5, 5]
        back = dec.generate(early, **kw)
        assert 0 < back.stats.n_cached <= 30
    with DFlashDecoder(target, drafter, **opts) as cold:
        assert cold.generate(turn2, **kw).tokens == warm.tokens
        assert cold.generate(early, **kw).tokens == back.tokens


def test_readme_targets_table_matches_llama_cpp():
    """README's `native` and `checkpoint` rows list exactly llama.cpp 0c1e570's recurrent / hybrid
    architectures, split by llm_arch_supports_rs_rollback (src/llama-arch.cpp)."""
    import re

    from benchmarks.upstream import UpstreamUnavailable, cache_dir, fetch_upstream

    try:
        root = fetch_upstream(needed=("convert_hf_to_gguf.py", "src/llama-arch.cpp"),
                              root=cache_dir() / "upstream-arch-0c1e570")
    except UpstreamUnavailable as e:
        pytest.skip(str(e))
    src = (root / "src" / "llama-arch.cpp").read_text()
    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+),\s*\"([^\"]+)\"\s*\}", src))

    def cases(fn):
        body = src[src.index(f"bool {fn}(const llm_arch & arch)"):]
        body = body[:body.index("default:")]
        return {names[c] for c in re.findall(r"case (LLM_ARCH_\w+):", body)}

    stateful = cases("llm_arch_is_recurrent") | cases("llm_arch_is_hybrid")
    native = cases("llm_arch_supports_rs_rollback") & stateful
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()

    def row(mech):
        line = next(ln for ln in readme.splitlines() if ln.startswith(f"| `{mech}` | recurrent"))
        return {a.strip() for a in line.split("|")[3].replace(";", ",").split(",")}

    assert row("native") == native
    assert row("checkpoint") == stateful - native
