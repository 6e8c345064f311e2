"""Tool-call parsing (dflash2_gguf.chat.toolcalls): exact calls per format, streaming == batch on random
splits (deltas accumulated as the openai SDK accumulates them), malformed output, format detection."""

from __future__ import annotations

import json
import random

import pytest

from dflash2_gguf.chat.toolcalls import (
    ToolCallParser, UnsupportedToolFormatError, detect_tool_format, parse_tool_calls,
)


def _ids():
    n = iter(range(1000))
    return lambda: f"call_{next(n)}"


def _call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def _splits(text, rng, max_piece=7):
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, max_piece)
        out.append(text[i:i + k])
        i += k
    return out


def _accumulate(deltas):
    """Rebuild (content, tool_calls) from stream deltas the way the openai SDK does: content
    concatenated; tool calls merged by ``index``, id/type/name taken from the first delta of an index,
    ``function.arguments`` fragments concatenated."""
    content, calls = None, {}
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "type": None, "function": {"name": None, "arguments": ""}})
            if tc.get("id"):
                c["id"] = tc["id"]
            if tc.get("type"):
                c["type"] = tc["type"]
            fn = tc.get("function", {})
            if fn.get("name"):
                assert c["function"]["name"] is None, "the name is sent once, in the first delta"
                c["function"]["name"] = fn["name"]
            c["function"]["arguments"] += fn.get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def _stream(text, fmt, rng, **kw):
    p = ToolCallParser(fmt, id_factory=_ids(), **kw)
    deltas = []
    for piece in _splits(text, rng):
        deltas += p.feed(piece)
    deltas += p.finish()
    return deltas


HERMES = (
    "I'll look both up.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
    "\"days\": [1, 2.5e1, -3], \"opts\": {\"unit\": \"celsius\", \"exact\": true, \"note\": null, "
    "\"q\": \"a \\\"quoted\\\" }] \\u00e9\"}}}\n</tool_call>\n<tool_call>\n{\"name\": \"time_now\", "
    "\"arguments\": {}}\n</tool_call>"
)
HERMES_CALLS = [
    _call(0, "get_weather", json.dumps({"city": "Paris", "days": [1, 25.0, -3], "opts": {
        "unit": "celsius", "exact": True, "note": None, "q": "a \"quoted\" }] é"}}, ensure_ascii=False)),
    _call(1, "time_now", "{}"),
]


def test_hermes_exact_calls():
    r = parse_tool_calls(HERMES, "hermes", id_factory=_ids())
    assert r.tool_calls == HERMES_CALLS
    assert r.content == "I'll look both up."
    assert json.loads(r.tool_calls[0]["function"]["arguments"])["opts"]["q"] == "a \"quoted\" }] é"


def test_hermes_qwen_shapes():
    # Qwen2.5 writes one call per block, no other text; content is then None
    t = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    r = parse_tool_calls(t, "hermes", id_factory=_ids())
    assert r.content is None and r.tool_calls == [_call(0, "add", '{"a": 2, "b": 3}')]
    # no closing tag (generation ended at EOS): still a call; arguments key absent -> "{}"
    r = parse_tool_calls('<tool_call>\n{"name": "ping"}', "hermes", id_factory=_ids())
    assert r.tool_calls == [_call(0, "ping", "{}")] and r.content is None
    # content after a call is kept, blanks around the call dropped
    r = parse_tool_calls('Sure.  <tool_call>{"name": "a", "arguments": {"x": "y"}}</tool_call>\n\nDone ',
                         "hermes", id_factory=_ids())
    assert (r.content, r.tool_calls) == ("Sure.Done ", [_call(0, "a", '{"x": "y"}')])
    # plain text is returned unchanged, including blanks and a lone '<'
    text = "  a < b and <tool it is\n\n"
    assert parse_tool_calls(text, "hermes") .content == text
    assert parse_tool_calls(text, "hermes").tool_calls == []


def test_hermes_bare_json_call_at_the_start():
    """Qwen2.5(-Coder) models often answer a tool prompt with the bare JSON object, no <tool_call>
    (llama.cpp's Hermes parser accepts that too)."""
    t = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    r = parse_tool_calls(t, "hermes", id_factory=_ids())
    assert (r.content, r.tool_calls) == (None, [_call(0, "get_weather", '{"city": "Paris"}')])
    t2 = '\n{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": 1}}\nDone <tool_call>{"name": "c"}</tool_call>'
    r = parse_tool_calls(t2, "hermes", id_factory=_ids())
    assert r.tool_calls == [_call(0, "a", "{}"), _call(1, "b", '{"x": 1}'), _call(2, "c", "{}")] and r.content == "Done"
    # JSON that is not a call (another first key, or a name that is not a tool) stays content
    for text in ('{"answer": 4, "name": "x"}', '  {"name": "Bob", "age": 3} is the record'):
        assert parse_tool_calls(text, "hermes", tool_names=["get_weather"]).content == text
    assert parse_tool_calls(t, "hermes", tool_names=["get_weather"]).tool_calls[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call> after",
    "Hi <tool_call>\n{name: 'f'}\n</tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    "<tool_call>{\"arguments\": {\"a\": 1}}</tool_call>",   # no name
    "<tool_call></tool_call>x",
    "text <tool_call>{\"na",                                # cut before the name completed
])
def test_hermes_malformed_left_as_content(text):
    r = parse_tool_calls(text, "hermes")
    assert r.tool_calls == [] and r.content == text


