"""New tokens/s of training-data capture: the native path (dflash2_gguf.train.generate) against
the ctypes path it replaced (BatchedGreedyGenerator of an earlier commit, inline cb_eval capture),
on the same prompts, same slots, same threads, in one run.

    python scripts/bench_capture.py --baseline-commit e8a8f82 --n-prompts 32 --batch-size 16

The baseline's two files (dflash2_gguf/train/{generate,capture}.py at that commit) are read with
`git show` into a temporary package; both paths get the same token ids (the serving chat
renderer) and capture the same target layers. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _baseline_module(commit: str, tmp: Path):
    pkg = tmp / "baseline_capture"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("generate.py", "capture.py"):
        src = subprocess.run(["git", "show", f"{commit}:dflash2_gguf/train/{name}"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        (pkg / name).write_text(src)
    sys.path.insert(0, str(tmp))
    return importlib.import_module("baseline_capture.generate")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-commit", default="e8a8f82")
    ap.add_argument("--prompts", default="gsm8k-train")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--n-ctx", type=int, default=768, help="cells per sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-layer-ids", default="1,14,27")
    args = ap.parse_args(argv)

    from dflash2_gguf.assets import fetch
    from dflash2_gguf.train.cli import load_prompts
    from dflash2_gguf.train.generate import BatchedCapture

    target = str(fetch("smollm2-135m-instruct-q4_1"))
    ids = [int(x) for x in args.target_layer_ids.split(",")]
    texts = load_prompts(args.prompts, args.n_prompts)
    out = {"prompts": args.prompts, "n_prompts": len(texts), "batch_size": args.batch_size,
           "max_new_tokens": args.max_new_tokens, "threads": args.threads, "target_layer_ids": ids,
           "baseline_commit": args.baseline_commit}

    with BatchedCapture(target, ids, n_parallel=args.batch_size, n_ctx_seq=args.n_ctx,
                        n_threads=args.threads) as nat:
        ptoks = [nat.chat_prompt_ids(t) for t in texts]
        t0 = time.perf_counter()
        native = {s.key: s for s in nat.generate(ptoks, args.max_new_tokens)}
        dt = time.perf_counter() - t0
        new = sum(len(s.response) for s in native.values())
        out["native"] = {"capture_path": nat.capture_path, "new_tokens": new, "seconds": round(dt, 2),
                         "new_tok_s": round(new / dt, 2), "decode_calls": nat.stats["n_decode"]}

    with tempfile.TemporaryDirectory() as tmp:
        base = _baseline_module(args.baseline_commit, Path(tmp))
        with base.BatchedGreedyGenerator(target, n_parallel=args.batch_size, n_ctx_seq=args.n_ctx,
                                         n_threads=args.threads, kv_unified=True,
                                         target_layer_ids=ids) as g:
            t0 = time.perf_counter()
            ctypes_rows = {k: (resp, f) for k, resp, f in g.generate(ptoks, args.max_new_tokens)}
            dt = time.perf_counter() - t0
        new = sum(len(r) for r, _ in ctypes_rows.values())
        out["ctypes"] = {"capture_path": "cb_eval (ctypes)", "new_tokens": new, "seconds": round(dt, 2),
                         "new_tok_s": round(new / dt, 2)}

    out["ratio"] = round(out["native"]["new_tok_s"] / out["ctypes"]["new_tok_s"], 2)
    same = sum(native[k].response == ctypes_rows[k][0] for k in native)
    out["identical_answers"] = f"{same}/{len(native)}"
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
