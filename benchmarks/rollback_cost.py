"""What rolling a target back costs per cycle, next to a verify pass, and what the adaptive policy
then picks: tiny random targets of each mechanism (benchmarks/tiny_targets.py) with a random
DFlash 2 drafter (block 6).

For each target: the verify pass over 1 and 6 rows (the cost model measured by the driver), the
rollback per cycle that rolled back (state copy + restore + re-decode for ``checkpoint``, the tail
removal for ``native`` and ``kv``) from a full-block generation whose drafts are all rejected, one
copy of the recurrent state (what a checkpoint holds; native rollback keeps block - 1 more), and
the draft lengths the adaptive policy chose over a generation with the measured cost model.

    python -m benchmarks.rollback_cost [--archs qwen35,qwen3next,...] [--tokens 200] [-t 2]

Prints a markdown table (BENCHMARKS.md, "Hybrid and recurrent targets"). Timings want an idle
machine: run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.tiny_targets import ARCHS, random_drafter, tiny_target

__all__ = ["measure", "main"]

PROMPT = [1, 5, 9, 14, 20, 7, 7, 33, 12, 40, 41, 8]


def measure(arch: str, drafter_dir: Path, n_tokens: int, n_threads: int) -> dict:
    """One row of the table for ``arch`` (see the module docstring)."""
    from dflash2_gguf import DFlashDecoder, SamplingParams

    target = tiny_target(arch)
    drafter = random_drafter(target, drafter_dir / f"{arch}-drafter.gguf")
    sp = SamplingParams(temperature=0.0)
    with DFlashDecoder(target, drafter, n_ctx=1024, n_threads=n_threads, cost_model=None) as dec:
        costs = dec.measure_cost_model(reps=7, save=False)
        # rollback per cycle: the full block every cycle, nearly every draft rejected
        dec._set_costs(costs, fixed=True)
        full = dec.generate(PROMPT, max_tokens=n_tokens, sampling=sp, ignore_eos=True, adaptive=False,
                            spec_type="draft-dflash").stats
        state = dec.engine.recurrent_state_bytes
        mode = dec.rollback_mode
    with DFlashDecoder(target, drafter, n_ctx=1024, n_threads=n_threads, cost_model=None) as dec:
        measured = dec.measure_cost_model(reps=7, save=False)
        dec._set_costs(measured, fixed=False)
        adaptive = dec.generate(PROMPT, max_tokens=n_tokens, sampling=sp, ignore_eos=True, spec_type="draft-dflash").stats
    per_rb = 1000.0 * full.t_rollback_s / max(full.n_rollbacks, 1)
    return dict(arch=arch, mode=mode, verify1=costs["verify_ms"][0], verify6=costs["verify_ms"][5],
                rollback=per_rb, redecoded=full.n_redecoded / max(full.n_rollbacks, 1),
                rollback_model=measured.get("rollback_ms", 0.0), state_kib=state / 1024.0,
                k_hist={k: n for k, n in enumerate(adaptive.k_hist) if n},
                skipped=adaptive.n_drafter_skipped, cycles=adaptive.n_cycles)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rollback_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default="qwen35,lfm2,qwen3next,mamba2,gemma3",
                   help=f"comma-separated, of {', '.join(ARCHS)}")
    p.add_argument("--tokens", type=int, default=200, help="new tokens per generation")
    p.add_argument("-t", "--threads", type=int, default=2)
    a = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollback-cost-") as tmp:
        for arch in a.archs.split(","):
            rows.append(measure(arch.strip(), Path(tmp), a.tokens, a.threads))
    print("| target | rollback | verify 1 row (ms) | verify 6 rows (ms) | rollback per cycle (ms) | "
          "tokens re-decoded per rollback | rollback in the cost model (ms) | recurrent state (KiB) | "
          "adaptive policy: drafts per cycle (k: cycles) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arch']} | {r['mode']} | {r['verify1']:.2f} | {r['verify6']:.2f} | {r['rollback']:.3f} | "
              f"{r['redecoded']:.2f} | {r['rollback_model']:.2f} | {r['state_kib']:.0f} | {r['k_hist']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
