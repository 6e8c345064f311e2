"""The server speaks agents' language (issue 13): tools, reasoning, stop strings in streams,
``/v1/responses`` and ``/v1/messages``, proven with real clients (the ``openai`` and ``anthropic``
SDKs, the OpenAI Agents SDK).

Fast tests run the app with a scripted fake decoder (its output text is set per test), so they
check the wiring and the wire shapes; the ``slow`` tests run the real Qwen2.5-Coder-0.5B target
with a random DFlash 2 drafter (``qwen25_drafter``) in a server subprocess whose environment makes
T = 0 exact (README "Exactness at T = 0": ``-nr``, ``-fa on``, ``GGML_CPU_TILED_MM=0``, one
thread), and the real SmolLM2 target for the stop-string stream property.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from live_server import LiveServer  # noqa: E402

from dflash2_gguf.server.app import ServerSettings  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What's the weather in Paris right now?"}]
# The tool result of the live tests. Qwen2.5-Coder-0.5B (the small real target) answers a bare result
# ("sunny, 21 degrees Celsius", or JSON) by calling the tool again, at T = 0 with or without tools in
# the request (measured); with this wording it answers in text.
RESULT = "Paris: sunny, 21 degrees Celsius. Reply to the user in one plain sentence; do not call get_weather again."
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# a chat template with Hermes tool calls (what the fake server detects the format from)
HERMES_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                   "{% if tools %}<tools>{{ tools | tojson }}</tools> answer with <tool_call>{% endif %}")


class ScriptDecoder:
    """A fake decoder whose output is ``script`` (a list of text pieces, one stream chunk each).

    ``apply_chat_template`` records its keywords in ``renders`` and ends the prompt with
    ``<think>\\n`` when ``enable_thinking`` is true (as Qwen3-style templates do); ``calls`` holds
    every ``generate`` keyword set."""

    n_vocab = 100

    def __init__(self) -> None:
        self.script = ["Hello", " world"]
        self.calls, self.renders = [], []

    def tokenize(self, text, add_special=True, parse_special=False):
        return ([1] if add_special else []) + [ord(c) % 100 for c in text]

    def detokenize(self, tokens, special=False):
        return "".join(chr(t) for t in tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        self.renders.append(dict(kw, messages=messages))
        text = "".join(f"<{m['role']}>{m.get('content')}" for m in messages) + "<assistant>"
        if (kw.get("chat_template_kwargs") or {}).get("enable_thinking"):
            text += "<think>\n"
        return text

    def generate(self, stream=True, **kw):
        from dflash2_gguf.decoder.api import GenerationStats, StreamChunk

        self.calls.append(kw)
        pieces = list(self.script)
        n = len(kw.get("prompt") or [1])
        for i, p in enumerate(pieces):
            done = i == len(pieces) - 1
            st = GenerationStats(n, len(pieces), 0, 0, 0, 1.0, [], [], [], 0.0, 0.0, 0.0, 0.0, 0.0, 0.01, 200.0, 100.0,
                                 "eog") if done else None
            yield StreamChunk(p, [i + 1], [False], done, st)

    def close(self):
        pass


def _fake(**kw):
    decs = []

    def load():
        d = ScriptDecoder()
        decs.append(d)
        return d

    kw.setdefault("chat_template", HERMES_TEMPLATE)
    s = ServerSettings(model="none.gguf", alias="fake", **kw)
    return LiveServer(s, load=load), decs


def _split(text: str, k: int = 7) -> list:
    return [text[i:i + k] for i in range(0, len(text), k)]


def _client(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _err(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _accumulate(chunks) -> tuple:
    """Rebuild (content, reasoning, tool calls, finish) from OpenAI stream chunks the way the
    openai SDK's accumulation does (calls by index: id/name once, arguments concatenated)."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            cur = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                cur["id"] = tc.id
            if tc.function and tc.function.name:
                cur["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                cur["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------------------- chat: tools (fake decoder)

def test_tool_call_parsed_streamed_and_sdk_accumulates_it():
    srv, decs = _fake()
    with srv:
        decs[0].script = _split(CALL_TEXT)
        c = _client(srv)
        r = c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER])
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        [call] = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert decs[0].renders[-1]["tools"] == [WEATHER]  # the template got the tools
        chunks = list(c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER], stream=True))
        content, _, calls, finish = _accumulate(chunks)
        assert content == "" and finish == "tool_calls"
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [("get_weather", {"city": "Paris"})]
        first = next(x for x in chunks if x.choices and x.choices[0].delta.tool_calls).choices[0].delta.tool_calls[0]
        assert first.id and first.type == "function" and first.function.name == "get_weather"
        assert first.function.arguments == ""  # OpenAI's first delta: header, empty arguments
        # the openai SDK's own stream helper rebuilds the same call
        with c.chat.completions.stream(model="fake", messages=ASK, tools=[WEATHER]) as s:
            final = s.get_final_completion()
        tc = final.choices[0].message.tool_calls[0]
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("get_weather", {"city": "Paris"})
        # the follow-up: assistant tool_calls + a tool message in the history reach the template
        decs[0].script = ["It is ", "sunny."]
        hist = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
        r2 = c.chat.completions.create(model="fake", messages=hist, tools=[WEATHER])
        assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
        seen = decs[0].renders[-1]["messages"]
        assert seen[1]["tool_calls"][0]["function"]["name"] == "get_weather" and seen[2]["role"] == "tool"


