"""Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on top of the chat
pipeline.

As llama-server serves it (tools/server/README.md at llama.cpp 0c1e570, "Anthropic-compatible API
Endpoints"), a Messages request becomes a chat request (:func:`to_chat`), runs through the same
decoder, chat template, tool-call and reasoning parsing, and the turn is written back as an
Anthropic message (:func:`message_object`) or its stream of events (:class:`MessagesStream`).
Shapes: Anthropic's API reference for Messages, as the ``anthropic`` Python SDK parses them.

Request, translated:

- ``system`` (a string or text blocks) -> a leading system message; ``messages``: ``user`` /
  ``assistant`` with a string or blocks: ``text``; ``tool_use`` (assistant; -> ``tool_calls`` with
  ``input`` as the JSON arguments); ``tool_result`` (user; -> ``tool`` messages, placed before the
  user's text, ``is_error`` prefixes the text with "Error: "); ``thinking`` (assistant; ->
  ``reasoning_content``); ``redacted_thinking`` dropped; ``cache_control`` ignored;
- ``tools``: custom tools ``{"name", "description", "input_schema"}``; ``tool_choice``:
  ``{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`` -> ``auto``
  / ``required`` / the named function / ``none`` and ``parallel_tool_calls``;
- ``max_tokens`` (default 4096, llama-server's), ``stop_sequences`` -> ``stop``, ``temperature``,
  ``top_p``, ``top_k``; ``thinking`` ``{"type": "enabled" | "disabled"}`` -> ``enable_thinking``;
- any other field goes to the chat request as is (unknown ones are ignored and logged once).

Refused with a 400 naming the field: server tools (``web_search_*``, ``bash_*``,
``text_editor_*``, ... any ``type`` other than ``custom``), image / document blocks, ``mcp_servers``.

Errors have Anthropic's shape ``{"type": "error", "error": {"type", "message"}}`` (:func:`error_body`),
also as an ``error`` event inside a stream.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator, Dict, List, Optional

from ..decoder.params import rename_request
from .errors import APIError

__all__ = ["to_chat", "message_object", "MessagesStream", "error_body", "ERROR_TYPES", "DEFAULT_MAX_TOKENS"]

#: llama-server's default ``max_tokens`` for ``/v1/messages``.
DEFAULT_MAX_TOKENS = 4096

#: HTTP status -> Anthropic error type (Anthropic API reference, "Errors").
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               501: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: APIError) -> dict:
    """Anthropic's error object for ``err`` (the message keeps the parameter's name)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(where, f"{where} must be a string or a list of content blocks")
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}[{j}]", f"{where}[{j}]: only text blocks are allowed here, got {kind!r}")
        out.append(str(b.get("text", "")))
    return "\n".join(out)