def test_hermes_broken_after_name_is_a_call_with_completed_arguments():
    t = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": "x",,}}</tool_call> ok'
    r = parse_tool_calls(t, "hermes", id_factory=_ids())
    assert r.tool_calls == [_call(0, "f", '{"a": 1, "b": "x"}')] and r.content == "ok"
    # cut by max_tokens inside a string value: the completed values only
    r = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1, "b": "unfin', "hermes", id_factory=_ids())
    assert r.tool_calls == [_call(0, "f", '{"a": 1}')]


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
     None, [_call(0, "get_weather", '{"city": "Paris", "days": 3}')]),
    ('<|python_tag|>{"type": "function", "name": "f", "parameters": {}}',
     None, [_call(0, "f", "{}")]),
    (' {"name": "a", "arguments": {"x": [1]}}; {"name": "b", "parameters": {"y": "z"}}\n',
     None, [_call(0, "a", '{"x": [1]}'), _call(1, "b", '{"y": "z"}')]),
    ('{"name": "a", "parameters": {}}\nThat is all.', "That is all.", [_call(0, "a", "{}")]),
    ("The answer is 4.", "The answer is 4.", []),
    ('  {"result": 5}', '  {"result": 5}', []),               # JSON, but not a call
    ('{"value": 1, "name": "a", "parameters": {}}', '{"value": 1, "name": "a", "parameters": {}}', []),
    ('Call {"name": "a", "parameters": {}}', 'Call {"name": "a", "parameters": {}}', []),  # not at the start
    ('{"name": "a", "parameters": {"q": 1,,}}', None, [_call(0, "a", '{"q": 1}')]),
    ('{"name" "a"}', '{"name" "a"}', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA3)
def test_llama3_exact(text, content, calls):
    r = parse_tool_calls(text, "llama3_json", id_factory=_ids())
    assert (r.content, r.tool_calls) == (content, calls)


def test_llama3_tool_names_filter():
    t = '{"name": "Bob", "parameters": {"age": 3}}'
    assert parse_tool_calls(t, "llama3_json", tool_names=["get_weather"]).content == t
    assert parse_tool_calls(t, "llama3_json", tool_names=["Bob"]).tool_calls[0]["function"]["name"] == "Bob"


CASES = [(HERMES, "hermes")] + [
    (t, "hermes") for t in (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        'Sure.  <tool_call>{"name": "a", "arguments": {"x": "y"}}</tool_call>\n\nDone ',
        "<tool_call>not json</tool_call> after <tool_call>{\"name\": \"z\", \"arguments\": {\"k\": [[], {}]}}</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"a": 1, "b": "x",,}}</tool_call> ok <tool_call>{"name": "g"',
        "plain text with < and <tool and </tool_call> in it",
        '<tool_call>{"arguments": {"a": {"b": [1, 2, 3]}}, "name": "late"}</tool_call>',
        '\n{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": 1}}\nDone <tool_call>{"name": "c"}</tool_call>',
        '{"answer": 4, "name": "x"} then <tool_call>{"name": "d", "arguments": {"e": "f"}}</tool_call>',
        '<tool_call>x <tool_call>{"name": "f"}</tool_call><tool_call>  </tool_call>',
        '{"answer": "a <tool_call> b"} <tool_call>{"name": "g", "arguments": {"h": [1, {"i": "<tool_call>"}]}}</tool_call>',
        '<tool_call>{"a": 1,, "name": "x"} <tool_call>{"name": "y"}</tool_call>',
    )
] + [(t, "llama3_json") for t, _, _ in LLAMA3]


@pytest.mark.parametrize("text,fmt", CASES)
def test_streaming_equals_batch_on_random_splits(text, fmt):
    batch = parse_tool_calls(text, fmt, id_factory=_ids())
    rng = random.Random(1234)
    for _ in range(60):
        deltas = _stream(text, fmt, rng)
        content, calls = _accumulate(deltas)
        assert calls == batch.tool_calls
        assert (content or None) == (batch.content or None)
        # OpenAI's shape: the first delta of a call carries id, type, name and empty arguments
        firsts = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                firsts.setdefault(tc["index"], tc)
        for i, tc in firsts.items():
            assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["arguments"] == ""
            assert tc["id"] == batch.tool_calls[i]["id"] and tc["type"] == "function"