def test_tool_choice_grammar_parallel_and_errors():
    srv, decs = _fake()
    with srv:
        c = _client(srv)
        two = CALL_TEXT + "\n" + CALL_TEXT.replace("get_weather", "get_time")
        decs[0].script = _split(two)
        r = c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
        g = decs[0].calls[-1]["sampling"].grammar
        assert g.startswith("root ::= tool-call-block (") and "get_weather" in g and "get_time" in g
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]
        r = c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False)
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
        assert decs[0].calls[-1]["sampling"].grammar is None  # auto: no grammar
        r = c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice={"type": "function", "function": {"name": "get_time"}})
        g = decs[0].calls[-1]["sampling"].grammar
        assert "get_time" in g and "get_weather" not in g
        # tool_choice none: tools rendered, output not parsed
        r = c.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER], tool_choice="none")
        assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
        url = srv.url + "/v1/chat/completions"
        bad = [
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [{"type": "web_search"}]}, "tools"),
            ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
            ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
            ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
            ({"reasoning_format": "xml"}, "reasoning_format"),
            ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
        ]
        for extra, param in bad:
            e = _err(httpx.post(url, json={"messages": ASK, **extra}, timeout=30), 400)
            assert (e["param"] or "").startswith(param), (extra, e)
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


def test_unsupported_template_is_400_naming_it():
    srv, _ = _fake(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with srv:
        e = _err(httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]},
                            timeout=30), 400)
        assert "--chat-template" in e["message"] and "does not render tools" in e["message"]
        # without tools the same server answers
        assert httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK}, timeout=30).status_code == 200


# ---------------------------------------------------------------------------- chat: reasoning (fake decoder)

