"""Agent-shaped work, side by side (issue 43, Deliver 5): our driver's configurations and stock
llama-server built from the pinned source, same GGUFs, same threads, T = 0, decode tokens/s.

Prompts: ``data/agent/agent_prompts.jsonl`` (:mod:`benchmarks.agent_prompts`: code edits, JSON
tool round trips, an agent transcript replayed turn by turn, prose as the control), each rendered
once with our chat renderer (:func:`dflash2_gguf.chat.templates.chat_prompt_ids`, what our server feeds)
and sent as those token ids to both: ``DFlashDecoder.generate(ids)`` and llama-server's
``/completion`` with ``"prompt": ids`` (its ``tokens_evaluated`` is checked against ``len(ids)``).

Configurations (each its own decoder or server process, all loaded at the start; every prompt runs
on every configuration back to back, in an order rotated and reversed from one prompt to the
next, so that drift in machine speed hits all alike; each configuration sees each prompt once, so
an n-gram pool shared across requests fills from earlier prompts only, as in a server):

- ours: ``target alone`` (no drafter, no context drafts), ``DFlash adaptive`` (``spec_type
  draft-dflash``; with a drafter), ``context drafts`` (``ngram-simple,ngram-mod``, no drafter
  loaded), ``mix (default)`` (with a drafter: the default, all three sources chosen per cycle).
  "Our default" is the mix with a drafter and the context drafts without one (the issue's
  "context drafts alone" on the targets that have no drafter).
- llama-server: ``--spec-type`` none, ``ngram-simple``, ``ngram-mod``, ``ngram-map-k`` (each
  measured; the best of them is "llama.cpp's best n-gram") and, with a drafter,
  ``draft-dflash,ngram-mod``; defaults otherwise (``-np 1``, ``-c`` as ours, ``-t``/``-tb`` the
  threads).

Decode tokens/s: tokens after the first / seconds after the prefill, summed over the prompts
(ours: ``(n_generated - 1) / (t_total - t_prefill)``; llama-server: ``(predicted_n - 1) /
predicted_ms`` of its ``timings``, whose first token is sampled from the prompt's pass).

Usage (an idle machine, OpenMP wait policy at its default)::

    python -m benchmarks.agent_bench -m SmolLM2-135M-Instruct.Q4_1.gguf -md models/smollm2-135m-dflash2.gguf \\
        -t 2 -n 256 --out bench-out/agent-smollm2.json
    python -m benchmarks.agent_bench -m Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf -t 2 --out bench-out/agent-qwen05.json
    python -m benchmarks.agent_bench -m SmolLM2-135M-Instruct.Q4_1.gguf -md models/smollm2-135m-dflash2.gguf \\
        -t 1 --identity code-edit-0,code-edit-1,transcript-0,transcript-11   # T = 0 identity, 1 thread
    python -m benchmarks.agent_bench --report bench-out/agent-*.json --benchmarks BENCHMARKS.md --plot \\
        benchmarks/agent_bench.png     # the section "Agent-shaped work: context drafts"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "agent" / "agent_prompts.jsonl"
KINDS = ("code-edit", "json-tool", "transcript", "prose")
LLAMA_NGRAM = ("ngram-simple", "ngram-mod", "ngram-map-k")
SECTION_START = "<!-- agent-bench:start -->"
SECTION_END = "<!-- agent-bench:end -->"


def pick_rows(path: Path, kinds, n_per_kind: int) -> list:
    """The first ``n_per_kind`` rows of each kind (the transcript: ``n_per_kind`` turns spread over
    the session, its last turn included)."""
    rows = [json.loads(ln) for ln in open(path, encoding="utf-8") if ln.strip()]
    out = []
    for k in kinds:
        rk = [r for r in rows if r["kind"] == k]
        if k == "transcript" and len(rk) > n_per_kind:
            step = (len(rk) - 1) / max(1, n_per_kind - 1)
            rk = [rk[round(i * step)] for i in range(n_per_kind)] if n_per_kind > 1 else rk[-1:]
        out += rk[:n_per_kind]
    return out


# ---------------------------------------------------------------------------- configurations

class OurConfig:
    """One of our configurations: its own decoder, generate kwargs."""

    backend = "ours"

    def __init__(self, name: str, target: str, drafter: Optional[str], threads: int, n_ctx: int, **gen) -> None:
        from dflash2_gguf import DFlashDecoder

        self.name, self.gen = name, gen
        self.dec = DFlashDecoder(target, drafter, n_ctx=n_ctx, n_threads=threads)
        if gen.get("spec_type", "") != "" or drafter:
            # measured now, not a cost model (and learnt policy state) saved by earlier runs that may
            # have run on a loaded machine: each run starts from the same calibration
            self.dec.measure_cost_model(reps=3, save=False)

    def warmup(self, ids: list) -> None:
        from dflash2_gguf import SamplingParams

        self.dec.generate(ids, max_tokens=16, sampling=SamplingParams.greedy_params(), **self.gen)

    def run(self, ids: list, n: int) -> dict:
        from dflash2_gguf import SamplingParams

        r = self.dec.generate(ids, max_tokens=n, sampling=SamplingParams.greedy_params(), cache_prompt=True, **self.gen)
        s = r.stats
        return dict(tokens=list(r.tokens), n_prompt=s.n_prompt, decode_tokens=s.n_generated - 1,
                    decode_seconds=s.t_total_s - s.t_prefill_s, cycles=s.n_cycles, drafted=s.n_drafted,
                    accepted=s.n_accepted, k_hist=list(s.k_hist), sources=dict(s.sources),
                    drafter_skipped=s.n_drafter_skipped, t_target=s.t_target_s, t_draft=s.t_draft_s,
                    t_inject=s.t_inject_s, t_sample=s.t_sample_s, t_rollback=s.t_rollback_s, stop=s.stop_reason)

    def extra(self) -> dict:
        return dict(cost_model=self.dec.cost_model)

    def close(self) -> None:
        self.dec.close()


class LlamaServerConfig:
    """One llama-server process with one ``--spec-type``."""

    backend = "llama-server"

    def __init__(self, name: str, exe: str, target: str, threads: int, n_ctx: int, spec: list) -> None:
        from benchmarks.llama_server_compat import _free_port, _wait

        self.name = name
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [exe, "-m", target, "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads), "-np", "1",
               "--port", str(port), *spec]
        self.cmd = cmd
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"agent-bench-{port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        _wait(self.url, self.proc)

    def _post(self, ids: list, n: int) -> dict:
        import httpx

        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "seed": 0, "cache_prompt": True,
                "return_tokens": True, "stream": False}
        r = httpx.post(self.url + "/completion", json=body, timeout=3600)
        r.raise_for_status()
        return r.json()

    def warmup(self, ids: list) -> None:
        self._post(ids, 16)

    def run(self, ids: list, n: int) -> dict:
        d = self._post(ids, n)
        t = d["timings"]
        return dict(tokens=list(d.get("tokens") or []), n_prompt=int(d.get("tokens_evaluated", -1)),
                    decode_tokens=int(t["predicted_n"]) - 1, decode_seconds=float(t["predicted_ms"]) / 1000.0,
                    drafted=int(t.get("draft_n", 0)), accepted=int(t.get("draft_n_accepted", 0)),
                    stop=d.get("stop_type", ""))

    def extra(self) -> dict:
        return dict(command=" ".join(Path(c).name if i == 0 else c for i, c in enumerate(self.cmd)))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ---------------------------------------------------------------------------- the run

def _add(acc: dict, r: dict) -> None:
    for k in ("decode_tokens", "decode_seconds", "cycles", "drafted", "accepted", "drafter_skipped",
              "t_target", "t_draft", "t_inject", "t_sample", "t_rollback"):
        if k in r:
            acc[k] = acc.get(k, 0) + r[k]
    acc["requests"] = acc.get("requests", 0) + 1
    if "k_hist" in r:
        kh = acc.setdefault("k_hist", [])
        kh.extend([0] * (len(r["k_hist"]) - len(kh)))
        for k, v in enumerate(r["k_hist"]):
            kh[k] += v
    for src, d in (r.get("sources") or {}).items():
        a = acc.setdefault("sources", {}).setdefault(src, {})
        for kk, vv in d.items():
            a[kk] = a.get(kk, 0) + vv


def run_bench(target: str, drafter: Optional[str], *, threads: int, n_new: int, n_ctx: int, kinds, n_per_kind: int,
              prompts: Path = PROMPTS, llama: bool = True, llama_types=LLAMA_NGRAM, ours: bool = True,
              progress: bool = True) -> dict:
    from dflash2_gguf import DFlashDecoder
    from dflash2_gguf.chat.templates import chat_prompt_ids

    rows = pick_rows(prompts, kinds, n_per_kind)
    others_before = other_load()
    with DFlashDecoder(target, None, n_ctx=n_ctx, n_threads=threads) as dec:
        ids = [chat_prompt_ids(dec, r["messages"]) for r in rows]
    keep = [i for i, x in enumerate(ids) if len(x) + n_new + 32 <= n_ctx]
    rows, ids = [rows[i] for i in keep], [ids[i] for i in keep]
    configs = []
    t0 = time.time()
    try:
        if ours:
            configs.append(OurConfig("target alone", target, None, threads, n_ctx))
            if drafter:
                configs.append(OurConfig("DFlash adaptive", target, drafter, threads, n_ctx, spec_type="draft-dflash"))
            configs.append(OurConfig("context drafts", target, None, threads, n_ctx, spec_type="ngram-simple,ngram-mod"))
            if drafter:
                configs.append(OurConfig("mix (default)", target, drafter, threads, n_ctx))
        if llama:
            from benchmarks.llama_server_compat import build_llama_server

            exe = str(build_llama_server())
            configs.append(LlamaServerConfig("llama.cpp none", exe, target, threads, n_ctx, []))
            for t in llama_types:
                configs.append(LlamaServerConfig(f"llama.cpp {t}", exe, target, threads, n_ctx, ["--spec-type", t]))
            if drafter:
                configs.append(LlamaServerConfig("llama.cpp draft-dflash,ngram-mod", exe, target, threads, n_ctx,
                                                 ["-md", drafter, "-td", str(threads), "--spec-type",
                                                  "draft-dflash,ngram-mod"]))
        with DFlashDecoder(target, None, n_ctx=256, n_threads=threads) as dec:  # no request's text: pools keep it
            warm = chat_prompt_ids(dec, [{"role": "user", "content": "Say hello."}])
        for c in configs:
            c.warmup(warm)
        load_s = time.time() - t0
        results = {c.name: dict(backend=c.backend, all={}, kinds={}, per_prompt=[]) for c in configs}
        t1 = time.time()
        for i, (row, x) in enumerate(zip(rows, ids)):
            order = configs[i % len(configs):] + configs[:i % len(configs)]
            if i % 2:
                order = order[::-1]
            outs = {}
            for c in order:
                time.sleep(0.3)  # an idle gap: the previous process's OpenMP threads stop spinning
                r = c.run(x, n_new)
                outs[c.name] = r
                res = results[c.name]
                _add(res["all"], r)
                _add(res["kinds"].setdefault(row["kind"], {}), r)
                res["per_prompt"].append(dict(id=row["id"], kind=row["kind"], n_prompt_ids=len(x),
                                              **{k: v for k, v in r.items() if k != "tokens"},
                                              n_tokens=len(r["tokens"])))
            base_ours = outs.get("target alone", {}).get("tokens")
            base_llama = outs.get("llama.cpp none", {}).get("tokens")
            for name, r in outs.items():
                pp = results[name]["per_prompt"][-1]
                ref = base_ours if results[name]["backend"] == "ours" else base_llama
                pp["identical_to_target"] = ref is not None and r["tokens"] == ref
                pp["identical_to_ours_target"] = base_ours is not None and r["tokens"] == base_ours
            if progress:
                line = ", ".join(f"{n}: {outs[n]['decode_tokens'] / max(outs[n]['decode_seconds'], 1e-9):.1f}"
                                 for n in results)
                print(f"[{i + 1}/{len(rows)} {row['id']} ({len(x)} prompt tokens)] {line}", file=sys.stderr, flush=True)
        bench_s = time.time() - t1
        extras = {c.name: c.extra() for c in configs}
    finally:
        for c in configs:
            c.close()
    for name, res in results.items():
        res.update(extras[name])
        for acc in [res["all"], *res["kinds"].values()]:
            acc["tokens_per_second"] = acc["decode_tokens"] / acc["decode_seconds"] if acc.get("decode_seconds") else 0.0
            if acc.get("cycles"):
                acc["tau"] = (acc["decode_tokens"]) / acc["cycles"]
        res["identical"] = all(p["identical_to_target"] for p in res["per_prompt"])
        res["n_prompt_mismatch"] = sum(p["n_prompt"] not in (-1, p["n_prompt_ids"]) for p in res["per_prompt"])
    return dict(config=dict(target=str(target), drafter=str(drafter) if drafter else None, threads=threads,
                            n_new=n_new, n_ctx=n_ctx, kinds=list(kinds), n_per_kind=n_per_kind,
                            prompts=str(Path(prompts).relative_to(ROOT)) if Path(prompts).is_absolute() else str(prompts),
                            rows=[r["id"] for r in rows], load_seconds=load_s, bench_seconds=bench_s,
                            others_before=others_before, others_after=other_load(),
                            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(default)"),
                            machine=machine(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            command="python -m benchmarks.agent_bench " + " ".join(sys.argv[1:])),
                results=results)


def other_load() -> dict:
    """The load average and the other processes using CPU (what else ran beside the benchmark)."""
    out = dict(loadavg=open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else [])
    try:
        ps = subprocess.run(["ps", "-eo", "pid,pcpu,etimes,args", "--sort=-pcpu"], capture_output=True, text=True,
                            timeout=10).stdout.splitlines()[1:8]
        me = os.getpid()
        out["top"] = [ln.strip()[:160] for ln in ps if ln.split()[0] != str(me) and float(ln.split()[1]) >= 5.0]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return out


def identity_check(target: str, drafter: Optional[str], threads: int, ids_wanted: list, n_new: int = 256,
                   n_ctx: int = 4096, prompts: Path = PROMPTS) -> list:
    """T = 0: the target alone, context drafts and (with a drafter) the mix on the prompts named;
    per prompt and configuration, None (identical) or the generated-token index where the text parts
    from the target alone's. With 1 thread the one-token decodes sum like batched rows (README,
    "Exactness at T = 0"), so any departure there would be a driver bug."""
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from dflash2_gguf.chat.templates import chat_prompt_ids

    rows = [r for r in pick_rows(prompts, KINDS, 10**6) if r["id"] in ids_wanted]
    g = SamplingParams.greedy_params()
    confs = [("target alone", None, {}), ("context drafts", None, dict(spec_type="ngram-simple,ngram-mod"))]
    confs += [("mix (default)", drafter, {})] if drafter else []
    out = []
    decs = {n: DFlashDecoder(target, d, n_ctx=n_ctx, n_threads=threads) for n, d, _ in confs}
    try:
        for r in rows:
            ids = chat_prompt_ids(decs["target alone"], r["messages"])
            toks = {n: decs[n].generate(ids, max_tokens=n_new, sampling=g, **kw).tokens for n, _, kw in confs}
            a = toks["target alone"]
            for n, b in toks.items():
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                             None if len(a) == len(b) else min(len(a), len(b)))
                out.append(dict(id=r["id"], n_prompt=len(ids), config=n, departs_at=first))
                print(f"{r['id']} ({len(ids)} prompt tokens) {n}: " + ("identical" if first is None else
                      f"parts at generated token {first} (cell {len(ids) + first})"), flush=True)
    finally:
        for d in decs.values():
            d.close()
    return out


def machine() -> str:
    cpu = ""
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu or platform.processor()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


# ---------------------------------------------------------------------------- report

def _short(path: Optional[str]) -> str:
    return Path(path).name if path else "none"


def ours_default(rep: dict) -> str:
    return "mix (default)" if "mix (default)" in rep["results"] else "context drafts"


def best_llama(rep: dict, kind: Optional[str] = None) -> Optional[str]:
    """llama-server's best n-gram configuration (overall, or on one kind)."""
    cands = [(n, r) for n, r in rep["results"].items()
             if r["backend"] == "llama-server" and any(n.endswith(t) for t in LLAMA_NGRAM)]
    if not cands:
        return None
    key = (lambda nr: nr[1]["all"]["tokens_per_second"]) if kind is None else \
        (lambda nr: nr[1]["kinds"].get(kind, {}).get("tokens_per_second", 0.0))
    return max(cands, key=key)[0]


