"""Run `bitdelta` as a user does: `python -m bitdelta.cli ARGS` in the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of one `bitdelta` command, in the tests' environment but for
    TRITON_INTERPRET (tests/conftest.py sets it for the test process's own kernel calls): a user's
    command on a CPU runs the C kernels, and under the interpreter one distilling compress of the
    tiny family took 46 s instead of 6."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-m", "bitdelta.cli", *args], capture_output=True, text=True, cwd=ROOT, env=env)
    return p.returncode, p.stdout + p.stderr
