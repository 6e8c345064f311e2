"""OpenAI Responses API (``POST /v1/responses``) on top of the chat pipeline.

As llama-server does it ("this endpoint works by converting Responses request into Chat Completions
request", tools/server/README.md at llama.cpp 0c1e570), a Responses request becomes a chat request
(:func:`to_chat`), runs through the same decoder, worker, chat template, tool-call and reasoning
parsing, and the finished turn (or its stream of chat deltas) is written back in the Responses
shapes (:func:`response_object`, :class:`ResponsesStream`). Shapes: OpenAI's API reference for
``responses.create`` and its streaming events, as the ``openai`` Python SDK (3.x) parses them.

Request, translated:

- ``instructions`` -> a leading system message; ``input``: a string (one user message) or a list of
  items: messages (``{"role", "content"}``, with or without ``"type": "message"``; content a string
  or ``input_text`` / ``output_text`` parts), ``function_call`` (-> assistant ``tool_calls``;
  consecutive calls join one assistant message), ``function_call_output`` (-> a ``tool`` message),
  ``reasoning`` items (dropped: the chat template gets no earlier reasoning);
- ``tools``: function tools ``{"type": "function", "name", "description", "parameters"}``;
  ``tool_choice``: ``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}``;
  ``parallel_tool_calls``; ``max_output_tokens`` -> ``max_tokens``; ``reasoning.effort`` ->
  ``reasoning_effort``; ``text.format`` ``json_schema`` / ``json_object`` -> ``response_format``;
- any other field goes to the chat request as is (llama-server's sampling fields work; unknown ones
  are ignored and logged once).

Refused with a 400 naming the field: ``previous_response_id`` / ``conversation`` /
``item_reference`` items (this server stores no responses: send the whole conversation),
hosted tools (``web_search``, ``file_search``, ``computer_use``, ``mcp``, ...), image / file
input. Errors have OpenAI's shape (:mod:`.errors`); an error during a stream is an ``error``
event. Reasoning is returned as a ``reasoning`` output item with ``reasoning_text`` content.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from ..decoder.params import rename_request
from .errors import APIError

__all__ = ["to_chat", "response_object", "ResponsesStream", "input_tokens_object"]

_PASS_TEXT = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _hex() -> str:
    return secrets.token_hex(12)


def _text_of(content: Any, where: str) -> Any:
    """A Responses content (string or parts) as chat content: a string, or text parts (media
    parts kept with their type, so that the chat request's check names them)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(where, f"{where} must be a string or a list of content parts")
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict):
            raise _bad(f"{where}[{j}]", f"{where}[{j}] must be an object")
        kind = p.get("type")
        if kind in _PASS_TEXT:
            parts.append({"type": "text", "text": str(p.get("text", p.get("refusal", "")))})
        else:
            raise _bad(f"{where}[{j}]", f"{where}[{j}]: content type {kind!r} is not supported: this server has no "
                                        f"image / file / audio input (text parts only)", "not_supported")
    return parts


def _tools(tools: Any) -> Optional[List[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"tools[{i}]", f"tools[{i}]: only function tools are supported by this server, got type "
                                      f"{kind!r} (hosted tools such as web_search or file_search are OpenAI's)",
                       "not_supported")
        if not isinstance(t.get("name"), str):
            raise _bad(f"tools[{i}].name", f"tools[{i}].name must be a string")
        fn = {"name": t["name"]}  # OpenAI's key order: the template writes the spec as JSON
        if t.get("description") is not None:
            fn["description"] = t["description"]
        fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(tc: Any) -> Any:
    if tc is None or isinstance(tc, str):
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise _bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                              "\"name\": ...} (hosted-tool choices are not supported)")