def test_reasoning_split_streamed_first_and_formats():
    srv, decs = _fake()
    with srv:
        c = _client(srv)
        decs[0].script = ["<thi", "nk>I should", " greet.</th", "ink>\n\nHel", "lo!"]
        r = c.chat.completions.create(model="fake", messages=ASK)
        m = r.choices[0].message
        assert m.content == "Hello!" and m.model_extra["reasoning_content"] == "I should greet."
        chunks = list(c.chat.completions.create(model="fake", messages=ASK, stream=True))
        kinds = [k for x in chunks if x.choices for k in ("reasoning_content", "content")
                 if (x.choices[0].delta.model_extra or {}).get(k) or (k == "content" and x.choices[0].delta.content)]
        assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content") and kinds[0] == "reasoning_content"
        content, reasoning, _, _ = _accumulate(chunks)
        assert (content, reasoning) == ("Hello!", "I should greet.")
        r = c.chat.completions.create(model="fake", messages=ASK, extra_body={"reasoning_format": "none"})
        assert r.choices[0].message.content == "".join(decs[0].script)
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
        # enable_thinking opens the block in the prompt: the output starts inside it
        decs[0].script = ["plan", "</think>", "Done"]
        r = c.chat.completions.create(model="fake", messages=ASK,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == ("Done", "plan")
        # reasoning_effort "none" turns thinking off (llama-server); another value reaches the template
        c.chat.completions.create(model="fake", messages=ASK, reasoning_effort="none")
        assert decs[0].renders[-1]["chat_template_kwargs"]["enable_thinking"] is False
        c.chat.completions.create(model="fake", messages=ASK, reasoning_effort="low")
        assert decs[0].renders[-1]["chat_template_kwargs"]["reasoning_effort"] == "low"


def test_server_reasoning_flags():
    from dflash2_gguf.cli import build_parser
    from dflash2_gguf.server.__main__ import settings_from_args

    t = os.path.abspath(__file__)  # any existing file stands in for the GGUF here
    a = build_parser().parse_args(["serve", "-m", t, "-c", "64", "--reasoning-format", "none", "-rea", "off"])
    s = settings_from_args(a)
    assert (s.reasoning_format, s.enable_thinking) == ("none", False)
    s = settings_from_args(build_parser().parse_args(["serve", "-m", t, "-c", "64"]))
    assert (s.reasoning_format, s.enable_thinking) == ("auto", None)
    srv, decs = _fake(reasoning_format="none", enable_thinking=True)
    with srv:
        decs[0].script = ["<think>x</think>", "y"]
        r = _client(srv).chat.completions.create(model="fake", messages=ASK)
        assert r.choices[0].message.content == "<think>x</think>y"
        assert decs[0].renders[-1]["chat_template_kwargs"] == {"enable_thinking": True}


# ---------------------------------------------------------------------------- /v1/responses (fake decoder)

def test_responses_api_text_stream_and_tool_call():
    srv, decs = _fake()
    with srv:
        c = _client(srv)
        decs[0].script = ["<think>hmm</think>", "Hi ", "there"]
        r = c.responses.create(model="fake", instructions="Be brief.", input="Say hi", max_output_tokens=16)
        assert r.output_text == "Hi there" and r.status == "completed"
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.usage.output_tokens == 3 and r.usage.input_tokens > 0
        assert decs[0].renders[-1]["messages"][0] == {"role": "system", "content": "Be brief."}
        assert decs[0].calls[-1]["max_tokens"] == 16
        events = list(c.responses.create(model="fake", input="Say hi", stream=True))
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        assert "response.reasoning_text.delta" in types and "response.output_text.done" in types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hi there"
        assert events[-1].response.output_text == "Hi there"
        with c.responses.stream(model="fake", input="Say hi") as s:
            assert s.get_final_response().output_text == "Hi there"
        # one tool call, streamed and not, then the follow-up with its output
        tool = {"type": "function", "name": "get_weather", "description": "weather",
                "parameters": WEATHER["function"]["parameters"]}
        decs[0].script = _split(CALL_TEXT)
        r = c.responses.create(model="fake", input="Weather in Paris?", tools=[tool])
        [fc] = [o for o in r.output if o.type == "function_call"]
        assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id
        events = list(c.responses.create(model="fake", input="Weather in Paris?", tools=[tool], stream=True))
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert json.loads(done.arguments) == {"city": "Paris"}
        assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
        decs[0].script = ["Sunny."]
        r = c.responses.create(model="fake", tools=[tool], input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
            {"type": "function_call_output", "call_id": fc.call_id, "output": '{"sky": "sunny"}'}])
        assert r.output_text == "Sunny."
        seen = decs[0].renders[-1]["messages"]
        assert [m["role"] for m in seen] == ["user", "assistant", "tool"]
        assert seen[1]["tool_calls"][0]["id"] == fc.call_id and seen[2]["tool_call_id"] == fc.call_id
        # token count, and what this server refuses (OpenAI's error shape)
        n = httpx.post(srv.url + "/v1/responses/input_tokens", json={"input": "Say hi"}, timeout=30).json()
        assert n["object"] == "response.input_tokens" and n["input_tokens"] > 0
        with pytest.raises(openai.BadRequestError) as ei:
            c.responses.create(model="fake", input="x", previous_response_id="resp_1")
        assert ei.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.BadRequestError):
            c.responses.create(model="fake", input="x", tools=[{"type": "web_search"}])
        assert c.responses.create(model="fake", input="again").status == "completed"


# ---------------------------------------------------------------------------- /v1/messages (fake decoder)

