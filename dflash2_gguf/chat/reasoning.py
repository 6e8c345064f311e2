"""``<think>...</think>`` reasoning split from model output, batch and streaming.

Semantics of llama-server's ``--reasoning-format`` (llama.cpp 0c1e570, ``tools/server/README.md``
and ``common/chat.cpp``):

- ``none``: thoughts stay in ``content`` unparsed; no ``reasoning_content``;
- ``deepseek``: thoughts go to ``reasoning_content``, ``content`` keeps the rest;
- ``deepseek-legacy``: ``content`` keeps the raw text, ``<think>`` tags included, and
  ``reasoning_content`` is filled as well;
- ``auto`` (llama-server's default): as ``deepseek`` (the reasoning is extracted when the output
  has a think block).

A think block counts only at the start of the output (after blanks), as in llama.cpp's DeepSeek-R1
style parsers: ``<think>`` text ``</think>`` then the answer. When the prompt already opened the
block (templates whose generation prompt ends with ``<think>``, e.g. Qwen3's thinking variants and
DeepSeek-R1 distills: :meth:`dflash2_gguf.chat.templates.ChatRenderer.generation_prompt_opens_thinking`),
pass ``starts_in_reasoning=True``: the output begins inside the block. A block that is never
closed (generation cut) is all reasoning. Blanks around the reasoning and before the answer are
dropped (the reasoning is stripped, the content left-stripped); text without a think block is
returned unchanged.

Streaming (:class:`ReasoningParser`) sends ``{"reasoning_content": ...}`` deltas before the
``{"content": ...}`` deltas, holding back text that may still be a tag; the batch function
(:func:`split_reasoning`) is the same parser fed the whole text, so both agree on any split.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["REASONING_FORMATS", "ReasoningParser", "split_reasoning"]

#: Values of ``--reasoning-format`` (llama-server's names).
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def _hold(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """Incremental reasoning splitter.

    Args:
        reasoning_format: One of :data:`REASONING_FORMATS`.
        starts_in_reasoning: The prompt ended inside an open think block.
        start / end: The tags (default ``<think>`` / ``</think>``).

    ``feed(text)`` / ``finish()`` return OpenAI stream deltas: ``{"reasoning_content": str}`` and
    ``{"content": str}``. After ``finish()``, ``reasoning`` (str, or None when there was no think
    block or the format is ``none``) and ``content`` hold the totals.

    Raises:
        ValueError: unknown format.
    """

    def __init__(self, reasoning_format: str = "auto", *, starts_in_reasoning: bool = False,
                 start: str = "<think>", end: str = "</think>") -> None:
        if reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning format {reasoning_format!r}; one of {', '.join(REASONING_FORMATS)}")
        self.format = reasoning_format
        self.start, self.end = start, end
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._r_started = False   # a non-blank reasoning character was sent
        self._ws = ""             # trailing blanks of reasoning, held until more reasoning follows
        self._pending = ""
        self._content: List[str] = []
        self._reasoning: List[str] = []
        self._found = starts_in_reasoning
        self._out: List[dict] = []

    @property
    def reasoning(self) -> Optional[str]:
        """Reasoning so far (None: no think block, or format ``none``)."""
        return "".join(self._reasoning) if (self._found and self.format != "none") else None

    @property
    def content(self) -> str:
        """Content so far."""
        return "".join(self._content)

    def feed(self, text: str) -> List[dict]:
        """Consume a text delta; return the deltas it completes."""
        if self.format == "none":
            return self._send_content(text)
        if self.format == "deepseek-legacy":
            self._out.extend(self._send_content(text))
        self._pending += text
        self._run(final=False)
        out, self._out = self._out, []
        return out

    def finish(self) -> List[dict]:
        """End of generation: flush held text."""
        if self.format == "none":
            return []
        self._run(final=True)
        out, self._out = self._out, []
        return out

    # -- internals -------------------------------------------------------------------------

    def _send_content(self, text: str) -> List[dict]:
        if not text:
            return []
        self._content.append(text)
        return [{"content": text}]

    def _content_delta(self, text: str) -> None:
        if self.format != "deepseek-legacy":  # legacy: content already got the raw text
            self._out.extend(self._send_content(text))

    def _reasoning_delta(self, text: str, final: bool) -> None:
        if not self._r_started:
            text = text.lstrip()
            if not text:
                return
            self._r_started = True
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._reasoning.append(body)
            self._out.append({"reasoning_content": body})

    def _run(self, final: bool) -> None:
        while True:
            p = self._pending
            if self._state == "start":
                s = p.lstrip()
                if s.startswith(self.start):
                    self._pending, self._state, self._found = s[len(self.start):], "reasoning", True
                    continue
                if not final and (not s or self.start.startswith(s)):
                    return  # blanks, or a tag still arriving
                self._state = "content"
                continue
            if self._state == "reasoning":
                i = p.find(self.end)
                if i >= 0:
                    self._reasoning_delta(p[:i], final)
                    self._ws = ""
                    self._pending, self._state = p[i + len(self.end):], "after"
                    continue
                keep = 0 if final else _hold(p, self.end)
                self._reasoning_delta(p[: len(p) - keep], final)
                self._pending = p[len(p) - keep:]
                return
            if self._state == "after":  # blanks between </think> and the answer are dropped
                s = p.lstrip()
                self._pending = s
                if not s:
                    return
                self._state = "content"
                continue
            # content
            if p:
                self._content_delta(p)
                self._pending = ""
            return


def split_reasoning(text: str, reasoning_format: str = "auto", *,
                    starts_in_reasoning: bool = False) -> Tuple[Optional[str], str]:
    """Split a whole output into ``(reasoning_content, content)`` (see :class:`ReasoningParser`)."""
    p = ReasoningParser(reasoning_format, starts_in_reasoning=starts_in_reasoning)
    p.feed(text)
    p.finish()
    return p.reasoning, p.content
