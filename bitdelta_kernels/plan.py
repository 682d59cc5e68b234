"""Per-batch metadata for the batched delta: which rows add which slots' planes, and which kernel runs.

The plan depends only on `row_slots`, so a worker builds it ONCE per decode
step and passes it to every layer (`plan=`). Built from a host `row_slots` (the
worker's case) it reads nothing back from the device and copies its index tensors
asynchronously from pinned memory; from a device `row_slots` it costs one sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from bitdelta_kernels.configs import config_for


@dataclass(frozen=True)
class BatchPlan:
    """kind: 'none' (no delta row), 'bgmv' (one program per row) or 'sgmv' (tiles of one slot set).

    row_slots: int32 [M, P] on the device (bgmv), each row's slots (−1: none; P = 1 for a 1-D
    row_slots); row_idx: int32 [rows with a slot], sorted by slot set; tile_start / tile_end:
    int32 [T], tile_slots: int32 [T, P], each tile ≤ block_m rows of one slot set (sgmv).
    max_rows: most rows of one slot set; slot_sets: the distinct slot tuples of those rows.
    unpacked: the slot sets of ≥ unpack_min_rows rows (a prefill chunk's), each with its rows
    (int64 on the device), which the launch serves apart with the signs unpacked and cuBLAS GEMMs;
    every other field then covers the other rows only (theirs are −1 in row_slots, absent from
    the tiles), and kind is 'none' when there are none.
    """

    kind: str
    m: int
    device: torch.device
    row_slots: torch.Tensor
    max_rows: int
    slot_sets: tuple[tuple[int, ...], ...]
    block_m: int = 0
    row_idx: torch.Tensor | None = None
    tile_start: torch.Tensor | None = None
    tile_end: torch.Tensor | None = None
    tile_slots: torch.Tensor | None = None
    unpacked: tuple[tuple[tuple[int, ...], torch.Tensor], ...] = ()

    @property
    def planes(self) -> int:
        """P: slots per row (the kernels' plane loop)."""
        return self.row_slots.shape[1]


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync (pinned + asynchronous copy on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def plan_batch(
    row_slots: torch.Tensor,
    n_slots: int,
    device: torch.device | None = None,
    sgmv_min_rows: int | None = None,
    block_m: int | None = None,
    unpack: bool = True,
) -> BatchPlan:
    """Group the rows of a batch by their whole slot tuple.

    row_slots: int [M] (one slot per row) or [M, P] (row r adds the planes of the slots
    row_slots[r, p] ≥ 0), −1 for nothing (a base-only row has no slot at all); n_slots: V of
    signs_stack (indices are checked against it here, once, so the kernels never read outside
    the stack). sgmv_min_rows and block_m default to the device's entry in configs.json.
    SGMV is chosen when some slot set has ≥ sgmv_min_rows rows (prefill-sized groups:
    one tensor-core dot per tile reads each plane once per tile instead of once per row);
    otherwise BGMV (decode: each row reads its planes' bits once anyway). With `unpack`, a slot set
    of ≥ the entry's unpack_min_rows rows goes to `unpacked` instead (SGMV's tiles of block_m rows
    would each expand the whole matrix's bits); without (column α's: that path has none) every row
    stays with the kernels.
    """
    if row_slots.dim() not in (1, 2):
        raise ValueError(f"row_slots must be [M] or [M, P], got {tuple(row_slots.shape)}")
    device = row_slots.device if device is None else torch.device(device)
    cfg = config_for(device)
    sgmv_min_rows = cfg["sgmv_min_rows"] if sgmv_min_rows is None else sgmv_min_rows
    block_m = cfg["sgmv"]["BLOCK_M"] if block_m is None else block_m
    rs = row_slots.to("cpu", torch.int64).reshape(row_slots.shape[0], -1)
    m, planes = rs.shape
    if planes < 1:
        raise ValueError("row_slots [M, P] needs P ≥ 1")
    if rs.numel() and (int(rs.max()) >= n_slots or int(rs.min()) < -1):
        raise ValueError(f"row_slots values must lie in [-1, {n_slots - 1}]")
    active = (rs >= 0).any(dim=1)
    if not bool(active.any()):
        return BatchPlan("none", m, device, _to(rs.to(torch.int32), device), 0, ())
    sets, key, counts = torch.unique(rs[active], dim=0, return_inverse=True, return_counts=True)
    if unpack and int(counts.max()) >= cfg["unpack_min_rows"]:
        rows = active.nonzero(as_tuple=True)[0]
        big = (counts >= cfg["unpack_min_rows"]).nonzero(as_tuple=True)[0].tolist()
        unpacked = tuple((tuple(sets[i].tolist()), _to(rows[key == i], device)) for i in big)
        rs = rs.clone()
        rs[rows[torch.isin(key, torch.tensor(big))]] = -1  # the kernels' rows: the others
        return dataclasses.replace(plan_batch(rs, n_slots, device, sgmv_min_rows, block_m, False), unpacked=unpacked)
    rs_dev = _to(rs.to(torch.int32), device)  # after the branch above, which copies its own rows
    slot_sets = tuple(tuple(s) for s in sets.tolist())
    max_rows = int(counts.max())
    if max_rows < sgmv_min_rows:
        return BatchPlan("bgmv", m, device, rs_dev, max_rows, slot_sets)
    # sort active rows by slot set (stable: rows keep their order inside a segment)
    order = active.nonzero(as_tuple=True)[0][torch.argsort(key, stable=True)]
    starts, ends, tsets = [], [], []
    pos = 0
    for s, c in zip(sets.tolist(), counts.tolist()):
        for t0 in range(0, c, block_m):
            starts.append(pos + t0)
            ends.append(pos + min(c, t0 + block_m))
            tsets.append(s)
        pos += c

    def dev(a):
        return _to(torch.as_tensor(a, dtype=torch.int32), device)

    return BatchPlan(
        "sgmv",
        m,
        device,
        rs_dev,
        max_rows,
        slot_sets,
        block_m,
        dev(order),
        dev(starts),
        dev(ends),
        dev(tsets),
    )
