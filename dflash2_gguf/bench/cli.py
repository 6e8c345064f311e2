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

Prompts come from :data:`dflash2_gguf.bench.prompt_sets.DATASETS`, the table training capture uses too
(the authors' prompt templates, rendered with the target's
chat template; MT-Bench is multi-turn: the second turn follows the model's first answer) and are
picked with ``random.Random(42).shuffle`` as the authors do. Results go to ``--out``:
``bench.json``, ``bench.md`` and ``per_position_acceptance.png``.

Optional side-by-side runs (``--upstream``: upstream's ``llama-speculative-simple`` /
``llama-completion`` of llama.cpp 0c1e570; ``--prompt-lookup``: llama-cpp-python's prompt-lookup
decoding) are in :mod:`.compare`; one that cannot run stops the command with the reason
and the fix.

Modules, imports one way (each imports only those below it):

- this module: the flags and :func:`run_from_args` (what ``dflash2-gguf bench`` dispatches to),
  and the public names of the others;
- :mod:`.run`: the run loop :func:`run_bench`;
- :mod:`.compare`: the side-by-side runs;
- :mod:`.report`: ``bench.json`` / ``bench.md`` / the per-position plot;
- :mod:`.stats`: tau, the histogram, per-position acceptance, tokens/s and speedups;
- :mod:`.prompt_sets` and :mod:`dflash2_gguf.options` (leaf modules of the package).

Nothing here imports native code or llama_cpp at import time.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .compare import ComparisonUnavailable
from .report import markdown_table, plot_per_position, write_report
from .run import ComparisonFailed, run_bench
from .stats import RequestResult, committed_per_pass, summarize
from ..options import add_model_args, add_sampling_args, decoder_kwargs
from .prompt_sets import DATASETS, DatasetSpec, format_turns, load_prompts, load_rows

__all__ = [
    "DATASETS", "DatasetSpec", "load_rows", "load_prompts", "format_turns", "committed_per_pass",
    "RequestResult", "summarize", "markdown_table", "plot_per_position", "write_report", "run_bench",
    "add_bench_args", "run_from_args", "ComparisonUnavailable", "ComparisonFailed",
]


def add_bench_args(p) -> None:
    """Flags of ``dflash2-gguf bench`` (model flags shared with ``generate``)."""
    add_model_args(p)
    p.add_argument("--dataset", required=True,
                   help=f"{'|'.join(DATASETS)}, a .jsonl file or a text file with one prompt per line "
                        "(mbpp: shipped in the package; $DFLASH2_GGUF_MBPP reads another copy)")
    p.add_argument("--n-prompts", type=int, default=10, help="prompts picked with random.Random(42).shuffle")
    # sampling (default: temperature only, T = 0 checks token equality; the seed is the base seed,
    # request i uses seed + i), -n / --max-new-tokens and the draft settings: dflash2_gguf/decoder/params.py
    add_sampling_args(p, "bench")
    p.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md and the PNG plot")
    p.add_argument("--no-warmup", action="store_true", help="skip the warmup generations")
    p.add_argument("--upstream", action="store_true",
                   help="also run upstream's llama-speculative-simple / llama-completion (llama.cpp 0c1e570; built once "
                        "from a clone with `python -m benchmarks.upstream_driver`, ~6 min, or found in "
                        "$DFLASH2_GGUF_UPSTREAM_BIN)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="also run llama-cpp-python with and without LlamaPromptLookupDecoding")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sweep", action="store_true",
                   help="instead: tokens/s of the target alone, every fixed k and the adaptive policy (the DFlash "
                        "drafter alone), each context source alone (ngram-simple, ngram-mod, both) and the mix (the "
                        "default) on the same requests")


def run_from_args(args) -> int:
    """Run ``dflash2-gguf bench`` from parsed flags; print the markdown table.

    Returns 0, or 1 when a requested side-by-side run failed while running (our figures are still
    printed and written; the error names the failed comparison).

    Raises:
        ValueError: a bad flag value; ComparisonUnavailable: a requested comparison cannot run
            (before anything loads; ``dflash2-gguf`` prints the message and exits non-zero).
    """
    md = args.model_draft
    if md is None or str(md).lower() == "none":
        raise ValueError("bench needs a drafter (-md DRAFT.gguf)")
    if args.n_prompts < 1:
        raise ValueError("--n-prompts must be >= 1")
    from ..decoder.params import sampling_from_values, select, values_from_args

    vals = values_from_args(args, "bench")
    sp = sampling_from_values(vals)  # ValueError names a bad value
    seed = 0 if sp.seed is None else sp.seed
    if args.upstream or args.prompt_lookup:
        import dataclasses

        plain = dataclasses.replace(sp, temperature=0.0, seed=0)
        if plain != type(sp)(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
            raise ValueError("--upstream / --prompt-lookup compare runs sampled with --temp alone: leave out the "
                             "other sampling flags (--top-k, --top-p, --min-p, penalties, -l, grammars)")
    gen = {k: v for k, v in vals.items()
           if k not in {p.name for p in select(group="sampling")} | {"max_tokens", "n_draft_max", "adaptive"}}
    dkw = {k: v for k, v in decoder_kwargs(args).items() if k not in ("n_ctx", "n_threads")}
    if args.sweep:
        from .run import run_sweep, sweep_markdown

        rep = run_sweep(args.model, md, args.dataset, n_prompts=args.n_prompts, max_new_tokens=args.max_tokens,
                        temperature=sp.temperature, seed=seed, n_threads=args.threads, n_ctx=args.ctx_size,
                        decoder_kwargs=dkw, progress=not args.no_progress, sampling=sp, generate_kwargs=gen)
        print(sweep_markdown(rep))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / "sweep.json.tmp"  # written whole, then renamed: never a half-written sweep.json
            tmp.write_text(json.dumps(rep, indent=1))
            os.replace(tmp, out / "sweep.json")
        return 0
    try:
        report = run_bench(
            args.model, md, args.dataset, n_prompts=args.n_prompts, max_new_tokens=args.max_tokens,
            temperature=sp.temperature, seed=seed, out=args.out, n_draft_max=args.n_draft_max,
            n_threads=args.threads, n_ctx=args.ctx_size,
            decoder_kwargs=dkw,
            warmup=not args.no_warmup, upstream=args.upstream, prompt_lookup=args.prompt_lookup,
            progress=not args.no_progress, adaptive=args.adaptive, sampling=sp, generate_kwargs=gen,
        )
        failed = []
    except ComparisonFailed as e:
        report, failed = e.report, e.errors
    print(markdown_table(report))
    cm = report["config"].get("cost_model")
    if cm:
        print("\ncost model (adaptive draft length): target pass over 1..{} rows {} ms; drafter pass {:.1f} ms".format(
            len(cm["verify_ms"]), " / ".join(f"{x:.1f}" for x in cm["verify_ms"]), cm["draft_ms"]))
    if args.out:
        print(f"[dflash2-gguf bench] wrote {Path(args.out) / 'bench.json'}, bench.md, per_position_acceptance.png",
              file=sys.stderr)
    if report["config"]["temperature"] == 0 and report["summary"]["mismatches"]:
        print(f"[dflash2-gguf bench] WARNING: {report['summary']['mismatches']} request(s) differ between the "
              "runs with and without the drafter at T=0", file=sys.stderr)
    for err in failed:
        print(f"dflash2-gguf bench: error: {err}", file=sys.stderr)
    return 1 if failed else 0
