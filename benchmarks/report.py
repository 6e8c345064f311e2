"""Assemble BENCHMARKS.md from ``dflash2-gguf bench`` runs (one folder per prompt set and T).

    python -m benchmarks.report --runs bench-runs --out BENCHMARKS.md [--plot benchmarks/per_position_acceptance.png]

Reads every ``<runs>/*/bench.json`` (written by ``dflash2-gguf bench --out``), and writes:

- the machine (CPU model, cores, memory, llama-cpp-python version, ggml's system info line);
- the exact commands (``<runs>/commands.txt``, written by ``scripts/benchmarks.sh``);
- one summary row per run: requests, acceptance length tau (bonus included), tokens/s of the
  target alone and with the drafter, speedup (time per token without / with, prefill included)
  and decode speedup, T=0 mismatches, and the side-by-side runs when present (upstream
  ``llama-speculative-simple``'s tau and decode speedup over ``llama-completion``; our decode
  tokens/s with the drafter over upstream's; llama-cpp-python prompt-lookup speedup);
- at T=0, how many requests each decoder's text departs from our target-alone text;
- the cost of a speculative cycle per run (verify, draft, the rest, in ms and in one-token
  decodes: the acceptance length at which drafting breaks even);
- per-position conditional acceptance per run, and one plot with a line per run.

Text between ``<!-- analysis -->`` and ``<!-- /analysis -->`` in an existing output file is kept:
that is where the hand-written reading of the figures goes; so is everything after
``<!-- /analysis -->`` (measurements added by hand).

Draft-length sweeps (``dflash2-gguf bench --sweep --out <runs>/sweep-<set>-t<T>``, issue 14: the
target alone, every fixed k and the adaptive policy on the same requests, back to back) are read
from ``<runs>/*/sweep.json`` and rendered between ``<!-- sweep -->`` and ``<!-- /sweep -->``;
``--sweeps-only`` rewrites just that block of an existing file (the other sections stay as they
are), so sweeps can be added run by run: a prompt set and temperature with no ``sweep.json`` under
``--runs`` keeps its row, command line and cost-model line from the block being replaced (the
``bench-runs/`` folder of an earlier session need not survive for its figures to stay).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Optional

from dflash2_gguf.bench.run import policy_summary

KEEP_START, KEEP_END = "<!-- analysis -->", "<!-- /analysis -->"
SWEEP_START, SWEEP_END = "<!-- sweep -->", "<!-- /sweep -->"
_SET_ORDER = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]


def _f(x: Optional[float], nd: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _md_table(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table: header, separator, one line per row of cell strings."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def machine() -> str:
    """One paragraph describing this machine (CPU, cores, memory, library versions)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB memory"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        import llama_cpp

        lib = f"llama-cpp-python {llama_cpp.__version__}; ggml: `{llama_cpp.llama_print_system_info().decode().strip()}`"
    except Exception as e:  # pragma: no cover - reported, not fatal
        lib = f"llama-cpp-python not importable ({e})"
    return (f"{cpu}, {os.cpu_count()} logical cores{mem}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; {lib}")


def _load(runs: Path, name: str) -> list[dict]:
    """Every ``name`` file under ``runs`` (one level down), in prompt-set order, T=0 first."""
    reps = [json.loads(p.read_text()) for p in sorted(runs.glob(f"*/{name}"))]

    def key(r: dict) -> tuple:
        ds = r["config"]["dataset"]
        return (_SET_ORDER.index(ds) if ds in _SET_ORDER else 99, ds, r["config"]["temperature"])
    return sorted(reps, key=key)


def load_runs(runs: Path) -> list[dict]:
    """Every ``bench.json`` under ``runs`` (``bench --out`` folders), in prompt-set order."""
    return _load(runs, "bench.json")


def load_sweeps(runs: Path) -> list[dict]:
    """Every ``sweep.json`` under ``runs`` (``bench --sweep --out`` folders), in prompt-set order."""
    return _load(runs, "sweep.json")


def _set_key(dataset: str, temperature: str) -> tuple:
    """Prompt-set order, then temperature: how rows, commands and cost models are sorted."""
    return (_SET_ORDER.index(dataset) if dataset in _SET_ORDER else 99, dataset, float(temperature))


