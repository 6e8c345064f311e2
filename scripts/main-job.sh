#!/usr/bin/env bash
# The main job: set up, convert a DFlash 2 drafter to GGUF, and run speculative decoding with it
# on the default real target (SmolLM2-135M-Instruct, Q4_1), next to the target alone.
#
# The drafter: models/smollm2-135m-dflash2.gguf, trained here for this target (docs/TRAINING.md,
# models/smollm2-135m-dflash2.json). Should that file be missing, an untrained drafter of the
# same shape is initialised in the authors' HF format and converted (acceptance length ~1: it
# shows the path, not a speedup).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# OpenMP keeps its default wait policy (spinning threads), as a user runs it: the tokens/s printed
# below are the ones to expect on an idle machine (BENCHMARKS.md).
bash scripts/setup.sh torch

TARGET=$("$PY" -m dflash2_gguf.assets smollm2-135m-instruct-q4_1)
WORK=${DFLASH2_GGUF_CACHE:-$HOME/.cache/dflash2-gguf}/main-job
mkdir -p "$WORK"
DRAFT=models/smollm2-135m-dflash2.gguf
if [[ ! -f "$DRAFT" ]]; then
  echo "== $DRAFT missing: initialising an untrained DFlash 2 drafter (HF format)"
  "$PY" - "$TARGET" "$WORK/untrained-hf" <<'PYEOF'
import sys
import torch
from dflash2_gguf.train.export import export_hf
from dflash2_gguf.train.model import DFlash2Config, DFlash2Drafter
from dflash2_gguf.train.target_weights import load_target_weights

target, out = sys.argv[1:]
torch.manual_seed(0)
info = load_target_weights(target).info
model = DFlash2Drafter(DFlash2Config.for_target(info, num_hidden_layers=2, block_size=8))
export_hf(model, out, force=True)
print(out)
PYEOF
  echo "== converting it to GGUF (q8_0)"
  DRAFT="$WORK/untrained-dflash2-q8_0.gguf"
  "$PY" -m convert hf-to-gguf "$WORK/untrained-hf" --target "$TARGET" --outfile "$DRAFT" --outtype q8_0 --force
fi
"$PY" -m convert inspect "$DRAFT" --target "$TARGET" | head -n 40

PROMPT="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
echo "== target + drafter (T = 0)"
dflash2-gguf generate -m "$TARGET" -md "$DRAFT" --chat -p "$PROMPT" -n 128 --temp 0 -t "$(nproc)"
echo "== target alone (T = 0): the same text"
dflash2-gguf generate -m "$TARGET" -md none --chat -p "$PROMPT" -n 128 --temp 0 -t "$(nproc)"
