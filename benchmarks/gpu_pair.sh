#!/usr/bin/env bash
# Two gpu_run.sh runs side by side, each with its own results folder and Triton cache:
# for work that times nothing (tests beside a sanitizer, say). Run 0 uses GPU 0, run 1
# GPU ${DEV1:-1}; DEV1=0 puts both on a one-GPU machine.
#
#   GPU0="env tests" GPU1="sanitize" DEV1=0 bash benchmarks/gpu_pair.sh
#
# Output: $OUT/gpu0/ and $OUT/gpu1/ (each as gpu_run.sh's $OUT), both summaries printed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hisparse-out}
pids=()
for i in 0 1; do
  var=GPU$i
  [ -z "${!var:-}" ] && continue
  mkdir -p "$OUT/gpu$i"
  # shellcheck disable=SC2086  # the section list splits on purpose
  dev=$i; [ "$i" = 1 ] && dev=${DEV1:-1}
  OUT=$OUT/gpu$i RES=/tmp/hisparse-results-$i HS_TRITON_CACHE=/tmp/hisparse-triton-$i CUDA_VISIBLE_DEVICES=$dev \
    bash benchmarks/gpu_run.sh ${!var} >"$OUT/gpu$i/stdout.txt" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for i in 0 1; do [ -f "$OUT/gpu$i/summary.txt" ] && { echo "== gpu$i"; cat "$OUT/gpu$i/summary.txt"; }; done
