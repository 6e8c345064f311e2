"""The web page's routes, CORS as llama-server answers it, and the stream's draft marks (issue 41),
against live servers (uvicorn on 127.0.0.1, see tests/server/test_server.py) with httpx.

CORS reference: tools/server/server-http.cpp at llama.cpp 0c1e570 (the pre-routing handler and
``origin_is_localhost``; defaults in common/common.h). Fake decoders for the routes and headers;
the real SmolLM2 target with the shipped drafter for the draft marks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from live_server import LiveServer  # noqa: E402
from test_server import _fake  # noqa: E402

from dflash2_gguf.server.app import ServerSettings  # noqa: E402
from dflash2_gguf.server.web import ASSET_DIR, origin_is_localhost  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": origin}, timeout=30)


# ---------------------------------------------------------------------------- CORS

def test_cors_default_reflects_any_origin_as_llama_server(tmp_path):
    """No --cors-origins: every Origin (a bare ``localhost`` too) is reflected, with llama-server's
    credentials, methods and headers values verbatim, before the API key is checked."""
    srv, _ = _fake(tmp_path, api_key="sekret")
    with srv:
        for origin in ("localhost", "http://a.example", "https://b.example:8443", "null", "http://[::1]"):
            r = _preflight(srv.url, origin)
            assert r.status_code == 200, (origin, r.text)
            assert r.content == b""
            assert r.headers["access-control-allow-origin"] == origin
            assert r.headers["access-control-allow-credentials"] == "true"
            assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
            assert r.headers["access-control-allow-headers"] == "*"
        # an OPTIONS that is no preflight gets the same answer
        r = httpx.request("OPTIONS", srv.url + "/v1/models", headers={"Origin": "localhost"}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-headers"] == "*"
        # other methods: the Origin is reflected (401s included), the preflight-only headers are not sent
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "localhost"}, timeout=30)
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "localhost"
        assert "access-control-allow-methods" not in r.headers
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://a.example", "Authorization": "Bearer sekret"},
                      timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://a.example"
        # no Origin: no header (llama-server sends an empty one)
        assert "access-control-allow-origin" not in httpx.get(srv.url + "/health", timeout=30).headers


def test_cors_localhost_reflects_local_origins_only(tmp_path):
    """--cors-origins localhost: http(s) URLs whose host is localhost / 127.0.0.1 / ::1, with a
    port or without, are reflected; any other Origin gets no Allow-Origin header."""
    srv, _ = _fake(tmp_path, cors_origins="localhost")
    local = ["http://localhost", "http://[::1]", "https://localhost", "http://localhost:3000", "http://127.0.0.1",
             "http://127.0.0.1:8080", "http://[::1]:5173", "http://user@localhost"]
    foreign = ["http://example.com", "localhost", "http://localhost.example.com", "ftp://localhost", "http://[::1",
               "http://127.0.0.2", "null"]
    with srv:
        for origin in local:
            r = _preflight(srv.url, origin)
            assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == origin, origin
            assert r.headers["access-control-allow-credentials"] == "true"
        for origin in foreign:
            r = _preflight(srv.url, origin)
            assert r.status_code == 200, origin
            assert "access-control-allow-origin" not in r.headers, origin
            assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        r = httpx.get(srv.url + "/health", headers={"Origin": "http://[::1]"}, timeout=30)
        assert r.headers["access-control-allow-origin"] == "http://[::1]"


def test_cors_explicit_origins_methods_headers(tmp_path):
    """--cors-origins <one origin> is sent as given, whatever the request's Origin (llama-server);
    --cors-methods / --cors-headers / --no-cors-credentials verbatim; "*" without credentials is "*"."""
    srv, _ = _fake(tmp_path, cors_origins="https://app.example", cors_methods="GET, POST",
                   cors_headers="Authorization, Content-Type", cors_credentials=False)
    with srv:
        r = _preflight(srv.url, "http://other.example")
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert r.headers["access-control-allow-credentials"] == "false"
        assert r.headers["access-control-allow-methods"] == "GET, POST"
        assert r.headers["access-control-allow-headers"] == "Authorization, Content-Type"
    srv, _ = _fake(tmp_path, cors_origins="https://a.example,https://b.example")
    with srv:
        assert _preflight(srv.url, "https://b.example").headers["access-control-allow-origin"] == "https://b.example"
        assert "access-control-allow-origin" not in _preflight(srv.url, "https://c.example").headers
    srv, _ = _fake(tmp_path, cors_credentials=False)
    with srv:
        r = _preflight(srv.url, "http://a.example")
        assert r.headers["access-control-allow-origin"] == "*"
        assert r.headers["access-control-allow-credentials"] == "false"


def test_origin_is_localhost_as_common_http_parse_url():
    assert origin_is_localhost("http://localhost") and origin_is_localhost("http://[::1]")
    assert origin_is_localhost("https://127.0.0.1:1/x") and origin_is_localhost("http://u:p@localhost:80")
    assert origin_is_localhost("http://localhost:80abc")  # std::stoi reads the leading digits
    assert not origin_is_localhost("http://localhost:abc")  # ... and throws without any
    assert not origin_is_localhost("HTTP://localhost")  # the scheme is compared as written
    assert not origin_is_localhost("localhost") and not origin_is_localhost("http://::1")
    assert not origin_is_localhost("ws://localhost") and not origin_is_localhost("")


# ---------------------------------------------------------------------------- the page

def _check_page(url: str, headers: dict) -> None:
    index = (ASSET_DIR / "index.html").read_bytes()
    for path in ("/", "/index.html"):
        r = httpx.get(url + path, headers=headers, timeout=30)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        assert r.content == index
    assert b'src="webui/app.js"' in index and b'href="webui/app.css"' in index
    for name, ctype in (("app.js", "text/javascript; charset=utf-8"), ("app.css", "text/css; charset=utf-8")):
        r = httpx.get(f"{url}/webui/{name}", headers=headers, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == ctype
        assert r.content == (ASSET_DIR / name).read_bytes()
    assert httpx.get(url + "/webui/nope.js", headers=headers, timeout=30).status_code in (401, 404)


def test_get_root_serves_the_page_with_and_without_api_key(tmp_path):
    """GET / is the web page: without an API key set, and with one set, where the page and its
    assets need no key (llama-server's public UI paths) and the API still does."""
    srv, _ = _fake(tmp_path)
    with srv:
        _check_page(srv.url, {})
    srv, _ = _fake(tmp_path, api_key="sekret")
    with srv:
        _check_page(srv.url, {})
        assert httpx.get(srv.url + "/webui/nope.js", timeout=30).status_code == 401
        assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 401
        assert httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                          timeout=30).status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer sekret"},
                         timeout=30).status_code == 200


