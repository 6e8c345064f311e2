"""Send the same requests to stock llama-server and to ``dflash2-gguf serve``; report every
difference in status code and response keys (issue 17).

Usage::

    # both servers already running on the same target GGUF:
    python -m benchmarks.llama_server_compat --ours http://127.0.0.1:8081 --theirs http://127.0.0.1:8080
    # or build llama-server from the pinned source (once, ~16 min on 2 cores) and start both:
    python -m benchmarks.llama_server_compat --start -m target.gguf [-md drafter.gguf] [--out report.md]

The build reuses the pinned llama.cpp 0c1e570 source that :mod:`benchmarks.upstream_driver`
fetches (the llama-cpp-python 0.3.36 sdist), configured with ``-DLLAMA_BUILD_SERVER=ON
-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF`` in its own build folder, target ``llama-server``.

What is compared, per case (:data:`CASES`): the HTTP status, and the set of keys of the JSON
response (nested objects as ``a.b``, the first element of lists as ``a[0].b``; streamed
responses: the keys of the first and the last event, and of the first three as ``first3``).
Values are not compared (texts, timings and ids differ by nature), except the CORS headers
(``Access-Control-*``) and a case's ``values`` (key paths compared by value: the per-slot
context, the model id, aliases and tags). ``--start`` runs both servers as
``-c CTX -np 2 --alias b-alias,a-alias --tags y,x`` so that the per-slot split (llama-server:
``-c`` across the slots) and the alias sets are compared. Differences listed in :data:`DOCUMENTED` are the documented ones
(README "Serve it"); the report marks them, and any other difference is a bug to fix.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["Case", "CASES", "DOCUMENTED", "key_paths", "probe", "compare", "report_markdown",
           "build_llama_server", "main"]

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@dataclass(frozen=True)
class Case:
    """One request: ``name``, ``method``, ``path``, JSON ``body`` (or raw ``data`` with
    ``headers``), ``stream`` (read SSE events), ``values`` (key paths compared by value)."""

    name: str
    method: str
    path: str
    body: Optional[dict] = None
    data: Optional[bytes] = None
    headers: Optional[dict] = None
    stream: bool = False
    values: tuple = ()


CASES: List[Case] = [
    Case("health", "GET", "/health"),
    Case("models", "GET", "/v1/models",
         values=("data[0].id", "data[0].aliases", "data[0].tags", "data[0].meta.n_ctx", "models[0].name")),
    Case("models-no-v1", "GET", "/models"),
    Case("props", "GET", "/props", values=("default_generation_settings.n_ctx", "total_slots", "model_alias")),
    Case("slots", "GET", "/slots", values=("[0].n_ctx",)),
    Case("tokenize", "POST", "/tokenize", {"content": "Hello world"}),
    Case("tokenize-pieces", "POST", "/tokenize", {"content": "Hello", "with_pieces": True}),
    Case("tokenize-add-special", "POST", "/tokenize", {"content": ["Hello", 5], "add_special": True,
                                                       "with_pieces": True}, values=("tokens",)),
    Case("detokenize", "POST", "/detokenize", {"tokens": [1, 2, 3]}),
    Case("apply-template", "POST", "/apply-template", {"messages": CHAT}),
    Case("completion", "POST", "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0}),
    Case("completion-object-prompt", "POST", "/completion", {"prompt": {"prompt_string": "Hi"}, "n_predict": 2}),
    Case("completion-multi-prompt", "POST", "/completion", {"prompt": ["Hi", "Yo"], "n_predict": 2}),
    Case("completion-response-fields", "POST", "/completion",
         {"prompt": "Hi", "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict"]}),
    Case("completion-n-probs", "POST", "/completion", {"prompt": "Hi", "n_predict": 2, "n_probs": 2}),
    Case("completion-logit-bias", "POST", "/completion", {"prompt": "Hi", "n_predict": 2, "logit_bias": [[1, -1.0]]}),
    Case("completion-stream", "POST", "/completion", {"prompt": "Hi", "n_predict": 3, "stream": True,
                                                      "timings_per_token": True, "return_progress": True},
         stream=True),
    Case("completions-no-v1", "POST", "/completions", {"prompt": "Hi", "n_predict": 2}),
    Case("v1-completions", "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0}),
    Case("v1-completions-n-predict", "POST", "/v1/completions", {"prompt": "Hi", "n_predict": 2}),
    Case("v1-completions-stream", "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True},
         stream=True),
    Case("chat", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0}),
    Case("chat-no-v1", "POST", "/chat/completions", {"messages": CHAT, "max_tokens": 4}),
    Case("chat-tools-null", "POST", "/v1/chat/completions",
         {"messages": CHAT, "max_tokens": 2, "tools": None, "tool_choice": None}),
    Case("chat-unknown-fields", "POST", "/v1/chat/completions",
         {"messages": CHAT, "max_tokens": 2, "parallel_tool_calls": True, "some_future_field": 1}),
    Case("chat-speculative", "POST", "/v1/chat/completions",
         {"messages": CHAT, "max_tokens": 2, "speculative.n_max": 3, "speculative.p_min": 0.5}),
    Case("chat-continue", "POST", "/v1/chat/completions",
         {"messages": CHAT + [{"role": "assistant", "content": "It is"}], "max_tokens": 2}),
    Case("chat-stream", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True},
         stream=True),
    Case("chat-stream-timings", "POST", "/v1/chat/completions",
         {"messages": CHAT, "max_tokens": 3, "stream": True, "timings_per_token": True}, stream=True),
    Case("chat-stream-progress", "POST", "/v1/chat/completions",
         {"messages": CHAT, "max_tokens": 3, "stream": True, "timings_per_token": True, "return_progress": True},
         stream=True),
    Case("v1-completions-stream-progress", "POST", "/v1/completions",
         {"prompt": "Hi", "max_tokens": 3, "stream": True, "return_progress": True}, stream=True),
    Case("chat-input-tokens", "POST", "/chat/completions/input_tokens", {"messages": CHAT},
         values=("input_tokens", "object")),
    Case("chat-input-tokens-v1", "POST", "/v1/chat/completions/input_tokens",
         {"messages": CHAT + [{"role": "assistant", "content": "It is "}]}, values=("input_tokens",)),
    Case("responses-input-tokens", "POST", "/responses/input_tokens", {"input": "What is 2 + 2?"},
         values=("input_tokens",)),
    Case("apply-template-continue", "POST", "/apply-template",
         {"messages": CHAT + [{"role": "assistant", "content": "It is "}]}, values=("prompt",)),
    Case("chat-plain-curl-body", "POST", "/v1/chat/completions",
         data=json.dumps({"messages": CHAT, "max_tokens": 2}).encode(),
         headers={"Content-Type": "application/x-www-form-urlencoded"}),
    Case("chat-bad-type", "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "x"}),
    Case("context-exceeded", "POST", "/completion", {"prompt": "hello " * 40000, "n_predict": 2}),
    Case("cors-preflight", "OPTIONS", "/v1/chat/completions",
         headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}),
    Case("cors-preflight-bare-localhost", "OPTIONS", "/v1/chat/completions",
         headers={"Origin": "localhost", "Access-Control-Request-Method": "POST",
                  "Access-Control-Request-Headers": "authorization, content-type"}),
    Case("cors-options-no-preflight", "OPTIONS", "/v1/models", headers={"Origin": "http://[::1]"}),
    Case("cors-get", "GET", "/v1/models", headers={"Origin": "http://localhost"}),
    Case("web-page", "GET", "/"),
    Case("unknown-path", "GET", "/v1/nope"),
]

#: Documented differences: (case name or "*", "status" or a key path) -> why. A ``"*"`` entry
#: also covers the same key nested deeper (``[0].timings.draft_n``, ``generation_settings.speculative.n_max``).
DOCUMENTED: Dict[tuple, str] = {
    ("*", "error.param"): "ours adds OpenAI's `param` to error objects",
    ("*", "timings.draft_n"): "ours always reports drafting in `timings`",
    ("*", "timings.draft_n_accepted"): "ours always reports drafting in `timings`",
    ("*", "timings.acceptance_length"): "ours: tokens per target pass",
    ("*", "timings.n_cycles"): "ours: draft/verify cycles",
    ("*", "timings.tokens_per_second"): "ours: end-to-end tokens/s",
    ("models", "data[0].meta.target"): "ours: target/drafter file names",
    ("models", "data[0].meta.drafter"): "ours", ("models", "data[0].meta.spec_type"): "ours",
    ("models", "data[0].meta.n_draft_max"): "ours",
    ("models-no-v1", "data[0].meta.target"): "ours", ("models-no-v1", "data[0].meta.drafter"): "ours",
    ("models-no-v1", "data[0].meta.spec_type"): "ours", ("models-no-v1", "data[0].meta.n_draft_max"): "ours",
    ("health", "slots_idle"): "ours: slot counts in /health", ("health", "slots_processing"): "ours",
    ("health", "queued"): "ours",
    ("unknown-path", "status"): "llama-server answers unknown paths with its web UI / 404 text",
    ("web-page", "status"): "the compared llama-server is built without its web UI (LLAMA_USE_PREBUILT_UI=OFF): "
                            "404 there; ours serves its own page",
    ("*", "speculative.n_max"): "ours echoes the effective per-request draft settings in the generation "
                                "settings (llama-server takes them in a request, reports only speculative.types)",
    ("*", "speculative.n_min"): "ours echoes the effective per-request draft settings",
    ("*", "speculative.p_min"): "ours echoes the effective per-request draft settings",
    ("*", "speculative.adaptive"): "ours: the adaptive draft length (README 'Adaptive draft length')",
    ("*", "speculative.accept"): "ours: the acceptance rule at T > 0 (README 'Seeds: two acceptance rules')",
    ("*", "header access-control-allow-origin"): "with no Origin header ours sends no Access-Control-Allow-Origin, "
                                                 "llama-server an empty one (README 'CORS')",
    ("cors-get", "data[0].meta.target"): "ours", ("cors-get", "data[0].meta.drafter"): "ours",
    ("cors-get", "data[0].meta.spec_type"): "ours", ("cors-get", "data[0].meta.n_draft_max"): "ours",
}


def key_paths(obj: Any, prefix: str = "") -> set:
    """Key paths of a JSON value: ``a``, ``a.b``, ``a[0].b`` (first list element only)."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            out.add(p)
            out |= key_paths(v, p)
    elif isinstance(obj, list) and obj:
        out |= key_paths(obj[0], f"{prefix}[0]")
    return out


