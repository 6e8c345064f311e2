"""Tests of the converter (``convert/``): schema, values, libllama loading, bad inputs, CLI.

No network. Real target: SmolLM2-135M Q4_1 (fixture ``smollm2_gguf``, hidden 576, 30 layers,
vocab 49152). Tiny target: a tensor-less GGUF with SmolLM2's tokenizer, hidden 512, 8 layers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFReader, GGUFValueType as VT  # noqa: E402

from checkpoints import make_dflash_checkpoint  # noqa: E402
from convert import ConversionError, convert_hf_to_gguf, inspect_gguf  # noqa: E402
from convert.__main__ import main as cli_main  # noqa: E402
from convert.config import parse_config  # noqa: E402
from convert.names import ARCH, KEYS, TARGET_LAYER_OFFSET, TENSORS  # noqa: E402

TINY_HIDDEN = 512
TINY_LAYERS = 8
TINY_IDS = (1, 3, 5)


# --------------------------------------------------------------------------------------------
# helpers


_FIELDS_CACHE: dict = {}


def _fields(path, reader=None) -> dict:
    """name -> (main type, sub type or None, python value) read straight from GGUFReader.

    GGUFReader takes seconds on a 49k-token tokenizer, so results are cached per file state.
    """
    st = Path(path).stat()
    ck = (str(path), st.st_mtime_ns, st.st_size)
    if ck in _FIELDS_CACHE:
        return _FIELDS_CACHE[ck]
    r = reader if reader is not None else GGUFReader(path)
    out = _FIELDS_CACHE[ck] = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = f.types[0]
        sub = f.types[-1] if t == VT.ARRAY else None
        if t == VT.ARRAY:
            if sub == VT.STRING:
                val = [bytes(f.parts[i]) for i in f.data]
            else:
                val = np.concatenate([f.parts[i] for i in f.data]).tolist()
        elif t == VT.STRING:
            val = bytes(f.parts[f.data[0]]).decode()
        else:
            val = f.parts[f.data[0]][0].item()
        out[name] = (t, sub, val)
    return out


def _fast_fields(path) -> dict:
    """Like :func:`_fields` through convert's own header reader (fast; not an oracle)."""
    from convert.gguf_meta import read_header

    out = {}
    for k, v in read_header(path).kv.items():
        val = v.value.decode() if isinstance(v.value, bytes) else v.value
        out[k] = (v.vtype, v.sub_type, val)
    return out