class KeptSweeps:
    """What an existing sweep block says of the (prompt set, T) pairs that this run of the report
    has no ``sweep.json`` for: their table rows, command lines and cost-model lines, verbatim.

    Args:
        block: The text between ``SWEEP_START`` and ``SWEEP_END`` of the file being rewritten
            (empty: nothing is kept).
        have: The ``(dataset, T as written, e.g. "0")`` pairs that come from sweep.json files.
    """

    def __init__(self, block: str, have: set) -> None:
        self.rows: dict[tuple, str] = {}
        self.commands: dict[tuple, str] = {}
        self.cost_lines: dict[tuple, str] = {}
        in_cmds = False
        for ln in block.splitlines():
            if ln.startswith("```"):
                in_cmds = ln.startswith("```bash")
                continue
            if in_cmds:
                ds, t = _flag(ln, "--dataset"), _flag(ln, "--temp")
                if ds and t and (ds, t) not in have:
                    self.commands[_set_key(ds, t)] = ln.rstrip()
            elif ln.startswith("| ") and not ln.startswith("| prompt set"):
                cells = [c.strip() for c in ln.strip("|").split("|")]
                if len(cells) > 2 and (cells[0], cells[1]) not in have:
                    self.rows[_set_key(cells[0], cells[1])] = ln
            elif ln.startswith("- ") and " T=" in ln and ":" in ln:
                ds, t = ln[2:].split(":", 1)[0].split(" T=")
                if (ds, t) not in have:
                    self.cost_lines[_set_key(ds, t)] = ln


def _flag(cmd: str, flag: str) -> str:
    """The value after ``flag`` in a command line, or ""."""
    words = cmd.split()
    return words[words.index(flag) + 1] if flag in words[:-1] else ""


def _t(r: dict) -> str:
    """A sweep's temperature as the table and the commands write it ("0", "1", "0.7")."""
    return f"{r['config']['temperature']:g}"


def _merged(new: dict, kept: dict) -> list[str]:
    """Lines keyed by ``_set_key``, the new ones and the kept ones, in prompt-set order."""
    both = {**kept, **new}
    return [both[k] for k in sorted(both)]


def sweep_table(sweeps: list[dict], kept: Optional[KeptSweeps] = None) -> str:
    """One row per sweep: the target alone's decode tokens/s, each fixed k's and the adaptive
    policy's decode tokens/s as a ratio to it, the adaptive policy's ratio with the prefill
    included, and its ratio to the best fixed k; ``kept`` rows (earlier runs) sorted in."""
    n_fixed = max(len(r["rows"]) - 2 for r in sweeps)
    cols = (["prompt set", "T", "requests", "target alone tok/s"] + [f"k={k}" for k in range(1, n_fixed + 1)]
            + ["adaptive", "adaptive, prefill incl.", "adaptive / best fixed k", "adaptive tau",
               "T=0 requests departing: adaptive / most of a fixed k"])
    rows = []
    for r in sweeps:
        c, rr = r["config"], r["rows"]
        fixed = [_f(x["ratio_vs_alone"], 3) for x in rr[1:-1]] + ["-"] * (n_fixed - (len(rr) - 2))
        ad = rr[-1]
        rows.append([c["dataset"], f"{c['temperature']:g}", str(c["n_prompts"]), _f(rr[0]["tokens_per_second"], 1)]
                    + fixed + [f"**{ad['ratio_vs_alone']:.3f}**", _f(ad.get("overall_ratio_vs_alone"), 3),
                               _f(r["adaptive_vs_best_fixed"], 3), _f(ad["acceptance_length"], 2),
                               _departures(r)])
    table = _md_table(cols, rows).splitlines()
    new = {_set_key(r["config"]["dataset"], _t(r)): ln for r, ln in zip(sweeps, table[2:])}
    return "\n".join(table[:2] + _merged(new, kept.rows if kept else {}))


def _context_summary(r: dict) -> str:
    """The sweep's context rows (issue 43) as ratios to the target alone, "" for sweeps without them."""
    ctx = r.get("context_rows")
    if not ctx:
        return ""
    return "; context rows (vs target alone): " + ", ".join(f"{x['name']} {x['ratio_vs_alone']:.3f}" for x in ctx)


def _departures(r: dict) -> str:
    if r["config"]["temperature"] != 0:
        return "-"
    rr = r["rows"]
    if "departed" not in rr[-1]:  # a sweep from before the count: only whether all were equal
        return "0 / 0" if r["identical"] else "some"
    return f"{rr[-1]['departed']} / {max(x['departed'] for x in rr[1:-1])}"


