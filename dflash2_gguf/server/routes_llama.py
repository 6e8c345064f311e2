"""llama-server's own endpoints (tools/server/server.cpp at llama.cpp 0c1e570 routes them):

- ``GET /health`` (``/v1/health``): 200 ``{"status": "ok"}`` when every slot has its model; 503
  ``unavailable_error`` while loading, after a failed load, or when a slot thread died.
- ``GET /props`` (``POST /props``: 501), ``GET /slots`` (``?fail_on_no_slot=1``; 501 with
  ``--no-slots``), ``GET /metrics`` (Prometheus text, :mod:`.metrics`; always on).
- ``POST /tokenize``, ``/detokenize``, ``/apply-template``.
- ``POST /completion`` and ``/completions``: the native completion (its stream has no ``[DONE]``
  line); several prompts (or ``n`` > 1) give an array of results.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import compat
from .app import (BUILD_INFO, Service, _chat_opts, _Choice, _event_stream, _partial_timings, _piece, _progress, _sse,
                  metrics_params, parse_body)
from .errors import APIError, error_response
from .types import ApplyTemplateRequest, DetokenizeRequest, LlamaCompletionRequest, TokenizeRequest

__all__ = ["router"]


def router(svc: Service) -> APIRouter:
    """The llama-server endpoints of the app of ``svc`` (its settings, worker and metrics)."""
    settings, worker, metrics, info = svc.settings, svc.worker, svc.metrics, svc.info
    r = APIRouter()

    @r.get("/health")
    @r.get("/v1/health")
    async def health():
        """200 when every slot is alive with a loaded model, else 503."""
        if worker.alive:
            return {"status": "ok", "slots_idle": settings.n_slots - worker.busy, "slots_processing": worker.busy,
                    "queued": worker.queued}
        return error_response(APIError(503, worker.unavailable_reason(), "unavailable_error", None, "unavailable"))

    def default_params() -> dict:
        return svc.job_params(LlamaCompletionRequest(prompt=""), settings.max_tokens)

    caps_cache: list = []

    def template_caps() -> dict:
        """``chat_template_caps`` of the served template (see :func:`compat.template_caps`),
        computed once."""
        if not caps_cache:
            dec = worker.decoder if worker.alive else None  # the loaded target, else its file
            caps_cache.append(compat.template_caps(dec if dec is not None else settings.model, settings.chat_template))
        return caps_cache[0]

    @r.get("/props")
    async def props():
        """llama-server's ``GET /props`` (``default_generation_settings`` is ``{params, n_ctx}``
        with the ``/slots`` view of the params, as server-context.cpp at 0c1e570 builds it)."""
        caps = await asyncio.to_thread(template_caps)
        return {
            "default_generation_settings": {"params": metrics_params(default_params()), "n_ctx": settings.n_ctx},
            "total_slots": settings.n_slots, "model_alias": settings.model_id, "model_ftype": info.ftype,
            "model_path": settings.model,
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": None, "endpoint_slots": settings.endpoint_slots, "endpoint_props": False,
            "endpoint_metrics": True, "ui": settings.ui, "ui_settings": {},
            "chat_template": settings.chat_template if settings.chat_template is not None else info.chat_template,
            "chat_template_caps": caps, "bos_token": info.bos_token, "eos_token": info.eos_token,
            "build_info": BUILD_INFO, "is_sleeping": False, "cors_proxy_enabled": False,
        }

    @r.post("/props")
    async def props_post():
        """Changing global properties is not supported (llama-server needs ``--props`` for it)."""
        raise APIError(501, "changing global properties (POST /props) is not supported by this server",
                       "not_supported_error", None, "not_supported")

    @r.get("/slots")
    async def slots(request: Request):
        """llama-server's ``GET /slots`` (``?fail_on_no_slot=1``: 503 when no slot is free)."""
        if not settings.endpoint_slots:
            raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           "not_supported_error", None, "not_supported")
        if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") and \
                all(s.busy for s in worker.slots):
            raise APIError(503, "no slot available", "unavailable_error", None, "unavailable")
        out = []
        for s in worker.slots:
            job, last = s.job, s.last_job
            e = {"id": s.id, "n_ctx": settings.n_ctx, "speculative": settings.model_draft is not None,
                 "is_processing": job is not None}
            if last is not None:  # llama-server: task fields once the slot has had a task
                n_pred = s.last_params.get("n_predict", -1)
                n_prompt = int(last.info.get("n_prompt", 0))
                n_cached = int(last.info.get("n_cached", 0))
                e.update({
                    "id_task": last.id, "n_prompt_tokens": n_prompt,
                    "n_prompt_tokens_processed": max(n_prompt - n_cached, 0), "n_prompt_tokens_cache": n_cached,
                    "params": metrics_params(s.last_params),
                    "next_token": [{"has_next_token": job is not None, "has_new_line": s.has_new_line,
                                    "n_remain": (n_pred - s.n_decoded) if job is not None and n_pred >= 0 else -1,
                                    "n_decoded": s.n_decoded}],
                })
            out.append(e)
        return out

    @r.get("/metrics")
    async def prom():
        """Prometheus text."""
        return PlainTextResponse(metrics.prometheus(), media_type="text/plain; version=0.0.4")

    @r.post("/tokenize")
    async def tokenize(request: Request):
        """llama-server's ``/tokenize`` (``add_special`` false, ``parse_special`` true by default)."""
        body = await parse_body(request, TokenizeRequest)
        dec = svc.vocab_decoder()

        def work():
            if body.content is None:
                return []
            c = body.content
            if isinstance(c, str):
                toks = dec.tokenize(c, add_special=body.add_special, parse_special=body.parse_special)
            else:
                toks = []
                for i, x in enumerate(c):
                    toks += dec.tokenize(x, add_special=body.add_special and i == 0,
                                         parse_special=body.parse_special) if isinstance(x, str) else [int(x)]
            return [{"id": t, "piece": _piece(dec, t)} for t in toks] if body.with_pieces else toks

        return {"tokens": await asyncio.to_thread(work)}

    @r.post("/detokenize")
    async def detokenize(request: Request):
        """llama-server's ``/detokenize`` (special tokens rendered)."""
        body = await parse_body(request, DetokenizeRequest)
        dec = svc.vocab_decoder()
        nv = int(dec.n_vocab)
        bad = [t for t in body.tokens if not 0 <= t < nv]
        if bad:
            raise APIError(400, f"token id {bad[0]} out of range [0, {nv})", "invalid_request_error", "tokens",
                           "invalid_value")
        return {"content": await asyncio.to_thread(dec.detokenize, body.tokens, True)}

    @r.post("/apply-template")
    async def apply_template(request: Request):
        """llama-server's ``/apply-template``: the rendered chat prompt, no generation."""
        body = await parse_body(request, ApplyTemplateRequest)
        dec = svc.vocab_decoder()
        text = await asyncio.to_thread(compat.render_chat, dec, body.template_messages(),
                                       template=settings.chat_template, jinja=settings.jinja,
                                       **_chat_opts(body, settings))
        return {"prompt": text}

    @r.post("/completion")
    @r.post("/completions")
    async def llama_completion(request: Request):
        """llama-server's native ``/completion``."""
        metrics.request("/completion")
        body = await parse_body(request, LlamaCompletionRequest)
        prompts = compat.split_prompts(body.prompt)
        done, jobs = await svc.generate(body, request, [svc.make_prepare(body, prompt=p) for p in prompts])
        if done is not None:
            res = [svc.native_final(c, body, i, stream=False) for i, c in enumerate(done)]
            return res[0] if len(res) == 1 else JSONResponse(res)

        n_dec = {}

        def on_start(i, job):
            return [_sse({"index": i, "content": "", "tokens": [], "stop": False, "id_slot": job.info.get("id_slot", 0),
                          "tokens_predicted": 0, "tokens_evaluated": job.info.get("n_prompt", 0),
                          **({"timings": _partial_timings(job, 0)} if body.timings_per_token else {}),
                          "prompt_progress": pp}) for pp in (_progress(job) if body.return_progress else [])]

        toks_of: dict = {}

        def on_chunk(i, job, ch):
            n_dec[i] = n_dec.get(i, 0) + len(ch.tokens)
            toks_of.setdefault(i, []).extend(ch.tokens)
            o = {"index": i, "content": ch.text, "tokens": list(ch.tokens), "stop": False,
                 "id_slot": job.info.get("id_slot", 0), "tokens_predicted": n_dec[i],
                 "tokens_evaluated": job.info.get("n_prompt", 0)}
            if body.timings_per_token:
                o["timings"] = _partial_timings(job, n_dec[i])
            lp = compat.format_probs(worker.decoder, getattr(ch, "logprobs", None) or [], body.post_sampling_probs)
            if lp:
                o["completion_probabilities"] = lp
            return [_sse(o)]

        def on_done(i, job, st):
            return [_sse(svc.native_final(_Choice("", toks_of.get(i, []), st, job), body, i, stream=True))]

        return _event_stream(svc.stream(jobs, on_chunk, on_done, done_line=False, on_start=on_start))

    return r
