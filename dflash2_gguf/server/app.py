"""The FastAPI app: :func:`create_app` builds one app around one :class:`Worker` (no globals).

Here: the settings (:class:`ServerSettings`), the request handling the endpoints share
(:class:`Service`: request -> jobs, streaming, chat turns), the middleware (API keys, OPTIONS),
the app's lifespan. The endpoints, as llama-server's README and tools/server/server.cpp at
llama.cpp 0c1e570 route them, one router per API:

- :mod:`.routes_llama`: llama-server's own (``/health``, ``/props``, ``/slots``, ``/metrics``,
  ``/tokenize``, ``/detokenize``, ``/apply-template``, ``/completion``);
- :mod:`.routes_openai`: OpenAI's (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/responses``, the token counts), agents' tools and reasoning included
  (:mod:`dflash2_gguf.chat.output`);
- :mod:`.routes_anthropic`: Anthropic's (``/v1/messages``, ``/v1/messages/count_tokens``);
- not served (404, documented out of scope): embeddings, reranking, infill, LoRA adapters, slot
  save/restore, router mode, ``/v1/chat/completions/control``;
- ``GET /`` (``/index.html``, ``/webui/<asset>``): the web page (:mod:`.web`), public.

Requests: bodies are parsed as JSON whatever their ``Content-Type`` (``curl -d`` sends
``application/x-www-form-urlencoded``), as llama-server parses them; field policy in
:mod:`.types`; prompt, chat and sampling semantics in :mod:`.compat`.

Auth: with API keys set, every path except ``/health``, ``/v1/health`` and the web page's
(:data:`PUBLIC_PATHS`, llama-server's public endpoints) needs ``Authorization: Bearer <key>`` or
``X-Api-Key: <key>``; otherwise 401.
``OPTIONS`` requests never need a key.

CORS (llama-server's ``--cors-*`` flags, header for header, :class:`.web.LlamaCors`): by default
any ``Origin`` is reflected with credentials allowed; ``localhost`` reflects only local origins;
every ``OPTIONS`` is answered 200 with the CORS headers before auth.

Context: ``n_ctx`` is one slot's (``-c`` split across the slots, :mod:`.context`); a prompt of
``n_ctx`` tokens or more is a 400 ``exceed_context_size_error`` with
``n_prompt_tokens`` and ``n_ctx``; a generation that fills the context stops with
``finish_reason`` "length" (llama-server's behaviour without context shift).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from . import compat, web
from ..chat.output import ChatOutput, ToolPlan, finish_reason_for, plan_tools
from .context import ModelInfo, read_model_info
from .errors import APIError, error_response, from_exception, install_error_handlers, validation_error
from .metrics import Metrics
from ..decoder.params import PARAMS, effective_spec_types, table_fields
from .types import ChatCompletionRequest
from .worker import Job, Worker

__all__ = ["ServerSettings", "Service", "create_app", "PUBLIC_PATHS", "BUILD_INFO"]

log = logging.getLogger("dflash2_gguf.server")

#: Paths that never need the API key (llama-server's ``get_public_endpoints``).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"}) | web.PAGE_PATHS

#: ``build_info`` (``/props``) and ``system_fingerprint``: llama-server's ``llama_build_info()``,
#: ``b<build number>-<commit>`` (common/build-info.cpp.in), of the pinned llama.cpp 0c1e570, whose
#: release builds report build 11312.
BUILD_INFO = "b11312-0c1e57098"

_FINISH = {"length": "length", "context": "length", "eog": "stop", "stop": "stop"}
_STOP_TYPE = {"length": "limit", "context": "limit", "eog": "eos", "stop": "word"}
_SAMPLERS = ["top_k", "top_p", "min_p", "temperature"]

#: Keys of llama-server's full generation settings that its ``/slots`` and ``/props`` views leave
#: out (``task_params::to_json(only_metrics)``, tools/server/server-task.cpp at 0c1e570).
_FULL_ONLY_PARAMS = ("dry_sequence_breakers", "stop", "logit_bias", "grammar", "grammar_lazy",
                     "grammar_triggers", "preserved_tokens")

#: llama-server's DRY sequence breakers default (``common_params_sampling``, common/common.h at
#: 0c1e570); reported as is: DRY is off (``dry_multiplier`` 0) here, as it is there by default.
_DRY_BREAKERS = ["\n", ":", "\"", "*"]


def metrics_params(params: dict) -> dict:
    """The ``/slots`` / ``/props`` view of a job's generation settings: llama-server's
    ``only_metrics`` form (no stop strings, bias, grammar, DRY breakers)."""
    return {k: v for k, v in params.items() if k not in _FULL_ONLY_PARAMS}


#: Draft-source settings of a request passed on to ``DFlashDecoder.generate`` as they are
#: (dflash2_gguf/decoder/params.py: ``spec_type``, ``spec_accept``, ``spec_ngram_*``).
_SPEC_KEYS = ("spec_type", "spec_accept", "spec_ngram_simple_size_n", "spec_ngram_simple_size_m",
              "spec_ngram_mod_n_match", "spec_ngram_mod_n_max", "spec_ngram_mod_n_min")


@dataclass(frozen=True)
@table_fields(command="serve")
class ServerSettings:
    """Everything the server needs; ``dflash2-gguf serve`` flags map onto these fields.

    Attributes:
        model: Target GGUF (``-m``).
        model_draft: Drafter GGUF (``-md``); None serves the target alone.
        n_ctx / n_ctx_draft / n_threads / n_threads_draft / n_gpu_layers / n_gpu_layers_draft /
            n_batch / flash_attn / repack / capture / cache_ram_mib:
            :class:`~dflash2_gguf.decoder.api.DFlashDecoder` keywords (``n_ctx`` per slot; ``serve``
            resolves it with :mod:`.context`; ``n_batch`` is min(-b, -ub), ``cache_ram_mib``
            ``--cache-ram``, each slot's).
        verbose: ``-v``: llama.cpp's log, and llama-server's ``__verbose`` in responses.
        n_slots: ``--parallel``: slots (each loads its own decoder, see :mod:`.worker`).
        chat_template_kwargs: ``--chat-template-kwargs``: template variables of every chat
            request (a request's ``chat_template_kwargs`` override them).
        reasoning_effort: ``--reasoning-effort``: given to the chat template unless the request
            sets one (None: not given).
        (generation parameters): one field per entry of :data:`dflash2_gguf.decoder.params.PARAMS` that
            ``serve`` has (``temperature``, ``top_k``, ..., ``presence_penalty``, ``logit_bias``,
            ``grammar``, ``max_tokens`` (-1 = until end of generation or a full context),
            ``ignore_eos``, ``n_draft_max`` (the upper bound of a request's ``speculative.n_max``
            and of the adaptive draft length), ``n_draft_min``, ``p_min``, ``adaptive``), with
            the table's ``serve`` default: the request defaults, set by the same flags as
            llama-server's (``--temp``, ``--presence-penalty``, ``-n`` ...).
        api_key: Required bearer token(s), comma-separated (None = no auth).
        alias: Model names (``--alias a,b``), kept as llama-server keeps them (a sorted set): the
            first in sorted order is the model id; default: the ``-m`` path as given.
        tags: ``--tags`` (informational, in ``/v1/models``; sorted, duplicates dropped).
        chat_template: ``--chat-template`` / ``--chat-template-file`` text (None = the GGUF's).
        jinja: ``--jinja`` (default) / ``--no-jinja``.
        reasoning_format: ``--reasoning-format`` (``none``, ``auto``, ``deepseek``,
            ``deepseek-legacy``; a request's ``reasoning_format`` overrides it).
        enable_thinking: ``--reasoning on|off`` (True / False: ``enable_thinking`` given to the
            template unless the request sets it; None = ``auto``, the template's default).
        cors_origins / cors_methods / cors_headers / cors_credentials: llama-server's ``--cors-*``.
        endpoint_slots: ``--slots`` (default) / ``--no-slots``.
        ui: ``--ui`` (default) / ``--no-ui``: the web page at ``/`` (:mod:`.web`).
        static_path: ``--path DIR``: serve DIR's files at ``/`` instead of the shipped page.
        max_queue: Queued requests beyond this get 503.
        context_shift / n_keep: ``--context-shift`` (a full slot context drops half of what follows
            the first ``n_keep`` tokens and goes on; a request's ``n_keep`` wins) and ``--keep``.
        poll_s: How often a waiting handler checks the worker is alive / the client connected.
    """

    model: str
    model_draft: Optional[str] = None
    n_ctx: int = 4096
    n_ctx_draft: Optional[int] = None
    n_threads: Optional[int] = None
    n_threads_draft: Optional[int] = None
    n_gpu_layers: int = 0
    n_gpu_layers_draft: Optional[int] = None
    n_batch: int = 512
    flash_attn: Optional[bool] = None
    repack: bool = True
    capture: str = "auto"
    cache_ram_mib: int = 1024
    verbose: bool = False
    n_slots: int = 1
    api_key: Optional[str] = None
    alias: Optional[str] = None
    tags: Optional[str] = None
    chat_template: Optional[str] = None
    jinja: bool = True
    reasoning_format: str = "auto"
    enable_thinking: Optional[bool] = None
    cors_origins: str = "*"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    endpoint_slots: bool = True
    ui: bool = True
    static_path: Optional[str] = None
    max_queue: int = 64
    poll_s: float = 0.5
    chat_template_kwargs: Optional[Mapping[str, Any]] = None
    reasoning_effort: Optional[str] = None
    context_shift: bool = False
    n_keep: int = 0

    @property
    def aliases(self) -> list:
        """``--alias`` split on commas, as llama-server keeps them (``std::set``: sorted, no
        duplicates); without ``--alias``, the ``-m`` path as given (llama-server's default)."""
        a = sorted({a.strip() for a in (self.alias or "").split(",") if a.strip()})
        return a or [str(self.model)]

    @property
    def tag_list(self) -> list:
        """``--tags`` split on commas (sorted, no duplicates, as llama-server's set)."""
        return sorted({a.strip() for a in (self.tags or "").split(",") if a.strip()})

    @property
    def api_keys(self) -> list:
        """``--api-key`` split on commas."""
        return [a.strip() for a in (self.api_key or "").split(",") if a.strip()]

    @property
    def model_id(self) -> str:
        """The first alias in sorted order (llama-server's ``model_name``), else the ``-m`` path."""
        return self.aliases[0]

    def generation_defaults(self) -> dict:
        """The request defaults (``--temp``, ``--presence-penalty``, ``-n`` ...): ``{table entry
        name: value}`` for every generation parameter ``serve`` has."""
        return {p.name: getattr(self, p.name) for p in PARAMS if "serve" in p.commands and p.group != "input"}

    def load_decoder(self) -> Any:
        """Build one slot's :class:`~dflash2_gguf.decoder.api.DFlashDecoder` (called in the slot's thread)."""
        from ..decoder.api import DFlashDecoder

        return DFlashDecoder(
            self.model, self.model_draft, n_ctx=self.n_ctx, n_ctx_draft=self.n_ctx_draft,
            n_threads=self.n_threads, n_threads_draft=self.n_threads_draft,
            n_gpu_layers=self.n_gpu_layers, n_gpu_layers_draft=self.n_gpu_layers_draft,
            n_batch=self.n_batch, flash_attn=self.flash_attn, repack=self.repack, capture=self.capture,
            cache_ram_mib=self.cache_ram_mib, verbose=self.verbose,
        )


# ---------------------------------------------------------------------------- helpers

def _client_gone(job: Job) -> APIError:
    """Cancel ``job`` whose client disconnected; the error to raise (499, as nginx logs it)."""
    job.cancel()
    return APIError(499, "client closed the request", "invalid_request_error", None, "client_disconnected")


def _n_cached(st: Any) -> int:
    return int(getattr(st, "n_cached", 0) or 0)


def _timings(st: Any) -> dict:
    """llama-server's ``timings`` object (plus ``draft_n``, ``draft_n_accepted``,
    ``acceptance_length``, ``n_cycles``, ``tokens_per_second``)."""
    pre_ms = st.t_prefill_s * 1000.0
    dec_ms = max(st.t_total_s - st.t_prefill_s, 0.0) * 1000.0
    n_dec = max(st.n_generated - 1, 0)  # the first token comes from the prefill
    cached = _n_cached(st)
    n_pre = max(st.n_prompt - cached, 0)
    return {
        "cache_n": cached,
        "prompt_n": n_pre,
        "prompt_ms": pre_ms,
        "prompt_per_token_ms": pre_ms / n_pre if n_pre else 0.0,
        "prompt_per_second": n_pre / (pre_ms / 1000.0) if pre_ms > 0 else 0.0,
        "predicted_n": st.n_generated,
        "predicted_ms": dec_ms,
        "predicted_per_token_ms": dec_ms / n_dec if n_dec else 0.0,
        "predicted_per_second": st.decode_tokens_per_second,
        "draft_n": st.n_drafted,
        "draft_n_accepted": st.n_accepted,
        "acceptance_length": st.acceptance_length,
        "n_cycles": st.n_cycles,
        "tokens_per_second": st.tokens_per_second,
    }


def _partial_timings(job: Job, n_decoded: int) -> dict:
    """Timings so far for ``timings_per_token`` (from the slot's clock marks in ``job.info``)."""
    t0, t1 = job.info.get("t_start", time.perf_counter()), job.info.get("t_first", time.perf_counter())
    now = time.perf_counter()
    n_all = int(job.info.get("n_prompt", 0))
    cache = min(int(job.cycles[0][1]), n_all) if job.cycles else 0
    n = n_all - cache  # llama-server's prompt_n: evaluated, the prompt-cache hits apart (cache_n)
    pre_ms, dec_ms = (t1 - t0) * 1000.0, (now - t1) * 1000.0
    n_dec = max(n_decoded - 1, 0)
    return {"cache_n": cache, "prompt_n": n, "prompt_ms": pre_ms, "prompt_per_token_ms": pre_ms / n if n else 0.0,
            "prompt_per_second": n / (pre_ms / 1000.0) if pre_ms > 0 else 0.0, "predicted_n": n_decoded,
            "predicted_ms": dec_ms, "predicted_per_token_ms": dec_ms / n_dec if n_dec else 0.0,
            "predicted_per_second": n_dec / (dec_ms / 1000.0) if dec_ms > 0 and n_dec else 0.0}


def _progress(job: Job) -> list:
    """llama-server's ``prompt_progress`` objects of a streamed request with ``return_progress``
    (tools/server/server-context.cpp at 0c1e570): one when the slot starts on the prompt
    (``processed`` = the tokens reused from the prompt cache, ``time_ms`` 0) and one per evaluated
    batch (here the prompt is evaluated in one native call: one more, all processed, ``time_ms``
    = the prefill's). Both are sent once the prefill is done (the stream's status waits for the
    first token, so that a refused request still gets its 4xx). ``cache``: prompt tokens reused
    from the prompt cache (the slot's counters after the first cycle, :attr:`.worker.Job.cycles`)."""
    n = int(job.info.get("n_prompt", 0))
    cache = min(int(job.cycles[0][1]), n) if job.cycles else 0
    t = (job.info.get("t_first", time.perf_counter()) - job.info.get("t_start", time.perf_counter())) * 1000.0
    return [{"total": n, "cache": cache, "processed": cache, "time_ms": 0},
            {"total": n, "cache": cache, "processed": n, "time_ms": int(t)}]


def _usage(stats: Sequence[Any]) -> dict:
    p = sum(s.n_prompt for s in stats)
    c = sum(s.n_generated for s in stats)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(_n_cached(s) for s in stats)}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event_stream(events) -> StreamingResponse:
    """Server-sent events from an async iterator of ``data: ...`` lines, unbuffered."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def parse_body(request: Request, model: Any) -> Any:
    """The request body as ``model``, parsed as JSON whatever the ``Content-Type`` (llama-server
    parses every body as JSON; ``curl -d`` sends ``application/x-www-form-urlencoded``).

    Raises:
        APIError: 400 ``json_invalid`` for a body that is not a JSON object; 400 naming the
            field for a validation error.
    """
    return validate_body(await read_json(request), model)


async def read_json(request: Request) -> dict:
    """The request body as a JSON object, whatever the ``Content-Type``.

    Raises:
        APIError: 400 ``json_invalid`` for a body that is not a JSON object.
    """
    raw = await request.body()
    try:
        obj = json.loads(raw) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", "invalid_request_error", None, "json_invalid") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_request_error", None, "json_invalid")
    return obj


def validate_body(obj: dict, model: Any) -> Any:
    """``obj`` as the pydantic ``model``; raises APIError 400 naming the field."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _piece(dec: Any, tok: int) -> Any:
    """llama-server's token piece: the text when valid UTF-8, else its byte values."""
    eng = getattr(dec, "engine", None)
    raw = bytes(eng.detokenize([tok], True)) if eng is not None else dec.detokenize([tok], True).encode()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


@dataclass
class _Choice:
    """One finished choice: text, tokens, stats, and its job."""

    text: str
    tokens: list
    stats: Any
    job: Job
    logprobs: list = field(default_factory=list)


@dataclass
class ChatTurn:
    """One finished chat choice, split for the three chat APIs.

    Attributes:
        content: Message text (None when there are tool calls and no other text).
        reasoning: ``reasoning_content`` (None: none).
        tool_calls: OpenAI-shaped calls.
        finish_reason: OpenAI's (``stop``, ``length``, ``tool_calls``).
        stop_reason: The driver's (``eog``, ``stop``, ``length``, ``context``).
        stopping_word: The stop string that ended the generation ("" otherwise; llama-server's
            ``stopping_word``).
        stats: :class:`~dflash2_gguf.decoder.api.GenerationStats`.
        job: The job (``info``: prompt text, ``n_prompt``).
    """

    content: Optional[str]
    reasoning: Optional[str]
    tool_calls: list
    finish_reason: str
    stop_reason: str
    stopping_word: str
    stats: Any
    job: Job


# ---------------------------------------------------------------------------- service

class Service:
    """Request handling shared by the endpoints (bound to one app's settings and worker)."""

    def __init__(self, settings: ServerSettings, worker: Worker, metrics: Metrics, info: ModelInfo) -> None:
        self.settings = settings
        self.worker = worker
        self.metrics = metrics
        self.info = info

    # ------------------------------------------------------------------ request -> jobs

    def check_n(self, body: Any) -> int:
        n = body.n_choices
        if n > self.settings.n_slots:
            raise APIError(400, f"Field 'n_cmpl': Value must be between 1 <= value <= {self.settings.n_slots}, "
                                f"but got {n} (n completions need --parallel >= n)", "invalid_request_error",
                           "n", "invalid_value")
        return n

    def grammar_for(self, body: Any) -> tuple:
        """(GBNF or None, the request field it came from)."""
        if body.grammar:
            return body.grammar, "grammar"
        schema = body.output_schema() if hasattr(body, "output_schema") else (
            ({"type": "object"} if body.json_schema in ({}, True) else body.json_schema)
            if body.json_schema is not None else None)
        if schema is None:
            return None, None
        param = "json_schema" if body.json_schema is not None else "response_format"
        return compat.schema_grammar(schema), param

    def job_params(self, body: Any, n_predict: int) -> dict:
        """llama-server's generation settings of a request (``generation_settings``, ``/slots``
        ``params``, ``/props``), with its keys in its order (``task_params::to_json``,
        tools/server/server-task.cpp at 0c1e570).

        Samplers this server does not have (dynamic temperature, top-n-sigma, XTC, typical, DRY,
        Mirostat, adaptive-p, ``min_keep``, backend sampling) are reported with llama-server's
        defaults, which leave them off: a request may only send their neutral values
        (:mod:`.types`), so these are the effective settings. ``logit_bias`` and ``grammar`` are
        filled in by the slot when the request is prepared (the bias needs the vocabulary).
        Ours on top: every other generation parameter of :data:`dflash2_gguf.decoder.params.PARAMS`
        under its ``props`` key, e.g. ``speculative.n_max`` / ``n_min`` / ``p_min`` /
        ``adaptive``, the effective per-request draft settings (llama-server takes them in a
        request but reports only ``speculative.types``)."""
        s = self.settings
        v = compat.resolve(body, s)
        fmt = getattr(body, "reasoning_format", None) or s.reasoning_format
        fmt = "deepseek" if fmt == "auto" else fmt
        drafting = s.model_draft is not None and body.use_drafter
        samplers = ["penalties"] + list(_SAMPLERS)
        out = {
            "seed": -1 if v["seed"] is None else v["seed"], "temperature": v["temperature"],
            "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
            "top_k": v["top_k"], "top_p": v["top_p"], "min_p": v["min_p"],
            "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
            "repeat_last_n": v["repeat_last_n"], "repeat_penalty": v["repeat_penalty"],
            "presence_penalty": v["presence_penalty"], "frequency_penalty": v["frequency_penalty"],
            "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
            "dry_sequence_breakers": list(_DRY_BREAKERS),
            "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
            "adaptive_target": -1.0, "adaptive_decay": 0.9,
            "stop": body.stop_list, "max_tokens": n_predict, "n_predict": n_predict,
            "n_keep": body.n_keep or 0, "n_discard": 0,
            "ignore_eos": v["ignore_eos"], "stream": body.stream, "logit_bias": [],
            "n_probs": body.n_probs_wanted(), "min_keep": 0,
            "grammar": "", "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": [],
            "chat_format": "Content-only", "reasoning_format": fmt,
            "reasoning_in_content": bool(body.stream) and fmt == "deepseek-legacy",
            "generation_prompt": "", "samplers": samplers,
            "speculative.types": "none" + "".join(
                "," + t for t in (effective_spec_types(v.get("spec_type"), s.model_draft is not None) if body.use_drafter
                                  else ())),
        }
        # every other table entry under its generation_settings key (ours: speculative.n_max /
        # n_min / p_min, the effective per-request draft settings; a new entry shows up here)
        for p in PARAMS:
            if p.props and p.props not in out and p.name in v:
                out[p.props] = v[p.name]
        out.update({"timings_per_token": body.timings_per_token, "post_sampling_probs": body.post_sampling_probs,
                    "backend_sampling": False, "lora": []})
        return out

    # ------------------------------------------------------------------ chat: tools, reasoning

    def _tool_template(self, tools: Any) -> tuple:
        """(template text, its name) rendered for a request with ``tools``."""
        s = self.settings
        if s.chat_template is not None:
            return s.chat_template, "the --chat-template template"
        try:
            from ..chat.templates import renderer_for

            r = renderer_for(self.worker.decoder)
            return r.template_for(tools), r.source
        except Exception:  # noqa: BLE001 - a decoder without the renderer: the GGUF's template text
            return self.info.chat_template, f"tokenizer.chat_template of {Path(s.model).name}"

    def tool_plan(self, body: Any) -> ToolPlan:
        """The request's :class:`~dflash2_gguf.chat.output.ToolPlan` (see :mod:`dflash2_gguf.chat.output`).

        Raises:
            APIError: 400 for tools with ``--no-jinja``, tools with a custom grammar / JSON
                schema, malformed tools, a template whose tool format is not supported.
        """
        tools = getattr(body, "tools", None)
        choice = getattr(body, "tool_choice", None)
        if not tools and choice in (None, "auto", "none"):
            return ToolPlan()
        if tools and not self.settings.jinja:
            raise APIError(400, "tools need the Jinja chat template: restart the server without --no-jinja",
                           "invalid_request_error", "tools", "not_supported")
        if body.uses_tools and (body.grammar or body.output_schema() is not None):
            raise APIError(400, "Cannot use custom grammar constraints with tools (grammar, json_schema or "
                                "response_format together with tools); send tool_choice 'none' or drop one",
                           "invalid_request_error", "tools", "invalid_value")
        if body.parse_tool_calls is False:
            choice = "none"
        src, name = self._tool_template(tools) if tools and choice != "none" else (None, "")
        return plan_tools(tools, choice, body.parallel_tool_calls, src, name)

    def chat_output(self, job: Job, body: Any, plan: ToolPlan) -> ChatOutput:
        """A :class:`~dflash2_gguf.chat.output.ChatOutput` for one choice of ``body`` (its prompt is rendered)."""
        fmt = body.reasoning_format or self.settings.reasoning_format
        opens = str(job.info.get("prompt", "")).rstrip().endswith("<think>")
        return ChatOutput(fmt, starts_in_reasoning=opens, plan=plan)

    def stopping_word(self, tokens: Sequence[int], stops: Sequence[str], stop_reason: str) -> str:
        """The stop string that ended a generation: the earliest one in its text ("" when it did
        not end on a stop string)."""
        if stop_reason != "stop" or not stops:
            return ""
        try:
            text = self.worker.decoder.detokenize(list(tokens))
        except Exception:  # noqa: BLE001 - decoder gone: the first stop string is the best guess
            return stops[0]
        hits = [(text.find(w), w) for w in stops if w and w in text]
        return min(hits)[1] if hits else stops[0]

    def finish_turn(self, out: ChatOutput, stats: Any, tokens: Sequence[int], body: Any, job: Job) -> ChatTurn:
        """The :class:`ChatTurn` of a choice whose output went through ``out`` (finished)."""
        calls = out.tool_calls
        return ChatTurn(out.content, out.reasoning, calls, finish_reason_for(stats.stop_reason, calls),
                        stats.stop_reason, self.stopping_word(tokens, body.stop_list, stats.stop_reason), stats, job)

    def turn_of(self, c: "_Choice", body: Any, plan: ToolPlan) -> ChatTurn:
        """The :class:`ChatTurn` of a collected (non-streamed) choice."""
        out = self.chat_output(c.job, body, plan)
        out.feed(c.text)
        out.finish()
        return self.finish_turn(out, c.stats, c.tokens, body, c.job)

    async def turn_stream(self, job: Job, body: Any, plan: ToolPlan) -> AsyncIterator[tuple]:
        """A streamed choice (after :meth:`start_stream`): ``("delta", d)`` for each OpenAI chat
        delta (``reasoning_content``, ``content``, ``tool_calls``), then ``("done", ChatTurn)``.
        Cancels the job if the consumer stops early.

        Raises:
            APIError: the generation failed or was cancelled, or the worker died.
        """
        finished = False
        out: Optional[ChatOutput] = None
        toks: list = []
        try:
            item = job.info.pop("_first")
            while True:
                kind, val = item
                if kind == "error":
                    raise from_exception(val)
                if kind == "cancelled":
                    raise APIError(503, "the generation was cancelled", "unavailable_error", None, "cancelled")
                if out is None:
                    out = self.chat_output(job, body, plan)
                toks += list(val.tokens)
                for d in out.feed(val.text):
                    yield ("delta", d)
                if val.done:
                    for d in out.finish():
                        yield ("delta", d)
                    finished = True
                    yield ("done", self.finish_turn(out, val.stats, toks, body, job))
                    return
                item = await self.next(job)
        finally:
            if not finished:
                job.cancel()

    def make_prepare(self, body: Any, *, prompt: Any = None, messages: Optional[list] = None,
                     chat: Optional[dict] = None, tool_grammar: Optional[str] = None) -> Callable[[Any, Job], dict]:
        """The slot-thread step of a request: tokenize / render, check the context, build the
        generation keywords (see :mod:`.compat`). ``tool_grammar``: the tool-choice grammar
        (:meth:`tool_plan`), used instead of the request's (never both)."""
        s = self.settings
        v = compat.resolve(body, s)
        limit = v["max_tokens"]
        grammar = tool_grammar or self.grammar_for(body)[0] or v["grammar"]
        n_probs = body.n_probs_wanted()
        stop = body.stop_list

        def prepare(dec: Any, job: Job) -> dict:
            job.info["t_start"] = time.perf_counter()
            if messages is not None:
                text = compat.render_chat(dec, messages, template=s.chat_template, jinja=s.jinja, **(chat or {}))
                ids = dec.tokenize(text, add_special=True, parse_special=True)
                job.info["prompt"] = text
            else:
                ids = compat.tokenize_prompt(dec, prompt)
                job.info["prompt"] = compat.prompt_text(prompt)
            job.info["n_prompt"] = len(ids)
            compat.check_context(len(ids), s.n_ctx)
            sampling = compat.sampling_params(body, v, dec, grammar=grammar, n_probs=n_probs)
            if job.params:  # llama-server reports the bias by token id (-inf as null)
                if sampling.logit_bias:
                    job.params["logit_bias"] = [{"bias": None if math.isinf(b) else b, "token": t}
                                                for t, b in sampling.logit_bias.items()]
                if grammar:
                    job.params["grammar"] = grammar
            max_tokens = s.n_ctx - len(ids) if limit < 0 else limit
            return dict(prompt=ids, max_tokens=max_tokens, sampling=sampling, stop=stop or None,
                        n_draft_max=v["n_draft_max"], n_draft_min=int(v["n_draft_min"] or 0), p_min=v["p_min"],
                        adaptive=bool(v["adaptive"]), use_drafter=body.use_drafter, ignore_eos=v["ignore_eos"],
                        cache_prompt=body.cache_prompt, context_shift=s.context_shift,
                        n_keep=s.n_keep if body.n_keep is None else body.n_keep,
                        **{k: v[k] for k in _SPEC_KEYS if v.get(k) is not None})

        prepare.n_predict = limit  # type: ignore[attr-defined]
        return prepare

    def submit_all(self, body: Any, prepares: list) -> list:
        """Submit one job per prepare (each ``n`` times); returns the jobs in choice order."""
        loop = asyncio.get_running_loop()
        jobs = []
        try:
            for prep in prepares:
                params = self.job_params(body, prep.n_predict)
                for _ in range(body.n_choices):
                    job = Job(kwargs={}, loop=loop, prepare=prep, id_slot=body.id_slot, params=params)
                    self.worker.submit(job)
                    jobs.append(job)
        except BaseException:
            for j in jobs:
                j.cancel()
            raise
        return jobs

    async def first(self, job: Job) -> tuple:
        """Wait for a job's first result (so errors still become 4xx JSON)."""
        try:
            item = await self.next(job)
        except BaseException:
            job.cancel()
            raise
        if item[0] == "error":
            raise from_exception(item[1])
        return item

    async def next(self, job: Job, request: Optional[Request] = None) -> tuple:
        """The job's next result; raises APIError 503 if the worker dies while we wait."""
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), timeout=self.settings.poll_s)
                if "t_first" not in job.info:
                    job.info["t_first"] = time.perf_counter()
                return item
            except asyncio.TimeoutError:
                if not self.worker.alive:
                    job.cancel()
                    raise APIError(503, f"the model worker stopped: {self.worker.unavailable_reason()}",
                                   "unavailable_error", None, "unavailable") from None
                if request is not None and await request.is_disconnected():
                    raise _client_gone(job)

    async def collect(self, job: Job, request: Request) -> _Choice:
        """Run a job to its end.

        The client's connection is checked every ``poll_s`` even while chunks keep arriving
        (``next`` only checks when the worker is silent), so a client that gives up on a
        non-streaming request cancels its generation.
        """
        text, toks, lps = [], [], []
        item = await self.first(job)
        last_check = time.monotonic()
        while True:
            if time.monotonic() - last_check >= self.settings.poll_s:
                last_check = time.monotonic()
                if await request.is_disconnected():
                    raise _client_gone(job)
            kind, val = item
            if kind == "error":
                raise from_exception(val)
            if kind == "cancelled":
                raise APIError(503, "the generation was cancelled", "unavailable_error", None, "cancelled")
            text.append(val.text)
            toks += list(val.tokens)
            lps += list(getattr(val, "logprobs", None) or [])
            if val.done:
                if lps:
                    lps = await asyncio.to_thread(compat.format_probs, self.worker.decoder, lps,
                                                  bool(job.params.get("post_sampling_probs")))
                return _Choice("".join(text), toks, val.stats, job, lps)
            item = await self.next(job, request)

    async def collect_all(self, jobs: list, request: Request) -> list:
        try:
            return [await self.collect(j, request) for j in jobs]
        except BaseException:
            for j in jobs:
                j.cancel()
            raise

    async def stream(self, jobs: list, on_chunk: Callable, on_done: Callable, done_line: bool = True,
                     on_start: Optional[Callable] = None) -> AsyncIterator[str]:
        """SSE lines for jobs (one after another, each with its choice index); cancels the jobs if
        the client goes away before the end. ``on_chunk(i, job, chunk)``, ``on_done(i, job,
        stats)`` and ``on_start(i, job)`` return lists of lines."""
        finished = False
        try:
            for i, job in enumerate(jobs):
                item = await self.next(job) if i else None
                if i == 0:
                    item = job.info.pop("_first")
                started = False
                while True:
                    kind, val = item
                    if kind == "chunk":
                        if not started and on_start is not None:
                            for line in on_start(i, job):
                                yield line
                        started = True
                        if val.text or val.tokens:
                            for line in on_chunk(i, job, val):
                                yield line
                        if val.done:
                            for line in on_done(i, job, val.stats):
                                yield line
                            break
                    elif kind == "error":
                        yield _sse(from_exception(val).body())
                        finished = True
                        return
                    else:  # cancelled
                        finished = True
                        return
                    try:
                        item = await self.next(job)
                    except APIError as err:
                        yield _sse(err.body())
                        finished = True
                        return
            if done_line:
                yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                for j in jobs:
                    j.cancel()

    async def start_stream(self, jobs: list) -> None:
        """Wait for the first job's first result before answering 200 (errors stay 4xx)."""
        try:
            jobs[0].info["_first"] = await self.first(jobs[0])
        except BaseException:
            for j in jobs:
                j.cancel()
            raise

    # ------------------------------------------------------------------ shared by the endpoints

    def vocab_decoder(self) -> Any:
        """The decoder whose vocabulary answers /tokenize and friends.

        Raises:
            APIError: 503 while the model loads, after a failed load or when a slot died.
        """
        if not self.worker.alive or self.worker.decoder is None:
            raise APIError(503, self.worker.unavailable_reason(), "unavailable_error", None, "unavailable")
        return self.worker.decoder

    def verbose_of(self, body: Any) -> bool:
        """Whether a response carries llama-server's ``__verbose`` (``-v`` or the request's)."""
        return self.settings.verbose or body.verbose

    def native_final(self, c: _Choice, body: Any, index: int, *, stream: bool) -> dict:
        """llama-server's final ``/completion`` object of choice ``c`` (``stream``: the stream's
        last event, without tokens and probabilities), cut to ``response_fields`` if given."""
        st = c.stats
        stop_type = _STOP_TYPE.get(st.stop_reason, "eos")
        gs = dict(c.job.params)
        out = {
            "index": index, "content": c.text, "tokens": c.tokens if (body.return_tokens and not stream) else [],
            "id_slot": c.job.info.get("id_slot", 0), "stop": True, "model": self.settings.model_id,
            "tokens_predicted": st.n_generated, "tokens_evaluated": st.n_prompt, "generation_settings": gs,
            "prompt": c.job.info.get("prompt", ""), "has_new_line": "\n" in c.text,
            "truncated": st.stop_reason == "context", "stop_type": stop_type,
            "stopping_word": self.stopping_word(c.tokens, body.stop_list, st.stop_reason),
            "tokens_cached": _n_cached(st), "timings": _timings(st),
        }
        if c.logprobs and not stream:
            out["completion_probabilities"] = c.logprobs
        return compat.nested_fields(body.response_fields, out) if body.response_fields else out

    async def generate(self, body: Any, request: Request, prepares: list):
        """Submit one job per prepared prompt: ``(done choices, jobs)``, or ``(None, jobs)`` when
        streaming (once the first job has its first result, so that errors stay 4xx)."""
        self.check_n(body)
        jobs = self.submit_all(body, prepares)
        if not body.stream:
            return await self.collect_all(jobs, request), jobs
        await self.start_stream(jobs)
        return None, jobs

    async def start_chat(self, body: ChatCompletionRequest, request: Request) -> tuple:
        """Submit a chat request: ``(done choices or None when streaming, jobs, tool plan)``."""
        plan = await asyncio.to_thread(self.tool_plan, body)
        prep = self.make_prepare(body, messages=body.template_messages(), chat=_chat_opts(body, self.settings),
                                tool_grammar=plan.grammar)
        done, jobs = await self.generate(body, request, [prep])
        return done, jobs, plan

    async def count_chat_tokens(self, body: ChatCompletionRequest) -> int:
        """Prompt tokens of a chat request as it would be fed (rendered with tools, tokenized)."""
        dec = self.vocab_decoder()
        opts = _chat_opts(body, self.settings)

        def work():
            text = compat.render_chat(dec, body.template_messages(), template=self.settings.chat_template,
                                      jinja=self.settings.jinja, **opts)
            return len(dec.tokenize(text, add_special=True, parse_special=True))

        return await asyncio.to_thread(work)


# ---------------------------------------------------------------------------- app

def create_app(settings: ServerSettings, *, load: Optional[Callable[[], Any]] = None) -> FastAPI:
    """Build the app for ``settings``.

    Args:
        settings: :class:`ServerSettings`.
        load: Decoder factory run in each slot's thread (default: ``settings.load_decoder``);
            tests may pass a fake.

    The slots start (and load the model in their threads) when the app's lifespan starts, and
    stop with it; ``app.state`` holds ``settings``, ``worker``, ``metrics`` and ``model_info``.
    """
    metrics = Metrics()
    worker = Worker(load or settings.load_decoder, metrics, max_queue=settings.max_queue, n_slots=settings.n_slots)
    info = read_model_info(settings.model)
    svc = Service(settings, worker, metrics, info)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="dflash2-gguf", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.model_info = info
    install_error_handlers(app)

    web.install_static(app, settings)  # --path DIR: innermost, after the API key check

    keys = [k.encode() for k in settings.api_keys]
    if keys:
        app.add_middleware(_ApiKey, keys=keys)

    app.add_middleware(_PlainOptions)

    # CORS outermost: preflights are answered before auth, errors carry the CORS headers too.
    web.install(app, settings)  # and the web page at /

    app.state.service = svc
    app.state.start_chat = svc.start_chat
    # the endpoints, one router per API (the route modules import this one: imported here)
    from . import routes_anthropic, routes_llama, routes_openai

    for routes in (routes_llama, routes_openai, routes_anthropic):
        app.include_router(routes.router(svc))

    return app


class _ApiKey:
    """ASGI middleware: with API keys set, every path but :data:`PUBLIC_PATHS` needs
    ``Authorization: Bearer <key>`` or ``X-Api-Key: <key>`` (llama-server's
    ``middleware_validate_api_key``); ``OPTIONS`` never does. Pure ASGI, as :class:`_PlainOptions`."""

    def __init__(self, app: Any, keys: list) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in PUBLIC_PATHS:
            h = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            auth = h.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else (auth or h.get("x-api-key", ""))
            if not given or not any(secrets.compare_digest(given.encode(), k) for k in self.keys):
                resp = error_response(APIError(401, "Invalid API Key", "authentication_error", None, "invalid_api_key"))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _PlainOptions:
    """ASGI middleware: any OPTIONS (a CORS preflight or not) gets an empty 200, as llama-server
    answers it, with the CORS headers of :class:`.web.LlamaCors` outside it (pure ASGI, so that
    ``request.is_disconnected()`` keeps working, which Starlette's ``BaseHTTPMiddleware`` would
    break)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            await Response(status_code=200)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _chat_opts(body: Any, settings: Optional[ServerSettings] = None) -> dict:
    """render_chat keywords from a chat request (tools; template variables: the server's
    ``--chat-template-kwargs`` and ``--reasoning-effort``, then the request's over them, with the
    server's ``--reasoning`` default)."""
    kw = dict((settings.chat_template_kwargs if settings else None) or {})
    if settings is not None and settings.reasoning_effort and not body.reasoning_effort:
        kw.setdefault("reasoning_effort", settings.reasoning_effort)
    kw.update(body.template_kwargs(settings.enable_thinking if settings else None) or {})
    return {"add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "template_kwargs": kw or None,
            "tools": body.tools or None}



