"""Reasoning split (dflash2_gguf.chat.reasoning): llama-server's --reasoning-format semantics, batch and
streaming equal on random splits, output that starts inside a think block."""

from __future__ import annotations

import random

import pytest

from dflash2_gguf.chat.reasoning import ReasoningParser, split_reasoning

QWEN3 = "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.\n"


def test_formats():
    assert split_reasoning(QWEN3, "deepseek") == ("The user wants 2+2.\nThat is 4.", "The answer is **4**.\n")
    assert split_reasoning(QWEN3, "auto") == ("The user wants 2+2.\nThat is 4.", "The answer is **4**.\n")
    assert split_reasoning(QWEN3, "none") == (None, QWEN3)
    assert split_reasoning(QWEN3, "deepseek-legacy") == ("The user wants 2+2.\nThat is 4.", QWEN3)


def test_edge_cases():
    # no think block: text unchanged, no reasoning
    assert split_reasoning("  Hello <think> not at start", "auto") == (None, "  Hello <think> not at start")
    # the prompt opened the block (generation prompt ends with <think>)
    assert split_reasoning("hmm\n</think>\n\nOK", "auto", starts_in_reasoning=True) == ("hmm", "OK")
    # empty thinking (enable_thinking=False style output)
    assert split_reasoning("<think>\n\n</think>\n\nOK", "auto") == ("", "OK")
    # never closed (cut by max_tokens): all reasoning
    assert split_reasoning("<think>still going ", "auto") == ("still going", "")
    assert split_reasoning("still going", "auto", starts_in_reasoning=True) == ("still going", "")
    # a lone tag prefix at the end is content, not held forever
    assert split_reasoning("<thi", "auto") == (None, "<thi")
    with pytest.raises(ValueError, match="unknown reasoning format"):
        ReasoningParser("r1")


CASES = [
    (QWEN3, "auto", False), (QWEN3, "deepseek-legacy", False), (QWEN3, "none", False),
    ("hmm </thin k> still\n</think>\n\nOK <think>x</think>", "auto", True),
    ("   <think> a  b \n\n c </think>   d  e ", "deepseek", False),
    ("plain answer, no thoughts </think>", "auto", False),
    ("<think>cut here </thi", "auto", False),
]


@pytest.mark.parametrize("text,fmt,opened", CASES)
def test_streaming_equals_batch(text, fmt, opened):
    want = split_reasoning(text, fmt, starts_in_reasoning=opened)
    rng = random.Random(99)
    for _ in range(80):
        p = ReasoningParser(fmt, starts_in_reasoning=opened)
        deltas, i = [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            deltas += p.feed(text[i:i + k])
            i += k
        deltas += p.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        assert (reasoning if want[0] is not None else None, content) == want
        assert (p.reasoning, p.content) == want
        if fmt in ("auto", "deepseek"):
            # reasoning is streamed before the content
            kinds = [("r" if "reasoning_content" in d else "c") for d in deltas]
            assert "".join(kinds) == "r" * kinds.count("r") + "c" * kinds.count("c")
