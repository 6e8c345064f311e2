"""Bounded load test of ``dflash2-gguf serve``: N requests at concurrency C, with and without the
drafter (two server runs on 127.0.0.1, same prompts, same settings otherwise).

Prompts: GSM8K test questions (``dflash2_gguf.assets.fetch("gsm8k-test")``), a fixed-seed pick,
sent as chat messages to ``/v1/chat/completions`` with streaming (so time to first token is
measured too). One warmup request per run is not counted. Reported per run: p50/p95 latency,
p50 time to first token, aggregate tokens/s (completion tokens of all requests / wall time),
mean per-request tokens/s, mean acceptance length (server ``timings``) and drafted/accepted
counts; then the speedup of the drafter run (aggregate tokens/s ratio)::

    python -m benchmarks.server_load -m TARGET.gguf -md DRAFT.gguf -n 16 -C 4 --max-tokens 64
    python -m benchmarks.server_load --url http://127.0.0.1:8080 -n 16 -C 4   # an existing server

Writes one JSON object (stdout, or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

__all__ = ["load_prompts", "run_load", "main"]


def load_prompts(n: int, seed: int = 0) -> list:
    """``n`` GSM8K test questions, picked with a fixed-seed shuffle."""
    from dflash2_gguf import assets

    with open(assets.fetch("gsm8k-test"), encoding="utf-8") as f:
        rows = [json.loads(line)["question"] for line in f if line.strip()]
    random.Random(seed).shuffle(rows)
    return rows[:n]


def _percentile(xs: list, q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _one(url: str, question: str, max_tokens: int, temperature: float, api_key: Optional[str], timeout: float) -> dict:
    import httpx

    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    ttft = None
    timings, usage, err = None, None, None
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    err = obj["error"]["message"]
                    continue
                ch = obj.get("choices") or []
                if ch and ch[0]["delta"].get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
                if "timings" in obj:
                    timings = obj["timings"]
                if obj.get("usage"):
                    usage = obj["usage"]
    except Exception as e:  # noqa: BLE001 - reported per request
        return {"error": f"{type(e).__name__}: {e}"}
    lat = time.perf_counter() - t0
    if err or usage is None:
        return {"error": err or "no usage chunk"}
    return {"latency_s": lat, "ttft_s": ttft if ttft is not None else lat, "completion_tokens": usage["completion_tokens"],
            "timings": timings or {}}


def run_load(url: str, prompts: list, concurrency: int, max_tokens: int, temperature: float = 0.0,
             api_key: Optional[str] = None, timeout: float = 600.0) -> dict:
    """Send every prompt once (``concurrency`` in flight) after one warmup; return the figures."""
    _one(url, prompts[0], min(max_tokens, 8), temperature, api_key, timeout)  # warmup
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        res = list(ex.map(lambda p: _one(url, p, max_tokens, temperature, api_key, timeout), prompts))
    wall = time.perf_counter() - t0
    ok = [r for r in res if "error" not in r]
    lat = [r["latency_s"] for r in ok]
    toks = sum(r["completion_tokens"] for r in ok)
    taus = [r["timings"].get("acceptance_length", 0.0) for r in ok if r["timings"].get("n_cycles")]
    return {
        "requests": len(prompts), "ok": len(ok), "errors": [r["error"] for r in res if "error" in r][:5],
        "concurrency": concurrency, "max_tokens": max_tokens, "wall_s": wall,
        "latency_p50_s": _percentile(lat, 0.5), "latency_p95_s": _percentile(lat, 0.95),
        "ttft_p50_s": _percentile([r["ttft_s"] for r in ok], 0.5),
        "completion_tokens": toks, "tokens_per_second": toks / wall if wall > 0 else 0.0,
        "per_request_tokens_per_second": statistics.fmean(r["timings"].get("tokens_per_second", 0.0) for r in ok)
        if ok else 0.0,
        "acceptance_length": statistics.fmean(taus) if taus else 0.0,
        "draft_n": sum(r["timings"].get("draft_n", 0) for r in ok),
        "draft_n_accepted": sum(r["timings"].get("draft_n_accepted", 0) for r in ok),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: argparse.Namespace, drafter: Optional[str]):
    """Start ``python -m dflash2_gguf.server`` and wait (bounded) for /health; returns (proc, url, log)."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "dflash2_gguf.server", "-m", args.model, "-c", str(args.ctx_size),
           "--port", str(port), "--host", "127.0.0.1", "--log-level", "warning"]
    cmd += ["-md", drafter, "--spec-type", "draft-dflash"] if drafter else ["--spec-type", "none"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    if args.n_gpu_layers:
        cmd += ["-ngl", str(args.n_gpu_layers), "-ngld", str(args.n_gpu_layers)]
    if drafter and args.spec_draft_n_max is not None:
        cmd += ["--spec-draft-n-max", str(args.spec_draft_n_max)]
    log = tempfile.NamedTemporaryFile("w+", prefix="server_load_", suffix=".log", delete=False)
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.terminate()
    raise RuntimeError(f"server not ready in {args.startup_timeout} s; log: {log.name}")


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main(argv: Optional[list] = None) -> int:
    """Entry point; prints (or writes) the JSON report."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.server_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="target GGUF (starts the servers)")
    ap.add_argument("-md", "--model-draft", help="drafter GGUF (adds the drafter run)")
    ap.add_argument("--url", help="benchmark an already running server instead (one run)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("-n", "--requests", type=int, default=16)
    ap.add_argument("-C", "--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="prompt pick seed")
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    ap.add_argument("--spec-draft-n-max", type=int, default=None)
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if not args.url and not args.model:
        ap.error("give -m TARGET.gguf (and -md DRAFT.gguf) or --url")
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("-n, -C and --max-tokens must be >= 1")
    prompts = load_prompts(args.requests, args.seed)
    report = {"dataset": "gsm8k-test", "seed": args.seed, "runs": {}}
    if args.url:
        report["runs"]["server"] = run_load(args.url, prompts, args.concurrency, args.max_tokens, args.temperature,
                                            args.api_key)
    else:
        for name, drafter in (("target", None), ("dflash", args.model_draft)):
            if name == "dflash" and not drafter:
                continue
            proc, url, log = _serve(args, drafter)
            try:
                report["runs"][name] = run_load(url, prompts, args.concurrency, args.max_tokens, args.temperature)
            finally:
                _stop(proc)
            print(f"[server_load] {name}: {json.dumps(report['runs'][name])}", file=sys.stderr)
        runs = report["runs"]
        if "target" in runs and "dflash" in runs and runs["target"]["tokens_per_second"] > 0:
            report["speedup"] = runs["dflash"]["tokens_per_second"] / runs["target"]["tokens_per_second"]
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    return 0 if all(r["ok"] == r["requests"] for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
