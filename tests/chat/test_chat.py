"""The chat renderer (dflash2_gguf.chat.templates): byte-identical to transformers' rendering for the real
SmolLM2 and Qwen2.5-Coder templates, transformers' Jinja environment, and the token ids llama-server
feeds for a chat."""

from __future__ import annotations

import copy
import json

import pytest

from dflash2_gguf.chat.templates import ChatRenderer, ChatTemplateError, normalize_messages

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city <b>now</b>",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {"name": "time_now", "description": "UTC time",
                                      "parameters": {"type": "object", "properties": {}}}},
]

# (OpenAI-shaped messages as clients send them, the same conversation as transformers expects it)
CONVERSATIONS = {
    "one_user": (
        [{"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "Hi!"}],
    ),
    "system_several_turns": (
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4."},
         {"role": "user", "content": [{"type": "text", "text": "And 3+3?", "cache_control": {"type": "ephemeral"}},
                                      {"type": "text", "text": "Answer with a number."}]}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4."},
         {"role": "user", "content": "And 3+3?\nAnswer with a number."}],
    ),
    "tool_calls_and_results": (
        [{"role": "system", "content": "Use the tools."},
         {"role": "user", "content": "Weather in Paris and Tokyo?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
         {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25C, rain"}]},
         {"role": "assistant", "content": "Paris: 18C and sunny; Tokyo: 25C and rain."},
         {"role": "user", "content": "Thanks! And a café near the Louvre?"}],
        [{"role": "system", "content": "Use the tools."},
         {"role": "user", "content": "Weather in Paris and Tokyo?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
         {"role": "tool", "tool_call_id": "call_2", "content": "25C, rain"},
         {"role": "assistant", "content": "Paris: 18C and sunny; Tokyo: 25C and rain."},
         {"role": "user", "content": "Thanks! And a café near the Louvre?"}],
    ),
}


@pytest.fixture(scope="module")
def renderers(smollm2_gguf, qwen25_05b_gguf):
    return {"smollm2": ChatRenderer.from_gguf(smollm2_gguf), "qwen25": ChatRenderer.from_gguf(qwen25_05b_gguf)}


def _transformers(template, messages, *, tools=None, add_generation_prompt, **kw):
    """transformers' own rendering: the function its apply_chat_template calls."""
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                   add_generation_prompt=add_generation_prompt, **kw)
    return out[0]


@pytest.mark.parametrize("model", ["smollm2", "qwen25"])
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_byte_identical_to_transformers(renderers, model, conv, with_tools, add_generation_prompt):
    r = renderers[model]
    ours_in, hf_in = CONVERSATIONS[conv]
    tools = TOOLS if with_tools else None
    sent = copy.deepcopy(ours_in)
    got = r.render(sent, tools=tools, add_generation_prompt=add_generation_prompt)
    want = _transformers(r.template, hf_in, tools=tools, add_generation_prompt=add_generation_prompt,
                         bos_token=r.bos_token, eos_token=r.eos_token)
    assert got == want
    assert sent == ours_in  # the caller's messages are not modified


def test_real_template_facts(renderers):
    """What the comparison above covers, spelled out on the real templates."""
    smol, qwen = renderers["smollm2"], renderers["qwen25"]
    assert (smol.bos_token, smol.eos_token, smol.add_bos) == ("<|im_start|>", "<|im_end|>", False)
    assert (qwen.bos_token, qwen.eos_token, qwen.add_bos) == ("<|endoftext|>", "<|im_end|>", False)
    msgs = CONVERSATIONS["tool_calls_and_results"][0]
    text = qwen.render(msgs, tools=TOOLS)
    # tools rendered with transformers' tojson (no HTML escaping, non-ASCII kept)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text and "<b>now</b>" in text
    # OpenAI string arguments reached the template as a dict
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n25C, rain" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert smol.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n")


ENV_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
    "{% generation %}[{{ m.role }}]{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{{ documents | tojson }}"
    "{% if enable_thinking is defined %}<think={{ enable_thinking }}>{% endif %}"
    "{% if add_generation_prompt %}<gen>{% endif %}{{ eos_token }}\n"
)


@pytest.mark.parametrize("kw", [{}, {"enable_thinking": False}, {"enable_thinking": True, "bos_token": "<B>"}])
def test_environment_matches_transformers(kw):
    """loopcontrols, {% generation %}, tojson with arguments, documents, template kwargs overriding
    bos/eos, trailing-newline handling: as transformers."""
    r = ChatRenderer(ENV_TEMPLATE, "<s>", "</s>")
    msgs = [{"role": "user", "content": "<a href='x'>é & \"q\"</a>"}, {"role": "stop", "content": ""},
            {"role": "user", "content": "never"}]
    docs = [{"title": "t", "text": "d"}]
    got = r.render(msgs, tools=TOOLS[:1], documents=docs, **kw)
    want = _transformers(ENV_TEMPLATE, msgs, tools=TOOLS[:1], documents=docs, add_generation_prompt=True,
                         **{"bos_token": "<s>", "eos_token": "</s>", **kw})
    assert got == want
    assert "<a href='x'>é & \\\"q\\\"</a>" in got and "never" not in got


def test_errors_name_the_template():
    r = ChatRenderer("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must start with user') }}"
                     "{% endif %}ok", source="tokenizer.chat_template of x.gguf")
    assert r.render([{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="x.gguf refused the conversation: Conversation roles must start"):
        r.render([{"role": "assistant", "content": "a"}])
    with pytest.raises(ChatTemplateError, match=r"cannot compile y.gguf: .*line 1"):
        ChatRenderer("{% for m in messages %}", source="y.gguf")
    with pytest.raises(ChatTemplateError, match="rendering z failed: TypeError"):
        ChatRenderer("{{ 1 + messages[0].content }}", source="z").render([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not JSON"):
        normalize_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(ChatTemplateError, match="content must be"):
        normalize_messages([{"role": "user", "content": 5}])
    with pytest.raises(ChatTemplateError, match="empty"):
        r.render([])
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_message_normalisation():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                              {"type": "text", "text": "b"}]},
            {"role": "assistant"}]
    assert normalize_messages(msgs) == [{"role": "system", "content": "a\nb"}, {"role": "assistant", "content": ""}]


def test_strftime_now_and_chatml_fallback():
    import datetime

    r = ChatRenderer("{{ strftime_now('%Y') }}")
    assert r.render([{"role": "user", "content": "x"}]) == str(datetime.datetime.now().year)
    chatml = ChatRenderer(None)
    assert not chatml.has_template
    assert chatml.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n")


def test_bos_written_by_the_template_is_not_doubled():
    """llama-server drops a template-written BOS when the tokenizer adds one itself."""
    t = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ChatRenderer(t, "<s>", "</s>", add_bos=True).prompt_text([{"role": "user", "content": "x"}]) == "x"
    assert ChatRenderer(t, "<s>", "</s>", add_bos=False).prompt_text([{"role": "user", "content": "x"}]) == "<s>x"


def test_generation_prompt_opens_thinking():
    t = "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
    r = ChatRenderer(t)
    assert r.generation_prompt_opens_thinking([{"role": "user", "content": "x"}], enable_thinking=True)
    assert not r.generation_prompt_opens_thinking([{"role": "user", "content": "x"}], enable_thinking=False)


def _tokenize(gguf, text):
    """llama_tokenize(add_special=True, parse_special=True), what llama-server does with a rendered chat."""
    import llama_cpp as L

    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(gguf).encode(), params)
    try:
        vocab = L.llama_model_get_vocab(model)
        raw = text.encode()
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), True, True)
        return list(buf[:n])
    finally:
        L.llama_model_free(model)


