"""Tiny random hybrid, recurrent and sliding-window target GGUFs, made with llama.cpp's converter.

No such weights can be downloaded here, and these architectures' tensors and keys are many and
arch-specific, so they are not written by hand: a tiny random model is built with transformers
(random init, fixed seed), converted by llama.cpp's own ``convert_hf_to_gguf.py`` at the pinned
commit (:func:`benchmarks.upstream.run_upstream_converter`'s environment), and then cut down to
the 48-token vocabulary of ``tests/tiny_models.py`` (``TINY_VOCAB``): ``token_embd`` and
``output`` keep their first 48 rows, the tokenizer keys are replaced, and the matrices of the
matmuls are stored as Q8_0 (one-row and batched passes then take the same kernels, which greedy
equality tests need; see ``tests/tiny_models.py``). The output head is scaled so that logits have
a std of about ``logit_std`` (a random model's are nearly flat, and near-ties make greedy texts
part on rounding).

The conversion uses the SmolLM2 tokenizer (its HF folder is rebuilt from the pinned SmolLM2 GGUF
by :func:`benchmarks.upstream.hf_target_from_gguf`). ``vocab="full"`` keeps it (49,152 tokens and
SmolLM2's chat template: text prompts, ``bench`` and the server work on such a target); the default
``"tiny"`` replaces it as above (fast tests over a small vocabulary).

Architectures (:data:`ARCHS`): ``qwen35`` (hybrid: Gated DeltaNet + attention; libllama rolls its
recurrent state back natively), ``qwen3next`` (hybrid without native rollback), ``mamba2`` (pure
recurrent), ``gemma3`` (sliding-window attention, window 8), ``lfm2`` (hybrid, native rollback).

``python -m benchmarks.tiny_targets qwen35 out.gguf [--vocab full] [--drafter drafter.gguf]``
writes one (cached under ``<cache>/tiny-targets/``) and, with ``--drafter``, a random DFlash 2
drafter for it (1 layer, block 6, target layers 1 and 3, converted by this project's converter).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from benchmarks.upstream import fetch_upstream, hf_target_from_gguf, upstream_env
from dflash2_gguf.assets import cache_dir

__all__ = ["ARCHS", "HIDDEN", "tiny_target", "random_drafter", "main"]

#: Hidden size of every tiny target: a DFlash 2 drafter needs hidden >= top_k * (top_k + 1).
HIDDEN = 288
_VOCAB_CONVERT = 49152  # the SmolLM2 tokenizer's size, for the converter; cut to 48 afterwards
_VERSION = 1  # bumped when the recipe changes (part of the cache key)


# Sizes every tiny target shares, and those of the Gated DeltaNet layers (qwen35, qwen3next).
_COMMON = dict(vocab_size=_VOCAB_CONVERT, hidden_size=HIDDEN, num_hidden_layers=4, tie_word_embeddings=False)
_ATTENTION = dict(intermediate_size=576, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096)
_DELTANET = dict(head_dim=72, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4,
                 layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def _qwen35() -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_COMMON, **_ATTENTION, **_DELTANET)


def _qwen3next() -> Any:
    from transformers import Qwen3NextConfig

    # llama.cpp's graph for it wants mixture-of-experts layers: a few experts and a shared one
    return Qwen3NextConfig(**_COMMON, **_ATTENTION, **_DELTANET, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
                           mlp_only_layers=[])


def _mamba2() -> Any:
    from transformers import Mamba2Config

    return Mamba2Config(**_COMMON, state_size=16, expand=2, head_dim=32, num_heads=2 * HIDDEN // 32, n_groups=1,
                        conv_kernel=4)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_COMMON, **_ATTENTION, head_dim=72, sliding_window=8,
                            layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                         "full_attention"])


def _lfm2() -> Any:
    from transformers import Lfm2Config

    return Lfm2Config(**_COMMON, **_ATTENTION, conv_L_cache=3,
                      layer_types=["conv", "full_attention", "conv", "full_attention"])


#: name -> (transformers config factory, how libllama rolls it back with a drafter).
ARCHS: dict[str, tuple[Callable[[], Any], str]] = {
    "qwen35": (_qwen35, "native"),
    "qwen3next": (_qwen3next, "checkpoint"),
    "mamba2": (_mamba2, "checkpoint"),
    "gemma3": (_gemma3, "kv"),
    "lfm2": (_lfm2, "native"),
}

# Tensor names (after ``blk.N.``) of matrices that go through a matmul and are stored as Q8_0.
_Q8_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                "attn_qkv.weight", "attn_gate.weight", "ffn_gate.weight", "ffn_up.weight",
                "ffn_down.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                "ffn_down_shexp.weight", "ssm_out.weight", "ssm_in.weight", "ssm_beta_alpha.weight",
                "ssm_alpha.weight", "ssm_beta.weight", "shortconv.in_proj.weight",
                "shortconv.out_proj.weight")


def _build_hf(arch: str, dest: Path, seed: int, init_std: float) -> None:
    """Random transformers model of ``arch`` + the SmolLM2 tokenizer files in ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash2_gguf import assets

    cfg = ARCHS[arch][0]()
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(dest))
    tok = hf_target_from_gguf(assets.fetch("smollm2-135m-instruct-q4_1"))
    for f in tok.iterdir():
        if f.name != "config.json" and f.is_file() and not f.name.startswith("."):
            shutil.copyfile(f, dest / f.name)