def sweep_section(sweeps: list[dict], commands: str, old_block: str = "") -> str:
    """The draft-length section: the commands, the table, what the columns mean, the cost models.
    ``old_block``: the section being replaced; its prompt sets / temperatures that ``sweeps`` has
    no run for are kept (:class:`KeptSweeps`)."""
    c0 = sweeps[0]["config"]
    kept = KeptSweeps(old_block, {(r["config"]["dataset"], _t(r)) for r in sweeps})
    cm_lines = {_set_key(r["config"]["dataset"], _t(r)):
                f"- {r['config']['dataset']} T={_t(r)}: verify "
                + ", ".join(f"{x:.1f}" for x in cm.get("verify_ms", [])) + f" ms for 1.. rows; drafter pass "
                f"{cm.get('draft_ms', float('nan')):.1f} ms"
                + (f"; adaptive: {ps}" if (ps := policy_summary(r["rows"][-1])) else "")
                + _context_summary(r)
                for r in sweeps if (cm := r.get("cost_model"))}
    cmds = {_set_key(_flag(ln, "--dataset"), _flag(ln, "--temp") or "0"): ln.rstrip()
            for ln in commands.strip().splitlines() if ln.strip()}
    n_kept = len(kept.rows)
    return "\n".join([
        SWEEP_START,
        "## Draft length: target alone, every fixed k, adaptive",
        "",
        f"Each request runs every configuration back to back through one decoder (the target alone "
        f"and the adaptive policy twice, side by side, in the order alone, adaptive, adaptive, alone or "
        f"its mirror, then the fixed k, the order reversed every other request), {c0['max_new_tokens']} new tokens, first turns only; tokens/s of the decode "
        "phase (tokens after the first / time after the prefill) unless marked; the k columns and "
        "\"adaptive\" are ratios to the target alone. Machine: " + machine()
        + (f" ({n_kept} of the rows come from earlier runs of the same command on a machine of the same "
           "kind; each row's configurations ran side by side in one run.)" if n_kept else ""),
        "",
        "```bash",
        "\n".join(_merged(cmds, kept.commands)) or "(commands.txt missing)",
        "```",
        "",
        sweep_table(sweeps, kept),
        "",
        "Cost models in use at the end of each run (measured at load, then updated online), and what the "
        "adaptive policy did:",
        "",
        *_merged(cm_lines, kept.cost_lines),
        SWEEP_END,
    ])


def _block(text: str, start: str, end: str) -> str:
    """The text between the markers ``start`` and ``end`` (exclusive), or "" when either is absent."""
    return text.split(start, 1)[1].split(end, 1)[0] if start in text and end in text else ""


def replace_block(text: str, block: str, start: str, end: str, before: str = "") -> str:
    """``text`` with the block from ``start`` to ``end`` replaced by ``block`` (inserted before the
    first occurrence of ``before`` when absent, else appended)."""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    if before and before in text:
        head, rest = text.split(before, 1)
        return head + block + "\n\n" + before + rest
    return text.rstrip("\n") + "\n\n" + block + "\n"


def _side(rep: dict) -> dict[str, Any]:
    rows = {r["name"]: r for r in (rep.get("side_by_side") or {}).get("rows", [])}
    out: dict[str, Any] = {}
    up_s = next((r for n, r in rows.items() if n.startswith("llama-speculative-simple")), None)
    up_b = next((r for n, r in rows.items() if n.startswith("llama-completion")), None)
    pl_b = rows.get("llama-cpp-python Llama (plain)")
    pl_l = rows.get("llama-cpp-python prompt lookup")
    if up_s:
        out["up_tau"] = up_s.get("acceptance_length")
        out["ours_over_up"] = up_s.get("ours_over_theirs")
        out["up_speedup"] = _ratio(up_s.get("tokens_per_second"), (up_b or {}).get("tokens_per_second"))
    if pl_b and pl_l:
        out["pl_speedup"] = _ratio(pl_l.get("tokens_per_second"), pl_b.get("tokens_per_second"))
    return out


