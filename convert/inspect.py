"""Summarise a drafter GGUF and, optionally, check it against a target."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from .errors import ConversionError  # noqa: F401 (documented in the docstring)
from .gguf_meta import read_header
from .names import ARCH, TARGET_LAYER_OFFSET, key
from .target import check_pairing, load_target

__all__ = ["inspect_gguf"]

_DSPARK_TENSORS = ("markov_w1", "markov_w2", "conf_proj")


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode("utf-8", "replace") for x in v]
    return v


def inspect_gguf(path, target=None) -> dict:
    """Describe a GGUF drafter.

    Returns a dict with ``path``, ``architecture``, ``version`` (``"v1"``, ``"v2"``,
    ``"dspark"``, or ``None`` for a non-dflash file), ``keys`` (every ``dflash.*`` key,
    values as Python scalars/lists), ``mask_token_id``, ``target_layers_hf`` (stored ids minus
    the offset), ``file_type``, ``tensor_count``, ``tensor_types`` (name -> GGML type name) and
    ``type_counts``. With ``target`` (GGUF or HF folder): ``target`` (its path, arch, sizes),
    ``fits`` (bool) and ``reasons`` (list of mismatches, empty when it fits).

    Raises:
        ConversionError: unreadable file, or an unreadable target.
    """
    p = Path(path)
    header = read_header(p)
    kv = header.kv
    arch = _plain(kv["general.architecture"].value) if "general.architecture" in kv else None
    tensors = {t.name: t.tensor_type.name for t in header.tensors}
    info: dict[str, Any] = {
        "path": str(p),
        "architecture": arch,
        "keys": {n: _plain(v.value) for n, v in kv.items() if n.startswith(f"{ARCH}.")},
        "mask_token_id": kv[key("mask_token_id")].value if key("mask_token_id") in kv else None,
        "file_type": kv["general.file_type"].value if "general.file_type" in kv else None,
        "tensor_count": len(tensors),
        "tensor_types": tensors,
        "type_counts": dict(Counter(tensors.values())),
    }
    if arch != ARCH:
        info["version"] = None
    elif any(n in tensors or n + ".weight" in tensors for n in _DSPARK_TENSORS) \
            or key("sample_from_anchor") in kv:
        info["version"] = "dspark"
    elif key("conv_kernel_size") in kv or "selector_hidden.weight" in tensors:
        info["version"] = "v2"
    else:
        info["version"] = "v1"
    stored = info["keys"].get(key("target_layers"))
    info["target_layers_hf"] = [int(i) - TARGET_LAYER_OFFSET for i in stored] if stored else None

    if target is not None:
        tgt = load_target(target)
        info["target"] = {"path": str(tgt.path), "kind": tgt.kind, "architecture": tgt.arch,
                          "n_embd": tgt.n_embd, "n_layer": tgt.n_layer, "n_vocab": tgt.n_vocab}
        reasons = []
        if arch != ARCH:
            reasons.append(f"architecture is {arch!r}, not {ARCH!r}")
        else:
            n_vocab = None
            for t in header.tensors:
                if t.name == "selector_predecessor.weight":
                    n_vocab = int(t.shape[-1])  # ggml order: [rank, vocab]
            if n_vocab is None:
                n_vocab = tgt.n_vocab  # v1 carries no vocab-sized tensor: nothing to compare
            reasons = check_pairing(
                hidden_size=int(info["keys"].get(key("embedding_length"), -1)),
                vocab_size=n_vocab,
                target_layer_ids=info["target_layers_hf"] or [],
                mask_token_id=int(info["mask_token_id"]) if info["mask_token_id"] is not None else -1,
                target=tgt)
        info["fits"] = not reasons
        info["reasons"] = reasons
    return info
