"""Anthropic's endpoints: ``POST /v1/messages`` (the Messages API, translated into a chat request
by :mod:`.messages_api` and run through the chat pipeline) and ``/v1/messages/count_tokens``;
their errors are answered in Anthropic's shape.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from . import messages_api
from .app import Service, _event_stream, read_json, validate_body
from .errors import APIError, from_exception
from .types import ChatCompletionRequest

log = logging.getLogger("dflash2_gguf.server")

__all__ = ["router"]


def router(svc: Service) -> APIRouter:
    """The Anthropic endpoints of the app of ``svc`` (its settings, worker and metrics)."""
    settings, metrics = svc.settings, svc.metrics
    r = APIRouter()

    def anthropic_errors(handler):
        """Answer the handler's errors in Anthropic's shape (:func:`.messages_api.error_body`)."""
        import functools

        @functools.wraps(handler)
        async def wrapped(request: Request):
            try:
                return await handler(request)
            except APIError as e:
                return JSONResponse(messages_api.error_body(e), status_code=e.status)
            except Exception as e:  # noqa: BLE001 - mapped like the app-wide handler
                err = from_exception(e)
                if err.status >= 500:
                    log.exception("internal error on %s", request.url.path, exc_info=e)
                return JSONResponse(messages_api.error_body(err), status_code=err.status)

        return wrapped

    @r.post("/v1/messages")
    @anthropic_errors
    async def messages(request: Request):
        """Anthropic Messages API, translated to a chat request (:mod:`.messages_api`)."""
        metrics.request("/v1/messages")
        body = validate_body(messages_api.to_chat(await read_json(request)), ChatCompletionRequest)
        done, jobs, plan = await svc.start_chat(body, request)
        if done is not None:
            return messages_api.message_object(svc.turn_of(done[0], body, plan), settings.model_id)
        stream = messages_api.MessagesStream(settings.model_id)
        return _event_stream(stream.events(svc.turn_stream(jobs[0], body, plan),
                                           int(jobs[0].info.get("n_prompt", 0))))

    @r.post("/v1/messages/count_tokens")
    @anthropic_errors
    async def messages_count_tokens(request: Request):
        """Anthropic's token count (``{"input_tokens": n}``); ``max_tokens`` not needed."""
        raw = await read_json(request)
        raw.setdefault("max_tokens", 1)
        body = validate_body(messages_api.to_chat(raw), ChatCompletionRequest)
        return {"input_tokens": await svc.count_chat_tokens(body)}

    return r