def summary_table(reps: list[dict]) -> str:
    columns = ["prompt set", "T", "requests", "tau", "target alone tok/s", "with drafter tok/s", "speedup",
               "decode speedup", "T=0 mismatches", "upstream tau", "upstream decode speedup",
               "ours / upstream (decode tok/s, drafter)", "prompt-lookup speedup"]
    rows = []
    for r in reps:
        c, s, sd = r["config"], r["summary"], _side(r)
        rows.append([c["dataset"], f"{c['temperature']:g}", str(s["n_requests"]), _f(s["acceptance_length"], 3),
                     _f(s["base_tokens_per_second"]), _f(s["spec_tokens_per_second"]), _f(s["speedup"]),
                     _f(s["decode_speedup"]), str(s["mismatches"]) if c["temperature"] == 0 else "-",
                     _f(sd.get("up_tau"), 3), _f(sd.get("up_speedup")), _f(sd.get("ours_over_up")),
                     _f(sd.get("pl_speedup"))])
    return _md_table(columns, rows)


def cycle_cost(rep: dict) -> Optional[dict]:
    """Where the time of one speculative cycle goes, from a run's per-request timings.

    Returns milliseconds: ``decode`` (one target-alone decode pass, prefill excluded), ``verify``
    (the target pass over [anchor, drafts]), ``draft`` (the drafter pass) and ``rest`` (feature
    injection and sampling) per cycle; ``break_even`` = cycle / decode, the acceptance length at
    which drafting starts to pay; ``expected`` = pooled tau / break_even, the decode speedup those
    costs predict (compare ``decode_speedup``). ``None`` when the timings are missing.
    """
    base_s = base_n = spec_n = 0.0
    spec = {"verify": 0.0, "draft": 0.0, "rest": 0.0}
    for q in rep.get("requests", []):
        b, sp = q.get("base") or {}, q.get("spec") or {}
        if "t_target_s" not in sp or not b.get("n_cycles") or not sp.get("n_cycles"):
            return None
        base_s += b["t_total_s"] - b["t_prefill_s"]
        base_n += b["n_cycles"]
        spec["verify"] += sp["t_target_s"]
        spec["draft"] += sp["t_draft_s"]
        spec["rest"] += sp.get("t_inject_s", 0.0) + sp.get("t_sample_s", 0.0)
        spec_n += sp["n_cycles"]
    if not base_n or not spec_n:
        return None
    out = {"decode": 1e3 * base_s / base_n, **{k: 1e3 * v / spec_n for k, v in spec.items()}}
    out["break_even"] = (out["verify"] + out["draft"] + out["rest"]) / out["decode"]
    tau = rep["summary"].get("acceptance_length_pooled")
    out["expected"] = tau / out["break_even"] if tau else None
    return out


def cost_table(reps: list[dict]) -> str:
    """Markdown table of :func:`cycle_cost` per run (runs without timings are left out)."""
    columns = ["prompt set", "T", "decode ms/token (target alone)", "verify ms/cycle", "draft ms/cycle",
               "rest ms/cycle", "break-even tau (cycle / decode)", "pooled tau", "expected decode speedup",
               "measured decode speedup"]
    rows = []
    for r in reps:
        c, s, k = r["config"], r["summary"], cycle_cost(r)
        if k is not None:
            rows.append([c["dataset"], f"{c['temperature']:g}", _f(k["decode"], 1), _f(k["verify"], 1),
                         _f(k["draft"], 1), _f(k["rest"], 1), _f(k["break_even"]),
                         _f(s.get("acceptance_length_pooled"), 3), _f(k["expected"]), _f(s.get("decode_speedup"))])
    return _md_table(columns, rows)


def text_diverges(ours: str, theirs: str) -> bool:
    """Whether ``theirs`` departs from ``ours`` (T=0 texts of the same prompt) before either ends.

    ``theirs`` may carry the echoed prompt in front (upstream's tools print it) and an
    ``[end of text]`` marker; it is aligned at the first 40 characters of ``ours``. A text that
    stops earlier or later but agrees up to there does not diverge.
    """
    o = ours.strip()
    t = theirs.replace("[end of text]", "")
    j = t.find(o[:40])
    if j < 0:
        return bool(o)
    t = t[j:].strip()
    m = min(len(o), len(t))
    return o[:m] != t[:m]


_SIDE_TEXTS = [("upstream_spec", "upstream speculative"), ("upstream_base", "upstream plain"),
               ("llama_cpp_python", "llama-cpp-python plain"), ("prompt_lookup", "prompt lookup")]