def _source_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF checkpoint as float32 numpy (read with safetensors + torch)."""
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k).to(torch.float32).numpy()
    return out


# HF name -> GGUF name, written independently of convert/names.py (from upstream llama.cpp 0c1e570's
# gguf-py/gguf/constants.py and tensor_mapping.py, MODEL_ARCH.DFLASH).
def _gguf_name(hf: str) -> str:
    fixed = {
        "fc.weight": "fc.weight",
        "hidden_norm.weight": "enc.output_norm.weight",
        "norm.weight": "output_norm.weight",
        "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
        "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
        "candidate_selector.successor_codebook": "selector_successor.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, n, rest = hf.split(".", 2)
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "attention_conv.base_kernel": "attn_conv_base",
        "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
        "mlp_conv.base_kernel": "ffn_conv_base",
        "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
    }
    return f"blk.{n}.{per_layer[rest]}"


def _expected_type(gguf_name: str, shape, matrix: QT) -> QT:
    if len(shape) == 1 or gguf_name.endswith("_conv_base"):
        return QT.F32
    if matrix in (QT.Q8_0, QT.Q4_0) and shape[-1] % 32:
        return QT.F16
    return matrix


def _check_tensors(out: Path, src: Path, matrix: QT, *, tol: float = 0.0, reader=None) -> dict:
    """Names, shapes, types and values of ``out`` against the checkpoint ``src``."""
    source = _source_tensors(src)
    r = reader if reader is not None else GGUFReader(out)
    got = {t.name: t for t in r.tensors}
    assert set(got) == {_gguf_name(n) for n in source}
    for hf, arr in source.items():
        t = got[_gguf_name(hf)]
        assert list(reversed([int(x) for x in t.shape])) == list(arr.shape), hf
        if matrix is not None:
            assert t.tensor_type == _expected_type(t.name, arr.shape, matrix), t.name
        deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(arr.shape)
        if t.tensor_type == QT.F32:
            np.testing.assert_array_equal(deq, arr, err_msg=t.name)
        elif t.tensor_type == QT.F16:
            np.testing.assert_array_equal(deq, arr.astype(np.float16).astype(np.float32), err_msg=t.name)
        elif t.tensor_type == QT.BF16:
            np.testing.assert_array_equal(deq, arr, err_msg=t.name)  # sources are bf16 or exact
        else:
            err = np.abs(deq - arr).max()
            assert err <= tol * np.abs(arr).max(), (t.name, t.tensor_type.name, err)
    return got


def _expected_keys(*, version: int, n_layers: int, hidden: int, ffn: int, ids, rank=None,
                   file_type: int, mask: int) -> dict:
    keys = {
        "general.architecture": (VT.STRING, None, "dflash"),
        "general.type": (VT.STRING, None, "model"),
        "general.file_type": (VT.UINT32, None, file_type),
        "general.quantization_version": (VT.UINT32, None, 2),
        "dflash.block_count": (VT.UINT32, None, n_layers),
        "dflash.context_length": (VT.UINT32, None, 40960),
        "dflash.embedding_length": (VT.UINT32, None, hidden),
        "dflash.feed_forward_length": (VT.UINT32, None, ffn),
        "dflash.attention.head_count": (VT.UINT32, None, 8),
        "dflash.attention.head_count_kv": (VT.UINT32, None, 4),
        "dflash.rope.freq_base": (VT.FLOAT32, None, 1000000.0),
        "dflash.attention.layer_norm_rms_epsilon": (VT.FLOAT32, None, float(np.float32(1e-6))),
        "dflash.attention.key_length": (VT.UINT32, None, 64),
        "dflash.attention.value_length": (VT.UINT32, None, 64),
        "dflash.block_size": (VT.UINT32, None, 8),
        "dflash.target_layers": (VT.ARRAY, VT.INT32, [i + 1 for i in ids]),
        "tokenizer.ggml.mask_token_id": (VT.UINT32, None, mask),
    }
    if version == 2:
        keys.update({
            "dflash.attention.causal": (VT.BOOL, None, False),
            "dflash.conv_kernel_size": (VT.UINT32, None, 2),
            "dflash.conv_group_size": (VT.UINT32, None, 16),
            "dflash.selector_rank": (VT.UINT32, None, rank),
            "dflash.selector_top_k": (VT.UINT32, None, 16),
        })
    return keys


def _check_keys(out: Path, target: Path, expected: dict, reader=None) -> dict:
    got = _fields(out, reader)
    tgt = _fields(target)
    for k, v in expected.items():
        assert got.get(k) == v, (k, got.get(k), v)
    dflash_keys = {k for k in got if k.startswith("dflash.")}
    assert dflash_keys == {k for k in expected if k.startswith("dflash.")}
    general = {k for k in got if k.startswith("general.")}
    assert {"general.name", "general.size_label"} <= general
    assert general <= set(expected) | {"general.name", "general.size_label", "general.version",
                                       "general.basename", "general.finetune"}
    # the target's whole tokenizer, same types and values
    tok = {k: v for k, v in tgt.items() if k.startswith("tokenizer.") and k != "tokenizer.ggml.mask_token_id"}
    assert tok, "target has no tokenizer keys"
    for k, v in tok.items():
        assert got[k] == v, k
    assert {k for k in got if k.startswith("tokenizer.")} == set(tok) | {"tokenizer.ggml.mask_token_id"}
    return got


class _Llama:
    """Tiny libllama harness (low-level ctypes API), logs silenced."""

    def __init__(self):
        self.ll = pytest.importorskip("llama_cpp.llama_cpp")

        @self.ll.llama_log_callback
        def _quiet(level, text, user_data):  # noqa: ARG001
            pass

        self._cb = _quiet
        self.ll.llama_log_set(self._cb, None)
        self.ll.llama_backend_init()

    def close(self):
        import ctypes

        from llama_cpp import _logger

        self.ll.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))

    def load(self, path):
        mp = self.ll.llama_model_default_params()
        m = self.ll.llama_model_load_from_file(str(path).encode(), mp)
        assert m, f"libllama refused {path}"
        return m

    def meta(self, model, name: str) -> str:
        import ctypes

        buf = ctypes.create_string_buffer(256)
        n = self.ll.llama_model_meta_val_str(model, name.encode(), buf, 256)
        return buf.value.decode() if n >= 0 else ""

    def context(self, model, ctx_other=None):
        cp = self.ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64
        cp.n_threads = cp.n_threads_batch = 2
        if ctx_other is not None:
            cp.ctx_other = ctx_other
        ctx = self.ll.llama_init_from_model(model, cp)
        assert ctx
        return ctx


@pytest.fixture(scope="module")
def llama():
    h = _Llama()
    yield h
    h.close()


@pytest.fixture(scope="session")
def tiny_target(smollm2_gguf, tmp_path_factory) -> Path:
    """Tensor-less llama-arch GGUF: hidden 512, 8 layers, SmolLM2's tokenizer (exact types)."""
    from convert.target import read_kv

    path = tmp_path_factory.mktemp("tiny-target") / "tiny-target.gguf"
    kv = read_kv(smollm2_gguf)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-target")
    w.add_uint32("llama.block_count", TINY_LAYERS)
    w.add_uint32("llama.embedding_length", TINY_HIDDEN)
    w.add_uint32("llama.context_length", 2048)
    for k, v in kv.items():
        if k.startswith("tokenizer."):
            w.add_key_value(k, v.value, v.vtype, v.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def _tiny_ckpt(path, **kw):
    args = dict(hidden_size=TINY_HIDDEN, intermediate_size=512, num_layers=1, target_layer_ids=TINY_IDS,
                num_target_layers=TINY_LAYERS, selector_rank=32)
    args.update(kw)
    return make_dflash_checkpoint(path, **args)


# --------------------------------------------------------------------------------------------
# the name table


def _upstream_constants():
    candidates = [os.environ.get("DFLASH2_UPSTREAM_CONSTANTS", ""),
                  "/tmp/llsrc/vendor/llama.cpp/gguf-py/gguf/constants.py",
                  str(Path.home() / ".cache/dflash2-gguf/upstream-0c1e570/gguf-py/gguf/constants.py")]
    for c in candidates:
        if c and Path(c).is_file():
            spec = importlib.util.spec_from_file_location("_upstream_gguf_constants", c)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    pytest.skip("upstream gguf-py constants.py (llama.cpp 0c1e570) not at hand")


def test_names_match_upstream():
    up = _upstream_constants()
    assert up.MODEL_ARCH_NAMES[up.MODEL_ARCH.DFLASH] == ARCH
    for alias, k in KEYS.items():
        obj = up.Keys
        for part in k.upstream.split("."):
            obj = getattr(obj, part)
        assert obj == k.template, (alias, obj, k.template)
    allowed = set(up.MODEL_TENSORS[up.MODEL_ARCH.DFLASH])
    for rule in TENSORS:
        member = up.MODEL_TENSOR[rule.upstream]
        assert up.TENSOR_NAMES[member] == rule.gguf, rule
        assert member in allowed, rule
    assert TARGET_LAYER_OFFSET == 1


# --------------------------------------------------------------------------------------------
# config parsing


def test_config_variants(tmp_path):
    base = json.loads((_tiny_ckpt(tmp_path / "a", version=2, vocab_size=1024, mask_token_id=7) / "config.json").read_text())
    c = parse_config(base)
    assert (c.version, c.block_size, c.rope_theta, c.causal, c.sliding_window) == (2, 8, 1e6, False, None)

    v1 = json.loads((_tiny_ckpt(tmp_path / "b", version=1, vocab_size=1024, block_size=16) / "config.json").read_text())
    assert "block_size" not in v1["dflash_config"] and v1["block_size"] == 16
    c1 = parse_config(v1)
    assert (c1.version, c1.block_size, c1.causal, c1.conv_kernel_size) == (1, 16, None, None)

    # nested wins over top level; rope_parameters (transformers 5); SWA via layer_types
    cfg = dict(base, block_size=4, rope_theta=None, rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
               use_sliding_window=True, sliding_window=2048, layer_types=["sliding_attention"],
               output_multiplier=0.5, is_causal=True)
    cfg["dflash_config"] = dict(base["dflash_config"], output_multiplier=0.25, final_logit_softcapping=20.0,
                                input_embedding_scale=2.0)
    c2 = parse_config(cfg)
    assert c2.block_size == 8 and c2.rope_theta == 5e5 and c2.output_multiplier == 0.25
    assert (c2.sliding_window, c2.sliding_window_pattern, c2.causal) == (2048, (True,), True)
    assert (c2.final_logit_softcapping, c2.input_embedding_scale) == (20.0, 2.0)
    # softcap 0 means none; use_swa in dflash_config marks every layer
    cfg3 = dict(base, final_logit_softcapping=0.0, sliding_window=None)
    cfg3["dflash_config"] = dict(base["dflash_config"], use_swa=True, swa_window_size=64)
    c3 = parse_config(cfg3)
    assert c3.final_logit_softcapping is None and c3.sliding_window_pattern == (True,)

    with pytest.raises(ConversionError, match="layer_types"):
        parse_config(dict(base, layer_types=["full_attention", "full_attention"]))
    with pytest.raises(ConversionError, match="hidden_size"):
        parse_config({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ConversionError, match="selector_rank"):
        parse_config(dict(base, dflash_config={k: v for k, v in base["dflash_config"].items() if k != "selector_rank"}))


# --------------------------------------------------------------------------------------------
# real target: 5-layer v2 (81 tensors), 5-layer sharded v1 (58 tensors)


def test_v2_five_layers_smollm2(tmp_path, smollm2_gguf, llama):
    ck = make_dflash_checkpoint(tmp_path / "drafter-v2", num_layers=5, selector_rank=32)
    out = convert_hf_to_gguf(ck, smollm2_gguf, outfile=tmp_path / "d.gguf", outtype="f16")
    assert out == tmp_path / "d.gguf" and sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "drafter-v2"]
    reader = GGUFReader(out)
    got = _check_tensors(out, ck, QT.F16, reader=reader)
    assert len(got) == 81
    _check_keys(out, smollm2_gguf, _expected_keys(version=2, n_layers=5, hidden=576, ffn=1536, ids=(1, 14, 27),
                                                  rank=32, file_type=1, mask=49151), reader)
    info = inspect_gguf(out, target=smollm2_gguf)
    assert (info["version"], info["tensor_count"], info["fits"], info["reasons"]) == ("v2", 81, True, [])
    assert info["target_layers_hf"] == [1, 14, 27]

    ll = llama.ll
    m = llama.load(out)
    tm = llama.load(smollm2_gguf)
    try:
        assert llama.meta(m, "general.architecture") == "dflash"
        assert (ll.llama_model_n_embd(m), ll.llama_model_n_layer(m), ll.llama_model_n_head(m)) == (576, 5, 8)
        tctx = llama.context(tm)
        dctx = llama.context(m, ctx_other=tctx)
        # one draft block [anchor, MASK x 7], bidirectional, every row an output
        ll.llama_set_causal_attn(dctx, False)
        batch = ll.llama_batch_init(8, 0, 1)
        for i, tok in enumerate([1] + [49151] * 7):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = 8
        assert ll.llama_decode(dctx, batch) == 0
        row = np.ctypeslib.as_array(ll.llama_get_logits_ith(dctx, 1), shape=(49152,))
        assert np.isfinite(row).all() and row.std() > 0
        ll.llama_batch_free(batch)
        ll.llama_free(dctx)
        ll.llama_free(tctx)
    finally:
        ll.llama_model_free(m)
        ll.llama_model_free(tm)


def test_v1_five_layers_sharded_f32(tmp_path, smollm2_gguf, llama):
    ck = make_dflash_checkpoint(tmp_path / "drafter-v1", version=1, num_layers=5, shards=3, dtype="float16")
    assert (ck / "model.safetensors.index.json").is_file()
    import tracemalloc

    tracemalloc.start()
    try:
        out = convert_hf_to_gguf(str(ck), str(smollm2_gguf), outfile=str(tmp_path / "d1.gguf"), outtype="f32")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # streaming: the F32 model is ~68 MB, its largest tensor 3.5 MB; the copied tokenizer ~8 MB
    assert out.stat().st_size > 60e6 and peak < 24e6, peak
    reader = GGUFReader(out)
    got = _check_tensors(out, ck, QT.F32, reader=reader)
    assert len(got) == 58
    _check_keys(out, smollm2_gguf, _expected_keys(version=1, n_layers=5, hidden=576, ffn=1536, ids=(1, 14, 27),
                                                  file_type=0, mask=49151), reader)
    assert "dflash.attention.causal" not in _fields(out, reader)  # upstream writes none for v1
    assert inspect_gguf(out)["version"] == "v1"
    m = llama.load(out)
    try:
        assert llama.meta(m, "general.architecture") == "dflash"
        assert llama.ll.llama_model_n_layer(m) == 5
    finally:
        llama.ll.llama_model_free(m)


# --------------------------------------------------------------------------------------------
# outtypes on the tiny target


@pytest.mark.parametrize("outtype,matrix,ftype,tol", [
    ("bf16", QT.BF16, 32, 0.0),
    ("q8_0", QT.Q8_0, 7, 0.01),
    ("q4_0", QT.Q4_0, 2, 0.15),
])
def test_outtypes(tmp_path, tiny_target, outtype, matrix, ftype, tol):
    ck = _tiny_ckpt(tmp_path / "ck", intermediate_size=544)  # 544 % 32 == 0; down_proj rows 544
    out = convert_hf_to_gguf(ck, tiny_target, outfile=tmp_path / "o.gguf", outtype=outtype)
    got = _check_tensors(out, ck, matrix, tol=tol)
    assert len(got) == 3 + 11 + 4 + 3
    assert _fast_fields(out)["general.file_type"] == (VT.UINT32, None, ftype)


def test_q8_0_falls_back_to_f16_on_odd_rows(tmp_path, tiny_target, caplog):
    ck = _tiny_ckpt(tmp_path / "ck", intermediate_size=520)  # down_proj rows of 520: not /32
    out = convert_hf_to_gguf(ck, tiny_target, outfile=tmp_path / "o.gguf", outtype="q8_0")
    types = inspect_gguf(out)["tensor_types"]
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"
    assert "falling back to F16" in caplog.text


@pytest.mark.parametrize("outtype,ftype", [("q4_k_m", 15), pytest.param("q6_k", 18, marks=pytest.mark.slow)])
def test_k_quants(tmp_path, tiny_target, llama, outtype, ftype):
    ck = _tiny_ckpt(tmp_path / "ck", selector_rank=256, intermediate_size=768)
    out = convert_hf_to_gguf(ck, tiny_target, outfile=tmp_path / "k.gguf", outtype=outtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "k.gguf"]  # temps removed
    got = _check_tensors(out, ck, None, tol=0.2)
    assert got["blk.0.attn_conv_base"].tensor_type == QT.F32
    assert got["blk.0.attn_norm.weight"].tensor_type == QT.F32
    kq = {t.tensor_type for t in got.values()} - {QT.F32}
    assert kq and kq <= {QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q5_0, QT.Q5_1}
    assert _fast_fields(out)["general.file_type"] == (VT.UINT32, None, ftype)
    m = llama.load(out)
    llama.ll.llama_model_free(m)


def test_optional_keys_written_with_upstream_types(tmp_path, tiny_target):
    ck = _tiny_ckpt(tmp_path / "ck", config_overrides={
        "is_causal": True, "use_sliding_window": True, "sliding_window": 2048,
        "layer_types": ["sliding_attention"], "rope_theta": None,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                            "original_max_position_embeddings": 4096},
        "dflash_config": {"output_multiplier": 0.196, "final_logit_softcapping": 20.0,
                          "input_embedding_scale": 2.0}})
    out = convert_hf_to_gguf(ck, tiny_target, outfile=tmp_path / "o.gguf", outtype="f32")
    f = _fast_fields(out)
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    assert f["dflash.attention.causal"] == (VT.BOOL, None, True)
    assert f["dflash.attention.sliding_window"] == (VT.UINT32, None, 2048)
    assert f["dflash.attention.sliding_window_pattern"] == (VT.ARRAY, VT.BOOL, [True])
    assert f["dflash.logit_scale"] == (VT.FLOAT32, None, f32(0.196))
    assert f["dflash.final_logit_softcapping"] == (VT.FLOAT32, None, 20.0)
    assert f["dflash.embedding_scale"] == (VT.FLOAT32, None, 2.0)
    assert f["dflash.rope.freq_base"] == (VT.FLOAT32, None, 10000.0)
    assert f["dflash.rope.scaling.type"] == (VT.STRING, None, "yarn")
    assert f["dflash.rope.scaling.factor"] == (VT.FLOAT32, None, 4.0)
    assert f["dflash.rope.scaling.original_context_length"] == (VT.UINT32, None, 4096)
    assert f["dflash.target_layers"] == (VT.ARRAY, VT.INT32, [2, 4, 6])


