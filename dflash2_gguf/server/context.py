"""The server's context sizes: the pool of ``-c`` (the GGUF's training context capped by memory
when not given) and each slot's share of it, as llama-server splits it.

llama-server's ``-c 0`` (its default) takes the training context from the model
(``<arch>.context_length``). A 128k-token training context would need tens of GB of KV cache,
so without ``-c`` this server takes::

    n_ctx = min(n_ctx_train, cap)
    cap   = floor(RAM_FRACTION * MemAvailable / (n_pools * kv_bytes_per_token) / 256) * 256
    kv_bytes_per_token = 2 (K and V) * n_layer * n_head_kv * head_dim * 2 bytes (F16 cache)

with ``RAM_FRACTION`` = 0.5, ``MemAvailable`` from ``/proc/meminfo`` (else ``os.sysconf``),
``head_dim`` = ``<arch>.attention.key_length`` (else ``n_embd / n_head``), ``n_pools`` = 1 (the
slots split one pool) or the number of slots with ``--kv-unified`` (each slot holds a whole
pool here, see below), and never less than :data:`MIN_CTX`. The drafter's KV cache (a few
layers) is left out of the formula. ``-c N`` uses N; ``-c 0`` uses the training context
uncapped, as llama.cpp does.

Per slot (:func:`slot_n_ctx`), as llama.cpp 0c1e570 sizes a sequence (``llama_context``'s
``n_ctx_seq``, src/llama-context.cpp) and llama-server a slot (``n_ctx_slot()``,
tools/server/server-context.cpp)::

    pool = pad256(n_ctx)
    seq  = pool                      with --kv-unified
         = pad256(pool / n_slots)    otherwise (llama-server's default with -np N)
    slot = min(seq, --kv-unified-per-slot if set, n_ctx_train if known)

so ``-c 1024 -np 2`` gives each slot 512 cells, and ``/props``, ``/slots``, ``/v1/models`` and
the "context exceeded" check use that per-slot size. One difference: llama-server's
``--kv-unified`` slots share one pool of cells (one long request may use all of it while the
others are short); here each slot loads its own decoder (:mod:`.worker`), so with
``--kv-unified`` each slot gets a whole pool of its own (``n_slots`` times the KV memory).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["ModelInfo", "read_model_info", "memory_cap", "resolve_n_ctx", "slot_n_ctx", "pad256", "RAM_FRACTION",
           "MIN_CTX"]

log = logging.getLogger("dflash2_gguf.server")

RAM_FRACTION = 0.5
MIN_CTX = 512
_FALLBACK_CTX = 4096


@dataclass(frozen=True)
class ModelInfo:
    """What the server reports about the target GGUF (``/v1/models`` ``meta``, ``/props``).

    Attributes:
        arch: ``general.architecture``.
        n_ctx_train: ``<arch>.context_length`` (0 if absent).
        n_layer / n_embd / n_head / n_head_kv / head_dim: attention shape (0 if absent).
        n_vocab: tokens in ``tokenizer.ggml.tokens`` (0 if absent).
        size: file size in bytes.
        chat_template: ``tokenizer.chat_template`` ("" if absent).
        name: ``general.name`` ("" if absent).
        tokenizer_model: ``tokenizer.ggml.model`` ("llama", "gpt2", ...).
        n_params: elements of all tensors; ftype: ``general.file_type`` (0 if absent).
        bos_token / eos_token: the BOS / EOS token texts ("" if absent).
    """

    arch: str = ""
    n_ctx_train: int = 0
    n_layer: int = 0
    n_embd: int = 0
    n_head: int = 0
    n_head_kv: int = 0
    head_dim: int = 0
    n_vocab: int = 0
    size: int = 0
    chat_template: str = ""
    name: str = ""
    tokenizer_model: str = ""
    n_params: int = 0
    ftype: int = 0
    bos_token: str = ""
    eos_token: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of F16 K+V cache per token (0 when the shape is unknown)."""
        return 2 * self.n_layer * self.n_head_kv * self.head_dim * 2