def departure_context(req: dict) -> Optional[int]:
    """Context length in KV cells (prompt + generated tokens before it) when the token where
    ``ours + drafter`` first departs from the target alone was chosen; None if it never departs."""
    j = req.get("first_mismatch")
    return None if j is None else int(req["n_prompt"]) + int(j)


def lossless_table(reps: list[dict]) -> str:
    """T=0 runs: requests whose text departs from our target-alone text, per decoder, and the
    smallest context at which one of ours departs."""
    rows = []
    for r in reps:
        if r["config"]["temperature"] != 0:
            continue
        base = [q["base"]["text"] for q in r["requests"]]
        side = (r.get("side_by_side") or {}).get("requests") or []
        at = [c for c in map(departure_context, r["requests"]) if c is not None]
        cells = [r["config"]["dataset"], str(len(base)), f"{r['summary']['mismatches']}/{len(base)}",
                 str(min(at)) if at else "-"]
        for key, _ in _SIDE_TEXTS:
            pairs = [(b, q[key]["text"]) for b, q in zip(base, side) if key in q]
            cells.append(f"{sum(text_diverges(b, t) for b, t in pairs)}/{len(pairs)}" if pairs else "n/a")
        rows.append(cells)
    return _md_table(["prompt set", "requests", "ours + drafter", "ours: first departure at (cells, min)",
                      *(n for _, n in _SIDE_TEXTS)], rows)


def per_position_table(reps: list[dict]) -> str:
    n = max((len(r["summary"]["per_position_acceptance"]) for r in reps), default=0)
    rows = []
    for r in reps:
        p = [_f(x, 3) for x in r["summary"]["per_position_acceptance"]]
        rows.append([r["config"]["dataset"], f"{r['config']['temperature']:g}", *p, *[""] * (n - len(p))])
    return _md_table(["prompt set", "T", *(f"pos {i + 1}" for i in range(n))], rows)


MIN_REACHED = 20   # plot a position only where at least this many drafts reached it


