"""The prompt sets: one table for the benchmark and for training capture.

:data:`DATASETS` names each set, where its rows come from (an asset of :mod:`dflash2_gguf.assets`
fetched once and cached, or, for MBPP, a file shipped in the package) and how a row becomes user turns with the DFlash authors' prompt templates (their
``dflash/benchmark.py``: GSM8K and MATH-500 get the "reason step by step ... \\boxed{}" suffix,
HumanEval the "Write a solution ..." prefix around a python fence, MBPP the task text as is,
MT-Bench its two turns). :func:`load_prompts` picks rows as the authors do:
``random.Random(seed).shuffle`` of the row order, then the first ``n``.

``dflash2-gguf bench --dataset NAME`` renders every turn (MT-Bench's second turn follows the
model's first answer); ``dflash2-gguf train capture --prompts NAME`` uses the first turn of each
picked row (:func:`first_turns`). Both then render the user message with the GGUF's chat template
(:mod:`dflash2_gguf.chat.templates`).

A set may also be given as a path: a ``.jsonl`` / ``.jsonl.gz`` file (a name starting with
``mbpp`` gets the MBPP template; any other file is used raw: ``turns`` (list) or the first of
``prompt``/``question``/``problem``/``text``/``instruction``), or any other text file with one
prompt per line.

A leaf module: it imports :mod:`dflash2_gguf.assets` only when an asset is read.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

__all__ = ["DATASETS", "DatasetSpec", "MATH_SUFFIX", "HUMANEVAL_PREFIX", "dataset_spec", "load_rows",
           "format_turns", "load_prompts", "first_turns"]

#: The authors' suffix for GSM8K and MATH-500 questions (appended after a newline).
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
#: The authors' prefix for HumanEval (the problem follows in a python fence).
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n"

_RAW_KEYS = ("prompt", "question", "problem", "text", "instruction")


def _read_jsonl(path: Path) -> list:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_lines(path: Path) -> list:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [{"prompt": line.rstrip("\n")} for line in f if line.strip()]


def _asset_loader(name: str) -> Callable[[], list]:
    def load() -> list:
        from ..assets import fetch

        return _read_jsonl(fetch(name))

    return load


#: MBPP's 974 tasks, shipped in the package (CC-BY-4.0; source and licence in dflash2_gguf/data/README.md).
MBPP_FILE = "mbpp.jsonl.gz"


def _load_mbpp() -> list:
    """``$DFLASH2_GGUF_MBPP`` (another copy of MBPP's jsonl, full or sanitized split) when set, else
    the package's own ``data/mbpp.jsonl.gz``."""
    env = os.environ.get("DFLASH2_GGUF_MBPP")
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(f"mbpp: DFLASH2_GGUF_MBPP={env} is not a file")
        return _read_jsonl(path)
    with resources.files("dflash2_gguf").joinpath("data", MBPP_FILE).open("rb") as raw:
        with gzip.open(raw, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def _mbpp_text(row: dict) -> str:
    # the sanitized split names it "prompt", the full one "text"
    return row["prompt"] if "prompt" in row else row["text"]


def _math_turns(key: str) -> Callable[[dict], list]:
    return lambda r: [r[key] + MATH_SUFFIX]


def _humaneval_turns(row: dict) -> list:
    return [HUMANEVAL_PREFIX + "```python\n" + row["prompt"] + "\n```"]


def _generic_turns(row: dict) -> list:
    if isinstance(row.get("turns"), list):
        return [str(t) for t in row["turns"]]
    for key in _RAW_KEYS:
        if isinstance(row.get(key), str):
            return [row[key]]
    raise ValueError(f"row has none of turns/{'/'.join(_RAW_KEYS)}: {sorted(row)}")


@dataclass(frozen=True)
class DatasetSpec:
    """One prompt set: where its rows come from and how a row becomes user turns.

    Attributes:
        name: Key of :data:`DATASETS` (``bench --dataset``, ``train capture --prompts``).
        load: Returns the rows (dicts) of the set, in file order.
        turns: Row -> list of user messages (one per turn), the authors' template applied.
        source: Where the rows come from (an asset name of :mod:`dflash2_gguf.assets` or a path).
    """

    name: str
    load: Callable[[], list]
    turns: Callable[[dict], list]
    source: str


#: The prompt sets of the DFlash papers with the authors' prompt templates, plus GSM8K's train
#: split (the shipped drafter's training prompts, same template as GSM8K's test split).
DATASETS: dict = {
    d.name: d
    for d in (
        DatasetSpec("gsm8k", _asset_loader("gsm8k-test"), _math_turns("question"), "gsm8k-test"),
        DatasetSpec("math500", _asset_loader("math500"), _math_turns("problem"), "math500"),
        DatasetSpec("humaneval", _asset_loader("humaneval"), _humaneval_turns, "humaneval"),
        DatasetSpec("mbpp", _load_mbpp, lambda r: [_mbpp_text(r)], "dflash2_gguf/data/" + MBPP_FILE),
        DatasetSpec("mt-bench", _asset_loader("mt-bench"), lambda r: list(r["turns"]), "mt-bench"),
        DatasetSpec("gsm8k-train", _asset_loader("gsm8k-train"), _math_turns("question"), "gsm8k-train"),
    )
}


def dataset_spec(dataset: str) -> DatasetSpec:
    """The :class:`DatasetSpec` of a name of :data:`DATASETS` (or the asset name it reads, e.g.
    ``gsm8k-test``) or of a file path (see the module docstring).

    Raises:
        ValueError: neither a known name nor an existing file (the message lists the names).
    """
    if dataset in DATASETS:
        return DATASETS[dataset]
    for spec in DATASETS.values():
        if spec.source == dataset:
            return spec
    p = Path(dataset)
    if not p.is_file():
        raise ValueError(f"unknown dataset {dataset!r}: use one of {', '.join(DATASETS)}, a .jsonl file "
                         "or a text file with one prompt per line")
    if ".jsonl" not in p.name:
        return DatasetSpec(p.stem, lambda: _read_lines(p), lambda r: [r["prompt"]], str(p))
    turns = (lambda r: [_mbpp_text(r)]) if p.name.startswith("mbpp") else _generic_turns
    return DatasetSpec(p.name.split(".jsonl")[0], lambda: _read_jsonl(p), turns, str(p))


def load_rows(dataset: str) -> list:
    """All rows of ``dataset`` (see :func:`dataset_spec`), file order."""
    return dataset_spec(dataset).load()


def format_turns(dataset: str, row: dict) -> list:
    """User turns of one row of ``dataset`` with the authors' template applied."""
    return dataset_spec(dataset).turns(row)


def load_prompts(dataset: str, n_prompts: Optional[int] = None, *, seed: int = 42) -> list:
    """Pick ``n_prompts`` rows as the authors do (``random.Random(seed).shuffle`` of the row order,
    then the first ``n``; None = all) and return their user turns: a list of lists of strings."""
    spec = dataset_spec(dataset)
    rows = spec.load()
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    if n_prompts is not None:
        order = order[: int(n_prompts)]
    return [spec.turns(rows[i]) for i in order]


def first_turns(dataset: str, n_prompts: Optional[int] = None, *, seed: int = 42) -> list:
    """The first user turn of each row :func:`load_prompts` picks (single-turn training prompts)."""
    return [turns[0] for turns in load_prompts(dataset, n_prompts, seed=seed)]
