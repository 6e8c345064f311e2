"""The web page at ``/``, CORS as llama-server answers it, and the per-token draft marks of a stream.

Web page (issue 41): a chat with the served model for a person at a laptop (streaming, stop, system
prompt, sampling settings), where every token that came from an accepted draft is marked, with
live tokens/s, acceptance length, the draft length the policy chose and the prompt-cache hits.
Vanilla HTML/JS/CSS in ``dflash2_gguf/server/webui/`` (package data, shipped in the wheel), no
third-party front-end code and nothing fetched from the network. ``GET /`` and ``/index.html`` answer
the page, ``GET /webui/<name>`` its assets; like llama-server's embedded UI (tools/server/
server-http.cpp at llama.cpp 0c1e570) they are public: :data:`PAGE_PATHS` never needs the API key,
while the page's own API calls send it (the page asks for a key when a call gets 401, and keeps it
in the browser's ``localStorage``).

llama-server's page flags (tools/server/server-http.cpp at 0c1e570): ``--no-ui`` / ``--no-webui``
(``ServerSettings.ui`` False) registers no page route, so ``GET /`` is a 404 (``/props`` reports
``"ui": false``); ``--path DIR`` (``ServerSettings.static_path``) serves DIR's files instead of the
shipped page, as llama-server's mount point at ``/`` (:class:`StaticDir`: ``/`` and folders answer
their ``index.html``; a file is served before the endpoints, so ``DIR/health`` would shadow
``/health``; paths that leave DIR are never served). With an API key set, only ``/`` (and the
shipped page's paths, :data:`PAGE_PATHS`) are public there, as llama-server's public paths are
``/`` and its embedded assets: DIR's other files need the key.

CORS (:class:`LlamaCors`): llama-server's pre-routing handler, header for header:

- ``--cors-origins *`` (the default) with credentials: the request's ``Origin`` is reflected
  whatever it is (``http://a.example``, a bare ``localhost``, ``null``);
- ``--cors-origins localhost``: reflected only when it parses as an ``http``/``https`` URL whose
  host is ``localhost``, ``127.0.0.1`` or ``::1``, any port or none (``http://localhost``,
  ``http://[::1]``, ``https://127.0.0.1:8443``); any other Origin gets no such header;
- anything else: sent as given (llama-server sends the flag's value as is; a comma list of several
  origins, which no browser accepts as one header, is answered here with the request's Origin when
  it is in the list, else with nothing).

``Access-Control-Allow-Origin`` goes on every response (errors and 401s included). Every ``OPTIONS``
request, preflight or not, is answered 200 with an empty body and ``Access-Control-Allow-Credentials``
(``true``/``false``), ``Access-Control-Allow-Methods`` (``--cors-methods``, default
``GET, POST, DELETE, OPTIONS``) and ``Access-Control-Allow-Headers`` (``--cors-headers``, default
``*``) as given, before the API key is checked. One difference: with no ``Origin`` header at all,
llama-server's default sends an empty ``Access-Control-Allow-Origin``; here it is left out (an empty
value allows nothing either way).

Draft marks (our stream extension, :class:`DraftMarks`): a chat completion request with
``"stream": true, "return_draft_marks": true`` gets, on each chunk that carries a cycle's tokens,

.. code-block:: json

    "draft_marks": {"pieces": [" the", " sea", "."], "from_draft": [true, true, false],
                    "draft_n": 4, "cache_n": 12}

``pieces``: the text of each token the cycle committed (in order; an end-of-generation token is
``""``); ``from_draft``: per token, whether it was an accepted draft (the last token of a cycle is
the target's own, the "bonus"); ``draft_n``: drafts the policy sent to verification in this cycle
(0 for the prefill's token and for cycles where the adaptive policy skipped the drafter);
``cache_n``: prompt tokens reused from the prompt cache (llama-server's ``timings.cache_n``). The
pieces concatenate to the generated text (special tokens not rendered); the chunk's ``delta`` is
unchanged (reasoning and tool calls are still split out of it).
"""

from __future__ import annotations

import codecs
import collections
from pathlib import Path
from typing import Any, Optional

__all__ = ["ASSET_DIR", "PAGE_PATHS", "LlamaCors", "DraftMarks", "StaticDir", "install", "install_static",
           "origin_is_localhost"]

#: The page's files (package data).
ASSET_DIR = Path(__file__).resolve().parent / "webui"

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}


