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
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from dflash2_gguf.server.app import ServerSettings  # noqa: E402
from fakes import FakeDecoder  # noqa: E402
from live_server import LiveServer  # noqa: E402

N_CTX = 512
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def drafter(native_ext, smollm2_drafters):
    return str(smollm2_drafters[2])


@pytest.fixture(scope="module")
def live(smollm2_gguf, drafter):
    # a fixed draft length: these tests check the server's plumbing of drafting statistics, which a
    # random drafter under the adaptive policy (tests/native/test_draft_policy.py) may rightly never use
    s = ServerSettings(model=str(smollm2_gguf), model_draft=drafter, n_ctx=N_CTX, n_threads=1, alias="smol",
                       adaptive=False)
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
    assert {"message", "type", "param", "code"} <= set(e) and e["message"]
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
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": -2}, {"n": 2},
                {"mirostat": 2}, {"seed": -5}, {"temperature": "hot"}):
        e = _err(httpx.post(url + "/v1/completions", json={"prompt": "x", **bad}, timeout=30), 400)
        assert e["param"] == next(iter(bad)), e
    _err(httpx.post(url + "/v1/chat/completions", json={"messages": [], "max_tokens": 2}, timeout=30), 400)
    _err(httpx.post(url + "/v1/completions", json={"prompt": [10**9], "max_tokens": 2}, timeout=30), 400)
    _err(httpx.get(url + "/v1/nope", timeout=30), 404, "not_found")
    # the official client sees the same errors as typed exceptions
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=CHAT, temperature=-0.5)
    # prompts longer than the context, streaming or not
    long_prompt = "hello " * (N_CTX + 50)
    for stream in (False, True):
        e = _err(httpx.post(url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 4, "stream": stream},
                            timeout=60), 400, "context_length_exceeded")
        assert e["type"] == "exceed_context_size_error" and e["n_ctx"] == N_CTX and e["n_prompt_tokens"] > N_CTX
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

    with LiveServer(s, load=lambda: FakeDecoder("die")) as srv:
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert time.monotonic() - t0 < 15  # the handler noticed the dead worker, no hang
        _err(r, 503)
        _err(httpx.get(srv.url + "/health", timeout=30), 503)


def test_fake_decoder_roundtrip_and_queue(tmp_path):
    s = ServerSettings(model=str(tmp_path / "none.gguf"), alias="fake")
    with LiveServer(s, load=lambda: FakeDecoder("ok", delay=0.05)) as srv:
        with ThreadPoolExecutor(8) as ex:
            rs = list(ex.map(lambda _: httpx.post(srv.url + "/v1/chat/completions",
                                                  json={"messages": CHAT}, timeout=60), range(8)))
        assert all(r.status_code == 200 for r in rs)
        assert all(r.json()["choices"][0]["message"]["content"] == "ab" for r in rs)
        u = rs[0].json()["usage"]
        assert u["completion_tokens"] == 2 and u["total_tokens"] == u["prompt_tokens"] + 2
        assert _metrics(srv.url)["dflash2_requests_finished_total"] == 8


def test_queue_full_gets_503_and_all_others_complete(tmp_path):
    s = ServerSettings(model=str(tmp_path / "none.gguf"), max_queue=1)
    with LiveServer(s, load=lambda: FakeDecoder("ok", delay=0.5)) as srv:
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
    assert s.model_draft is None and s.n_ctx == 4096 and s.model_id == str(t) and s.aliases == [str(t)]
    with pytest.raises(ValueError):
        settings_from_args(build_parser().parse_args(["serve", "-m", str(t), "--spec-type", "draft-dflash"]))


# ---------------------------------------------------------------------------- llama-server drop-in (issue 17)
# Each test asserts what tools/server/README.md (and server*.cpp) at llama.cpp 0c1e570 document.
# Fake decoders: no model, fast.

def _fake(tmp_path, **kw):
    """(LiveServer, fake decoders list) with a fake decoder per slot."""
    decs = []
    delay = kw.pop("_delay", 0.0)

    def load():
        d = FakeDecoder("ok", delay=delay)
        decs.append(d)
        return d

    s = ServerSettings(model=str(tmp_path / "none.gguf"), **kw)
    return LiveServer(s, load=load), decs


