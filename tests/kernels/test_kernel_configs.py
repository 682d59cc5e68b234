"""Launch configurations: every shipped one fits its GPU, and tiles fill the GPU at every batch size.

No GPU needed: the resource model (bitdelta_kernels/configs.py) is arithmetic on the block sizes,
and the tile/split choice is arithmetic on the shapes and the SM count.
"""

from __future__ import annotations

import json

import pytest

from bitdelta_kernels import configs as kc

GPUS = kc.device_names() + ["default"]
SMS = {"H100": 132, "H200": 132, "A100": 108, "default": 46}
KINDS = ("linear", "sgmv", "bgmv")


def shipped(cfg: dict):
    """(kind, blocks) of every configuration an entry ships."""
    for b in cfg["linear"]:
        yield "linear", {k: v for k, v in b.items() if k not in ("max_m", "min_block_n")}
    yield "sgmv", cfg["sgmv"]
    yield "bgmv", cfg["bgmv"]


@pytest.mark.parametrize("elem_bytes", [2, 4], ids=["16bit", "fp32"])
@pytest.mark.parametrize("gpu", GPUS)
def test_every_shipped_config_fits_its_gpu_unchanged(gpu, elem_bytes):
    cfg = kc.device_config(gpu)
    for kind, b in shipped(cfg):
        smem, regs = kc.RESOURCES[kind](b, elem_bytes)
        assert smem <= cfg["smem_per_block"], (kind, b, smem)
        assert regs <= kc.MAX_REGS_PER_THREAD, (kind, b, regs)
        assert kc.fit(kind, b, elem_bytes, cfg["smem_per_block"]) == b  # the launcher launches it as shipped


def test_the_model_rejects_the_old_h100_fp32_prefill_tile():
    # 128×256×64, 3 stages: 96 KiB of fp32 operands per stage > 227 KiB in three stages
    old = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    assert not kc.fits("linear", old, 4, 232448)
    with pytest.raises(ValueError, match="choose smaller blocks"):
        kc.fit("linear", old, 4, 232448)  # two accumulators of 128×256 overflow the registers at any depth
    deep = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 8}
    fitted = kc.fit("linear", deep, 4, 101376)
    assert fitted["num_stages"] < 8 and kc.fits("linear", fitted, 4, 101376)


@pytest.mark.parametrize("gpu", ["H100", "H200", "A100"])
@pytest.mark.parametrize("N", [1024, 4096, 8192, 11008, 28672])
@pytest.mark.parametrize("M", [1, 4, 16, 17, 32, 64, 65, 128, 512, 2048])
def test_tiles_and_split_fill_the_gpu(gpu, M, N):
    cfg = kc.device_config(gpu)
    K = 4096
    b = kc.linear_blocks(cfg, M, N, K, SMS[gpu])
    programs = kc._cdiv(M, b["BLOCK_M"]) * kc._cdiv(N, b["BLOCK_N"]) * b["SPLIT_K"]
    assert programs >= SMS[gpu], b  # every SM has work
    assert b["SPLIT_K"] == 1 or K // b["SPLIT_K"] >= cfg["min_k_per_split"]
    assert b["BLOCK_M"] <= max(16, 2 * M) or b["BLOCK_M"] == kc.linear_bucket(cfg, M)["BLOCK_M"]
    assert kc.fits("linear", b, 2, cfg["smem_per_block"])


def test_mid_batches_leave_prefill_tiles():
    # the case: 17–64 rows of one variant on 128×256 prefill tiles gave 32 CTAs on 132 SMs
    cfg = kc.device_config("H200")
    for M in (17, 40, 64):
        b = kc.linear_blocks(cfg, M, 8192, 8192, 132)
        assert b["BLOCK_M"] <= 64
        assert kc._cdiv(M, b["BLOCK_M"]) * kc._cdiv(8192, b["BLOCK_N"]) * b["SPLIT_K"] >= 132  # was 32


def test_override_wins_and_bucket_order():
    cfg = kc.device_config("H100")
    assert kc.linear_blocks(cfg, 3, 4096, 4096, 132, {"SPLIT_K": 1, "BLOCK_N": 128})["BLOCK_N"] == 128
    ms = [kc.linear_bucket(cfg, m)["BLOCK_M"] for m in (1, 16, 17, 64, 65, 10**6)]
    assert ms == sorted(ms)


@pytest.mark.parametrize("gpu", ["H100", "H200"])
def test_the_search_space_fits(gpu):
    # python -m bitdelta_kernels.tune tunes the GPU's serving dtype (bf16) and skips what does not fit; all of these do
    cfg = kc.device_config(gpu)
    base = {
        "linear_decode": kc.linear_bucket(cfg, 1),
        "linear_mid": kc.linear_bucket(cfg, 32),
        "linear_prefill": kc.linear_bucket(cfg, 10**6),
        "sgmv": cfg["sgmv"],
        "bgmv": cfg["bgmv"],
    }
    space = kc._table()["search"]
    for key, cands in space.items():
        if key.startswith("_"):
            continue
        kind = key.split("_")[0]
        for c in cands:
            assert kc.fits(kind, {**base[key], **c}, 2, cfg["smem_per_block"]), (key, c)


@pytest.mark.parametrize("gpu", ["H100", "H200", "A100"])
def test_tune_candidates_start_from_the_shipped_blocks_and_fit(gpu):
    from bitdelta_kernels import tune

    cfg = kc.device_config(gpu)
    for bucket in ("linear_decode", "linear_mid", "linear_prefill", "sgmv", "bgmv"):
        cands = tune.candidates(cfg, bucket, 2, cfg["smem_per_block"])
        kind = bucket.split("_")[0]
        assert len(cands) >= 2 and all(kc.fits(kind, b, 2, cfg["smem_per_block"]) for b in cands)
        assert len({json.dumps(b, sort_keys=True) for b in cands}) == len(cands)