def _assets() -> dict:
    """``{url path: file}`` for every shipped asset (``index.html`` at ``/`` and ``/index.html``)."""
    out = {}
    if ASSET_DIR.is_dir():
        for f in sorted(ASSET_DIR.iterdir()):
            if f.is_file() and f.suffix in _TYPES:
                out[f"/webui/{f.name}"] = f
        if (ASSET_DIR / "index.html").is_file():
            out["/"] = out["/index.html"] = ASSET_DIR / "index.html"
    return out


_ASSETS = _assets()

#: Paths of the page and its assets: public, as llama-server's embedded UI (no API key).
PAGE_PATHS = frozenset(_ASSETS)


def install_static(app: Any, settings: Any) -> None:
    """With ``--path DIR`` (and the page on), add :class:`StaticDir` for DIR. Call it before the
    API-key middleware is added, so that the key is checked first (middlewares added first run
    innermost)."""
    if getattr(settings, "ui", True) and getattr(settings, "static_path", None):
        app.add_middleware(StaticDir, root=settings.static_path)


def install(app: Any, settings: Any) -> None:
    """Add :class:`LlamaCors` (outermost) and the page's routes to ``app`` (none with ``--no-ui``
    or ``--path``).

    Call it after the other middlewares are added, so that CORS headers also go on their answers
    (401s included) and preflights are answered before the API key is checked.
    """
    from fastapi.responses import Response

    app.add_middleware(LlamaCors, origins=settings.cors_origins, methods=settings.cors_methods,
                       headers=settings.cors_headers, credentials=settings.cors_credentials)
    if not getattr(settings, "ui", True) or getattr(settings, "static_path", None):
        return

    def page(path: str):
        f = _ASSETS[path]

        async def serve():
            # index.html revalidated on each load; the assets too: they are not content-hashed
            return Response(f.read_bytes(), media_type=_TYPES[f.suffix], headers={"Cache-Control": "no-cache"})

        serve.__doc__ = f"The web page's {f.name} (public)."
        return serve

    for path in _ASSETS:
        app.add_api_route(path, page(path), methods=["GET"], include_in_schema=False)


