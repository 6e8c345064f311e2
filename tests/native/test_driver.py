"""Native driver on tiny random targets: greedy equality, capture paths, stats, lifetime, errors.

Targets are tiny F32 GGUFs (``tiny_models.py``: llama records layer inputs, qwen2 goes through
the cb_eval capture); drafters are random checkpoints in the authors' format converted with our
converter. Everything here runs in seconds on 2 CPU cores.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiny_models import rewrite_gguf, tiny_drafter

pytestmark = pytest.mark.native

GREEDY = None


def greedy():
    from dflash2_gguf import SamplingParams

    return SamplingParams.greedy_params()


def _prompts(n):
    rng = np.random.default_rng(123)
    return [[1] + rng.integers(4, 48, size=int(rng.integers(2, 12))).tolist() for _ in range(n)]


def _decoder(target, drafter=None, **kw):
    from dflash2_gguf import DFlashDecoder

    from tiny_models import FLAT_COSTS

    kw.setdefault("n_ctx", 512)
    kw.setdefault("n_threads", 1)
    kw.setdefault("cost_model", FLAT_COSTS)
    if drafter is not None:  # these tests are the DFlash drafter's (context drafts: test_context_drafts.py)
        kw.setdefault("spec_type", "draft-dflash")
    return DFlashDecoder(target, drafter, **kw)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("n_draft_max", [None, 2])
def test_greedy_equals_target_alone_with_acceptance(native_ext, tiny_peaked, version, n_draft_max):
    """T = 0 with a drafter that is often right: identical tokens, and drafts were accepted."""
    target, drafters = tiny_peaked
    with _decoder(target, drafters[version]) as dec, _decoder(target) as alone:
        acc = 0
        for ids in _prompts(6):
            r = dec.generate(ids, max_tokens=40, sampling=greedy(), ignore_eos=True, n_draft_max=n_draft_max)
            ref = alone.generate(ids, max_tokens=40, sampling=greedy(), ignore_eos=True)
            assert r.tokens == ref.tokens
            assert len(r.tokens) == 40 and len(r.from_draft) == 40
            st = r.stats
            assert sum(r.from_draft) == st.n_accepted
            assert st.n_drafted <= st.n_cycles * (n_draft_max or dec.block_size - 1)
            assert st.acceptance_length == pytest.approx((st.n_generated - 1) / st.n_cycles)
            acc += st.n_accepted
        assert acc > 10, "the peaked fixture should make greedy drafts accepted"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("version", [1, 2])
def test_greedy_equals_target_alone_capture_paths(native_ext, tiny_dir, tiny_llama, tiny_qwen2, tiny_drafters,
                                                  arch, version):
    """Both capture paths (llama: layer inputs, qwen2: cb_eval) keep T = 0 output unchanged."""
    target = tiny_llama if arch == "llama" else tiny_qwen2
    with _decoder(target, tiny_drafters[version]) as dec, _decoder(target) as alone:
        assert dec.capture_path == ("layer_inp" if arch == "llama" else "cb_eval")
        for ids in _prompts(4):
            r = dec.generate(ids, max_tokens=32, sampling=greedy(), ignore_eos=True)
            assert r.tokens == alone.generate(ids, max_tokens=32, sampling=greedy(), ignore_eos=True).tokens


def test_greedy_equals_llama_cpp(native_ext, tiny_peaked):
    """Independent reference: llama_cpp.Llama greedy on the same token ids."""
    import llama_cpp

    target, drafters = tiny_peaked
    # flash attention on both sides (our decoder: llama.cpp's auto, which picks it on CPU)
    llm = llama_cpp.Llama(str(target), n_ctx=512, n_threads=1, flash_attn=True, verbose=False)
    with _decoder(target, drafters[2]) as dec:
        for ids in _prompts(4):
            r = dec.generate(ids, max_tokens=32, sampling=greedy(), ignore_eos=True)
            llm.reset()
            ref = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
                ref.append(int(tok))
                if len(ref) == 32:
                    break
            assert r.tokens == ref


def test_cb_eval_features_equal_layer_inputs(native_ext, tiny_llama, tiny_drafters):
    """On a llama target both capture paths give the same features (l_out-{id} == input of id+1)."""
    ids = _prompts(1)[0] * 3
    with _decoder(tiny_llama, tiny_drafters[2], capture="layer_inp") as a, \
         _decoder(tiny_llama, tiny_drafters[2], capture="cb_eval") as b:
        fa = a.engine.capture_features(ids)
        fb = b.engine.capture_features(ids)
        assert fa.shape == (len(ids), 2 * 288)
        np.testing.assert_allclose(fa, fb, rtol=0, atol=1e-6)
        r1 = a.generate(ids, max_tokens=16, sampling=greedy(), ignore_eos=True)
        r2 = b.generate(ids, max_tokens=16, sampling=greedy(), ignore_eos=True)
        assert r1.tokens == r2.tokens


def test_stream_matches_generate(native_ext, tiny_peaked):
    from dflash2_gguf import SamplingParams

    target, drafters = tiny_peaked
    with _decoder(target, drafters[1]) as dec:
        ids = _prompts(1)[0]
        for sp in (greedy(), SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=7)):
            r = dec.generate(ids, max_tokens=30, sampling=sp, ignore_eos=True)
            chunks = list(dec.generate(ids, max_tokens=30, sampling=sp, ignore_eos=True, stream=True))
            assert [t for c in chunks for t in c.tokens] == r.tokens
            assert [f for c in chunks for f in c.from_draft] == r.from_draft
            assert chunks[-1].done and chunks[-1].stats is not None
            assert "".join(c.text for c in chunks) == r.text
            assert chunks[-1].stats.n_accepted == r.stats.n_accepted


def test_same_seed_same_output_and_p_min(native_ext, tiny_peaked):
    from dflash2_gguf import SamplingParams

    target, drafters = tiny_peaked
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    with _decoder(target, drafters[2]) as dec:
        ids = _prompts(1)[0]
        a = dec.generate(ids, max_tokens=24, sampling=sp, ignore_eos=True)
        b = dec.generate(ids, max_tokens=24, sampling=sp, ignore_eos=True)
        assert a.tokens == b.tokens
        # p_min = 1: no draft is ever confident enough -> no drafts, same greedy output
        g = dec.generate(ids, max_tokens=24, sampling=greedy(), ignore_eos=True, p_min=1.0)
        assert g.stats.n_drafted == 0 and g.stats.n_cycles == 23
        assert g.tokens == dec.generate(ids, max_tokens=24, sampling=greedy(), ignore_eos=True).tokens


def test_stop_string_and_eog(native_ext, tiny_peaked):
    target, drafters = tiny_peaked
    with _decoder(target, drafters[2]) as dec:
        ids = _prompts(1)[0]
        full = dec.generate(ids, max_tokens=40, sampling=greedy(), ignore_eos=True)
        stop = full.text[10:13]
        r = dec.generate(ids, max_tokens=40, sampling=greedy(), ignore_eos=True, stop=stop)
        assert r.finish_reason == "stop" and stop not in r.text
        assert full.text.startswith(r.text) and len(r.tokens) < 40
        assert r.tokens == full.tokens[: len(r.tokens)]


def test_chat_and_text_prompt_smollm2(native_ext, smollm2_gguf):
    with _decoder(smollm2_gguf, n_ctx=256, n_threads=2) as dec:
        msgs = [{"role": "user", "content": "Say hi."}]
        text = dec.apply_chat_template(msgs)
        assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")
        r = dec.generate(messages=msgs, max_tokens=8, sampling=greedy())
        assert 1 <= len(r.tokens) <= 8 and isinstance(r.text, str)
        r2 = dec.generate("The capital of France is", max_tokens=4, sampling=greedy())
        assert r2.tokens == dec.generate(dec.tokenize("The capital of France is"), max_tokens=4, sampling=greedy()).tokens
        with pytest.raises(ValueError):
            dec.generate("x", messages=msgs)


def test_close_twice_context_manager_and_closed_error(native_ext, tiny_llama, tiny_drafters):
    from dflash2_gguf import ClosedError

    dec = _decoder(tiny_llama, tiny_drafters[1])
    with dec:
        assert dec.has_drafter and dec.drafter_version == 1 and dec.block_size == 6
    dec.close()
    dec.close()
    with pytest.raises(ClosedError):
        dec.generate([1, 5], max_tokens=2)
    d2 = _decoder(tiny_llama, tiny_drafters[2])
    assert d2.drafter_version == 2
    del d2  # freed by __del__


def test_bad_arguments(native_ext, tiny_llama):
    from dflash2_gguf import ContextFullError

    with _decoder(tiny_llama, n_ctx=16) as dec:
        with pytest.raises(ValueError):
            dec.generate([1, 5], max_tokens=0)
        with pytest.raises(ValueError):
            dec.generate([1, 999], max_tokens=2)
        with pytest.raises(ValueError):
            dec.generate([1, 5], max_tokens=2, top_p=0.0)
        with pytest.raises(TypeError):
            dec.generate([1, 5], max_tokens=2, temprature=1.0)
        with pytest.raises(ContextFullError) as ei:
            dec.generate(list(range(4, 40)), max_tokens=2)
        assert ei.value.code == 5
        r = dec.generate([1, 5], max_tokens=100, sampling=greedy(), ignore_eos=True)
        assert r.finish_reason == "context" and len(r.tokens) == 16 - 2 + 1


# ------------------------------------------------------------------------------ mismatched pairs


@pytest.fixture(scope="module")
def bad_drafters(tiny_dir, tiny_drafters):
    """Drafters whose metadata no longer fits the tiny llama target (metadata rewritten)."""
    d2 = tiny_drafters[2]
    return {
        "hidden": rewrite_gguf(d2, tiny_dir / "bad_hidden.gguf", {"dflash.embedding_length": 320}),
        "layers": rewrite_gguf(d2, tiny_dir / "bad_layers.gguf", {"dflash.target_layers": [1, 4]}),
        "narrow": rewrite_gguf(d2, tiny_dir / "bad_narrow.gguf", {"dflash.selector_top_k": 17}),
    }


@pytest.mark.parametrize("kind, needle", [
    ("hidden", "hidden size mismatch"),
    ("layers", "outside the target's usable layers"),
    ("narrow", "too narrow"),
])
def test_mismatched_pairs_raise_before_generation(native_ext, tiny_llama, bad_drafters, kind, needle):
    from dflash2_gguf import IncompatibleDrafterError

    with pytest.raises(IncompatibleDrafterError, match=needle) as ei:
        _decoder(tiny_llama, bad_drafters[kind])
    assert ei.value.code == 2 and isinstance(ei.value, ValueError)


def test_vocab_mismatch_real_pair(native_ext, smollm2_gguf, tiny_drafters):
    """A real drafter for another target (vocab 48 vs SmolLM2's 49152) is refused up front."""
    from dflash2_gguf import IncompatibleDrafterError

    with pytest.raises(IncompatibleDrafterError, match="vocabulary mismatch"):
        _decoder(smollm2_gguf, tiny_drafters[1])


def test_target_as_drafter_and_missing_file(native_ext, tiny_llama):
    from dflash2_gguf import IncompatibleDrafterError

    with pytest.raises(IncompatibleDrafterError, match="expected 'dflash'"):
        _decoder(tiny_llama, tiny_llama)
    with pytest.raises(FileNotFoundError):
        _decoder(tiny_llama, "/nonexistent/drafter.gguf")


def test_import_checks_the_pinned_libllama(native_ext, monkeypatch):
    """The loaded libllama is the pinned build; a different one is refused at import with the fix."""
    import dflash2_gguf._native_loader as loader

    mod = loader.native()
    assert mod.PINNED_LLAMA_CPP_COMMIT == "0c1e570" and mod.check_libllama() == ""
    monkeypatch.setattr(loader, "_native", None)
    monkeypatch.setattr(mod, "check_libllama", lambda: "loaded libllama reports version 'other'")
    with pytest.raises(ImportError, match="reports version 'other'"):
        loader.native()


def test_recurrent_target_with_drafter_rolls_back_by_checkpoint(native_ext, tiny_dir, tiny_drafters):
    """A recurrent target (mamba, hand-written here; more archs in test_driver_hybrid.py) runs with
    a drafter: its state is copied before each verify pass and restored on a rejection, so greedy
    output equals the target alone."""
    from tiny_models import FLAT_COSTS, write_tiny_mamba

    from dflash2_gguf import DFlashDecoder, SamplingParams

    t = write_tiny_mamba(tiny_dir / "tiny_mamba.gguf")
    sp = SamplingParams.greedy_params()
    with DFlashDecoder(t, None, n_ctx=128, n_threads=1) as dec:
        alone = dec.generate([1, 5, 6], max_tokens=48, sampling=sp, ignore_eos=True)
        assert alone.stats.n_drafted == 0
    with DFlashDecoder(t, tiny_drafters[2], n_ctx=128, n_threads=1, cost_model=FLAT_COSTS) as dec:
        assert dec.rollback_mode == "checkpoint"
        r = dec.generate([1, 5, 6], max_tokens=48, sampling=sp, ignore_eos=True, adaptive=False)
    assert r.stats.n_rollbacks > 0 and r.stats.rollback == "checkpoint"
    assert r.tokens == alone.tokens


def test_capture_path_decided_by_architecture(native_ext, tiny_dir, tiny_qwen2):
    """Forcing layer inputs on qwen2 (whose graph does not record them: libllama would abort the
    process) is refused with an exception instead."""
    from dflash2_gguf import UnsupportedError

    d = tiny_drafter(tiny_dir / "q2", tiny_qwen2, version=1, seed=5)
    with pytest.raises(UnsupportedError, match="does not record layer inputs"):
        _decoder(tiny_qwen2, d, capture="layer_inp")
    with _decoder(tiny_qwen2, d) as dec:
        assert dec.capture_path == "cb_eval"


def test_from_llama_target(native_ext, tiny_llama, tiny_drafters):
    """A decoder built from an existing llama_cpp.Llama target gives that Llama's greedy output."""
    import llama_cpp

    from dflash2_gguf import DFlashDecoder

    llm = llama_cpp.Llama(str(tiny_llama), n_ctx=256, n_threads=1, verbose=False)
    with DFlashDecoder.from_llama(llm, tiny_drafters[2]) as dec:
        assert dec.engine.n_ctx == 256
        ids = _prompts(1)[0]
        r = dec.generate(ids, max_tokens=12, sampling=greedy(), ignore_eos=True)
        ref = []
        for tok in llm.generate(ids, temp=0.0, reset=True):
            ref.append(int(tok))
            if len(ref) == 12:
                break
        assert r.tokens == ref


def test_short_drafter_context(native_ext, tiny_peaked):
    """A drafter context shorter than the target's: drafting stops when the block no longer fits,
    generation continues with the target alone, output unchanged."""
    target, drafters = tiny_peaked
    ids = [1] + list(range(4, 44))
    with _decoder(target, drafters[2], n_ctx=256, n_ctx_draft=48) as dec, _decoder(target, n_ctx=256) as alone:
        r = dec.generate(ids, max_tokens=30, sampling=greedy(), ignore_eos=True)
        assert r.tokens == alone.generate(ids, max_tokens=30, sampling=greedy(), ignore_eos=True).tokens
        assert 0 < r.stats.n_drafted < r.stats.n_cycles * (dec.block_size - 1)


def test_context_shift_with_drafter_equals_target_alone(native_ext, tiny_peaked):
    """llama-server's --context-shift: a 64-cell context generating 150 tokens shifts several times;
    with a drafter the shifts come at the same positions and the greedy text is the target's."""
    from tiny_models import FLAT_COSTS

    from dflash2_gguf import DFlashDecoder, SamplingParams

    target, drafters = tiny_peaked
    sp = SamplingParams.greedy_params()
    prompt = [1, 5, 9, 14, 20, 7, 7, 33, 12, 40]
    kw = dict(max_tokens=150, sampling=sp, ignore_eos=True, context_shift=True, n_keep=4)
    with DFlashDecoder(target, None, n_ctx=64, n_threads=1) as dec:
        alone = dec.generate(prompt, **kw)
        short = dec.generate(prompt, max_tokens=150, sampling=sp, ignore_eos=True)
    assert alone.stats.n_ctx_shifts >= 3 and len(alone.tokens) == 150
    assert short.stats.stop_reason == "context" and len(short.tokens) < 64
    with DFlashDecoder(target, drafters[2], n_ctx=64, n_threads=1, cost_model=FLAT_COSTS) as dec:
        spec = dec.generate(prompt, adaptive=False, **kw)
    assert spec.stats.n_ctx_shifts == alone.stats.n_ctx_shifts and spec.stats.n_accepted > 0
    assert spec.tokens == alone.tokens
