"""Prompt cache: a later turn prefills only its new tokens, with the cold run's text and tau.

The real SmolLM2-135M-Instruct target with the shipped drafter, T = 0. Both decoders prefill in
chunks of 32 rows (``n_batch=32``): ggml's CPU flash attention switches to a tiled kernel from
64 query rows on, so a cold prefill of a whole transcript and a cached one that prefills only
the new tail would otherwise evaluate the same rows with different kernels (README, "Exactness at
T = 0": the comparison is made under the same batch schedule). Every context stays within 256
cells.

- 3-turn chat, each turn the previous transcript plus a new user message: the reused prefix is
  exactly the common prefix of the new prompt with the tokens the decoder holds (the previous
  prompt and output), so only the new tokens are prefilled; the text equals a cold run's
  (``cache_prompt=False``) and the acceptance length is within 5% of it (it is equal: the
  drafter's features of the cached prefix are the ones a cold prefill computes).
- the same prompt twice: a full-prefix hit still evaluates the last prompt token (same text).
- a short unrelated prompt after a long one equals its cold run.
- a side request between two turns does not evict the conversation when the RAM cache holds
  both (restored from RAM, same text as cold); with the RAM cache off it is evicted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.native

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-dflash2.gguf"
TURNS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell?",
    "And if she sold 10 more in June?",
    "Write the total as a number.",
]
N_NEW = 32


def _decoder(smollm2_gguf, **kw):
    from dflash2_gguf import DFlashDecoder

    from tiny_models import FLAT_COSTS

    # the DFlash drafter alone: ngram-mod's pool would hold the warm run's output when the cold
    # run repeats the request (context drafts and the prompt cache: tests/native/test_driver_hybrid.py)
    kw.setdefault("spec_type", "draft-dflash")
    return DFlashDecoder(smollm2_gguf, SHIPPED, n_ctx=512, n_threads=2, n_batch=32, flash_attn=True,
                         cost_model=FLAT_COSTS, **kw)


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_three_turn_chat_prefills_only_new_tokens(native_ext, smollm2_gguf):
    from dflash2_gguf import SamplingParams
    from dflash2_gguf.chat.templates import chat_prompt_ids

    greedy = SamplingParams.greedy_params()
    with _decoder(smollm2_gguf) as dec:
        msgs = []
        held = []  # tokens the decoder holds after a generation: prompt + output minus the last token
        for i, user in enumerate(TURNS):
            msgs.append({"role": "user", "content": user})
            ids = chat_prompt_ids(dec, msgs)
            assert len(ids) + N_NEW <= 256
            warm = dec.generate(ids, max_tokens=N_NEW, sampling=greedy)
            expect = min(_lcp(held, ids), len(ids) - 1)
            assert warm.stats.n_cached == expect, (i, warm.stats.n_cached, expect)
            if i > 0:  # the previous transcript is reused: only the new turn's tokens are prefilled
                assert expect >= len(held) - 8, (expect, len(held))
                assert warm.stats.n_prompt - warm.stats.n_cached < 40
            cold = dec.generate(ids, max_tokens=N_NEW, sampling=greedy, cache_prompt=False)
            assert cold.stats.n_cached == 0
            assert warm.tokens == cold.tokens, i
            assert warm.stats.acceptance_length == pytest.approx(cold.stats.acceptance_length, rel=0.05)
            # the cold run left the same transcript in the caches
            held = ids + cold.tokens[:-1]
            msgs.append({"role": "assistant", "content": cold.text})

        # the same prompt again: everything but the last prompt token is reused
        again = dec.generate(ids, max_tokens=N_NEW, sampling=greedy)
        assert again.stats.n_cached == len(ids) - 1 and again.tokens == cold.tokens

        # a short unrelated prompt after the long one
        short = dec.tokenize("The capital of France is")
        warm = dec.generate(short, max_tokens=N_NEW, sampling=greedy)
        cold = dec.generate(short, max_tokens=N_NEW, sampling=greedy, cache_prompt=False)
        assert warm.stats.n_cached <= 1 and warm.tokens == cold.tokens


@pytest.mark.parametrize("ram_mib", [64, 0])
def test_side_request_does_not_evict_the_conversation(native_ext, smollm2_gguf, ram_mib):
    from dflash2_gguf import SamplingParams
    from dflash2_gguf.chat.templates import chat_prompt_ids

    greedy = SamplingParams.greedy_params()
    with _decoder(smollm2_gguf, cache_ram_mib=ram_mib) as dec:
        msgs = [{"role": "user", "content": TURNS[0]}]
        first = dec.generate(messages=msgs, max_tokens=N_NEW, sampling=greedy)
        msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": TURNS[1]}]
        turn2 = chat_prompt_ids(dec, msgs)
        # an agent's side request: a short title prompt sharing nothing but the template's opening
        side = dec.generate(messages=[{"role": "user", "content": "Title for: clips"}], max_tokens=8, sampling=greedy)
        assert side.stats.n_cached < 40
        warm = dec.generate(turn2, max_tokens=N_NEW, sampling=greedy)
        cold = dec.generate(turn2, max_tokens=N_NEW, sampling=greedy, cache_prompt=False)
        assert warm.tokens == cold.tokens
        if ram_mib:
            assert warm.stats.n_cache_restored > 60 and warm.stats.n_cached == warm.stats.n_cache_restored
            assert warm.stats.n_prompt - warm.stats.n_cached < 40
            assert dec.engine.prompt_cache_info()["entries"] >= 1
        else:  # negative control: without the RAM cache the conversation was evicted
            assert warm.stats.n_cache_restored == 0 and warm.stats.n_cached < 40
