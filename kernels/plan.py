"""Per-batch metadata for the batched delta: which rows go to which variant, and which kernel runs.

The plan depends only on `row_variant`, so a worker builds it ONCE per decode
step and passes it to every layer (`plan=`). Built from a host `row_variant` (the
worker's case) it reads nothing back from the device and copies its index tensors
asynchronously from pinned memory; from a device `row_variant` it costs one sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.configs import config_for


@dataclass(frozen=True)
class BatchPlan:
    """kind: 'none' (no delta row), 'bgmv' (one program per row) or 'sgmv' (tiles of one variant).

    row_variant: int32 [M] on the device (bgmv); row_idx: int32 [rows with v ≥ 0], sorted by
    variant; tile_start / tile_end / tile_variant: int32 [T], each tile ≤ block_m rows of one
    variant (sgmv). max_rows: most rows of one variant; variants: distinct variants ≥ 0.
    """

    kind: str
    m: int
    device: torch.device
    row_variant: torch.Tensor
    max_rows: int
    variants: tuple[int, ...]
    block_m: int = 0
    row_idx: torch.Tensor | None = None
    tile_start: torch.Tensor | None = None
    tile_end: torch.Tensor | None = None
    tile_variant: torch.Tensor | None = None


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync (pinned + asynchronous copy on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def plan_batch(
    row_variant: torch.Tensor,
    n_variants: int,
    device: torch.device | None = None,
    sgmv_min_rows: int | None = None,
    block_m: int | None = None,
) -> BatchPlan:
    """Group the rows of a batch by variant.

    row_variant: int [M], −1 for base-only rows; n_variants: V of signs_stack (indices are
    checked against it here, once, so the kernels never read outside the stack).
    sgmv_min_rows and block_m default to the device's entry in configs.json.
    SGMV is chosen when some variant has ≥ sgmv_min_rows rows (prefill-sized groups:
    one tensor-core dot per tile reads S_v once per tile instead of once per row);
    otherwise BGMV (decode: each row reads its variant's bits once anyway).
    """
    if row_variant.dim() != 1:
        raise ValueError(f"row_variant must be 1-D, got {tuple(row_variant.shape)}")
    device = row_variant.device if device is None else torch.device(device)
    cfg = config_for(device)
    sgmv_min_rows = cfg["sgmv_min_rows"] if sgmv_min_rows is None else sgmv_min_rows
    block_m = cfg["sgmv"]["BLOCK_M"] if block_m is None else block_m
    rv = row_variant.to("cpu", torch.int64)
    m = rv.numel()
    if m and (int(rv.max()) >= n_variants or int(rv.min()) < -1):
        raise ValueError(f"row_variant values must lie in [-1, {n_variants - 1}]")
    active = rv >= 0
    rv_dev = _to(rv.to(torch.int32), device)
    if not bool(active.any()):
        return BatchPlan("none", m, device, rv_dev, 0, ())
    variants, counts = torch.unique(rv[active], return_counts=True)
    max_rows = int(counts.max())
    if max_rows < sgmv_min_rows:
        return BatchPlan("bgmv", m, device, rv_dev, max_rows, tuple(variants.tolist()))
    # sort active rows by variant (stable: rows keep their order inside a segment)
    order = torch.argsort(rv.masked_fill(~active, n_variants), stable=True)[: int(active.sum())]
    starts, ends, tvars = [], [], []
    pos = 0
    for v, c in zip(variants.tolist(), counts.tolist()):
        for t0 in range(0, c, block_m):
            starts.append(pos + t0)
            ends.append(pos + min(c, t0 + block_m))
            tvars.append(v)
        pos += c

    def dev(a):
        return _to(torch.as_tensor(a, dtype=torch.int32), device)

    return BatchPlan(
        "sgmv",
        m,
        device,
        rv_dev,
        max_rows,
        tuple(variants.tolist()),
        block_m,
        dev(order),
        dev(starts),
        dev(ends),
        dev(tvars),
    )
