#!/usr/bin/env bash
# One GPU session in one command (< 8 minutes on an H200: the steps' limits add up to 430 s, 560 s with
# --tune-first), from the repository root, with the machine's own python3 (no .venv there; it must not
# install anything):
#
#   bash bench/gpu.sh              # worker benchmark (eager, then CUDA graphs), CUDA test profile, kernels
#   bash bench/gpu.sh --tune-first # the launch-configuration sweep first, then every step on its table
#   bash bench/gpu.sh --dry-run    # the same steps on CPU with tiny shapes (Triton interpreter)
#
# A GPU image with torch and triton but not the project's other packages, and no registry: make
# their wheels here with bench/gpu_wheels.sh, which says how to install them there.
#
# Everything lands in bench/results/<date>-<gpu>/ (logs included), each step under its own
# time limit so one overrun still leaves the others' results. Exit status: 0 if every step
# passed, else the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # a step stopped at its limit still leaves its log
DRY=0
TUNE_FIRST=0
[ "${1:-}" = "--dry-run" ] && DRY=1
[ "${1:-}" = "--tune-first" ] && TUNE_FIRST=1

if [ $DRY = 1 ]; then
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    gpu=cpu-dry-run
else
    gpu=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0).replace(" ", "-"))') || {
        echo "[gpu] no CUDA device visible to $PY"; exit 1; }
fi
out=${OUT_DIR:-bench/results/$(date -u +%Y-%m-%d)-$gpu}
mkdir -p "$out"
echo "[gpu] results in $out"
"$PY" - > "$out/versions.txt" 2>&1 <<'PYEOF'
import platform, numpy, torch
print("python", platform.python_version(), "torch", torch.__version__, "numpy", numpy.__version__)
try:
    import triton; print("triton", triton.__version__)
except Exception as e: print("triton: not importable:", e)
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PYEOF
cat "$out/versions.txt"

# the generated protobuf modules are git-ignored: generate them (grpc_tools) or use carried ones
if "$PY" -c 'import grpc_tools' 2>/dev/null; then
    "$PY" -m bitdelta.protos_build || echo "[gpu] protos_build failed"
fi
if ! "$PY" -c 'import bitdelta.delta_store.v1.delta_store_pb2' 2>/dev/null; then
    echo "[gpu] WARNING: no generated protobuf modules (no grpc_tools here and none carried):"
    echo "[gpu]          the worker steps will fail; carry bitdelta/{common,delta_store,gpu_worker,router}/v1"
fi

failed=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $out/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "[gpu] == $name (limit ${limit}s)"
    timeout --signal=INT --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "[gpu] == $name: exit $rc in $((SECONDS - t0))s"
    [ $rc = 0 ] || failed=$((failed + 1))
}

if [ $DRY = 1 ]; then
    # CPU: the profile's tests through the interpreter / C kernels (the GPU guard test is off)
    step tests 900 "$PY" -m pytest -q -m cuda -x -p no:cacheprovider tests/kernels/test_kernel_numerics.py \
        tests/gpu_worker/test_worker_batch_invariance.py
    step kernels 600 "$PY" bench/kernels.py --dry-run --reps 1 --out "$out"
    step worker 600 "$PY" bench/worker.py --preset tiny --new-tokens 4 --prompt-len 32 --reps 1 \
        --variants 1,4 --decode-batches 1,8 --kv-cache 8388608 --cuda-graphs --out "$out/worker.json"
else
    if [ $TUNE_FIRST = 1 ]; then  # the launch configurations this GPU measures best, for every step below
        step tune 130 "$PY" -m bitdelta_kernels.tune --out "$out/tuned_configs.json"
        [ -s "$out/tuned_configs.json" ] && export BITDELTA_KERNEL_CONFIGS="$(realpath "$out/tuned_configs.json")"
        echo "[gpu] kernel configs: ${BITDELTA_KERNEL_CONFIGS:-bitdelta_kernels/configs.json}"
    fi
    # most important first; Triton compiles (~1-2 s per binary) dominate the first two steps.
    # decode at batch 1, 8, 64 as a fraction of the HBM limit: where the per-step overhead stands
    # (building the random 7B-shaped family on the host takes about a minute of it)
    # then the same decode measures with each step's layers replayed as a CUDA graph (--cuda-graphs)
    step worker 200 "$PY" bench/worker.py --preset gpu7b --new-tokens 32 --prompt-len 256 --reps 2 \
        --decode-batches 1,8,64 --kv-cache 1073741824 --cuda-graphs --out "$out/worker.json"
    export BITDELTA_REQUIRE_CUDA=1  # the profile fails if it is not really on the GPU
    # the tests' Triton compiles spread over the host's cores where pytest-xdist is installed
    par=()
    "$PY" -c 'import xdist' 2>/dev/null && par=(-n 8)
    step tests 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider -p no:benchmark "${par[@]}" tests/kernels/test_kernel_numerics.py \
        tests/gpu_worker/test_worker_batch_invariance.py tests/kernels/test_kernels.py tests/kernels/test_unpack.py \
        tests/gpu_worker/test_worker_graphs.py
    step kernels 80 "$PY" bench/kernels.py --out "$out"
    # the launch-configuration sweep only with --tune-first (two H200 sweeps kept the shipped table)
fi
# the worker step runs the tensor-parallel size 1 path (one process, one GPU); TP >= 2 (one rank per
# GPU over NCCL, docs/tensor-parallel.md) needs a machine with several GPUs: its numbers wait for one
echo "[gpu] tensor parallel: measured TP = 1 on one GPU; TP >= 2 numbers wait for a machine with several GPUs" \
    | tee "$out/tensor-parallel.txt"
echo "[gpu] done: $failed step(s) failed; results in $out"
exit $failed
