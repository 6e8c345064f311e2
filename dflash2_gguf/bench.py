"""Benchmark: acceptance length and speedup of a drafter on real prompt sets.

``dflash2-gguf bench -m TARGET.gguf -md DRAFT.gguf --dataset gsm8k --n-prompts 20`` runs, for
each prompt, the target alone and the target with the drafter through the SAME decoder object and
the same native loop (``use_drafter=False`` / ``True``), after a warmup of both. It reports (as
the DFlash papers do, after the authors' ``dflash/benchmark.py``):

- mean acceptance length tau: tokens committed per target verification pass, bonus included,
  averaged per request (= one generation; an MT-Bench question is two requests) and then over
  requests;
- a histogram of the tokens committed per pass (1 .. block size);
- per-position conditional acceptance: P(draft i accepted | drafts 0..i-1 accepted and draft i
  verified), pooled over all requests;
- tokens/s of both runs and the speedup = time per output token without / with the drafter;
- at T = 0, the number of requests whose tokens differ between the two runs (must be 0).

Prompts come from :data:`DATASETS` (the authors' prompt templates, rendered with the target's
chat template; MT-Bench is multi-turn: the second turn follows the model's first answer) and are
picked with ``random.Random(42).shuffle`` as the authors do. Results go to ``--out``:
``bench.json``, ``bench.md`` and ``per_position_acceptance.png``.

Optional side-by-side runs (``--upstream``, ``--prompt-lookup``) use
:mod:`benchmarks.upstream_driver` (upstream's ``llama-speculative-simple`` / ``llama-completion``
of llama.cpp 0c1e570, llama-cpp-python's prompt-lookup decoding); they need the repository's
``benchmarks`` package on the import path.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .chat import chat_prompt_ids

__all__ = [
    "DATASETS", "DatasetSpec", "load_rows", "load_prompts", "format_turns", "committed_per_pass",
    "RequestResult", "summarize", "markdown_table", "plot_per_position", "run_bench", "add_bench_args",
    "run_from_args",
]

# ---------------------------------------------------------------------------- datasets

_MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n"


def _read_jsonl(path: Path) -> list:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _asset_loader(name: str) -> Callable[[], list]:
    def load() -> list:
        from .assets import fetch

        return _read_jsonl(fetch(name))

    return load


def _mbpp_default_path() -> Path:
    """``$DFLASH2_GGUF_MBPP``, else ``../shared/data/mbpp.jsonl`` next to the repository
    (where CI puts it), else ``/work/shared/data/mbpp.jsonl``."""
    env = os.environ.get("DFLASH2_GGUF_MBPP")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parent.parent
    for cand in (repo.parent / "shared" / "data" / "mbpp.jsonl", Path("/work/shared/data/mbpp.jsonl")):
        if cand.is_file():
            return cand
    return repo.parent / "shared" / "data" / "mbpp.jsonl"


def _mbpp_text(row: dict) -> str:
    # the sanitized split names it "prompt", the full one "text"
    return row["prompt"] if "prompt" in row else row["text"]


@dataclass(frozen=True)
class DatasetSpec:
    """One prompt set: where its rows come from and how a row becomes user turns.

    Attributes:
        name: Key of :data:`DATASETS` (``--dataset``).
        load: Returns the rows (dicts) of the set, in file order.
        turns: Row -> list of user messages (one per turn), the authors' template applied.
        source: Where the rows come from (an asset name of :mod:`dflash2_gguf.assets` or a path).
    """

    name: str
    load: Callable[[], list]
    turns: Callable[[dict], list]
    source: str


#: The prompt sets of the DFlash papers, with the authors' prompt templates (ASSETS.md).
DATASETS: dict = {
    d.name: d
    for d in (
        DatasetSpec("gsm8k", _asset_loader("gsm8k-test"), lambda r: [r["question"] + _MATH_SUFFIX], "gsm8k-test"),
        DatasetSpec("math500", _asset_loader("math500"), lambda r: [r["problem"] + _MATH_SUFFIX], "math500"),
        DatasetSpec("humaneval", _asset_loader("humaneval"),
                    lambda r: [_HUMANEVAL_PREFIX + "```python\n" + r["prompt"] + "\n```"], "humaneval"),
        DatasetSpec("mbpp", lambda: _read_jsonl(_mbpp_default_path()), lambda r: [_mbpp_text(r)],
                    "../shared/data/mbpp.jsonl"),
        DatasetSpec("mt-bench", _asset_loader("mt-bench"), lambda r: list(r["turns"]), "mt-bench"),
    )
}


def _generic_turns(row: dict) -> list:
    if isinstance(row.get("turns"), list):
        return [str(t) for t in row["turns"]]
    for key in ("prompt", "question", "problem", "text", "instruction"):
        if isinstance(row.get(key), str):
            return [row[key]]
    raise ValueError(f"row has none of turns/prompt/question/problem/text/instruction: {sorted(row)}")


def _spec_for(dataset: str) -> DatasetSpec:
    """The :class:`DatasetSpec` of a name of :data:`DATASETS` or of a ``.jsonl[.gz]`` path.

    A file whose name starts with ``mbpp`` gets the MBPP template (the task text as is); any other
    file is used raw: ``turns`` (list) or the first of ``prompt``/``question``/``problem``/
    ``text``/``instruction``, no template.
    """
    if dataset in DATASETS:
        return DATASETS[dataset]
    p = Path(dataset)
    if not p.is_file():
        raise ValueError(f"unknown dataset {dataset!r}: use one of {', '.join(DATASETS)} or a .jsonl file")
    turns = (lambda r: [_mbpp_text(r)]) if p.name.startswith("mbpp") else _generic_turns
    return DatasetSpec(p.stem, lambda: _read_jsonl(p), turns, str(p))


def load_rows(dataset: str) -> list:
    """All rows of ``dataset`` (a :data:`DATASETS` key or a ``.jsonl[.gz]`` path), file order."""
    return _spec_for(dataset).load()


def format_turns(dataset: str, row: dict) -> list:
    """User turns of one row of ``dataset`` with the authors' template applied."""
    return _spec_for(dataset).turns(row)