def test_openai_sdk_with_and_without_v1(tmp_path):
    srv, decs = _fake(tmp_path, alias="fake")
    with srv:
        for base in (srv.url + "/v1", srv.url):  # llama-server routes /chat/completions and /v1/...
            c = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=60)
            r = c.chat.completions.create(model="fake", messages=CHAT, max_tokens=4)
            assert r.choices[0].message.content == "ab" and r.object == "chat.completion"
            parts = list(c.chat.completions.create(model="fake", messages=CHAT, max_tokens=4, stream=True))
            assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == "ab"
        # /completions without /v1 is llama-server's native completion, /v1/completions OpenAI's
        j = httpx.post(srv.url + "/completions", json={"prompt": "hi", "n_predict": 4}, timeout=30).json()
        assert j["content"] == "ab" and j["stop_type"] == "limit"
        r = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
            model="fake", prompt="hi", max_tokens=4)
        assert r.choices[0].text == "ab"


def test_tokenize_detokenize_apply_template(tmp_path):
    srv, _ = _fake(tmp_path)
    with srv:
        u = srv.url
        assert httpx.post(u + "/tokenize", json={"content": "AB"}, timeout=30).json() == {"tokens": [65, 66]}
        t = httpx.post(u + "/tokenize", json={"content": "A", "add_special": True, "with_pieces": True},
                       timeout=30).json()["tokens"]
        assert t == [{"id": 1, "piece": "\x01"}, {"id": 65, "piece": "A"}]
        assert httpx.post(u + "/detokenize", json={"tokens": [72, 73]}, timeout=30).json() == {"content": "HI"}
        _err(httpx.post(u + "/detokenize", json={"tokens": [500]}, timeout=30), 400)
        p = httpx.post(u + "/apply-template", json={"messages": CHAT}, timeout=30).json()["prompt"]
        assert p == "<user>What is 2 + 2?</user><assistant>"
        # llama-server's assistant prefill: a final assistant message is continued, not closed
        msgs = CHAT + [{"role": "assistant", "content": "It is"}]
        p = httpx.post(u + "/apply-template", json={"messages": msgs}, timeout=30).json()["prompt"]
        assert p.endswith("<assistant>It is")
        _err(httpx.post(u + "/apply-template", json={"messages": CHAT, "continue_final_message": True},
                        timeout=30), 400)


def test_props_slots_models(tmp_path):
    srv, _ = _fake(tmp_path, alias="a1,a2", tags="t1", n_ctx=2048, n_slots=2)
    with srv:
        p = httpx.get(srv.url + "/props", timeout=30).json()
        assert p["default_generation_settings"]["n_ctx"] == 2048 and p["total_slots"] == 2
        assert {"chat_template", "model_path", "build_info", "modalities"} <= set(p)
        dp = p["default_generation_settings"]["params"]
        assert set(p["default_generation_settings"]) == {"params", "n_ctx"} and dp["temperature"] == 0.8
        # samplers we lack, at llama-server's neutral defaults; /props shows the /slots view (no stop)
        assert (dp["mirostat"], dp["typical_p"], dp["xtc_probability"], dp["dry_multiplier"]) == (0, 1.0, 0.0, 0.0)
        assert "stop" not in dp and "speculative.types" in dp
        assert set(p["chat_template_caps"]) >= {"supports_tools", "supports_system_role", "supports_string_content"}
        _err(httpx.post(srv.url + "/props", json={}, timeout=30), 501)
        sl = httpx.get(srv.url + "/slots", timeout=30).json()
        assert [s["id"] for s in sl] == [0, 1] and not any(s["is_processing"] for s in sl)
        # llama-server: a slot that never had a task shows only these
        assert set(sl[0]) == {"id", "n_ctx", "speculative", "is_processing"}
        j = httpx.post(srv.url + "/completion", json={"prompt": "hi", "n_predict": 2, "logit_bias": [[1, -1.0]]},
                       timeout=30).json()
        gs = j["generation_settings"]
        assert "model" not in gs and "n_ctx" not in gs and gs["logit_bias"] == [{"bias": -1.0, "token": 1}]
        assert gs["dry_sequence_breakers"] and gs["grammar"] == "" and gs["n_predict"] == 2
        sl = httpx.get(srv.url + "/slots", timeout=30).json()
        used = [s for s in sl if "id_task" in s]
        assert len(used) == 1 and {"params", "next_token", "n_prompt_tokens", "n_prompt_tokens_cache"} <= set(used[0])
        assert isinstance(used[0]["next_token"], list) and used[0]["params"]["n_predict"] == 2
        m = httpx.get(srv.url + "/v1/models", timeout=30).json()
        d = m["data"][0]
        assert d["id"] == "a1" and d["aliases"] == ["a1", "a2"] and d["tags"] == ["t1"]
        assert d["meta"]["n_ctx"] == 2048 and "n_ctx_train" in d["meta"] and m["models"][0]["name"] == "a1"
    srv, _ = _fake(tmp_path, endpoint_slots=False)
    with srv:
        _err(httpx.get(srv.url + "/slots", timeout=30), 501)