def test_messages_api_with_anthropic_sdk():
    anthropic = pytest.importorskip("anthropic")
    srv, decs = _fake()
    with srv:
        a = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        decs[0].script = ["<think>hm</think>", "Hello", " there"]
        m = a.messages.create(model="fake", max_tokens=32, system="Be brief.",
                              messages=[{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                                      "cache_control": {"type": "ephemeral"}}]}])
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "Hello there"
        assert m.stop_reason == "end_turn" and m.usage.output_tokens == 3
        assert decs[0].renders[-1]["messages"][0] == {"role": "system", "content": "Be brief."}
        with a.messages.stream(model="fake", max_tokens=32, messages=[{"role": "user", "content": "Hi"}]) as s:
            texts = list(s.text_stream)
            final = s.get_final_message()
        assert "".join(texts) == "Hello there" and final.content[-1].text == "Hello there"
        # one tool call, streamed and not, and the tool_result follow-up
        tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["function"]["parameters"]}
        decs[0].script = _split(CALL_TEXT)
        m = a.messages.create(model="fake", max_tokens=64, tools=[tool],
                              messages=[{"role": "user", "content": "Weather in Paris?"}])
        [tu] = [b for b in m.content if b.type == "tool_use"]
        assert (tu.name, tu.input, m.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
        with a.messages.stream(model="fake", max_tokens=64, tools=[tool],
                               messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
            events = list(s)
            final = s.get_final_message()
        assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events
                   if e.type == "content_block_delta")
        assert final.content[-1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
        m = a.messages.create(model="fake", max_tokens=64, tools=[tool], tool_choice={"type": "any"},
                              messages=[{"role": "user", "content": "Weather in Paris?"}])
        assert "get_weather" in decs[0].calls[-1]["sampling"].grammar
        decs[0].script = ["Sunny ", "STOP"]
        m = a.messages.create(model="fake", max_tokens=64, tools=[tool], stop_sequences=["STOP"], messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": tu.id, "name": tu.name, "input": tu.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "sunny"}]}])
        assert m.content[0].text == "Sunny STOP"  # the fake decoder does not cut stops; the driver does
        seen = decs[0].renders[-1]["messages"]
        assert [x["role"] for x in seen] == ["user", "assistant", "tool"] and seen[2]["content"] == "sunny"
        assert decs[0].calls[-1]["stop"] == ["STOP"]
        n = a.messages.count_tokens(model="fake", messages=[{"role": "user", "content": "Hi"}])
        assert n.input_tokens > 0
        # Anthropic's error shape, and the server keeps serving
        with pytest.raises(anthropic.BadRequestError) as ei:
            a.messages.create(model="fake", max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
        assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.BadRequestError):
            a.messages.create(model="fake", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                              tools=[{"type": "web_search_20250305", "name": "web_search"}])
        r = httpx.post(srv.url + "/v1/messages", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
        assert r.status_code == 200 and r.json()["type"] == "message"


# ---------------------------------------------------------------------------- payloads as agents send them

AGENTS_SDK = {  # openai-agents 0.x, chat-completions model, one function tool
    "model": "fake", "messages": [{"role": "system", "content": "You are helpful."},
                                  {"role": "user", "content": "Weather in Paris?"}],
    "tools": [{"type": "function", "function": dict(WEATHER["function"], strict=True)}],
    "parallel_tool_calls": True, "tool_choice": "auto", "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": False}, "reasoning_effort": "low",
    "store": False, "top_p": None, "temperature": None, "metadata": {}, "response_format": None}
CLINE = {  # Cline's OpenAI-compatible provider: cache_control on parts, long system prompt, streaming
    "model": "fake", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
    "messages": [{"role": "system", "content": [{"type": "text", "text": "You are Cline." * 50,
                                                 "cache_control": {"type": "ephemeral"}}]},
                 {"role": "user", "content": [{"type": "text", "text": "<task>list files</task>",
                                               "cache_control": {"type": "ephemeral"}}]}],
    "max_completion_tokens": 64}
LANGCHAIN = {  # langchain-openai ChatOpenAI.bind_tools(...).invoke(...)
    "model": "fake", "messages": [{"role": "user", "content": "Weather in Paris?"}], "stream": False, "n": 1,
    "temperature": 0.0, "tools": [WEATHER], "parallel_tool_calls": False, "tool_choice": "get_weather_x"}


def test_agent_payloads_get_200_bad_values_400_and_server_keeps_serving():
    srv, decs = _fake()
    with srv:
        url = srv.url + "/v1/chat/completions"
        decs[0].script = _split(CALL_TEXT)
        r = httpx.post(url, json=AGENTS_SDK, timeout=30)
        assert r.status_code == 200 and "data: [DONE]" in r.text and '"tool_calls"' in r.text
        last = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")][-1]
        assert last["usage"]["completion_tokens"] > 0  # include_usage honoured
        decs[0].script = ["I will ", "list them."]
        r = httpx.post(url, json=CLINE, timeout=30)
        assert r.status_code == 200 and "list them." in r.text
        lc = dict(LANGCHAIN, tool_choice={"type": "function", "function": {"name": "get_weather"}})
        decs[0].script = _split(CALL_TEXT)
        r = httpx.post(url, json=lc, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        for body in (LANGCHAIN, dict(CLINE, temperature=-1), dict(AGENTS_SDK, parallel_tool_calls="yes"),
                     dict(AGENTS_SDK, messages=[{"role": "tool"}]), dict(AGENTS_SDK, tools=[{"type": "function"}])):
            assert httpx.post(url, json=body, timeout=30).status_code == 400
        assert httpx.post(url, json=CLINE, timeout=30).status_code == 200
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


# ---------------------------------------------------------------------------- stop strings, real model

@pytest.mark.native
def test_stop_strings_stream_equals_non_stream_and_stopping_word(native_ext, smollm2_gguf):
    """Real SmolLM2 target, T = 0: for stop strings cut out of the greedy text at random places,
    the streamed pieces concatenate to the non-streamed text, none of them holds the start of the
    cut stop string, and ``/completion`` reports the stop string that matched (``stopping_word``)."""
    from dflash2_gguf import DFlashDecoder

    prompt = "The three primary colors are"
    with DFlashDecoder(str(smollm2_gguf), None, n_ctx=128, n_threads=1) as dec:
        full = dec.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True).text
        rng = random.Random(0)
        for _ in range(6):
            i = rng.randrange(1, len(full) - 4)
            stop = full[i:i + rng.randrange(2, 5)]
            decoy = stop[:-1] + "\x00"  # shares a prefix, never completes
            ref = dec.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True, stop=[decoy, stop]).text
            assert ref == full[:full.find(stop)]
            pieces = [c.text for c in dec.generate(prompt, max_tokens=24, temperature=0, ignore_eos=True,
                                                   stop=[decoy, stop], stream=True)]
            assert "".join(pieces) == ref
            sent = ""
            for p in pieces:
                sent += p
                assert sent == ref[:len(sent)]  # nothing sent is ever taken back
    s = ServerSettings(model=str(smollm2_gguf), n_ctx=128, n_threads=1)
    with LiveServer(s) as srv:
        stop = full[5:9]
        j = httpx.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 24, "temperature": 0,
                                                      "stop": ["\x01", stop], "ignore_eos": True}, timeout=120).json()
        assert (j["stop_type"], j["stopping_word"], j["content"]) == ("word", stop, full[:full.find(stop)])
        r = httpx.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 24, "temperature": 0,
                                                      "stop": [stop], "ignore_eos": True, "stream": True}, timeout=120)
        objs = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: ")]
        assert "".join(o["content"] for o in objs[:-1]) == full[:full.find(stop)]
        assert objs[-1]["stopping_word"] == stop
        # Anthropic's stop_sequence is the matched stop string
        ask = {"max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}]}
        text = httpx.post(srv.url + "/v1/messages", json=ask, timeout=120).json()["content"][0]["text"]
        word = text[len(text) // 2:len(text) // 2 + 3]
        m = httpx.post(srv.url + "/v1/messages", json=dict(ask, stop_sequences=["\x01", word]), timeout=120).json()
        assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", word)
        assert m["content"][0]["text"] == text[:text.find(word)]


# ---------------------------------------------------------------------------- real Qwen2.5-Coder target

class ServerProcess:
    """``python -m dflash2_gguf.server ARGS`` on 127.0.0.1:<free port> in a subprocess (its own
    environment: ggml reads ``GGML_CPU_TILED_MM`` once per process)."""

    def __init__(self, args: list, env: dict) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.env = args, env
        self.proc = None

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash2_gguf.server", *self.args, "--port",
                                      str(self.port), "--log-level", "warning"], env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("server did not become ready in 300 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


@pytest.fixture(scope="module")
def qwen_server(native_ext, qwen25_05b_gguf, qwen25_drafter):
    """The real Qwen2.5-Coder-0.5B target with a random DFlash 2 drafter, settings for exact T = 0
    (``-nr``, ``-fa on``, ``GGML_CPU_TILED_MM=0``, one thread: exact beyond 256 cells too)."""
    import argparse

    from dflash2_gguf.server.__main__ import add_arguments

    env = dict(os.environ, GGML_CPU_TILED_MM="0", OMP_WAIT_POLICY="passive")
    args = ["-m", str(qwen25_05b_gguf), "-md", str(qwen25_drafter), "--spec-draft-n-max", "3", "-c", "1024",
            "-t", "1", "-td", "1", "-nr", "-fa", "on", "--temp", "0", "--alias", "qwen"]
    p = argparse.ArgumentParser()
    add_arguments(p)
    # a random drafter is gated off by the adaptive draft length: verify its drafts every cycle
    forced = "--spec-draft-adaptive" in p._option_string_actions
    if forced:
        args += ["--spec-draft-adaptive", "off"]
    with ServerProcess(args, env) as srv:
        srv.drafts_forced = forced
        yield srv


def _transcript(c, drafter: bool, forced: bool) -> dict:
    """Ask, call the tool, answer with its result; streamed and not. Returns what was said."""
    x = {"use_drafter": drafter}
    r = c.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=48,
                                  extra_body=x)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message
    [call] = ch.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args, dict) and "city" in args
    t = r.model_extra["timings"]
    assert t["draft_n"] == 0 if not drafter else (t["draft_n"] > 0 or not forced)
    chunks = list(c.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], temperature=0,
                                            max_tokens=48, stream=True, extra_body=x))
    _, _, calls, finish = _accumulate(chunks)
    assert finish == "tool_calls"
    assert [(k["name"], k["arguments"]) for k in calls] == [(call.function.name, call.function.arguments)]
    hist = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                  {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    r2 = c.chat.completions.create(model="qwen", messages=hist, tools=[WEATHER], temperature=0, max_tokens=40,
                                   extra_body=x)
    answer = r2.choices[0].message.content
    assert answer and r2.choices[0].message.tool_calls is None
    named = c.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Time in Oslo?"}],
                                      tools=[WEATHER, TIME], temperature=0, max_tokens=32, extra_body=x,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    [nc] = named.choices[0].message.tool_calls
    assert nc.function.name == "get_time" and isinstance(json.loads(nc.function.arguments).get("city"), str)
    return {"call": (call.function.name, args), "answer": answer, "usage": r2.usage.completion_tokens,
            "named": (nc.function.name, json.loads(nc.function.arguments))}


@pytest.mark.slow
@pytest.mark.native
def test_real_target_tool_calls_same_with_and_without_drafter(qwen_server):
    c = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    on, off = _transcript(c, True, qwen_server.drafts_forced), _transcript(c, False, qwen_server.drafts_forced)
    assert on == off
    assert "21" in on["answer"] or "sunny" in on["answer"].lower(), on


@pytest.mark.slow
@pytest.mark.native
def test_real_target_responses_and_messages_tool_call(qwen_server):
    anthropic = pytest.importorskip("anthropic")
    c = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    tool = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": WEATHER["function"]["parameters"]}
    r = c.responses.create(model="qwen", input=ASK[0]["content"], tools=[tool], temperature=0, max_output_tokens=48)
    [fc] = [o for o in r.output if o.type == "function_call"]
    assert fc.name == "get_weather" and "city" in json.loads(fc.arguments)
    a = anthropic.Anthropic(base_url=qwen_server.url, api_key="x", max_retries=0, timeout=600)
    atool = {"name": "get_weather", "description": "Current weather in a city",
             "input_schema": WEATHER["function"]["parameters"]}
    with a.messages.stream(model="qwen", max_tokens=48, tools=[atool], messages=ASK) as s:  # --temp 0
        m = s.get_final_message()
    [tu] = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and tu.name == "get_weather" and isinstance(tu.input.get("city"), str)


@pytest.mark.slow
@pytest.mark.native
def test_openai_agents_sdk_two_step_task(qwen_server):
    """The OpenAI Agents SDK runs a function tool against the server: the model calls the tool, the
    SDK runs it and sends the result back, and the final answer carries the tool's result."""
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: The city name.
        """
        seen.append(city)
        return RESULT

    client = openai.AsyncOpenAI(base_url=qwen_server.url + "/v1", api_key="x", max_retries=0, timeout=600)
    agent = Agent(name="weather", instructions="Use the tools to answer.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="qwen", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=48))
    result = Runner.run_sync(agent, "What's the weather in Paris right now?", max_turns=4)
    assert seen and "paris" in seen[0].lower()
    out = str(result.final_output)
    assert "21" in out or "sunny" in out.lower(), out
    assert agents  # imported: the SDK is installed
