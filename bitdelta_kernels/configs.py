"""Per-GPU launch configurations of the Triton kernels, kept as data in configs.json,
and the resource model that checks a configuration fits its GPU before it launches.

Tile choice for the fused linear (`linear_blocks`): the first bucket of the entry's
`linear` list whose `max_m` ≥ M gives the blocks; BLOCK_N is then halved (down to
`min_block_n`) while the grid has fewer than one program per SM, and split-K fills the
rest up to `target_ctas_per_sm` × SMs. So a 17–64-row batch gets 32/64-row tiles and
enough programs for a 132-SM H200, not 32 prefill-sized ones.

Resources (`linear_resources`, `sgmv_resources`, `bgmv_resources`): shared memory =
num_stages × (bytes of the tiles loaded per K-step) + the expanded sign operand staged
for the MMA (Triton stages a register operand through shared memory for mma/wgmma);
registers per thread = (accumulators + expanded sign tile + operand tiles) ÷ threads,
in 32-bit registers, plus a fixed overhead. An estimate, deliberately on the high side:
the launcher lowers num_stages until a configuration fits (`fit`), and the tests check
every shipped configuration fits its GPU unchanged for fp16, bf16 and fp32.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from bitdelta_kernels.settings import current

CONFIG_FILE = Path(__file__).with_name("configs.json")
# Registers a thread may use before the compiler spills (sm_80/sm_90), and per SM.
MAX_REGS_PER_THREAD = 255
REGS_PER_SM = 65536
# Loop indices, pointers, masks, addresses: what the estimate adds beyond the tiles.
REG_OVERHEAD = 40


@functools.cache
def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors: Triton's own TRITON_INTERPRET=1, which it
    reads when the kernels are defined (so it is set before `bitdelta_kernels` is imported), read once."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _table() -> dict:
    """The table of the setting `configs_file` (BITDELTA_KERNEL_CONFIGS), else configs.json."""
    return _load_table(current().configs_file or CONFIG_FILE)


@functools.cache
def _load_table(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def _merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`; nested dicts merge, lists (the `linear` buckets) replace."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def device_names() -> list[str]:
    """The GPU keys of the table (not 'default', 'interpreter' or '_'-prefixed notes)."""
    return _device_names(_table())


def _device_names(table: dict) -> list[str]:
    return [k for k in table if k not in ("default", "interpreter", "search") and not k.startswith("_")]


def device_config(device_name: str) -> dict:
    """The entry for a device name ('interpreter' for the interpreter), completed from 'default'."""
    return _device_config(current().configs_file or CONFIG_FILE, device_name)


@functools.cache
def _device_config(path: Path, device_name: str) -> dict:
    table = _load_table(path)
    for key in _device_names(table):
        if key in device_name:
            return _merge(table["default"], table[key])
    if device_name == "interpreter" and "interpreter" in table:
        return _merge(table["default"], table["interpreter"])
    return dict(table["default"])


def config_for(device: torch.device) -> dict:
    """The configuration for tensors on `device`."""
    if device.type != "cuda":
        return device_config("interpreter")
    return device_config(torch.cuda.get_device_name(device))


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def smem_limit(cfg: dict, device: torch.device | None = None) -> int:
    """Shared memory one block may use: the device's opt-in limit when torch reports it, else the table's."""
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        got = getattr(props, "shared_memory_per_block_optin", 0)
        if got:
            return int(got)
    return int(cfg["smem_per_block"])


# ---------------------------------------------------------------- tile choice
def linear_bucket(cfg: dict, M: int) -> dict:
    """The blocks of the first `linear` bucket serving M rows (a copy)."""
    for b in cfg["linear"]:
        if b.get("max_m") is None or M <= b["max_m"]:
            return {k: v for k, v in b.items() if k != "max_m"}
    raise ValueError("configs.json: the last 'linear' bucket must have max_m null")


def linear_blocks(cfg: dict, M: int, N: int, K: int, sms: int, override: dict | None = None) -> dict:
    """Blocks and split for y[M, N] = x[M, K] · W[N, K]ᵀ (+ delta) on a GPU with `sms` SMs.

    BLOCK_N halves (not below min_block_n) while there are fewer tiles than SMs; then
    (a bucket may set its own min_block_n); then SPLIT_K "auto" splits K until target_ctas_per_sm × sms programs exist, keeping at
    least max(min_k_per_split, BLOCK_K) columns per split. `override` (tests, tuning)
    wins over everything, including SPLIT_K.
    """
    blocks = linear_bucket(cfg, M)
    min_bn = blocks.pop("min_block_n", cfg["min_block_n"])
    want = cfg["target_ctas_per_sm"] * sms
    if not (override and "BLOCK_N" in override):
        while _cdiv(M, blocks["BLOCK_M"]) * _cdiv(N, blocks["BLOCK_N"]) < sms and blocks["BLOCK_N"] // 2 >= min_bn:
            blocks["BLOCK_N"] //= 2
    if override:
        blocks.update(override)
    n_tiles = _cdiv(M, blocks["BLOCK_M"]) * _cdiv(N, blocks["BLOCK_N"])
    split = blocks["SPLIT_K"]
    if split == "auto":
        if want <= n_tiles:
            split = 1
        else:
            max_split = max(1, K // max(cfg["min_k_per_split"], blocks["BLOCK_K"]))
            split = max(1, min(max_split, want // n_tiles))
    blocks["SPLIT_K"] = int(split)
    return blocks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- resources
def linear_resources(b: dict, elem_bytes: int) -> tuple[int, int]:
    """(shared bytes, registers per thread) of the fused linear kernel with blocks `b`.

    Per K-step it loads x [BM, BK], W [BN, BK] and the sign bytes [BN, BK/8]; it holds two
    fp32 accumulators [BM, BN] (base and delta) and the expanded sign tile [BN, BK].
    """
    bm, bn, bk = b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_K"]
    stage = (bm * bk + bn * bk) * elem_bytes + bn * bk // 8
    smem = b["num_stages"] * stage + bn * bk * elem_bytes
    words = 2 * bm * bn + bn * bk + (bm * bk + bn * bk) * elem_bytes // 4 + bm
    return smem, words // (32 * b["num_warps"]) + REG_OVERHEAD


def sgmv_resources(b: dict, elem_bytes: int) -> tuple[int, int]:
    """(shared bytes, registers per thread) of the SGMV kernel: x [BM, BK] and sign bytes per step."""
    bm, bn, bk = b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_K"]
    smem = b["num_stages"] * (bm * bk * elem_bytes + bn * bk // 8) + bn * bk * elem_bytes
    words = bm * bn + bn * bk + bm * bk * elem_bytes // 4 + bm
    return smem, words // (32 * b["num_warps"]) + REG_OVERHEAD


def bgmv_resources(b: dict, elem_bytes: int) -> tuple[int, int]:
    """(shared bytes, registers per thread) of the BGMV kernel: no dot; x [BK] and bytes [BN, BK/8] per step."""
    bn, bk = b["BLOCK_N"], b["BLOCK_K"]
    smem = b["num_stages"] * (bk * elem_bytes + bn * bk // 8)
    words = bn * bk + bk + bn
    return smem, words // (32 * b["num_warps"]) + REG_OVERHEAD


RESOURCES = {"linear": linear_resources, "sgmv": sgmv_resources, "bgmv": bgmv_resources}


def fits(kind: str, b: dict, elem_bytes: int, smem_bytes: int) -> bool:
    smem, regs = RESOURCES[kind](b, elem_bytes)
    return smem <= smem_bytes and regs <= MAX_REGS_PER_THREAD and regs * 32 * b["num_warps"] <= REGS_PER_SM


def fit(kind: str, b: dict, elem_bytes: int, smem_bytes: int) -> dict:
    """`b` with num_stages lowered until it fits `smem_bytes`; ValueError if no stage count does."""
    b = dict(b)
    while not fits(kind, b, elem_bytes, smem_bytes):
        if b["num_stages"] <= 1:
            smem, regs = RESOURCES[kind](b, elem_bytes)
            raise ValueError(
                f"{kind} blocks {b} need {smem} B shared memory and ~{regs} registers per thread "
                f"with {elem_bytes}-byte inputs; the GPU allows {smem_bytes} B and "
                f"{MAX_REGS_PER_THREAD} registers: choose smaller blocks"
            )
        b["num_stages"] -= 1
    return b
