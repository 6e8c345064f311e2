#!/usr/bin/env python
"""Acceptance length of drafter GGUFs on held-out prompt sets (T=0), drafter runs only.

    python scripts/measure_acceptance.py --n-prompts 10 --max-new-tokens 256 \
        --datasets gsm8k,humaneval,mbpp,mt-bench D1.gguf [D2.gguf ...]

Prompts: ``dflash2_gguf.bench.prompt_sets.load_prompts(dataset, n)`` (the authors' order and template,
the same as ``dflash2-gguf bench --dataset``; first user turn only), the target's chat template,
greedy, a fixed draft length (every cycle verifies the whole block: the adaptive policy would stop
drafting on this CPU and leave nothing to measure). Prints one JSON line per drafter and prompt
set: mean acceptance length (tau, bonus included; averaged per request, then over requests),
tokens, and the per-request values. ``dflash2-gguf bench --spec-draft-adaptive off`` measures the
same with the target-alone comparison and token-equality check on top.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("drafters", nargs="+")
    p.add_argument("--target", default=None, help="target GGUF (default: the pinned SmolLM2 Q4_1)")
    p.add_argument("--n-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--datasets", default="gsm8k", help="comma-separated prompt sets (bench's --dataset names)")
    a = p.parse_args()
    from dflash2_gguf.decoder.api import DFlashDecoder
    from dflash2_gguf.bench.prompt_sets import load_prompts

    target = a.target
    if target is None:
        from dflash2_gguf.assets import fetch

        target = str(fetch("smollm2-135m-instruct-q4_1"))
    sets = {name: load_prompts(name, a.n_prompts) for name in a.datasets.split(",")}
    for d in a.drafters:
        with DFlashDecoder(target, d, n_ctx=2048, n_threads=a.threads) as dec:
            for name, prompts in sets.items():
                t0 = time.perf_counter()
                taus, ntok = [], 0
                for turns in prompts:
                    r = dec.generate(messages=[{"role": "user", "content": turns[0]}],
                                     max_tokens=a.max_new_tokens, temperature=0.0, adaptive=False)
                    taus.append(r.stats.acceptance_length)
                    ntok += len(r.tokens)
                print(json.dumps({"drafter": d, "dataset": name, "n_prompts": len(prompts),
                                  "max_new_tokens": a.max_new_tokens, "tokens": ntok,
                                  "tau": round(sum(taus) / len(taus), 4),
                                  "tau_per_request": [round(t, 3) for t in taus],
                                  "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