def load_prompts(dataset: str, n_prompts: Optional[int] = None, *, seed: int = 42) -> list:
    """Pick ``n_prompts`` rows as the authors do (``random.Random(seed).shuffle`` of the row order,
    then the first ``n``) and return their user turns: a list of lists of strings."""
    spec = _spec_for(dataset)
    rows = spec.load()
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    if n_prompts is not None:
        order = order[: int(n_prompts)]
    return [spec.turns(rows[i]) for i in order]


# ---------------------------------------------------------------------------- statistics

def committed_per_pass(from_draft: Sequence[bool]) -> list:
    """Tokens committed by each verification pass, read from a result's ``from_draft`` flags.

    The first token comes from the prefill; each pass then commits its accepted drafts (True)
    and the target's own token (False). A last pass cut short by the budget, EOG or a stop
    string may end on drafts without its own token.
    """
    out, run = [], 0
    for fd in list(from_draft)[1:]:
        if fd:
            run += 1
        else:
            out.append(run + 1)
            run = 0
    if run:
        out.append(run)
    return out


@dataclass
class RequestResult:
    """One request (one generation = one turn) run with and without the drafter.

    Attributes:
        prompt_index / turn: Which prompt (in pick order) and which of its turns.
        n_prompt: Prompt tokens.
        base / spec: Per run: ``n_generated``, ``t_total_s``, ``t_prefill_s``, ``tokens_per_second``,
            ``decode_tokens_per_second``, ``stop_reason``; spec also ``n_cycles``, ``n_drafted``,
            ``n_accepted``, ``acceptance_length``, ``pos_reached``, ``pos_accepted``, ``committed``
            (tokens per pass).
        tokens_equal: Both runs produced the same tokens.
        first_mismatch: Index of the first differing token (None when equal).
    """

    prompt_index: int
    turn: int
    n_prompt: int
    base: dict
    spec: dict
    tokens_equal: bool
    first_mismatch: Optional[int]


