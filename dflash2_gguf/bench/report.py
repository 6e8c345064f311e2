"""Report of ``dflash2-gguf bench``: ``bench.json``, ``bench.md`` and the per-position plot.

``benchmarks/report.py`` (in the repository) assembles BENCHMARKS.md from the ``bench.json``
files written here; the JSON layout is ``{config, summary, requests, wall_s[, side_by_side]}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from ..options import FLASH_ATTN

__all__ = ["markdown_table", "plot_per_position", "write_report", "fmt"]


def fmt(x: Optional[float], nd: int = 2) -> str:
    """``x`` with ``nd`` decimals; "n/a" for None or NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def markdown_table(report: dict) -> str:
    """The markdown report: settings, the main table, per-position acceptance, the histogram and
    the side-by-side runs when present."""
    fa_word = {v: k for k, v in FLASH_ATTN.items()}
    c, s = report["config"], report["summary"]
    lines = [
        f"### dflash2-gguf bench: {c['dataset']} ({s['n_requests']} requests from {c['n_prompts']} prompts), "
        f"T={c['temperature']}, max {c['max_new_tokens']} new tokens",
        "",
        f"target `{Path(c['target']).name}`, drafter `{Path(c['drafter']).name}` (DFlash {c['drafter_version']}, "
        f"block {c['block_size']}, n_max {c['n_draft_max']}), threads {c['threads'] or 'all'}, "
        f"capture {c['capture_path']}, rollback {c.get('rollback', 'kv')}, flash attention {fa_word[c.get('flash_attn')]}, "
        f"repack {'on' if c.get('repack', True) else 'off'}",
        "",
        "| run | tokens | tokens/s | decode tokens/s | speedup | tau | T=0 mismatches |",
        "|---|---|---|---|---|---|---|",
        f"| target alone | {s['base_tokens']} | {fmt(s['base_tokens_per_second'])} | "
        f"{fmt(s['base_decode_tokens_per_second'])} | 1.00 | - | - |",
        f"| target + drafter | {s['spec_tokens']} | {fmt(s['spec_tokens_per_second'])} | "
        f"{fmt(s['spec_decode_tokens_per_second'])} | {fmt(s['speedup'])} "
        f"(decode {fmt(s['decode_speedup'])}) | {fmt(s['acceptance_length'], 3)} | "
        f"{s['mismatches'] if c['temperature'] == 0 else 'n/a (T>0)'} |",
    ]
    up = report.get("side_by_side")
    if up:
        lines += ["", "Side by side (same target, drafter and rendered prompts; ratio = ours / theirs):", "",
                  "| decoder | tokens | tokens/s | tau | ours / theirs | T=0 text agrees with ours |",
                  "|---|---|---|---|---|---|"]
        for row in up["rows"]:
            lines.append(f"| {row['name']} | {row['tokens']} | {fmt(row['tokens_per_second'])} | "
                         f"{fmt(row.get('acceptance_length'), 3)} | {fmt(row.get('ours_over_theirs'))} "
                         f"({row.get('compared_to', '')}) | {row.get('text_agrees') or '-'} |")
        for note in up.get("notes", []):
            lines.append(f"\n{note}")
    ppa = s["per_position_acceptance"]
    lines += ["", "Per-position conditional acceptance (draft i accepted | drafts before it accepted):", "",
              "| position | " + " | ".join(str(i + 1) for i in range(len(ppa))) + " |",
              "|---|" + "---|" * len(ppa),
              "| P(accept) | " + " | ".join(fmt(p, 3) for p in ppa) + " |",
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
    ax.set_title(f"{c['dataset']}: tau {fmt(s['acceptance_length'], 2)}, speedup {fmt(s['speedup'])}x")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(report: dict, out) -> Path:
    """Write ``bench.json``, ``bench.md`` and ``per_position_acceptance.png`` into folder ``out``
    (created if needed). Returns the folder."""
    od = Path(out)
    od.mkdir(parents=True, exist_ok=True)
    (od / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (od / "bench.md").write_text(markdown_table(report))
    plot_per_position(report, od / "per_position_acceptance.png")
    return od
