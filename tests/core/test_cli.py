"""`bitdelta compress | inspect | verify` as a user runs them (`python -m bitdelta.cli`), and a
missing input named in the error."""

from __future__ import annotations

import json

from tests.support.cli import run_cli


def test_cli_compress_inspect_apply(family, tmp_path):
    base, (v0, _) = family
    out = tmp_path / "c.safetensors"
    code, text = run_cli(
        "compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--alpha", "matrix"
    )
    assert code == 0, text
    code, text = run_cli("inspect", str(out), "--json")
    info = json.loads(text[text.index("{") :])
    assert info["alpha_mode"] == "matrix"
    assert info["bytes"]["total"] == out.stat().st_size
    assert info["ratio_compressed_part"] > 10  # 1 bit vs 16 bits, less the scales
    code, text = run_cli("verify", str(out), "--base", str(base))
    assert code == 0 and "OK" in text
    code, text = run_cli("compress", "--base", str(base), "--finetuned", str(tmp_path / "nope"), "--out", str(out))
    assert code != 0 and "config.json" in text