def test_cors_preflight_without_api_key(tmp_path):
    srv, _ = _fake(tmp_path, api_key="k1,k2")
    pre = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    with srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=pre, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "http://example.com"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "*"  # llama-server's default, verbatim
        assert httpx.request("OPTIONS", srv.url + "/v1/models", timeout=30).status_code == 200
        r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://example.com"}, timeout=30)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://example.com"
        for k in ("k1", "k2"):
            assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {k}"},
                             timeout=30).status_code == 200
    srv, _ = _fake(tmp_path, cors_origins="localhost")
    with srv:
        r = httpx.options(srv.url + "/props", headers=pre, timeout=30)
        assert "access-control-allow-origin" not in r.headers
        r = httpx.options(srv.url + "/props", headers={**pre, "Origin": "http://localhost:3000"}, timeout=30)
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_body_without_json_content_type_and_lenient_fields(tmp_path):
    srv, decs = _fake(tmp_path)
    with srv:
        # curl -d sends application/x-www-form-urlencoded; llama-server parses the body as JSON anyway
        r = httpx.post(srv.url + "/completion", content=b'{"prompt": "hi", "n_predict": 2}', timeout=30,
                       headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and r.json()["content"] == "ab"
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                           "cache_control": {"type": "ephemeral"}}]}],
                "tools": None, "tool_choice": None, "parallel_tool_calls": True, "reasoning_effort": "low",
                "stream_options": None, "response_fields": None, "some_future_field": {"x": 1},
                "continue_final_message": None, "temperature": None}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert decs[0].calls[-1]["sampling"].temperature == 0.8  # null = the server default
        from dflash2_gguf.server.types import ignored_fields

        assert ("ChatCompletionRequest", "some_future_field") in ignored_fields()
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": CHAT, "tools": [], "n_probs": 0}, timeout=30)
        assert r.status_code == 200
        e = _err(httpx.post(srv.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": "x"},
                            timeout=30), 400)
        assert e["param"] == "max_tokens"
        e = _err(httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            timeout=30), 400)
        assert "multimodal" in e["message"]
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


