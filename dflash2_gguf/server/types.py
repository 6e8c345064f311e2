"""Request models of the HTTP server (pydantic 2), with their bounds in ``Field``.

Policy on parameters (llama-server's, tools/server/server-schema.cpp at llama.cpp 0c1e570, and
issue 13 item 4):

- Unknown fields are ignored, as llama-server ignores them; each unknown field name is logged once
  per request model (warning ``ignoring unknown request field``), so a typo shows in the log
  without failing clients that send extra fields (the OpenAI Agents SDK's ``parallel_tool_calls``,
  ``cache_control`` on content parts, ``stream_options.include_obfuscation`` ...).
- A known field with the wrong type or out of range is a 400 naming the field (``param``). Where
  llama-server clamps a value silently (its "soft limits": ``top_p``, ``min_p``, ``temperature``
  below 0 ...), we answer 400 instead.
- ``null`` means "absent" (the server default), as in llama-server (``has_value`` in
  server-schema.cpp).
- Fields llama-server honours and this server cannot (``mirostat``, DRY, XTC, ``typical_p``,
  ``top_n_sigma``, dynamic temperature, ``lora``, ``n_indent``, ``t_max_predict_ms``, multimodal
  parts) are accepted only with their neutral value; any other value is a 400 naming the field,
  never a silent ignore.
- The generation parameters (sampling, penalties, ``logit_bias``, ``grammar`` / ``json_schema`` /
  ``response_format``, ``n_probs``, limits, draft settings) are the entries of
  :data:`dflash2_gguf.decoder.params.PARAMS`: the generic ones become fields here with the table's
  bounds; every one maps onto the generation (:func:`.compat.resolve`).
- Generation defaults are the server's (``--temp``, ``--top-k``, ``--presence-penalty``, ``-n``
  ...; llama-server's defaults, e.g. 0.8 / 40 / 0.95 / 0.05 / random / -1 = until end of
  generation or a full context): a request field left out keeps the server's value.
- Token limits: ``n_predict``, ``max_completion_tokens``, ``max_tokens`` are aliases, the first
  given wins in that order (llama-server); -1 = no limit, 0 = evaluate the prompt only.
- ``n`` (alias of llama-server's ``n_cmpl``): 1 <= n <= ``--parallel``, as llama-server.
- Speculative decoding per request: llama-server's names ``speculative.n_max``,
  ``speculative.n_min``, ``speculative.p_min`` (flat keys, or nested in a ``speculative``
  object), plus our older ``n_draft_max`` (= ``speculative.n_max``). ``n_max`` lowers the drafts
  verified per cycle (never above ``--spec-draft-n-max``), ``p_min`` stops reading drafts below
  that draft probability; ``n_min`` (minimum drafts per cycle) is accepted and recorded for the
  adaptive drafting that comes later: today the driver always verifies its drafts up to
  ``n_max`` / ``p_min``, so ``n_min`` changes nothing yet.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model, field_validator, model_validator

__all__ = [
    "StreamOptions", "SpeculativeOptions", "ContentPart", "ChatMessage", "GenerationFields",
    "CompletionRequest", "ChatCompletionRequest", "LlamaCompletionRequest", "TokenizeRequest",
    "DetokenizeRequest", "ApplyTemplateRequest", "ignored_fields",
]

log = logging.getLogger("dflash2_gguf.server")

#: Upper bound on stop strings per request (OpenAI allows 4; llama-server has no bound).
MAX_STOP = 16

_ignored: set = set()
_ignored_lock = threading.Lock()


def ignored_fields() -> set:
    """``{(model name, field name)}`` of unknown request fields seen so far (each logged once)."""
    with _ignored_lock:
        return set(_ignored)


def _note_ignored(model: str, names) -> None:
    for name in names:
        key = (model, name)
        with _ignored_lock:
            if key in _ignored:
                continue
            _ignored.add(key)
        log.warning("ignoring unknown request field %r in %s (logged once per field name)", name, model)


class _Lenient(BaseModel):
    """Base of the request models: unknown fields ignored (logged once), ``null`` = absent."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _log_unknown(self):
        if self.model_extra:
            _note_ignored(type(self).__name__, sorted(self.model_extra))
        return self