def _tps(res: dict, kind: Optional[str]) -> float:
    acc = res["all"] if kind is None else res["kinds"].get(kind, {})
    return acc.get("tokens_per_second", 0.0)


def _drafts(res: dict, kind: Optional[str]) -> str:
    acc = res["all"] if kind is None else res["kinds"].get(kind, {})
    if res["backend"] == "llama-server":
        return f"{acc.get('accepted', 0)} / {acc.get('drafted', 0)}" if acc.get("drafted") else ""
    parts = []
    if acc.get("cycles"):
        parts.append(f"tau {acc['tau']:.2f}")
    for src, d in sorted((acc.get("sources") or {}).items()):
        if d.get("drafted"):
            parts.append(f"{src} {d['accepted']}/{d['drafted']} in {d['cycles']} cycles")
    return "; ".join(parts)


def geomean_speedup(rep: dict, name: str, base: str = "target alone") -> float:
    """Geometric mean over the prompts of this configuration's decode tokens/s over ``base``'s on the
    same prompt (each prompt weighs the same; the "all" column weighs them by time)."""
    import math

    b = {p["id"]: p for p in rep["results"][base]["per_prompt"]}
    logs = []
    for p in rep["results"][name]["per_prompt"]:
        q = b.get(p["id"])
        if q and p["decode_seconds"] > 0 and q["decode_seconds"] > 0 and p["decode_tokens"] > 0 and q["decode_tokens"] > 0:
            logs.append(math.log((p["decode_tokens"] / p["decode_seconds"]) / (q["decode_tokens"] / q["decode_seconds"])))
    return math.exp(sum(logs) / len(logs)) if logs else float("nan")


