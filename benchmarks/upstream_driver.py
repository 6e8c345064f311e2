"""Upstream's own decoders, run side by side with ours by ``dflash2-gguf bench``.

Three comparison points, all on the same target GGUF, drafter GGUF and rendered prompts:

- ``llama-speculative-simple`` of llama.cpp 0c1e570 (the copy vendored by the llama-cpp-python
  0.3.36 sdist): upstream's C++ DFlash driver (the spec type comes from the drafter GGUF's
  metadata, ``draft-dflash``);
- ``llama-completion`` of the same commit with the same flags: upstream's plain baseline
  (``llama-speculative-simple`` refuses to run without a drafter);
- llama-cpp-python's prompt-lookup decoding (``LlamaPromptLookupDecoding``), the only speculative
  mode its Python API offers, and its plain ``Llama`` decoding.

The two binaries are built once from the sdist's sources (Release, Ninja when available,
static libraries, ``-DGGML_NATIVE=ON``; about 6 min on 2 cores) in a folder of the cache and
kept under ``<cache>/upstream-0c1e570/bin`` (``<cache>`` = ``$DFLASH2_GGUF_CACHE`` or
``~/.cache/dflash2-gguf``). Nothing of this lands in the repository.

Example::

    from benchmarks.upstream_driver import build_upstream_tools, run_speculative_simple
    bins = build_upstream_tools()
    r = run_speculative_simple(bins, "target.gguf", "drafter.gguf", prompt, n_predict=64)
    print(r.decode_tokens_per_second, r.acceptance_length)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from .upstream import UPSTREAM_COMMIT, UpstreamUnavailable, cache_dir, fetch_upstream

__all__ = [
    "TOOLS", "UpstreamRun", "bin_dir", "build_upstream_tools", "run_speculative_simple",
    "run_completion", "run_prompt_lookup", "parse_speculative_simple", "parse_completion",
]

#: The upstream targets built (and nothing else).
TOOLS = ("llama-speculative-simple", "llama-completion")

#: CMake options of the build (the brief of DESIGN.md section 8: no network at build time).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
)


def bin_dir() -> Path:
    """Folder of the cached upstream binaries: ``<cache>/upstream-0c1e570/bin``."""
    return cache_dir() / f"upstream-{UPSTREAM_COMMIT}" / "bin"


def _have_tools(d: Path) -> bool:
    return all(os.access(d / t, os.X_OK) for t in TOOLS)


def build_upstream_tools(*, jobs: int = 2, quiet: bool = False, timeout: Optional[float] = None) -> Path:
    """Return the folder holding ``llama-speculative-simple`` and ``llama-completion``.

    Built once from the llama-cpp-python 0.3.36 sdist (fetched with
    :func:`benchmarks.upstream.fetch_upstream`) in ``<cache>/upstream-0c1e570-build`` (kept
    until the build succeeds, so an interrupted build resumes), then copied to :func:`bin_dir`.

    Args:
        jobs: Parallel compile jobs.
        quiet: Do not echo progress to stderr.
        timeout: Seconds for the configure + build (None: no limit).

    Raises:
        UpstreamUnavailable: no sdist, no CMake, or the build failed (the message carries the
            tail of the log).
    """
    out = bin_dir()
    if _have_tools(out):
        return out
    if shutil.which("cmake") is None:
        raise UpstreamUnavailable("cmake is not installed: cannot build upstream's tools")
    work = cache_dir() / f"upstream-{UPSTREAM_COMMIT}-build"
    work.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(cache_dir() / f".upstream-{UPSTREAM_COMMIT}-build.lock", "w") as lock:
        if _locked(lock) and not quiet:
            print("[upstream] another process is building upstream's tools: waiting", file=sys.stderr)
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a waiter finds the binaries
        if _have_tools(out):
            return out
        return _build(out, work, jobs=jobs, quiet=quiet, timeout=timeout)


def _locked(lock) -> bool:
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def _build(out: Path, work: Path, *, jobs: int, quiet: bool, timeout: Optional[float]) -> Path:
    src = work / "llama.cpp"
    build = work / "build"
    log = work / "build.log"
    t0 = time.time()
    if not (src / ".complete").is_file():
        fetch_upstream(quiet=quiet, needed=None, root=src)
    cmd_cfg = ["cmake", "-S", str(src), "-B", str(build), *CMAKE_OPTIONS]
    if shutil.which("ninja"):
        cmd_cfg[1:1] = ["-G", "Ninja"]
    cmd_build = ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
                 "--target", *TOOLS]
    work.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as lf:
        for cmd in ([] if (build / "CMakeCache.txt").is_file() else [cmd_cfg]) + [cmd_build]:
            if not quiet:
                print(f"[upstream] $ {' '.join(cmd)}", file=sys.stderr)
            lf.write(f"$ {' '.join(cmd)}\n")
            lf.flush()
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout).returncode
            if rc != 0:
                lf.flush()
                tail = log.read_text(errors="replace")[-3000:]
                raise UpstreamUnavailable(f"upstream build failed (rc {rc}), log {log}:\n{tail}")
    fetch_upstream(quiet=True)  # make sure the converter folder (our parent) is complete
    tmp = out.with_name("bin.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for t in TOOLS:
        shutil.copy2(build / "bin" / t, tmp / t)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    if not quiet:
        print(f"[upstream] built {', '.join(TOOLS)} in {time.time() - t0:.0f}s -> {out}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return out


@dataclass
class UpstreamRun:
    """What one upstream run reported.

    Attributes:
        tool: ``"llama-speculative-simple"``, ``"llama-completion"``, ``"prompt-lookup"`` or
            ``"llama-cpp-python"``.
        n_generated: Tokens generated (as the tool counts them).
        decode_s: Decode time in seconds (prefill excluded where the tool separates it).
        decode_tokens_per_second: ``n_generated / decode_s`` as the tool reports it.
        n_drafted / n_accepted: Draft tokens verified / accepted (speculative tools).
        acceptance_length: Tokens committed per target pass, bonus included:
            ``n_generated / (n_generated - n_accepted)`` for llama-speculative-simple (each of
            its passes commits the accepted drafts + one target token).
        text: The generated text (stdout), when the tool prints it.
        wall_s: Wall time of the whole process/call (model load included for the binaries).
    """

    tool: str
    n_generated: int = 0
    decode_s: float = 0.0
    decode_tokens_per_second: float = 0.0
    n_drafted: int = 0
    n_accepted: int = 0
    acceptance_length: float = 0.0
    text: str = ""
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready)."""
        return asdict(self)