# --------------------------------------------------------------------------------------------
# bad inputs: ConversionError, nothing left in the output folder


def _drop_tensor(ck: Path, name: str | None = None, add: str | None = None):
    from safetensors.numpy import load_file, save_file

    f = ck / "model.safetensors"
    t = load_file(str(f))
    if name:
        del t[name]
    if add:
        t[add] = np.zeros((4, 4), np.float32)
    save_file(t, str(f))


def _truncate(ck: Path):
    f = ck / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)


BAD = [
    ("unknown arch", dict(config_overrides={"architectures": ["LlamaForCausalLM"]}), None, "unknown drafter architecture"),
    ("missing tensor", {}, lambda ck: _drop_tensor(ck, name="layers.0.mlp.up_proj.weight"), "missing tensors: layers.0.mlp.up_proj.weight"),
    ("unexpected tensor", {}, lambda ck: _drop_tensor(ck, add="extra.weight"), "unexpected tensors: extra.weight"),
    ("misshaped", dict(config_overrides={"intermediate_size": 640}), None, "misshaped tensors: .*layers.0.mlp.down_proj.weight"),
    ("truncated", {}, _truncate, "truncated"),
    ("conv group", dict(config_overrides={"dflash_config": {"conv_group_size": 24}}), None, "conv_group_size 24 does not divide"),
    ("small v2 hidden", dict(hidden_size=256, num_heads=4, num_kv_heads=2), None, "top_k"),
    ("mask outside vocab", dict(mask_token_id=49152), None, "mask_token_id 49152 is outside"),
    ("hidden mismatch", dict(hidden_size=576), None, "hidden size 576 != target embedding length 512"),
    ("vocab mismatch", dict(vocab_size=1024, mask_token_id=3), None, "vocab size 1024 != target vocab 49152"),
    ("layer beyond depth", dict(target_layer_ids=(1, 3, 7)), None, "beyond the target's depth"),
    ("missing key", dict(config_overrides={"num_attention_heads": None}), None, "num_attention_heads"),
]