def test_smollm2_gsm8k_prompt_is_llama_servers_87_tokens(smollm2_gguf):
    """Measured with stock llama-server (llama.cpp 0c1e570): it prefills 87 tokens for a GSM8K chat on SmolLM2 where
    libllama's built-in template guess gave 66; the difference is the template's default system
    message. GSM8K test row 30 with the benchmark's math suffix is one such request."""
    from dflash2_gguf import assets
    from dflash2_gguf.bench.cli import format_turns
    from dflash2_gguf.chat.templates import render_builtin

    rows = [json.loads(line) for line in open(assets.fetch("gsm8k-test"), encoding="utf-8")]
    msgs = [{"role": "user", "content": format_turns("gsm8k", rows[30])[0]}]
    r = ChatRenderer.from_gguf(smollm2_gguf)
    ids = _tokenize(smollm2_gguf, r.prompt_text(msgs))
    old = _tokenize(smollm2_gguf, render_builtin(r.template, msgs))
    assert (len(ids), len(old)) == (87, 66)
    sys_ids = _tokenize(smollm2_gguf, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                                      "trained by Hugging Face<|im_end|>\n")
    assert ids == sys_ids + old  # exactly one <|im_start|> (the BOS id) at the start, no doubled BOS
    assert ids[0] == 1 and ids[1] != 1