def _neutral(name: str, value: Any, neutral: Any, what: str) -> None:
    if value is not None and value != neutral:
        raise ValueError(f"{name} = {value!r} is not supported by this server ({what}); "
                         f"leave it out or send {neutral!r}")


class StreamOptions(_Lenient):
    """OpenAI ``stream_options``: ``include_usage`` adds a final chunk with ``usage``."""

    include_usage: bool = False


class SpeculativeOptions(_Lenient):
    """llama-server's ``speculative`` per-request options (``speculative.n_max`` ...)."""

    n_max: Optional[int] = Field(None, ge=0, le=256, description="drafts verified per cycle (at most)")
    n_min: Optional[int] = Field(None, ge=0, le=256, description="minimum drafts (recorded; no effect yet)")
    p_min: Optional[float] = Field(None, ge=0.0, le=1.0, description="stop reading drafts below this probability")
    type: Optional[Any] = Field(None, description="speculative types (llama-server's speculative.type)")
    ngram_size_n: Optional[int] = Field(None, ge=1, le=1024, description="ngram-simple: shortest suffix looked up")
    ngram_size_m: Optional[int] = Field(None, ge=1, le=1024, description="ngram-simple: most drafts")


#: llama-server sampling fields this server does not have -> (neutral value, what it is).
_NEUTRAL = {
    "mirostat": (0, "Mirostat sampling"),
    "dry_multiplier": (0.0, "DRY sampling"),
    "xtc_probability": (0.0, "XTC sampling"),
    "typical_p": (1.0, "locally typical sampling"),
    "dynatemp_range": (0.0, "dynamic temperature"),
    "n_indent": (0, "minimum indentation"),
    "t_max_predict_ms": (0, "prediction time limit"),
}


def _stop_list(v: Union[str, List[str], None]) -> List[str]:
    if v is None:
        return []
    return [s for s in ([v] if isinstance(v, str) else list(v)) if s]


def _table_model() -> type:
    """A base model with one optional field per generic request field of the generation
    parameters table (:func:`dflash2_gguf.decoder.params.request_fields`, the completion and chat APIs),
    its bounds from the table; None = the server's default."""
    from ..decoder.params import request_fields

    fields: Dict[str, Any] = {}
    for api in ("completion", "chat"):
        for name, p in request_fields(api):
            fields[name] = (Optional[p.type], Field(None, description=p.help, **dict(p.bounds)))
    return create_model("TableFields", __base__=_Lenient, **fields)


