"""The low-rank residual of a delta (bitdelta.planes: U [d_out, r] · V [r, d_in] kept beside the sign
planes), for one variant's rows of one projection group: two small GEMMs, no custom kernel.

    y[rows, r0_m : r0_m + d_out_m] += (x[rows] · Vᵀ)[:, c0_m : c0_m + r_m] · U_mᵀ   for each matrix m

A projection group concatenates matrices along d_out (q‖k‖v, gate‖up) and each chooses its own
rank, so the group's V's are stacked into one [R, d_in] (R = the sum of the ranks: ONE shrink
GEMM for the group) and every matrix with a rank expands its columns of the shrink through its
own U into its rows of y: the factors' bytes are exactly the file's, with no zero padding.
At decode the pair reads r·(d_in + d_out) values per matrix against the base's d_in·d_out: a
GEMM library at these sizes is what a kernel would be, on CPU and GPU alike (Punica's
shrink/expand kernels pay off only with many adapters in one batch). With batch-invariant
kernels (`bitdelta_kernels.settings`) the CPU runs both through the C GEMV instead, one sum order per
row (`factor_mm`). The caller runs it once per variant present in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitdelta_kernels.cpu_ops import linear_gemv_cpu, row_invariant


def lowrank_delta(
    x: torch.Tensor,
    v: torch.Tensor,
    us: Sequence[tuple[int, int, torch.Tensor]],
    y: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[rows] += the group's low-rank residual of x[rows], in fp32; returns y.

    x: [M, d_in]; v: [R, d_in] (the group's V's stacked, any float dtype: widened to fp32 here);
    us: (r0, c0, U [d_out_m, r_m]) per matrix with a rank: its rows r0.. of y, its rows c0.. of v;
    y: fp32 [M, d_out] (the base's output before its one rounding), updated in place;
    rows: int [n] indices into x and y (None: every row).
    """
    if x.dim() != 2 or y.dim() != 2 or v.dim() != 2:
        raise ValueError("x [M, d_in], v [R, d_in] and y [M, d_out] expected")
    if y.dtype != torch.float32:
        raise ValueError(f"y must be fp32 (the residual goes in before the one rounding), got {y.dtype}")
    (M, d_in), (R, d_out) = x.shape, (v.shape[0], y.shape[1])
    if v.shape[1] != d_in or y.shape[0] != M:
        raise ValueError(f"v must be [R, {d_in}] and y [{M}, d_out], got {tuple(v.shape)} and {tuple(y.shape)}")
    for r0, c0, u in us:
        if u.dim() != 2 or r0 < 0 or r0 + u.shape[0] > d_out or c0 < 0 or c0 + u.shape[1] > R:
            raise ValueError(f"U {tuple(u.shape)} at rows {r0}, ranks {c0} does not fit y's {d_out} rows and v's {R}")
    xs = (x if rows is None else x[rows]).float()
    t = factor_mm(xs, v)  # [n, R]: the shrink, once for the group
    add = y if rows is None else torch.zeros(xs.shape[0], d_out, dtype=torch.float32, device=y.device)
    for r0, c0, u in us:  # the expand, per matrix
        add[:, r0 : r0 + u.shape[0]] += factor_mm(t[:, c0 : c0 + u.shape[1]], u)
    if rows is not None:
        y.index_add_(0, rows, add)
    return y


def factor_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [n, k] fp32 · w [m, k]ᵀ -> fp32 [n, m]: the GEMM library's, or on CPU with batch-invariant
    kernels the C GEMV's, whose per-row sum order does not depend on n (a GEMM picks its blocking,
    and so its sum order, from the row count)."""
    if a.device.type == "cpu" and row_invariant():
        return linear_gemv_cpu(a, w.float(), None, None)
    return a @ w.float().t()