def _messages(inp: Any, instructions: Any) -> List[dict]:
    msgs: List[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "instructions must be a string")
        msgs.append({"role": "system", "content": instructions})
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
        return msgs
    if not isinstance(inp, list):
        raise _bad("input", "input must be a string or a list of input items")
    for i, it in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise _bad(where, f"{where} must be an object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role", f"{where}.role must be user, assistant, system or developer, got {role!r}")
            msgs.append({"role": role, "content": _text_of(it.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                raise _bad(where, f"{where}: a function_call item needs 'call_id' and 'name' strings")
            args = it.get("arguments", "{}")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last.get("content")):
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise _bad(where, f"{where}: a function_call_output item needs a 'call_id' string")
            out = it.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else _text_of(out, f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier reasoning is not given back to the template
        elif kind == "item_reference":
            raise _bad(where, f"{where}: item_reference needs stored responses, which this server does not keep; "
                              "send the items themselves", "not_supported")
        else:
            raise _bad(where, f"{where}: input item type {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", "not_supported")
    return msgs


def to_chat(req: Dict[str, Any]) -> Dict[str, Any]:
    """A Responses request body -> the equivalent chat completion body (see the module docstring).

    Raises:
        APIError: 400 naming the field for what this server cannot do or a malformed field.
    """
    r = rename_request(req, "responses")  # the table's responses field names -> the chat ones
    for name in ("previous_response_id", "conversation"):
        if r.get(name) is not None:
            raise _bad(name, f"{name} needs stored responses, which this server does not keep: send the whole "
                             "conversation in 'input' (and store: false)", "not_supported")
    if r.get("background"):
        raise _bad("background", "background responses are not supported: send background: false", "not_supported")
    if "input" not in r and "instructions" not in r:
        raise _bad("input", "missing required parameter: input", "missing_required_parameter")
    chat: Dict[str, Any] = {"messages": _messages(r.pop("input", []), r.pop("instructions", None))}
    if not chat["messages"]:
        raise _bad("input", "input is empty: give at least one message")
    tools = _tools(r.pop("tools", None))
    if tools:
        chat["tools"] = tools
    tc = _tool_choice(r.pop("tool_choice", None))
    if tc is not None and (tools or tc == "none"):
        chat["tool_choice"] = tc
    mot = r.pop("max_output_tokens", None)
    if mot is not None:
        if not isinstance(mot, int) or isinstance(mot, bool) or mot < 1:
            raise _bad("max_output_tokens", "max_output_tokens must be an integer >= 1")
        chat["max_tokens"] = mot
    reasoning = r.pop("reasoning", None)
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    text = r.pop("text", None)
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    for name in ("top_logprobs", "include", "store", "metadata", "truncation", "user", "prompt", "service_tier",
                 "prompt_cache_key", "safety_identifier", "max_tool_calls", "stream_options", "messages"):
        r.pop(name, None)
    for k, v in r.items():
        chat.setdefault(k, v)
    return chat


# ---------------------------------------------------------------------------- output

def _usage(turn: Any) -> dict:
    st = turn.stats
    cached = int(getattr(st, "n_cached", 0) or 0)
    return {"input_tokens": st.n_prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": st.n_generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": st.n_prompt + st.n_generated}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _envelope(resp_id: str, req: Dict[str, Any], model: str, created: int, status: str, output: list,
              usage: Optional[dict], incomplete: Optional[str] = None) -> dict:
    text = req.get("text") if isinstance(req.get("text"), dict) else {"format": {"type": "text"}}
    return {
        "id": resp_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
        "parallel_tool_calls": req.get("parallel_tool_calls", True) is not False,
        "previous_response_id": None, "reasoning": req.get("reasoning") or {"effort": None, "summary": None},
        "store": False, "temperature": req.get("temperature"), "text": text,
        "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools") or [],
        "top_p": req.get("top_p"), "truncation": "disabled", "usage": usage, "metadata": req.get("metadata") or {},
        "user": None,
    }


def _status(turn: Any) -> Tuple[str, Optional[str]]:
    if turn.finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def response_object(req: Dict[str, Any], turn: Any, model: str) -> dict:
    """The Responses API ``response`` object of a finished chat turn (non-streamed)."""
    out = []
    if turn.reasoning:
        out.append(_reasoning_item("rs_" + _hex(), turn.reasoning))
    if turn.content:
        out.append(_message_item("msg_" + _hex(), turn.content))
    for c in turn.tool_calls:
        out.append(_call_item("fc_" + _hex(), c))
    status, why = _status(turn)
    return _envelope("resp_" + _hex(), req, model, int(time.time()), status, out, _usage(turn), why)


def input_tokens_object(n: int) -> dict:
    """llama-server's ``/v1/responses/input_tokens`` answer."""
    return {"object": "response.input_tokens", "input_tokens": int(n)}


class ResponsesStream:
    """Responses streaming events from the chat pipeline's ``("delta", d)`` / ``("done", turn)``
    items (:meth:`~dflash2_gguf.server.app.Service.turn_stream`).

    Events, in order: ``response.created``, ``response.in_progress``; per output item
    ``response.output_item.added``, then for a message ``response.content_part.added``,
    ``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``;
    for reasoning ``response.reasoning_text.delta``... / ``.done``; for a function call
    ``response.function_call_arguments.delta``... / ``.done``; then ``response.output_item.done``;
    finally ``response.completed`` (``response.incomplete`` when cut by ``max_output_tokens``). Each
    event has ``type`` and a growing ``sequence_number``; an error is an ``error`` event.
    """

    def __init__(self, req: Dict[str, Any], model: str) -> None:
        self.req, self.model = req, model
        self.id, self.created = "resp_" + _hex(), int(time.time())
        self.seq = 0
        self.output: List[dict] = []
        self.cur: Optional[dict] = None   # the open item: {"kind", "id", "text", "call"}

    def _ev(self, kind: str, **data: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _open(self, kind: str, call: Optional[dict] = None) -> List[str]:
        prefix = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}[kind]
        self.cur = {"kind": kind, "id": prefix + _hex(), "text": "", "call": call}
        idx = len(self.output)
        if kind == "message":
            item = _message_item(self.cur["id"], "", "in_progress")
            item["content"] = []
            return [self._ev("response.output_item.added", output_index=idx, item=item),
                    self._ev("response.content_part.added", item_id=self.cur["id"], output_index=idx, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        if kind == "reasoning":
            item = {"type": "reasoning", "id": self.cur["id"], "summary": [], "content": []}
            return [self._ev("response.output_item.added", output_index=idx, item=item)]
        return [self._ev("response.output_item.added", output_index=idx,
                         item=_call_item(self.cur["id"], call, "in_progress"))]

    def _close(self) -> List[str]:
        c, self.cur = self.cur, None
        if c is None:
            return []
        idx = len(self.output)
        if c["kind"] == "message":
            item = _message_item(c["id"], c["text"])
            evs = [self._ev("response.output_text.done", item_id=c["id"], output_index=idx, content_index=0,
                            text=c["text"], logprobs=[]),
                   self._ev("response.content_part.done", item_id=c["id"], output_index=idx, content_index=0,
                            part=item["content"][0])]
        elif c["kind"] == "reasoning":
            item = _reasoning_item(c["id"], c["text"])
            evs = [self._ev("response.reasoning_text.done", item_id=c["id"], output_index=idx, content_index=0,
                            text=c["text"])]
        else:
            call = dict(c["call"], function=dict(c["call"]["function"], arguments=c["text"]))
            item = _call_item(c["id"], call)
            evs = [self._ev("response.function_call_arguments.done", item_id=c["id"], output_index=idx,
                            name=call["function"]["name"], arguments=c["text"])]
        self.output.append(item)
        return evs + [self._ev("response.output_item.done", output_index=idx, item=item)]

    def _delta(self, d: dict) -> List[str]:
        evs: List[str] = []
        if "reasoning_content" in d:
            if self.cur is None or self.cur["kind"] != "reasoning":
                evs += self._close() + self._open("reasoning")
            self.cur["text"] += d["reasoning_content"]
            evs.append(self._ev("response.reasoning_text.delta", item_id=self.cur["id"],
                                output_index=len(self.output), content_index=0, delta=d["reasoning_content"]))
        elif "content" in d:
            if self.cur is None or self.cur["kind"] != "message":
                evs += self._close() + self._open("message")
            self.cur["text"] += d["content"]
            evs.append(self._ev("response.output_text.delta", item_id=self.cur["id"], output_index=len(self.output),
                                content_index=0, delta=d["content"], logprobs=[]))
        elif "tool_calls" in d:
            for tc in d["tool_calls"]:
                if "id" in tc:  # a new call's header
                    evs += self._close()
                    evs += self._open("function_call", {"id": tc["id"], "type": "function",
                                                         "function": {"name": tc["function"]["name"], "arguments": ""}})
                frag = tc.get("function", {}).get("arguments", "")
                if frag and self.cur is not None and self.cur["kind"] == "function_call":
                    self.cur["text"] += frag
                    evs.append(self._ev("response.function_call_arguments.delta", item_id=self.cur["id"],
                                        output_index=len(self.output), delta=frag))
        return evs

    async def events(self, items: AsyncIterator[tuple]) -> AsyncIterator[str]:
        """SSE text for the chat pipeline's items; an :class:`APIError` becomes an ``error`` event."""
        base = _envelope(self.id, self.req, self.model, self.created, "in_progress", [], None)
        yield self._ev("response.created", response=base)
        yield self._ev("response.in_progress", response=base)
        try:
            async for kind, val in items:
                if kind == "delta":
                    for e in self._delta(val):
                        yield e
                else:
                    for e in self._close():
                        yield e
                    status, why = _status(val)
                    final = _envelope(self.id, self.req, self.model, self.created, status, self.output,
                                      _usage(val), why)
                    yield self._ev("response.completed" if status == "completed" else "response.incomplete",
                                   response=final)
        except APIError as e:
            yield self._ev("error", code=e.code, message=e.message, param=e.param)