class StaticDir:
    """ASGI middleware: ``GET`` / ``HEAD`` of a file under ``root`` answers that file (``/`` and
    folders their ``index.html``), before the routes, as llama-server's ``--path`` mount point;
    anything else goes on to the app. Paths that resolve outside ``root`` are never served."""

    def __init__(self, app: Any, root: str) -> None:
        self.app = app
        self.root = Path(root).resolve()

    def file_for(self, path: str) -> Optional[Path]:
        """The file ``path`` names under the root, or None."""
        from urllib.parse import unquote

        rel = unquote(path).lstrip("/")
        if "\x00" in rel:
            return None
        f = (self.root / rel).resolve()
        if f != self.root and self.root not in f.parents:
            return None
        if f.is_dir():
            f = f / "index.html"
        return f if f.is_file() else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            f = self.file_for(scope["path"])
            if f is not None:
                import mimetypes

                from starlette.responses import FileResponse

                kind = mimetypes.guess_type(f.name)[0] or "application/octet-stream"
                await FileResponse(f, media_type=kind, headers={"Cache-Control": "no-cache"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------- CORS

def origin_is_localhost(origin: str) -> bool:
    """llama-server's ``origin_is_localhost``: ``origin`` parses as an ``http``/``https`` URL
    (``common_http_parse_url``, common/http.h at 0c1e570) whose host is ``localhost``,
    ``127.0.0.1`` or ``::1`` (bracketed in the URL), with any port or none."""
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme not in ("http", "https"):
        return False
    if "@" in rest:
        rest = rest.split("@", 1)[1]
    host = rest.split("/", 1)[0]
    if host.startswith("["):
        close = host.find("]")
        if close < 0:
            return False
        port, host = host[close + 1:], host[1:close]
        port = port[1:] if port.startswith(":") else ""
    else:
        host, _, port = host.partition(":")
    if port:  # std::stoi: leading digits (after optional blanks/sign), else an error
        digits = port.lstrip(" \t\n\v\f\r")
        digits = digits[1:] if digits[:1] in "+-" else digits
        if not digits[:1].isdigit():
            return False
    return host in ("localhost", "127.0.0.1", "::1")


class LlamaCors:
    """ASGI middleware: CORS headers as llama-server's pre-routing handler sets them (see the module
    docstring) on every response; with the app's ``_PlainOptions`` inside it, every ``OPTIONS`` is
    answered 200 with an empty body before auth.

    Pure ASGI (Starlette's ``BaseHTTPMiddleware`` would break ``request.is_disconnected()``)."""

    def __init__(self, app: Any, origins: str = "*", methods: str = "GET, POST, DELETE, OPTIONS",
                 headers: str = "*", credentials: bool = True) -> None:
        self.app = app
        self.origins = origins
        self.listed = [o.strip() for o in origins.split(",") if o.strip()]
        self.methods, self.headers, self.credentials = methods, headers, credentials

    def allow_origin(self, origin: Optional[str]) -> Optional[str]:
        """The ``Access-Control-Allow-Origin`` value for a request's ``Origin`` (None: no header)."""
        if self.credentials and self.origins == "*":
            return origin or None
        if self.origins == "localhost":
            return origin if origin and origin_is_localhost(origin) else None
        if len(self.listed) > 1:
            return origin if origin in self.listed else None
        return self.origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = None
        for k, v in scope.get("headers", []):
            if k.lower() == b"origin":
                origin = v.decode("latin-1")
                break
        extra = []
        allow = self.allow_origin(origin)
        if allow is not None:
            extra.append((b"access-control-allow-origin", allow.encode("latin-1")))
        if scope["method"] == "OPTIONS":  # answered 200, empty, by app._PlainOptions inside
            extra += [(b"access-control-allow-credentials", b"true" if self.credentials else b"false"),
                      (b"access-control-allow-methods", self.methods.encode("latin-1")),
                      (b"access-control-allow-headers", self.headers.encode("latin-1"))]
        if not extra:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                names = {k for k, _ in extra}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": kept + extra}
            await send(message)

        await self.app(scope, receive, send_with_cors)


# ---------------------------------------------------------------------------- draft marks

def cycle_counts(decoder: Any) -> Optional[tuple]:
    """``(n_drafted, n_cached)`` so far in the decoder's running generation (its native stats),
    or None for a decoder without them (a test's fake). Called by the slot thread after each chunk."""
    try:
        s = decoder.engine.stats()
        return int(s["n_drafted"]), int(s["n_cached"])
    except Exception:  # noqa: BLE001 - no native engine (fakes), or closed
        return None


class DraftMarks:
    """Builds one choice's ``draft_marks`` objects (see the module docstring), chunk by chunk.

    Args:
        decoder: A decoder for vocabulary work (``detokenize``; its native ``engine`` when it has
            one, for bytes: a character split across tokens goes to the token that completes it).
        cycles: The job's :attr:`~.worker.Job.cycles` (:func:`cycle_counts` after each chunk that
            has tokens, filled by the slot, taken here in order).
    """

    def __init__(self, decoder: Any, cycles: "collections.deque") -> None:
        self.decoder = decoder
        self.cycles = cycles
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.prev: Optional[int] = None  # the last token: context for a piece's leading space
        self.n_drafted = 0

    def _bytes(self, tokens: list) -> bytes:
        eng = getattr(self.decoder, "engine", None)
        if eng is not None and hasattr(eng, "detokenize"):
            return bytes(eng.detokenize(tokens, False))
        return self.decoder.detokenize(tokens).encode("utf-8")

    def piece(self, token: int) -> str:
        """The text ``token`` adds after the previous one (SentencePiece vocabularies drop a
        leading space of a text's first token: the piece is taken after its predecessor)."""
        if self.prev is None:
            raw = self._bytes([token])
        else:
            raw = self._bytes([self.prev, token])[len(self._bytes([self.prev])):]
        self.prev = token
        return self.utf8.decode(raw)

    def chunk(self, ch: Any) -> dict:
        """The ``draft_marks`` object of one stream chunk (one cycle's tokens)."""
        counts = self.cycles.popleft() if self.cycles and ch.tokens else None
        draft_n, cache_n = 0, 0
        if counts is not None:
            draft_n, cache_n = counts[0] - self.n_drafted, counts[1]
            self.n_drafted = counts[0]
        pieces = [self.piece(int(t)) for t in ch.tokens]
        if ch.done:
            tail = self.utf8.decode(b"", final=True)
            if tail and pieces:
                pieces[-1] += tail
        return {"pieces": pieces, "from_draft": [bool(x) for x in ch.from_draft], "draft_n": draft_n,
                "cache_n": cache_n}