def test_arguments_are_streamed_in_fragments():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": [1, 2], "c": {"d": "e"}}}</tool_call>'
    p = ToolCallParser("hermes", id_factory=_ids())
    deltas = []
    for ch in text:
        deltas += p.feed(ch)
    deltas += p.finish()
    frags = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(frags) >= 4, frags      # the arguments arrive while the model writes them
    assert "".join(frags) == '{"a": 1, "b": [1, 2], "c": {"d": "e"}}'
    # the header was sent before the arguments were complete
    first = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert first < len(deltas) - 2


def test_openai_sdk_stream_accumulation():
    """The openai SDK's own stream accumulator rebuilds the batch calls from our deltas."""
    pytest.importorskip("openai")
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    batch = parse_tool_calls(HERMES, "hermes", id_factory=_ids())
    deltas = _stream(HERMES, "hermes", random.Random(7))
    state = ChatCompletionStreamState()
    chunks = [{"index": 0, "delta": d, "finish_reason": None} for d in [{"role": "assistant"}] + deltas]
    chunks.append({"index": 0, "delta": {}, "finish_reason": "tool_calls"})
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [c]}))
    msg = state.get_final_completion().choices[0].message
    assert msg.content == batch.content
    got = [{"id": t.id, "type": t.type, "function": {"name": t.function.name, "arguments": t.function.arguments}}
           for t in msg.tool_calls]
    assert got == batch.tool_calls


# ----------------------------------------------------------------------------- format detection

QWEN_LIKE = "{%- if tools %}...<tools>{{ tool | tojson }}</tools>...<tool_call>\n{% endif %}"
LLAMA31_LIKE = ("{%- if tools %}<|start_header_id|>user<|end_header_id|>Respond in the format "
                '{"name": function name, "parameters": dictionary}{% endif %}<|start_header_id|>ipython')


def test_detect_tool_format():
    assert detect_tool_format(QWEN_LIKE) == "hermes"
    assert detect_tool_format(LLAMA31_LIKE) == "llama3_json"
    with pytest.raises(UnsupportedToolFormatError, match="model.gguf.*does not render tools"):
        detect_tool_format("{% for m in messages %}{{ m.content }}{% endfor %}", "tokenizer.chat_template of model.gguf")
    with pytest.raises(UnsupportedToolFormatError, match="Mistral") as e:
        detect_tool_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "T")
    assert e.value.source == "T" and isinstance(e.value, ValueError)
    with pytest.raises(UnsupportedToolFormatError, match="Qwen3-Coder"):
        detect_tool_format("{% if tools %}<tool_call>\n<function={{ name }}>{% endif %}")
    with pytest.raises(UnsupportedToolFormatError, match="not recognised"):
        detect_tool_format("{% if tools %}FUNCTIONS: {{ tools | tojson }}{% endif %}")


def test_real_templates(qwen25_05b_gguf, smollm2_gguf):
    from dflash2_gguf.chat.templates import ChatRenderer

    assert detect_tool_format(ChatRenderer.from_gguf(qwen25_05b_gguf).template) == "hermes"
    smol = ChatRenderer.from_gguf(smollm2_gguf)
    with pytest.raises(UnsupportedToolFormatError, match="SmolLM2.*does not render tools"):
        detect_tool_format(smol.template, smol.source)


def test_parser_rejects_unknown_format_and_feed_after_finish():
    with pytest.raises(ValueError, match="unknown tool-call format"):
        ToolCallParser("mistral")
    p = ToolCallParser("hermes")
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


@pytest.mark.slow
def test_real_qwen25_coder_tool_call(native_ext, qwen25_05b_gguf):
    """The real Qwen2.5-Coder-0.5B target, T = 0, a prompt that needs a function: the format comes
    from its template and its answer parses into the call with JSON arguments."""
    from dflash2_gguf import DFlashDecoder
    from dflash2_gguf.chat.templates import chat_prompt_ids, renderer_for

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "What's the weather in Paris right now?"}]
    with DFlashDecoder(qwen25_05b_gguf, None, n_ctx=1024, n_threads=2) as dec:
        fmt = detect_tool_format(renderer_for(dec).template_for(tools))
        res = dec.generate(chat_prompt_ids(dec, msgs, tools=tools), max_tokens=48, temperature=0)
    assert fmt == "hermes"
    r = parse_tool_calls(res.text, fmt, tool_names=["get_weather"], id_factory=_ids())
    assert r.tool_calls == [_call(0, "get_weather", '{"city": "Paris"}')], res.text
