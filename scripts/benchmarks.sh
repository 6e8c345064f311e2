#!/usr/bin/env bash
# The figures of BENCHMARKS.md: dflash2-gguf bench on the five prompt sets at T=0 and T=1, with
# upstream's llama-speculative-simple / llama-completion and llama-cpp-python prompt lookup side by
# side, then benchmarks/report.py. Run it on an otherwise idle machine (timings are compared).
#
#   bash scripts/benchmarks.sh                      # all sets, N_PROMPTS=30, MAX_NEW=128
#   SETS="gsm8k" TEMPS="0" N_PROMPTS=2 bash scripts/benchmarks.sh   # a quick look
#   MODE=sweep bash scripts/benchmarks.sh           # draft-length sweeps (bench --sweep: target
#       alone, every fixed k, adaptive), then only BENCHMARKS.md's sweep section is rewritten
#
# Env: DRAFTER (default models/smollm2-135m-dflash2.gguf), RUNS (output folder, default
# bench-runs/), SIDE ("--upstream --prompt-lookup"; empty to skip), SIDE_TEMPS (temperatures that
# get SIDE, default: all of TEMPS), THREADS (default: all), ADAPTIVE (bench mode's
# --spec-draft-adaptive, default off: the summary measures the drafter itself, every pass verifying
# the whole block; the sweep section has the adaptive policy), SPEC_TYPE (bench mode's --spec-type,
# default draft-dflash: the drafter alone, no context drafts). A run whose bench.json exists is kept
# (delete RUNS/<set>-t<T>/ to redo it), so an interrupted script resumes.
# MBPP is shipped in the package (dflash2_gguf/data/mbpp.jsonl.gz; $DFLASH2_GGUF_MBPP reads another copy).
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenMP's default wait policy, as a user gets it: threads spin at barriers, which is right on an
# idle machine and ruinous beside another busy process (tests and CI use passive; on these 2
# cores passive makes a one-token decode ~3x slower and the speedup look better than it is).
TARGET=${TARGET:-$(python -c 'from dflash2_gguf.assets import fetch; print(fetch("smollm2-135m-instruct-q4_1"))')}
DRAFTER=${DRAFTER:-models/smollm2-135m-dflash2.gguf}
RUNS=${RUNS:-bench-runs}
SETS=${SETS:-gsm8k math500 humaneval mbpp mt-bench}
TEMPS=${TEMPS:-0 1}
N_PROMPTS=${N_PROMPTS:-30}
MAX_NEW=${MAX_NEW:-128}
SIDE=${SIDE---upstream --prompt-lookup}
SIDE_TEMPS=${SIDE_TEMPS:-$TEMPS}
mkdir -p "$RUNS"
# record_command FILE OUT CMD: one line per run folder in FILE, this run's replacing an earlier
# one. Called only for runs about to start: a kept run keeps the line that made it (a rerun with
# another SIDE must not rewrite it).
record_command() {
  { grep -v -- "--out $2 " "$1" || true; echo "$3" | sed "s#$HOME#~#g"; } > "$1.tmp"
  mv "$1.tmp" "$1"
}
if [[ ${MODE:-bench} == sweep ]]; then
  touch "$RUNS/sweep-commands.txt"
  for ds in $SETS; do
    for t in $TEMPS; do
      out=$RUNS/sweep-$ds-t$t
      cmd="dflash2-gguf bench -m $TARGET -md $DRAFTER --dataset $ds --n-prompts $N_PROMPTS --max-new-tokens $MAX_NEW --temp $t --seed 0 --sweep --out $out ${THREADS:+-t $THREADS}"
      if [[ -f $out/sweep.json ]]; then echo "kept: $out" >&2; continue; fi
      record_command "$RUNS/sweep-commands.txt" "$out" "$cmd"
      echo "+ $cmd" >&2
      $cmd > "$out.log" 2>&1 || { echo "FAILED: $ds T=$t (see $out.log)" >&2; exit 1; }
      grep -E "^adaptive /" "$out.log" || true
    done
  done
  python -m benchmarks.report --runs "$RUNS" --out BENCHMARKS.md --sweeps-only
  exit 0
fi
touch "$RUNS/commands.txt"
# bench --upstream runs upstream's tools and refuses to start without them: build them once
# (llama.cpp 0c1e570 from the llama-cpp-python sdist, ~6 min on 2 cores; cached afterwards)
if [[ " $SIDE " == *" --upstream "* ]]; then python -m benchmarks.upstream_driver >&2; fi
for ds in $SETS; do
  for t in $TEMPS; do
    side=""
    [[ " $SIDE_TEMPS " == *" $t "* ]] && side=$SIDE
    cmd="dflash2-gguf bench -m $TARGET -md $DRAFTER --dataset $ds --n-prompts $N_PROMPTS --max-new-tokens $MAX_NEW --temp $t --seed 0 --spec-draft-adaptive ${ADAPTIVE:-off} --spec-type ${SPEC_TYPE:-draft-dflash} $side --out $RUNS/$ds-t$t ${THREADS:+-t $THREADS}"
    if [[ -f $RUNS/$ds-t$t/bench.json ]]; then echo "kept: $RUNS/$ds-t$t" >&2; continue; fi
    record_command "$RUNS/commands.txt" "$RUNS/$ds-t$t" "$cmd"
    echo "+ $cmd" >&2
    $cmd > "$RUNS/$ds-t$t.log" 2>&1 || { echo "FAILED: $ds T=$t (see $RUNS/$ds-t$t.log)" >&2; exit 1; }
    tail -n 30 "$RUNS/$ds-t$t.log" | grep -E "^\| target" || true
  done
done
python -m benchmarks.report --runs "$RUNS" --out BENCHMARKS.md --plot benchmarks/per_position_acceptance.png
