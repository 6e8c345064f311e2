"""Tiny random target GGUFs (llama / qwen2 architecture) and matching drafters, for fast tests.

``write_tiny_target`` writes an F32 model with the ``gguf`` writer: a 48-token SentencePiece-style
vocabulary (``<unk> <s> </s> <mask>`` + 44 pieces), ``hidden`` wide, ``n_layer`` deep. Weights
are normals with std ``1/sqrt(fan_in)`` (so attention mixes context: a stale K/V entry after a
bad rollback changes the output) and an output head scaled to logits of std ~1.5 (spread enough
that random drafters get accepted sometimes, peaked enough that the distribution matters).

``tiny_drafter`` makes a random drafter in the authors' HF format (``tests/checkpoints.py``) for
such a target and converts it with our converter (``convert.convert_hf_to_gguf``).

``rewrite_gguf`` copies a GGUF with some metadata replaced (for mismatched-pair tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

import gguf

__all__ = ["FLAT_COSTS", "TINY_VOCAB", "MASK_ID", "write_tiny_target", "tiny_drafter", "rewrite_gguf", "read_tensor"]

_PIECES = ["_" + c for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqr")
TINY_VOCAB = ["<unk>", "<s>", "</s>", "<mask>"] + _PIECES  # 48 tokens
MASK_ID = 3

#: A GPU-like cost model for ``DFlashDecoder(cost_model=...)``: a verify pass costs the same for
#: any number of rows and the drafter nothing, so the adaptive policy (on, as by default) drafts
#: the whole block every cycle; tests of exactness with random drafters use it so that drafting
#: never stops (tests/native/test_draft_policy.py covers the policy's own choices).
FLAT_COSTS = {"verify_ms": [10.0] * 16, "draft_ms": 0.0}


def _write(w: gguf.GGUFWriter) -> None:
    """Header, key/values and tensors of ``w`` to its file, then close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tiny_vocab(w: gguf.GGUFWriter) -> None:
    """F32 file type and the tiny SentencePiece-style vocabulary (:data:`TINY_VOCAB`)."""
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(TINY_VOCAB)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(len(_PIECES))])
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
                       gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * len(_PIECES))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def write_tiny_target(path: str | Path, *, arch: str = "llama", hidden: int = 288, n_layer: int = 4,
                      n_head: int = 4, n_head_kv: int = 2, n_ff: int = 576, seed: int = 0,
                      logit_std: float = 1.5, peak: float = 0.0, peak_token: int = 7,
                      weights: str = "f32", vocab=None) -> Path:
    """Write a tiny random target GGUF (F32, or Q4_1 matmul weights) and return its path.

    Args:
        path: Output file.
        arch: ``"llama"`` (records layer inputs in libllama) or ``"qwen2"`` (does not: cb_eval).
        hidden, n_layer, n_head, n_head_kv, n_ff: Sizes (head_dim = hidden / n_head).
        seed: numpy seed.
        logit_std: Approximate std of the output logits.
        peak: When > 0, every token embedding gets ``+peak`` on dimension 0 and the output row of
            ``peak_token`` weight 1 there, so ``peak_token`` is often the argmax of the target
            AND of a random drafter (which reads the same embeddings and head): greedy drafts
            then get accepted, which exercises the acceptance path at T = 0.
        weights: ``"f32"``, or ``"q4_1"``: the matrices that go through a matmul (output and
            every attention / FFN projection) stored as Q4_1, the SmolLM2 target's type. On
            CPUs whose F32 matmul takes another kernel for one row than for several (seen on
            AVX-512 machines: logits ~1e-3 apart), only a quantized target gives one-token and
            batched passes bit-identical logits, which greedy equality tests need.
        vocab: None for :data:`TINY_VOCAB`, or the ``tokenizer.*`` keys to write instead (a list
            of ``convert.gguf_meta.KV``, e.g. from ``convert.target_vocab.target_vocab_fields``);
            the vocab size is then the length of its ``tokenizer.ggml.tokens``.
    """
    if weights not in ("f32", "q4_1"):
        raise ValueError(f"weights must be 'f32' or 'q4_1', not {weights!r}")
    path = Path(path)
    rng = np.random.default_rng(seed)
    hd = hidden // n_head
    V = len(TINY_VOCAB) if vocab is None else len(next(kv.value for kv in vocab if kv.name == "tokenizer.ggml.tokens"))

    def mat(out_f: int, in_f: int, std: float | None = None) -> np.ndarray:
        s = (1.0 / np.sqrt(in_f)) if std is None else std
        return (rng.standard_normal((out_f, in_f)) * s).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)

    def add_matrix(name: str, m: np.ndarray) -> None:
        if weights == "f32":
            w.add_tensor(name, m)
        else:
            q = gguf.GGMLQuantizationType.Q4_1
            w.add_tensor(name, gguf.quants.quantize(m, q), raw_dtype=q)

    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    if vocab is None:
        _add_tiny_vocab(w)
    else:
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        for kv in vocab:
            w.add_key_value(kv.name, kv.value, kv.vtype, kv.sub_type)

    emb = rng.standard_normal((V, hidden)).astype(np.float32)
    out = mat(V, hidden, logit_std / np.sqrt(hidden))
    if peak > 0:
        emb[:, 0] += np.float32(peak)
        out[peak_token, 0] = 1.0
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    add_matrix("output.weight", out)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        add_matrix(f"blk.{i}.attn_q.weight", mat(n_head * hd, hidden))
        add_matrix(f"blk.{i}.attn_k.weight", mat(n_head_kv * hd, hidden))
        add_matrix(f"blk.{i}.attn_v.weight", mat(n_head_kv * hd, hidden))
        if arch == "qwen2":
            for nm, n in (("q", n_head * hd), ("k", n_head_kv * hd), ("v", n_head_kv * hd)):
                w.add_tensor(f"blk.{i}.attn_{nm}.bias", (rng.standard_normal(n) * 0.1).astype(np.float32))
        add_matrix(f"blk.{i}.attn_output.weight", mat(hidden, n_head * hd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add_matrix(f"blk.{i}.ffn_gate.weight", mat(n_ff, hidden))
        add_matrix(f"blk.{i}.ffn_up.weight", mat(n_ff, hidden))
        add_matrix(f"blk.{i}.ffn_down.weight", mat(hidden, n_ff))
    _write(w)
    return path


def write_tiny_mamba(path: str | Path, *, hidden: int = 288, n_layer: int = 4, d_state: int = 16,
                     d_conv: int = 4, seed: int = 0) -> Path:
    """Write a tiny random F32 ``mamba`` (recurrent) target GGUF, same vocabulary as
    :func:`write_tiny_target`; tensor layout as llama.cpp's ``LLM_ARCH_MAMBA`` loads it."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    d_inner, dt_rank, V = 2 * hidden, max(1, hidden // 16), len(TINY_VOCAB)

    def rnd(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    _add_tiny_vocab(w)
    w.add_tensor("token_embd.weight", rnd(V, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output.weight", rnd(V, hidden))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_in.weight", rnd(2 * d_inner, hidden))
        w.add_tensor(f"blk.{i}.ssm_conv1d.weight", rnd(d_inner, d_conv))
        w.add_tensor(f"blk.{i}.ssm_conv1d.bias", rnd(d_inner))
        w.add_tensor(f"blk.{i}.ssm_x.weight", rnd(dt_rank + 2 * d_state, d_inner))
        w.add_tensor(f"blk.{i}.ssm_dt.weight", rnd(d_inner, dt_rank))
        w.add_tensor(f"blk.{i}.ssm_dt.bias", rnd(d_inner))
        w.add_tensor(f"blk.{i}.ssm_a", -np.ones((d_inner, d_state), dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_d", np.ones(d_inner, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ssm_out.weight", rnd(hidden, d_inner))
    _write(w)
    return path


def tiny_drafter(folder: str | Path, target: str | Path, *, version: int, hidden: int = 288, num_layers: int = 1,
                 target_layer_ids=(0, 2), num_target_layers: int = 4, block_size: int = 6,
                 outtype: str = "f32", seed: int = 0, **kw: Any) -> Path:
    """Random drafter (authors' HF format) for a tiny target, converted to GGUF; returns the GGUF."""
    from checkpoints import make_dflash_checkpoint
    from convert import convert_hf_to_gguf

    folder = Path(folder)
    ck = make_dflash_checkpoint(
        folder / f"hf_v{version}", version=version, hidden_size=hidden, intermediate_size=2 * hidden,
        num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, vocab_size=len(TINY_VOCAB),
        target_layer_ids=target_layer_ids, num_target_layers=num_target_layers, block_size=block_size,
        mask_token_id=MASK_ID, dtype="float32", seed=seed, selector_rank=32, selector_top_k=16, **kw)
    return convert_hf_to_gguf(ck, target, folder / f"drafter_v{version}_{outtype}.gguf", outtype=outtype, force=True)


def read_tensor(path: str | Path, name: str) -> np.ndarray:
    """An F32 tensor of a GGUF as numpy, in the HF orientation (``[out, in]``)."""
    r = gguf.GGUFReader(str(path))
    for t in r.tensors:
        if t.name == name:
            if t.tensor_type != gguf.GGMLQuantizationType.F32:
                raise ValueError(f"{name} is {t.tensor_type.name}, not F32")
            return np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
    raise KeyError(name)


def rewrite_gguf(src: str | Path, dst: str | Path, overrides: Mapping[str, Any]) -> Path:
    """Copy GGUF ``src`` to ``dst`` with metadata ``overrides`` ({key: value}; types kept).

    Array values keep their element type. Tensors are copied byte for byte.
    """
    r = gguf.GGUFReader(str(src))
    arch = bytes(r.fields["general.architecture"].parts[r.fields["general.architecture"].data[0]]).decode()
    w = gguf.GGUFWriter(str(dst), arch)
    skip = {"general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for name, f in r.fields.items():
        if name in skip:
            continue
        vt = f.types[0]
        if name in overrides:
            val = overrides[name]
        elif vt == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]) for i in f.data]
            else:
                val = [x.item() for i in f.data for x in f.parts[i]]
        elif vt == gguf.GGUFValueType.STRING:
            val = bytes(f.parts[f.data[0]])
        else:
            val = f.parts[f.data[0]][0].item()
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, val, vt, sub_type=f.types[-1])
        else:
            w.add_key_value(name, val, vt)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=[int(x) for x in reversed(t.shape)], raw_dtype=t.tensor_type)
    _write(w)
    return Path(dst)
