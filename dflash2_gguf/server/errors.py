"""OpenAI-shaped errors and the exception handlers of the app.

Every error response has the body ``{"error": {"message", "type", "param", "code"}}`` (the shape
the official ``openai`` client parses into ``openai.APIStatusError``), also on llama-server's
``/completion``. ``type`` is llama-server's (``format_error_response`` in
tools/server/server-common.cpp at llama.cpp 0c1e570); ``code`` is OpenAI's string code where
llama-server puts the HTTP status (clients read the status from the response line):

========================================  ======  ==========================  =========================
cause                                     status  type                        code
========================================  ======  ==========================  =========================
invalid JSON, wrong type / out-of-range   400     invalid_request_error       invalid_value / json_invalid
parameter (pydantic validation)                                               / missing_required_parameter
prompt does not fit the context           400     exceed_context_size_error   context_length_exceeded
(plus llama-server's ``n_prompt_tokens`` and ``n_ctx`` in the error object)
missing or wrong API key                  401     authentication_error        invalid_api_key
unknown path                              404     not_found_error             not_found
wrong method                              405     invalid_request_error       method_not_allowed
feature not supported / disabled          501     not_supported_error         not_supported
queue full                                503     unavailable_error           server_busy
model loading / worker dead               503     unavailable_error           unavailable
anything else                             500     server_error                internal_error
========================================  ======  ==========================  =========================

Unknown request fields are not errors (see :mod:`.types`).

A 500 is logged with its traceback and the server keeps serving.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "error_body", "error_response", "install_error_handlers", "from_exception",
           "validation_error", "context_error"]

log = logging.getLogger("dflash2_gguf.server")


class APIError(Exception):
    """An error to return to the client in the OpenAI shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, extra: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.extra = dict(extra or {})

    def body(self) -> dict:
        """``{"error": {...}}`` for this error (with its extra fields)."""
        return error_body(self.message, self.type, self.param, self.code, **self.extra)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None, **extra) -> dict:
    """The OpenAI error object ``{"error": {...}}`` (``extra``: llama-server's additional fields)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


def context_error(n_prompt: int, n_ctx: int) -> APIError:
    """llama-server's error for a prompt that does not fit: 400 ``exceed_context_size_error`` with
    ``n_prompt_tokens`` and ``n_ctx`` (``send_error`` in tools/server/server-context.cpp at 0c1e570:
    a prompt of ``n_ctx`` tokens or more is refused, one cell must stay free for a new token)."""
    return APIError(400, f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                         f"try increasing it (-c) or shortening the prompt", "exceed_context_size_error",
                    "prompt", "context_length_exceeded", {"n_prompt_tokens": int(n_prompt), "n_ctx": int(n_ctx)})


def error_response(err: APIError) -> JSONResponse:
    """A JSONResponse for ``err`` (``WWW-Authenticate`` on 401)."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def from_exception(exc: BaseException) -> APIError:
    """Map a decoder / worker exception to an :class:`APIError`."""
    from ..errors import ClosedError, ContextFullError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextFullError):
        return APIError(400, str(exc.args[0] if exc.args else exc), "exceed_context_size_error", "prompt",
                        "context_length_exceeded")
    if isinstance(exc, ClosedError):
        return APIError(503, "the model is not available", "unavailable_error", None, "unavailable")
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc), "invalid_request_error", None, "invalid_value")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")


def validation_error(errs: list) -> APIError:
    """The 400 for pydantic validation errors ``errs`` (``ValidationError.errors()``), naming the
    first offending parameter in ``param`` and the message."""
    if not errs:
        return APIError(400, "invalid request", code="invalid_value")
    # a union's branches each report; the branch with a value error says what is wrong
    e = next((x for x in errs if x.get("type") == "value_error"), errs[0])
    kind = e.get("type", "")
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not (isinstance(x, str) and "[" in x)]
    param = ".".join(loc) or None
    if kind == "json_invalid":
        return APIError(400, f"invalid JSON body: {e.get('msg', '')}", param=None, code="json_invalid")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown parameter: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return APIError(400, f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    msg = e.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more error(s))" if len(errs) > 1 else ""
    return APIError(400, f"invalid value for {param}: {msg}{more}" if param else f"{msg}{more}", param=param,
                    code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every failure into an OpenAI-shaped JSON error."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"not found: {request.url.path}", "not_found_error", None, "not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} not allowed on {request.url.path}",
                           code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500
                           else "server_error")
        return error_response(err)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        if err.status >= 500:
            log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(err)

