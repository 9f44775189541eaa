#!/usr/bin/env bash
# The prepared GPU check: one command, no interaction, under 4 minutes on one H200, results written
# to one folder as it goes (a run cut short still returns what it measured). The step limits add
# up to 240 s.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]      # default: $OUT if set (the device tool's folder), else ./gpu_results
#
# The GPU machine has PyTorch, Triton and transformers, not Ray or NIXL: every step here runs
# without them. Each step has its own time limit; a failed or timed-out step is recorded and the
# next one runs. Record the figures in docs/gpu.md with the date and this command.
set -u
RESULTS="${1:-${OUT:-./gpu_results}}"
mkdir -p "$RESULTS"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false

step() {   # step NAME SECONDS COMMAND...: output to RESULTS/NAME.txt, status to RESULTS/summary.txt
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$RESULTS/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$RESULTS/summary.txt"
}

: > "$RESULTS/summary.txt"
step env 10 python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))"
# 1. The test suite's CUDA cases (marked `cuda`; they skip without CUDA). Files that need Ray or
#    NIXL are not collected here.
step cuda_tests 50 python -m pytest -q -p no:cacheprovider -m cuda \
  tests/unit/test_kv_checksums.py tests/unit/test_lazy_checkpoint.py tests/integration/test_device_placement.py \
  tests/integration/test_decode_graphs.py tests/unit/test_cuda_ipc.py tests/integration/test_cuda_exactness.py
# 2. Kernel correctness and speed: decode attention GB/s against the HBM peak, prefill against SDPA.
step kernels 70 python bench/kernels.py --json "$RESULTS/kernels.json"
# 3. The engine's decode throughput at batch 1, 8 and 64, decode graphs on and off, beside transformers.
step engine 45 python bench/engine_vs_transformers.py --device cuda --batches 1 8 64 --new-tokens 64 --repeats 1
# 4. The batch-invariant mode through the Triton kernels: its cost and its divergence.
step determinism 40 python bench/determinism.py --device cuda --model bench --batches 1 8 64 --new-tokens 32 --repeats 1
# 5. A P/D handoff's bytes between two processes on the GPU (CUDA IPC: no NIXL here), GB/s.
step transfer 25 python bench/transfer.py --device cuda --transports cuda_ipc --sizes-mib 16 256 --layout llama8b --repeats 3
echo "results in $RESULTS"
