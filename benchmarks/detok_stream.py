"""Streaming detokenization costs time linear in the output length (issue 44, Deliver 3).

Streams 1,000 / 2,000 / 4,000 tokens of SmolLM2-135M's vocabulary (README.md tokenized) one token
at a time through :class:`dflash2_gguf.decoder.detok.StreamingDetokenizer` on the engine's
detokenizer, and, as the baseline, re-detokenizes the whole output at every step (what the stream
did before). Prints the fastest of 3 runs of each; the streamed text is checked against the
one-shot detokenization.

Usage::

    python -m benchmarks.detok_stream [-m SmolLM2-135M-Instruct.Q4_1.gguf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    from dflash2_gguf import DFlashDecoder, assets
    from dflash2_gguf.decoder.detok import StreamingDetokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: the pinned SmolLM2-135M-Instruct Q4_1)")
    a = ap.parse_args(argv)
    model = a.model or str(assets.fetch("smollm2-135m-instruct-q4_1"))
    with DFlashDecoder(model, None, n_ctx=512, n_threads=1) as dec:
        eng = dec.engine
        ids = dec.tokenize((ROOT / "README.md").read_text(encoding="utf-8") * 3, add_special=False)[:4000]

        def detok(t):
            return bytes(eng.detokenize(list(t), False))

        for n in (1000, 2000, 4000):
            stream_s = whole_s = float("inf")
            for _ in range(3):
                sd = StreamingDetokenizer(detok)
                t0 = time.perf_counter()
                text = "".join(sd.feed([t]) for t in ids[:n]) + sd.feed([], final=True)
                stream_s = min(stream_s, time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(1, n + 1):
                    detok(ids[:i])
                whole_s = min(whole_s, time.perf_counter() - t0)
            assert text == detok(ids[:n]).decode("utf-8", errors="replace")
            print(f"{n} tokens, one at a time: streaming {stream_s * 1e3:.1f} ms ({stream_s / n * 1e6:.1f} us a "
                  f"token); re-detokenizing the whole output each step {whole_s * 1e3:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
