#!/usr/bin/env bash
# The GPU test suite in one command, on a CUDA machine (the H200 test machine: one GPU,
# 16 cores, no network). Prints the suite's duration at the end.
#
#   bash tests/run_gpu.sh          every `gpu` test except the long cases (-m "gpu and not gpu_long")
#   bash tests/run_gpu.sh long     the long cases alone (-m gpu_long): a second command
#   bash tests/run_gpu.sh all      both
#   extra arguments after the mode go to pytest (e.g. `bash tests/run_gpu.sh default -x`)
#
# Most of a cold run is Triton compiling kernels on the CPU, so with pytest-xdist
# importable the suite runs in HS_GPU_WORKERS processes (default: half the cores, at most
# 8) sharing the GPU, one test file per worker at a time (--dist loadfile); the tests
# marked `gpu_alone` (timing or free-memory dependent) then run in one process with the
# GPU to themselves. Without pytest-xdist everything runs in one process (slower, same
# tests). Wheels carried in .gpu-deps/pytest/ are installed into /tmp/site when xdist is
# missing; so are FlashInfer's in .gpu-deps/flashinfer/, and .gpu-deps/vllm/_flashmla_C.abi3.so
# becomes HISPARSE_FLASHMLA_LIB (see the shared GPU notes); a nixl-cu<N> wheel in .gpu-deps/nixl/ is
# installed too (the P/D tests). Tests of a backend that is
# not there skip and say why (-rs).
#
# Results: ${OUT:-/tmp/hisparse-gpu-tests}/gpu-tests-<mode>[-alone].xml (JUnit, per-test times), and
# capture-loads-<mode>.txt: the Triton kernels first loaded inside a CUDA graph capture, per test
# (tests/conftest.py; a record, it fails nothing).
# Exit status: 0 when every phase passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-default}; shift || true
case "$mode" in
  default) sel="gpu and not gpu_long" ;;
  long)    sel="gpu_long" ;;
  all)     sel="gpu" ;;
  *) echo "usage: bash tests/run_gpu.sh [default|long|all] [pytest args...]" >&2; exit 2 ;;
esac
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "tests/run_gpu.sh: no CUDA GPU here (torch.cuda.is_available() is False); the CPU suite is ./dev test" >&2
  exit 2
fi
res=${OUT:-/tmp/hisparse-gpu-tests}
mkdir -p "$res"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .gpu-deps/vllm/_flashmla_C.abi3.so ] && [ -z "${HISPARSE_FLASHMLA_LIB:-}" ]; then
  export HISPARSE_FLASHMLA_LIB=$PWD/.gpu-deps/vllm/_flashmla_C.abi3.so
fi
site=/tmp/site
if ls .gpu-deps/flashinfer/*.whl >/dev/null 2>&1 && ! python3 -c 'import flashinfer' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$site" .gpu-deps/flashinfer/*.whl && export PYTHONPATH=$PYTHONPATH:$site
fi
# the wheel of torch's CUDA major (another major's UCX can't register GPU memory)
nixl_mod=$(python3 -c 'import torch; print("nixl_cu" + (torch.version.cuda or "12").split(".")[0])' 2>/dev/null)
if ls .gpu-deps/nixl/*.whl >/dev/null 2>&1 && ! python3 -c "import ${nixl_mod:-nixl_cu12}" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$site" .gpu-deps/nixl/*.whl
  case ":$PYTHONPATH:" in *":$site:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$site ;; esac
fi
if ! python3 -c 'import xdist' 2>/dev/null && ls .gpu-deps/pytest/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target "$site" .gpu-deps/pytest/*.whl
  case ":$PYTHONPATH:" in *":$site:"*) ;; *) export PYTHONPATH=$PYTHONPATH:$site ;; esac
fi
cores=$(nproc 2>/dev/null || echo 2)
workers=${HS_GPU_WORKERS:-$(( cores / 2 > 8 ? 8 : (cores / 2 < 1 ? 1 : cores / 2) ))}
python3 -c "import torch, triton; print(f'[gpu-tests] {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}')"
common=(-q -rs -p no:cacheprovider --durations=15)
t0=$SECONDS
status=0
export HISPARSE_CAPTURE_LOADS="$res/capture-loads-$mode.txt"
: > "$HISPARSE_CAPTURE_LOADS"
phase() {  # name marker-expression extra-args...
  local name=$1 expr=$2; shift 2
  local p0=$SECONDS rc
  echo "[gpu-tests] $name: -m \"$expr\" $*"
  python3 -m pytest tests -m "$expr" "${common[@]}" --junitxml="$res/gpu-tests-$name.xml" "$@"
  rc=$?
  # no test selected: fine for the gpu_alone phase, a broken selection for the main one
  [ "$rc" -eq 5 ] && [ "${name%-alone}" != "$name" ] && rc=0
  echo "[gpu-tests] $name: exit $rc in $((SECONDS - p0)) s"
  [ "$rc" -ne 0 ] && status=1
  return 0
}
if python3 -c 'import xdist' 2>/dev/null && [ "$workers" -gt 1 ]; then
  phase "$mode" "($sel) and not gpu_alone" -n "$workers" --dist loadfile "$@"
  phase "$mode-alone" "($sel) and gpu_alone" "$@"
else
  echo "[gpu-tests] pytest-xdist not importable (or one worker): one process"
  phase "$mode" "$sel" "$@"
fi
echo "[gpu-tests] kernels first loaded inside a capture: $(wc -l < "$HISPARSE_CAPTURE_LOADS") (in $HISPARSE_CAPTURE_LOADS)"
echo "[gpu-tests] suite '$mode' $([ $status -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - t0)) s (results: $res)"
exit $status