def _run_dict(res, with_spec: bool) -> dict:
    st = res.stats
    d = dict(n_generated=st.n_generated, t_total_s=st.t_total_s, t_prefill_s=st.t_prefill_s,
             tokens_per_second=st.tokens_per_second, decode_tokens_per_second=st.decode_tokens_per_second,
             stop_reason=st.stop_reason, n_cycles=st.n_cycles)
    if not with_spec:
        d["text"] = res.text
    else:
        d.update(n_drafted=st.n_drafted, n_accepted=st.n_accepted, acceptance_length=st.acceptance_length,
                 pos_reached=list(st.pos_reached), pos_accepted=list(st.pos_accepted),
                 committed=committed_per_pass(res.from_draft), t_target_s=st.t_target_s,
                 t_draft_s=st.t_draft_s, t_inject_s=st.t_inject_s, t_sample_s=st.t_sample_s)
    return d


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summarize(requests: Sequence[RequestResult], block_size: int) -> dict:
    """Pool per-request results into the figures of the report.

    Returns a dict with ``n_requests``, ``acceptance_length`` (mean over requests of each
    request's tau), ``acceptance_length_pooled`` (all committed tokens / all passes),
    ``acceptance_histogram`` (``{committed: passes}`` for 1..block_size), ``per_position_acceptance``,
    ``pos_reached``/``pos_accepted``, tokens/s of both runs (``*_tokens_per_second``: all tokens /
    all time, prefill included; ``*_decode_tokens_per_second``: prefill excluded), ``speedup``
    and ``decode_speedup`` (time per output token without / with the drafter), and the T=0
    check ``mismatches`` (requests whose tokens differ).
    """
    n_pos = max(block_size - 1, max((len(r.spec["pos_reached"]) for r in requests), default=0))
    reached, accepted = [0] * n_pos, [0] * n_pos
    hist = {k: 0 for k in range(1, max(block_size, 1) + 1)}
    taus = []
    for r in requests:
        s = r.spec
        if s["n_cycles"]:
            taus.append(s["acceptance_length"])
        for i, (a, b) in enumerate(zip(s["pos_accepted"], s["pos_reached"])):
            accepted[i] += a
            reached[i] += b
        for c in s["committed"]:
            hist[c] = hist.get(c, 0) + 1

    def agg(key: str) -> dict:
        n = sum(r.__dict__[key]["n_generated"] for r in requests)
        t = sum(r.__dict__[key]["t_total_s"] for r in requests)
        n_dec = sum(r.__dict__[key]["n_generated"] - 1 for r in requests)
        t_dec = sum(r.__dict__[key]["t_total_s"] - r.__dict__[key]["t_prefill_s"] for r in requests)
        return dict(n=n, t=t, n_dec=n_dec, t_dec=t_dec)

    b, s = agg("base"), agg("spec")
    passes = sum(r.spec["n_cycles"] for r in requests)
    committed = sum(sum(r.spec["committed"]) for r in requests)
    return {
        "n_requests": len(requests),
        "acceptance_length": (sum(taus) / len(taus)) if taus else float("nan"),
        "acceptance_length_pooled": _ratio(committed, passes),
        "acceptance_histogram": hist,
        "per_position_acceptance": [(a / r) if r else float("nan") for a, r in zip(accepted, reached)],
        "pos_reached": reached,
        "pos_accepted": accepted,
        "n_cycles": passes,
        "n_drafted": sum(r.spec["n_drafted"] for r in requests),
        "n_accepted": sum(r.spec["n_accepted"] for r in requests),
        "base_tokens": b["n"], "spec_tokens": s["n"],
        "base_tokens_per_second": _ratio(b["n"], b["t"]),
        "spec_tokens_per_second": _ratio(s["n"], s["t"]),
        "base_decode_tokens_per_second": _ratio(b["n_dec"], b["t_dec"]),
        "spec_decode_tokens_per_second": _ratio(s["n_dec"], s["t_dec"]),
        "speedup": _ratio(_ratio(b["t"], b["n"]), _ratio(s["t"], s["n"])),
        "decode_speedup": _ratio(_ratio(b["t_dec"], b["n_dec"]), _ratio(s["t_dec"], s["n_dec"])),
        "mismatches": sum(0 if r.tokens_equal else 1 for r in requests),
    }


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_nan_to_none(v) for v in x]
    return x


