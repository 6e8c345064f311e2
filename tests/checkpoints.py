"""Random DFlash / DFlash 2 drafter checkpoints in the authors' exact Hugging Face format.

``make_dflash_checkpoint`` writes a folder that looks like a real drafter release
(``z-lab/*-DFlash``, ``*-DFlash2``): a ``config.json`` with ``architectures``
(``DFlashDraftModel`` for v1, ``DFlash2DraftModel`` for v2), ``model_type: "qwen3"``, the usual
Qwen3 sizes, ``num_target_layers`` and a ``dflash_config`` block; plus one or several
safetensors files whose tensor names carry no ``model.`` prefix, as ``dflash==0.1.0``
(``dflash/model.py``) names its parameters::

    fc.weight                                   [hidden, len(target_layer_ids) * hidden]
    hidden_norm.weight, norm.weight             [hidden]
    layers.N.input_layernorm.weight             [hidden]
    layers.N.post_attention_layernorm.weight    [hidden]
    layers.N.self_attn.q_proj.weight            [n_head * head_dim, hidden]
    layers.N.self_attn.{k,v}_proj.weight        [n_kv_head * head_dim, hidden]
    layers.N.self_attn.o_proj.weight            [hidden, n_head * head_dim]
    layers.N.self_attn.{q,k}_norm.weight        [head_dim]
    layers.N.mlp.{gate,up}_proj.weight          [intermediate, hidden]
    layers.N.mlp.down_proj.weight               [hidden, intermediate]
  v2 only:
    layers.N.{attention,mlp}_conv.base_kernel                [2, conv_kernel_size, hidden]
    layers.N.{attention,mlp}_conv.kernel_projection.weight   [2 * K * hidden / G, hidden]
    candidate_selector.hidden_projection.weight              [rank, hidden]
    candidate_selector.{predecessor,successor}_codebook      [vocab, rank]   (no ``.weight``)

Weights are small-std normals (std 0.02 for matrices, norms 1 +- 0.02, conv tap 0 near 1 and the
other taps near 0) so that a forward pass stays numerically sane.

Loading the result in the authors' reference (needs ``transformers==5.15.0``, the version
``dflash==0.1.0`` pins; verified with it)::

    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    model = DFlash2DraftModel.from_pretrained(path, dtype=torch.float32)   # v2
    model = DFlashDraftModel.from_pretrained(path, dtype=torch.float32)    # v1

``DFlash2DraftModel.from_pretrained`` maps the codebooks' missing ``.weight`` itself. To load
with ``load_state_dict`` instead, build the model from ``Qwen3Config.from_pretrained(path)`` and
use :func:`load_state_dict_for_reference`, which appends ``.weight`` to the two codebooks.

The safetensors files are written by a small writer of our own (numpy has no bfloat16), with
the same layout ``safetensors`` writes: 8-byte little-endian header size, JSON header, data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["make_dflash_checkpoint", "checkpoint_tensors", "load_state_dict_for_reference",
           "write_safetensors"]

_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _to_bytes(arr: np.ndarray, dtype: str) -> bytes:
    """Encode a float32 array as ``dtype`` (``bfloat16`` rounds to nearest even)."""
    a = np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == "float32":
        return a.tobytes()
    if dtype == "float16":
        return a.astype(np.float16).tobytes()
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.tobytes()


def bf16_round(arr: np.ndarray) -> np.ndarray:
    """Return ``arr`` rounded to bfloat16 and widened back to float32 (what a reader sees)."""
    raw = np.frombuffer(_to_bytes(arr, "bfloat16"), dtype=np.uint16)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(arr.shape)


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], dtype: str = "bfloat16",
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (float arrays) to one safetensors file, all stored as ``dtype``.

    Args:
        path: Output file.
        tensors: Name -> array (any float dtype; cast to ``dtype``).
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        metadata: Optional ``__metadata__`` strings (defaults to ``{"format": "pt"}``).
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        data = _to_bytes(tensors[name], dtype)
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def checkpoint_tensors(cfg: Mapping[str, Any], *, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors for the drafter described by ``cfg`` (a config.json dict).

    Returns a name -> array dict with the authors' names and shapes (see module docstring).
    """
    rng = np.random.default_rng(seed)
    d = cfg["dflash_config"]
    hidden = cfg["hidden_size"]
    head_dim = cfg["head_dim"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter = cfg["intermediate_size"]
    v2 = cfg["architectures"][0] == "DFlash2DraftModel"

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)

    def conv_base(k: int) -> np.ndarray:
        base = rng.standard_normal((2, k, hidden), dtype=np.float32) * 0.02
        base[:, 0, :] += 1.0
        return base.astype(np.float32)

    t: dict[str, np.ndarray] = {
        "fc.weight": mat(hidden, len(d["target_layer_ids"]) * hidden),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "self_attn.q_proj.weight"] = mat(n_head * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = mat(n_kv * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = mat(n_kv * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = mat(hidden, n_head * head_dim)
        t[p + "self_attn.q_norm.weight"] = norm(head_dim)
        t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        t[p + "mlp.gate_proj.weight"] = mat(inter, hidden)
        t[p + "mlp.up_proj.weight"] = mat(inter, hidden)
        t[p + "mlp.down_proj.weight"] = mat(hidden, inter)
        if v2:
            k, g = d["conv_kernel_size"], d["conv_group_size"]
            for side in ("attention_conv", "mlp_conv"):
                t[p + side + ".base_kernel"] = conv_base(k)
                t[p + side + ".kernel_projection.weight"] = mat(2 * k * (hidden // g), hidden)
    if v2:
        rank = d["selector_rank"]
        t["candidate_selector.hidden_projection.weight"] = mat(rank, hidden)
        t["candidate_selector.predecessor_codebook"] = mat(cfg["vocab_size"], rank)
        t["candidate_selector.successor_codebook"] = mat(cfg["vocab_size"], rank)
    return t


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Update ``base`` in place; ``dflash_config`` merges one level deep; ``None`` deletes."""
    for key, value in overrides.items():
        if key == "dflash_config" and isinstance(value, Mapping):
            _merge(base.setdefault("dflash_config", {}), value)
        elif value is None:
            base.pop(key, None)
        else:
            base[key] = value


def make_dflash_checkpoint(
    path: str | Path,
    *,
    version: int = 2,
    hidden_size: int = 576,
    intermediate_size: int = 1536,
    num_layers: int = 2,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 64,
    vocab_size: int = 49152,
    target_layer_ids: Iterable[int] = (1, 14, 27),
    num_target_layers: int = 30,
    block_size: int = 8,
    mask_token_id: int | None = None,
    dtype: str = "bfloat16",
    shards: int = 1,
    seed: int = 0,
    config_overrides: Mapping[str, Any] | None = None,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 256,
    selector_top_k: int = 16,
) -> Path:
    """Write a random drafter checkpoint folder in the authors' format and return its path.

    Args:
        path: Folder to create (may exist; files in it are overwritten).
        version: 1 (``DFlashDraftModel``) or 2 (``DFlash2DraftModel``: conv + selector).
        hidden_size .. vocab_size: Qwen3 sizes written to config.json.
        target_layer_ids: HF layer ids of the target whose outputs feed ``fc``.
        num_target_layers: Depth of the target (config key ``num_target_layers``).
        block_size: Draft block size. v2 stores it in ``dflash_config``, v1 at the top level,
            as the authors' releases do.
        mask_token_id: Mask token id (default ``vocab_size - 1``).
        dtype: Storage dtype of every tensor: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        shards: Number of safetensors files; above 1 writes ``model-0000i-of-0000n.safetensors``
            plus ``model.safetensors.index.json``.
        seed: RNG seed (the same seed gives the same weights).
        config_overrides: Merged into config.json last; a ``dflash_config`` dict merges into
            the nested block; a value of ``None`` removes the key.
        conv_kernel_size, conv_group_size, selector_rank, selector_top_k: DFlash 2 settings
            (authors' defaults 2, 16, 256, 16). Smaller ranks keep test files small.

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: Unknown ``version`` or ``dtype``, or ``shards`` < 1.
    """
    if version not in (1, 2):
        raise ValueError(f"version must be 1 or 2, got {version!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    ids = [int(i) for i in target_layer_ids]
    mask = vocab_size - 1 if mask_token_id is None else int(mask_token_id)

    dflash_config: dict[str, Any] = {"target_layer_ids": ids, "mask_token_id": mask}
    cfg: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": 40960,
        "max_window_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
        "dflash_config": dflash_config,
    }
    if version == 2:
        dflash_config.update(block_size=block_size, conv_kernel_size=conv_kernel_size,
                             conv_group_size=conv_group_size, selector_rank=selector_rank,
                             selector_top_k=selector_top_k)
        cfg["is_causal"] = False
    else:
        cfg["block_size"] = block_size
    if config_overrides:
        _merge(cfg, config_overrides)
    # ``None`` values the authors keep in config.json (rope_scaling, sliding_window) survive
    # only if not overridden away.
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    # Shapes follow the un-overridden sizes so that tests can write deliberately broken configs.
    shape_cfg = dict(cfg)
    shape_cfg.update(hidden_size=hidden_size, intermediate_size=intermediate_size,
                     num_hidden_layers=num_layers, num_attention_heads=num_heads,
                     num_key_value_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                     architectures=cfg["architectures"])
    shape_cfg["dflash_config"] = {"target_layer_ids": ids, "conv_kernel_size": conv_kernel_size,
                                  "conv_group_size": conv_group_size,
                                  "selector_rank": selector_rank}
    tensors = checkpoint_tensors(shape_cfg, seed=seed)

    for old in out.glob("model*.safetensors*"):
        old.unlink()
    names = sorted(tensors)
    if shards == 1:
        write_safetensors(out / "model.safetensors", tensors, dtype)
    else:
        weight_map: dict[str, str] = {}
        total = 0
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            write_safetensors(out / fname, part, dtype)
            for n, a in part.items():
                weight_map[n] = fname
                total += a.size * (4 if dtype == "float32" else 2)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def load_state_dict_for_reference(path: str | Path) -> dict[str, Any]:
    """Read the checkpoint at ``path`` as a torch state dict for ``model.load_state_dict``.

    Appends ``.weight`` to the two selector codebooks (``nn.Embedding`` parameters), the rename
    that ``DFlash2DraftModel.from_pretrained`` does through its ``key_mapping``. Needs torch.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    files = sorted(folder.glob("model*.safetensors"))
    state: dict[str, Any] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            if name.endswith(("predecessor_codebook", "successor_codebook")):
                name += ".weight"
            state[name] = tensor
    return state
