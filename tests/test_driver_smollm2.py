"""T = 0 on the real SmolLM2-135M-Instruct (llama arch): with random v1 and v2 drafters
converted by our converter, the output is token-for-token the target alone through llama.cpp
(``llama_cpp.Llama`` greedy, an independent code path).

The target is the pinned Q4_1 file dequantized to F32 (the same weights; fixture
``smollm2_f32_gguf``). With the Q4_1 file itself, libllama's CPU kernels give a batched pass
(the verification of [anchor, drafts]) different low-order bits than a one-token decode: on
"def fibonacci(n):" token 14 the batched logits rank 304 first (21.59 vs 21.19) while one-token
decodes rank 2822 first, so ANY batched verifier (upstream's included) departs from one-token
greedy decoding there. With F32 weights batched and one-token passes agree up to float
summation order (~4e-4 on logits of ~22): in the 20 x 128 run one prompt meets a near-tie (top-2
gap 1.3e-3 one-token, 3.3e-4 batched) and flips. The check is therefore token-for-token, with a
divergence allowed only at such a reference near-tie (gap < 0.01, our token = its runner-up),
after which the prompt stops being compared; at most 4 of the 40 runs may flip. EOG tokens are ignored on both sides so
every prompt yields exactly ``n`` tokens. Flash attention is off on both sides: llama.cpp's
CPU flash-attention kernel and the plain one differ in the last bits, which flips near-ties
(observed: prompt 0, token 14, with FA auto-enabled in our context and off in Llama's).

The full check (20 prompts x 128 new tokens, both drafter versions) is ``slow``; a 3-prompt
subset runs by default.
"""

from __future__ import annotations

import numpy as np
import pytest


pytestmark = pytest.mark.native

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain photosynthesis in simple terms.",
    "Once upon a time, in a small village,",
    "List three benefits of regular exercise:",
    "The quick brown fox",
    "How do I make a cup of tea?",
    "In 1969, the first humans",
    "Translate 'good morning' into Spanish:",
    "What is the difference between a list and a tuple in Python?",
    "The most important thing about machine learning is",
    "import numpy as np\n\n# compute the mean of an array\n",
    "Dear customer, thank you for",
    "Here is a recipe for pancakes:",
    "Q: What is 12 times 7?\nA:",
    "The history of the Roman Empire",
    "Why is the sky blue?",
    "SELECT name, age FROM users WHERE",
    "My favourite book is",
]


NEAR_TIE = 0.01  # logits; SmolLM2's top logits are ~20


def _llama_cpp_greedy(llm, ids, n):
    """Greedy tokens of llama_cpp.Llama (one-token decodes) and the logits that chose each."""
    out = []
    llm.reset()
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
        out.append(int(tok))
        if len(out) == n:
            break
    scores = np.array(llm.scores[len(ids) - 1: len(ids) - 1 + n])
    return out, scores


def _compare(ours, ref, ref_scores, where):
    """Token-for-token equality; a divergence is tolerated only at a numerical near-tie of the
    reference (top-2 gap < NEAR_TIE and our token is its runner-up), after which the two
    sequences legitimately differ. Returns 1 if such a tie-flip happened, else 0."""
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        top = np.argsort(-ref_scores[j])[:2]
        gap = float(ref_scores[j][top[0]] - ref_scores[j][top[1]])
        assert a == int(top[1]) and gap < NEAR_TIE, (
            f"{where}: token {j}: ours {a}, llama.cpp {b} (top-2 {top.tolist()}, gap {gap:.4g})")
        print(f"{where}: near-tie flip at token {j} (gap {gap:.2e})")
        return 1
    assert len(ours) == len(ref)
    return 0


def _check(smollm2_gguf, drafters, prompts, n_new, n_draft_max_cycle=(None,), max_flips=0):
    import llama_cpp

    from dflash2_gguf import DFlashDecoder, SamplingParams

    llm = llama_cpp.Llama(str(smollm2_gguf), n_ctx=512, n_threads=2, flash_attn=False, logits_all=True,
                          verbose=False)
    greedy = SamplingParams.greedy_params()
    flips = 0
    with DFlashDecoder(smollm2_gguf, drafters[1], n_ctx=512, n_threads=2, flash_attn=False) as d1, \
         DFlashDecoder(smollm2_gguf, drafters[2], n_ctx=512, n_threads=2, flash_attn=False) as d2:
        for i, text in enumerate(prompts):
            ids = d1.tokenize(text)
            ref, ref_scores = _llama_cpp_greedy(llm, ids, n_new)
            for dec in (d1, d2):
                nmax = n_draft_max_cycle[i % len(n_draft_max_cycle)]
                r = dec.generate(ids, max_tokens=n_new, sampling=greedy, n_draft_max=nmax, ignore_eos=True)
                assert len(r.tokens) == n_new and r.stats.n_drafted > 0
                flips += _compare(r.tokens, ref, ref_scores, f"prompt {i} ({text!r}), drafter v{dec.drafter_version}")
    print(f"{len(prompts)} prompts x 2 drafters x {n_new} tokens: {flips} near-tie flips")
    assert flips <= max_flips


def test_greedy_equals_llama_cpp_quick(native_ext, smollm2_f32_gguf, smollm2_drafters):
    _check(smollm2_f32_gguf, smollm2_drafters, PROMPTS[:2], 32, (None, 3))


@pytest.mark.slow
def test_greedy_equals_llama_cpp_20_prompts_128_tokens(native_ext, smollm2_f32_gguf, smollm2_drafters):
    assert len(PROMPTS) >= 20
    _check(smollm2_f32_gguf, smollm2_drafters, PROMPTS, 128, (None, 3, 1), max_flips=4)
