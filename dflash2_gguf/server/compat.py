"""llama-server's request semantics, run in a slot thread before a generation.

Sources: tools/server/server-common.cpp (``tokenize_mixed``, ``tokenize_input_prompts``,
``oaicompat_chat_params_parse``, ``json_get_nested_values``) and server-schema.cpp at llama.cpp
0c1e570. What happens here:

- Prompts (:func:`split_prompts`, :func:`tokenize_prompt`): a string, token ids, a mixed list of
  ids and strings, or ``{"prompt_string": ...}`` (``multimodal_data`` -> 400: no multimodal input);
  a list of several of those gives one completion per prompt. Text is tokenized with BOS per the
  GGUF and special tokens parsed, as llama-server does (``add_special`` only before a leading string).
- Chat (:func:`render_chat`): :meth:`DFlashDecoder.apply_chat_template`, with llama-server's
  assistant prefill: when the last message is an assistant message (or ``continue_final_message``
  is true with ``add_generation_prompt: false``), the reply continues that message, whose text goes
  into the prompt as given, as llama-server builds it (common/chat.cpp and
  chat-auto-parser-generator.cpp at 0c1e570): the other messages rendered without the generation
  prompt, then the generation prompt (what ``add_generation_prompt`` adds to them), then the final
  message's content, trailing spaces kept. One difference: for a template with reasoning markers,
  llama-server also writes an empty ``<think></think>`` (or the message's ``reasoning_content``)
  before the content; here the generation prompt is used as the template writes it. A final message
  without text content (only ``reasoning_content``, or a lone message) is continued by cutting the
  full rendering after its text (transformers' ``continue_final_message``).
- Context (:func:`check_context`): a prompt of ``n_ctx`` tokens or more is a 400
  ``exceed_context_size_error`` with ``n_prompt_tokens`` / ``n_ctx``.
- Generation parameters (:func:`resolve`, :func:`sampling_params`): the request's values over
  the server's defaults, entry by entry of :data:`dflash2_gguf.decoder.params.PARAMS`, then
  :class:`~dflash2_gguf.decoder.sampling.SamplingParams`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Dict, List, Optional, Sequence

from .errors import APIError, context_error

__all__ = [
    "split_prompts", "tokenize_prompt", "render_chat", "check_context", "resolve", "sampling_params",
    "nested_fields", "schema_grammar", "parse_logit_bias",
]

log = logging.getLogger("dflash2_gguf.server")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


# ---------------------------------------------------------------------------- prompts

def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _is_mixed(x: Any) -> bool:
    """A list of ids and strings with at least one id (one prompt, llama-server's mixed form)."""
    return (isinstance(x, list) and any(isinstance(t, int) and not isinstance(t, bool) for t in x)
            and all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in x))


def split_prompts(prompt: Any) -> List[Any]:
    """llama-server's prompt forms -> a list of single prompts (``tokenize_input_prompts``).

    Raises:
        APIError: 400 for an empty prompt or an element of another type.
    """
    if isinstance(prompt, (str, dict)) or _is_mixed(prompt):
        out = [prompt]
    elif isinstance(prompt, list):
        out = list(prompt)
    else:
        raise _bad("prompt", "\"prompt\" must be a string, a list of tokens, a JSON object with \"prompt_string\", "
                             "or a list of those")
    if not out:
        raise _bad("prompt", "\"prompt\" must not be empty")
    for p in out:
        if not (isinstance(p, (str, dict)) or _is_mixed(p)):
            raise _bad("prompt", "\"prompt\" elements must be a string, a list of tokens, a JSON object containing "
                                 "a prompt string, or a list of mixed strings & tokens")
        if isinstance(p, dict):
            if p.get("multimodal_data"):
                raise APIError(400, "multimodal_data is not supported: this server has no multimodal input",
                               "invalid_request_error", "prompt", "not_supported")
            if not isinstance(p.get("prompt_string"), str):
                raise _bad("prompt", "a JSON-object prompt needs \"prompt_string\" (a string)")
    return out


def prompt_text(p: Any) -> str:
    """A single prompt as text for display (ids shown as ``[id]``)."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        return p["prompt_string"]
    return "".join(x if isinstance(x, str) else f"[{x}]" for x in p)


def tokenize_prompt(decoder: Any, p: Any) -> List[int]:
    """Token ids of one prompt (``tokenize_mixed``: BOS per the GGUF only before a leading string,
    special tokens parsed)."""
    if isinstance(p, dict):
        p = p["prompt_string"]
    if isinstance(p, str):
        ids = decoder.tokenize(p, add_special=True, parse_special=True)
    else:
        ids = []
        for i, x in enumerate(p):
            ids += decoder.tokenize(x, add_special=(i == 0), parse_special=True) if isinstance(x, str) else [int(x)]
    if not ids:
        raise _bad("prompt", "the prompt is empty")
    return ids


def check_context(n_prompt: int, n_ctx: int) -> None:
    """Raise llama-server's 400 when ``n_prompt >= n_ctx``."""
    if n_prompt >= n_ctx:
        raise context_error(n_prompt, n_ctx)


