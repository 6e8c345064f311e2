#!/usr/bin/env bash
# The main job: set up, convert the DFlash 2 drafter's HF checkpoint to GGUF, and run speculative
# decoding with it on the default real target (SmolLM2-135M-Instruct, Q4_1), next to the target
# alone.
#
# The drafter: models/SmolLM2-135M-DFlash2 (the authors' DFlash2DraftModel layout: config.json +
# bf16 model.safetensors), trained here for this target (docs/TRAINING.md,
# models/smollm2-135m-dflash2.json). The conversion must reproduce the committed
# models/smollm2-135m-dflash2.gguf byte for byte; the script stops if it does not.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# OpenMP keeps its default wait policy (spinning threads), as a user runs it: the tokens/s printed
# below are the ones to expect on an idle machine (BENCHMARKS.md).
bash scripts/setup.sh torch

TARGET=$("$PY" -m dflash2_gguf.assets smollm2-135m-instruct-q4_1)
WORK=${DFLASH2_GGUF_CACHE:-$HOME/.cache/dflash2-gguf}/main-job
mkdir -p "$WORK"
DRAFT="$WORK/smollm2-135m-dflash2-q8_0.gguf"

echo "== converting models/SmolLM2-135M-DFlash2 (HF) to $DRAFT (q8_0)"
"$PY" -m convert hf-to-gguf models/SmolLM2-135M-DFlash2 --target "$TARGET" --outfile "$DRAFT" --outtype q8_0 --force
"$PY" - "$DRAFT" <<'PYEOF'
import hashlib, json, sys
want = json.load(open("models/smollm2-135m-dflash2.json"))["sha256"]
got = hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest()
if got != want:
    sys.exit(f"converted drafter sha256 {got} != models/smollm2-135m-dflash2.json's {want}")
print(f"sha256 {got}: byte-identical to models/smollm2-135m-dflash2.gguf")
PYEOF
echo "== convert inspect (the pairing with the target)"
"$PY" -m convert inspect "$DRAFT" --target "$TARGET"

PROMPT="Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
echo "== target + drafter (T = 0)"
dflash2-gguf generate -m "$TARGET" -md "$DRAFT" --chat -p "$PROMPT" -n 128 --temp 0 -t "$(nproc)" | tee "$WORK/with-drafter.txt"
echo "== target alone (T = 0)"
dflash2-gguf generate -m "$TARGET" -md none --chat -p "$PROMPT" -n 128 --temp 0 -t "$(nproc)" | tee "$WORK/target-alone.txt"
if cmp -s "$WORK/with-drafter.txt" "$WORK/target-alone.txt"; then
  echo "== the two texts are identical"
else
  echo "== the two texts differ (see README, 'Exactness at T = 0')"
fi
