"""The cost-model cache of the adaptive draft length: ``<cache>/cost-models.json``.

A decoder with ``cost_model="auto"`` (:class:`~dflash2_gguf.decoder.api.DFlashDecoder`) looks up
its cost model (milliseconds of a target pass over 1, 2, ... rows and of a drafter pass) and what
its draft policy learnt under a key of the two model files (:func:`file_id`: real path, size,
mtime), the threads, GPU layers, flash attention, repacking and the pinned llama.cpp commit;
when none is kept it measures one and keeps it (:func:`save`). The file is one JSON object,
key -> entry; ``$DFLASH2_GGUF_COST_MODELS`` names another file (the tests use one per session).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Optional

__all__ = ["as_dict", "file_id", "path", "load", "is_whole", "save"]


def as_dict(c: Any) -> dict:
    """A native ``CostModel`` as the dict that ``cost_model=`` takes and the file keeps
    (``verify_ms``: list, ``draft_ms`` and ``rollback_ms``: milliseconds)."""
    return {"verify_ms": list(c.verify_ms), "draft_ms": c.draft_ms, "rollback_ms": c.rollback_ms}


def file_id(p) -> Optional[list]:
    """(real path, size, mtime in ns) of a file, the cache key part of a model file; None for
    None.

    Raises:
        OSError: the file cannot be stat'ed.
    """
    if p is None:
        return None
    st = os.stat(p)
    return [os.path.realpath(p), st.st_size, st.st_mtime_ns]


def path() -> Path:
    """Where cost models and learnt policies are kept: ``$DFLASH2_GGUF_COST_MODELS``, else
    ``<cache>/cost-models.json`` (``<cache>``: :func:`dflash2_gguf.assets.cache_dir`)."""
    from ..assets import cache_dir

    return Path(os.environ.get("DFLASH2_GGUF_COST_MODELS") or cache_dir() / "cost-models.json")


def load() -> dict:
    """The whole file as ``{key: entry}`` ({} when it is missing or unreadable)."""
    try:
        return json.loads(path().read_text())
    except (OSError, ValueError):
        return {}


def is_whole(verify_ms: Any, block_size: int) -> bool:
    """Whether ``verify_ms`` holds a positive time for every row count 1..block_size."""
    return (isinstance(verify_ms, (list, tuple)) and len(verify_ms) >= block_size
            and all(isinstance(x, (int, float)) and x > 0 for x in verify_ms))


def save(key: str, d: dict) -> None:
    """Add (or replace) one entry of the file (written to a temp file, then renamed, so that
    server slots saving from their threads never leave a torn file).

    Raises:
        OSError: the folder or file cannot be written.
    """
    p = path()
    models = load()
    models[key] = d
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(models, indent=1))
    os.replace(tmp, p)
