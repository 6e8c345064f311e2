"""Penalties, logit bias, grammars and logprobs stay exact under speculative decoding (T = 0).

The real SmolLM2-135M-Instruct target with the shipped DFlash 2 drafter, chat prompts, flash
attention on, every context within 256 cells (where a batched verify row and a one-token decode
give the same logits bit for bit: tests/native/test_driver_smollm2.py's docstring):

- 10 prompts x 40 tokens: with presence 1.5 / frequency 0.5 / repeat 1.3 / a logit bias / a JSON-schema grammar, the
  text with the drafter is the text without it, token for token, and each setting changes the
  text relative to plain greedy decoding (a setting the driver ignored would fail that);
- the penalties also equal ``llama_cpp.Llama``'s (its sampler counts generated tokens only:
  ``penalize_prompt=False``; its window is ``last_n_tokens_size`` = 64 = our default);
- logprobs are the same with and without the drafter;
- with a JSON schema and the drafter on, every output parses and validates (``jsonschema``).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytestmark = pytest.mark.native

SHIPPED = "models/smollm2-135m-dflash2.gguf"
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in simple terms.",
    "List three benefits of regular exercise.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is 12 times 7? Explain.",
    "Describe the water cycle.",
    "Who was Ada Lovelace?",
    "Tell me a fun fact about octopuses.",
]
N_NEW = 40
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def shipped(native_ext, smollm2_gguf):
    from pathlib import Path

    from dflash2_gguf import DFlashDecoder

    path = Path(__file__).resolve().parents[2] / SHIPPED
    from tiny_models import FLAT_COSTS

    with DFlashDecoder(smollm2_gguf, path, n_ctx=512, n_threads=2, flash_attn=True, cost_model=FLAT_COSTS) as dec:
        yield dec


def _ids(dec, q):
    from dflash2_gguf.chat.templates import chat_prompt_ids

    ids = chat_prompt_ids(dec, [{"role": "user", "content": q}])
    assert len(ids) + N_NEW <= 256, "keep every context within 256 cells (see the module docstring)"
    return ids


def _settings():
    from dflash2_gguf.chat.grammar import json_schema_to_grammar

    return {
        "presence 1.5": dict(presence_penalty=1.5),
        "frequency 0.5": dict(frequency_penalty=0.5),
        "repeat 1.3": dict(repeat_penalty=1.3),
        "logit bias": None,  # filled in from the plain texts (ban their most frequent token)
        "json schema": dict(grammar=json_schema_to_grammar(PERSON)),
    }


def _equal_with_and_without_drafter(dec, prompts, n_settings=None):
    from collections import Counter

    from dflash2_gguf import SamplingParams

    greedy = SamplingParams.greedy_params()
    ids = [_ids(dec, q) for q in prompts]
    plain = [dec.generate(i, max_tokens=N_NEW, sampling=greedy, ignore_eos=True, cache_prompt=False).tokens for i in ids]
    settings = _settings()
    common = Counter(t for toks in plain for t in toks).most_common(1)[0][0]
    settings["logit bias"] = dict(logit_bias={common: -float("inf")})
    outputs = {}
    for name, kw in list(settings.items())[:n_settings]:
        sp = dataclasses.replace(greedy, **kw)
        changed = 0
        outputs[name] = []
        for i, base in zip(ids, plain):
            on = dec.generate(i, max_tokens=N_NEW, sampling=sp, cache_prompt=False)
            off = dec.generate(i, max_tokens=N_NEW, sampling=sp, cache_prompt=False, use_drafter=False)
            j = next((j for j, (a, b) in enumerate(zip(on.tokens, off.tokens)) if a != b), None)
            assert j is None and len(on.tokens) == len(off.tokens), (name, j, on.tokens, off.tokens)
            assert on.stats.n_drafted > 0
            changed += on.tokens[: len(base)] != base[: len(on.tokens)] or len(on.tokens) < len(base)
            outputs[name].append(on)
        # a setting that the driver ignored would leave every text as plain greedy decoding
        assert changed >= max(1, len(prompts) // 2), f"{name} changed only {changed} of {len(prompts)} texts"
    return ids, outputs


def test_settings_exact_with_drafter_quick(shipped):
    _equal_with_and_without_drafter(shipped, QUESTIONS[:2])


@pytest.mark.slow
def test_settings_exact_with_drafter_10_prompts(shipped):
    ids, outputs = _equal_with_and_without_drafter(shipped, QUESTIONS[:10])
    for r in outputs["json schema"]:
        assert r.text.lstrip().startswith("{")


@pytest.mark.slow
def test_penalties_equal_llama_cpp(shipped, smollm2_gguf):
    """Our penalties are llama.cpp's: same tokens as ``llama_cpp.Llama`` (prompt tokens outside
    the window, as in its ``create_completion``), with the drafter on."""
    import llama_cpp

    from dflash2_gguf import SamplingParams

    llm = llama_cpp.Llama(str(smollm2_gguf), n_ctx=512, n_threads=2, n_threads_batch=2, flash_attn=True,
                          verbose=False)
    greedy = dataclasses.replace(SamplingParams.greedy_params(), penalize_prompt=False)
    for kw in (dict(presence_penalty=1.5), dict(presence_penalty=1.5, frequency_penalty=0.5, repeat_penalty=1.3)):
        sp = dataclasses.replace(greedy, **kw)
        for q in QUESTIONS[:10]:
            ids = _ids(shipped, q)
            ref = []
            llm.reset()
            for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True,
                                    repeat_penalty=sp.repeat_penalty, frequency_penalty=sp.frequency_penalty,
                                    presence_penalty=sp.presence_penalty):
                ref.append(int(tok))
                if len(ref) == N_NEW:
                    break
            ours = shipped.generate(ids, max_tokens=N_NEW, sampling=sp, ignore_eos=True, cache_prompt=False).tokens
            j = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            assert j is None, (kw, q, j, ours[j:j + 4], ref[j:j + 4])


def test_logprobs_equal_with_and_without_drafter(shipped):
    from dflash2_gguf import SamplingParams

    sp = dataclasses.replace(SamplingParams.greedy_params(), n_probs=3, presence_penalty=1.5)
    ids = _ids(shipped, QUESTIONS[0])
    on = shipped.generate(ids, max_tokens=24, sampling=sp, cache_prompt=False)
    off = shipped.generate(ids, max_tokens=24, sampling=sp, cache_prompt=False, use_drafter=False)
    assert on.stats.n_accepted > 0 and on.tokens == off.tokens
    assert len(on.logprobs) == len(on.tokens)
    for a, b, t in zip(on.logprobs, off.logprobs, on.tokens):
        assert a.token == t and b.token == t
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [x for x, _ in a.top] == [x for x, _ in b.top]
        # greedy under presence penalty: the committed token is the top of the processed distribution
        assert a.top[0][0] == t and a.top[0][1] == pytest.approx(a.logprob) and a.logprob <= 0
    # under a grammar the alternatives are the tokens it allows, never a banned one at -inf (JSON
    # cannot carry -inf: the server failed on it): after "yes"/"no" only end-of-generation tokens
    g = dataclasses.replace(sp, n_probs=5, grammar='root ::= "yes" | "no"')
    r = shipped.generate(ids, max_tokens=6, sampling=g, cache_prompt=False)
    assert r.finish_reason == "eog" and r.text in ("yes", "no")
    assert all(np.isfinite(v) for lp in r.logprobs for _, v in lp.top)
    last = r.logprobs[-1].top
    assert r.tokens[-1] in [t for t, _ in last] and len(last) < 5


@pytest.mark.slow
def test_json_schema_outputs_validate(shipped):
    """10 prompts, drafter on, T = 0 and T = 0.7: every output is JSON valid under the schema."""
    import jsonschema

    from dflash2_gguf import SamplingParams
    from dflash2_gguf.chat.grammar import json_schema_to_grammar

    g = json_schema_to_grammar(PERSON)
    prompts = [f"Invent a person and describe them as JSON (name, age, city). Person number {i}." for i in range(5)]
    prompts += [q + " Answer as JSON with name, age and city." for q in QUESTIONS[:5]]
    for i, q in enumerate(prompts):
        temp = 0.0 if i % 2 == 0 else 0.7
        sp = SamplingParams(temperature=temp, top_k=40, top_p=0.95, min_p=0.05, seed=i, grammar=g)
        r = shipped.generate(messages=[{"role": "user", "content": q}], max_tokens=160, sampling=sp)
        assert r.finish_reason == "eog", (q, r.text)
        jsonschema.validate(json.loads(r.text), PERSON)
