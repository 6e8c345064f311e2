"""llama-server drop-in, second part (issue 41): per-slot context, the chat token count, prefill
progress and per-token timings, assistant prefill, model aliases and tags, the build fingerprint,
``/tokenize`` with a BOS, and the web-page flags, against live servers (uvicorn on 127.0.0.1, see
tests/server/test_server.py) with httpx.

Reference: tools/server/server-context.cpp, server-task.cpp, server-common.cpp, server-http.cpp,
server.cpp and common/chat.cpp, src/llama-context.cpp at llama.cpp 0c1e570. The real SmolLM2 target
alone (and the tiny llama target, whose GGUF asks for a BOS) for what the model decides; fake
decoders for the page flags.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from live_server import LiveServer  # noqa: E402
from test_server import CHAT, _fake  # noqa: E402

from dflash2_gguf.server.app import BUILD_INFO, ServerSettings  # noqa: E402


def _serve_settings(argv):
    from dflash2_gguf.cli import build_parser
    from dflash2_gguf.server.__main__ import prepare_argv, settings_from_args

    return settings_from_args(build_parser().parse_args(["serve", *prepare_argv(argv, {})]), warn=lambda _: None)


def _events(url: str, path: str, body: dict) -> list:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]


@pytest.fixture(scope="module")
def smol(native_ext, smollm2_gguf):
    """SmolLM2 alone, 512 cells, aliases and tags given out of order."""
    s = ServerSettings(model=str(smollm2_gguf), n_ctx=512, n_threads=1, alias="smol,b-alias,smol", tags="y,x")
    with LiveServer(s) as srv:
        yield srv


# ---------------------------------------------------------------------------- context per slot

def test_context_is_split_across_slots(native_ext, smollm2_gguf):
    """``-c 1024 -np 2``: 512 cells per slot (llama-server's n_ctx_seq), reported in /props,
    /slots and /v1/models, and the context check and the generation limit use it."""
    m = str(smollm2_gguf)
    s = _serve_settings(["-m", m, "-c", "1024", "-np", "2", "-t", "1"])
    assert (s.n_ctx, s.n_slots) == (512, 2)
    # llama.cpp's rounding: the pool and each share padded to 256; -kvu: each slot the whole pool
    assert _serve_settings(["-m", m, "-c", "1000", "-np", "3"]).n_ctx == 512
    assert _serve_settings(["-m", m, "-c", "1024", "-np", "2", "--kv-unified"]).n_ctx == 1024
    assert _serve_settings(["-m", m, "-c", "300"]).n_ctx == 512
    assert _serve_settings(["-m", m, "-c", "65536"]).n_ctx == 8192  # capped by the training context
    assert _serve_settings(["-m", m, "-np", "2", "--kv-unified-per-slot", "256"]).n_ctx == 256
    with pytest.raises(ValueError, match="kv-unified-per-slot"):
        _serve_settings(["-m", m, "--kv-unified-per-slot", "-1"])
    with LiveServer(s) as srv:
        u = srv.url
        p = httpx.get(u + "/props", timeout=30).json()
        assert p["default_generation_settings"]["n_ctx"] == 512 and p["total_slots"] == 2
        assert [x["n_ctx"] for x in httpx.get(u + "/slots", timeout=30).json()] == [512, 512]
        assert httpx.get(u + "/v1/models", timeout=30).json()["data"][0]["meta"]["n_ctx"] == 512
        ids = httpx.post(u + "/tokenize", json={"content": "hello " * 600}, timeout=30).json()["tokens"]
        assert 512 <= len(ids) < 1024  # fitted the whole -c before
        r = httpx.post(u + "/completion", json={"prompt": ids, "n_predict": 2}, timeout=60)
        assert r.status_code == 400
        e = r.json()["error"]
        assert (e["type"], e["n_prompt_tokens"], e["n_ctx"]) == ("exceed_context_size_error", len(ids), 512)
        # no limit: the generation stops where the slot's 512 cells end
        j = httpx.post(u + "/completion", json={"prompt": ids[:500], "temperature": 0, "ignore_eos": True},
                       timeout=300).json()
        assert j["tokens_evaluated"] == 500 and j["tokens_predicted"] == 12 and j["stop_type"] == "limit"
        assert httpx.get(u + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------------- endpoints

def test_chat_input_tokens_all_paths(smol):
    """``POST /chat/completions/input_tokens`` (and /v1, and the Responses forms): the prompt's
    token count as it would be fed, in llama-server's shape."""
    u = smol.url
    msgs = CHAT + [{"role": "assistant", "content": "It is"}]
    prompt = httpx.post(u + "/apply-template", json={"messages": msgs}, timeout=30).json()["prompt"]
    n = len(httpx.post(u + "/tokenize", json={"content": prompt, "add_special": True}, timeout=30).json()["tokens"])
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        r = httpx.post(u + path, json={"messages": msgs}, timeout=30)
        assert r.status_code == 200 and r.json() == {"input_tokens": n, "object": "response.input_tokens"}, path
    for path in ("/responses/input_tokens", "/v1/responses/input_tokens"):
        j = httpx.post(u + path, json={"input": "What is 2 + 2?"}, timeout=30).json()
        assert j["object"] == "response.input_tokens" and j["input_tokens"] > 5
    r = httpx.post(u + "/chat/completions/input_tokens", json={"messages": "nope"}, timeout=30)
    assert r.status_code == 400 and "messages" in r.text
    assert httpx.post(u + "/chat/completions/input_tokens", json={"messages": CHAT}, timeout=30).status_code == 200


def test_stream_progress_and_timings_as_llama_server(smol):
    """Chat: each prompt-progress event is a role delta with the progress (and the timings with
    ``timings_per_token``): one at the start (the cache processed) and one with the prompt done;
    then the first token's role delta alone, without timings; every token event after it has
    them. Without ``return_progress`` the first event is that bare role delta."""
    u = smol.url
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True, "timings_per_token": True,
            "return_progress": True}
    ev = _events(u, "/v1/chat/completions", body)
    n = httpx.post(u + "/chat/completions/input_tokens", json={"messages": CHAT}, timeout=30).json()["input_tokens"]
    p0, p1 = ev[0]["prompt_progress"], ev[1]["prompt_progress"]
    assert (p0["total"], p0["processed"], p0["time_ms"]) == (n, p0["cache"], 0)
    assert (p1["total"], p1["processed"]) == (n, n) and p1["time_ms"] >= 0
    for e in ev[:2]:
        assert e["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" in e
        assert e["timings"]["predicted_n"] == 0
    assert ev[2]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert "timings" not in ev[2] and "prompt_progress" not in ev[2]
    rest = [e for e in ev[3:] if e["choices"]]
    assert rest and all("timings" in e for e in rest)
    assert not any("prompt_progress" in e for e in ev[2:])
    # without return_progress: the first event is the bare role delta, no progress anywhere
    ev = _events(u, "/v1/chat/completions", {**body, "return_progress": False})
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": None} and "timings" not in ev[0]
    assert "timings" in ev[1] and not any("prompt_progress" in e for e in ev)
    # /completion and /v1/completions: two progress events, then the tokens
    ev = _events(u, "/completion", {"prompt": "Hi there", "n_predict": 3, "stream": True, "return_progress": True})
    assert [e["prompt_progress"]["processed"] for e in ev[:2]] == [ev[0]["prompt_progress"]["cache"],
                                                                   ev[0]["prompt_progress"]["total"]]
    assert ev[0]["content"] == "" and "timings" not in ev[0] and "prompt_progress" not in ev[2]
    ev = _events(u, "/v1/completions", {"prompt": "Hi there", "max_tokens": 3, "stream": True,
                                        "return_progress": True, "timings_per_token": True})
    assert "prompt_progress" in ev[0] and "prompt_progress" in ev[1] and "timings" in ev[0]
    assert "prompt_progress" not in ev[2]


def test_assistant_prefill_continues_the_message_as_given(smol):
    """A final assistant message is continued: its content goes into the prompt as given (trailing
    space kept), after the generation prompt, as llama-server builds it; the reply is the
    continuation only (greedy: the same text as /completion on that prompt)."""
    u = smol.url
    msgs = CHAT + [{"role": "assistant", "content": "The answer is "}]
    prompt = httpx.post(u + "/apply-template", json={"messages": msgs}, timeout=30).json()["prompt"]
    head = httpx.post(u + "/apply-template", json={"messages": CHAT}, timeout=30).json()["prompt"]
    assert prompt == head + "The answer is "  # the generation prompt, then the content, space kept
    r = httpx.post(u + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0},
                   timeout=120).json()
    ref = httpx.post(u + "/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0},
                     timeout=120).json()
    assert r["choices"][0]["message"]["content"] == ref["content"] and ref["content"]
    assert r["usage"]["prompt_tokens"] == ref["tokens_evaluated"]
    bad = httpx.post(u + "/v1/chat/completions", json={"messages": msgs + [{"role": "assistant", "content": "x"}],
                                                      "max_tokens": 2}, timeout=30)
    assert bad.status_code == 400 and "2 or more assistant messages" in bad.text
    bad = httpx.post(u + "/v1/chat/completions", json={"messages": msgs, "continue_final_message": True,
                                                      "add_generation_prompt": True, "max_tokens": 2}, timeout=30)
    assert bad.status_code == 400 and "add_generation_prompt" in bad.text
    assert httpx.get(u + "/health", timeout=30).status_code == 200


