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

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
