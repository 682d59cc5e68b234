#!/usr/bin/env bash
# Compatibility check with the GPU machine's older stack: triton 3.6.0 (with numpy < 2.4, which
# its interpreter needs) under the project's torch, in a second virtualenv that reuses .venv
# for everything else. Runs the kernel tests (Triton interpreter) and the worker's batch-
# invariance tests (engine + kernels). torch 2.11 itself cannot be installed here (PyPI only has
# its CUDA build, several GB): the GPU session checks it (bench/gpu.sh records the versions).
#
#   bash scripts/compat.sh        # needs .venv (scripts/setup.sh) and the package registry once
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
V=.venv/compat  # inside .venv: ignored, and removed with it
if [ ! -x $V/bin/python ]; then
    .venv/bin/python -m venv $V
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
csite=$($V/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" > "$csite/zz-main-venv.pth"  # .venv's packages after this venv's own
if ! $V/bin/python -c 'import triton, numpy, sys; sys.exit(triton.__version__ != "3.6.0" or tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4))' 2>/dev/null; then
    $V/bin/python -m pip install -q --no-deps "triton==3.6.0" "numpy>=1.26,<2.4"
fi
$V/bin/python -c 'import torch, triton, numpy; print("compat stack: torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
OMP_NUM_THREADS=1 exec $V/bin/python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_kernels_planes.py tests/kernels/test_kernel_numerics.py \
    tests/kernels/test_kernel_configs.py tests/gpu_worker/test_worker_batch_invariance.py tests/gpu_worker/test_worker_startup.py "$@"