_RE_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s")
_RE_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_RE_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_RE_EVAL = re.compile(r"(?<!prompt )eval time\s*=\s*([\d.]+)\s*ms\s*/\s*(\d+)\s*runs.*?([\d.]+)\s*tokens per second")


def parse_speculative_simple(log: str) -> UpstreamRun:
    """Parse the summary that ``llama-speculative-simple`` prints on stderr.

    Raises:
        ValueError: the log has no ``decoded N tokens in S seconds`` line.
    """
    m = _RE_DECODED.search(log)
    if not m:
        raise ValueError("no 'decoded N tokens' line in the llama-speculative-simple output")
    r = UpstreamRun(tool="llama-speculative-simple", n_generated=int(m.group(1)), decode_s=float(m.group(2)),
                    decode_tokens_per_second=float(m.group(3)))
    if (d := _RE_DRAFTED.search(log)) and (a := _RE_ACCEPT.search(log)):
        r.n_drafted, r.n_accepted = int(d.group(1)), int(a.group(1))
        passes = r.n_generated - r.n_accepted
        r.acceptance_length = r.n_generated / passes if passes > 0 else 0.0
    return r


def parse_completion(log: str) -> UpstreamRun:
    """Parse the ``eval time = ... ms / N runs (... tokens per second)`` line of ``common_perf_print``.

    Raises:
        ValueError: the log has no such line.
    """
    m = _RE_EVAL.search(log)
    if not m:
        raise ValueError("no 'eval time' line in the llama-completion output")
    ms, runs, tps = float(m.group(1)), int(m.group(2)), float(m.group(3))
    # The eval runs exclude the token sampled from the prefill logits.
    return UpstreamRun(tool="llama-completion", n_generated=runs, decode_s=ms / 1000.0, decode_tokens_per_second=tps)


def _common_flags(target, prompt_file: Path, n_predict: int, temp: float, seed: int,
                  threads: Optional[int], n_ctx: int) -> list:
    flags = ["-m", str(target), "-f", str(prompt_file), "-n", str(n_predict), "--temp", str(temp),
             "--seed", str(seed), "-c", str(n_ctx), "--no-escape"]
    if temp > 0:   # plain temperature sampling, as our bench samples (llama.cpp's defaults truncate)
        flags += ["--top-k", "0", "--top-p", "1.0", "--min-p", "0.0"]
    if threads:
        flags += ["-t", str(threads)]
    return flags


def _run(cmd: list, timeout: Optional[float]) -> tuple[str, str, float]:
    env = dict(os.environ)   # the caller's OpenMP settings: the same as our decoder's in the same run
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed (rc {proc.returncode}):\n$ {' '.join(cmd)}\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout, proc.stderr, wall


