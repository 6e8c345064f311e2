"""Stop strings in a text stream: emit only text that can no longer become part of a stop string.

The non-streamed rule (``DFlashDecoder.generate``): generation ends at the token that completes a
stop string, and the text is cut before the earliest occurrence of any stop string. Streaming must
send the same text, and must never send the start of a stop string that is then cut.
:class:`StopStringBuffer` does that: it holds back the longest tail of the text that is a proper
prefix of some stop string, and cuts at the earliest occurrence once one is complete.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["StopStringBuffer"]


class StopStringBuffer:
    """Incremental stop-string cutter.

    Args:
        stops: Stop strings (empty strings are ignored; none -> text passes through unchanged).

    Use (one instance per generation)::

        buf = StopStringBuffer(stops)
        for delta in text_deltas:          # UTF-8-safe text of each committed chunk
            out = buf.feed(delta)           # send `out` (may be "")
            if buf.stopped:                 # a stop string completed: end generation now
                break
        else:
            out = buf.flush()               # generation ended otherwise: send the held tail

    Guarantee: if generation stops when ``stopped`` becomes True, the concatenation of everything
    returned equals ``text[:i]`` where ``text`` is the concatenation of everything fed and ``i`` the
    earliest occurrence of any stop string in it (``text`` itself when none occurs), i.e. the
    non-streamed result; and no returned piece is ever cut later.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in (stops or []) if s]
        self._held = ""
        self.stopped = False
        self.stop_string = None  # the stop string that matched (the earliest occurrence)

    @property
    def held(self) -> str:
        """Text fed but not yet returned (a possible start of a stop string)."""
        return self._held

    def feed(self, text: str) -> str:
        """Add a text delta; return the part that is now safe to send ("" after a stop)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        cut, which = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut, which = i, s
        if cut >= 0:
            self.stopped, self.stop_string, self._held = True, which, ""
            return buf[:cut]
        keep = self._hold_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """Generation ended without a stop string: return the held tail (then nothing is held)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _hold_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