def test_model_field_is_not_an_unknown_field(tmp_path, caplog):
    """Every OpenAI client sends ``model``: accepted on every generation endpoint without the
    "ignoring unknown request field" warning (one model per server, as llama-server)."""
    import logging

    from dflash2_gguf.server.types import ignored_fields

    srv, decs = _fake(tmp_path, alias="fake")
    with srv, caplog.at_level(logging.WARNING, logger="dflash2_gguf.server"):
        for path, body in (("/completion", {"prompt": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": CHAT}), ("/v1/responses", {"input": "hi"}),
                           ("/v1/messages", {"messages": CHAT, "max_tokens": 4})):
            r = httpx.post(srv.url + path, json={**body, "model": "some-other-name"}, timeout=30)
            assert r.status_code == 200, (path, r.text)
    assert [f for f in ignored_fields() if f[1] == "model"] == []
    assert "ignoring unknown request field 'model'" not in caplog.text
    assert len(decs[0].calls) == 5


def test_prompt_forms_n_predict_and_response_fields(tmp_path):
    srv, decs = _fake(tmp_path, n_ctx=64)
    with srv:
        u = srv.url
        r = httpx.post(u + "/completion", json={"prompt": {"prompt_string": "hi"}, "n_predict": 3}, timeout=30)
        assert r.status_code == 200 and decs[0].calls[-1]["prompt"] == [1, 4, 5]
        httpx.post(u + "/completion", json={"prompt": [7, "hi", 8], "n_predict": 3}, timeout=30)
        assert decs[0].calls[-1]["prompt"] == [7, 4, 5, 8]  # BOS only before a leading string
        many = httpx.post(u + "/completion", json={"prompt": ["a", "b"], "n_predict": 3}, timeout=30).json()
        assert isinstance(many, list) and [m["index"] for m in many] == [0, 1]
        _err(httpx.post(u + "/completion", json={"prompt": {"prompt_string": "x", "multimodal_data": ["AA=="]}},
                        timeout=30), 400)
        # n_predict wins over max_tokens on /v1/completions (llama-server's aliases)
        httpx.post(u + "/v1/completions", json={"prompt": "hi", "max_tokens": 9, "n_predict": 5}, timeout=30)
        assert decs[0].calls[-1]["max_tokens"] == 5
        # no limit anywhere: to the end of the context (n_ctx - prompt)
        httpx.post(u + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert decs[0].calls[-1]["max_tokens"] == 64 - 3
        n0 = len(decs[0].calls)
        j = httpx.post(u + "/completion", json={"prompt": "hi", "n_predict": 0}, timeout=30).json()
        assert j["content"] == "" and j["tokens_evaluated"] == 3 and len(decs[0].calls) == n0
        j = httpx.post(u + "/completion", json={"prompt": "hi", "n_predict": 2, "response_fields":
                                                ["content", "generation_settings/n_predict", "nope"]}, timeout=30).json()
        assert j == {"content": "ab", "generation_settings/n_predict": 2}
        e = _err(httpx.post(u + "/completion", json={"prompt": "x" * 80}, timeout=30), 400, "context_length_exceeded")
        assert (e["type"], e["n_prompt_tokens"], e["n_ctx"]) == ("exceed_context_size_error", 81, 64)


def test_stream_timings_per_token_and_progress(tmp_path):
    srv, _ = _fake(tmp_path)
    with srv:
        body = {"prompt": "hi", "n_predict": 2, "stream": True, "timings_per_token": True, "return_progress": True}
        with httpx.stream("POST", srv.url + "/completion", json=body, timeout=30) as r:
            ev = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
        # llama-server's two progress events: the start (the cache processed), then the prompt done
        assert [(e["prompt_progress"]["total"], e["prompt_progress"]["processed"]) for e in ev[:2]] == [(3, 0), (3, 3)]
        assert all("timings" in e for e in ev) and ev[-1]["stop"] is True  # the progress events too
        assert "".join(e["content"] for e in ev) == "ab"


def test_response_keys_as_llama_server(tmp_path):
    """Keys llama-server sends or leaves out (server-task.cpp at 0c1e570): chat ``logprobs`` only
    when asked for; every final /v1/completions stream chunk carries ``usage``."""
    srv, _ = _fake(tmp_path)
    with srv:
        j = httpx.post(srv.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=30).json()
        assert "logprobs" not in j["choices"][0]
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                                          "stream": True}, timeout=30) as r:
            ev = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert not any("logprobs" in e["choices"][0] for e in ev if e["choices"])
        with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                     "stream": True}, timeout=30) as r:
            ev = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert ev[-1]["choices"][0]["finish_reason"] and ev[-1]["usage"]["completion_tokens"] == 2


