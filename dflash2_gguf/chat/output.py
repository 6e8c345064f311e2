"""What a chat request asks of the output: tools (parsing, ``tool_choice`` grammar) and reasoning.

Shared by ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` (the last two are
translated into a chat request first, as llama-server does; see :mod:`dflash2_gguf.server.responses_api` and
:mod:`dflash2_gguf.server.messages_api`).

Tools (OpenAI chat completions ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; semantics as
llama-server's ``oaicompat_chat_params_parse`` in tools/server/server-common.cpp at llama.cpp
0c1e570):

- the tools are always given to the chat template; with ``tool_choice`` ``"none"`` the output is not
  parsed for calls (plain content), as llama-server;
- ``"auto"`` (the default): calls are parsed from the output (:mod:`dflash2_gguf.chat.toolcalls`, format
  from the template: Hermes/Qwen ``<tool_call>`` JSON or Llama 3.x JSON); a template with another
  format, or none, is a 400 naming the template;
- ``"required"`` or a named function ``{"type": "function", "function": {"name": ...}}``: the
  output is constrained by a GBNF grammar (:func:`tool_call_grammar`) that accepts only calls, in
  the template's format, with arguments valid under each tool's JSON schema
  (:func:`dflash2_gguf.chat.grammar.json_schema_to_grammar`). llama-server arms such a grammar lazily,
  at the first call marker; here the call must come first, so the grammar is active from the
  first token (same calls; no text before them);
- ``parallel_tool_calls`` false: one call at most (the grammar allows one; in ``auto`` mode only
  the first parsed call is returned, the rest of the output dropped);
- a ``grammar`` / ``json_schema`` / ``response_format`` together with tools (choice other than
  ``none``) is a 400, as in llama-server ("Cannot use custom grammar constraints with tools").

Reasoning: :class:`dflash2_gguf.chat.reasoning.ReasoningParser` with the request's ``reasoning_format``
(else the server's ``--reasoning-format``), starting inside the think block when the rendered
prompt ends with ``<think>``. The content that follows the reasoning goes to the tool-call parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from ..server.errors import APIError

__all__ = ["ToolPlan", "plan_tools", "tool_call_grammar", "ChatOutput", "finish_reason_for"]


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class ToolPlan:
    """How a request's tools shape generation and parsing.

    Attributes:
        fmt: Tool-call format to parse (``"hermes"`` / ``"llama3_json"``); None: no parsing.
        names: Tool names the parser accepts for bare JSON calls (the named one only, when named).
        grammar: GBNF forcing calls (``required`` / named), else None.
        parallel: More than one call allowed.
        choice: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
    """

    fmt: Optional[str] = None
    names: List[str] = field(default_factory=list)
    grammar: Optional[str] = None
    parallel: bool = True
    choice: str = "none"


def _function_specs(tools: Sequence[Any]) -> List[Dict[str, Any]]:
    """``[{"name", "parameters"}]`` of OpenAI tool specs.

    Raises:
        APIError: 400 naming ``tools[i]`` for an entry that is not a function tool with a name.
    """
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"tools[{i}]", f"tools[{i}]: only function tools are supported ({{\"type\": \"function\", "
                                      f"\"function\": {{\"name\", \"parameters\"}}}}), got type {kind!r}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].function.name", f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"name": name, "parameters": params})
    return out


def tool_call_grammar(fmt: str, functions: Sequence[Dict[str, Any]], parallel: bool = True) -> str:
    """GBNF accepting only tool calls in format ``fmt``, arguments valid under each function's schema.

    Args:
        fmt: ``"hermes"``: ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`` blocks
            separated by a newline (the layout Qwen2.5's template asks for); ``"llama3_json"``:
            ``{"name": N, "parameters": {...}}`` objects separated by ``; ``.
        functions: ``[{"name", "parameters"}]`` (the allowed functions).
        parallel: Allow several calls.

    Raises:
        ValueError: a schema the converter cannot turn into a grammar (the message names it).
    """
    from .grammar import json_schema_to_grammar

    key = "arguments" if fmt == "hermes" else "parameters"
    alts = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
             "required": ["name", key]} for f in functions]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    g = json_schema_to_grammar(schema, ["name", key])
    g, n = re.subn(r"(?m)^root ::=", "tool-call-json ::=", g)
    if n != 1:  # pragma: no cover - the converter always writes one root rule
        raise ValueError("unexpected grammar from the JSON schema converter (no single root rule)")
    if fmt == "hermes":
        head = 'tool-call-block ::= "<tool_call>\\n" tool-call-json "\\n</tool_call>"\n'
        root = 'root ::= tool-call-block ("\\n" tool-call-block)*\n' if parallel else "root ::= tool-call-block\n"
    else:
        head = ""
        root = 'root ::= tool-call-json ("; " tool-call-json)*\n' if parallel else "root ::= tool-call-json\n"
    return root + head + g


def plan_tools(tools: Optional[Sequence[Any]], tool_choice: Any, parallel_tool_calls: Optional[bool],
               template_source: Optional[str], template_name: str) -> ToolPlan:
    """The :class:`ToolPlan` of a chat request.

    Args:
        tools: The request's ``tools`` (None / empty: no tools).
        tool_choice: ``"auto"`` / ``"none"`` / ``"required"`` / ``{"type": "function",
            "function": {"name": ...}}`` (None = ``"auto"``).
        parallel_tool_calls: None = allowed.
        template_source: The chat template text rendered for this request (tool format detection).
        template_name: Names the template in errors.

    Raises:
        APIError: 400 for a malformed tool, an unknown named function, a tool choice without tools,
            or a template whose tool-call format is not supported (the message names the template).
    """
    from .toolcalls import UnsupportedToolFormatError, detect_tool_format

    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = fn.get("name")
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or "
                                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        choice, named = "named", name
    else:
        named = None
    if not tools:
        if choice in ("required", "named"):
            raise _bad("tool_choice", f"tool_choice {tool_choice!r} needs tools: the request has none")
        return ToolPlan()
    funcs = _function_specs(tools)
    if choice == "none":
        return ToolPlan(choice="none")
    try:
        fmt = detect_tool_format(template_source or "", template_name)
    except UnsupportedToolFormatError as e:
        raise _bad("tools", str(e), "not_supported") from None
    names = [f["name"] for f in funcs]
    parallel = parallel_tool_calls is not False
    if choice == "named":
        if named not in names:
            raise _bad("tool_choice", f"tool_choice names function {named!r}, which is not among the tools "
                                      f"({', '.join(names)})")
        funcs = [f for f in funcs if f["name"] == named]
        names = [named]
    grammar = None
    if choice in ("required", "named"):
        try:
            grammar = tool_call_grammar(fmt, funcs, parallel)
        except ValueError as e:
            raise _bad("tools", f"cannot build the tool-call grammar from the tools' parameters: {e}") from None
    return ToolPlan(fmt=fmt, names=names, grammar=grammar, parallel=parallel, choice=choice)


class ChatOutput:
    """One choice's output, split into reasoning, content and tool calls, batch or streamed.

    Args:
        reasoning_format: One of :data:`dflash2_gguf.chat.reasoning.REASONING_FORMATS`.
        starts_in_reasoning: The rendered prompt ends inside an open ``<think>`` block.
        plan: The request's :class:`ToolPlan` (None: no tools).

    ``feed(text)`` / ``finish()`` return OpenAI chat stream deltas (``{"reasoning_content"}``,
    ``{"content"}``, ``{"tool_calls": [...]}``); after ``finish()``, :attr:`content`,
    :attr:`reasoning` and :attr:`tool_calls` hold the totals (equal for any split of the text).
    """

    def __init__(self, reasoning_format: str = "auto", *, starts_in_reasoning: bool = False,
                 plan: Optional[ToolPlan] = None) -> None:
        from .reasoning import ReasoningParser
        from .toolcalls import ToolCallParser

        self._r = ReasoningParser(reasoning_format, starts_in_reasoning=starts_in_reasoning)
        self.plan = plan or ToolPlan()
        self._t = (ToolCallParser(self.plan.fmt, tool_names=self.plan.names) if self.plan.fmt else None)
        self._content: List[str] = []

    def _route(self, deltas: List[dict], final: bool = False) -> List[dict]:
        out: List[dict] = []
        for d in deltas:
            if "content" in d and self._t is not None:
                out += self._t.feed(d["content"])
            else:
                out.append(d)
        if final and self._t is not None:
            out += self._t.finish()
        if not self.plan.parallel:
            kept = []
            for d in out:
                if "tool_calls" in d:
                    calls = [c for c in d["tool_calls"] if c.get("index", 0) == 0]
                    if calls:
                        kept.append({"tool_calls": calls})
                elif "content" in d and self._t is not None and self._t.tool_calls:
                    continue  # text after the one call allowed is dropped
                else:
                    kept.append(d)
            out = kept
        self._content += [d["content"] for d in out if "content" in d]
        return out

    def feed(self, text: str) -> List[dict]:
        """Consume a text delta; return the stream deltas it completes."""
        return self._route(self._r.feed(text)) if text else []

    def finish(self) -> List[dict]:
        """End of the output: the last deltas."""
        return self._route(self._r.finish(), final=True)

    @property
    def reasoning(self) -> Optional[str]:
        """``reasoning_content`` (None: no think block, or format ``none``)."""
        return self._r.reasoning

    @property
    def tool_calls(self) -> List[dict]:
        """The parsed calls (OpenAI shape), at most one without ``parallel_tool_calls``."""
        if self._t is None:
            return []
        return list(self._t.tool_calls if self.plan.parallel else self._t.tool_calls[:1])

    @property
    def content(self) -> Optional[str]:
        """The message content (None when there are calls and no other text)."""
        text = "".join(self._content)
        return None if (self.tool_calls and not text) else text


def finish_reason_for(stop_reason: str, tool_calls: Sequence[Any]) -> str:
    """OpenAI ``finish_reason``: ``"tool_calls"`` when calls were parsed and generation was not cut
    by the token limit or the context, else ``"length"`` / ``"stop"``."""
    if stop_reason in ("length", "context"):
        return "length"
    return "tool_calls" if tool_calls else "stop"
