"""Streaming detokenization in time linear in the output length.

:class:`StreamingDetokenizer` turns the tokens of each committed chunk into the text they add.
Re-detokenizing the whole output at every step (what the stream did before) costs O(n) per step
and O(n^2) per generation. Here each step detokenizes only the new tokens behind a short window
of the tokens before them, and keeps the bytes of an unfinished UTF-8 sequence until a later
token completes it (a byte-level BPE token may hold half of a character), as llama-server's
``validate_utf8`` (tools/server/server-common.cpp at llama.cpp 0c1e570) and mlx-lm's streaming
detokenizers (``mlx_lm/tokenizer_utils.py``) do.

Why a window rather than each token alone: libllama's whole-sequence detokenization is what the
non-streamed text is (``DFlashDecoder.generate``), and it is not always the concatenation of
per-token pieces: it drops the leading space of the first token for SentencePiece vocabularies
(``add_space_prefix``) and may clean spaces around punctuation across a token boundary
(``clean_spaces``). Detokenizing ``window + new`` and cutting off ``detokenize(window)`` reproduces
the whole-sequence bytes of the new tokens; where that cut is not a prefix (a vocabulary whose
cleanup reaches further back), the step falls back to the whole output, so the text is always the
one-shot text.

A leaf module (no native code): ``detokenize`` is any ``list[int] -> bytes`` function.
"""

from __future__ import annotations

import codecs
from typing import Callable, List, Sequence

__all__ = ["StreamingDetokenizer", "WINDOW"]

#: Tokens before the new ones given to each detokenization (context for the cleanups above).
WINDOW = 4


class StreamingDetokenizer:
    """Text deltas of a token stream, equal in sum to the one-shot detokenization.

    Args:
        detokenize: ``tokens -> bytes`` of the whole sequence (e.g. the engine's
            ``detokenize(tokens, False)``).
        window: Tokens of context before the new ones (:data:`WINDOW`).

    Guarantee: after ``feed(t1)``, ..., ``feed(tk, final=True)``, the returned strings concatenate
    to ``detokenize(t1 + ... + tk).decode("utf-8", errors="replace")``; before the final call,
    to that text less a trailing incomplete UTF-8 sequence. Each call costs O(window + new
    tokens) (O(all tokens) only on a fallback step, counted in :attr:`n_fallbacks`).
    """

    def __init__(self, detokenize: Callable[[List[int]], bytes], window: int = WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._detok = detokenize
        self._window = int(window)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tokens: List[int] = []
        self._n_bytes = 0  # bytes of the whole-sequence detokenization handed to the UTF-8 decoder
        self.n_fallbacks = 0

    def _new_bytes(self, new: List[int]) -> bytes:
        if not self._tokens:
            return bytes(self._detok(new))
        ctx = self._tokens[-self._window:]
        before = bytes(self._detok(ctx))
        both = bytes(self._detok(ctx + new))
        if both.startswith(before):
            return both[len(before):]
        self.n_fallbacks += 1  # the cleanup reached back past the window: the whole output
        whole = bytes(self._detok(self._tokens + new))
        return whole[self._n_bytes:]

    def feed(self, tokens: Sequence[int], final: bool = False) -> str:
        """The text ``tokens`` add (complete UTF-8 characters only, unless ``final``)."""
        new = [int(t) for t in tokens]
        raw = self._new_bytes(new) if new else b""
        self._tokens += new
        self._n_bytes += len(raw)
        return self._utf8.decode(raw, final=final)