def test_speculative_request_fields(tmp_path):
    srv, decs = _fake(tmp_path, n_draft_max=6, p_min=0.1)
    with srv:
        u = srv.url
        httpx.post(u + "/completion", json={"prompt": "x", "n_predict": 2, "speculative.n_max": 3,
                                            "speculative.p_min": 0.5, "speculative.n_min": 1}, timeout=30)
        assert (decs[0].calls[-1]["n_draft_max"], decs[0].calls[-1]["p_min"]) == (3, 0.5)
        assert decs[0].calls[-1]["n_draft_min"] == 1
        httpx.post(u + "/v1/chat/completions", json={"messages": CHAT, "speculative": {"n_max": 99}}, timeout=30)
        assert decs[0].calls[-1]["n_draft_max"] == 6  # never above --spec-draft-n-max
        httpx.post(u + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert (decs[0].calls[-1]["n_draft_max"], decs[0].calls[-1]["p_min"]) == (6, 0.1)
        _err(httpx.post(u + "/completion", json={"prompt": "x", "speculative.p_min": 2}, timeout=30), 400)


def test_n_choices_parallel_slots_and_verbose(tmp_path):
    srv, decs = _fake(tmp_path, n_slots=2, verbose=True, _delay=0.3)
    with srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="m", messages=CHAT, n=2, max_tokens=2)
        assert [ch.index for ch in r.choices] == [0, 1] and all(ch.message.content == "ab" for ch in r.choices)
        assert "__verbose" in r.model_extra
        _err(httpx.post(srv.url + "/v1/chat/completions", json={"messages": CHAT, "n": 3}, timeout=30), 400)
        # two requests at once run on the two slots
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(httpx.post, srv.url + "/completion", json={"prompt": "x", "n_predict": 2},
                              timeout=30) for _ in range(2)]
            time.sleep(0.15)
            busy = [s["is_processing"] for s in httpx.get(srv.url + "/slots", timeout=30).json()]
            assert all(f.result().status_code == 200 for f in futs)
        assert busy == [True, True] and len(decs) == 2 and all(d.calls for d in decs)
        r = httpx.post(srv.url + "/completion", json={"prompt": "x", "n_predict": 2, "id_slot": 1}, timeout=30)
        assert r.json()["id_slot"] == 1
        _err(httpx.post(srv.url + "/completion", json={"prompt": "x", "id_slot": 5}, timeout=30), 400)


def test_serve_llama_server_flags(tmp_path):
    from dflash2_gguf.cli import build_parser
    from dflash2_gguf.server.__main__ import settings_from_args

    t = tmp_path / "t.gguf"
    t.write_bytes(b"x")
    tf = tmp_path / "tmpl.jinja"
    tf.write_text("{{ messages }}")
    a = build_parser().parse_args(["serve", "-m", str(t), "--temp", "0.2", "-s", "7", "-n", "33", "-np", "3",
                                   "--no-jinja", "--chat-template-file", str(tf), "--spec-draft-n-min", "2",
                                   "--cors-origins", "localhost", "--alias", "a,b", "--tags", "x",
                                   "--host", "127.0.0.1,::1", "--offline", "--no-slots", "--metrics",
                                   "--no-context-shift", "-c", "0"])
    s = settings_from_args(a)
    assert (s.temperature, s.seed, s.max_tokens, s.n_slots, s.jinja, s.chat_template) == \
        (0.2, 7, 33, 3, False, "{{ messages }}")
    assert (s.n_draft_min, s.cors_origins, s.aliases, s.tag_list, s.endpoint_slots) == \
        (2, "localhost", ["a", "b"], ["x"], False)
    # -c 0 on a file without metadata: 4096, split across the 3 slots as llama.cpp (padded to 256)
    assert a.host == "127.0.0.1,::1" and s.n_ctx == 1536
    s = settings_from_args(build_parser().parse_args(["serve", "-m", str(t), "--context-shift", "--keep", "-1"]))
    assert s.context_shift is True and s.n_keep == -1
    from dflash2_gguf.server.__main__ import bind_sockets

    socks = bind_sockets("127.0.0.1,127.0.0.2", 0)
    assert len(socks) == 2
    for so in socks:
        so.close()


def test_context_default_is_training_context_capped_by_memory(smollm2_gguf):
    from dflash2_gguf.server.context import read_model_info, resolve_n_ctx

    info = read_model_info(str(smollm2_gguf))
    assert info.n_ctx_train == 8192 and info.n_layer == 30 and info.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert resolve_n_ctx(None, info, mem_available=64 << 30) == 8192
    assert resolve_n_ctx(None, info, mem_available=int(2 * 23040 * 1024)) == 1024  # 0.5 * mem / kv, 256s
    assert resolve_n_ctx(0, info, mem_available=1) == 8192 and resolve_n_ctx(300, info) == 300


