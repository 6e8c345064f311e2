"""Save / load a trained drafter in the authors' DFlash 2 Hugging Face format.

The folder holds ``config.json`` (``architectures: ["DFlash2DraftModel"]``, ``model_type:
"qwen3"``, sizes, ``num_target_layers``, ``dflash_config``; see
:meth:`DFlash2Config.to_hf_dict`) and ``model.safetensors`` whose tensor names are the drafter's
state-dict keys, which are the authors' names (no ``model.`` prefix; the selector codebooks
without ``.weight``). It loads in ``dflash==0.1.0`` with
``DFlash2DraftModel.from_pretrained(folder)`` and converts to GGUF with
``python -m convert hf-to-gguf <folder> --target <target.gguf>``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from .model import DFlash2Config, DFlash2Drafter

__all__ = ["export_hf", "load_hf"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_hf(model: DFlash2Drafter, folder: str | Path, *, dtype: str = "bfloat16",
              force: bool = False) -> Path:
    """Write ``model`` (trainable weights only; the target's embedding/head are not saved).

    Args:
        model: the drafter.
        folder: output folder; refused when it already holds a config.json unless ``force``.
        dtype: storage dtype: ``"bfloat16"`` (the authors' releases), ``"float16"``, ``"float32"``.
        force: overwrite an existing export.

    Returns:
        ``Path(folder)``. Files are written to temp names and renamed, so a crash leaves no
        half-written checkpoint under the final names.
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    out = Path(folder)
    if (out / "config.json").exists() and not force:
        raise FileExistsError(f"{out} already holds a checkpoint (use force=True)")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", _DTYPES[dtype]).contiguous().clone()
               for k, v in model.state_dict().items()}
    cfg = model.config.to_hf_dict(dtype)
    with tempfile.NamedTemporaryFile(dir=out, suffix=".safetensors.tmp", delete=False) as f:
        tmp_st = f.name
    save_file(tensors, tmp_st, metadata={"format": "pt"})
    tmp_cfg = str(out / ".config.json.tmp")
    Path(tmp_cfg).write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp_st, out / "model.safetensors")
    os.replace(tmp_cfg, out / "config.json")
    return out


def load_hf(folder: str | Path, *, dtype: torch.dtype = torch.float32) -> DFlash2Drafter:
    """Build a :class:`DFlash2Drafter` from an authors'-format folder (single or sharded
    safetensors). Target weights must still be attached with ``set_target_weights``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = DFlash2Config.from_hf_dict(json.loads((folder / "config.json").read_text()))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        state.update(load_file(str(f)))
    model = DFlash2Drafter(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(dtype)