def _cors_headers(r: Any) -> dict:
    """The response's ``Access-Control-*`` headers (lower-case names), compared by value."""
    return {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


def probe(base: str, case: Case, api_key: Optional[str] = None, timeout: float = 300) -> dict:
    """Send ``case`` to ``base``; ``{"status", "keys", "headers"}`` (streams: keys of first and
    last event, prefixed ``first:`` / ``last:``; ``headers``: the CORS ones)."""
    import httpx

    headers = dict(case.headers or {})
    if api_key:
        headers.setdefault("Authorization", f"Bearer {api_key}")
    kw: dict = {"headers": headers, "timeout": timeout}
    if case.data is not None:
        kw["content"] = case.data
    elif case.body is not None:
        kw["json"] = case.body
    if case.stream:
        events = []
        with httpx.stream(case.method, base + case.path, **kw) as r:
            status = r.status_code
            for ln in r.iter_lines():
                if ln.startswith("data: ") and ln != "data: [DONE]":
                    try:
                        events.append(json.loads(ln[6:]))
                    except json.JSONDecodeError:
                        pass
            if status != 200:
                r.read()
        keys = set()
        cors = _cors_headers(r)
        if events:
            keys = {f"first:{k}" for k in key_paths(events[0])} | {f"last:{k}" for k in key_paths(events[-1])}
            for i, e in enumerate(events[:3]):
                keys |= {f"first3[{i}]:{k}" for k in key_paths(e)}
        return {"status": status, "keys": keys, "headers": cors, "values": {}}
    r = httpx.request(case.method, base + case.path, **kw)
    try:
        body = r.json()
    except ValueError:
        body = None
    return {"status": r.status_code, "keys": key_paths(body), "headers": _cors_headers(r),
            "values": {p: value_at(body, p) for p in case.values}}


def value_at(obj: Any, path: str) -> Any:
    """The value at a :func:`key_paths` path (``a.b``, ``a[0].b``, ``[0].n_ctx``); None if absent."""
    import re

    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        if index:
            obj = obj[int(index)] if isinstance(obj, list) and int(index) < len(obj) else None
        else:
            obj = obj.get(name) if isinstance(obj, dict) else None
    return obj


def _documented(case: str, what: str) -> Optional[str]:
    bare = what.split(":", 1)[-1]
    found = DOCUMENTED.get((case, what)) or DOCUMENTED.get((case, bare)) or DOCUMENTED.get(("*", bare))
    if found:
        return found
    for (c, key), why in DOCUMENTED.items():
        if c == "*" and bare.endswith("." + key):
            return why
    return None


def compare(ours: Dict[str, dict], theirs: Dict[str, dict]) -> List[dict]:
    """Every difference: ``{"case", "what" ("status", a key path, or ``header <name>`` for a CORS
    header whose value differs), "ours", "theirs", "documented" (the reason, or None)}``."""
    diffs = []
    for name in ours:
        o, t = ours[name], theirs.get(name)
        if t is None:
            continue
        if o["status"] != t["status"]:
            diffs.append({"case": name, "what": "status", "ours": o["status"], "theirs": t["status"],
                          "documented": _documented(name, "status")})
            continue
        for k in sorted(o["keys"] ^ t["keys"]):
            diffs.append({"case": name, "what": k, "ours": k in o["keys"], "theirs": k in t["keys"],
                          "documented": _documented(name, k)})
        ov, tv = o.get("values", {}), t.get("values", {})
        for k in sorted(set(ov) | set(tv)):
            if ov.get(k) != tv.get(k):
                what = f"value {k}"
                diffs.append({"case": name, "what": what, "ours": ov.get(k), "theirs": tv.get(k),
                              "documented": _documented(name, what)})
        oh, th = o.get("headers", {}), t.get("headers", {})
        for h in sorted(set(oh) | set(th)):
            if oh.get(h) != th.get(h):
                what = f"header {h}"
                diffs.append({"case": name, "what": what, "ours": oh.get(h), "theirs": th.get(h),
                              "documented": _documented(name, what)})
    return diffs


def report_markdown(diffs: List[dict], n_cases: int) -> str:
    """The report: a summary line and one table row per difference."""
    undoc = [d for d in diffs if not d["documented"]]
    lines = [f"# llama-server compatibility: {n_cases} requests, {len(diffs)} differences, "
             f"{len(undoc)} not documented", "", "| case | status / key | ours | llama-server | documented |",
             "|---|---|---|---|---|"]
    for d in diffs:
        lines.append(f"| {d['case']} | `{d['what']}` | {d['ours']} | {d['theirs']} | {d['documented'] or '**no**'} |")
    return "\n".join(lines) + "\n"


def run(ours: str, theirs: str, api_key: Optional[str] = None, cases: List[Case] = CASES) -> List[dict]:
    """Probe both servers with every case; the differences (see :func:`compare`)."""
    o = {c.name: probe(ours, c, api_key) for c in cases}
    t = {c.name: probe(theirs, c, api_key) for c in cases}
    return compare(o, t)


# ---------------------------------------------------------------------------- building / starting

def build_llama_server(jobs: int = 2, quiet: bool = False) -> Path:
    """``llama-server`` built once from the pinned source (see the module docstring); its path.

    Raises:
        RuntimeError: no CMake, or the build failed (the message names the log).
    """
    from benchmarks.upstream import UPSTREAM_COMMIT, cache_dir, fetch_upstream
    from benchmarks.upstream_driver import CMAKE_OPTIONS, build_dir

    exe = cache_dir() / f"upstream-{UPSTREAM_COMMIT}" / "bin" / "llama-server"
    if os.access(exe, os.X_OK):
        return exe
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed: cannot build llama-server")
    work = build_dir()
    src, build, log = work / "llama.cpp", work / "build-server", work / "build-server.log"
    if not (src / ".complete").is_file():
        fetch_upstream(quiet=quiet, needed=None, root=src)
    opts = [o for o in CMAKE_OPTIONS if not o.startswith("-DLLAMA_BUILD_SERVER")] + ["-DLLAMA_BUILD_SERVER=ON"]
    cmds = [["cmake", "-S", str(src), "-B", str(build), *opts],
            ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", "llama-server"]]
    with open(log, "a") as lf:
        for cmd in cmds:
            if not quiet:
                print(f"[llama-server] $ {' '.join(cmd)}", file=sys.stderr)
            if subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"llama-server build failed, log: {log}")
    exe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "bin" / "llama-server", exe)
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout} s")