class GenerationFields(_table_model()):
    """Sampling, limits and llama-server extensions shared by every generation endpoint; the
    generic generation parameters (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
    penalties, ``ignore_eos`` ...) come from :data:`dflash2_gguf.decoder.params.PARAMS`."""

    #: The API whose request field names (:attr:`dflash2_gguf.decoder.params.Param.request`) apply.
    API: ClassVar[str] = "completion"

    #: The model name every OpenAI client sends. One model per server here: any name is
    #: accepted and answered by the loaded model (llama-server outside router mode does the same).
    model: Optional[str] = None
    logit_bias: Union[Dict[str, Union[float, bool]], List[List[Any]], None] = None
    grammar: Optional[str] = None
    json_schema: Union[Dict[str, Any], bool, None] = None
    n_probs: Optional[int] = Field(None, ge=0, le=100)
    post_sampling_probs: bool = False
    stop: Union[str, List[str], None] = None
    # limits (aliases, first given wins: n_predict, max_completion_tokens, max_tokens)
    n_predict: Optional[int] = Field(None, ge=-1)
    n: Optional[int] = Field(None, ge=1, description="completions per prompt (llama-server's n_cmpl)")
    n_cmpl: Optional[int] = Field(None, ge=1)
    # streaming and response shape
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    timings_per_token: bool = False
    return_progress: bool = False
    return_draft_marks: bool = False  # ours: per-token draft marks on stream chunks (server/web.py)
    return_tokens: bool = False
    response_fields: Optional[List[str]] = None
    verbose: bool = False
    # slots, cache
    id_slot: int = Field(-1, ge=-1)
    cache_prompt: bool = True
    n_keep: Optional[int] = Field(None, ge=-1, description="with --context-shift: tokens never dropped (-1: the prompt)")
    # speculative decoding
    n_draft_max: Optional[int] = Field(None, ge=0, le=256, description="= speculative.n_max")
    use_drafter: bool = True
    speculative: Optional[SpeculativeOptions] = None
    spec_n_max: Optional[int] = Field(None, ge=0, le=256, alias="speculative.n_max")
    spec_n_min: Optional[int] = Field(None, ge=0, le=256, alias="speculative.n_min")
    spec_p_min: Optional[float] = Field(None, ge=0.0, le=1.0, alias="speculative.p_min")
    spec_type: Optional[Any] = Field(None, alias="speculative.type")
    spec_ngram_size_n: Optional[int] = Field(None, ge=1, le=1024, alias="speculative.ngram_size_n")
    spec_ngram_size_m: Optional[int] = Field(None, ge=1, le=1024, alias="speculative.ngram_size_m")
    # llama-server samplers this server does not have: neutral values only
    mirostat: Optional[int] = Field(None, ge=0, le=2)
    dry_multiplier: Optional[float] = None
    xtc_probability: Optional[float] = None
    typical_p: Optional[float] = None
    top_n_sigma: Optional[float] = None
    dynatemp_range: Optional[float] = None
    n_indent: Optional[int] = None
    t_max_predict_ms: Optional[int] = None
    lora: Optional[List[Any]] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if len(_stop_list(v)) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator(*_NEUTRAL)
    @classmethod
    def _neutral_only(cls, v, info):
        neutral, what = _NEUTRAL[info.field_name]
        _neutral(info.field_name, v, neutral, what)
        return v

    @field_validator("top_n_sigma")
    @classmethod
    def _no_sigma(cls, v):
        if v is not None and v > 0:
            raise ValueError("top_n_sigma > 0 is not supported by this server (top-n-sigma sampling); "
                             "leave it out or send -1")
        return v

    @field_validator("lora")
    @classmethod
    def _no_lora(cls, v):
        if v:
            raise ValueError("lora is not supported by this server (no LoRA adapters); send [] or leave it out")
        return v

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.grammar and self.json_schema is not None:
            raise ValueError("Cannot use both json_schema and grammar")
        return self

    # ------------------------------------------------------------------ derived values

    @property
    def stop_list(self) -> List[str]:
        """``stop`` as a list (empty strings dropped; empty when unset)."""
        return _stop_list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when a streaming client asked for the final usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def n_choices(self) -> int:
        """Completions per prompt (``n_cmpl``, else ``n``, else 1)."""
        return self.n_cmpl or self.n or 1

    def token_limit(self) -> Optional[int]:
        """``n_predict``, else the endpoint's other aliases; None = the server's ``-n``."""
        return self.n_predict

    def spec(self) -> Dict[str, Any]:
        """Per-request drafting: ``{"n_max", "n_min", "p_min"}`` (None = the server's)."""
        nested = self.speculative or SpeculativeOptions()
        n_max = next((v for v in (self.spec_n_max, nested.n_max, self.n_draft_max) if v is not None), None)
        n_min = self.spec_n_min if self.spec_n_min is not None else nested.n_min
        p_min = self.spec_p_min if self.spec_p_min is not None else nested.p_min

        def pick(flat, sub):
            return flat if flat is not None else sub

        return {"n_max": n_max, "n_min": n_min, "p_min": p_min, "type": pick(self.spec_type, nested.type),
                "ngram_size_n": pick(self.spec_ngram_size_n, nested.ngram_size_n),
                "ngram_size_m": pick(self.spec_ngram_size_m, nested.ngram_size_m)}