def _convert(src: Path, out: Path, extra: tuple[str, ...] = ()) -> None:
    upstream = fetch_upstream()
    cmd = [sys.executable, str(upstream / "convert_hf_to_gguf.py"), str(src), "--outfile", str(out),
           "--outtype", "f32", *extra]
    proc = subprocess.run(cmd, env=upstream_env(upstream), cwd=str(upstream), capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed (rc {proc.returncode}):\n$ {' '.join(cmd)}\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")


def _tests_path() -> None:
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def _shrink(src: Path, out: Path, logit_std: float, tiny_vocab: bool) -> None:
    """Copy ``src`` with Q8_0 matmul weights and a rescaled head; with ``tiny_vocab``, the tiny
    vocabulary and 48-row embeddings / head."""
    import gguf

    _tests_path()
    from tiny_models import TINY_VOCAB, _add_tiny_vocab  # noqa: E402  (the test suite's vocabulary)

    r = gguf.GGUFReader(src)
    n_vocab = len(TINY_VOCAB) if tiny_vocab else None
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(out, arch)
    skip = ("general.architecture", "general.file_type", "GGUF.")
    for name, f in r.fields.items():
        if (tiny_vocab and name.startswith("tokenizer.")) or name.startswith(skip):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode() for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, val, vt, sub)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[-1]).decode(), vt)
        else:
            w.add_key_value(name, f.parts[-1].tolist()[0], vt)
    if tiny_vocab:
        _add_tiny_vocab(w)
    else:
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        data = np.array(t.data, dtype=np.float32)
        if tiny_vocab and t.name in ("token_embd.weight", "output.weight"):
            data = data[:n_vocab].copy()
        if t.name == "output.weight":
            data *= logit_std / max(float(np.std(data)) * np.sqrt(data.shape[1]), 1e-12)
        quant = data.ndim == 2 and data.shape[1] % 32 == 0 and (
            t.name in ("output.weight", "token_embd.weight") or t.name.split(".", 2)[-1] in _Q8_SUFFIXES)
        if quant:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_target(arch: str, *, seed: int = 0, init_std: float = 0.1, logit_std: float = 3.0,
                vocab: str = "tiny", dest: str | Path | None = None) -> Path:
    """Return a tiny random ``arch`` target GGUF (built once, cached).

    Args:
        arch: A key of :data:`ARCHS`.
        seed: torch seed of the random weights.
        init_std: transformers ``initializer_range`` (the std of the random matrices).
        logit_std: Approximate std of the output logits after the head is rescaled.
        vocab: ``"tiny"``: the 48-token ``TINY_VOCAB`` of ``tests/tiny_models.py``; ``"full"``:
            the SmolLM2 tokenizer (49,152 tokens, ChatML template).
        dest: Where to copy the file (default: the cached path itself).

    Returns:
        Path of a GGUF of hidden :data:`HIDDEN`, 4 layers.

    Raises:
        KeyError: Unknown ``arch``.
        ValueError: Unknown ``vocab``.
        RuntimeError: llama.cpp's converter failed (the message has its output).
        benchmarks.upstream.UpstreamUnavailable: The pinned converter could not be fetched.
    """
    if arch not in ARCHS:
        raise KeyError(f"unknown tiny target arch {arch!r}; one of {', '.join(ARCHS)}")
    if vocab not in ("tiny", "full"):
        raise ValueError(f"vocab must be 'tiny' or 'full', not {vocab!r}")
    key = f"{arch}-{vocab}-s{seed}-i{init_std}-l{logit_std}-v{_VERSION}"
    root = cache_dir() / "tiny-targets"
    path = root / f"{key}.gguf"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
            tmp_path = Path(tmp)
            _build_hf(arch, tmp_path / "hf", seed, init_std)
            _convert(tmp_path / "hf", tmp_path / "full.gguf", ("--no-mtp",) if arch in ("qwen35", "qwen3next") else ())
            _shrink(tmp_path / "full.gguf", tmp_path / "tiny.gguf", logit_std, vocab == "tiny")
            os.replace(tmp_path / "tiny.gguf", path)
    if dest is not None:
        shutil.copyfile(path, dest)
        return Path(dest)
    return path


def random_drafter(target: str | Path, out: str | Path, *, seed: int = 3, block_size: int = 6) -> Path:
    """A random 1-layer DFlash 2 drafter (authors' format, converted with this project's converter)
    for a tiny target: hidden :data:`HIDDEN`, target layers 1 and 3 (HF ids 0 and 2), the
    target's vocabulary size. Returns ``Path(out)``."""
    import gguf

    _tests_path()
    from checkpoints import make_dflash_checkpoint  # noqa: E402

    from convert import convert_hf_to_gguf

    r = gguf.GGUFReader(target)
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="tiny-drafter-") as tmp:
        ck = make_dflash_checkpoint(
            Path(tmp) / "hf", version=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_layers=1,
            num_heads=4, num_kv_heads=2, head_dim=HIDDEN // 4, vocab_size=n_vocab, target_layer_ids=(0, 2),
            num_target_layers=4, block_size=block_size, mask_token_id=3, dtype="float32", seed=seed,
            selector_rank=32, selector_top_k=16)
        return convert_hf_to_gguf(ck, target, out, outtype="f32", force=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.tiny_targets ARCH [OUT]``: print the path of a tiny target."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.tiny_targets", description=__doc__.split("\n\n")[0])
    p.add_argument("arch", choices=sorted(ARCHS))
    p.add_argument("out", nargs="?", help="copy the GGUF here (default: print the cached path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", choices=("tiny", "full"), default="tiny",
                   help="tiny: 48 tokens (tests); full: SmolLM2's tokenizer, for text prompts")
    p.add_argument("--drafter", metavar="GGUF", help="also write a random DFlash 2 drafter for it here")
    a = p.parse_args(argv)
    t = tiny_target(a.arch, seed=a.seed, vocab=a.vocab, dest=a.out)
    print(t)
    if a.drafter:
        print(random_drafter(t, a.drafter))
    return 0


if __name__ == "__main__":
    sys.exit(main())
