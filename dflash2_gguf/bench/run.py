"""The run loop of ``dflash2-gguf bench``: each picked prompt with and without the drafter.

For each request, the target alone and the target with the drafter run through the SAME decoder
object and the same native loop (``use_drafter=False`` / ``True``), after a warmup of both; the
figures go through :mod:`.stats`, the files through :mod:`.report`, and the optional
side-by-side runs through :mod:`.compare`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Optional

from .compare import check_side_by_side, side_by_side
from .report import write_report
from .stats import RequestResult, first_mismatch, nan_to_none, run_dict, summarize
from ..chat.templates import chat_prompt_ids
from .prompt_sets import load_prompts

__all__ = ["run_sweep", "sweep_markdown", "policy_summary", "run_bench", "ComparisonFailed"]


class ComparisonFailed(RuntimeError):
    """A requested side-by-side run failed while running. The benchmark's own figures were kept
    (and written): :attr:`report`; :attr:`errors` has one message per failed comparison."""

    def __init__(self, report: dict, errors: list) -> None:
        super().__init__("side-by-side run failed: " + "; ".join(errors))
        self.report = report
        self.errors = list(errors)


def _base_sampling(sampling, temperature: float, seed: int):
    """The base :class:`SamplingParams` of a run: ``sampling`` (its seed None -> ``seed``), else
    temperature-only sampling (top-k / top-p / min-p off) at ``temperature``."""
    from ..decoder.sampling import SamplingParams

    if sampling is None:
        return SamplingParams(temperature=float(temperature), top_k=0, top_p=1.0, min_p=0.0, seed=int(seed))
    return sampling if sampling.seed is not None else dataclasses.replace(sampling, seed=int(seed))


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
    adaptive: bool = True,
    sampling=None,
    generate_kwargs: Optional[dict] = None,
) -> dict:
    """Run the benchmark and return the report (a JSON-ready dict); write files into ``out``.

    Every request runs twice on one decoder, target alone then with the drafter, each prefilling
    its whole prompt on an emptied KV cache (``cache_prompt=False``): a request's texts do not
    depend on the requests before it, and match a cold run of the same prompt (a reused prefix
    changes the prefill's batch shapes, so ggml sums in another order and greedy texts can part
    at near-ties).

    Args:
        target / drafter: GGUF paths.
        dataset: A key of :data:`~dflash2_gguf.bench.prompt_sets.DATASETS` or a file (see there).
        n_prompts: Prompts picked (``random.Random(42).shuffle``).
        max_new_tokens: Per request.
        temperature: 0 = greedy (then the token equality check applies); T > 0 samples with
            temperature only (top-k/top-p/min-p off), seeded per request with ``seed + request``.
        seed: Base sampling seed.
        out: Folder for ``bench.json``, ``bench.md``, ``per_position_acceptance.png`` (None: no files).
        n_draft_max: Drafts verified per pass (default: block size - 1).
        n_threads: CPU threads (default: all).
        n_ctx: Context size of target and drafter.
        decoder_kwargs: More :class:`~dflash2_gguf.decoder.api.DFlashDecoder` keywords.
        warmup: Run one short generation of each configuration first.
        upstream: Also run upstream's ``llama-speculative-simple`` / ``llama-completion``
            (:mod:`.compare`; the binaries must be built, see there).
        prompt_lookup: Also run llama-cpp-python with and without ``LlamaPromptLookupDecoding``.
        progress: tqdm bar on stderr.
        adaptive: The drafter runs with the adaptive draft length (``generate(adaptive=...)``;
            False: always ``n_draft_max`` drafts). The cost model in use goes into the report.
        sampling: A :class:`~dflash2_gguf.decoder.sampling.SamplingParams` to sample with instead of
            ``temperature`` alone (``bench``'s sampling flags); its seed (None: ``seed``) is the
            base seed, request ``i`` uses base + i.
        generate_kwargs: More :meth:`~dflash2_gguf.decoder.api.DFlashDecoder.generate` keywords for both
            runs (``p_min``, ``n_draft_min``, ``ignore_eos``: ``bench``'s draft and limit flags).

    Raises:
        ComparisonUnavailable: a requested comparison cannot run (checked before anything loads).
        ComparisonFailed: a requested comparison failed while running; the files of ``out`` are
            written first and the report is the exception's ``report``.
    """
    from ..decoder.api import DFlashDecoder
    from ..decoder.sampling import SamplingParams

    bins = check_side_by_side(upstream=upstream, prompt_lookup=prompt_lookup)
    prompts = load_prompts(dataset, n_prompts)
    if not prompts:
        raise ValueError(f"dataset {dataset!r} has no rows")
    max_new_tokens = int(max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")

    base_sp = _base_sampling(sampling, temperature, seed)
    temperature, seed = base_sp.temperature, base_sp.seed

    def sp(i: int) -> SamplingParams:
        return dataclasses.replace(base_sp, seed=seed + i)

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
        # cache_prompt=False: a cold prefill per run (why: the docstring)
        gen = dict(generate_kwargs or {})
        gen.update(max_tokens=max_new_tokens, n_draft_max=n_draft_max, adaptive=adaptive, cache_prompt=False)
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
                mm = first_mismatch(base.tokens, spec.tokens)
                requests.append(RequestResult(pi, ti, len(ids), run_dict(base, False), run_dict(spec, True),
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
                      rollback=dec.rollback_mode, prompt_pick="random.Random(42).shuffle", warmup=warmup,
                      flash_attn=kw.get("flash_attn"), repack=kw.get("repack", True), adaptive=adaptive,
                      cost_model=dec.cost_model)
    if not requests:
        raise ValueError("no prompt fits the context: raise -c or lower --max-new-tokens")
    summary = summarize(requests, block)
    report: dict = dict(config=config, summary=summary, requests=[r.__dict__ for r in requests],
                        wall_s=time.time() - t_start)
    if upstream or prompt_lookup:
        report["side_by_side"] = side_by_side(report, rendered, target, drafter, upstream=upstream,
                                              prompt_lookup=prompt_lookup, bins=bins)
    report = nan_to_none(report)
    if out:
        write_report(report, out)
    errors = report.get("side_by_side", {}).get("errors")
    if errors:
        raise ComparisonFailed(report, errors)
    return report


def run_sweep(
    target: str,
    drafter: str,
    dataset: str,
    *,
    n_prompts: int = 10,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    n_threads: Optional[int] = None,
    n_ctx: int = 4096,
    decoder_kwargs: Optional[dict] = None,
    progress: bool = True,
    sampling=None,
    context: bool = True,
    generate_kwargs: Optional[dict] = None,
) -> dict:
    """Tokens/s of every draft-length policy on the same requests, in one run (issue 14): the
    target alone, every fixed k = 1..n_max (k = n_max is the fixed full block) and the adaptive
    policy (these with the DFlash drafter as the only draft source, ``spec_type="draft-dflash"``),
    then each context source alone and the mix (issue 43): ``ngram-simple``, ``ngram-mod``,
    ``ngram-simple,ngram-mod`` (no drafter loaded: ``-md none --spec-type ...``) and the default
    of a decoder with the drafter (all three sources chosen per cycle by expected gain), each
    request run by every configuration back to back (so drift in machine speed hits all alike).
    The context rows run on decoders of their own, each seeing each request once: ngram-mod's
    pool is shared across a decoder's requests and would otherwise hold this request's output
    from an earlier row. The target alone and the adaptive policy, whose ratio is the one the adaptive
    policy is judged by, run twice per request in a counterbalanced order: alone, adaptive,
    adaptive, alone, then k = 1..n_max; every other request adaptive, alone, alone, adaptive,
    then k = n_max..1 (a drift in machine speed that is linear over four runs cancels, and each
    of the two runs first after a fixed-k run as often as the other). First turns of
    ``dataset`` only.

    ``context=False`` leaves the context rows out; ``generate_kwargs``: the ``spec_ngram_*``
    settings of the context rows.

    Returns:
        ``{"config": ..., "cost_model": {...}, "rows": [{"name", "tokens", "seconds",
        "tokens_per_second", "acceptance_length", "ratio_vs_alone", "overall_tokens_per_second",
        "overall_ratio_vs_alone", "departed", "cycles", "k_hist", "drafter_skipped",
        "draft_inject_seconds"}, ...], "adaptive_vs_best_fixed": float, "adaptive_vs_alone": float,
        "identical": bool}``, rows in the order target alone, k = 1..n_max, adaptive;
        tokens / seconds / tokens_per_second: the decode phase (after the first token);
        ``overall_*``: every token over the whole request, prefill included; ``departed``
        (T = 0): requests whose tokens are not the target alone's (README, "Exactness at T = 0":
        a batched verify row and a one-token decode can part past 256 cells); ``identical``
        (T = 0): no request departed in any configuration; ``k_hist[k]``: cycles that verified k
        drafts; ``drafter_skipped``: cycles in which the adaptive gate skipped the drafter;
        ``draft_inject_seconds``: time in drafter passes and feature injection (what drafting
        costs beyond the target's passes); ``sources``: per draft source ``{"cycles", "drafted",
        "accepted"}``. With ``context``, also ``"context_rows"`` (same keys), in the order
        ngram-simple, ngram-mod, context drafts, mix (default), and ``"mix_vs_alone"`` /
        ``"context_vs_alone"``.
    """
    from ..decoder.api import DFlashDecoder

    base_sp = _base_sampling(sampling, temperature, seed)
    temperature, seed = base_sp.temperature, base_sp.seed
    prompts = [t[0] for t in load_prompts(dataset, n_prompts)]
    kw = dict(n_ctx=n_ctx, n_threads=n_threads)
    kw.update(decoder_kwargs or {})
    ngram = {k: v for k, v in (generate_kwargs or {}).items() if k.startswith("spec_ngram_")}
    # the context rows: (name, drafter loaded, generate kwargs); each on a decoder of its own
    ctx_configs = [("ngram-simple", False, dict(spec_type="ngram-simple", **ngram)),
                   ("ngram-mod", False, dict(spec_type="ngram-mod", **ngram)),
                   ("context drafts (ngram-simple,ngram-mod)", False, dict(spec_type="ngram-simple,ngram-mod", **ngram)),
                   ("mix (default)", True, dict(ngram))] if context else []
    with contextlib.ExitStack() as stack:
        dec = stack.enter_context(DFlashDecoder(target, drafter, **kw))
        ctx_decs = {name: stack.enter_context(DFlashDecoder(target, drafter if with_drafter else None, **kw))
                    for name, with_drafter, _ in ctx_configs}
        nmax = dec.block_size - 1
        only = dict(spec_type="draft-dflash")  # the DFlash drafter alone: what these rows measure
        configs = [("target alone", dict(use_drafter=False))]
        configs += [(f"fixed k={k}" + (" (full block)" if k == nmax else ""), dict(adaptive=False, n_draft_max=k, **only))
                    for k in range(1, nmax + 1)]
        configs += [("adaptive", dict(adaptive=True, **only))]
        dec.generate(messages=[{"role": "user", "content": prompts[0]}], max_tokens=8, **only)  # warm-up + cost model
        for name, _, extra in ctx_configs:  # a warm-up of no request's text: the pool keeps what it sees
            ctx_decs[name].generate(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, **extra)
        # the target alone (A) and the adaptive policy (B) side by side, ABBA / BAAB, then the fixed k
        abba = [configs[0], configs[-1], configs[-1], configs[0]]
        baab = [configs[-1], configs[0], configs[0], configs[-1]]
        # per configuration: decode tokens, decode seconds, committed in cycles, cycles, all tokens, all seconds
        names = [name for name, _ in configs] + [name for name, _, _ in ctx_configs]
        acc = {name: [0, 0.0, 0, 0, 0, 0.0] for name in names}
        # per configuration: k histogram, cycles without the drafter, drafter + injection seconds
        policy = {name: dict(k_hist=[], drafter_skipped=0, draft_inject_seconds=0.0) for name in names}
        sources = {name: {} for name in names}
        departed = {name: 0 for name in names}
        identical = True
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts) * (len(configs) + 2 + len(ctx_configs)), desc=f"sweep {dataset}", unit="run", file=sys.stderr)
        for i, q in enumerate(prompts):
            ids = chat_prompt_ids(dec, [{"role": "user", "content": q}])
            if len(ids) + max_new_tokens + dec.block_size + 1 > n_ctx:
                continue
            sp = dataclasses.replace(base_sp, seed=seed + i)
            tokens = {}
            runs = [(name, dec, extra) for name, extra in
                    (abba + configs[1:-1] if i % 2 == 0 else baab + configs[-2:0:-1])]
            ctx_runs = [(name, ctx_decs[name], extra) for name, _, extra in ctx_configs]
            runs += ctx_runs if i % 2 == 0 else ctx_runs[::-1]
            for name, d, extra in runs:
                r = d.generate(ids, max_tokens=max_new_tokens, sampling=sp, cache_prompt=False, **extra)
                a = acc[name]
                a[0] += r.stats.n_generated - 1  # decode phase: the first token comes from the prefill
                a[1] += r.stats.t_total_s - r.stats.t_prefill_s
                a[2] += r.stats.n_generated - 1
                a[3] += r.stats.n_cycles
                a[4] += r.stats.n_generated
                a[5] += r.stats.t_total_s
                pol = policy[name]
                kh = pol["k_hist"]
                kh.extend([0] * (len(r.stats.k_hist) - len(kh)))
                for k, n in enumerate(r.stats.k_hist):
                    kh[k] += n
                pol["drafter_skipped"] += r.stats.n_drafter_skipped
                pol["draft_inject_seconds"] += r.stats.t_draft_s + r.stats.t_inject_s
                for src, d_src in r.stats.sources.items():
                    tot = sources[name].setdefault(src, {})
                    for key, v in d_src.items():
                        tot[key] = tot.get(key, 0) + v
                tokens[name] = r.tokens
                if bar is not None:
                    bar.update(1)
            for name, t in tokens.items():  # T = 0: requests whose tokens part from the target alone's
                departed[name] += temperature == 0 and t != tokens[configs[0][0]]
            identical &= temperature > 0 or all(t == tokens[configs[0][0]] for t in tokens.values())
        if bar is not None:
            bar.close()
        cost = dec.cost_model
    def row(name: str) -> dict:
        tok, sec, com, cyc, tok_all, sec_all = acc[name]
        return dict(name=name, tokens=tok, seconds=sec, tokens_per_second=tok / sec if sec else 0.0,
                    acceptance_length=com / cyc if cyc else 0.0,
                    overall_tokens_per_second=tok_all / sec_all if sec_all else 0.0,
                    departed=departed[name], cycles=cyc, sources=sources[name], **policy[name])

    rows = [row(name) for name, _ in configs]
    ctx_rows = [row(name) for name, _, _ in ctx_configs]
    alone, alone_all = rows[0]["tokens_per_second"], rows[0]["overall_tokens_per_second"]
    for r in rows + ctx_rows:
        r["ratio_vs_alone"] = r["tokens_per_second"] / alone if alone else 0.0
        r["overall_ratio_vs_alone"] = r["overall_tokens_per_second"] / alone_all if alone_all else 0.0
    best_fixed = max(r["tokens_per_second"] for r in rows[1:-1])
    rep = dict(config=dict(target=str(target), drafter=str(drafter), dataset=dataset, n_prompts=len(prompts),
                           max_new_tokens=max_new_tokens, temperature=float(temperature), threads=n_threads),
               cost_model=cost, rows=rows, identical=identical,
               adaptive_vs_best_fixed=rows[-1]["tokens_per_second"] / best_fixed if best_fixed else 0.0,
               adaptive_vs_alone=rows[-1]["ratio_vs_alone"])
    if ctx_rows:
        rep.update(context_rows=ctx_rows, context_vs_alone=ctx_rows[2]["ratio_vs_alone"],
                   mix_vs_alone=ctx_rows[3]["ratio_vs_alone"])
    return rep


def policy_summary(row: dict) -> str:
    """What one sweep row's policy did, in words: cycles that ran the drafter, the k histogram and
    the share of its decode time spent in drafter passes and feature injection; "" for rows from
    sweeps that did not record it."""
    if "k_hist" not in row or not row.get("cycles"):
        return ""
    cyc = row["cycles"]
    ran = cyc - row["drafter_skipped"]
    hist = ", ".join(f"{k}: {n}" for k, n in enumerate(row["k_hist"]) if n)
    share = row["draft_inject_seconds"] / row["seconds"] if row["seconds"] else 0.0
    return (f"drafter ran in {ran} of {cyc} cycles, k histogram {{{hist}}}, drafter passes + feature "
            f"injection {100 * share:.2f}% of its decode time")


def sweep_markdown(rep: dict) -> str:
    """The sweep as a markdown table plus the two ratios the issue asks for."""
    c = rep["config"]
    lines = [f"{c['dataset']}, {c['n_prompts']} prompts, {c['max_new_tokens']} new tokens, T = {c['temperature']:g} "
             "(decode phase: tokens after the first / time after the prefill)", "",
             "| configuration | tokens/s | vs target alone | tokens per target pass |", "|---|---|---|---|"]
    for r in rep["rows"] + rep.get("context_rows", []):
        lines.append(f"| {r['name']} | {r['tokens_per_second']:.1f} | {r['ratio_vs_alone']:.3f} | "
                     f"{r['acceptance_length']:.2f} |")
    lines += ["", f"adaptive / target alone = {rep['adaptive_vs_alone']:.3f}; "
              f"adaptive / best fixed k = {rep['adaptive_vs_best_fixed']:.3f}"
              + (f"; context drafts / target alone = {rep['context_vs_alone']:.3f}; mix (default) / target alone "
                 f"= {rep['mix_vs_alone']:.3f}" if "context_rows" in rep else "")]
    if summary := policy_summary(rep["rows"][-1]):
        lines.append(f"adaptive: {summary}")
    for r in rep.get("context_rows", []):
        per = "; ".join(f"{src} {d.get('accepted', 0)} of {d.get('drafted', 0)} drafts accepted in {d.get('cycles', 0)} "
                        "cycles" for src, d in sorted(r["sources"].items()) if d.get("drafted"))
        lines.append(f"{r['name']}: {per or 'no drafts'}")
    if c["temperature"] == 0:
        lines.append(f"T = 0 texts identical across configurations: {rep['identical']}")
    cm = rep.get("cost_model")
    if cm:
        lines.append("cost model: verify ms for 1..{} rows: {}; drafter pass {:.1f} ms".format(
            len(cm["verify_ms"]), ", ".join(f"{x:.1f}" for x in cm["verify_ms"]), cm["draft_ms"]))
    return "\n".join(lines)