def test_live_chat_without_v1_and_tokenize(live, reference):
    c = openai.OpenAI(base_url=live.url, api_key="x", max_retries=0, timeout=300)
    r = c.chat.completions.create(model="smol", messages=CHAT, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == reference(CHAT, 8)
    toks = httpx.post(live.url + "/tokenize", json={"content": "Hello world"}, timeout=30).json()["tokens"]
    assert httpx.post(live.url + "/detokenize", json={"tokens": toks}, timeout=30).json()["content"] == "Hello world"
    p = httpx.get(live.url + "/props", timeout=30).json()
    assert p["default_generation_settings"]["n_ctx"] == N_CTX and "{%" in p["chat_template"]


def test_llama_server_compat_report_logic(tmp_path):
    """benchmarks/llama_server_compat.py against our server on two ports: no difference; and its
    comparison finds status and key differences and marks the documented ones."""
    from benchmarks.llama_server_compat import CASES, compare, report_markdown, run

    cases = [c for c in CASES if c.name in ("props", "tokenize", "completion", "chat-stream", "cors-preflight",
                                            "chat-bad-type", "cors-preflight-bare-localhost", "cors-get")]
    a, _ = _fake(tmp_path)
    b, _ = _fake(tmp_path)
    with a, b:
        assert run(a.url, b.url, cases=cases) == []
    d = compare({"x": {"status": 200, "keys": {"a", "error.param"}}, "y": {"status": 400, "keys": set()}},
                {"x": {"status": 200, "keys": {"a", "b"}}, "y": {"status": 200, "keys": set()}})
    assert [(x["case"], x["what"], bool(x["documented"])) for x in d] == \
        [("x", "b", False), ("x", "error.param", True), ("y", "status", False)]
    assert "2 not documented" in report_markdown(d, 2)
    d = compare({"m": {"status": 200, "keys": {"[0].timings.draft_n", "last:generation_settings.speculative.n_max"}}},
                {"m": {"status": 200, "keys": set()}})
    assert all(x["documented"] for x in d)  # "*" entries cover the key nested deeper
    d = compare({"c": {"status": 200, "keys": set(), "headers": {"access-control-allow-headers": "authorization"}}},
                {"c": {"status": 200, "keys": set(), "headers": {"access-control-allow-headers": "*"}}})
    assert [(x["what"], x["ours"], x["theirs"]) for x in d] == [("header access-control-allow-headers",
                                                                 "authorization", "*")]


def test_live_n_probs_and_cached_tokens(live):
    """llama-server's n_probs shape on /completion, OpenAI logprobs on chat, and the prompt cache
    counts (timings.cache_n, usage.prompt_tokens_details.cached_tokens) on a repeated prompt."""
    j = httpx.post(live.url + "/completion", json={"prompt": PROMPTS[0], "n_predict": 3, "temperature": 0,
                                                   "n_probs": 2}, timeout=120).json()
    cp = j["completion_probabilities"]
    assert len(cp) == j["tokens_predicted"] and {"id", "token", "bytes", "logprob", "top_logprobs"} <= set(cp[0])
    assert len(cp[0]["top_logprobs"]) == 2 and cp[0]["top_logprobs"][0]["logprob"] <= 0
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    r1 = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()
    r2 = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert len(r1["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == r2["timings"]["cache_n"] > 0


def test_structured_output_parse_with_pydantic(client):
    """The openai SDK's ``chat.completions.parse(response_format=PydanticModel)`` (a
    ``json_schema`` response format, enforced by a grammar): the reply parses into the model."""
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        age: int

    r = client.chat.completions.parse(model="smol", messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, max_tokens=64, temperature=0)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and p.name and r.choices[0].finish_reason == "stop"


def test_serve_presence_penalty_flag_changes_outputs(smollm2_gguf, reference):
    """``serve --presence-penalty 1.5`` (issue 44): a request that sets no penalty is penalised
    (its greedy text departs from the target's plain greedy text), and one that sends
    ``presence_penalty: 0`` is not (the request's value wins)."""
    from dflash2_gguf.cli import build_parser
    from dflash2_gguf.server.__main__ import settings_from_args

    args = build_parser().parse_args(["serve", "-m", str(smollm2_gguf), "-c", str(N_CTX), "-t", "1",
                                      "--presence-penalty", "1.5", "--temp", "0", "-a", "smol"])
    s = settings_from_args(args)
    assert s.presence_penalty == 1.5 and s.temperature == 0.0
    prompt = PROMPTS[0]  # "The capital of France is": the penalty turns the greedy text after " Paris."
    with LiveServer(s) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16}, timeout=300).json()
        assert r["choices"][0]["text"] != reference(prompt)
        props = httpx.get(srv.url + "/props", timeout=30).json()["default_generation_settings"]["params"]
        assert props["presence_penalty"] == 1.5
        r0 = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "presence_penalty": 0},
                        timeout=300).json()
        assert r0["choices"][0]["text"] == reference(prompt)
