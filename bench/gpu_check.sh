#!/usr/bin/env bash
# The prepared GPU check: one command, no interaction, for one call of the device tool (600 s at
# most): steps of 510 s in all, under a deadline that also counts each step's grace to stop, the
# figures most worth having first. Output is unbuffered and every step writes as it goes, so a step
# cut short (SIGINT at its limit, SIGKILL 15 s later) still returns what it measured.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]      # default: $OUT if set (the device tool's folder), else ./gpu_results
#   PYTHON=python bash bench/gpu_check.sh      # the interpreter (default python3, as on the GPU image)
#
# The GPU machine's image has torch 2.11, Triton 3.6 and transformers 5.17, not Ray, NIXL or a
# network: no step needs them (tests/unit/test_gpu_image.py imports every step with them blocked;
# `python bench/compile_check.py` compiles the kernels with Triton 3.6). Eight files at most land in
# RESULTS_DIR: summary.txt (versions, then one line per step), a .txt per step and kernels.json.
# Record the figures in docs/gpu.md with the date and this command.
set -u
RESULTS="${1:-${OUT:-./gpu_results}}"
PY="${PYTHON:-python3}"
DEADLINE=${GPU_CHECK_DEADLINE:-575}   # seconds from the start by which every step has ended
GRACE=${GPU_CHECK_GRACE:-15}          # seconds between a step's SIGINT and its SIGKILL
MIN_STEP=${GPU_CHECK_MIN_STEP:-10}    # a step left fewer seconds than this is skipped
mkdir -p "$RESULTS"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1
START=$SECONDS

step() {   # step NAME SECONDS COMMAND...: output to RESULTS/NAME.txt, status to RESULTS/summary.txt
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - (SECONDS - START) - GRACE))
  if [ "$left" -lt "$MIN_STEP" ]; then
    echo "$name skipped: the deadline is near" | tee -a "$RESULTS/summary.txt"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout -s INT -k "$GRACE" "$limit" "$@" >> "$RESULTS/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s (limit ${limit}s)$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ', cut at its limit')" \
    | tee -a "$RESULTS/summary.txt"
}

: > "$RESULTS/summary.txt"
timeout -k 5 60 "$PY" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" \
  >> "$RESULTS/summary.txt" 2>&1 || echo "env: no CUDA device or a package is missing" >> "$RESULTS/summary.txt"
# 1. Kernels, bf16: correctness against the torch references, then decode attention GB/s against
#    the HBM peak and prefill against SDPA (kernels.json written after each section).
step kernels 150 "$PY" bench/kernel_speed.py --correctness-dtypes bfloat16 --skip-engine --json "$RESULTS/kernels.json"
# 2. The engine's decode tok/s at batch 1, 8 and 64, decode graphs on (first) and off, beside transformers.
step engine 110 "$PY" bench/engine_vs_transformers.py --device cuda --batches 1 8 64 --new-tokens 64 --repeats 1
# 3. The batch-invariant mode through the Triton kernels: its divergence (first), then its cost.
step determinism 70 "$PY" bench/determinism.py --device cuda --model bench --batches 1 8 64 --new-tokens 32 --repeats 1
# 4. The suite's CUDA cases (marked `cuda`; they skip without CUDA): exactness against transformers,
#    decode graphs, device checksums, placement, CUDA IPC between two processes.
step cuda_tests 90 "$PY" -m pytest -v -p no:cacheprovider -m cuda \
  tests/unit/test_kv_checksums.py tests/unit/test_lazy_checkpoint.py tests/integration/test_device_placement.py \
  tests/integration/test_decode_graphs.py tests/unit/test_cuda_ipc.py tests/integration/test_cuda_exactness.py
# 5. A P/D handoff's bytes between two processes on the GPU (CUDA IPC: no NIXL there), GB/s.
step transfer 30 "$PY" bench/transfer.py --device cuda --transports cuda_ipc --sizes-mib 16 256 --layout llama8b --repeats 3
# 6. Kernel correctness in fp16 and fp32 (added to kernels.json).
step kernels_more 60 "$PY" bench/kernel_speed.py --correctness-dtypes float16 float32 --correctness-only \
  --json "$RESULTS/kernels.json"
echo "results in $RESULTS ($((SECONDS - START)) s)"
