"""The README's first command's serving part (scripts/demo.py) runs end to end: delta store, two
workers and the router as processes, the three rounds of requests, a clean stop. Run here on the
tiny random family (the real family's build is `bitdelta family build`; its quality is the
quality tests' subject)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bitdelta.testing.family import make_test_family

ROOT = Path(__file__).resolve().parents[1]


def test_demo_serves_every_model_through_the_router(tmp_path):
    fam = make_test_family(tmp_path / "family", n_variants=2, merged=False)
    for bad in (fam.corrupt, fam.other_base):
        os.remove(fam.delta_path(bad))
    env = {**os.environ, "BITDELTA_KERNEL_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "scripts/demo.py",
            "--base",
            str(fam.base),
            "--deltas",
            str(fam.deltas),
            "--max-new-tokens",
            "6",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for words in ("round 1", "round 2", "round 3", "identical", "resident on", "grpcurl"):
        assert words in out, words
    # every model answered in round 1 with its TTFT breakdown and worker; v1 is cold again in round 3
    for model in ("base", "v0", "v1"):
        assert any(
            line.startswith(f"--- {model} ") and "ttft" in line and "prefill" in line for line in out.splitlines()
        ), model
    assert "exit codes [0, 0, 0, 0, 0]" in out and "the OpenAI-compatible gateway" in out and "AsyncOpenAI" in out
