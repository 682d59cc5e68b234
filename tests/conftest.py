"""Test-wide set-up.

Triton's interpreter must be switched on before `kernels` is imported, so the
same public kernel functions run their Triton code on CPU tensors in CI. On a
machine with CUDA the real compiler is used.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every CPU code path runs under the fp32 rule of bitdelta.precision, as on a CPU without
# native bf16 (the slowest common case, and the same numerics on every machine); the
# bf16 rule itself is tested in test_precision.py. Set BITDELTA_CPU_PRECISION=auto to run
# the suite under this machine's own choice.
os.environ.setdefault("BITDELTA_CPU_PRECISION", "fp32")


@pytest.fixture(scope="module")
def cpu_kernels():
    """The worker's production CPU path (the compiled C kernels) for a whole module: the
    Triton interpreter costs seconds per token at model sizes (test_worker_triton covers it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("BITDELTA_KERNEL_BACKEND", "cpu")
    yield
    mp.undo()


# --- the real model family ------------------------------------------------------------------
# Tests whose point is the real model use the converted SmolLM2-135M base (converted into the
# data directory on first use, ~30 s, as `bitdelta family build` would) and real deltas: the
# family's own when built, otherwise two short real fine-tunes of the base (a few optimizer
# steps each), compressed like the serving default. Nothing is skipped when data/ is empty.


@pytest.fixture(scope="session")
def real_base():
    from bitdelta import family
    from bitdelta.family import build as fb

    return fb.build_base(family.paths())


@pytest.fixture(scope="session")
def real_deltas(real_base, tmp_path_factory) -> dict:
    """variant name -> delta file (at least two) for the real base."""
    from bitdelta import family
    from bitdelta.checkpoint import fingerprint
    from bitdelta.format import read_header

    p = family.paths()
    fp = fingerprint(real_base)
    built = {v: p.deltas[v] for v in p.variants
             if p.deltas[v].is_file() and read_header(p.deltas[v]).meta.base_fingerprint == fp}
    if len(built) >= 2:
        return built
    from bitdelta.compress import compress
    from bitdelta.family.finetune import FinetuneConfig, finetune

    root = tmp_path_factory.mktemp("real_deltas")
    out = {}
    for variant, corpus in (("math", "arithmetic"), ("coder", "stdlib")):
        ft = root / "finetuned" / variant
        finetune(real_base, corpus, ft, FinetuneConfig(steps=3, batch=1, seq_len=64, warmup=0, lr=3e-4,
                                                       eval_windows=1), progress=False)
        out[variant] = compress(real_base, ft, root / "deltas" / f"{variant}.bitdelta.safetensors",
                                variant=variant, embeddings="sign", progress=False)
    return out
