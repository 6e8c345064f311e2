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

"$PY" -m pip install -q --disable-pip-version-check "llama-cpp-python==0.3.36" "scikit-build-core>=0.10" "nanobind>=2.0"
# The CPU build of torch (a local wheel on these machines); a bare `torch` pulls a multi-GB CUDA build.
if [[ ",$extras," == *",test,"* || ",$extras," == *",torch,"* ]]; then
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[${extras}]"
if [[ ",$extras," == *",test,"* ]]; then
  # The authors' PyTorch reference (parity tests) pins datasets/requests/tqdm it does not use here:
  # install it without dependencies, next to the transformers release it was made for.
  # sentencepiece: upstream's converter imports it (the byte-level comparison runs upstream's).
  "$PY" -m pip install -q --disable-pip-version-check "transformers==5.15.0" "sentencepiece>=0.2"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "dflash==0.1.0"
  # Fail here, not as skipped tests, when a test dependency did not install.
  "$PY" -c "import torch, transformers, dflash.model, fastapi, uvicorn, openai, anthropic, agents, httpx, matplotlib, sentencepiece, dflash2_gguf._native_loader as n; n.native()"
fi