class CompletionRequest(GenerationFields):
    """Body of ``POST /v1/completions`` (OpenAI, with llama-server's extensions).

    ``prompt``: text, token ids, a list of texts (one completion each, as ``choices[i]``), a mixed
    list of ids and texts, or llama-server's ``{"prompt_string": ...}`` object. ``logprobs`` (0..5)
    is OpenAI's top-logprobs count (= ``n_probs``).
    """

    prompt: Any = Field(..., description="llama-server's prompt forms")
    max_tokens: Optional[int] = Field(None, ge=-1)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1, le=1, description="only 1 (llama-server refuses best_of)")
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    suffix: Optional[str] = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("Only no echo is supported (as llama-server)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported (as llama-server); use /infill-style prompts")
        return v

    def token_limit(self) -> Optional[int]:
        return self.n_predict if self.n_predict is not None else self.max_tokens

    def n_probs_wanted(self) -> int:
        """Top-logprobs per token requested (``n_probs``, else ``logprobs``)."""
        return self.n_probs if self.n_probs is not None else (self.logprobs or 0)


class ContentPart(_Lenient):
    """One part of a message's content list: ``{"type": "text", "text": ...}``.

    Media parts (``image_url``, ``input_audio``, ``input_video``, ``file``) are llama-server's
    multimodal input, out of scope here: a 400 names them.
    """

    type: str
    text: Optional[str] = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported: this server has no multimodal "
                             f"input (text parts only)")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class ChatMessage(_Lenient):
    """One chat message; ``content`` is text or a list of text parts. ``tool_calls``,
    ``tool_call_id``, ``name`` and ``reasoning_content`` go to the chat template unchanged."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.role != "assistant" and self.content is None:
            raise ValueError("All non-assistant messages must contain 'content'")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("Assistant message must contain either 'content' or 'tool_calls'")
        return self

    def text(self) -> str:
        """The message content as one string: text parts joined with newlines, as llama-server
        and :func:`dflash2_gguf.chat.templates.normalize_messages` join them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def as_template_dict(self) -> Dict[str, Any]:
        """The message for the chat template (``developer`` -> ``system``)."""
        d: Dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        for k in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d