def main(argv: Optional[List[str]] = None) -> int:
    """CLI (see the module docstring). Exit code 1 when an undocumented difference is found."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", help="base URL of dflash2-gguf serve")
    p.add_argument("--theirs", help="base URL of llama-server")
    p.add_argument("--start", action="store_true", help="build llama-server if needed and start both servers")
    p.add_argument("-m", "--model", help="target GGUF (with --start)")
    p.add_argument("-md", "--model-draft", default=None, help="drafter GGUF (with --start)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048)
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None, help="write the markdown report here (also printed)")
    p.add_argument("--json", default=None, help="write the differences as JSON here")
    a = p.parse_args(argv)
    procs = []
    try:
        if a.start:
            if not a.model:
                p.error("--start needs -m TARGET.gguf")
            po, pt = _free_port(), _free_port()
            # -np 2: the per-slot split of -c; the aliases and tags out of order: llama-server's sets
            common = ["-m", a.model, "-c", str(a.ctx_size), "-np", "2", "--alias", "b-alias,a-alias",
                      "--tags", "y,x", "--port"]
            spec = ["-md", a.model_draft, "--spec-type", "draft-dflash"] if a.model_draft else []
            procs.append(subprocess.Popen([str(build_llama_server()), *common, str(pt), *spec]))
            procs.append(subprocess.Popen([sys.executable, "-m", "dflash2_gguf.server", *common, str(po), *spec]))
            a.ours, a.theirs = f"http://127.0.0.1:{po}", f"http://127.0.0.1:{pt}"
            _wait(a.theirs, procs[0])
            _wait(a.ours, procs[1])
        if not (a.ours and a.theirs):
            p.error("give --ours and --theirs, or --start -m TARGET.gguf")
        diffs = run(a.ours, a.theirs, a.api_key)
        md = report_markdown(diffs, len(CASES))
        print(md)
        if a.out:
            Path(a.out).write_text(md)
        if a.json:
            Path(a.json).write_text(json.dumps(diffs, indent=1))
        return 1 if any(not d["documented"] for d in diffs) else 0
    finally:
        for pr in procs:
            pr.terminate()
            try:
                pr.wait(30)
            except subprocess.TimeoutExpired:
                pr.kill()


if __name__ == "__main__":
    sys.exit(main())