def plot(reps: list[dict], path: Path) -> Path:
    """Per-position conditional acceptance, one line per run (solid T=0, dashed T>0); positions
    reached by fewer than :data:`MIN_REACHED` drafts in a run are left out (too few to say)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in reps:
        reached = r["summary"].get("pos_reached") or []
        p = [math.nan if x is None or (i < len(reached) and reached[i] < MIN_REACHED) else x
             for i, x in enumerate(r["summary"]["per_position_acceptance"])]
        c = r["config"]
        ax.plot(range(1, len(p) + 1), p, marker="o", linestyle="-" if c["temperature"] == 0 else "--",
                label=f"{c['dataset']} T={c['temperature']:g}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | earlier drafts accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def render(reps: list[dict], *, commands: str, plot_rel: str, kept: str) -> str:
    c0 = reps[0]["config"] if reps else {}
    drafter = Path(c0.get("drafter", "?")).name
    target = Path(c0.get("target", "?")).name
    n = c0.get("n_draft_max", "?")
    if c0.get("adaptive") is False:
        drafts = f"every pass verifying {n} drafts: adaptive draft length off, so the rows measure the drafter itself"
    else:
        drafts = f"up to {n} drafts per pass, as many as the adaptive draft length chooses"
    return "\n".join([
        "# Benchmarks",
        "",
        f"Target `{target}`, drafter `{drafter}` (DFlash {c0.get('drafter_version', '?')}, block "
        f"{c0.get('block_size', '?')}, {drafts}), "
        f"up to {c0.get('max_new_tokens', '?')} new tokens per request. Every row runs the target alone and "
        "with the drafter through the same decoder, one after the other, on the same machine; side-by-side "
        "columns run upstream's `llama-speculative-simple` / `llama-completion` (llama.cpp 0c1e570) and "
        "llama-cpp-python's prompt-lookup decoding on the same rendered prompts in the same run.",
        "",
        f"Machine: {machine()}",
        "",
        "Commands (as `scripts/benchmarks.sh` ran them, with OpenMP's default wait policy):",
        "",
        "```bash",
        commands.strip(),
        "```",
        "",
        "## Summary",
        "",
        summary_table(reps),
        "",
        "tau = tokens committed per target pass (bonus included), averaged per request. Speedup = time per "
        "output token of the target alone / with the drafter, prefill included; decode speedup excludes the "
        "prefill. T=0 mismatches = requests whose tokens differ between the two runs.",
        "",
        "## T=0: output against the target alone",
        "",
        lossless_table(reps),
        "",
        "Requests whose greedy text departs (before either stops) from our decoder's target-alone text. "
        "\"ours + drafter\" compares token ids; the other columns compare the texts the tools print. "
        "\"first departure at\": the context (prompt + generated tokens, KV cells) when the first differing "
        "token was chosen, smallest over the set. Up to 256 cells a row of a batched pass and a one-token "
        "decode get bit-identical logits on this CPU build with flash attention; beyond, llama.cpp's "
        "one-token decodes switch to a split-KV attention kernel that sums in another order "
        "(tests/native/test_driver_smollm2.py).",
        "",
        "## Cost of a cycle",
        "",
        cost_table(reps),
        "",
        "Per cycle the target verifies [anchor, drafts] in one pass and the drafter drafts the next "
        "block; drafting pays once the acceptance length (tokens per cycle) exceeds the cycle's cost "
        "in one-token decodes (break-even tau). Timings summed over the run's requests.",
        "",
        "## Per-position acceptance",
        "",
        per_position_table(reps),
        "",
        f"![per-position acceptance]({plot_rel})",
        "",
        f"The plot leaves out positions that fewer than {MIN_REACHED} drafts of a run reached; the table "
        "keeps them.",
        "",
        KEEP_START,
        kept.strip() or "## Reading the figures\n\n(to be written after the run)",
        KEEP_END,
        "",
    ])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, type=Path, help="folder with one bench --out folder per run")
    ap.add_argument("--out", default="BENCHMARKS.md", type=Path)
    ap.add_argument("--plot", default=Path("benchmarks/per_position_acceptance.png"), type=Path)
    ap.add_argument("--sweeps-only", action="store_true",
                    help="rewrite only the draft-length sweep section of an existing --out")
    a = ap.parse_args(argv)
    sweeps = load_sweeps(a.runs)
    scmds = a.runs / "sweep-commands.txt"
    sweep_cmds = scmds.read_text() if scmds.is_file() else ""
    if a.sweeps_only:
        if not sweeps:
            raise SystemExit(f"no */sweep.json under {a.runs}")
        if not a.out.is_file():
            raise SystemExit(f"{a.out} does not exist (--sweeps-only updates an existing report)")
        old = a.out.read_text()
        text = replace_block(old, sweep_section(sweeps, sweep_cmds, _block(old, SWEEP_START, SWEEP_END)),
                             SWEEP_START, SWEEP_END, before="## Summary")
        tmp = a.out.with_suffix(".md.tmp")
        tmp.write_text(text)
        os.replace(tmp, a.out)
        print(f"wrote the sweep section of {a.out} ({len(sweeps)} sweeps)")
        return 0
    reps = load_runs(a.runs)
    if not reps:
        raise SystemExit(f"no */bench.json under {a.runs}")
    old = a.out.read_text() if a.out.is_file() else ""
    kept = _block(old, KEEP_START, KEEP_END)
    cmds = a.runs / "commands.txt"
    commands = cmds.read_text() if cmds.is_file() else "(commands.txt missing)"
    plot(reps, a.plot)
    rel = os.path.relpath(a.plot, a.out.parent)
    tmp = a.out.with_suffix(".md.tmp")
    text = render(reps, commands=commands, plot_rel=rel, kept=kept)
    old_sweeps = _block(old, SWEEP_START, SWEEP_END)
    if sweeps:
        text = replace_block(text, sweep_section(sweeps, sweep_cmds, old_sweeps), SWEEP_START, SWEEP_END,
                             before="## Summary")
    elif old_sweeps:  # no sweep this time: the section stays as it was
        text = replace_block(text, SWEEP_START + old_sweeps + SWEEP_END, SWEEP_START, SWEEP_END, before="## Summary")
    if KEEP_END in old:  # hand-written sections after the analysis stay too
        after = old.split(KEEP_END, 1)[1].strip("\n")
        if after:
            text = text.rstrip("\n") + "\n\n" + after + "\n"
    tmp.write_text(text)
    os.replace(tmp, a.out)
    print(f"wrote {a.out} ({len(reps)} runs) and {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
