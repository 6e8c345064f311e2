"""Chat rendering side by side with stock llama-server: the same conversations sent to both
servers' ``/apply-template``, the rendered prompts compared byte for byte (issue 13, test a).

Usage::

    # llama-server is built once from the pinned source (benchmarks/llama_server_compat.py):
    python -m benchmarks.apply_template_compat -m SmolLM2-135M-Instruct.Q4_1.gguf \\
        -m Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf [--out report.md]

For each target GGUF both servers are started on it (target alone), every conversation of
:data:`CONVERSATIONS` is rendered by each, and the report lists, per target and conversation,
whether the two prompts are identical and, if not, where they part. Exit code 1 on any
difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CONVERSATIONS = {
    "user": {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    "system + 3 turns": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "And a third?"}]},
    "content parts": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]}]},
    "tools + tool result": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"}]},
}


def first_difference(a: str, b: str) -> Optional[int]:
    """Index where ``a`` and ``b`` part (None when equal)."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def render_both(ours: str, theirs: str) -> List[dict]:
    """Every conversation through both ``/apply-template``: rows ``{"name", "identical", "at",
    "ours", "theirs"}`` (the prompts around the first difference)."""
    import httpx

    rows = []
    for name, body in CONVERSATIONS.items():
        got = []
        for base in (ours, theirs):
            r = httpx.post(base + "/apply-template", json=body, timeout=120)
            got.append(r.json().get("prompt") if r.status_code == 200 else f"<HTTP {r.status_code}: {r.text[:200]}>")
        at = first_difference(*got)
        rows.append({"name": name, "identical": at is None, "at": at,
                     "ours": got[0] if at is None else got[0][max(0, at - 40):at + 40],
                     "theirs": got[1] if at is None else got[1][max(0, at - 40):at + 40]})
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    from benchmarks.llama_server_compat import _free_port, _wait, build_llama_server

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", action="append", required=True, help="target GGUF (repeatable)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    lines = ["| target | conversation | identical | where they part (ours / llama-server) |", "|---|---|---|---|"]
    bad = 0
    for model in a.model:
        po, pt = _free_port(), _free_port()
        procs = [subprocess.Popen([str(build_llama_server()), "-m", model, "-c", "2048", "--port", str(pt), "-np", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                 subprocess.Popen([sys.executable, "-m", "dflash2_gguf.server", "-m", model, "-c", "2048",
                                   "--port", str(po)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            _wait(f"http://127.0.0.1:{pt}", procs[0])
            _wait(f"http://127.0.0.1:{po}", procs[1])
            for r in render_both(f"http://127.0.0.1:{po}", f"http://127.0.0.1:{pt}"):
                bad += not r["identical"]
                where = "" if r["identical"] else f"char {r['at']}: {json.dumps(r['ours'])} / {json.dumps(r['theirs'])}"
                lines.append(f"| {Path(model).name} | {r['name']} | {'yes' if r['identical'] else '**no**'} | {where} |")
        finally:
            for pr in procs:
                pr.terminate()
                pr.wait(30)
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        Path(a.out).write_text(md)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