def _fmt(x: Optional[float], nd: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown_table(report: dict) -> str:
    """The markdown report: settings, the main table, per-position acceptance, the histogram and
    the side-by-side runs when present."""
    from .cli import FLASH_ATTN

    fa_word = {v: k for k, v in FLASH_ATTN.items()}
    c, s = report["config"], report["summary"]
    lines = [
        f"### dflash2-gguf bench: {c['dataset']} ({s['n_requests']} requests from {c['n_prompts']} prompts), "
        f"T={c['temperature']}, max {c['max_new_tokens']} new tokens",
        "",
        f"target `{Path(c['target']).name}`, drafter `{Path(c['drafter']).name}` (DFlash {c['drafter_version']}, "
        f"block {c['block_size']}, n_max {c['n_draft_max']}), threads {c['threads'] or 'all'}, "
        f"capture {c['capture_path']}, flash attention {fa_word[c.get('flash_attn')]}, "
        f"repack {'on' if c.get('repack', True) else 'off'}",
        "",
        "| run | tokens | tokens/s | decode tokens/s | speedup | tau | T=0 mismatches |",
        "|---|---|---|---|---|---|---|",
        f"| target alone | {s['base_tokens']} | {_fmt(s['base_tokens_per_second'])} | "
        f"{_fmt(s['base_decode_tokens_per_second'])} | 1.00 | - | - |",
        f"| target + drafter | {s['spec_tokens']} | {_fmt(s['spec_tokens_per_second'])} | "
        f"{_fmt(s['spec_decode_tokens_per_second'])} | {_fmt(s['speedup'])} "
        f"(decode {_fmt(s['decode_speedup'])}) | {_fmt(s['acceptance_length'], 3)} | "
        f"{s['mismatches'] if c['temperature'] == 0 else 'n/a (T>0)'} |",
    ]
    up = report.get("side_by_side")
    if up:
        lines += ["", "Side by side (same target, drafter and rendered prompts; ratio = ours / theirs):", "",
                  "| decoder | tokens | tokens/s | tau | ours / theirs | T=0 text agrees with ours |",
                  "|---|---|---|---|---|---|"]
        for row in up["rows"]:
            lines.append(f"| {row['name']} | {row['tokens']} | {_fmt(row['tokens_per_second'])} | "
                         f"{_fmt(row.get('acceptance_length'), 3)} | {_fmt(row.get('ours_over_theirs'))} "
                         f"({row.get('compared_to', '')}) | {row.get('text_agrees') or '-'} |")
        for note in up.get("notes", []):
            lines.append(f"\n{note}")
    ppa = s["per_position_acceptance"]
    lines += ["", "Per-position conditional acceptance (draft i accepted | drafts before it accepted):", "",
              "| position | " + " | ".join(str(i + 1) for i in range(len(ppa))) + " |",
              "|---|" + "---|" * len(ppa),
              "| P(accept) | " + " | ".join(_fmt(p, 3) for p in ppa) + " |",
              "| verified | " + " | ".join(str(r) for r in s["pos_reached"]) + " |",
              "", "Tokens committed per target pass (histogram):", "",
              "| committed | " + " | ".join(str(k) for k in s["acceptance_histogram"]) + " |",
              "|---|" + "---|" * len(s["acceptance_histogram"]),
              "| passes | " + " | ".join(str(v) for v in s["acceptance_histogram"].values()) + " |"]
    return "\n".join(lines) + "\n"


def plot_per_position(report: dict, path: Path) -> Path:
    """Write a PNG bar chart of per-position conditional acceptance (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    s, c = report["summary"], report["config"]
    ppa = [0.0 if (p is None or (isinstance(p, float) and math.isnan(p))) else p for p in s["per_position_acceptance"]]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.bar(range(1, len(ppa) + 1), ppa, color="#3b75af")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | previous accepted)")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, len(ppa) + 1))
    ax.set_title(f"{c['dataset']}: tau {_fmt(s['acceptance_length'], 2)}, speedup {_fmt(s['speedup'])}x")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- running

def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_bench(
    target: str,
    drafter: str,
    dataset: str,
    *,
    n_prompts: int = 10,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    out: Optional[str] = None,
    n_draft_max: Optional[int] = None,
    n_threads: Optional[int] = None,
    n_ctx: int = 4096,
    decoder_kwargs: Optional[dict] = None,
    warmup: bool = True,
    upstream: bool = False,
    prompt_lookup: bool = False,
    progress: bool = True,
) -> dict:
    """Run the benchmark and return the report (a JSON-ready dict); write files into ``out``.

    Args:
        target / drafter: GGUF paths.
        dataset: A key of :data:`DATASETS` or a ``.jsonl[.gz]`` path.
        n_prompts: Prompts picked (``random.Random(42).shuffle``).
        max_new_tokens: Per request.
        temperature: 0 = greedy (then the token equality check applies); T > 0 samples with
            temperature only (top-k/top-p/min-p off), seeded per request with ``seed + request``.
        seed: Base sampling seed.
        out: Folder for ``bench.json``, ``bench.md``, ``per_position_acceptance.png`` (None: no files).
        n_draft_max: Drafts verified per pass (default: block size - 1).
        n_threads: CPU threads (default: all).
        n_ctx: Context size of target and drafter.
        decoder_kwargs: More :class:`~dflash2_gguf.api.DFlashDecoder` keywords.
        warmup: Run one short generation of each configuration first.
        upstream: Also run upstream's ``llama-speculative-simple`` / ``llama-completion``.
        prompt_lookup: Also run llama-cpp-python with and without ``LlamaPromptLookupDecoding``.
        progress: tqdm bar on stderr.
    """
    from .api import DFlashDecoder
    from .sampling import SamplingParams

    prompts = load_prompts(dataset, n_prompts)
    if not prompts:
        raise ValueError(f"dataset {dataset!r} has no rows")
    max_new_tokens = int(max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")

    def sp(i: int) -> SamplingParams:
        if temperature == 0:
            return SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed + i)
        return SamplingParams(temperature=float(temperature), top_k=0, top_p=1.0, min_p=0.0, seed=seed + i)

    kw = dict(n_ctx=n_ctx, n_threads=n_threads)
    kw.update(decoder_kwargs or {})
    requests: list = []
    rendered: list = []  # (prompt text as rendered, max tokens) for the side-by-side runs
    t_start = time.time()
    with DFlashDecoder(target, drafter, **kw) as dec:
        if not dec.has_drafter:
            raise ValueError("the benchmark needs a drafter (-md)")
        block = dec.block_size
        nmax = block - 1 if n_draft_max is None else int(n_draft_max)
        gen = dict(max_tokens=max_new_tokens, n_draft_max=n_draft_max)
        if warmup:
            msgs = [{"role": "user", "content": prompts[0][0]}]
            for use in (False, True):
                dec.generate(messages=msgs, max_tokens=min(16, max_new_tokens), sampling=sp(0), use_drafter=use)
        n_req = sum(len(t) for t in prompts)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=n_req, desc=f"bench {dataset}", unit="req", file=sys.stderr)
        k = 0
        for pi, turns in enumerate(prompts):
            messages: list = []
            for ti, turn in enumerate(turns):
                messages.append({"role": "user", "content": turn})
                text = dec.apply_chat_template(messages)
                ids = chat_prompt_ids(dec, messages)  # as generate(messages=...) and llama-server tokenize it
                if len(ids) + max_new_tokens + block + 1 > n_ctx:
                    if bar is not None:
                        bar.update(len(turns) - ti)
                    break  # this conversation no longer fits: skip the rest of it
                base = dec.generate(ids, sampling=sp(k), use_drafter=False, **gen)
                spec = dec.generate(ids, sampling=sp(k), use_drafter=True, **gen)
                mm = _first_mismatch(base.tokens, spec.tokens)
                requests.append(RequestResult(pi, ti, len(ids), _run_dict(base, False), _run_dict(spec, True),
                                              mm is None, mm))
                rendered.append(text)
                # next turn follows the target-alone answer (identical to the drafted one at T=0)
                messages.append({"role": "assistant", "content": base.text})
                k += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(tau=f"{spec.stats.acceptance_length:.2f}")
        if bar is not None:
            bar.close()
        config = dict(target=str(target), drafter=str(drafter), dataset=dataset, n_prompts=len(prompts),
                      max_new_tokens=max_new_tokens, temperature=float(temperature), seed=seed,
                      n_draft_max=nmax, block_size=block, drafter_version=dec.drafter_version,
                      threads=n_threads, n_ctx=n_ctx, capture_path=dec.capture_path,
                      prompt_pick="random.Random(42).shuffle", warmup=warmup,
                      flash_attn=kw.get("flash_attn"), repack=kw.get("repack", True))
    if not requests:
        raise ValueError("no prompt fits the context: raise -c or lower --max-new-tokens")
    summary = summarize(requests, block)
    report: dict = dict(config=config, summary=summary, requests=[r.__dict__ for r in requests],
                        wall_s=time.time() - t_start)
    if upstream or prompt_lookup:
        report["side_by_side"] = _side_by_side(report, rendered, target, drafter, upstream=upstream,
                                               prompt_lookup=prompt_lookup, out=out)
    report = _nan_to_none(report)
    if out:
        od = Path(out)
        od.mkdir(parents=True, exist_ok=True)
        (od / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
        (od / "bench.md").write_text(markdown_table(report))
        plot_per_position(report, od / "per_position_acceptance.png")
    return report


def _agrees(ours: str, theirs: str) -> bool:
    """Loose T=0 text check: our output (its first 200 characters, stripped) appears in theirs
    (upstream's tools print the prompt too, and may stop a few tokens later or earlier)."""
    o, t = ours.strip()[:200], theirs.strip()
    return o in t or (bool(t) and t.split("[end of text]")[0].strip() in o and len(t) > 0.5 * len(o))


def _side_by_side(report: dict, rendered: list, target: str, drafter: str, *, upstream: bool,
                  prompt_lookup: bool, out: Optional[str]) -> dict:
    """Run upstream's decoders on the same rendered prompts; rows with tokens/s and ratios."""
    import tempfile

    try:
        from benchmarks import upstream_driver as ud
    except ImportError as e:  # pragma: no cover - outside a checkout
        return {"rows": [], "notes": [f"side-by-side skipped: benchmarks package not importable ({e})"]}
    c, s = report["config"], report["summary"]
    n, temp, seed, thr, ctx = c["max_new_tokens"], c["temperature"], c["seed"], c["threads"], c["n_ctx"]
    rows, notes, per_req = [], [], []
    if upstream:
        try:
            bins = ud.build_upstream_tools()
            with tempfile.TemporaryDirectory(prefix="dflash2-bench-") as tmp:
                spec_runs, base_runs = [], []
                for i, text in enumerate(rendered):
                    w = Path(tmp) / str(i)
                    spec_runs.append(ud.run_speculative_simple(bins, target, drafter, text, workdir=w, n_predict=n,
                                                               temp=temp, seed=seed, threads=thr, n_ctx=ctx,
                                                               n_draft_max=c["n_draft_max"]))
                    base_runs.append(ud.run_completion(bins, target, text, workdir=w, n_predict=n, temp=temp,
                                                       seed=seed, threads=thr, n_ctx=ctx))
            ns = sum(r.n_generated for r in spec_runs)
            ts = sum(r.decode_s for r in spec_runs)
            na = sum(r.n_accepted for r in spec_runs)
            taus = [r.acceptance_length for r in spec_runs if r.acceptance_length]
            nb = sum(r.n_generated for r in base_runs)
            tb = sum(r.decode_s for r in base_runs)
            up_spec_tps, up_base_tps = _ratio(ns, ts), _ratio(nb, tb)
            ours_txt = [r["base"]["text"] for r in report["requests"]]
            agree_s = sum(_agrees(o, r.text) for o, r in zip(ours_txt, spec_runs))
            agree_b = sum(_agrees(o, r.text) for o, r in zip(ours_txt, base_runs))
            rows.append(dict(name="llama-speculative-simple (upstream, DFlash)", tokens=ns,
                             tokens_per_second=up_spec_tps,
                             acceptance_length=(sum(taus) / len(taus)) if taus else None,
                             acceptance_length_pooled=_ratio(ns, ns - na),
                             ours_over_theirs=_ratio(s["spec_decode_tokens_per_second"], up_spec_tps),
                             compared_to="our decode tokens/s with drafter",
                             text_agrees=f"{agree_s}/{len(spec_runs)}" if temp == 0 else None))
            rows.append(dict(name="llama-completion (upstream, plain)", tokens=nb, tokens_per_second=up_base_tps,
                             ours_over_theirs=_ratio(s["base_decode_tokens_per_second"], up_base_tps),
                             compared_to="our decode tokens/s, target alone",
                             text_agrees=f"{agree_b}/{len(base_runs)}" if temp == 0 else None))
            up_speedup = _ratio(up_spec_tps, up_base_tps)
            notes.append(f"Upstream decode speedup (llama-speculative-simple / llama-completion tokens/s): "
                         f"{_fmt(up_speedup)}; ours: {_fmt(s['decode_speedup'])} "
                         f"(ratio {_fmt(_ratio(s['decode_speedup'], up_speedup))}).")
            per_req += [dict(upstream_spec=a.to_dict(), upstream_base=b.to_dict())
                        for a, b in zip(spec_runs, base_runs)]
        except Exception as e:  # keep our own figures when upstream is unavailable
            notes.append(f"upstream side-by-side failed: {type(e).__name__}: {str(e)[:500]}")
    if prompt_lookup:
        try:
            fa = c.get("flash_attn")
            runner = ud.PromptLookupRunner(target, n_ctx=ctx, threads=thr, num_pred_tokens=c["n_draft_max"] or 7,
                                           seed=seed, flash_attn=True if fa is None else bool(fa))
            try:
                if rendered:  # warmup
                    runner.run(rendered[0], lookup=False, n_predict=min(16, n), temp=temp, seed=seed)
                    runner.run(rendered[0], lookup=True, n_predict=min(16, n), temp=temp, seed=seed)
                pl = [(runner.run(t, lookup=False, n_predict=n, temp=temp, seed=seed),
                       runner.run(t, lookup=True, n_predict=n, temp=temp, seed=seed)) for t in rendered]
            finally:
                runner.close()
            nb = sum(a.n_generated for a, _ in pl)
            tb = sum(a.decode_s for a, _ in pl)
            nl = sum(b.n_generated for _, b in pl)
            tl = sum(b.decode_s for _, b in pl)
            notes.append(f"llama-cpp-python prompt-lookup speedup (tokens/s with / without, prefill included): "
                         f"{_fmt(_ratio(_ratio(nl, tl), _ratio(nb, tb)))}; ours: {_fmt(s['speedup'])}.")
            ours_txt = [r["base"]["text"] for r in report["requests"]]
            agree_p = sum(_agrees(o, a.text) for o, (a, _) in zip(ours_txt, pl))
            agree_l = sum(_agrees(o, b.text) for o, (_, b) in zip(ours_txt, pl))
            rows.append(dict(name="llama-cpp-python Llama (plain)", tokens=nb, tokens_per_second=_ratio(nb, tb),
                             ours_over_theirs=_ratio(s["base_tokens_per_second"], _ratio(nb, tb)),
                             compared_to="our tokens/s, target alone",
                             text_agrees=f"{agree_p}/{len(pl)}" if temp == 0 else None))
            rows.append(dict(name="llama-cpp-python prompt lookup", tokens=nl, tokens_per_second=_ratio(nl, tl),
                             ours_over_theirs=_ratio(s["spec_tokens_per_second"], _ratio(nl, tl)),
                             compared_to="our tokens/s with drafter",
                             text_agrees=f"{agree_l}/{len(pl)}" if temp == 0 else None))
            for i, (a, b) in enumerate(pl):
                if i < len(per_req):
                    per_req[i].update(llama_cpp_python=a.to_dict(), prompt_lookup=b.to_dict())
                else:
                    per_req.append(dict(llama_cpp_python=a.to_dict(), prompt_lookup=b.to_dict()))
        except Exception as e:
            notes.append(f"prompt-lookup side-by-side failed: {type(e).__name__}: {str(e)[:500]}")
    return dict(rows=rows, notes=notes, requests=per_req)


# ---------------------------------------------------------------------------- CLI

def add_bench_args(p) -> None:
    """Flags of ``dflash2-gguf bench`` (model flags shared with ``generate``)."""
    from .cli import add_model_args

    add_model_args(p)
    p.add_argument("--dataset", required=True,
                   help=f"{'|'.join(DATASETS)} or a .jsonl file (mbpp: ../shared/data/mbpp.jsonl by default)")
    p.add_argument("--n-prompts", type=int, default=10, help="prompts picked with random.Random(42).shuffle")
    p.add_argument("--max-new-tokens", type=int, default=256, help="maximum new tokens per request")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy, checks token equality)")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed")
    p.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md and the PNG plot")
    p.add_argument("--spec-draft-n-max", type=int, default=None, help="drafts verified per pass (default: block - 1)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warmup generations")
    p.add_argument("--upstream", action="store_true",
                   help="also run upstream's llama-speculative-simple / llama-completion (built once, ~6 min)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="also run llama-cpp-python with and without LlamaPromptLookupDecoding")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_from_args(args) -> int:
    """Run ``dflash2-gguf bench`` from parsed flags; print the markdown table. Returns 0."""
    from .cli import decoder_kwargs

    md = args.model_draft
    if md is None or str(md).lower() == "none":
        raise ValueError("bench needs a drafter (-md DRAFT.gguf)")
    if args.n_prompts < 1:
        raise ValueError("--n-prompts must be >= 1")
    if args.temp < 0:
        raise ValueError("--temp must be >= 0")
    if args.upstream or args.prompt_lookup:
        repo = str(Path(__file__).resolve().parent.parent)
        if repo not in sys.path:
            sys.path.append(repo)
    report = run_bench(
        args.model, md, args.dataset, n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temp, seed=args.seed, out=args.out, n_draft_max=args.spec_draft_n_max,
        n_threads=args.threads, n_ctx=args.ctx_size,
        decoder_kwargs={k: v for k, v in decoder_kwargs(args).items() if k not in ("n_ctx", "n_threads")},
        warmup=not args.no_warmup, upstream=args.upstream, prompt_lookup=args.prompt_lookup,
        progress=not args.no_progress,
    )
    print(markdown_table(report))
    if args.out:
        print(f"[dflash2-gguf bench] wrote {Path(args.out) / 'bench.json'}, bench.md, per_position_acceptance.png",
              file=sys.stderr)
    if report["config"]["temperature"] == 0 and report["summary"]["mismatches"]:
        print(f"[dflash2-gguf bench] WARNING: {report['summary']['mismatches']} request(s) differ between the "
              "runs with and without the drafter at T=0", file=sys.stderr)
    return 0
