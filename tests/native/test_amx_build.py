"""CPUs with AMX (Sapphire Rapids and later): llama.cpp's AMX kernels crash at the first decode
with weight repacking on (SIGSEGV in ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824; seen on
these machines with the SmolLM2 Q4_1 target). ``scripts/setup.sh`` compiles llama.cpp without them
there, and the native loader turns repacking off for a build that has them (native/pairing.cpp).

Each test runs the real decode in a child process, so a crash fails the test instead of the
session. Skipped on CPUs without AMX, where there is nothing to crash."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.upstream_driver import cpu_has_amx

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = ROOT / "models" / "smollm2-135m-dflash2.gguf"


pytestmark = pytest.mark.skipif(not cpu_has_amx(), reason="this CPU has no AMX")

_GENERATE = (
    "import sys\n"
    "from dflash2_gguf.cli import main\n"
    "sys.exit(main(['generate', '-m', sys.argv[1], '-md', sys.argv[2], '-p', "
    "'The capital of France is Paris. The capital of Germany is', '-n', '24', '--temp', '0', "
    "'--threads', '2']))\n"
)


def _generate(target: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """A speculative decode with repacking on (the default), in a child process."""
    return subprocess.run([sys.executable, "-c", _GENERATE, str(target), str(DRAFTER)],
                          capture_output=True, text=True, timeout=300, env=env)


def _ggml_cpu_lib() -> Path:
    import llama_cpp

    libs = sorted(glob.glob(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so*")))
    assert libs, "llama_cpp ships no libggml-cpu.so"
    return Path(libs[0])


def test_setup_builds_llama_cpp_without_amx_kernels(smollm2_gguf):
    """The installed llama.cpp has no AMX kernels, and a repacked decode runs to the end."""
    assert b"ggml_backend_amx_mul_mat" not in _ggml_cpu_lib().read_bytes(), (
        "llama-cpp-python was built with llama.cpp's AMX kernels: run `bash scripts/setup.sh`")
    proc = _generate(smollm2_gguf)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert "24 tokens" in proc.stderr
    assert "AMX kernels" not in proc.stderr


@pytest.mark.skipif(not os.environ.get("DFLASH2_AMX_GGML_CPU_LIB"),
                    reason="set DFLASH2_AMX_GGML_CPU_LIB to a libggml-cpu.so.0 of llama-cpp-python "
                           "0.3.36 built with AMX (e.g. from pip's wheel cache)")
def test_native_loader_turns_repack_off_for_an_amx_build(smollm2_gguf):
    """With a libggml-cpu built with AMX preloaded, the decode warns and finishes instead of
    crashing."""
    env = dict(os.environ, LD_PRELOAD=os.environ["DFLASH2_AMX_GGML_CPU_LIB"])
    proc = _generate(smollm2_gguf, env)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert "24 tokens" in proc.stderr
    assert "ggml-org/llama.cpp#20824" in proc.stderr
