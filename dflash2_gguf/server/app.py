"""The FastAPI app: :func:`create_app` builds one app around one :class:`Worker` (no globals).

Endpoints (llama-server's paths and field names where it has them):

- ``GET /health`` (``/v1/health``): 200 ``{"status": "ok"}`` when the worker is alive with a
  loaded model; 503 with an OpenAI-shaped error while loading, after a failed load, or when the
  worker thread died.
- ``GET /v1/models`` (``/models``): the one served model (``--alias`` or the target file name).
- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI shapes, SSE streaming ending
  with ``data: [DONE]``; every response (the last chunk when streaming) also carries llama-server's
  ``timings`` object with ``draft_n`` / ``draft_n_accepted`` and our ``acceptance_length``.
- ``POST /completion`` (``/completions``): llama-server's native completion (``prompt``,
  ``n_predict``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stream``, ``stop``;
  response ``content``, ``tokens_predicted``, ``tokens_evaluated``, ``stop_type``, ``timings``).
  Its stream has no ``[DONE]`` line, as llama-server's.
- ``GET /metrics``: Prometheus text (see :mod:`.metrics`).

With ``api_key`` set, every path except ``/health``, ``/v1/health``, ``/models`` and
``/v1/models`` (llama-server's public endpoints) needs ``Authorization: Bearer <key>`` (or
``X-Api-Key: <key>``); otherwise 401.

Context: a prompt that does not fit ``n_ctx`` is a 400 ``context_length_exceeded``; a generation
that fills the context stops with ``finish_reason`` "length" (llama-server's behaviour; OpenAI
would reject ``prompt + max_tokens > n_ctx`` up front).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from .errors import APIError, error_body, error_response, from_exception, install_error_handlers
from .metrics import Metrics
from .types import ChatCompletionRequest, CompletionRequest, LlamaCompletionRequest
from .worker import Job, Worker

__all__ = ["ServerSettings", "create_app"]

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models"})

_FINISH = {"length": "length", "context": "length", "eog": "stop", "stop": "stop"}
_STOP_TYPE = {"length": "limit", "context": "limit", "eog": "eos", "stop": "word"}


@dataclass(frozen=True)
class ServerSettings:
    """Everything the server needs; ``dflash2-gguf serve`` flags map onto these fields.

    Attributes:
        model: Target GGUF (``-m``).
        model_draft: Drafter GGUF (``-md``); None serves the target alone.
        n_ctx / n_ctx_draft / n_threads / n_threads_draft / n_gpu_layers / n_gpu_layers_draft /
            flash_attn / repack / capture: :class:`~dflash2_gguf.api.DFlashDecoder` keywords.
        n_draft_max: Default drafts verified per cycle (``--spec-draft-n-max``; None = block
            size - 1); a request may lower it with ``n_draft_max``.
        p_min: ``--spec-draft-p-min``.
        api_key: Required bearer token (None = no auth).
        alias: Model id in responses (default: the target's file name).
        max_queue: Queued requests beyond this get 503.
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
    flash_attn: Optional[bool] = None
    repack: bool = True
    capture: str = "auto"
    verbose: bool = False
    n_draft_max: Optional[int] = None
    p_min: float = 0.0
    api_key: Optional[str] = None
    alias: Optional[str] = None
    max_queue: int = 64
    poll_s: float = 0.5

    @property
    def model_id(self) -> str:
        """``alias``, else the target's file name."""
        return self.alias or Path(self.model).name

    def load_decoder(self) -> Any:
        """Build the :class:`~dflash2_gguf.api.DFlashDecoder` (called in the worker thread)."""
        from ..api import DFlashDecoder

        return DFlashDecoder(
            self.model, self.model_draft, n_ctx=self.n_ctx, n_ctx_draft=self.n_ctx_draft,
            n_threads=self.n_threads, n_threads_draft=self.n_threads_draft,
            n_gpu_layers=self.n_gpu_layers, n_gpu_layers_draft=self.n_gpu_layers_draft,
            flash_attn=self.flash_attn, repack=self.repack, capture=self.capture, verbose=self.verbose,
        )


def _client_gone(job: Job) -> APIError:
    """Cancel ``job`` whose client disconnected; the error to raise (499, as nginx logs it)."""
    job.cancel()
    return APIError(499, "client closed the request", "invalid_request_error", None, "client_disconnected")


def _timings(st: Any) -> dict:
    """llama-server's ``timings`` object (plus ``acceptance_length`` and ``n_cycles``)."""
    pre_ms = st.t_prefill_s * 1000.0
    dec_ms = max(st.t_total_s - st.t_prefill_s, 0.0) * 1000.0
    n_dec = max(st.n_generated - 1, 0)  # the first token comes from the prefill
    return {
        "prompt_n": st.n_prompt,
        "prompt_ms": pre_ms,
        "prompt_per_token_ms": pre_ms / st.n_prompt if st.n_prompt else 0.0,
        "prompt_per_second": st.n_prompt / (pre_ms / 1000.0) if pre_ms > 0 else 0.0,
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


def _usage(st: Any) -> dict:
    return {"prompt_tokens": st.n_prompt, "completion_tokens": st.n_generated,
            "total_tokens": st.n_prompt + st.n_generated}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _event_stream(events) -> StreamingResponse:
    """Server-sent events from an async iterator of ``data: ...`` lines, unbuffered."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _closing_events(chunk: Callable[[Any, Optional[str]], dict], empty: Any, st: Any,
                    include_usage: bool) -> list[str]:
    """The last events of an OpenAI stream: the chunk with ``finish_reason`` (plus llama-server's
    ``timings``) and, with ``stream_options.include_usage``, a usage chunk with no choices.
    ``chunk(payload, finish_reason)`` builds one chunk; ``empty`` is its empty payload."""
    last = chunk(empty, _FINISH.get(st.stop_reason, "stop"))
    last["timings"] = _timings(st)
    events = [_sse(last)]
    if include_usage:
        u = chunk(empty, None)
        u["choices"] = []
        u["usage"] = _usage(st)
        events.append(_sse(u))
    return events


class _Service:
    """Request handling shared by the endpoints (bound to one app's settings and worker)."""

    def __init__(self, settings: ServerSettings, worker: Worker, metrics: Metrics) -> None:
        self.settings = settings
        self.worker = worker
        self.metrics = metrics

    def sampling(self, r: Any, seed: Optional[int]) -> Any:
        from ..sampling import SamplingParams

        return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, seed=seed)

    def gen_kwargs(self, *, max_tokens: Optional[int], sampling: Any, stop: list, n_draft_max: Optional[int],
                   use_drafter: bool = True, ignore_eos: bool = False, **prompt: Any) -> dict:
        s = self.settings
        nd = n_draft_max if n_draft_max is not None else s.n_draft_max
        if nd is not None and s.n_draft_max is not None:
            nd = min(nd, s.n_draft_max)
        return dict(prompt, max_tokens=int(max_tokens or s.n_ctx), sampling=sampling, stop=stop or None,
                    n_draft_max=nd, p_min=s.p_min, use_drafter=use_drafter, ignore_eos=ignore_eos)

    async def start(self, kwargs: dict) -> tuple[Job, tuple]:
        """Submit a job and wait for its first result (so errors still become 4xx JSON)."""
        job = Job(kwargs=kwargs, loop=asyncio.get_running_loop())
        self.worker.submit(job)
        try:
            first = await self.next(job)
        except BaseException:
            job.cancel()
            raise
        if first[0] == "error":
            raise from_exception(first[1])
        return job, first

    async def next(self, job: Job, request: Optional[Request] = None) -> tuple:
        """The job's next result; raises APIError 503 if the worker dies while we wait."""
        while True:
            try:
                return await asyncio.wait_for(job.out.get(), timeout=self.settings.poll_s)
            except asyncio.TimeoutError:
                if not self.worker.alive:
                    job.cancel()
                    raise APIError(503, f"the model worker stopped: {self.worker.unavailable_reason()}",
                                   "server_error", None, "unavailable") from None
                if request is not None and await request.is_disconnected():
                    raise _client_gone(job)

    async def collect(self, job: Job, first: tuple, request: Request) -> tuple[str, list, Any]:
        """Run a job to its end; returns (text, tokens, stats).

        The client's connection is checked every ``poll_s`` even while chunks keep arriving
        (``next`` only checks when the worker is silent), so a client that gives up on a
        non-streaming request cancels its generation.
        """
        text, toks, item = [], [], first
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
                raise APIError(503, "the generation was cancelled", "server_error", None, "cancelled")
            text.append(val.text)
            toks += list(val.tokens)
            if val.done:
                return "".join(text), toks, val.stats
            item = await self.next(job, request)

    async def stream(self, job: Job, first: tuple, on_chunk: Callable, on_done: Callable,
                     done_line: bool = True) -> AsyncIterator[str]:
        """SSE lines for a job; cancels the job if the client goes away before the end."""
        finished = False
        try:
            item = first
            while True:
                kind, val = item
                if kind == "chunk":
                    if val.text or val.tokens:
                        line = on_chunk(val)
                        if line:
                            yield line
                    if val.done:
                        for line in on_done(val.stats):
                            yield line
                        if done_line:
                            yield "data: [DONE]\n\n"
                        finished = True
                        return
                elif kind == "error":
                    err = from_exception(val)
                    yield _sse(error_body(err.message, err.type, err.param, err.code))
                    finished = True
                    return
                else:  # cancelled
                    finished = True
                    return
                try:
                    item = await self.next(job)
                except APIError as err:
                    yield _sse(error_body(err.message, err.type, err.param, err.code))
                    finished = True
                    return
        finally:
            if not finished:
                job.cancel()


def create_app(settings: ServerSettings, *, load: Optional[Callable[[], Any]] = None) -> FastAPI:
    """Build the app for ``settings``.

    Args:
        settings: :class:`ServerSettings`.
        load: Decoder factory run in the worker thread (default: ``settings.load_decoder``);
            tests may pass a fake.

    The worker starts (and loads the model in its thread) when the app's lifespan starts, and
    stops with it; ``app.state`` holds ``settings``, ``worker`` and ``metrics``.
    """
    metrics = Metrics()
    worker = Worker(load or settings.load_decoder, metrics, max_queue=settings.max_queue)
    svc = _Service(settings, worker, metrics)

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
    install_error_handlers(app)

    if settings.api_key:
        key = settings.api_key

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path not in PUBLIC_PATHS:
                auth = request.headers.get("authorization", "")
                given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
                if not given or not secrets.compare_digest(given.encode(), key.encode()):
                    return error_response(APIError(401, "invalid or missing API key", "authentication_error",
                                                   None, "invalid_api_key"))
            return await call_next(request)

    # ------------------------------------------------------------------ info

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        """200 when the worker is alive with a loaded model, else 503."""
        if worker.alive:
            return {"status": "ok", "queued": worker.queued, "processing": int(worker.busy)}
        return error_response(APIError(503, worker.unavailable_reason(), "server_error", None, "unavailable"))

    created = int(time.time())

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        """The served model."""
        return {"object": "list", "data": [{
            "id": settings.model_id, "object": "model", "created": created, "owned_by": "dflash2-gguf",
            "meta": {"n_ctx": settings.n_ctx, "target": os.path.basename(settings.model),
                     "drafter": os.path.basename(settings.model_draft) if settings.model_draft else None,
                     "spec_type": "draft-dflash" if settings.model_draft else "none",
                     "n_draft_max": settings.n_draft_max},
        }]}

    @app.get("/metrics")
    async def prom():
        """Prometheus text."""
        return PlainTextResponse(metrics.prometheus(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ OpenAI

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI text completion."""
        metrics.request("/v1/completions")
        prompt = body.prompt
        kw = svc.gen_kwargs(prompt=prompt, max_tokens=body.max_tokens, sampling=svc.sampling(body, body.seed),
                            stop=body.stop_list, n_draft_max=body.n_draft_max, use_drafter=body.use_drafter)
        job, first = await svc.start(kw)
        cid, now, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), settings.model_id

        def obj(text: str, finish: Optional[str]) -> dict:
            return {"id": cid, "object": "text_completion", "created": now, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        if not body.stream:
            text, _toks, st = await svc.collect(job, first, request)
            out = obj(text, _FINISH.get(st.stop_reason, "stop"))
            out["usage"] = _usage(st)
            out["timings"] = _timings(st)
            return out

        def on_chunk(ch) -> Optional[str]:
            return _sse(obj(ch.text, None)) if ch.text else None

        def on_done(st) -> list:
            return _closing_events(obj, "", st, body.include_usage)

        return _event_stream(svc.stream(job, first, on_chunk, on_done))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completion (prompt rendered with the GGUF's chat template)."""
        metrics.request("/v1/chat/completions")
        kw = svc.gen_kwargs(messages=body.chat_messages(), max_tokens=body.token_limit,
                            sampling=svc.sampling(body, body.seed), stop=body.stop_list,
                            n_draft_max=body.n_draft_max, use_drafter=body.use_drafter)
        job, first = await svc.start(kw)
        cid, now, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), settings.model_id

        if not body.stream:
            text, _toks, st = await svc.collect(job, first, request)
            return {"id": cid, "object": "chat.completion", "created": now, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": _FINISH.get(st.stop_reason, "stop")}],
                    "usage": _usage(st), "timings": _timings(st)}

        def obj(delta: dict, finish: Optional[str]) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        sent_role = [False]

        def on_chunk(ch) -> Optional[str]:
            if not ch.text:
                return None
            delta = {"content": ch.text}
            if not sent_role[0]:
                delta = {"role": "assistant", "content": ch.text}
                sent_role[0] = True
            return _sse(obj(delta, None))

        def on_done(st) -> list:
            opening = [] if sent_role[0] else [_sse(obj({"role": "assistant", "content": ""}, None))]
            return opening + _closing_events(obj, {}, st, body.include_usage)

        return _event_stream(svc.stream(job, first, on_chunk, on_done))

    # ------------------------------------------------------------------ llama-server native

    @app.post("/completion")
    @app.post("/completions")
    async def llama_completion(body: LlamaCompletionRequest, request: Request):
        """llama-server's ``/completion``."""
        metrics.request("/completion")
        seed = None if body.seed < 0 else body.seed
        n_predict = None if body.n_predict < 0 else body.n_predict
        kw = svc.gen_kwargs(prompt=body.prompt, max_tokens=n_predict, sampling=svc.sampling(body, seed),
                            stop=list(body.stop), n_draft_max=body.n_draft_max, ignore_eos=body.ignore_eos)
        job, first = await svc.start(kw)

        def final(text: str, toks: list, st) -> dict:
            stop_type = _STOP_TYPE.get(st.stop_reason, "eos")
            return {"content": text, "tokens": toks, "id_slot": 0, "stop": True, "model": settings.model_id,
                    "tokens_predicted": st.n_generated, "tokens_evaluated": st.n_prompt,
                    "generation_settings": {"n_predict": body.n_predict, "temperature": body.temperature,
                                            "top_k": body.top_k, "top_p": body.top_p, "min_p": body.min_p,
                                            "seed": body.seed, "stop": list(body.stop), "n_ctx": settings.n_ctx},
                    "stop_type": stop_type, "stopping_word": body.stop[0] if stop_type == "word" and body.stop else "",
                    "truncated": False, "has_new_line": "\n" in text, "timings": _timings(st)}

        if not body.stream:
            text, toks, st = await svc.collect(job, first, request)
            return final(text, toks, st)

        def on_chunk(ch) -> Optional[str]:
            return _sse({"content": ch.text, "tokens": list(ch.tokens), "stop": False, "id_slot": 0})

        def on_done(st) -> list:
            return [_sse(final("", [], st))]

        return _event_stream(svc.stream(job, first, on_chunk, on_done, done_line=False))

    return app