@pytest.mark.parametrize("what,kw,mutate,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(tmp_path, tiny_target, what, kw, mutate, msg):
    kw = dict(kw)
    kw.setdefault("dtype", "float32")
    ck = _tiny_ckpt(tmp_path / "ck", version=kw.pop("version", 2), selector_rank=16, **kw)
    if mutate:
        mutate(ck)
    before = sorted(p.name for p in ck.iterdir())
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConversionError, match=msg):
        convert_hf_to_gguf(ck, tiny_target, outfile=out_dir / "x.gguf", outtype="q8_0")
    assert list(out_dir.iterdir()) == []
    assert sorted(p.name for p in ck.iterdir()) == before


def test_bad_options_and_targets(tmp_path, tiny_target, monkeypatch):
    ck = _tiny_ckpt(tmp_path / "ck", version=1, dtype="float32")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConversionError, match="unknown outtype"):
        convert_hf_to_gguf(ck, tiny_target, outfile=out_dir / "x.gguf", outtype="q3_k")
    existing = out_dir / "exists.gguf"
    existing.write_bytes(b"keep")
    with pytest.raises(ConversionError, match="exists"):
        convert_hf_to_gguf(ck, tiny_target, outfile=existing)
    assert existing.read_bytes() == b"keep" and sorted(p.name for p in out_dir.iterdir()) == ["exists.gguf"]
    assert convert_hf_to_gguf(ck, tiny_target, outfile=existing, force=True) == existing
    assert GGUFReader(existing).fields["general.architecture"]
    existing.unlink()

    # HF target folder: the checks run, then a folder without tokenizer.json asks for the GGUF
    hf = tmp_path / "hf-target"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"hidden_size": 512, "num_hidden_layers": 8, "vocab_size": 49152}))
    with pytest.raises(ConversionError, match="no tokenizer.json; pass the target's GGUF"):
        convert_hf_to_gguf(ck, hf, outfile=out_dir / "x.gguf")
    (hf / "config.json").write_text(json.dumps({"hidden_size": 1024, "num_hidden_layers": 8, "vocab_size": 49152}))
    with pytest.raises(ConversionError, match="hidden size 512 != target embedding length 1024"):
        convert_hf_to_gguf(ck, hf, outfile=out_dir / "x.gguf")
    with pytest.raises(ConversionError, match="neither a GGUF file nor a folder"):
        convert_hf_to_gguf(ck, tmp_path / "nope.gguf", outfile=out_dir / "x.gguf")
    with pytest.raises(ConversionError, match="no such folder"):
        convert_hf_to_gguf(tmp_path / "nope", tiny_target, outfile=out_dir / "x.gguf")

    # unreachable hub id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        import huggingface_hub.constants as hc

        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True, raising=False)
    except ImportError:
        pass
    with pytest.raises(ConversionError, match="no-such-org/no-such-drafter.*local folder"):
        convert_hf_to_gguf("no-such-org/no-such-drafter", tiny_target, outfile=out_dir / "x.gguf")
    assert list(out_dir.iterdir()) == []


