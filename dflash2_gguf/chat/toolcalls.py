"""Tool calls in model output: the format picked from the chat template, batch and streaming parsers.

Formats (chosen by :func:`detect_tool_format` from markers in the template text):

- ``"hermes"``: Hermes / Qwen2.5 / Qwen3 (and Qwen2.5-Coder): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the output, any number;
  the output may also *open* with bare call objects (no marker), which small Qwen2.5 models write
  and llama.cpp's Hermes parser accepts.
- ``"llama3_json"``: Llama 3.1 / 3.2 / 3.3: the output *starts* with ``{"name": ...,
  "parameters": {...}}`` (``"type": "function"`` may come first; ``"arguments"`` is accepted for
  ``"parameters"``; several calls may follow, separated by ``;`` or whitespace; an optional
  ``<|python_tag|>`` is skipped). Text that starts otherwise is content.

Any other tool-aware template (Mistral ``[TOOL_CALLS]``, Qwen3-Coder / GLM XML, DeepSeek, gpt-oss,
Command-R, ...) or a template that never renders ``tools`` raises
:class:`UnsupportedToolFormatError`, whose message names the template, for the server to map to a
400.

Output shape (OpenAI chat completions): a call is ``{"id": "call_<24 hex>", "type": "function",
"function": {"name": str, "arguments": str}}`` with ``arguments`` the model's argument object
re-serialised by ``json.dumps(..., ensure_ascii=False)`` (``"{}"`` when absent). Streaming deltas are
the ``choices[0].delta`` objects of OpenAI's stream: ``{"content": str}`` or ``{"tool_calls":
[{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}`` once a call's name is
complete, then ``{"tool_calls": [{"index", "function": {"arguments": fragment}}]}``; the fragments
concatenate to the batch ``arguments``.

Rules that make the streamed result equal the batch result for any split of the text (the batch
parser *is* the streaming parser fed the whole text):

- text that could still be the start of ``<tool_call>`` is held back;
- whitespace between content and a call, and after a call, is dropped (content around calls is
  otherwise verbatim); a result with calls and no other text has ``content`` None;
- a call's header is sent once its JSON prefix is valid and its ``"name"`` string is complete;
  argument fragments cover completed values only (strings, numbers and literals still being written
  are held), so no fragment is ever taken back;
- a bare object (no marker) is a call only if its keys before ``"name"`` are at most ``"type"``
  and, when ``tool_names`` is given, the name is one of them; otherwise it is content once it
  completes (it is held until then);
- JSON that is malformed from the start (no complete name before the first error) is left as
  content, verbatim, markers included (the text after the error is read again, so a later call is
  still found); JSON that breaks after a complete name (or is cut by the end of generation) is
  closed as a call with the arguments completed up to the break (for a bare call, the rest of the
  output is then dropped: there is no end marker to resume at).

Partial JSON is read with the maintained ``partial-json-parser`` package (PyPI
``partial-json-parser``, MIT, used by vLLM's tool parsers for the same purpose): it parses a JSON
prefix and, with ``Allow.OBJ | Allow.ARR``, drops strings, numbers and literals that are not yet
complete, which is exactly the "completed values only" rule above. Complete objects go through the
standard library's ``json``. Marker scanning is a few lines of string search here.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Sequence

__all__ = [
    "TOOL_FORMATS", "UnsupportedToolFormatError", "detect_tool_format", "ToolCallParser",
    "ParsedToolCalls", "parse_tool_calls", "new_call_id",
]

#: Supported tool-call formats (see the module docstring).
TOOL_FORMATS = ("hermes", "llama3_json")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"

# template marker -> the format it means (checked in this order; the unsupported ones first, since
# e.g. Qwen3-Coder's XML format also writes <tool_call>)
_UNSUPPORTED_MARKERS = (
    ("<function=", "Qwen3-Coder XML (<function=...><parameter=...>)"),
    ("<arg_key>", "GLM XML (<arg_key>/<arg_value>)"),
    ("[TOOL_CALLS]", "Mistral ([TOOL_CALLS])"),
    ("<｜tool▁calls▁begin｜>", "DeepSeek (<｜tool▁calls▁begin｜>)"),
    ("<|channel|>", "gpt-oss harmony (<|channel|>)"),
    ("<|START_ACTION|>", "Command-R (<|START_ACTION|>)"),
    ("<|tool_call_start|>", "LFM2 (<|tool_call_start|>)"),
    ("functools[", "Phi/Firefunction (functools[...])"),
)


class UnsupportedToolFormatError(ValueError):
    """The chat template's tool-call format is not one this parser reads (or the template does not
    render tools at all). ``source`` names the template; the message says which format was seen."""

    def __init__(self, message: str, source: str = "chat template"):
        super().__init__(message)
        self.source = source


def detect_tool_format(template: str, source: str = "chat template") -> str:
    """The tool-call format of a chat template, from markers in its text.

    Args:
        template: Jinja template source (``ChatRenderer.template_for(tools)``).
        source: Names the template in the error (e.g. ``"tokenizer.chat_template of x.gguf"``).

    Returns:
        ``"hermes"`` or ``"llama3_json"``.

    Raises:
        UnsupportedToolFormatError: the template does not use ``tools``, or uses a format listed in
            the module docstring as unsupported, or one with no recognised marker.
    """
    t = template or ""
    for marker, name in _UNSUPPORTED_MARKERS:
        if marker in t:
            raise UnsupportedToolFormatError(
                f"{source} uses the {name} tool-call format, which this server does not parse "
                f"(supported: Hermes/Qwen <tool_call> JSON, Llama 3.x JSON); send the request without "
                f"tools or use a model whose template is one of those", source)
    if "tools" not in t:
        raise UnsupportedToolFormatError(
            f"{source} does not render tools (it never reads the 'tools' variable): this model was not "
            f"given a tool-call format; send the request without tools or use a tool-calling model", source)
    if _OPEN in t:
        return "hermes"
    if "<|start_header_id|>" in t and ("ipython" in t or '"parameters"' in t or "parameters" in t):
        return "llama3_json"
    raise UnsupportedToolFormatError(
        f"{source} renders tools but its tool-call format is not recognised (no <tool_call> marker, not "
        f"Llama 3.x); supported: Hermes/Qwen <tool_call> JSON, Llama 3.x JSON", source)


def new_call_id() -> str:
    """``call_`` + 24 random hex digits (the shape of OpenAI's tool-call ids)."""
    return "call_" + secrets.token_hex(12)


# ----------------------------------------------------------------------------- JSON helpers

_ALLOW = None


def _partial(s: str):
    """Parse a JSON prefix keeping completed values only; raises ValueError when malformed."""
    global _ALLOW
    from partial_json_parser import Allow, loads

    if _ALLOW is None:
        _ALLOW = Allow.OBJ | Allow.ARR
    return loads(s, _ALLOW)


def _longest_valid_prefix(s: str):
    """``(k, obj)``: the longest prefix ``s[:k]`` that is valid partial JSON and its parse
    (``(0, None)`` if none). Validity is prefix-closed, so ``k`` does not depend on how much of a
    malformed text has arrived once the error is in it."""
    for k in range(len(s) - 1, 0, -1):
        try:
            return k, _partial(s[:k])
        except ValueError:
            continue
    return 0, None


def _args_of(obj: dict):
    if "arguments" in obj:
        return obj["arguments"]
    return obj.get("parameters")


def _args_final(obj: dict) -> str:
    a = _args_of(obj)
    if a is None:
        return "{}"
    if isinstance(a, str):
        return a
    return json.dumps(a, ensure_ascii=False)


def _args_stable_prefix(obj: dict) -> str:
    """The part of the final arguments string already fixed by a partial object: its dump minus
    the closing brackets that later values may still precede."""
    a = _args_of(obj)
    if a is None or isinstance(a, str) or not isinstance(a, (dict, list)):
        return ""  # a string / scalar value: sent whole when the call completes
    return json.dumps(a, ensure_ascii=False).rstrip("}]")


def _inspect(body: str):
    """Classify a call body: ``(kind, obj, k)``.

    ``kind``: ``empty`` (blanks only), ``bad`` (does not start with ``{``), ``complete`` (a whole
    JSON object; ``k`` = where it ends in ``body``), ``partial`` (a valid prefix; ``obj`` = its
    completed part), ``broken`` (malformed; ``obj`` = the partial parse of the longest valid
    prefix, which ends at ``k``). For ``empty`` / ``partial`` ``k`` is ``len(body)``, for ``bad``
    the first non-blank position. ``k`` is where the text stops being the call's JSON: a decision
    that no later text can change, which keeps streaming equal to the batch parse."""
    s = body.lstrip()
    lead = len(body) - len(s)
    if not s:
        return "empty", None, len(body)
    if s[0] != "{":
        return "bad", None, lead
    try:
        obj, end = json.JSONDecoder().raw_decode(s)
        return "complete", obj, lead + end
    except ValueError:
        pass
    try:
        return "partial", _partial(s), len(body)
    except ValueError:
        k, obj = _longest_valid_prefix(s)
        return "broken", (obj if isinstance(obj, dict) else None), lead + k


# ----------------------------------------------------------------------------- parser


@dataclass
class ParsedToolCalls:
    """Batch result: ``content`` (str; None when there are calls and no other text) and
    ``tool_calls`` (OpenAI-shaped list, possibly empty)."""

    content: Optional[str]
    tool_calls: List[dict] = field(default_factory=list)


class ToolCallParser:
    """Incremental tool-call parser: feed text deltas, get OpenAI stream deltas.

    Args:
        fmt: ``"hermes"`` or ``"llama3_json"`` (:func:`detect_tool_format`).
        tool_names: The request's tool names: a bare JSON object (no ``<tool_call>`` marker) whose
            name is not among them is content, not a call. Pass them: it keeps a JSON answer
            that happens to have a ``"name"`` key from becoming a call.
        id_factory: Makes call ids (default :func:`new_call_id`).

    Use::

        p = ToolCallParser("hermes")
        for piece in text_stream:
            for delta in p.feed(piece):
                send(delta)            # {"content": ...} or {"tool_calls": [...]}
        for delta in p.finish():
            send(delta)
        p.tool_calls, p.content        # the accumulated result (== parse_tool_calls(whole text))

    Raises:
        ValueError: unknown ``fmt``; RuntimeError: feed after finish.
    """

    def __init__(self, fmt: str, *, tool_names: Optional[Iterable[str]] = None,
                 id_factory: Optional[Callable[[], str]] = None) -> None:
        if fmt not in TOOL_FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; one of {', '.join(TOOL_FORMATS)}")
        self.fmt = fmt
        self.tool_names = None if tool_names is None else set(tool_names)
        self._new_id = id_factory or new_call_id
        self.tool_calls: List[dict] = []
        self._content: List[str] = []
        self._state = "start"   # a bare JSON call may open the output (both formats)
        self._bare = False      # the open call is a bare JSON object (no <tool_call> marker)
        self._pending = ""      # undecided text (content state: a possible marker prefix)
        self._raw = ""          # raw text of the current call (markers included), for a fall back
        self._body = ""         # JSON text of the current call
        self._ws = ""           # trailing whitespace of content, held until we know what follows
        self._after_call = False
        self._cur: Optional[dict] = None   # the call being streamed: {"index","id","name","sent"}
        self._out: List[dict] = []
        self._done = False

    # -- public ----------------------------------------------------------------------------

    @property
    def content(self) -> Optional[str]:
        """Content so far (None when there are calls and no other text)."""
        text = "".join(self._content)
        return None if (self.tool_calls and not text) else text

    def feed(self, text: str) -> List[dict]:
        """Consume a text delta; return the stream deltas it completes (possibly none)."""
        if self._done:
            raise RuntimeError("ToolCallParser.feed after finish()")
        self._pending += text
        self._run(final=False)
        out, self._out = self._out, []
        return out

    def finish(self) -> List[dict]:
        """End of generation: resolve held text and any open call; return the last deltas."""
        if not self._done:
            self._run(final=True)
            if self._ws:  # trailing blanks of content that nothing followed
                self._emit_content("", final=True)
            self._done = True
        out, self._out = self._out, []
        return out

    # -- internals -------------------------------------------------------------------------

    def _emit_content(self, text: str, *, final: bool = False) -> None:
        if self._after_call:
            stripped = text.lstrip()
            if not stripped:
                return
            text, self._after_call = stripped, False
        text = self._ws + text
        body = text if final else text.rstrip()
        self._ws = text[len(body):]
        if body:
            self._content.append(body)
            self._out.append({"content": body})

    def _call_started(self) -> None:
        self._ws = ""  # whitespace before a call is dropped

    def _run(self, final: bool) -> None:
        while True:
            if self._state == "content":
                if not self._step_content(final):
                    break
            elif self._state == "start":
                if not self._step_start(final):
                    break
            elif self._state == "call":
                if not self._step_call(final):
                    break
            elif self._state == "skip":  # hermes: rest of a broken call, up to </tool_call>
                i = self._pending.find(_CLOSE)
                if i < 0:
                    keep = _marker_hold(self._pending, _CLOSE)
                    self._pending = self._pending[len(self._pending) - keep:] if keep else ""
                    if final:
                        self._pending = ""
                    break
                self._pending = self._pending[i + len(_CLOSE):]
                self._state = "content"
            elif self._state == "between":  # llama3: after a call, `;` / whitespace / next call
                s = self._pending.lstrip()
                if s.startswith(";"):
                    s = s[1:].lstrip()
                if not s:
                    self._pending = ""
                    if final:
                        self._state = "content_only"
                        continue
                    break
                self._pending = s
                if s[0] == "{":
                    self._begin_call(raw_prefix="", bare=True)
                else:
                    self._state = self._text_state
            elif self._state == "drop":  # llama3: after a broken call
                self._pending = ""
                break
            elif self._state == "content_only":
                if self._pending:
                    self._emit_content(self._pending, final=final)
                    self._pending = ""
                elif final:
                    self._emit_content("", final=True)
                break
            else:  # pragma: no cover
                raise AssertionError(self._state)

    def _step_content(self, final: bool) -> bool:
        p = self._pending
        i = p.find(_OPEN)
        if i >= 0:
            self._emit_content(p[:i])
            self._pending = p[i + len(_OPEN):]
            self._begin_call(raw_prefix=_OPEN, bare=False)
            return True
        keep = 0 if final else _marker_hold(p, _OPEN)
        self._emit_content(p[: len(p) - keep], final=final)
        self._pending = p[len(p) - keep:]
        return False

    def _step_start(self, final: bool) -> bool:
        """Decide from the first non-blank text whether the output opens with a bare JSON call
        (llama3_json's only form; Qwen2.5 models also answer so, without <tool_call>)."""
        s = self._pending.lstrip()
        if self.fmt == "llama3_json":
            if s.startswith(_PYTHON_TAG):
                s = s[len(_PYTHON_TAG):].lstrip()
            elif s and _PYTHON_TAG.startswith(s) and not final:
                return False  # maybe the tag, still arriving
        if not s:
            if final:
                self._state = self._text_state
                return True
            return False
        if s[0] == "{":
            lead = self._pending[: len(self._pending) - len(s)]  # blanks / tag: dropped for a call
            self._pending = s
            self._begin_call(raw_prefix=lead, bare=True)
        else:
            self._state = self._text_state
        return True

    @property
    def _text_state(self) -> str:
        """Where plain text goes: hermes keeps scanning for <tool_call>; llama3 calls only open the output."""
        return "content" if self.fmt == "hermes" else "content_only"

    def _begin_call(self, raw_prefix: str, bare: bool) -> None:
        self._state = "call"
        self._bare = bare
        self._raw = raw_prefix
        self._body = ""

    def _step_call(self, final: bool) -> bool:
        """Advance the open call with the pending text. Returns True to keep running."""
        tail = ""  # the </tool_call> that ended a tagged body in this step
        if not self._bare:
            i = self._pending.find(_CLOSE)
            if i >= 0:
                self._body += self._pending[:i]
                tail = _CLOSE
                self._pending = self._pending[i + len(_CLOSE):]
            else:
                keep = 0 if final else _marker_hold(self._pending, _CLOSE)
                self._body += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]
        else:
            self._body += self._pending
            self._pending = ""
        end = bool(tail) or final
        kind, obj, k = _inspect(self._body)
        if kind == "complete":
            if not self._is_call(obj):
                return self._fallback(k, tail)
            self._finish_call(obj)
            if self._bare:  # what followed the object goes back to the pending text
                self._pending = self._body[k:] + self._pending
                self._state = "between"
            else:  # text after the object up to </tool_call> is ignored
                self._state = "content" if end else "skip"
            self._body = ""
            return True
        if kind == "bad" or (kind == "empty" and end):
            return self._fallback(k, tail)
        if kind == "empty":
            return False
        if kind == "partial" and not end:
            if self._is_call(obj):
                self._stream_partial(obj)
            return False  # not (yet) a call: decided when the object completes or breaks
        # broken, or partial at the end of the body / stream: the completed part decides
        if obj is not None and self._is_call(obj):
            self._finish_call(obj)
            self._body = ""
            if not self._bare:
                self._state = "content" if end else "skip"
            else:  # a bare call has no end marker to resynchronise on: the rest is dropped
                self._pending = ""
                self._state = "drop"
            return True
        return self._fallback(k, tail)

    def _rejected(self, obj: dict) -> bool:
        """A bare object whose keys before ``name`` are not just ``type`` is not a call."""
        if not self._bare:
            return False
        for k in obj:
            if k == "name":
                return False
            if k != "type":
                return True
        return False

    def _is_call(self, obj: dict) -> bool:
        """Whether a (partial) object is a call: a complete string ``name`` (llama3_json: first key
        ``name`` or ``type``, and a name among ``tool_names`` when given)."""
        name = obj.get("name")
        if not isinstance(name, str):
            return False
        if self._bare:
            if self._rejected(obj):
                return False
            if self.tool_names is not None and name not in self.tool_names:
                return False
        return True

    def _stream_partial(self, obj: dict) -> None:
        cur = self._ensure_header(obj["name"])
        prefix = _args_stable_prefix(obj)
        if len(prefix) > len(cur["sent"]) and prefix.startswith(cur["sent"]):
            frag = prefix[len(cur["sent"]):]
            cur["sent"] = prefix
            self._out.append({"tool_calls": [{"index": cur["index"], "function": {"arguments": frag}}]})

    def _ensure_header(self, name: str) -> dict:
        if self._cur is None:
            self._call_started()
            self._cur = {"index": len(self.tool_calls), "id": self._new_id(), "name": name, "sent": ""}
            self._out.append({"tool_calls": [{"index": self._cur["index"], "id": self._cur["id"], "type": "function",
                                              "function": {"name": name, "arguments": ""}}]})
        return self._cur

    def _finish_call(self, obj: dict) -> None:
        cur = self._ensure_header(obj["name"])
        final = _args_final(obj)
        if not final.startswith(cur["sent"]):  # pragma: no cover - guarded by _args_stable_prefix
            raise AssertionError(f"streamed arguments {cur['sent']!r} are not a prefix of {final!r}")
        if len(final) > len(cur["sent"]):
            self._out.append({"tool_calls": [{"index": cur["index"], "function": {"arguments": final[len(cur['sent']):]}}]})
        self.tool_calls.append({"id": cur["id"], "type": "function", "function": {"name": cur["name"], "arguments": final}})
        self._cur = None
        self._after_call = True

    def _fallback(self, k: int, tail: str) -> bool:
        """The open call is not a call: its opening (marker or blanks) and the first ``k``
        characters of its body become content; the rest (and the ``tail`` marker) is read again as
        text."""
        if self._cur is not None:  # pragma: no cover - a streamed header always ends as a call
            raise AssertionError("a call whose header was sent fell back to content")
        text = self._raw + self._body[:k]
        self._pending = self._body[k:] + tail + self._pending
        self._raw, self._body = "", ""
        self._state = self._text_state
        self._emit_content(text)
        return True


def _marker_hold(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def parse_tool_calls(text: str, fmt: str, *, tool_names: Optional[Iterable[str]] = None,
                     id_factory: Optional[Callable[[], str]] = None) -> ParsedToolCalls:
    """Parse a whole model output (see :class:`ToolCallParser` for the arguments and rules)."""
    p = ToolCallParser(fmt, tool_names=tool_names, id_factory=id_factory)
    p.feed(text)
    p.finish()
    return ParsedToolCalls(content=p.content, tool_calls=list(p.tool_calls))
