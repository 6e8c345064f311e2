"""Read safetensors checkpoints one tensor at a time, without torch.

The header (8-byte little-endian length + JSON) gives every tensor's dtype, shape and byte
range, so shapes are known before any data is read, and each tensor is then read alone with
``numpy.fromfile`` at its offset (peak memory: one tensor, widened to float32). numpy has no
bfloat16, which is why this does not go through ``safetensors.safe_open(framework="np")``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConversionError

__all__ = ["TensorEntry", "index_checkpoint", "read_tensor"]

_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, dtype (``BF16``/``F16``/``F32``), shape, absolute offset."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _read_header(path: Path) -> list[TensorEntry]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ConversionError(f"{path.name}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 << 20:
                raise ConversionError(f"{path.name}: truncated or corrupt safetensors header")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
    except ValueError as e:  # JSON
        raise ConversionError(f"{path.name}: corrupt safetensors header ({e})") from None
    entries = []
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype")
        shape = tuple(int(x) for x in info.get("shape", ()))
        start, end = (int(x) for x in info["data_offsets"])
        if dtype not in _DTYPES:
            raise ConversionError(
                f"{path.name}: tensor {name!r} has dtype {dtype}; only BF16, F16 and F32 are supported")
        if end - start != int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype]:
            raise ConversionError(f"{path.name}: tensor {name!r} byte range does not match its shape")
        entries.append(TensorEntry(name, path, dtype, shape, 8 + n + start, end - start))
        end_max = max(end_max, end)
    if 8 + n + end_max > size:
        raise ConversionError(
            f"{path.name}: truncated safetensors file ({size} bytes, header promises {8 + n + end_max})")
    return entries


def index_checkpoint(folder: Path) -> list[TensorEntry]:
    """List every tensor of the checkpoint in ``folder``, in the order upstream reads them.

    Uses ``model.safetensors.index.json`` when present (its shards in sorted order), else every
    ``model*.safetensors`` file sorted by name; within a file, tensors in name order.

    Raises:
        ConversionError: no safetensors files, a shard named by the index is missing, a tensor
            appears twice, the index and the shard headers disagree, a truncated file, or an
            unsupported dtype.
    """
    index = folder / "model.safetensors.index.json"
    listed: dict[str, str] | None = None
    if index.is_file():
        try:
            listed = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConversionError(f"{index}: unreadable shard index ({e})") from None
        files = sorted(set(listed.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ConversionError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        paths = [folder / f for f in files]
    else:
        paths = sorted(p for p in folder.glob("model*.safetensors") if p.is_file())
    if not paths:
        raise ConversionError(f"no safetensors weights (model*.safetensors) in {folder}")
    entries: list[TensorEntry] = []
    seen: dict[str, Path] = {}
    for p in paths:
        for e in sorted(_read_header(p), key=lambda e: e.name):
            if e.name in seen:
                raise ConversionError(f"tensor {e.name!r} appears in both {seen[e.name].name} and {p.name}")
            seen[e.name] = p
            entries.append(e)
    if listed is not None:
        absent = sorted(n for n in listed if n not in seen)
        if absent:
            raise ConversionError(f"{index.name} lists tensors its shards lack: {', '.join(absent[:20])}")
        moved = sorted(n for n, f in listed.items() if seen[n].name != f)
        if moved:
            raise ConversionError(f"{index.name} places tensors in the wrong shard: {', '.join(moved[:20])}")
    return entries


def read_tensor(e: TensorEntry) -> np.ndarray:
    """Read one tensor as a float32 array of its shape (bf16 widened exactly)."""
    if e.dtype == "BF16":
        raw = np.fromfile(e.file, dtype="<u2", count=e.nbytes // 2, offset=e.offset)
        out = (raw.astype(np.uint32) << 16).view(np.float32)
    elif e.dtype == "F16":
        out = np.fromfile(e.file, dtype="<f2", count=e.nbytes // 2, offset=e.offset).astype(np.float32)
    else:
        out = np.fromfile(e.file, dtype="<f4", count=e.nbytes // 4, offset=e.offset)
    if out.size * (2 if e.dtype != "F32" else 4) != e.nbytes:
        raise ConversionError(f"{e.file.name}: tensor {e.name!r} is truncated")
    return out.reshape(e.shape)
