"""The training prompt mix: prompt families disjoint from every benchmark set.

Families (each row's first user turn, with the DFlash authors' template of its set,
:mod:`dflash2_gguf.prompt_sets`):

- ``math``: all 7473 GSM8K-train questions (asset ``gsm8k-train``);
- ``code``: MBPP's train and validation tasks (task ids 601-974 and 511-600 of the original
  release's split, Austin et al. 2021; never the test tasks 11-510 nor the few-shot prompts 1-10).

Not yet in the mix: general chat / instruction prompts (issue 15 asks for a registry package
that ships them; none was found yet) and further code-instruction sets.

Never in the mix: any row of a benchmark set (:data:`BENCHMARK_SETS`: GSM8K test, MATH-500,
HumanEval, MBPP's test tasks, MT-Bench). :func:`benchmark_overlap` compares texts after
whitespace and case folding; :func:`prompt_mix` drops a row that matches (MBPP has a few tasks
whose text repeats across its splits) and the tests assert that nothing is left.

The order is ``random.Random(seed).shuffle`` of all families together (as the benchmark picks
rows), so any prefix of the mix (``--limit``) keeps the families' proportions.
"""

from __future__ import annotations

import random
import re
from typing import Iterable, Optional

__all__ = ["FAMILIES", "MBPP_TRAIN_TASK_IDS", "MBPP_TEST_TASK_IDS", "BENCHMARK_SETS", "family_prompts",
           "benchmark_texts", "benchmark_overlap", "prompt_mix"]

#: MBPP's split by task id (the original release; Hugging Face ``mbpp`` "full" config).
MBPP_TEST_TASK_IDS = range(11, 511)
MBPP_TRAIN_TASK_IDS = tuple(range(511, 601)) + tuple(range(601, 975))  # validation + train

#: The benchmark sets the mix must never touch: prompt_sets names (MBPP: its test tasks).
BENCHMARK_SETS = ("gsm8k", "math500", "humaneval", "mbpp-test", "mt-bench")

FAMILIES = ("math", "code")


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _mbpp_rows(task_ids: Iterable[int]) -> list:
    from ..prompt_sets import load_rows

    keep = set(task_ids)
    return [r for r in load_rows("mbpp") if int(r["task_id"]) in keep]


def family_prompts(family: str) -> list:
    """The first user turns of one family, file order (see the module docstring)."""
    from ..prompt_sets import format_turns, load_rows

    if family == "math":
        return [format_turns("gsm8k-train", r)[0] for r in load_rows("gsm8k-train")]
    if family == "code":
        return [format_turns("mbpp", r)[0] for r in _mbpp_rows(MBPP_TRAIN_TASK_IDS)]
    raise ValueError(f"unknown prompt family {family!r}: use one of {', '.join(FAMILIES)}")


def benchmark_texts() -> set:
    """Every user turn of every benchmark set (:data:`BENCHMARK_SETS`), whitespace and case
    folded, with and without the authors' templates (the raw question / task text too)."""
    from ..prompt_sets import format_turns, load_rows

    out = set()
    for name in BENCHMARK_SETS:
        rows = _mbpp_rows(MBPP_TEST_TASK_IDS) if name == "mbpp-test" else load_rows(name)
        spec = "mbpp" if name == "mbpp-test" else name
        for r in rows:
            for turn in format_turns(spec, r):
                out.add(_norm(turn))
            for key in ("question", "problem", "prompt", "text"):
                if isinstance(r.get(key), str):
                    out.add(_norm(r[key]))
    return out


def benchmark_overlap(prompts: Iterable[str], bench: Optional[set] = None) -> list:
    """The prompts whose text (folded as :func:`benchmark_texts`) is a benchmark set's."""
    bench = benchmark_texts() if bench is None else bench
    return [p for p in prompts if _norm(p) in bench]


def prompt_mix(families: Iterable[str] = FAMILIES, *, seed: int = 42) -> list:
    """``(family, prompt)`` pairs of the mix, shuffled together with ``random.Random(seed)``;
    rows whose text is a benchmark set's are dropped."""
    bench = benchmark_texts()
    pairs = [(f, p) for f in families for p in family_prompts(f) if _norm(p) not in bench]
    random.Random(seed).shuffle(pairs)
    return pairs
