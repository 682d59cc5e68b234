"""The capacity planner: the brief's arithmetic, the corrections, and agreement
with the bytes `bitdelta compress` actually writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bitdelta import cli, plan

ROOT = Path(__file__).resolve().parents[2]
LLAMA2_70B = json.loads((ROOT / "configs" / "llama-2-70b.json").read_text())


def test_brief_arithmetic_for_70b():
    p = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=80e9, gpus=8)
    assert p.brief["params"] == 70e9
    assert p.brief["base"] == pytest.approx(140e9)
    assert p.brief["delta"] == pytest.approx(8.75e9)
    assert p.brief["total"] == pytest.approx(262.5e9)
    # 8.75 GB at 3-7 GB/s: 1.25-2.9 s, not 200 ms.
    assert p.load["brief_delta_nvme_s"] == pytest.approx([8.75 / 3, 8.75 / 7])


def test_corrected_bytes_for_70b_by_hand():
    s = plan.Shape.from_hf(LLAMA2_70B)
    d, kv, f = 8192, 1024, 28672
    per_layer = d * d * 2 + kv * d * 2 + 3 * d * f
    assert s.projection_params == 80 * per_layer
    assert s.params == 80 * per_layer + 2 * 32000 * d + (2 * 80 + 1) * d  # untied head, norms
    db = plan.delta_bytes(s, "bf16", "row", "dense")
    assert db.signs == 80 * per_layer // 8
    assert db.alpha == 80 * (d + kv + kv + d + f + f + d) * 4
    assert db.dense == (2 * 32000 * d + (2 * 80 + 1) * d) * 2
    assert plan.delta_bytes(s, "bf16", "matrix", "dense").alpha == 80 * 7 * 4
    assert plan.kv_bytes_per_token(s) == 2 * 80 * 8 * 128 * 2  # 320 KiB


def test_per_gpu_placement_and_capacity():
    p = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=80e9, gpus=8, context=4096, reserve_frac=0.1)
    # 1/8 of everything but the replicated norms and row-parallel α's (bitdelta.shard)
    assert p.base_per_gpu == pytest.approx(p.base_bytes / 8, rel=1e-3) and p.base_per_gpu > p.base_bytes / 8
    assert p.kv_per_token_per_gpu == pytest.approx(p.kv_per_token / 8)
    free = 80e9 - 8e9 - p.base_per_gpu - 14 * p.delta_per_gpu
    assert p.free_for_kv_per_gpu == pytest.approx(free)
    assert p.sequences_per_replica == int(free // (p.kv_per_token / 8 * 4096))
    # Two TP-4 replicas: each GPU holds twice the shard; KV heads 8 over 4 GPUs.
    p4 = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=80e9, gpus=8, tp=4)
    assert p4.replicas == 2 and p4.base_per_gpu == pytest.approx(p.base_bytes / 4, rel=1e-3)
    # TP beyond the KV heads replicates them: 16 GPUs, 8 KV heads -> one head per GPU.
    p16 = plan.make_plan(LLAMA2_70B, variants=1, gpu_mem=80e9, gpus=16)
    assert p16.kv_per_token_per_gpu == pytest.approx(p.kv_per_token / 8)
    # Too many variants for one 24 GB GPU: does not fit, zero sequences.
    small = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=24e9, gpus=8)
    assert not small.fits and small.sequences_per_replica == 0


def test_planner_agrees_with_real_compressed_files(tmp_path):
    """The planner's bytes for a full fine-tune equal what compress() writes (tiny model, fp32)."""
    from bitdelta.checkpoint import read_config
    from bitdelta.compress import compress
    from bitdelta.format import read_header
    from tests.support.family import make_tiny_family

    base, (v0,) = make_tiny_family(tmp_path, n_variants=1)
    cfg = read_config(base)
    s = plan.Shape.from_hf(cfg)
    for alpha, emb in (("row", "dense"), ("matrix", "dense"), ("row", "sign")):
        roles = read_header(
            compress(base, v0, tmp_path / f"{alpha}-{emb}.st", alpha_mode=alpha, embeddings=emb, progress=False)
        ).bytes_by_role()
        want = plan.delta_bytes(s, "fp32", alpha, emb)
        assert (roles["sign"], roles["alpha"], roles["dense"]) == (want.signs, want.alpha, want.dense), (alpha, emb)


@pytest.mark.parametrize(
    "text,value",
    [
        ("80GB", 80e9),
        ("80GiB", 80 * 2**30),
        ("141 GB", 141e9),
        ("512MiB", 512 * 2**20),
        ("1e3", None),
        ("2k", 2000),
        ("3 kB", 3000),
    ],
)
def test_parse_bytes(text, value):
    if value is None:
        with pytest.raises(ValueError):
            plan.parse_bytes(text)
    else:
        assert plan.parse_bytes(text) == value


def test_nominal_size():
    assert plan.nominal_size(68_976_648_192) == 70e9
    assert plan.nominal_size(6_738_415_616) == 7e9
    assert plan.nominal_size(134_515_008) == 0.135e9


def test_cli_plan(capsys):
    rc = cli.main(
        [
            "plan",
            "--config",
            str(ROOT / "configs" / "llama-2-70b.json"),
            "--variants",
            "14",
            "--gpu-mem",
            "80GB",
            "--gpus",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "base + 14 deltas = 262.50 GB" in out and "one delta = 70B / 8 = 8.75 GB" in out
    assert "not 200 ms" in out and "concurrent sequences" in out
    rc = cli.main(["plan", "--config", "/nonexistent.json"])
    assert rc == 1 and "cannot read the config" in capsys.readouterr().err
