"""What a target verify pass costs by the number of rows it verifies and the context it attends to.

A cycle that verifies k drafts runs one target pass over k + 1 rows (the anchor and the drafts)
at the current context length; whether drafting pays is E(tokens) / cost(k + 1 rows) against one
token per one-row pass (native/draft_policy.h). This measures that cost the way the driver's
target context runs it (llama-cpp-python's libllama, the pinned build; n_batch = n_ubatch = 512,
flash attention auto, weight repacking on, logits for every row): after a prefill of C random
tokens, the fastest of ``--reps`` passes over r rows, each rolled back before the next.

    python -m benchmarks.verify_cost -m MODEL.gguf [-t 2] [--contexts 64,512,1024,2048,3200]
        [--rows 1,2,3,4,8,16,32,48,65] [--reps 3]

Prints a markdown table (BENCHMARKS.md, "What a verify pass costs"): milliseconds per pass, and
each as a multiple of the one-row pass at the same context. Timings want an idle machine: run
nothing else meanwhile, and leave OMP_WAIT_POLICY at its default.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

__all__ = ["measure", "markdown", "main"]


def _ints(text: str) -> list:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def measure(model: str, contexts: list, rows: list, threads: int = 2, reps: int = 3, seed: int = 0) -> dict:
    """Milliseconds of one target pass over each row count after each context length.

    Args:
        model: Path of the target GGUF.
        contexts: Context lengths C (tokens in the KV cache before the pass).
        rows: Row counts r of the pass (logits for every row, as a verify pass asks).
        threads: CPU threads (decode and batch).
        reps: Passes per (C, r); the fastest counts (other work only ever adds time).
        seed: Seed of the random token ids (prefill and rows).

    Returns:
        ``{C: {r: ms}}`` (floats, milliseconds).

    Raises:
        ValueError: reps or threads below 1, more than 512 rows, the model does not load, a context of
            max(contexts) + max(rows) tokens cannot be created for it, or its memory cannot drop
            a pass's rows (a recurrent target).
        RuntimeError: a ``llama_decode`` call failed.
    """
    import llama_cpp as L

    if reps < 1 or threads < 1:
        raise ValueError(f"reps and threads must be >= 1, got reps={reps}, threads={threads}")
    if max(rows) > 512:
        raise ValueError(f"a pass verifies at most 512 rows here (n_batch), got {max(rows)}")
    n_ctx = max(contexts) + max(rows) + 8
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mdl = L.llama_model_load_from_file(str(model).encode(), mp)
    if not mdl:
        raise ValueError(f"could not load {model}: is it a GGUF file?")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 512, 512
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(mdl, cp)
    if not ctx:
        L.llama_model_free(mdl)
        raise ValueError(f"could not create a context of {n_ctx} tokens for {model}")
    mem = L.llama_get_memory(ctx)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(mdl))
    rng = random.Random(seed)
    batch = L.llama_batch_init(max(512, max(rows)), 0, 1)

    def decode(toks: list, pos0: int, all_logits: bool) -> None:
        for i, t in enumerate(toks):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(toks) - 1
        batch.n_tokens = len(toks)
        rc = L.llama_decode(ctx, batch)
        L.llama_synchronize(ctx)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (rc {rc})")

    lo, hi = (100, n_vocab - 100) if n_vocab > 400 else (0, n_vocab)  # away from special ids when there are many

    def tokens(n: int) -> list:
        return [rng.randrange(lo, hi) for _ in range(n)]

    out = {}
    try:
        for c in contexts:
            L.llama_memory_clear(mem, True)
            pre = tokens(c)
            for i in range(0, c, 512):
                decode(pre[i:i + 512], i, False)
            decode(tokens(1), c, True)  # warm-up pass at this length
            if not L.llama_memory_seq_rm(mem, 0, c, -1):
                raise ValueError(f"{model}: its memory cannot drop a pass's rows (a recurrent target); "
                                 "this benchmark measures attention targets")
            out[c] = {}
            for r in rows:
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    decode(tokens(r), c, True)
                    best = min(best, (time.perf_counter() - t0) * 1e3)
                    L.llama_memory_seq_rm(mem, 0, c, -1)
                out[c][r] = best
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(mdl)
    return out


def markdown(res: dict) -> str:
    """The table: one line per row count, per context ``ms (x one-row pass)``."""
    contexts = sorted(res)
    rows = sorted(next(iter(res.values())))
    lines = ["| rows | " + " | ".join(f"context {c}: ms (x 1 row)" for c in contexts) + " |",
             "|---|" + "---|" * len(contexts)]
    for r in rows:
        cells = [f"{res[c][r]:.1f} ({res[c][r] / res[c][rows[0]]:.2f}x)" for c in contexts]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.verify_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="target GGUF")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--contexts", type=_ints, default=[64, 512, 1024, 2048, 3200])
    ap.add_argument("--rows", type=_ints, default=[1, 2, 3, 4, 8, 16, 32, 48, 65])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    if not Path(a.model).is_file():
        ap.error(f"no such file: {a.model}")
    if a.reps < 1 or a.threads < 1:
        ap.error("--reps and --threads must be >= 1")
    if a.rows[0] != 1:
        a.rows = [1] + [r for r in a.rows if r != 1]  # the ratios are to the one-row pass
    try:
        res = measure(a.model, a.contexts, a.rows, a.threads, a.reps)
    except ValueError as e:
        ap.error(str(e))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