# ---------------------------------------------------------------------------- chat

def render_chat(decoder: Any, messages: List[Dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: Any = None, template: Optional[str] = None, jinja: bool = True,
                template_kwargs: Optional[Dict[str, Any]] = None, tools: Optional[List[Any]] = None) -> str:
    """Render ``messages`` with the decoder's chat template (or ``template``), llama-server style.

    Args:
        decoder: A :class:`~dflash2_gguf.decoder.api.DFlashDecoder` (its ``apply_chat_template``; only
            the keywords that are set are passed: ``chat_template``, ``jinja=False``,
            ``chat_template_kwargs``, ``tools``).
        messages: Template dicts (role, content, and tool fields).
        add_generation_prompt / continue_final_message: The request's fields. With the last
            message an assistant's and ``continue_final_message`` not given, the message is
            continued (llama-server's default ``--prefill-assistant``).
        template: ``--chat-template`` / ``--chat-template-file`` text, or None for the GGUF's.
        jinja: ``--jinja`` (True) or ``--no-jinja``.
        template_kwargs: ``chat_template_kwargs``.
        tools: OpenAI tool specs for the template (``tools``).

    Raises:
        APIError: 400 for llama-server's refusals (both ``add_generation_prompt`` and
            ``continue_final_message``, two assistant messages at the end, a final message the
            rendering does not contain) and for a template that cannot be rendered.
    """
    cont = continue_final_message
    cont = cont not in (None, False, "none", "")
    if cont and add_generation_prompt:
        raise _bad("continue_final_message",
                   "Cannot set both add_generation_prompt and continue_final_message to true.")
    if not cont and continue_final_message is None and messages and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise _bad("messages", "Cannot have 2 or more assistant messages at the end of the list.")
        cont, add_generation_prompt = True, False
    if cont and messages and messages[-1].get("tool_calls"):
        raise _bad("continue_final_message", "Cannot continue an assistant message that contains tool calls.")
    kw: Dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if template is not None:
        kw["chat_template"] = template
    if not jinja:
        kw["jinja"] = False
    if template_kwargs:
        kw["chat_template_kwargs"] = template_kwargs
    if tools:
        if not jinja:
            raise APIError(400, "tools need the Jinja chat template: restart the server without --no-jinja",
                           "invalid_request_error", "tools", "not_supported")
        kw["tools"] = list(tools)
    try:
        text = decoder.apply_chat_template(messages, **kw)
    except APIError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise _bad("messages", f"Failed to format input: {e}") from e
    if jinja:
        text = _strip_special(decoder, template, text)
    if not cont:
        return text
    prefilled = _prefill_prompt(decoder, messages, kw, template, jinja)
    return prefilled if prefilled is not None else _cut_after_final(text, messages)


def _content_text(content: Any) -> Optional[str]:
    """A message's text content (OpenAI text parts joined), None when it has none."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(parts) if parts else None
    return None


def _prefill_prompt(decoder: Any, messages: List[Dict[str, Any]], kw: Dict[str, Any], template: Optional[str],
                    jinja: bool) -> Optional[str]:
    """llama-server's prompt for continuing the final message (module docstring): the messages
    before it rendered without the generation prompt, the generation prompt (the part the
    rendering with it adds), then the final message's content as given. None when the final
    message has no text content or is the only message (the caller cuts the full rendering)."""
    content = _content_text(messages[-1].get("content"))
    if not content or len(messages) < 2:
        return None
    head = messages[:-1]
    try:
        base = decoder.apply_chat_template(head, **{**kw, "add_generation_prompt": False})
        with_gen = decoder.apply_chat_template(head, **{**kw, "add_generation_prompt": True})
    except (ValueError, TypeError, KeyError):
        return None
    if jinja:
        base = _strip_special(decoder, template, base)
        with_gen = _strip_special(decoder, template, with_gen)
    n = 0
    while n < min(len(base), len(with_gen)) and base[n] == with_gen[n]:
        n += 1
    return base + with_gen[n:] + content


def _strip_special(decoder: Any, template: Optional[str], text: str) -> str:
    """Drop a template-written leading BOS / trailing EOS that the tokenizer adds itself, as
    llama-server's prompt (and :meth:`dflash2_gguf.chat.templates.ChatRenderer.prompt_text`) does; a
    decoder without the chat renderer (a test fake) keeps the text."""
    try:
        from ..chat.templates import renderer_for

        r = renderer_for(decoder, template)
    except Exception:  # noqa: BLE001 - no renderer for this decoder
        return text
    if getattr(r, "add_bos", False) and r.bos_token and text.startswith(r.bos_token):
        text = text[len(r.bos_token):]
    if getattr(r, "add_eos", False) and r.eos_token and text.endswith(r.eos_token):
        text = text[: -len(r.eos_token)]
    return text


def _cut_after_final(text: str, messages: Sequence[Dict[str, Any]]) -> str:
    """Cut a rendering right after the final message's text (transformers'
    ``continue_final_message``: the stripped content's last occurrence)."""
    final = str(messages[-1].get("content") or "").strip()
    i = text.rfind(final) if final else -1
    if i < 0:
        raise _bad("continue_final_message", "the final message does not appear in the rendered chat, so it "
                                             "cannot be continued (check the chat template)")
    return text[: i + len(final)]


# ---------------------------------------------------------------------------- sampling

def parse_logit_bias(decoder: Any, bias: Any) -> Dict[int, float]:
    """llama-server's ``logit_bias`` forms -> ``{token id: bias}`` (``false`` = -inf = banned).

    Accepts ``[[id or text, bias], ...]`` and ``{"id or text": bias}``; a text key applies to
    each of its tokens; ids outside the vocabulary are skipped, as llama-server skips them.
    """
    out: Dict[int, float] = {}
    if not bias:
        return out
    nv = int(decoder.n_vocab)
    items = bias.items() if isinstance(bias, dict) else [tuple(x) for x in bias if isinstance(x, list) and len(x) == 2]
    for key, val in items:
        if isinstance(val, bool):
            if val:
                continue
            b = -math.inf
        elif isinstance(val, (int, float)):
            b = float(val)
        else:
            continue
        if isinstance(key, int) or (isinstance(key, str) and key.lstrip("-").isdigit()):
            tok = int(key)
            toks = [tok] if 0 <= tok < nv else []
        elif isinstance(key, str):
            toks = decoder.tokenize(key, add_special=False, parse_special=False)
        else:
            continue
        for t in toks:
            out[t] = b
    return out


def schema_grammar(schema: Any) -> str:
    """GBNF for a JSON schema (:func:`dflash2_gguf.chat.grammar.json_schema_to_grammar`).

    Raises:
        APIError: 400 when the schema cannot be converted.
    """
    try:
        from ..chat.grammar import json_schema_to_grammar

        return json_schema_to_grammar(schema)
    except Exception as e:  # noqa: BLE001
        raise _bad("json_schema", f"\"json_schema\": {e}") from e


def format_probs(decoder: Any, items: Sequence[Any], post_sampling: bool = False) -> List[Dict[str, Any]]:
    """llama-server's ``completion_probabilities`` / ``logprobs.content`` entries from
    :class:`~dflash2_gguf.decoder.api.TokenLogprob` items: ``{"id", "token", "bytes", "logprob",
    "top_logprobs": [...]}``. With ``post_sampling_probs``, ``prob`` / ``top_probs`` instead
    (``exp`` of the same log-probabilities: the driver reports the distribution after bias,
    penalties and grammar, before truncation and temperature, for both settings)."""
    def tok(t: int) -> tuple:
        eng = getattr(decoder, "engine", None)
        raw = bytes(eng.detokenize([t], True)) if eng is not None else decoder.detokenize([t], True).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def one(t: int, lp: float) -> Dict[str, Any]:
        text, raw = tok(t)
        d: Dict[str, Any] = {"id": t, "token": text, "bytes": raw}
        if post_sampling:
            d["prob"] = math.exp(lp)
        else:
            d["logprob"] = lp
        return d

    out = []
    for it in items:
        d = one(it.token, it.logprob)
        d["top_probs" if post_sampling else "top_logprobs"] = [one(t, lp) for t, lp in it.top]
        out.append(d)
    return out


def resolve(req: Any, settings: Any) -> Dict[str, Any]:
    """The effective generation parameters of a request: ``{table entry name: value}`` for every
    entry of :data:`dflash2_gguf.decoder.params.PARAMS` that the server has (``settings``' fields) or the
    request's API has, the request's value over the server's.

    Generic entries take the first of their request fields (for the request's API) that is set;
    the custom ones: ``max_tokens`` (``req.token_limit()``; unset or < 0: the server's ``-n``),
    ``n_draft_max`` / ``n_draft_min`` / ``p_min`` (llama-server's ``speculative.*``; ``n_max`` never
    above ``--spec-draft-n-max``), ``n_probs`` (``req.n_probs_wanted()``), ``stop``; ``logit_bias``
    and ``grammar`` are the server's here (the request's are added in :func:`sampling_params`, as
    they need the vocabulary).
    """
    from ..decoder.params import PARAMS

    api = getattr(req, "API", "completion")
    out: Dict[str, Any] = {}
    for p in PARAMS:
        if p.group == "input":
            continue
        default = getattr(settings, p.name, p.default)
        v = None
        if not p.custom:
            for name in p.request.get(api, ()):
                v = getattr(req, name, None)
                if v is not None:
                    break
        out[p.name] = p.normalize(v) if v is not None else default
    limit = req.token_limit()
    out["max_tokens"] = limit if limit is not None and limit >= 0 else settings.max_tokens
    spec = req.spec()
    cap = settings.n_draft_max
    nd = spec["n_max"] if spec["n_max"] is not None else cap
    out["n_draft_max"] = min(nd, cap) if nd is not None and cap is not None else nd
    out["n_draft_min"] = spec["n_min"] if spec["n_min"] is not None else settings.n_draft_min
    out["p_min"] = spec["p_min"] if spec["p_min"] is not None else settings.p_min
    if spec["type"] is not None:
        from ..decoder.params import parse_spec_types

        try:
            types = parse_spec_types(spec["type"])
        except ValueError as e:
            raise _bad("speculative.type", f"speculative.type: {e}") from None
        if "draft-dflash" in types and not getattr(settings, "model_draft", None):
            raise _bad("speculative.type", "speculative.type: draft-dflash needs the server started with -md DRAFT.gguf")
        out["spec_type"] = ",".join(types) or "none"
    for key, name in (("ngram_size_n", "spec_ngram_simple_size_n"), ("ngram_size_m", "spec_ngram_simple_size_m")):
        if spec[key] is not None:
            out[name] = spec[key]
    out["n_probs"] = req.n_probs_wanted()
    out["stop"] = req.stop_list
    return out


def sampling_params(req: Any, values: Dict[str, Any], decoder: Any, *, grammar: Optional[str] = None,
                    n_probs: int = 0) -> Any:
    """:class:`SamplingParams` of request ``req`` from its :func:`resolve` ``values``: every
    sampling entry of the table, the request's ``logit_bias`` (any of llama-server's forms) over
    the server's ``-l``, ``grammar`` (the request's, a JSON schema's or the tool-call grammar;
    else the server's) and ``n_probs``.

    Raises:
        APIError: 400 naming the field for a value :class:`SamplingParams` refuses.
    """
    from ..decoder.params import select
    from ..decoder.sampling import SamplingParams

    names = [p.name for p in select(group="sampling")]
    kw: Dict[str, Any] = {k: values[k] for k in names if k in values}
    bias = dict(values.get("logit_bias") or {})
    bias.update(parse_logit_bias(decoder, getattr(req, "logit_bias", None)))
    kw["logit_bias"] = bias or None
    kw["grammar"] = grammar or values.get("grammar") or None
    kw["n_probs"] = n_probs
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        raise _bad(first if first in names else "temperature", str(e)) from e


# ---------------------------------------------------------------------------- responses

def nested_fields(paths: Sequence[str], obj: Dict[str, Any]) -> Dict[str, Any]:
    """llama-server's ``response_fields``: each ``a/b`` path present in ``obj`` becomes a
    top-level key named by the whole path; missing paths are left out (``json_get_nested_values``)."""
    out: Dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        ok = True
        for k in path.split("/"):
            if isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


# ---------------------------------------------------------------------------- template capabilities

#: llama-server's capability defaults (``jinja::caps``, common/jinja/caps.h at 0c1e570): what
#: ``/props`` ``chat_template_caps`` reports when the template cannot be probed.
TEMPLATE_CAPS_DEFAULT = {
    "supports_object_arguments": False, "supports_parallel_tool_calls": True,
    "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
    "supports_string_content": True, "supports_system_role": True, "supports_tool_calls": True,
    "supports_tools": True, "supports_typed_content": False,
}


def _tool_conversation(calls: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call0000{i + 1}", "type": "function", "function": f} for i, f in enumerate(calls)]},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


def template_caps(model: Any, template: Optional[str] = None) -> Dict[str, bool]:
    """``/props`` ``chat_template_caps`` of the served chat template, by llama-server's probes
    (``caps_get``, common/jinja/caps.cpp at 0c1e570): the same probe conversations (typed
    content, a system message, one tool call with object then string arguments, two calls, an
    earlier turn's ``reasoning_content``, ``reasoning_effort`` low / high). llama-server watches
    which template variables each render reads; we look at the rendered text instead (a marker
    shows up, or the two renderings differ), which agrees for templates that print what they
    read. Any failure to load the template gives :data:`TEMPLATE_CAPS_DEFAULT`.

    ``model``: a loaded decoder (its template read through its engine) or, before one is loaded,
    the GGUF's path.
    """
    caps = dict(TEMPLATE_CAPS_DEFAULT)
    try:
        from ..chat.templates import ChatRenderer, _environment, renderer_for

        base = ChatRenderer.from_gguf(model) if isinstance(model, (str, os.PathLike)) else renderer_for(model)
        env = _environment()
        plain = env.from_string(template if template is not None else base.template)
        with_tools = (plain if template is not None or not base.tool_use_template
                      else env.from_string(base.tool_use_template))
    except Exception as e:  # noqa: BLE001 - a fake or unreadable model: llama-server's defaults
        log.debug("chat_template_caps: template not probed (%s)", e)
        return caps

    def render(tmpl: Any, messages: list, tools: Optional[list] = None, **kw: Any) -> Optional[str]:
        try:
            return tmpl.render(messages=messages, tools=tools, add_generation_prompt=True,
                               bos_token=base.bos_token, eos_token=base.eos_token, **kw)
        except Exception:  # noqa: BLE001 - a template refusing the probe
            return None

    out = render(plain, [{"role": "user", "content": "STRING_MARKER"}])
    caps["supports_string_content"] = out is not None and "STRING_MARKER" in out
    out = render(plain, [{"role": "user", "content": [{"type": "text", "text": "TYPED_MARKER"}]}])
    caps["supports_typed_content"] = out is not None and "TYPED_MARKER" in out and "'type'" not in out
    out = render(plain, [{"role": "system", "content": "SYSTEM_MARKER"}, {"role": "user", "content": "User message"}])
    caps["supports_system_role"] = out is not None and "SYSTEM_MARKER" in out

    tools = [{"type": "function", "function": {
        "name": "TOOL_DEF_MARKER", "description": "Tool description",
        "parameters": {"type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
                       "required": ["arg"]}}}]
    out = render(with_tools, _tool_conversation([{"name": "TOOL_CALL_MARKER", "arguments": {"arg": "ARG_MARKER"}}]),
                 tools)
    caps["supports_object_arguments"] = out is not None and "ARG_MARKER" in out
    if not caps["supports_object_arguments"]:
        out = render(with_tools, _tool_conversation([{"name": "TOOL_CALL_MARKER",
                                                      "arguments": '{"arg": "ARG_MARKER"}'}]), tools)
    caps["supports_tools"] = out is not None and "TOOL_DEF_MARKER" in out
    caps["supports_tool_calls"] = out is not None and "TOOL_CALL_MARKER" in out
    args: Any = {"arg": "value"} if caps["supports_object_arguments"] else '{"arg": "value"}'
    out = render(with_tools, _tool_conversation([{"name": "CALL_A_MARKER", "arguments": args},
                                                 {"name": "CALL_B_MARKER", "arguments": args}]), tools)
    caps["supports_parallel_tool_calls"] = (caps["supports_tool_calls"] and out is not None
                                            and "CALL_A_MARKER" in out and "CALL_B_MARKER" in out)

    out = render(plain, [{"role": "user", "content": "User message"},
                         {"role": "assistant", "content": "Assistant message",
                          "reasoning_content": "<REASONING_CONTENT_PLACEHOLDER>"},
                         {"role": "user", "content": "User message"},
                         {"role": "assistant", "content": "Assistant message",
                          "reasoning_content": "Reasoning content"},
                         {"role": "user", "content": "User message"}], enable_thinking=True)
    caps["supports_preserve_reasoning"] = out is not None and "<REASONING_CONTENT_PLACEHOLDER>" in out
    user = [{"role": "user", "content": "User message"}]
    low = render(plain, user, enable_thinking=True, reasoning_effort="low")
    high = render(plain, user, enable_thinking=True, reasoning_effort="high")
    caps["supports_reasoning_effort"] = low is not None and high is not None and low != high
    return caps
