"""Run `bitdelta` as a user does: `python -m bitdelta.cli ARGS` in the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of one `bitdelta` command."""
    p = subprocess.run([sys.executable, "-m", "bitdelta.cli", *args], capture_output=True, text=True, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr
