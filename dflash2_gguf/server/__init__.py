"""OpenAI-compatible HTTP server (``dflash2-gguf serve``); needs the ``server`` extra.

Layout (after mlx-lm's one-thread-owns-the-model server, without llama-cpp-python's globals):

- :mod:`.types`: pydantic request models with their bounds and the parameter policy.
- :mod:`.errors`: the OpenAI error shape and the app's exception handlers.
- :mod:`.worker`: one thread owns the decoder and a request queue; a response queue per request.
- :mod:`.metrics`: counters and their Prometheus text.
- :mod:`.app`: :func:`create_app(settings) <dflash2_gguf.server.app.create_app>`, the settings,
  the request handling the endpoints share, the middleware.
- :mod:`.routes_llama`, :mod:`.routes_openai`, :mod:`.routes_anthropic`: the endpoints, one
  router per API; :mod:`.responses_api` and :mod:`.messages_api` translate the Responses and
  Messages APIs into chat requests; :mod:`.compat`: prompts, chat and sampling semantics.
- :mod:`.web`: the web page at ``/`` (files in ``webui/``), CORS as llama-server answers it, the
  stream's draft marks.
- :mod:`.__main__`: the ``serve`` flags (llama-server's names) and the uvicorn entry.

Names resolve lazily so that ``dflash2-gguf --help`` does not import FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"create_app": "app", "ServerSettings": "app", "Worker": "worker", "Job": "worker", "Metrics": "metrics"}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dflash2_gguf.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{mod}", __name__), name)