def _user(m: dict, where: str) -> List[dict]:
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
    tools, texts = [], []
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(w, f"{w}: a tool_result block needs a 'tool_use_id' string")
            c = b.get("content", "")
            text = c if isinstance(c, str) else _text(c, f"{w}.content")
            if b.get("is_error"):
                text = "Error: " + text
            tools.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind in ("image", "document", "search_result"):
            raise _bad(w, f"{w}: {kind} blocks are not supported: this server has no image / document input",
                       "not_supported")
        else:
            raise _bad(w, f"{w}: content block type {kind!r} is not supported in a user message "
                          "(text, tool_result)", "not_supported")
    out = list(tools)
    if texts or not tools:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(m: dict, where: str) -> dict:
    content = m.get("content")
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
    texts, calls, thoughts = [], [], []
    for j, b in enumerate(content):
        w = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise _bad(w, f"{w}: a tool_use block needs 'id' and 'name' strings")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {},
                                                                                  ensure_ascii=False)}})
        elif kind == "thinking":
            thoughts.append(str(b.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue
        else:
            raise _bad(w, f"{w}: content block type {kind!r} is not supported in an assistant message "
                          "(text, tool_use, thinking)", "not_supported")
    msg: Dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    if msg["content"] is None and not calls:
        msg["content"] = ""
    return msg


def to_chat(req: Dict[str, Any]) -> Dict[str, Any]:
    """A Messages request body -> the equivalent chat completion body (see the module docstring).

    Raises:
        APIError: 400 naming the field for a malformed field or something this server cannot do.
    """
    r = rename_request(req, "messages")  # the table's messages field names -> the chat ones
    if r.get("mcp_servers"):
        raise _bad("mcp_servers", "mcp_servers are not supported by this server (no remote MCP connector)",
                   "not_supported")
    msgs: List[dict] = []
    system = r.pop("system", None)
    if system is not None:
        msgs.append({"role": "system", "content": _text(system, "system")})
    raw = r.pop("messages", None)
    if not isinstance(raw, list) or not raw:
        raise _bad("messages", "messages must be a non-empty list", "missing_required_parameter")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            msgs += _user(m, where)
        elif role == "assistant":
            msgs.append(_assistant(m, where))
        else:
            raise _bad(f"{where}.role", f"{where}.role must be 'user' or 'assistant', got {role!r}")
    chat: Dict[str, Any] = {"messages": msgs}
    tools = r.pop("tools", None)
    if tools:
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise _bad(f"tools[{i}]", f"tools[{i}]: server tool {kind!r} is not supported; only custom tools "
                                          "({name, description, input_schema})", "not_supported")
            if not isinstance(t.get("name"), str):
                raise _bad(f"tools[{i}].name", f"tools[{i}].name must be a string")
            fn = {"name": t["name"]}  # OpenAI's key order: the template writes the spec as JSON
            if t.get("description") is not None:
                fn["description"] = t["description"]
            fn["parameters"] = t.get("input_schema") or {"type": "object", "properties": {}}
            out.append({"type": "function", "function": fn})
        chat["tools"] = out
    tc = r.pop("tool_choice", None)
    if tc is not None:
        kind = tc.get("type") if isinstance(tc, dict) else None
        if kind == "auto":
            chat["tool_choice"] = "auto"
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "none":
            chat["tool_choice"] = "none"
        elif kind == "tool" and isinstance(tc.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
        else:
            raise _bad("tool_choice", "tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                                      "{\"type\": \"tool\", \"name\": ...}")
        if tc.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    mt = r.pop("max_tokens", None)
    if mt is None:
        mt = DEFAULT_MAX_TOKENS
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise _bad("max_tokens", "max_tokens must be an integer >= 1")
    chat["max_tokens"] = mt
    stops = r.pop("stop_sequences", None)
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop_sequences", "stop_sequences must be a list of strings")
        chat["stop"] = stops
    thinking = r.pop("thinking", None)
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        kw = dict(r.pop("chat_template_kwargs", None) or {})
        kw.setdefault("enable_thinking", thinking["type"] == "enabled")
        chat["chat_template_kwargs"] = kw
    for name in ("metadata", "service_tier", "container", "context_management", "mcp_servers", "betas"):
        r.pop(name, None)
    for k, v in r.items():
        chat.setdefault(k, v)
    return chat


# ---------------------------------------------------------------------------- output

def _stop_reason(turn: Any) -> tuple:
    if turn.tool_calls and turn.finish_reason == "tool_calls":
        return "tool_use", None
    if turn.finish_reason == "length":
        return "max_tokens", None
    if turn.stopping_word:
        return "stop_sequence", turn.stopping_word
    return "end_turn", None


def _usage(turn: Any) -> dict:
    st = turn.stats
    cached = int(getattr(st, "n_cached", 0) or 0)
    return {"input_tokens": st.n_prompt - cached, "output_tokens": st.n_generated,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _args(call: dict) -> Any:
    try:
        return json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        return {}


def message_object(turn: Any, model: str) -> dict:
    """The Anthropic ``message`` of a finished chat turn (non-streamed)."""
    content: List[dict] = []
    if turn.reasoning:
        content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content:
        content.append({"type": "text", "text": turn.content})
    for c in turn.tool_calls:
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _args(c)})
    reason, seq = _stop_reason(turn)
    return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": _usage(turn)}


class MessagesStream:
    """Anthropic streaming events from the chat pipeline's ``("delta", d)`` / ``("done", turn)``
    items: ``message_start``; per content block ``content_block_start``, ``content_block_delta``
    (``thinking_delta``, ``text_delta``, ``input_json_delta``)..., ``content_block_stop``; then
    ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage.output_tokens``) and
    ``message_stop``. An :class:`APIError` becomes an ``error`` event."""

    def __init__(self, model: str, n_prompt: int = 0) -> None:
        self.model, self.n_prompt = model, n_prompt
        self.index = -1
        self.open: Optional[str] = None  # kind of the open block

    @staticmethod
    def _ev(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

    def _close(self) -> List[str]:
        if self.open is None:
            return []
        self.open = None
        return [self._ev("content_block_stop", index=self.index)]

    def _start(self, kind: str, block: dict) -> List[str]:
        evs = self._close()
        self.index += 1
        self.open = kind
        return evs + [self._ev("content_block_start", index=self.index, content_block=block)]

    def _delta(self, d: dict) -> List[str]:
        evs: List[str] = []
        if "reasoning_content" in d:
            if self.open != "thinking":
                evs += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            evs.append(self._ev("content_block_delta", index=self.index,
                                delta={"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        elif "content" in d:
            if self.open != "text":
                evs += self._start("text", {"type": "text", "text": ""})
            evs.append(self._ev("content_block_delta", index=self.index, delta={"type": "text_delta", "text": d["content"]}))
        elif "tool_calls" in d:
            for tc in d["tool_calls"]:
                if "id" in tc:
                    evs += self._start("tool_use", {"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                                                    "input": {}})
                frag = tc.get("function", {}).get("arguments", "")
                if frag and self.open == "tool_use":
                    evs.append(self._ev("content_block_delta", index=self.index,
                                        delta={"type": "input_json_delta", "partial_json": frag}))
        return evs

    async def events(self, items: AsyncIterator[tuple], n_prompt: int = 0) -> AsyncIterator[str]:
        """SSE text for the chat pipeline's items (``n_prompt``: input tokens for ``message_start``)."""
        start = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": self.model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": n_prompt, "output_tokens": 0}}
        yield self._ev("message_start", message=start)
        try:
            async for kind, val in items:
                if kind == "delta":
                    for e in self._delta(val):
                        yield e
                else:
                    for e in self._close():
                        yield e
                    reason, seq = _stop_reason(val)
                    yield self._ev("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                                   usage=_usage(val))
                    yield self._ev("message_stop")
        except APIError as e:
            yield f"event: error\ndata: {json.dumps(error_body(e), ensure_ascii=False)}\n\n"