# --------------------------------------------------------------------------------------------
# CLI


def test_cli(tmp_path, tiny_target, capsys):
    ck = _tiny_ckpt(tmp_path / "ck", version=1)
    out = tmp_path / "c.gguf"
    assert cli_main(["hf-to-gguf", str(ck), "--target", str(tiny_target), "--outfile", str(out),
                     "--outtype", "bf16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # not the temp file's 0600
    assert cli_main(["hf-to-gguf", str(ck), "--target", str(tiny_target), "--outfile", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "exists" in err and "Traceback" not in err
    assert cli_main(["hf-to-gguf", str(ck), "--target", str(tiny_target), "--outfile", str(out), "--force"]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", str(out), "--target", str(tiny_target)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["architecture"], info["version"], info["fits"]) == ("dflash", "v1", True)

    # a target of another depth: the pairing check fails -> exit 2
    other = tmp_path / "shallow.gguf"
    w = gguf.GGUFWriter(str(other), "llama")
    w.add_uint32("llama.block_count", 4)
    w.add_uint32("llama.embedding_length", 512)
    w.add_array("tokenizer.ggml.tokens", ["a"] * 49152)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    assert cli_main(["inspect", str(out), "--target", str(other)]) == 2
    info = json.loads(capsys.readouterr().out)
    assert not info["fits"] and "beyond the target's depth" in info["reasons"][0]

    proc = subprocess.run([sys.executable, "-m", "convert", "hf-to-gguf", str(tmp_path / "missing"),
                           "--target", str(tiny_target)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no such folder" in proc.stderr


# --------------------------------------------------------------------------------------------
# byte-level diff against upstream's converter (needs its checkout and an HF target folder)


@pytest.mark.slow
def test_interleaved_rope_checkpoint_is_permuted_to_neox(tmp_path, tiny_target):
    ck = _tiny_ckpt(tmp_path / "ck", version=1, dtype="float32", config_overrides={"rope_is_neox_style": False})
    out = convert_hf_to_gguf(ck, tiny_target, outfile=tmp_path / "o.gguf", outtype="f32")
    src = _source_tensors(ck)
    got = {t.name: np.asarray(t.data) for t in GGUFReader(out).tensors}
    perm = np.concatenate([h * 64 + np.r_[0:64:2, 1:64:2] for h in range(8)])
    np.testing.assert_array_equal(got["blk.0.attn_q.weight"], src["layers.0.self_attn.q_proj.weight"][perm])
    np.testing.assert_array_equal(got["blk.0.attn_k.weight"], src["layers.0.self_attn.k_proj.weight"][perm[:256]])
    np.testing.assert_array_equal(got["blk.0.attn_k_norm.weight"], src["layers.0.self_attn.k_norm.weight"][perm[:64]])
    np.testing.assert_array_equal(got["blk.0.attn_v.weight"], src["layers.0.self_attn.v_proj.weight"])


def test_mask_embedding_checkpoints_are_refused(tmp_path, tiny_target):
    ck = _tiny_ckpt(tmp_path / "ck", version=1)
    (ck / "mask_embedding.pt").write_bytes(b"")
    with pytest.raises(ConversionError, match="mask_embedding.pt"):
        convert_hf_to_gguf(ck, tiny_target, outfile=tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


def test_hub_id_goes_through_snapshot_download(tmp_path, tiny_target, monkeypatch):
    import huggingface_hub

    ck = _tiny_ckpt(tmp_path / "snap" / "0123abcd", version=1)
    calls = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(ck)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out = convert_hf_to_gguf("some-org/Some-Drafter", tiny_target, outtype="bf16")
    assert calls and calls[0][0] == "some-org/Some-Drafter"
    assert out == work / "Some-Drafter-BF16.gguf" and out.is_file()
    assert _fast_fields(out)["general.name"][2] == "some-org/Some-Drafter"
