"""Upstream's own decoders, run side by side with ours by ``dflash2-gguf bench``.

Three comparison points, all on the same target GGUF, drafter GGUF and rendered prompts:

- ``llama-speculative-simple`` of llama.cpp 0c1e570 (the copy vendored by the llama-cpp-python
  0.3.36 sdist): upstream's C++ DFlash driver (the spec type comes from the drafter GGUF's
  metadata, ``draft-dflash``);
- ``llama-completion`` of the same commit with the same flags: upstream's plain baseline
  (``llama-speculative-simple`` refuses to run without a drafter);
- llama-cpp-python's prompt-lookup decoding (``LlamaPromptLookupDecoding``), the only speculative
  mode its Python API offers, and its plain ``Llama`` decoding.

Running the tools and parsing what they print live in :mod:`dflash2_gguf.bench.compare` (re-exported
here); this module builds them. The two binaries are built once from the sdist's sources (Release, Ninja when available,
static libraries, ``-DGGML_NATIVE=ON``, without llama.cpp's AMX kernels on a CPU that has AMX
as ``scripts/setup.sh`` builds llama-cpp-python there; about 3-6 min on 2 cores) in a folder of the cache and
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
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# Running the tools and parsing their output is the package's (``dflash2-gguf bench --upstream``
# works from an installed wheel once the tools exist); building them is this module's.
from dflash2_gguf.bench.compare import (UPSTREAM_TOOLS, PromptLookupRunner, UpstreamRun, _common_flags,  # noqa: F401
                                        default_upstream_bin_dir, parse_completion, parse_speculative_simple,
                                        run_completion, run_speculative_simple)

from .upstream import UPSTREAM_COMMIT, UpstreamUnavailable, cache_dir, fetch_upstream

__all__ = [
    "TOOLS", "UpstreamRun", "bin_dir", "build_upstream_tools", "run_speculative_simple",
    "run_completion", "run_prompt_lookup", "parse_speculative_simple", "parse_completion",
]

#: The upstream targets built (and nothing else): the ones ``dflash2-gguf bench --upstream`` runs.
TOOLS = UPSTREAM_TOOLS

#: CMake options of the build: nothing is fetched at build time (no curl / OpenSSL, no prebuilt web UI).
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

#: Compiler flags that leave llama.cpp's AMX kernels out, as ``scripts/setup.sh`` builds
#: llama-cpp-python on a CPU that has AMX: with ``-DGGML_NATIVE=ON`` they are compiled in there,
#: and they crash at the first decode with weight repacking on (SIGSEGV in
#: ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824; ``llama-speculative-simple`` with the
#: SmolLM2 pair, seen on these machines). Without them both sides of a comparison repack the same way.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_AMX_KERNEL_SYMBOL = b"ggml_backend_amx_mul_mat"


def cpu_has_amx() -> bool:
    """True when ``/proc/cpuinfo`` lists ``amx_int8`` (Sapphire Rapids and later); False elsewhere
    or where it cannot be read."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def cmake_options(amx_cpu: Optional[bool] = None) -> tuple:
    """The configure options of the build: :data:`CMAKE_OPTIONS`, plus :data:`NO_AMX_FLAGS` as
    the C / C++ flags on a CPU with AMX (``amx_cpu``; default :func:`cpu_has_amx`)."""
    if amx_cpu is None:
        amx_cpu = cpu_has_amx()
    if not amx_cpu:
        return CMAKE_OPTIONS
    return CMAKE_OPTIONS + (f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}")


def bin_dir() -> Path:
    """Folder of the cached upstream binaries: ``<cache>/upstream-0c1e570/bin`` (where
    ``dflash2-gguf bench --upstream`` looks for them unless ``$DFLASH2_GGUF_UPSTREAM_BIN`` is set)."""
    return default_upstream_bin_dir()


def build_dir() -> Path:
    """Work folder of the upstream builds: ``<cache>/upstream-0c1e570-build``, the pinned source in
    its ``llama.cpp/`` (upstream's tools here, ``llama-server`` by
    :func:`benchmarks.llama_server_compat.build_llama_server`)."""
    return cache_dir() / f"upstream-{UPSTREAM_COMMIT}-build"


def _have_tools(d: Path) -> bool:
    if not all(os.access(d / t, os.X_OK) for t in TOOLS):
        return False
    # binaries built with the AMX kernels (before the build left them out) crash here: rebuild
    return not (cpu_has_amx() and any(_AMX_KERNEL_SYMBOL in (d / t).read_bytes() for t in TOOLS))


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
    work = build_dir()
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
    cmd_cfg = ["cmake", "-S", str(src), "-B", str(build), *cmake_options()]
    if shutil.which("ninja"):
        cmd_cfg[1:1] = ["-G", "Ninja"]
    cmd_build = ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
                 "--target", *TOOLS]
    work.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as lf:
        # configure every time (seconds): a build folder left by an interrupted build keeps its
        # objects, and takes today's options (the AMX flags) before the build resumes
        for cmd in (cmd_cfg, cmd_build):
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
    import argparse

    argparse.ArgumentParser(description="Build (once, cached) llama.cpp 0c1e570's llama-speculative-simple and "
                            "llama-completion for `bench --upstream` and print their folder.").parse_args()
    print(build_upstream_tools())