def test_page_assets_are_self_contained():
    """No network fetch at run time: the page references only its own relative assets."""
    text = "\n".join(f.read_text() for f in ASSET_DIR.iterdir() if f.suffix in (".html", ".js", ".css"))
    assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert "@import" not in text


def test_page_is_package_data():
    """The page ships in the wheel: it lives inside the dflash2_gguf package (wheel.packages), and
    no exclude pattern drops it."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
    assert "dflash2_gguf" in cfg["wheel"]["packages"]
    assert ASSET_DIR.relative_to(ROOT / "dflash2_gguf")
    excluded = cfg.get("wheel", {}).get("exclude", []) + cfg.get("sdist", {}).get("exclude", [])
    assert not any(p in ("*.html", "*.js", "*.css") or "webui" in p for p in excluded)
    try:  # scikit-build-core's own selection of the package's files (a private helper of 1.x)
        from scikit_build_core.build._pathutil import iter_package_files

        files = {str(f.relative_to(ROOT)) if f.is_absolute() else str(f) for f, _ in iter_package_files(
            packages={"dflash2_gguf": str(ROOT / "dflash2_gguf")}, include=[], src_exclude=excluded,
            target_exclude=[], build_dir=cfg.get("build-dir", "build"), mode="classic")}
    except (ImportError, TypeError):
        return
    shipped = {str((ASSET_DIR / n).relative_to(ROOT)) for n in ("index.html", "app.js", "app.css")}
    assert shipped <= files, sorted(shipped - files)


# ---------------------------------------------------------------------------- draft marks (real model)

@pytest.fixture(scope="module")
def live_drafter(native_ext, smollm2_gguf):
    """SmolLM2-135M with the shipped drafter, a fixed draft length (the adaptive policy may rightly
    skip the drafter on a busy 2-core machine)."""
    s = ServerSettings(model=str(smollm2_gguf), model_draft=str(ROOT / "models" / "smollm2-135m-dflash2.gguf"),
                       n_ctx=512, n_threads=1, adaptive=False)
    with LiveServer(s) as srv:
        yield srv


def _stream(url: str, body: dict) -> list:
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_stream_draft_marks(live_drafter):
    """``return_draft_marks``: per chunk the tokens' texts, which came from accepted drafts, the
    drafts verified in the cycle and the cached prompt tokens, consistent with the final timings
    and the content; absent unless asked for."""
    body = {"messages": [{"role": "user", "content": "Count from 1 to 10."}], "max_tokens": 40, "temperature": 0,
            "return_draft_marks": True}
    for round_ in range(2):
        ev = _stream(live_drafter.url, body)
        marks = [e["draft_marks"] for e in ev if "draft_marks" in e]
        final = ev[-1]["timings"]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in ev if e["choices"])
        assert "".join(p for m in marks for p in m["pieces"]) == content
        assert all(len(m["pieces"]) == len(m["from_draft"]) >= 1 for m in marks)
        assert sum(len(m["pieces"]) for m in marks) == final["predicted_n"]
        assert sum(sum(m["from_draft"]) for m in marks) == final["draft_n_accepted"] > 0
        assert sum(m["draft_n"] for m in marks) == final["draft_n"]
        assert marks[0]["draft_n"] == 0 and not any(marks[0]["from_draft"])  # the prefill's token
        # a cycle ends with the target's own token (the last may stop inside the accepted drafts)
        assert not any(m["from_draft"][-1] for m in marks[1:-1])
        assert {m["cache_n"] for m in marks} == {final["cache_n"]}
        if round_ == 1:  # the same prompt again: its prefix comes from the prompt cache
            assert final["cache_n"] > 0
    ev = _stream(live_drafter.url, {**body, "return_draft_marks": False})
    assert not any("draft_marks" in e for e in ev)
