#!/usr/bin/env bash
# The Python packages bench/gpu.sh needs that a GPU image with only torch and triton lacks, as
# wheels in .wheels/ (git-ignored), at the versions of this checkout's .venv: the generated protobuf
# modules need the grpcio and protobuf they were generated with. For a GPU machine that cannot reach
# a package registry (the wheels travel with the working tree); run here, from the repository root:
#
#   bash bench/gpu_wheels.sh                  # CPython 3.12 wheels (GPU_PYTHON=3.11 for another)
#
# then on the GPU machine, in the repository root (with .wheels/ and the generated bitdelta/*/v1
# modules copied along; `python -m bitdelta.protos_build` makes them here):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl
#   PYTHONPATH=/tmp/site bash bench/gpu.sh
#
# The first H200 runs (bench/results/2026-12-04-NVIDIA-H200/) had torch, triton, numpy, pytest,
# pytest-xdist, safetensors, tokenizers and aiofiles in their image and took these from here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
GPU_PYTHON=${GPU_PYTHON:-3.12}
PACKAGES=(grpcio grpcio-health-checking grpcio-reflection protobuf opentelemetry-api opentelemetry-sdk
    opentelemetry-semantic-conventions llguidance pytest-asyncio)
pins=()
for p in "${PACKAGES[@]}"; do
    v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p") || {
        echo "[gpu-wheels] $p is not installed in $PY: run scripts/setup.sh first" >&2
        exit 1
    }
    pins+=("$p==$v")
done
platforms=()
for n in 17 24 27 28 31 34 35 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
rm -rf .wheels
mkdir -p .wheels
for pin in "${pins[@]}"; do  # one at a time: pip resolves each pin's own platform tags
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .wheels "$pin"
done
echo "[gpu-wheels] $(ls .wheels | wc -l) wheels, $(du -sh .wheels | cut -f1), in .wheels/: ${pins[*]}"