def test_decoder_uses_the_renderer(native_ext, smollm2_gguf):
    """DFlashDecoder.apply_chat_template / generate(messages=...) / bench render with this renderer."""
    from dflash2_gguf import DFlashDecoder
    from dflash2_gguf.chat.templates import chat_prompt_ids

    msgs = CONVERSATIONS["system_several_turns"][0]
    r = ChatRenderer.from_gguf(smollm2_gguf)
    with DFlashDecoder(smollm2_gguf, None, n_ctx=512, n_threads=1) as dec:
        assert dec.apply_chat_template(msgs) == r.render(msgs)
        assert dec.apply_chat_template(msgs, chat_template_kwargs={"x": 1}, add_generation_prompt=False) == \
            r.render(msgs, add_generation_prompt=False)
        ids = dec._prompt_ids(None, msgs)
        assert ids == chat_prompt_ids(dec, msgs) == _tokenize(smollm2_gguf, r.render(msgs))
        # --no-jinja: libllama's built-in guess (no default system message)
        assert "SmolLM" not in dec.apply_chat_template(msgs[1:], jinja=False)
        # --chat-template TEXT
        assert dec.apply_chat_template(msgs, chat_template="{{ bos_token }}{{ messages | length }}") == "<|im_start|>4"


@pytest.mark.native
@pytest.mark.parametrize("which", ["smollm2", "qwen25"])
def test_renderer_reads_the_loaded_engine(native_ext, smollm2_gguf, qwen25_05b_gguf, monkeypatch, which):
    """A decoder's renderer comes from its loaded engine (the same template, BOS / EOS pieces and
    add flags as the vocabulary-only load of the file), with no second load of the vocabulary."""
    from dflash2_gguf import DFlashDecoder
    from dflash2_gguf.chat import templates

    path = str(smollm2_gguf if which == "smollm2" else qwen25_05b_gguf)
    ref = templates.ChatRenderer.from_gguf(path)

    def second_load(cls, p):
        raise AssertionError(f"the vocabulary of {p} was loaded a second time")

    with DFlashDecoder(path, None, n_ctx=256, n_threads=1) as dec:
        monkeypatch.setattr(templates.ChatRenderer, "from_gguf", classmethod(second_load))
        r = templates.renderer_for(dec)
        ids = templates.chat_prompt_ids(dec, [{"role": "user", "content": "Hi"}])
    got = (r.template, r.tool_use_template, r.bos_token, r.eos_token, r.add_bos, r.add_eos)
    assert got == (ref.template, ref.tool_use_template, ref.bos_token, ref.eos_token, ref.add_bos, ref.add_eos)
    assert r.has_template and len(ids) > 3