def test_models_aliases_tags_and_fingerprint(smol, smollm2_gguf, tmp_path):
    """``--alias smol,b-alias,smol --tags y,x``: llama-server's sets (sorted, no duplicates), the
    first alias is the id; ``system_fingerprint`` and ``build_info`` are ``b<build>-<commit>``;
    without ``--alias`` the id is the ``-m`` path as given."""
    u = smol.url
    d = httpx.get(u + "/v1/models", timeout=30).json()
    m = d["data"][0]
    assert (m["id"], m["aliases"], m["tags"]) == ("b-alias", ["b-alias", "smol"], ["x", "y"])
    assert d["models"][0]["name"] == "b-alias"
    p = httpx.get(u + "/props", timeout=30).json()
    assert p["model_alias"] == "b-alias" and p["build_info"] == BUILD_INFO == "b11312-0c1e57098"
    r = httpx.post(u + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60).json()
    assert r["system_fingerprint"] == BUILD_INFO and r["model"] == "b-alias"
    assert re.fullmatch(r"b\d+-[0-9a-f]{7,}", r["system_fingerprint"])
    ev = _events(u, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert {e["system_fingerprint"] for e in ev} == {BUILD_INFO}
    s = ServerSettings(model=str(smollm2_gguf))
    assert (s.model_id, s.aliases, s.tag_list) == (str(smollm2_gguf), [str(smollm2_gguf)], [])


def test_tokenize_bos_and_pieces(native_ext, tiny_llama):
    """``/tokenize`` as llama-server: ``add_special`` puts the BOS first for a GGUF that asks for
    one (``tokenizer.ggml.add_bos_token``), only before a first text element; ``with_pieces``
    gives each id with its text."""
    s = ServerSettings(model=str(tiny_llama), n_ctx=256, n_threads=1)
    with LiveServer(s) as srv:
        u = srv.url

        def tok(**body):
            r = httpx.post(u + "/tokenize", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        # (the tiny vocabulary has no space piece, so its texts are empty: the BOS alone shows)
        assert tok(content="") == [] and tok(content="", add_special=True) == [1]  # the BOS first when asked
        assert tok(content=["", 5, 6], add_special=True) == [1, 5, 6]
        assert tok(content=[5, ""], add_special=True) == [5]  # a first id: no BOS
        assert tok(content=["", 5]) == [5]
        pieces = tok(content=["", 5], add_special=True, with_pieces=True)
        assert pieces == [{"id": 1, "piece": "<s>"}, {"id": 5, "piece": "_b"}]
        r = httpx.post(u + "/tokenize", json={"content": "", "with_pieces": "yes please"}, timeout=30)
        assert r.status_code == 400
        assert httpx.get(u + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------------- the web page's flags

def test_no_ui_and_static_path(tmp_path):
    """``--no-ui``: no page at / (404, ``"ui": false`` in /props); ``--path DIR``: DIR's files at
    / (``index.html`` for /), before the endpoints, never outside DIR; with an API key only / is
    public."""
    from dflash2_gguf.server.web import PAGE_PATHS

    srv, _ = _fake(tmp_path, ui=False)
    with srv:
        assert httpx.get(srv.url + "/", timeout=30).status_code == 404
        assert all(httpx.get(srv.url + p, timeout=30).status_code == 404 for p in PAGE_PATHS)
        assert httpx.get(srv.url + "/props", timeout=30).json()["ui"] is False
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "index.html").write_text("<p>mine</p>")
    (site / "app.js").write_text("let x = 1;")
    (site / "sub" / "index.html").write_text("sub page")
    (tmp_path / "secret.txt").write_text("no")
    srv, _ = _fake(tmp_path, static_path=str(site), api_key="k")
    with srv:
        u = srv.url
        r = httpx.get(u + "/", timeout=30)
        assert r.status_code == 200 and r.text == "<p>mine</p>" and r.headers["content-type"].startswith("text/html")
        assert httpx.get(u + "/app.js", timeout=30).status_code == 401  # not public with a key
        r = httpx.get(u + "/app.js", headers={"Authorization": "Bearer k"}, timeout=30)
        assert r.text == "let x = 1;" and "javascript" in r.headers["content-type"]
        assert httpx.get(u + "/sub/", headers={"Authorization": "Bearer k"}, timeout=30).text == "sub page"
        for bad in ("/../secret.txt", "/%2e%2e/secret.txt", "/sub/../../secret.txt"):
            r = httpx.get(u + bad, headers={"Authorization": "Bearer k"}, timeout=30)
            assert r.status_code == 404 and "no" != r.text, bad
        assert httpx.get(u + "/webui/app.js", headers={"Authorization": "Bearer k"}, timeout=30).status_code == 404
        p = httpx.get(u + "/props", headers={"Authorization": "Bearer k"}, timeout=30).json()
        assert p["ui"] is True
        assert httpx.get(u + "/health", timeout=30).status_code == 200


def test_page_flags_parse(tmp_path):
    """``--no-webui`` / ``--ui`` / ``--path`` reach the settings; a missing ``--path`` folder is
    refused, as llama-server refuses it."""
    t = tmp_path / "t.gguf"
    t.write_bytes(b"x")
    assert _serve_settings(["-m", str(t), "--no-webui"]).ui is False
    assert _serve_settings(["-m", str(t), "--no-ui", "--ui"]).ui is True
    assert _serve_settings(["-m", str(t), "--path", str(tmp_path)]).static_path == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="static assets path not found"):
        _serve_settings(["-m", str(t), "--path", str(tmp_path / "nope")])


# ---------------------------------------------------------------------------- context shift

def test_context_shift_live(native_ext, tiny_peaked):
    """``--context-shift --keep 4`` with a drafter: a request that runs past its 256-cell slot
    goes on (llama-server's shift), and its greedy text equals the target alone's with the same
    shifts; without the flag it ends at the full context with finish_reason "length"."""
    from dflash2_gguf import DFlashDecoder, SamplingParams

    target, drafters = tiny_peaked
    prompt = [1, 5, 9, 14, 20, 7, 7, 33, 12, 40]
    with DFlashDecoder(target, None, n_ctx=256, n_threads=1) as dec:
        ref = dec.generate(prompt, max_tokens=400, sampling=SamplingParams.greedy_params(), ignore_eos=True,
                           context_shift=True, n_keep=4)
    assert ref.stats.n_ctx_shifts >= 2
    body = {"prompt": prompt, "n_predict": 400, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    s = ServerSettings(model=str(target), model_draft=str(drafters[2]), n_ctx=256, n_threads=1, adaptive=False,
                       context_shift=True, n_keep=4)
    with LiveServer(s) as srv:
        r = httpx.post(srv.url + "/completion", json=body, timeout=300).json()
        assert r["tokens"] == ref.tokens and r["timings"]["draft_n"] > 0
    with LiveServer(ServerSettings(model=str(target), n_ctx=256, n_threads=1)) as srv:
        r = httpx.post(srv.url + "/completion", json=body, timeout=300).json()
        assert len(r["tokens"]) < 256 and r["stop_type"] == "limit"


# ---------------------------------------------------------------------------- seed-stable speculation

def test_target_sample_acceptance_live(native_ext, smollm2_gguf):
    """A request's ``spec_accept: "target-sample"`` (llama-server's acceptance rule) at T = 1 gives,
    for its seed, the text of a server without a drafter; ``--spec-accept`` sets the default."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-dflash2.gguf"
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 1.0, "seed": 11, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0}
    with LiveServer(ServerSettings(model=str(smollm2_gguf), n_ctx=512, n_threads=1)) as srv:
        alone = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300).json()
    alone_text = alone["choices"][0]["message"]["content"]
    s = ServerSettings(model=str(smollm2_gguf), model_draft=str(shipped), n_ctx=512, n_threads=1, adaptive=False)
    with LiveServer(s) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "spec_accept": "target-sample"},
                       timeout=300).json()
        assert r["choices"][0]["message"]["content"] == alone_text and r["timings"]["draft_n"] > 0
        bad = httpx.post(srv.url + "/v1/chat/completions", json={**body, "spec_accept": "maybe"}, timeout=60)
        assert bad.status_code == 400
    s2 = _serve_settings(["-m", str(smollm2_gguf), "-md", str(shipped), "--spec-accept", "target-sample"])
    assert s2.spec_accept == "target-sample"