def _scalar(reader, key: str):
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    v = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(v).decode("utf-8", errors="replace")
    v = v.tolist()
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def read_model_info(path: str) -> ModelInfo:
    """Read :class:`ModelInfo` from a GGUF's header with the ``gguf`` package (memory-mapped).

    Returns an empty :class:`ModelInfo` (with ``size``) when the file is not a readable GGUF, so
    that a server with a fake model (tests) still starts.
    """
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    try:
        from gguf import GGUFReader

        r = GGUFReader(path, "r")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        log.debug("cannot read GGUF metadata of %s: %s", path, e)
        return ModelInfo(size=size)
    arch = _scalar(r, "general.architecture") or ""

    def num(key: str) -> int:
        v = _scalar(r, f"{arch}.{key}")
        if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv): the largest
            v = max(v) if v else 0
        return int(v or 0)

    n_head = num("attention.head_count")
    n_embd = num("embedding_length")
    head_dim = num("attention.key_length") or (n_embd // n_head if n_head else 0)
    toks = r.fields.get("tokenizer.ggml.tokens")

    def token_text(key: str) -> str:
        i = _scalar(r, key)
        if toks is None or not isinstance(i, int) or not 0 <= i < len(toks.data):
            return ""
        return bytes(toks.parts[toks.data[i]]).decode("utf-8", errors="replace")

    return ModelInfo(
        arch=arch, n_ctx_train=num("context_length"), n_layer=num("block_count"), n_embd=n_embd,
        n_head=n_head, n_head_kv=num("attention.head_count_kv") or n_head, head_dim=head_dim,
        n_vocab=len(toks.data) if toks is not None else 0, size=size,
        chat_template=_scalar(r, "tokenizer.chat_template") or "", name=_scalar(r, "general.name") or "",
        tokenizer_model=_scalar(r, "tokenizer.ggml.model") or "",
        n_params=int(sum(int(t.n_elements) for t in r.tensors)), ftype=int(_scalar(r, "general.file_type") or 0),
        bos_token=token_text("tokenizer.ggml.bos_token_id"), eos_token=token_text("tokenizer.ggml.eos_token_id"),
    )


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 0


def memory_cap(info: ModelInfo, n_slots: int = 1, mem_available: Optional[int] = None) -> Optional[int]:
    """The memory-based context cap of the module docstring (None when it cannot be computed);
    ``n_slots``: how many pools of that size must fit (1 when the slots split one pool)."""
    mem = _mem_available() if mem_available is None else mem_available
    kv = info.kv_bytes_per_token
    if mem <= 0 or kv <= 0:
        return None
    cap = int(RAM_FRACTION * mem / (max(n_slots, 1) * kv)) // 256 * 256
    return max(cap, MIN_CTX)


def resolve_n_ctx(requested: Optional[int], info: ModelInfo, n_slots: int = 1,
                  mem_available: Optional[int] = None) -> int:
    """The context pool to serve with (llama-server's ``-c``, before :func:`slot_n_ctx` splits it).

    Args:
        requested: ``-c``: None (not given) = min(training context, memory cap); 0 = the training
            context; N > 0 = N.
        info: The target's :class:`ModelInfo`.
        n_slots: How many pools must fit in memory (1 when the slots split one pool; the
            number of slots with ``--kv-unified``, where each slot holds a whole pool here).

    Raises:
        ValueError: ``requested`` < 0.
    """
    if requested is not None and requested < 0:
        raise ValueError("-c must be >= 0 (0 = the model's training context)")
    if requested:
        return int(requested)
    train = info.n_ctx_train or _FALLBACK_CTX
    if requested == 0:
        return train
    cap = memory_cap(info, n_slots, mem_available)
    if cap is not None and cap < train:
        log.warning("context: %d tokens (the training context %d does not fit in %.0f%% of the available RAM "
                    "with %d pool(s) at %d KV bytes per token); -c N sets it", cap, train, RAM_FRACTION * 100,
                    n_slots, info.kv_bytes_per_token)
        return cap
    return train


def pad256(n: int) -> int:
    """``n`` rounded up to a multiple of 256 (llama.cpp's ``GGML_PAD(n, 256)``)."""
    return (int(n) + 255) // 256 * 256


def slot_n_ctx(n_ctx: int, n_slots: int = 1, *, kv_unified: bool = False, n_ctx_train: int = 0,
               per_slot: int = 0) -> int:
    """One slot's context as llama-server sizes it (module docstring): ``-c`` padded to 256,
    split across the slots unless ``kv_unified`` (each share padded to 256 again), then capped
    by ``--kv-unified-per-slot`` (``per_slot`` > 0) and the training context (``n_ctx_train`` >
    0). ``slot_n_ctx(1024, 2) == 512``.

    Raises:
        ValueError: ``n_ctx`` < 1 or ``n_slots`` < 1.
    """
    if n_ctx < 1 or n_slots < 1:
        raise ValueError(f"the context ({n_ctx}) and the slots ({n_slots}) must be >= 1")
    pool = pad256(n_ctx)
    seq = pool if kv_unified else pad256(pool // n_slots)
    if per_slot > 0:
        seq = min(seq, per_slot)
    if n_ctx_train > 0:
        seq = min(seq, n_ctx_train)
    return seq
