"""Agent-shaped transcript: time to first token and time per turn, prompt cache on/off, drafter
on/off (issue 12, item 7). Prints a markdown table and writes JSON.

An agent resends the whole conversation every turn behind a long system prompt. This script
builds one: a system prompt of >= 3000 tokens (tool descriptions and paragraphs of this repository's
README as the "project instructions"), then 6 user turns; each turn's prompt is the
previous transcript (with the model's own answers) plus the new user message, rendered with the
GGUF's chat template. For each configuration it replays the 6 turns on a fresh decoder and reports
per turn: prompt tokens, tokens reused from the prompt cache, time to first token (prefill +
first token) and total time, T = 0.

Usage (idle machine, OpenMP wait policy at its default)::

    python -m benchmarks.agent_transcript -m SmolLM2-135M-Instruct.Q4_1.gguf \\
        -md models/smollm2-135m-dflash2.gguf --out bench-out/agent.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = """
Tools you can call (answer with a JSON object {"name": ..., "arguments": {...}}):
- read_file(path: string): the text of a file of the repository.
- write_file(path: string, text: string): replace a file.
- run(command: string): run a shell command in the repository root; returns stdout and stderr.
- search(query: string): search the repository for a string; returns file:line matches.
"""
TURNS = [
    "Which two commands set up a fresh machine, and what does each do?",
    "How do I convert a released drafter checkpoint to GGUF?",
    "What does the acceptance length measure?",
    "Why is the drafter slower than the target alone on this CPU?",
    "Which flags does the server share with generate and bench?",
    "Summarise in one sentence what this project is for.",
]


def system_prompt(min_tokens: int, tokenize) -> str:
    """Project instructions of at least ``min_tokens`` tokens: tool descriptions, then paragraphs
    of this repository's README and docs until the count is reached."""
    text = "You are a coding agent working in the dflash2-gguf repository.\n" + TOOLS + "\nProject documentation:\n"
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    paragraphs = [q for f in files for q in f.read_text(encoding="utf-8").split("\n\n")]
    while len(tokenize(text)) < min_tokens and paragraphs:
        text += "\n\n" + "\n\n".join(paragraphs[:8])
        del paragraphs[:8]
    return text


def run_config(target: str, drafter, *, cache: bool, n_ctx: int, n_new: int, threads, sys_tokens: int) -> dict:
    """Replay the transcript once; per-turn figures."""
    from dflash2_gguf import DFlashDecoder, SamplingParams
    from dflash2_gguf.chat.templates import chat_prompt_ids

    greedy = SamplingParams.greedy_params()
    rows = []
    with DFlashDecoder(target, drafter, n_ctx=n_ctx, n_threads=threads, cache_ram_mib=1024 if cache else 0) as dec:
        msgs = [{"role": "system", "content": system_prompt(sys_tokens, dec.tokenize)}]
        for i, user in enumerate(TURNS):
            msgs.append({"role": "user", "content": user})
            ids = chat_prompt_ids(dec, msgs)
            t0 = time.perf_counter()
            first = None
            text, toks = "", []
            for ch in dec.generate(ids, max_tokens=n_new, sampling=greedy, cache_prompt=cache, stream=True):
                if first is None:
                    first = time.perf_counter() - t0
                text += ch.text
                toks += ch.tokens
                st = ch.stats
            total = time.perf_counter() - t0
            msgs.append({"role": "assistant", "content": text})
            rows.append(dict(turn=i + 1, n_prompt=st.n_prompt, n_cached=st.n_cached, n_generated=st.n_generated,
                             ttft_s=first, total_s=total, acceptance_length=st.acceptance_length, tokens=toks))
            print(f"  turn {i + 1}: prompt {st.n_prompt}, cached {st.n_cached}, ttft {first:.2f} s, "
                  f"total {total:.2f} s", file=sys.stderr)
    return dict(rows=rows)


def markdown(results: dict) -> str:
    names = list(results)
    head = "| turn | prompt tokens | " + " | ".join(f"{n}: cached / TTFT s / total s" for n in names) + " |"
    sep = "|---|---|" + "---|" * len(names)
    lines = [head, sep]
    n_turns = len(results[names[0]]["rows"])
    for t in range(n_turns):
        r0 = results[names[0]]["rows"][t]
        cells = []
        for n in names:
            r = results[n]["rows"][t]
            cells.append(f"{r['n_cached']} / {r['ttft_s']:.2f} / {r['total_s']:.2f}")
        lines.append(f"| {t + 1} | {r0['n_prompt']} | " + " | ".join(cells) + " |")
    tot = [sum(r["total_s"] for r in results[n]["rows"]) for n in names]
    lines.append("| all | | " + " | ".join(f"total {x:.1f} s" for x in tot) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-md", "--model-draft", required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=8192)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--system-tokens", type=int, default=3000)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    results = {}
    for name, drafter, cache in (("cache on, drafter on", a.model_draft, True),
                                 ("cache on, drafter off", None, True),
                                 ("cache off, drafter on", a.model_draft, False),
                                 ("cache off, drafter off", None, False)):
        print(name, file=sys.stderr)
        results[name] = run_config(a.model, drafter, cache=cache, n_ctx=a.ctx_size, n_new=a.n_predict,
                                   threads=a.threads, sys_tokens=a.system_tokens)
    same = all(results[n]["rows"][t]["tokens"] == results["cache off, drafter off"]["rows"][t]["tokens"]
               for n in results for t in range(len(TURNS)))
    md = markdown(results)
    print(md)
    print(f"\nT = 0 texts identical across the four configurations: {same}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(results=results, identical=same, markdown=md), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
