#!/usr/bin/env bash
# Train the DFlash 2 drafter for SmolLM2-135M-Instruct Q4_1 on CPU, resumably (docs/TRAINING.md).
#
#   scripts/train_smollm2_drafter.sh data      # background: responses + features -> shards
#       (PROMPTS=gsm8k-train by default; PROMPTS=mix: the math / code / chat mix, dflash2_gguf/train/prompt_mix.py,
#       each sequence tagged with its family, so fit logs held-out tau per family; N_CTX=1536
#       cells per sequence: the 40 chat prompts longer than 1280 tokens are skipped); RESPONSES=FILE:
#       the responses.jsonl[.gz] of an earlier machine's capture, teacher-forced instead of
#       generated (PROMPTS=mix: data/train/smollm2-mix-responses.jsonl.gz by default, if present);
#       SKIP=N FAMILIES=math,code: the rest of the mix past its first N prompts, those families,
#       into $WORK/feats-from<N>-<families> (its kept answers: data/train/smollm2-mix-from<N>-...);
#       UNTIL=M stops that stream before the mix's prompt M, where a stream started with SKIP=M
#       begins (the folder keeps its name: a stream is named by where it starts);
#       PROMPTS=word-math: the ASDiv / SVAMP / MAWPS word problems beside the mix, into
#       $WORK/feats-word-math (kept answers: data/train/smollm2-word-math-responses.jsonl.gz)
#   scripts/train_smollm2_drafter.sh keep      # feats/responses.jsonl -> that file (to commit)
#   scripts/train_smollm2_drafter.sh fit       # background: train on the shards present (resumes)
#   scripts/train_smollm2_drafter.sh both      # data, then fit as soon as MIN_SHARDS shards exist
#   scripts/train_smollm2_drafter.sh export    # checkpoint -> HF folder -> q8_0 GGUF
#   scripts/train_smollm2_drafter.sh status    # last log lines, shard count per feats folder
#
# THREADS (default 2): threads of capture / fit; THREADS=1 for each lets the two run side by side on
# 2 cores without their thread pools preempting each other.
#
# Everything lives in $WORK (default ~/.cache/dflash2-gguf/train/smollm2); rerunning a stage
# resumes it (finished shards kept, training restarts from checkpoint.pt).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-$HOME/.cache/dflash2-gguf/train/smollm2}
FEATS=$WORK/feats
RUN=${RUN:-$WORK/run-l2-b8-r128}
MIN_SHARDS=${MIN_SHARDS:-2}
export OMP_WAIT_POLICY=passive PYTHONUNBUFFERED=1
mkdir -p "$WORK" "$FEATS" "$RUN"
TARGET=$(python -c 'from dflash2_gguf.assets import fetch; print(fetch("smollm2-135m-instruct-q4_1"))')
# drafter shape (docs/TRAINING.md): 2 layers, block 8, 3 target layers, selector rank 128 / top-k 16;
# LAYERS=3 with INIT=<a 2-layer folder> grows it: the new layer starts as the identity (fit --init)
SHAPE=(--layers ${LAYERS:-2} --target-layer-ids 1,14,27)

# SKIP=N FAMILIES=math,code (PROMPTS=mix): the mix past its first N prompts, those families only,
# captured into their own folder $WORK/feats-from<N>-<families> (fit trains on every feats* folder);
# UNTIL=M: only the mix's prompts [N, M), so two streams never answer the same prompt
SKIP=${SKIP:-0}
if [ "${PROMPTS:-}" = word-math ]; then
  # the ASDiv / SVAMP / MAWPS word problems beside the mix (dflash2_gguf/train/prompt_mix.py), their own folder
  FEATS_OUT=$WORK/feats-word-math
  KEPT=data/train/smollm2-word-math-responses.jsonl.gz