class ChatCompletionRequest(GenerationFields):
    """Body of ``POST /v1/chat/completions`` (and ``/chat/completions``)."""

    API: ClassVar[str] = "chat"

    messages: List[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=-1)
    max_completion_tokens: Optional[int] = Field(None, ge=-1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    response_format: Optional[Dict[str, Any]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: Union[bool, str, None] = None
    # agents (issue 13): tools, reasoning (llama-server's names, tools/server/README.md at 0c1e570)
    parallel_tool_calls: Optional[StrictBool] = None
    parse_tool_calls: Optional[StrictBool] = None
    reasoning_format: Optional[str] = None
    reasoning_effort: Optional[str] = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if isinstance(v, str) and v not in ("auto", "none", "required"):
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', ...}")
        if isinstance(v, dict):
            fn = v.get("function") if isinstance(v.get("function"), dict) else {}
            if v.get("type") != "function" or not isinstance(fn.get("name"), str):
                raise ValueError("a tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        for i, t in enumerate(v or []):
            fn = t.get("function")
            if t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise ValueError(f"tools[{i}]: only function tools are supported ({{\"type\": \"function\", "
                                 f"\"function\": {{\"name\", \"description\", \"parameters\"}}}}), "
                                 f"got type {t.get('type')!r}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}].function.name must be a non-empty string")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        return v

    @field_validator("reasoning_format")
    @classmethod
    def _reasoning_format(cls, v):
        from ..chat.reasoning import REASONING_FORMATS

        if v is not None and v not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {v!r}")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _thinking_is_bool(cls, v):
        if v and "enable_thinking" in v and not isinstance(v["enable_thinking"], bool):
            raise ValueError("invalid type for \"enable_thinking\" (expected boolean, got "
                             f"{type(v['enable_thinking']).__name__})")
        return v

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be set to true")
        rf = self.response_format
        if rf is not None and rf.get("type", "text") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type must be one of \"text\", \"json_object\" or \"json_schema\", "
                             f"got {rf.get('type')!r}")
        return self

    def token_limit(self) -> Optional[int]:
        for v in (self.n_predict, self.max_completion_tokens, self.max_tokens):
            if v is not None:
                return v
        return None

    def n_probs_wanted(self) -> int:
        """Top-logprobs per token requested (``n_probs``, else ``top_logprobs`` (default 20, as
        llama-server) when ``logprobs`` is true)."""
        if self.n_probs is not None:
            return self.n_probs
        if self.logprobs:
            return self.top_logprobs if self.top_logprobs is not None else 20
        return 0

    def template_messages(self) -> List[Dict[str, Any]]:
        """Messages as dicts for the chat template."""
        return [m.as_template_dict() for m in self.messages]

    def template_kwargs(self, enable_thinking: Optional[bool] = None) -> Optional[Dict[str, Any]]:
        """Template variables: ``chat_template_kwargs`` over the server's ``--reasoning on|off``
        (``enable_thinking``); ``reasoning_effort`` "none" sets ``enable_thinking`` false, another
        value is given to the template as ``reasoning_effort`` (llama-server's
        ``oaicompat_chat_params_parse``). None when there are none."""
        kw: Dict[str, Any] = {}
        if enable_thinking is not None:
            kw["enable_thinking"] = enable_thinking
        kw.update(self.chat_template_kwargs or {})
        if self.reasoning_effort == "none":
            kw["enable_thinking"] = False
            kw.pop("reasoning_effort", None)
        elif self.reasoning_effort:
            kw["reasoning_effort"] = self.reasoning_effort
        return kw or None

    @property
    def uses_tools(self) -> bool:
        """True when tool calls may be produced (tools given and ``tool_choice`` is not "none")."""
        return bool(self.tools) and self.tool_choice != "none" and self.parse_tool_calls is not False

    def output_schema(self) -> Optional[Dict[str, Any]]:
        """The JSON schema that constrains the output (``json_schema`` or ``response_format``),
        ``{"type": "object"}`` for a bare ``json_object``; None when unconstrained."""
        if self.json_schema is not None:
            return self.json_schema if isinstance(self.json_schema, dict) and self.json_schema else {"type": "object"}
        rf = self.response_format or {}
        if rf.get("type") == "json_object":
            return rf.get("schema") or {"type": "object"}
        if rf.get("type") == "json_schema":
            return (rf.get("json_schema") or {}).get("schema") or {"type": "object"}
        return None


class LlamaCompletionRequest(GenerationFields):
    """Body of llama-server's ``POST /completion`` (and ``/completions``): its field names and
    defaults (``n_predict`` -1 = until EOG or a full context; ``seed`` -1 = random). ``prompt``
    takes all of llama-server's forms; several prompts give an array of results."""

    prompt: Any = Field(..., description="llama-server's prompt forms")

    def n_probs_wanted(self) -> int:
        return self.n_probs or 0


class TokenizeRequest(_Lenient):
    """Body of ``POST /tokenize`` (llama-server: ``add_special`` false, ``parse_special`` true)."""

    content: Union[str, List[Union[int, str]], None] = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Lenient):
    """Body of ``POST /detokenize``."""

    tokens: List[int] = Field(default_factory=list)


class ApplyTemplateRequest(ChatCompletionRequest):
    """Body of ``POST /apply-template``: a chat request; only ``messages`` and the template
    options are used."""
