"""HTTP server (issue 5): a live uvicorn server on 127.0.0.1 (background thread, free port) with
the real SmolLM2-135M target and a converted random DFlash 2 drafter, driven by the official
``openai`` client and raw ``httpx``.

Checked: greedy (T = 0) outputs equal the target alone for /v1/completions, /v1/chat/completions
and llama-server's /completion, streaming and not; 16 concurrent streaming clients; the 4xx
errors in the OpenAI shape (and the server keeps serving); a client that disconnects cancels its
generation; 401 with an API key; /metrics; /health reflecting the worker (fake decoders, no model).
Loopback only, bounded loops only.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

from dflash2_gguf.server.app import ServerSettings, create_app  # noqa: E402

N_CTX = 512
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


class LiveServer:
    """uvicorn serving ``create_app(settings)`` in a daemon thread on 127.0.0.1:<free port>."""

    def __init__(self, settings: ServerSettings, load=None, wait_ready: bool = True) -> None:
        self.app = create_app(settings, load=load)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.wait_ready = wait_ready

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.server.started:
                if not self.wait_ready:
                    return self
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError("server did not become ready in 120 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()


@pytest.fixture(scope="module")
def drafter(native_ext, smollm2_drafters):
    return str(smollm2_drafters[2])


@pytest.fixture(scope="module")
def live(smollm2_gguf, drafter):
    s = ServerSettings(model=str(smollm2_gguf), model_draft=drafter, n_ctx=N_CTX, n_threads=1, alias="smol")
    with LiveServer(s) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(native_ext, smollm2_gguf):
    """Greedy outputs of the target alone: ref(prompt or messages, n) -> text (cached)."""
    from dflash2_gguf import DFlashDecoder

    dec = DFlashDecoder(str(smollm2_gguf), None, n_ctx=N_CTX, n_threads=1)
    cache = {}

    def ref(prompt, n=16):
        key = (json.dumps(prompt), n)
        if key not in cache:
            kw = {"messages": prompt} if isinstance(prompt, list) else {"prompt": prompt}
            cache[key] = dec.generate(max_tokens=n, temperature=0, **kw).text
        return cache[key]

    yield ref
    dec.close()


def _metrics(url: str, **kw) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30, **kw).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# ---------------------------------------------------------------------------- basic endpoints

def test_health_models_metrics(live, client):
    r = httpx.get(live.url + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    m = httpx.get(live.url + "/metrics", timeout=30)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("dflash2_requests_total", "dflash2_generated_tokens_total", "dflash2_acceptance_length",
                 "dflash2_tokens_per_second", "dflash2_draft_accepted_tokens_total"):
        assert f"# TYPE {name} " in m.text


def test_completion_matches_target(client, reference):
    r = client.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text == reference(PROMPTS[0])
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 1
    t = r.model_extra["timings"]
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert t["acceptance_length"] >= 1.0 and t["predicted_n"] == r.usage.completion_tokens


def test_completion_stream_matches_target(client, reference):
    chunks = list(client.completions.create(model="smol", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference(PROMPTS[1])
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and "timings" in finals[0].model_extra
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_chat_matches_target(client, reference):
    want = reference(CHAT, 16)
    r = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.model_extra["timings"]["draft_n"] > 0
    parts = list(client.chat.completions.create(model="smol", messages=CHAT, max_tokens=16, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == want
    assert parts[-1].choices[0].finish_reason in ("length", "stop")


def test_sse_wire_format_ends_with_done(live):
    body = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"


def test_llama_server_completion_endpoint(live, reference):
    body = {"prompt": PROMPTS[2], "n_predict": 16, "temperature": 0, "top_k": 40, "top_p": 0.95,
            "min_p": 0.05, "seed": 1, "stop": []}
    r = httpx.post(live.url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["content"] == reference(PROMPTS[2])
    assert j["stop"] is True and j["tokens_predicted"] >= 1 and j["tokens_evaluated"] >= 1
    assert {"draft_n", "draft_n_accepted", "predicted_per_second", "prompt_n"} <= set(j["timings"])
    pieces = []
    with httpx.stream("POST", live.url + "/completion", json={**body, "stream": True}, timeout=120) as s:
        for ln in s.iter_lines():
            if ln.startswith("data: "):
                pieces.append(json.loads(ln[6:]))
    assert "".join(p["content"] for p in pieces) == j["content"]
    assert pieces[-1]["stop"] is True and "timings" in pieces[-1]


# ---------------------------------------------------------------------------- load

@pytest.mark.slow
def test_sixteen_concurrent_streaming_clients(live, client, reference):
    want = {p: reference(p) for p in PROMPTS}
    before = _metrics(live.url)

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=300)
        s = c.completions.create(model="smol", prompt=p, max_tokens=16, temperature=0, stream=True)
        return p, "".join(ch.choices[0].text for ch in s if ch.choices)

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16), timeout=600))
    assert len(results) == 16
    for p, text in results:
        assert text == want[p]
    after = _metrics(live.url)
    assert after["dflash2_requests_finished_total"] - before["dflash2_requests_finished_total"] == 16
    assert after["dflash2_requests_processing"] == 0


# ---------------------------------------------------------------------------- errors

def _err(r: httpx.Response, status: int, code=None) -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if code is not None:
        assert e["code"] == code
    return e


def test_bad_requests_get_openai_errors_and_server_keeps_serving(live, client):
    url = live.url
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x", ', timeout=30,
                   headers={"content-type": "application/json"})
    _err(r, 400, "json_invalid")
    r = httpx.post(url + "/v1/chat/completions", content=b"not json", timeout=30,
                   headers={"content-type": "application/json"})
    _err(r, 400)
    e = _err(httpx.post(url + "/v1/completions", json={"prompt": "x", "max_token": 4}, timeout=30), 400,
             "unknown_parameter")
    assert e["param"] == "max_token"
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0}, {"n": 2},
                {"presence_penalty": 0.5}, {"logprobs": 3}, {"seed": -5}):
        e = _err(httpx.post(url + "/v1/completions", json={"prompt": "x", **bad}, timeout=30), 400)
        assert e["param"] == next(iter(bad)), e
    _err(httpx.post(url + "/v1/chat/completions", json={"messages": [], "max_tokens": 2}, timeout=30), 400)
    _err(httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "tools": []}, timeout=30), 400,
         "unknown_parameter")
    _err(httpx.post(url + "/completion", json={"prompt": "x", "n_predict": 2, "bogus": 1}, timeout=30), 400)
    _err(httpx.post(url + "/v1/completions", json={"prompt": [10**9], "max_tokens": 2}, timeout=30), 400)
    _err(httpx.get(url + "/v1/nope", timeout=30), 404, "not_found")
    # the official client sees the same errors as typed exceptions
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt="x", max_tokens=2, extra_body={"foo": 1})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=CHAT, temperature=-0.5)
    # prompts longer than the context, streaming or not
    long_prompt = "hello " * (N_CTX + 50)
    for stream in (False, True):
        e = _err(httpx.post(url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 4, "stream": stream},
                            timeout=60), 400, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
    assert ei.value.code == "context_length_exceeded"
    # still serving
    r = client.completions.create(model="smol", prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(url + "/health", timeout=30).status_code == 200


@pytest.mark.slow
def test_disconnect_cancels_generation(live, reference):
    n_predict = 400
    before = _metrics(live.url)
    body = {"prompt": PROMPTS[0], "n_predict": n_predict, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", live.url + "/completion", json=body) as r:
            assert r.status_code == 200
            for ln in r.iter_lines():
                if ln.startswith("data: "):
                    break  # first chunk received: hang up
    deadline = time.monotonic() + 120
    m = before
    while time.monotonic() < deadline:
        m = _metrics(live.url)
        if m["dflash2_requests_cancelled_total"] > before["dflash2_requests_cancelled_total"]:
            break
        time.sleep(0.2)
    assert m["dflash2_requests_cancelled_total"] == before["dflash2_requests_cancelled_total"] + 1
    ran = m["dflash2_cancelled_generated_tokens_total"] - before["dflash2_cancelled_generated_tokens_total"]
    assert 1 <= ran < n_predict
    assert m["dflash2_generated_tokens_total"] == before["dflash2_generated_tokens_total"]
    # a non-streaming client that gives up is cancelled too (the handler polls for the disconnect)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/completion", json={**body, "stream": False}, timeout=httpx.Timeout(120, read=3))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m2 = _metrics(live.url)
        if m2["dflash2_requests_cancelled_total"] > m["dflash2_requests_cancelled_total"]:
            break
        time.sleep(0.2)
    assert m2["dflash2_requests_cancelled_total"] == m["dflash2_requests_cancelled_total"] + 1
    assert m2["dflash2_cancelled_generated_tokens_total"] - m["dflash2_cancelled_generated_tokens_total"] < n_predict
    # the decoder is intact: a greedy request afterwards still equals the target alone
    r = httpx.post(live.url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(PROMPTS[3])


# ---------------------------------------------------------------------------- auth

def test_api_key(smollm2_gguf, native_ext):
    s = ServerSettings(model=str(smollm2_gguf), n_ctx=128, n_threads=1, api_key="sekret")
    with LiveServer(s) as srv:
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200  # public, as llama-server
        _err(httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30), 401,
             "invalid_api_key")
        _err(httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer wrong"}, timeout=30), 401)
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="m", prompt="x", max_tokens=1)
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        r = good.completions.create(model="m", prompt="Hello", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert "timings" in r.model_extra and r.model_extra["timings"]["draft_n"] == 0  # target alone


# ---------------------------------------------------------------------------- worker health (no model)

class _FakeDecoder:
    """Stands in for DFlashDecoder: ``mode`` "ok" yields two chunks, "die" kills the worker."""

    n_vocab = 100

    def __init__(self, mode: str = "ok", delay: float = 0.0) -> None:
        self.mode, self.delay = mode, delay

    def generate(self, stream=True, **kw):
        from dflash2_gguf.api import GenerationStats, StreamChunk

        if self.mode == "die":
            raise SystemExit("worker thread killed")  # not an Exception: ends the worker thread
        st = GenerationStats(1, 2, 1, 0, 0, 1.0, [], [], [], 0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 200.0, 100.0, "length")
        yield StreamChunk("a", [1], [False], False)
        time.sleep(self.delay)
        yield StreamChunk("b", [2], [False], True, st)

    def close(self):
        pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reflects_loading_failure_and_dead_worker(tmp_path):
    s = ServerSettings(model=str(tmp_path / "none.gguf"))
    gate = threading.Event()

    def slow_fail():
        gate.wait(30)
        raise RuntimeError("boom")

    with LiveServer(s, load=slow_fail, wait_ready=False) as srv:
        e = _err(httpx.get(srv.url + "/health", timeout=30), 503, "unavailable")
        assert "loading" in e["message"]
        _err(httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=30), 503)
        gate.set()
        deadline = time.monotonic() + 30
        while srv.app.state.worker.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        e = _err(httpx.get(srv.url + "/health", timeout=30), 503)
        assert "boom" in e["message"]

    with LiveServer(s, load=lambda: _FakeDecoder("die")) as srv:
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert time.monotonic() - t0 < 15  # the handler noticed the dead worker, no hang
        _err(r, 503)
        _err(httpx.get(srv.url + "/health", timeout=30), 503)


def test_fake_decoder_roundtrip_and_queue(tmp_path):
    s = ServerSettings(model=str(tmp_path / "none.gguf"), alias="fake")
    with LiveServer(s, load=lambda: _FakeDecoder("ok", delay=0.05)) as srv:
        with ThreadPoolExecutor(8) as ex:
            rs = list(ex.map(lambda _: httpx.post(srv.url + "/v1/chat/completions",
                                                  json={"messages": CHAT}, timeout=60), range(8)))
        assert all(r.status_code == 200 for r in rs)
        assert all(r.json()["choices"][0]["message"]["content"] == "ab" for r in rs)
        assert rs[0].json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        assert _metrics(srv.url)["dflash2_requests_finished_total"] == 8


def test_queue_full_gets_503_and_all_others_complete(tmp_path):
    s = ServerSettings(model=str(tmp_path / "none.gguf"), max_queue=1)
    with LiveServer(s, load=lambda: _FakeDecoder("ok", delay=0.5)) as srv:
        with ThreadPoolExecutor(6) as ex:
            rs = list(ex.map(lambda _: httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=60),
                             range(6)))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}
        for r in rs:
            if r.status_code == 503:
                _err(r, 503, "server_busy")
            else:
                assert r.json()["choices"][0]["text"] == "ab"
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------------- CLI flags

def test_serve_flags(tmp_path):
    from dflash2_gguf.cli import build_parser
    from dflash2_gguf.server.__main__ import settings_from_args

    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    t.write_bytes(b"x")
    d.write_bytes(b"x")
    a = build_parser().parse_args(["serve", "-m", str(t), "-md", str(d), "--spec-type", "draft-dflash",
                                   "--spec-draft-n-max", "7", "-c", "1024", "-ngl", "99", "-ngld", "99", "-t", "2",
                                   "--api-key", "k", "--alias", "x"])
    assert (a.host, a.port) == ("127.0.0.1", 8080)
    s = settings_from_args(a)
    assert (s.model_draft, s.n_draft_max, s.n_ctx, s.n_gpu_layers, s.n_gpu_layers_draft, s.n_threads) == \
        (str(d), 7, 1024, 99, 99, 2)
    assert (s.api_key, s.model_id) == ("k", "x")
    assert (s.flash_attn, s.repack) == (None, True)
    s = settings_from_args(build_parser().parse_args(["serve", "-m", str(t), "-fa", "on", "-nr"]))
    assert (s.flash_attn, s.repack) == (True, False)
    a = build_parser().parse_args(["serve", "-m", str(t), "-md", str(d), "--spec-type", "none"])
    assert settings_from_args(a).model_draft is None
    a = build_parser().parse_args(["serve", "-m", str(t)])
    s = settings_from_args(a)
    assert s.model_draft is None and s.n_ctx == 4096 and s.model_id == "t.gguf"
    with pytest.raises(ValueError):
        settings_from_args(build_parser().parse_args(["serve", "-m", str(t), "--spec-type", "draft-dflash"]))
