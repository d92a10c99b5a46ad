#!/usr/bin/env bash
# Everything hisparse runs on the H200 test machine, in one command, results under $OUT.
#
#   bash benchmarks/gpu_run.sh [SECTION ...]  sections: env tests sanitize racecheck_controls staging decode triton_configs profile
#                                             prefill e2e stress autotune tests_each pool_kinds vllm_resolve
#                                             profile_host (cProfile + torch.profiler of bench_e2e --quick)
#                                             e2e_layer_graphs (bench_e2e eager, then with --layer-graphs;
#                                             E2E_DECODE_STEPS decode steps per request, default 128)
#                                             host_calls (bench_host_calls, one run per mode), host_calls_compare
#                                             (every mode in one process, steps interleaved)
#                                             layer (bench_layer: one decode layer in a CUDA graph vs resident)
#                                             miss (bench_miss_attention: the miss-attention kernels alone)
#                                             profile_layer (kernel timeline of one replayed decode layer per mode)
#                                             soak (long verified stress runs, memory watched; takes the whole budget)
#                                             capacity (bench_capacity: each tier's largest batch, tokens/s under graphs)
#                                             mini_graphs (hisparse mini-engine --graphs, both KV stores, serial and split)
#                                             resolve_phases (benchmarks.resolve_phases: %globaltimer per phase of the
#                                             resolve program, standalone and inside the 128K capacity step)
#                                             pd (bench_pd --device cuda: P/D through NIXL, the prefill side's rows
#                                             on the GPU, one 32K-token x 61-layer request; PD_ARGS)
#                                             (default: env tests sanitize staging decode prefill e2e stress autotune)
#   sanitize: compute-sanitizer ${SANITIZE_TOOLS:-memcheck racecheck} over benchmarks.sanitize_trace (every
#             kernel: writes, resolve, miss and prefill staging, decode attention); reports in $OUT/sanitize/
#   racecheck_controls: benchmarks.racecheck_controls (tiny Gluon kernels that show what racecheck does with
#             warp_specialize, mbarrier-ordered and CTA-barrier-ordered shared-memory exchanges, and a real
#             race) plain and under compute-sanitizer ${RC_TOOLS:-racecheck memcheck}; reports and the
#             script's lines in $RES/sanitize/racecheck_controls_*.txt
#   soak: python -m benchmarks.soak --preset ${SOAK:-16k} (16k: 32 requests x 16K x 2 layers; 128k: 16 x 128K x 2),
#         runs sized to the time left; SOAK_SEED (first seed, default 0) to add runs in a later call
#   vllm_resolve: vLLM 0.30's hisparse_resolve_residency vs our resolve_triton, all hits, same
#                 process (benchmarks.bench_vllm_resolve); needs .gpu-deps/vllm/_C_stable_libtorch.abi3.so
#                 or its .xz (decompressed into /tmp/hisparse-vllm by the script)
# Extra arguments: PROFILE_LAYER_ARGS (profile_layer, e.g. "--hits 95 --backends triton"), CAPACITY_ARGS (capacity, e.g. "--contexts 128K --same-batch"), RESOLVE_PHASES_ARGS (resolve_phases standalone), TC_ARGS (triton_configs), PREFILL_ARGS, DECODE_ARGS, STAGING_ARGS, VLLM_RESOLVE_ARGS,
#                  PROFILE_HOST_ARGS (default --quick; " " for the full size), SOAK_ARGS (soak);
#                  POOL_KINDS (pool_kinds).
# Uses the machine's preinstalled torch/triton (no network there): PYTHONPATH=. , no install.
# Optional kernels are picked up from .gpu-deps/ when carried (see ../shared/GPU.md):
#   .gpu-deps/vllm/_flashmla_C.abi3.so  -> HISPARSE_FLASHMLA_LIB
#   .gpu-deps/flashinfer/*.whl          -> installed into /tmp/site (PYTHONPATH)
#   .gpu-deps/nixl/*.whl                -> the same (the nixl-cu<N> wheel of torch's CUDA major, for the
#                                          machine's Python, without its nixl_ep_cu<N> part: the whole
#                                          wheel is over a call's carry limit; another major's UCX cannot
#                                          register GPU memory)
# Output: $OUT/run.log (everything), $OUT/results.tgz (all JSON/PNG), $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hisparse-out}
RES=${RES:-/tmp/hisparse-results}  # two runs side by side (one per GPU) need their own RES and HS_TRITON_CACHE
# a machine can come back with an earlier run's /tmp: ship only this run's results
rm -rf "$RES"
mkdir -p "$OUT" "$RES"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# the commit every record names (benchmarks.common.git_commit): the sender's HEAD, written before the call with
# `git rev-parse HEAD > .gpu-deps/commit` (a copied tree's git metadata can be older than the tree)
if [ -z "${HISPARSE_COMMIT:-}" ] && [ -s .gpu-deps/commit ]; then export HISPARSE_COMMIT=$(cat .gpu-deps/commit); fi
# Triton's compile cache travels between runs (git-ignored .triton-cache, carried back as
# $OUT/triton-cache.tgz): a fresh machine would otherwise recompile every kernel.
# The directory itself starts empty: a warm machine keeps ignored files between calls, and
# Triton's cache key misses changes to Gluon layouts held in module globals.
export TRITON_CACHE_DIR=${HS_TRITON_CACHE:-$PWD/.triton-cache}
# HS_KEEP_TRITON_CACHE=1: keep it (a later gpu_run.sh of the same command, same tree)
[ -z "${HS_KEEP_TRITON_CACHE:-}" ] && rm -rf "$TRITON_CACHE_DIR"
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .triton-cache.tgz ]; then tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR"; fi
if [ -f .gpu-deps/vllm/_flashmla_C.abi3.so ]; then export HISPARSE_FLASHMLA_LIB=$PWD/.gpu-deps/vllm/_flashmla_C.abi3.so; fi
if ls .gpu-deps/flashinfer/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-deps/flashinfer/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# the wheel of torch's CUDA major (another major's UCX can't register GPU memory)
nixl_mod=$(python3 -c 'import torch; print("nixl_cu" + (torch.version.cuda or "12").split(".")[0])' 2>/dev/null)
if ls .gpu-deps/nixl/*.whl >/dev/null 2>&1 && ! python3 -c "import ${nixl_mod:-nixl_cu12}" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-deps/nixl/*.whl
  case ":$PYTHONPATH:" in *":/tmp/site:"*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
fi
sections=("$@"); [ ${#sections[@]} -eq 0 ] && sections=(env tests sanitize staging decode prefill e2e stress autotune)
LOG=$OUT/run.log
SUM=$OUT/summary.txt
: > "$SUM"
END=$((SECONDS + ${BUDGET:-560}))  # the whole run stays inside the device tool's 10-minute limit
cap() {  # echo min(requested timeout, time left before END minus margin), or 0
  local t=$1 rem=$((END - SECONDS - 20))
  [ "$rem" -lt 10 ] && { echo 0; return; }
  [ "$t" -gt "$rem" ] && t=$rem
  echo "$t"
}
run() {  # name timeout_s cmd...
  local name=$1 t; t=$(cap "$2"); shift 2
  if [ "$t" = 0 ]; then echo "[$name] SKIPPED (out of time)" | tee -a "$SUM" "$LOG"; return; fi
  echo "===== [$name] $(date +%T) $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$t" "$@" >>"$LOG" 2>&1; local rc=$?
  echo "[$name] rc=$rc ($((SECONDS - t0)) s)" | tee -a "$SUM" "$LOG"
}
run_to() {  # name timeout_s stdout_file cmd...  (stdout to a file, stderr to the log)
  local name=$1 t f=$3; t=$(cap "$2"); shift 3
  if [ "$t" = 0 ]; then echo "[$name] SKIPPED (out of time)" | tee -a "$SUM" "$LOG"; return; fi
  echo "===== [$name] $(date +%T) $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$t" "$@" >"$f" 2>>"$LOG"; local rc=$?
  echo "[$name] rc=$rc ($((SECONDS - t0)) s)" | tee -a "$SUM" "$LOG"
}
for s in "${sections[@]}"; do
  case "$s" in
    env) run_to env 180 "$RES/env.json" python3 -m hisparse_tools env --json; nvidia-smi >>"$LOG" 2>&1
         python3 -m hisparse_tools env >>"$LOG" 2>&1 ;;
    tests) run tests ${TESTS_TIMEOUT:-400} env OUT="$RES" bash tests/run_gpu.sh default
           tail -5 "$LOG" | tee -a "$SUM" ;;
    tests_each)  # one pytest per file, so a slow file can't hide the others' reports
      for f in ${TESTS:-tests/test_*gpu*.py}; do
        run "t:$(basename "$f" .py)" ${EACH_TIMEOUT:-150} python3 -m pytest -m gpu "$f" -q -rfE --tb=short -p no:cacheprovider
        grep -E "passed|failed|error" "$LOG" | tail -1 | tee -a "$SUM"
      done ;;
    pool_kinds) run pool_kinds 200 python3 -m benchmarks.bench_pool_kinds --kinds ${POOL_KINDS:-register} --out "$RES/pool_kinds.json" ;;
    profile)  # Nsight Compute on one decode launch (T=64, H=128, fp8), when ncu is installed
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      if [ -n "$NCU" ]; then
        run profile 240 "$NCU" --kernel-name regex:sparse_mla_decode --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \
            --section MemoryWorkloadAnalysis --section LaunchStats python3 -m benchmarks.profile_decode ${PROFILE_ARGS:-}
      else echo "[profile] no ncu on this machine" | tee -a "$SUM" "$LOG"; fi ;;
    sanitize)  # one process per tool; rc=9: the tool found errors (its report says which)
      CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
      if [ -z "$CS" ]; then echo "[sanitize] no compute-sanitizer on this machine" | tee -a "$SUM" "$LOG"
      else
        mkdir -p "$OUT/sanitize"
        for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
          # no caching allocator: each tensor is its own allocation, so memcheck sees overruns
          # SANITIZE_KERNEL: check only kernels whose name contains it (the others run uninstrumented)
          run "$tool" ${SANITIZE_TIMEOUT:-270} env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$tool" \
              ${SANITIZE_KERNEL:+--kernel-name kns=$SANITIZE_KERNEL} \
              --error-exitcode 9 --log-file "$OUT/sanitize/$tool.txt" python3 -m benchmarks.sanitize_trace
          tail -2 "$OUT/sanitize/$tool.txt" 2>/dev/null | tee -a "$SUM"
          cp "$OUT/sanitize/$tool.txt" "$RES/sanitize_$tool.txt" 2>/dev/null
        done
      fi ;;
    racecheck_controls)  # rc=9 under a tool: it reported errors (expected for ctl_c_unsynced; read the report)
      CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
      mkdir -p "$RES/sanitize"
      run_to rc_controls 120 "$RES/sanitize/racecheck_controls_plain.txt" python3 -m benchmarks.racecheck_controls
      tee -a "$SUM" < "$RES/sanitize/racecheck_controls_plain.txt"
      if [ -z "$CS" ]; then echo "[racecheck_controls] no compute-sanitizer on this machine" | tee -a "$SUM" "$LOG"
      else
        for tool in ${RC_TOOLS:-racecheck memcheck}; do
          run_to "rc_controls_$tool" ${RC_TIMEOUT:-240} "$RES/sanitize/racecheck_controls_${tool}_stdout.txt" \
              "$CS" --tool "$tool" --error-exitcode 9 --print-limit 10000 \
              --log-file "$RES/sanitize/racecheck_controls_$tool.txt" python3 -m benchmarks.racecheck_controls
          tail -1 "$RES/sanitize/racecheck_controls_$tool.txt" 2>/dev/null | tee -a "$SUM"
          # report lines naming each control kernel (0 lines: clean for that control)
          grep -o "ctl_[a-z_]*_kernel" "$RES/sanitize/racecheck_controls_$tool.txt" 2>/dev/null | sort | uniq -c | tee -a "$SUM"
        done
      fi ;;
    staging) run staging 300 python3 -m benchmarks.bench_staging --out "$RES/staging.json" ${QUICK:+--quick} ${STAGING_ARGS:-} ;;
    decode) run decode 300 python3 -m benchmarks.bench_decode --out "$RES/decode.json" ${QUICK:+--quick} ${DECODE_ARGS:-} ;;
    triton_configs) run triton_configs 300 python3 -m benchmarks.bench_triton_configs --out "$RES/triton_configs.json" ${QUICK:+--quick} ${TC_ARGS:-} ;;
    prefill) run prefill 240 python3 -m benchmarks.bench_prefill --out "$RES/prefill.json" ${QUICK:+--quick} ${PREFILL_ARGS:-} ;;
    profile_host) run profile_host 420 python3 -m benchmarks.profile_e2e_host ${PROFILE_HOST_ARGS:---quick} --torch-profiler --out "$RES/profile_e2e_host.txt" --chrome-trace "$RES/traces"
                  python3 -m benchmarks.analyse_e2e_trace "$RES"/traces/*.json.gz --json "$RES/e2e_trace_steps.json" >"$RES/e2e_trace_steps.txt" 2>>"$LOG" ;;
    pd) run pd 300 python3 -m benchmarks.bench_pd --device cuda --requests 1 --tokens 32768 --layers 61 --reps 5 \
          --out "$RES/pd_32k_gpu.json" ${PD_ARGS:-} ;;
    vllm_resolve) run vllm_resolve 300 python3 -m benchmarks.bench_vllm_resolve --out "$RES/vllm_resolve.json" ${VLLM_RESOLVE_ARGS:-} ;;
    e2e) run e2e 300 python3 -m benchmarks.bench_e2e --out "$RES/e2e.json" ${QUICK:+--quick} ;;
    e2e_layer_graphs)  # the eager engines, then the same with hisparse's per-layer graphs (padded decode steps)
      for lg in "" layer_graphs; do
        run "e2e${lg:+_$lg}" 300 python3 -m benchmarks.bench_e2e ${QUICK:+--quick} ${lg:+--layer-graphs} \
            --decode-steps ${E2E_DECODE_STEPS:-128} --out "$RES/e2e${lg:+_$lg}.json"
        grep "^\[bench_e2e\] \(ratio\|decode\|hisparse\|resident\|target\)" "$LOG" | tail -n 6 | tee -a "$SUM"
      done ;;
    layer) run layer ${LAYER_TIMEOUT:-420} python3 -m benchmarks.bench_layer --out "$RES/layer.json" ${LAYER_ARGS:-} ;;
    profile_layer) run_to profile_layer 300 "$RES/profile_layer.txt" python3 -m benchmarks.profile_layer \
        --out "$RES/profile_layer.json" ${PROFILE_LAYER_ARGS:-} ;;
    miss) run miss 300 python3 -m benchmarks.bench_miss_attention --out "$RES/miss_attention.json" ${QUICK:+--quick} ${MISS_ARGS:-} ;;
    stress) run_to stress 420 "$RES/stress.json" python3 -m hisparse_tools stress --preset gpu --json --plot "$RES"
            python3 -c "import json,sys; from hisparse_tools.stress_report import format_stress; print(format_stress(json.load(open(sys.argv[1]))))" "$RES/stress.json" >>"$LOG" 2>&1 ;;
    host_calls) for pad in "" 64; do
          run "host_calls${pad:+_pad$pad}" 240 python3 -m benchmarks.bench_host_calls --requests 64 --layers 8 \
              --steps 30 ${pad:+--pad-to $pad} --out "$RES/host_calls${pad:+_pad$pad}.json" ${HOST_CALLS_ARGS:-}
          grep -A7 "^host time per call" "$LOG" | tail -8 | tee -a "$SUM"
        done
        for inp in allocated moving in-place; do  # the per-layer graphs and what they are given
          run "host_calls_pad64_layer_graphs_${inp/-/_}" 240 python3 -m benchmarks.bench_host_calls --requests 64 \
              --layers 8 --steps 30 --pad-to 64 --layer-graphs --inputs "$inp" \
              --out "$RES/host_calls_pad64_layer_graphs_${inp/-/_}.json" ${HOST_CALLS_ARGS:-}
          grep -A8 "^host time per call" "$LOG" | tail -9 | tee -a "$SUM"
        done ;;
    host_calls_compare)  # every mode in one process, steps interleaved: ratios from the same run
      run host_calls_compare 300 python3 -m benchmarks.bench_host_calls --requests 64 --layers 8 --steps 30 \
          --pad-to 64 --compare --out "$RES/host_calls_compare.json" ${HOST_CALLS_ARGS:-}
      grep -A7 "^host time per layer" "$LOG" | tail -8 | tee -a "$SUM" ;;
    soak) left=$((END - SECONDS - 45))
          run soak 600 python3 -m benchmarks.soak --preset "${SOAK:-16k}" --seed "${SOAK_SEED:-0}" \
              --budget-s "$left" --out "$RES/soak_${SOAK:-16k}.json" ${SOAK_ARGS:-}
          grep "^\[soak\] " "$LOG" | grep -v "^\[soak\] rc=" | tail -n 8 | tee -a "$SUM" ;;
    capacity) for ov in ${CAPACITY_OVERLAPS:-serial}; do  # CAPACITY_OVERLAPS="serial split": both decodes
          run "capacity_$ov" ${CAPACITY_TIMEOUT:-540} python3 -m benchmarks.bench_capacity --overlap "$ov" \
              --out "$RES/capacity_$ov.json" ${CAPACITY_ARGS:-}
          grep "^context\|^ *[0-9]* *\(resident\|hisparse\)" "$LOG" | tail -n 12 | tee -a "$SUM"
        done ;;
    resolve_phases)  # the resolve program's phase times: standalone, then inside the capacity step
      run resolve_phases 240 python3 -m benchmarks.resolve_phases standalone --out "$RES/phases_standalone.json" \
          ${RESOLVE_PHASES_ARGS:-}
      run resolve_phases_capacity 300 python3 -m benchmarks.resolve_phases capacity \
          --out "$RES/phases_capacity.json" -- --contexts 128K --buffer 5120 --decode-steps 64 --profile 2 \
          --out "$RES/phases_capacity_run.json"
      grep "^{\"slots\|^\[phases\]" "$LOG" | tail -n 3 | tee -a "$SUM" ;;
    mini_graphs)
      for ov in serial split; do
        run "mini_graphs_$ov" 240 python3 -m hisparse_tools mini-engine --preset h200 --graphs --unchecked --overlap "$ov" \
            --layers 2 --requests 16 --min-prompt 7680 --max-prompt 8192 --synthetic-context 7168 \
            --arrival-every 1 --backend triton --out "$RES/mini_graphs_$ov.json"
      done ;;
    autotune) run autotune 420 python3 -m hisparse_tools autotune --layers 61 --format fp8_ds_mla --top-k 2048 \
              --heads 128 --context 8192 --out "$RES/autotune.json" ;;
    *) echo "unknown section $s" | tee -a "$SUM" ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$RES" . 2>>"$LOG"
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . 2>>"$LOG"
ls -la "$OUT" >>"$LOG"
cat "$SUM"