def model_markdown(rep: dict) -> str:
    c = rep["config"]
    alone = rep["results"].get("target alone")
    best = best_llama(rep)
    by_kind = [k for k in c["kinds"] if any(k in r["kinds"] for r in rep["results"].values())]
    head = ["configuration", "decode tok/s (all)", "vs target alone", "vs llama.cpp best n-gram",
            "per-prompt geomean vs target alone",
            *[f"{k} tok/s" for k in by_kind], "T=0 identical", "accepted / drafted (tau; per source)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, res in rep["results"].items():
        tps = _tps(res, None)
        ra = tps / _tps(alone, None) if alone and _tps(alone, None) else float("nan")
        rb = tps / _tps(rep["results"][best], None) if best else float("nan")
        nm = f"**{name}**" if name == ours_default(rep) else (f"*{name}*" if name == best else name)
        ident = "yes" if res["identical"] else f"no ({sum(not p['identical_to_target'] for p in res['per_prompt'])})"
        gm = geomean_speedup(rep, name) if alone else float("nan")
        lines.append(f"| {nm} | {tps:.1f} | {ra:.2f}x | {rb:.2f}x | {gm:.2f}x | "
                     + " | ".join(f"{_tps(res, k):.1f}" for k in by_kind)
                     + f" | {ident} | {_drafts(res, None)} |")
    return "\n".join(lines)


def verdict(rep: dict) -> str:
    d = ours_default(rep)
    res = rep["results"]
    best = best_llama(rep)
    parts = []
    if "target alone" in res:
        parts.append(f"our default ({d}) / target alone = {_tps(res[d], None) / _tps(res['target alone'], None):.3f}")
    if best:
        parts.append(f"/ llama.cpp's best n-gram ({best.split(' ', 1)[1]}) = "
                     f"{_tps(res[d], None) / _tps(res[best], None):.3f}")
        if "target alone" in res:
            parts.append(f"per-prompt geometric means vs target alone: our default "
                         f"{geomean_speedup(rep, d):.3f}, llama.cpp's best n-gram {geomean_speedup(rep, best):.3f}")
        others = [n for n, r in res.items() if r["backend"] == "llama-server"]
        top = max(others, key=lambda n: _tps(res[n], None))
        if top != best:
            parts.append(f"/ llama.cpp's best overall ({top.split(' ', 1)[1]}) = "
                         f"{_tps(res[d], None) / _tps(res[top], None):.3f}")
    if "llama.cpp none" in res and "target alone" in res:
        parts.append(f"llama.cpp none / our target alone = "
                     f"{_tps(res['llama.cpp none'], None) / _tps(res['target alone'], None):.3f}")
        same = sum(p["identical_to_ours_target"] for p in res["llama.cpp none"]["per_prompt"])
        parts.append(f"llama-server's T = 0 tokens equal ours on {same} of {len(res['llama.cpp none']['per_prompt'])} prompts")
    mism = {n: r["n_prompt_mismatch"] for n, r in res.items() if r["backend"] == "llama-server"}
    parts.append("prompt token counts agree with llama-server's tokens_evaluated on every request" if not any(mism.values())
                 else f"prompt token count mismatches: {mism}")
    return "; ".join(parts) + "."


def where_time_goes(rep: dict) -> str:
    out = []
    for name, res in rep["results"].items():
        if res["backend"] != "ours":
            continue
        a = res["all"]
        sec = a.get("decode_seconds", 0.0) or 1e-9
        kh = ", ".join(f"{k}: {n}" for k, n in enumerate(a.get("k_hist", [])) if n)
        out.append(f"- {name}: {a.get('cycles', 0)} target passes for {a.get('decode_tokens', 0)} tokens "
                   f"(tau {a.get('tau', 0):.2f}); verify passes {100 * a.get('t_target', 0) / sec:.0f}%, drafter + "
                   f"injection {100 * (a.get('t_draft', 0) + a.get('t_inject', 0)) / sec:.0f}%, sampling/acceptance "
                   f"{100 * a.get('t_sample', 0) / sec:.0f}% of decode time; k histogram {{{kh}}}")
        cm = res.get("cost_model")
        if cm and cm.get("verify_ms"):
            v = cm["verify_ms"]
            out[-1] += ("; cost model: verify " + ", ".join(f"{x:.1f}" for x in v[:17])
                        + f" ms for 1..{min(len(v), 17)} rows")
    return "\n".join(out)


def report_section(reps: list, plot: Optional[str], notes: str = "") -> str:
    lines = [SECTION_START, "## Agent-shaped work: context drafts", "",
             "Issue 43, Deliver 5. Prompts made here, not drawn from any benchmark set "
             "(`data/agent/agent_prompts.jsonl`, built by `python -m benchmarks.agent_prompts`): code edits of "
             "real 55-130-line files (four of this repository at 007f1e3, four of idna 3.21, click 8.5.1, "
             "jinja2 3.1.6 and requests 2.34.2 as installed here; rename / fix this bug / add a method, \"print the "
             "whole file\"), JSON tool-call round trips (a tool result in the context, \"call the update tool with "
             "one field changed\"), a scripted coding-agent transcript replayed turn by turn (turns spread over the "
             "session), and prose as the control. Each prompt is rendered once by our chat renderer and the same "
             "token ids go to our decoder and to stock `llama-server` built from the pinned llama.cpp 0c1e570 "
             "(`/completion` with `\"prompt\": ids`), one process per `--spec-type`, all loaded for the whole "
             "run; every prompt runs on every configuration back to back (rotated order), T = 0. Decode "
             "tokens/s: tokens after the first over the time after the prefill, summed over the prompts. "
             "**Bold**: our default (with the drafter the mix: DFlash, ngram-simple and ngram-mod chosen per "
             "cycle, context drafts continued by the DFlash block where that pays; without one, context drafts "
             "alone); *italic*: llama.cpp's best n-gram type.", ""]
    if notes:
        lines += [notes, ""]
    for rep in reps:
        c = rep["config"]
        lines += [f"### {_short(c['target'])}" + (f" with {_short(c['drafter'])}" if c["drafter"] else ""), "",
                  f"{len(c['rows'])} prompts ({', '.join(c['kinds'])}; {c['n_per_kind']} per kind), "
                  f"{c['n_new']} new tokens at most, {c['threads']} threads, n_ctx {c['n_ctx']}; {c['date']}; "
                  f"{c['machine']}; load average {' / '.join(c.get('others_before', {}).get('loadavg', []))} before, "
                  f"{' / '.join(c.get('others_after', {}).get('loadavg', []))} after; wall time "
                  f"{c['bench_seconds'] / 60:.0f} min; OMP_WAIT_POLICY {c.get('omp_wait_policy', '(default)')}.", "", f"`{c['command']}`", "", model_markdown(rep), "", verdict(rep), "",
                  "Where our decode time goes:", "", where_time_goes(rep), ""]
    if plot:
        lines += [f"![decode tokens/s by configuration and kind]({plot})", ""]
    lines.append(SECTION_END)
    return "\n".join(lines)


def write_plot(reps: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(reps), 1, figsize=(11, 3.6 * len(reps)), squeeze=False)
    for ax, rep in zip(axes[:, 0], reps):
        names = list(rep["results"])
        kinds = [k for k in rep["config"]["kinds"]] + ["all"]
        alone = rep["results"].get("target alone") or rep["results"].get("llama.cpp none")
        w = 0.8 / len(names)
        for j, n in enumerate(names):
            res = rep["results"][n]
            vals = [_tps(res, None if k == "all" else k) / max(_tps(alone, None if k == "all" else k), 1e-9)
                    for k in kinds]
            hatch = "//" if res["backend"] == "llama-server" else None
            ax.bar([i + j * w for i in range(len(kinds))], vals, w, label=n, hatch=hatch)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(kinds))], kinds)
        ax.set_ylabel("decode tok/s vs our target alone")
        c = rep["config"]
        ax.set_title(_short(c["target"]) + (f" + {_short(c['drafter'])}" if c["drafter"] else "")
                     + f", {c['threads']} threads, T = 0")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replace_section(md_path: Path, section: str) -> None:
    text = md_path.read_text(encoding="utf-8") if md_path.exists() else "# Benchmarks\n"
    if SECTION_START in text and SECTION_END in text:
        a, b = text.index(SECTION_START), text.index(SECTION_END) + len(SECTION_END)
        text = text[:a] + section + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    md_path.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model")
    p.add_argument("-md", "--model-draft", default=None)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-n", "--n-predict", type=int, default=256)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--n-per-kind", type=int, default=8)
    p.add_argument("--prompts", default=str(PROMPTS))
    p.add_argument("--no-llama", action="store_true", help="our configurations only")
    p.add_argument("--llama-types", default=",".join(LLAMA_NGRAM))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--report", nargs="*", default=None, help="instead: render these JSON results")
    p.add_argument("--benchmarks", default=None, help="with --report: rewrite this file's section")
    p.add_argument("--plot", default=None, help="with --report: write the PNG here")
    p.add_argument("--notes", default="", help="with --report: a paragraph (what else ran, ...), or @FILE")
    p.add_argument("--identity", default=None, metavar="ID,ID,...",
                   help="instead: T = 0 identity of target alone / context drafts / mix on these prompts (-t threads)")
    a = p.parse_args(argv)
    if a.notes.startswith("@"):
        a.notes = Path(a.notes[1:]).read_text(encoding="utf-8").strip()
    if a.identity:
        res = identity_check(a.model, a.model_draft, a.threads, a.identity.split(","), a.n_predict, a.ctx_size)
        return 0 if all(r["departs_at"] is None for r in res) else 1
    if a.report is not None:
        reps = [json.loads(Path(f).read_text()) for f in a.report]
        if a.plot:
            write_plot(reps, a.plot)
        sec = report_section(reps, os.path.relpath(a.plot, Path(a.benchmarks).parent) if a.plot and a.benchmarks
                             else a.plot, a.notes)
        print(sec)
        if a.benchmarks:
            replace_section(Path(a.benchmarks), sec)
        return 0
    if not a.model:
        p.error("-m TARGET.gguf (or --report)")
    rep = run_bench(a.model, a.model_draft, threads=a.threads, n_new=a.n_predict, n_ctx=a.ctx_size,
                    kinds=[k for k in a.kinds.split(",") if k], n_per_kind=a.n_per_kind, prompts=Path(a.prompts),
                    llama=not a.no_llama, llama_types=[t for t in a.llama_types.split(",") if t])
    print(model_markdown(rep))
    print()
    print(verdict(rep))
    print(where_time_goes(rep))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
