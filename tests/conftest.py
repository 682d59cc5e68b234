"""Test-wide set-up.

Triton's interpreter must be switched on before `bitdelta_kernels` is imported, so the
same public kernel functions run their Triton code on CPU tensors in CI. On a
machine with CUDA the real compiler is used.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every CPU code path runs under the fp32 rule of bitdelta.precision, as on a CPU without
# native bf16 (the slowest common case, and the same numerics on every machine); the
# bf16 rule itself is tested in tests/core/test_precision.py. Set BITDELTA_CPU_PRECISION=auto to run
# the suite under this machine's own choice. The variable is the choice's alias, read once
# per process (here and in every server process a test starts).
os.environ.setdefault("BITDELTA_CPU_PRECISION", "fp32")

# after the variables above: what it imports may read them
from bitdelta.testing.cluster import exited_processes
from bitdelta.testing.real import cached_real_artifact, real_deltas_of, short_real_finetunes


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report names the services of its clusters that had died by then, with the
    end of their logs: a test that fails on a refused connection then says why."""
    report = (yield).get_result()
    if report.failed:
        for i, text in enumerate(exited_processes()):
            report.sections.append((f"cluster process no longer running ({i + 1})", text))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cuda: the CUDA profile (`pytest -m cuda`, run by bench/gpu.sh): kernel grids and batch invariance "
        "in bf16. They run everywhere: on CPU through the interpreter / C kernels, on a GPU with real dots.",
    )


@pytest.fixture(scope="module")
def cpu_kernels():
    """The worker's production kernels for this machine, for a whole module: the compiled C
    kernels on CPU (the Triton interpreter costs seconds per token at model sizes;
    test_worker_triton covers it), Triton on CUDA (the worker's tensors are on the GPU there)."""
    from bitdelta_kernels.settings import configured

    with configured(backend="auto" if torch.cuda.is_available() else "cpu"):
        yield


# --- the real model family ------------------------------------------------------------------
# bitdelta.testing.real builds and caches what tests serve from the real model (also the deploy
# check's family when data/ holds none); these fixtures hand it to the test modules.


@pytest.fixture(scope="session")
def artifact_cache():
    """`cached_real_artifact` for test modules: (name, key, build) -> entry dir."""
    return cached_real_artifact


@pytest.fixture(scope="session")
def real_finetune_cache():
    """`short_real_finetunes` for test modules: (real_base, {variant: corpus}, cfg, delta) -> entry dir."""
    return short_real_finetunes


@pytest.fixture(scope="session")
def real_base():
    from bitdelta import family
    from bitdelta.family import build as fb

    return fb.build_base(family.paths())


@pytest.fixture(scope="session")
def real_deltas(real_base) -> dict:
    """variant name -> delta file (at least two) for the real base."""
    return real_deltas_of(real_base)
