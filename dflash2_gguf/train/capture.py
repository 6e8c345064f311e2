"""Target hidden-state capture through llama-cpp-python alone (``cb_eval`` on ``l_out-{k}``).

The data stage of drafter training needs, for every token of target-generated sequences, the
target's hidden states at the HF layer ids ``target_layer_ids`` (output of decoder layer ``k``).
In llama.cpp's graphs that tensor is named ``l_out-{k}`` (layer input ``k + 1``, the index GGUF
``dflash.target_layers`` stores). The public scheduler callback ``cb_eval`` (a field of
``llama_context_params``) sees it on every architecture (DESIGN.md section 8: bit-identical to
the staging API on a llama target, works on qwen2 where the staging API aborts). Cost: the graph
is split after each captured tensor (slower than the native driver's staging path).

This module uses only llama-cpp-python's ctypes bindings plus three public ggml functions
(``ggml_get_name``, ``ggml_nelements``, ``ggml_backend_tensor_get``) from the libggml-base that
llama_cpp loaded. The native driver may later replace it with a faster path; the shard format
(:mod:`dflash2_gguf.train.data`) stays the same.

Details that matter:

- every row of a decode is flagged as an output: llama.cpp prunes the LAST layer's ``l_out`` to
  the output rows (DESIGN.md section 7);
- the callback is called twice per tensor: ``ask=True`` ("do you want it?": True only for the
  wanted names) then ``ask=False`` with the data computed; returning False there would abort
  the graph, so it returns True;
- a prompt longer than ``n_ubatch`` arrives in several calls per layer, in row order;
- the ctypes callback object is kept referenced for the context's lifetime.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

__all__ = ["LlamaFeatureCapture", "generate_and_capture"]


def _silent(level, text, user_data):  # llama.cpp log callback that drops everything
    return None


_SILENT_LOG = None


def _ggml_base():
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (libdir / name).exists():
            lib = ctypes.CDLL(str(libdir / name))
            break
    else:  # pragma: no cover
        raise OSError(f"libggml-base not found under {libdir}")
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_nelements.argtypes = [ctypes.c_void_p]
    lib.ggml_nelements.restype = ctypes.c_int64
    lib.ggml_nrows.argtypes = [ctypes.c_void_p]
    lib.ggml_nrows.restype = ctypes.c_int64
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


class _LlamaTarget:
    """What every llama-cpp-python-backed target wrapper here shares: text helpers (``tokenize``,
    ``chat_prompt``, ``is_eog``) and the free order of its handles (batch, context, model).
    Subclasses set ``_L`` (the ``llama_cpp`` module), ``model``, ``ctx``, ``vocab`` and
    ``_batch``; those that capture features also set ``_g`` (ggml-base), ``_want`` (tensor name
    -> layer slot), ``_chunks`` (one list per slot) and pass :meth:`_callback` as ``cb_eval``."""

    #: while False, :meth:`_callback` asks ggml for no tensor (decodes that capture nothing)
    capturing = True

    def _callback(self, tensor, ask, _user):
        """ggml ``cb_eval``: ask for the ``l_out-{id}`` tensors in ``_want``, then copy each
        (F32, ``rows x n_embd``) into ``_chunks[slot]``."""
        if not self.capturing:
            return False if ask else True
        name = self._g.ggml_get_name(tensor)
        idx = self._want.get(name)
        if ask:
            return idx is not None
        if idx is not None:
            n = self._g.ggml_nelements(tensor)
            if self._g.ggml_nbytes(tensor) != 4 * n:
                raise RuntimeError(f"{name!r} is not F32")
            rows = self._g.ggml_nrows(tensor)
            out = np.empty((rows, n // rows), dtype=np.float32)
            self._g.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
            self._chunks[idx].append(out)
        return True

    def close(self) -> None:
        L = self._L
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- text helpers -------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        L = self._L
        raw = text.encode()
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
        if n < 0:
            buf = (L.llama_token * (-n))()
            n = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
        return list(buf[:n])

    def chat_prompt(self, messages: Sequence[dict]) -> str:
        """The chat as text to tokenize (``tokenize`` adds BOS per the vocabulary): the GGUF's own
        Jinja template rendered as transformers does, assistant prefix added, a template-written
        BOS dropped when the vocabulary adds one -- :class:`dflash2_gguf.chat.ChatRenderer`, the
        renderer the decoder, server and benchmark use."""
        r = getattr(self, "_chat_renderer", None)
        if r is None:
            from ..chat import renderer_for_llama_model

            r = self._chat_renderer = renderer_for_llama_model(self.model)
        return r.prompt_text(list(messages), add_generation_prompt=True)

    def is_eog(self, token: int) -> bool:
        return bool(self._L.llama_vocab_is_eog(self.vocab, int(token)))


class LlamaFeatureCapture(_LlamaTarget):
    """A target GGUF loaded through llama-cpp-python with ``l_out`` capture.

    Args:
        model_path: target GGUF.
        target_layer_ids: HF layer ids (``l_out-{k}``) to capture, in feature order.
        n_ctx: context size (prompt + response must fit).
        n_batch: rows per decode call.
        n_threads: CPU threads (default: all cores).
        n_gpu_layers: layers offloaded when llama-cpp-python was built with a GPU backend.
        verbose: keep llama.cpp's log on stderr (False installs a silent log callback,
            process-wide, as ``llama_cpp.Llama(verbose=False)`` does).
    """

    def __init__(self, model_path: str | Path, target_layer_ids: Sequence[int], *, n_ctx: int = 4096,
                 n_batch: int = 512, n_threads: int | None = None, n_gpu_layers: int = 0,
                 verbose: bool = False) -> None:
        import llama_cpp as L

        global _SILENT_LOG
        if _SILENT_LOG is None:
            _SILENT_LOG = L.llama_log_callback(_silent)  # kept referenced for the process
        self._L = L
        if not verbose:
            L.llama_log_set(_SILENT_LOG, ctypes.c_void_p(0))
        self._g = _ggml_base()
        self.layer_ids = [int(k) for k in target_layer_ids]
        self._want = {f"l_out-{k}".encode(): i for i, k in enumerate(self.layer_ids)}
        self._chunks: list[list[np.ndarray]] = [[] for _ in self.layer_ids]
        self.capturing = False
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_embd = L.llama_model_n_embd(self.model)
        self.n_layer = L.llama_model_n_layer(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        bad = [k for k in self.layer_ids if not 0 <= k < self.n_layer]
        if bad:
            raise ValueError(f"target has {self.n_layer} layers; bad layer ids {bad}")
        self._cb = L.ggml_backend_sched_eval_callback(self._callback)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        threads = n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.cb_eval = self._cb
        cparams.cb_eval_user_data = None
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self._batch = L.llama_batch_init(n_batch, 0, 1)

    # -- running the target -------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the KV cache (start a new sequence at position 0)."""
        self._L.llama_memory_clear(self._L.llama_get_memory(self.ctx), True)

    def _decode(self, tokens: Sequence[int], pos0: int) -> np.ndarray:
        """Decode ``tokens`` at positions pos0.. with every row an output; returns logits [n, V]."""
        L, b = self._L, self._batch
        n = len(tokens)
        b.n_tokens = n
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc}")
        ptr = L.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_vocab)).copy()

    def run(self, tokens: Sequence[int], *, pos0: int = 0, capture: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Feed ``tokens`` (continuing the current sequence at ``pos0``).

        Returns (features float32 [n, len(ids) * H] (empty when ``capture`` is False),
        logits float32 [n, V]).
        """
        if pos0 + len(tokens) > self.n_ctx:
            raise ValueError(f"sequence of {pos0 + len(tokens)} tokens exceeds n_ctx {self.n_ctx}")
        self._chunks = [[] for _ in self.layer_ids]
        self.capturing = capture
        logits = []
        try:
            for s in range(0, len(tokens), self.n_batch):
                logits.append(self._decode(tokens[s:s + self.n_batch], pos0 + s))
        finally:
            self.capturing = False
        logits_arr = np.concatenate(logits) if logits else np.zeros((0, self.n_vocab), np.float32)
        if not capture:
            return np.zeros((len(tokens), 0), np.float32), logits_arr
        feats = []
        for k, chunks in zip(self.layer_ids, self._chunks):
            f = np.concatenate(chunks) if chunks else np.zeros((0, self.n_embd), np.float32)
            if f.shape != (len(tokens), self.n_embd):
                raise RuntimeError(f"captured l_out-{k} with shape {f.shape}, expected "
                                   f"{(len(tokens), self.n_embd)}")
            feats.append(f)
        return np.concatenate(feats, axis=1), logits_arr


def generate_and_capture(cap: LlamaFeatureCapture, prompt_tokens: Sequence[int], max_new_tokens: int
                         ) -> tuple[list[int], np.ndarray]:
    """Greedy response of the target to ``prompt_tokens`` and the features of every row.

    Features of prompt rows come from the batched prefill, those of response rows from the
    one-token decodes of generation (plus one last decode for the final token), the way the
    speculative loop computes them. Returns (prompt + response ids, features [n, n_ids*H]).
    """
    cap.reset()
    room = cap.n_ctx - len(prompt_tokens) - 1
    if room < 1:
        raise ValueError("prompt does not fit the context")
    feats, logits = cap.run(prompt_tokens)
    parts = [feats]
    seq = list(prompt_tokens)
    nxt = int(np.argmax(logits[-1]))
    for _ in range(min(max_new_tokens, room)):
        seq.append(nxt)
        f, lg = cap.run([nxt], pos0=len(seq) - 1)
        parts.append(f)
        if cap.is_eog(nxt):
            break
        nxt = int(np.argmax(lg[-1]))
    return seq, np.concatenate(parts)


def iter_captured(cap: LlamaFeatureCapture, prompts: Iterable[str], max_new_tokens: int):
    """Yield ``(ids, features, prompt_len)`` for each prompt (a user message, chat template)."""
    for text in prompts:
        ptoks = cap.tokenize(cap.chat_prompt([{"role": "user", "content": text}]))
        bos = cap._L.llama_vocab_bos(cap.vocab)
        if len(ptoks) > 1 and ptoks[0] == ptoks[1] == bos:  # template text already had BOS
            ptoks = ptoks[1:]
        ids, feats = generate_and_capture(cap, ptoks, max_new_tokens)
        yield ids, feats, len(ptoks)
