#!/usr/bin/env bash
# Install everything the project needs into the current Python environment (idempotent).
#
# llama-cpp-python 0.3.36 ships no binary wheel: pip compiles llama.cpp once (about 10 minutes on
# 2 cores) and its wheel cache makes every later install take seconds. The extension is then built
# against that same libllama without build isolation, so exactly one libllama is used.
# For CUDA, build llama-cpp-python first with:
#   CMAKE_ARGS="-DGGML_CUDA=on" pip install --no-cache-dir --force-reinstall llama-cpp-python==0.3.36
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
extras=${1:-test}

# llama.cpp's AMX kernels crash on CPUs that have AMX (Sapphire Rapids and later): SIGSEGV in
# ggml_backend_amx_mul_mat at the first decode with weight repacking on (ggml-org/llama.cpp#20824,
# seen on these machines with the SmolLM2 Q4_1 target). There, llama.cpp is compiled without them;
# a build that has them (an earlier install, a cached wheel) is rebuilt. The other repacked
# layouts (CPU_REPACK) stay on.
amx_cpu=0
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  amx_cpu=1
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
fi
"$PY" -m pip install -q --disable-pip-version-check "llama-cpp-python==0.3.36" "scikit-build-core>=0.10" "nanobind>=2.0"
if [ "$amx_cpu" = 1 ]; then
  cpu_lib=$("$PY" -c 'import glob, os, llama_cpp; print(*glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so*"))[:1])')
  if [ -z "$cpu_lib" ] || grep -q ggml_backend_amx_mul_mat "$cpu_lib"; then
    echo "setup: this CPU has AMX; rebuilding llama-cpp-python without llama.cpp's AMX kernels (about 10 minutes)" >&2
    "$PY" -m pip install -q --disable-pip-version-check --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
  fi
fi
# The CPU build of torch (a local wheel on these machines); a bare `torch` pulls a multi-GB CUDA build.
if [[ ",$extras," == *",test,"* || ",$extras," == *",torch,"* ]]; then
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[${extras}]"
if [[ ",$extras," == *",test,"* ]]; then
  # The web page's browser test (tests/server/test_web_browser.py) drives the system's Chromium with its
  # chromedriver (Selenium from the test extra, nothing downloaded): Debian's packages, as root.
  if ! { command -v chromium || command -v chromium-browser; } >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "setup: installing chromium chromium-driver (apt-get) for tests/server/test_web_browser.py" >&2
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
      echo "setup: no chromium/chromedriver: tests/server/test_web_browser.py will be skipped" \
           "(Debian: apt-get install chromium chromium-driver)" >&2
    fi
  fi
  # The authors' PyTorch reference (parity tests) pins datasets/requests/tqdm it does not use here:
  # install it without dependencies, next to the transformers release it was made for.
  # sentencepiece: upstream's converter imports it (the byte-level comparison runs upstream's).
  "$PY" -m pip install -q --disable-pip-version-check "transformers==5.15.0" "sentencepiece>=0.2"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "dflash==0.1.0"
  # Fail here, not as skipped tests, when a test dependency did not install.
  "$PY" -c "import torch, transformers, dflash.model, fastapi, uvicorn, openai, anthropic, agents, httpx, matplotlib, sentencepiece, selenium, dflash2_gguf._native_loader as n; n.native()"
fi
