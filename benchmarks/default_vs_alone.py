"""The default configuration against the target alone on the five standard prompt sets (issue 43:
"on the five standard sets the default stays at or above 0.97x the target alone").

One decoder per configuration, both loaded for the whole run: the target alone (``spec_type
none``) and the default (with a drafter: DFlash, ngram-simple and ngram-mod chosen per cycle by
expected gain, context drafts continued by the DFlash block where that pays). Every prompt runs
on both back to back, the order alternating from prompt to prompt, T = 0, each prompt prefilled
on an emptied cache. Decode tokens/s: tokens after the first over the seconds after the prefill,
summed over a set's prompts. The default's cost model is measured at load (not a saved one).

Usage (an idle machine, OpenMP's wait policy at its default)::

    python -m benchmarks.default_vs_alone -m SmolLM2-135M-Instruct.Q4_1.gguf \\
        -md models/smollm2-135m-dflash2.gguf -t 2 --n-prompts 10 -n 128
"""

from __future__ import annotations

import argparse
import json
import sys

SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")


def run(target: str, drafter: str, *, threads: int, n_prompts: int, n_new: int, n_ctx: int = 4096) -> dict:
    """Per set: ``{"alone": tok/s, "default": tok/s, "ratio": default / alone, "identical": n,
    "n": prompts, "sources": per-source counts of the default}``."""
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from dflash2_gguf.chat.templates import chat_prompt_ids
    from dflash2_gguf.bench.prompt_sets import load_prompts

    g = SamplingParams.greedy_params()
    alone = DFlashDecoder(target, None, n_ctx=n_ctx, n_threads=threads)
    default = DFlashDecoder(target, drafter, n_ctx=n_ctx, n_threads=threads)
    default.measure_cost_model(reps=3, save=False)
    out = {}
    try:
        for name in SETS:
            acc = {"alone": [0, 0.0], "default": [0, 0.0]}
            same, src = 0, {}
            for i, turns in enumerate(load_prompts(name, n_prompts)):
                ids = chat_prompt_ids(alone, [{"role": "user", "content": turns[0]}])
                order = [("alone", alone, {"spec_type": "none"}), ("default", default, {})]
                toks = {}
                for label, dec, kw in (order if i % 2 == 0 else order[::-1]):
                    r = dec.generate(ids, max_tokens=n_new, sampling=g, cache_prompt=False, **kw)
                    s = r.stats
                    acc[label][0] += s.n_generated - 1
                    acc[label][1] += s.t_total_s - s.t_prefill_s
                    toks[label] = list(r.tokens)
                    if label == "default":
                        for k, v in s.sources.items():
                            e = src.setdefault(k, {"cycles": 0, "drafted": 0, "accepted": 0})
                            for kk in e:
                                e[kk] += v[kk]
                same += toks["alone"] == toks["default"]
            tps = {k: n / t if t > 0 else 0.0 for k, (n, t) in acc.items()}
            out[name] = dict(alone=tps["alone"], default=tps["default"], ratio=tps["default"] / tps["alone"],
                             identical=same, n=n_prompts, sources=src)
            print(f"{name}: target alone {tps['alone']:.1f} tok/s, default {tps['default']:.1f} tok/s "
                  f"({out[name]['ratio']:.3f}x), T = 0 identical {same}/{n_prompts}; default's sources {src}",
                  flush=True)
    finally:
        alone.close()
        default.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-md", "--model-draft", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--n-prompts", type=int, default=10)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    res = run(a.model, a.model_draft, threads=a.threads, n_prompts=a.n_prompts, n_new=a.n_predict)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