elif [ "$SKIP" != 0 ] || [ -n "${FAMILIES:-}" ]; then
  SUFFIX=from$SKIP${FAMILIES:+-${FAMILIES//,/-}}
  FEATS_OUT=$WORK/feats-$SUFFIX
  KEPT=data/train/smollm2-mix-$SUFFIX-responses.jsonl.gz
else
  FEATS_OUT=$FEATS
  KEPT=data/train/smollm2-mix-responses.jsonl.gz  # the mix's answers, committed: they outlive the machine
fi
case "${PROMPTS:-}" in mix|word-math) if [ -z "${RESPONSES:-}" ] && [ -f "$KEPT" ]; then RESPONSES=$KEPT; fi ;; esac

data() {
  python -m dflash2_gguf.train capture --target "$TARGET" "${SHAPE[@]}" --prompts "${PROMPTS:-gsm8k-train}" \
    ${FAMILIES:+--families "$FAMILIES"} --skip "$SKIP" ${UNTIL:+--until "$UNTIL"} \
    --max-new-tokens 256 --batch-size ${BATCH:-32} --seqs-per-shard 64 --n-ctx ${N_CTX:-1536} --threads ${THREADS:-2} \
    --out "$FEATS_OUT" --resume ${RESPONSES:+--responses "$RESPONSES"}
}

fit() {
  # HELD_OUT (a glob, default shard-00000) is held out (greedy tau on it is logged, per prompt
  # family for the mix); training re-globs the other shards every 100 steps while capture is
  # still writing them. INIT=HF_FOLDER starts from those weights (e.g. models/SmolLM2-135M-DFlash2),
  # WD sets AdamW's weight decay, FDROP (0-1) the dropout on the fused target features, WALK
  # (0-1) the share of anchors moved one decode pass on (fit --walk-anchors), EVAL_WALK=N the
  # decode-walk tau of N held-out sequences per family.
  python -m dflash2_gguf.train fit --target "$TARGET" "${SHAPE[@]}" --block-size 8 \
    --selector-rank 128 --selector-top-k 16 --vocab data --shards "$WORK"/'feats*/shard-*.safetensors' \
    --reload-shards-every 100 ${INIT:+--init "$INIT"} --weight-decay ${WD:-0} \
    --eval-shards "$FEATS/${HELD_OUT:-shard-00000.safetensors}" --eval-every ${EVAL_EVERY:-200} \
    --steps ${STEPS:-6000} --lr ${LR:-1e-3} --warmup 100 --batch-size ${BS:-4} --max-len 512 \
    --anchors ${ANCHORS:-16} --walk-anchors ${WALK:-0} --eval-walk-seqs ${EVAL_WALK:-0} \
    --feature-dropout ${FDROP:-0} \
    --save-every ${SAVE_EVERY:-50} --threads ${THREADS:-2} --out "$RUN"
}

case "${1:-status}" in
  data) nohup bash "$0" _data >> "$WORK/data.log" 2>&1 & echo "data: pid $! log $WORK/data.log -> $FEATS_OUT" ;;
  fit) nohup bash "$0" _fit >> "$RUN/fit.log" 2>&1 & echo "fit: pid $! log $RUN/fit.log" ;;
  both) nohup bash "$0" _both >> "$WORK/both.log" 2>&1 & echo "both: pid $! log $WORK/both.log" ;;
  _data) data ;;
  _fit) fit ;;
  _both)
    data >> "$WORK/data.log" 2>&1 &
    until [ "$(ls "$FEATS"/shard-*.safetensors 2>/dev/null | wc -l)" -ge "$MIN_SHARDS" ]; do sleep 60; done
    fit >> "$RUN/fit.log" 2>&1
    wait ;;
  export)
    python -m dflash2_gguf.train export --run "$RUN" --out "$RUN/hf"
    python -m convert hf-to-gguf "$RUN/hf" --target "$TARGET" --outfile "$RUN/drafter-q8_0.gguf" --outtype q8_0
    ls -l "$RUN/drafter-q8_0.gguf" ;;
  keep)
    # every answer recorded so far (this machine's and the kept file's), one line per prompt,
    # in prompt order; gzip -n: the same answers give the same bytes
    mkdir -p "$(dirname "$KEPT")"
    python - "$FEATS_OUT/responses.jsonl" "$KEPT" <<'PYEOF'
import gzip, json, os, sys
from dflash2_gguf.train.generate import read_responses
rows = {**read_responses(sys.argv[2]), **read_responses(sys.argv[1])}
tmp = sys.argv[2] + ".tmp"
with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
    for i in sorted(rows):
        f.write((json.dumps(rows[i]) + "\n").encode())
os.replace(tmp, sys.argv[2])
print(f"{len(rows)} answers -> {sys.argv[2]} ({os.path.getsize(sys.argv[2])} bytes)")
PYEOF
    ;;
  status)
    for d in "$WORK"/feats*; do
      echo "$(basename "$d"): shards $(ls "$d"/shard-*.safetensors 2>/dev/null | wc -l)  responses $(wc -l < "$d/responses.jsonl" 2>/dev/null || echo 0)"
    done
    tail -n 3 "$WORK/data.log" 2>/dev/null | tr '\r' '\n' | tail -n 3 || true
    tail -c 600 "$RUN/fit.log" 2>/dev/null | tr '\r' '\n' | tail -n 3 || true ;;
  *) echo "usage: $0 data|fit|both|export|keep|status" >&2; exit 2 ;;
esac