def run_speculative_simple(bins: Path, target, drafter, prompt: str, *, workdir: Path, n_predict: int = 64,
                           temp: float = 0.0, seed: int = 42, threads: Optional[int] = None,
                           n_ctx: int = 4096, n_draft_max: int = 7,
                           timeout: Optional[float] = 600) -> UpstreamRun:
    """Run upstream's ``llama-speculative-simple`` on one rendered prompt (special tokens parsed).

    ``--spec-draft-n-max n_draft_max``; the spec type (``draft-dflash``) is inferred by upstream
    from the drafter GGUF. Returns the parsed :class:`UpstreamRun` (text = its stdout).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    pf = workdir / "prompt.txt"
    pf.write_text(prompt + "\n")  # -f drops one trailing newline
    cmd = [str(Path(bins) / "llama-speculative-simple"), *_common_flags(target, pf, n_predict, temp, seed, threads, n_ctx),
           "-md", str(drafter), "--spec-draft-n-max", str(n_draft_max)]
    if threads:
        cmd += ["-td", str(threads)]
    out, err, wall = _run(cmd, timeout)
    r = parse_speculative_simple(err + out)
    r.text, r.wall_s = out, wall
    return r


def run_completion(bins: Path, target, prompt: str, *, workdir: Path, n_predict: int = 64, temp: float = 0.0,
                   seed: int = 42, threads: Optional[int] = None, n_ctx: int = 4096,
                   timeout: Optional[float] = 600) -> UpstreamRun:
    """Run upstream's ``llama-completion`` (plain decoding, same flags, no conversation mode)."""
    workdir.mkdir(parents=True, exist_ok=True)
    pf = workdir / "prompt.txt"
    pf.write_text(prompt + "\n")  # -f drops one trailing newline
    cmd = [str(Path(bins) / "llama-completion"), *_common_flags(target, pf, n_predict, temp, seed, threads, n_ctx),
           "-no-cnv", "--no-display-prompt", "--perf"]
    out, err, wall = _run(cmd, timeout)
    r = parse_completion(err + out)
    r.text, r.wall_s = out, wall
    return r


class PromptLookupRunner:
    """llama-cpp-python's ``Llama`` with and without ``LlamaPromptLookupDecoding``.

    Two ``Llama`` objects on the same target, built once and reused for every prompt.
    ``num_pred_tokens`` = drafts per pass (llama-cpp-python's default is 10; we pass n_max).
    ``flash_attn`` should match the decoder compared against (llama.cpp's auto = on).
    ``threads=None`` keeps llama-cpp-python's own defaults (``n_threads`` = cores // 2 for
    one-token decodes, ``n_threads_batch`` = cores), so its tokens/s are what its users get, not
    what our decoder (all cores for both) gets: compare its prompt-lookup speedup with its own
    plain run, and pass ``threads`` for like-for-like tokens/s.
    """

    def __init__(self, target, *, n_ctx: int = 4096, threads: Optional[int] = None, num_pred_tokens: int = 7,
                 seed: int = 42, flash_attn: bool = True) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # flash_attn: llama-cpp-python defaults to off, llama.cpp's "auto" (our decoder's and the
        # upstream tools' default) turns it on; at T=0 the two pick different tokens on near-ties.
        kw = dict(n_ctx=n_ctx, seed=seed, verbose=False, logits_all=False, flash_attn=bool(flash_attn))
        if threads:
            kw.update(n_threads=threads, n_threads_batch=threads)
        self.plain = Llama(str(target), **kw)
        self.lookup = Llama(str(target), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens), **kw)

    def run(self, prompt: str, *, lookup: bool, n_predict: int, temp: float = 0.0, seed: int = 42) -> UpstreamRun:
        """Complete ``prompt`` (special tokens parsed); timing covers the whole call (prefill included)."""
        llm = self.lookup if lookup else self.plain
        llm.reset()
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
        t0 = time.perf_counter()
        # T>0: plain temperature sampling like our bench (llama-cpp-python's defaults truncate: top_k
        # 40, top_p 0.95, min_p 0.05)
        trunc = dict(top_k=1) if temp == 0 else dict(top_k=0, top_p=1.0, min_p=0.0)
        out = llm.create_completion(ids, max_tokens=n_predict, temperature=temp, seed=seed, **trunc)
        wall = time.perf_counter() - t0
        n = int(out["usage"]["completion_tokens"])
        return UpstreamRun(tool="prompt-lookup" if lookup else "llama-cpp-python", n_generated=n, decode_s=wall,
                           decode_tokens_per_second=(n / wall) if wall > 0 else 0.0,
                           text=out["choices"][0]["text"], wall_s=wall)

    def close(self) -> None:
        """Free both ``Llama`` objects."""
        for llm in (self.plain, self.lookup):
            try:
                llm.close()
            except Exception:
                pass


def run_prompt_lookup(target, prompts: list, *, n_predict: int = 64, temp: float = 0.0, seed: int = 42,
                      threads: Optional[int] = None, n_ctx: int = 4096, num_pred_tokens: int = 7) -> list:
    """Convenience: ``[(plain UpstreamRun, prompt-lookup UpstreamRun)]`` for each prompt."""
    runner = PromptLookupRunner(target, n_ctx=n_ctx, threads=threads, num_pred_tokens=num_pred_tokens, seed=seed)
    try:
        return [(runner.run(p, lookup=False, n_predict=n_predict, temp=temp, seed=seed),
                 runner.run(p, lookup=True, n_predict=n_predict, temp=temp, seed=seed)) for p in prompts]
    finally:
        runner.close()


if __name__ == "__main__":  # python -m benchmarks.upstream_driver: build (once) and print the folder
    print(build_upstream_tools())
