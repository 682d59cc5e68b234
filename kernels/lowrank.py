"""The low-rank residual of a delta (bitdelta.planes: U [d_out, r] · V [r, d_in] kept beside the sign
planes) for a mixed batch: two small GEMMs per variant present, no custom kernel.

    y[r] += (x[r] · V_sᵀ) · U_sᵀ,  s = row_slots[r] ≥ 0

At decode the pair reads U and V once per variant (r·(d_in + d_out) values against the base's
d_in·d_out) and does 2·r·(d_in + d_out) flops per row: a GEMM library at these sizes is what a
kernel would be, on CPU and GPU alike (Punica's shrink/expand kernels pay off only with many
adapters in one batch). Rows of one variant are gathered once (their indices from a host copy of
`row_slots`: no device sync).
"""

from __future__ import annotations

import torch


def lowrank_delta_batched(
    x: torch.Tensor, u_stack: torch.Tensor, v_stack: torch.Tensor, row_slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """y[r] += (x[r] · V_sᵀ) · U_sᵀ for s = row_slots[r] ≥ 0; rows with −1 are untouched.

    x: [M, d_in]; u_stack: [L, d_out, R]; v_stack: [L, R, d_in] (L factor slots; a variant of rank
    r < R has zeros in its last R − r columns of U and rows of V, which add exactly 0);
    row_slots: int [M] (one factor slot per row, −1: none), best on the host; y: [M, d_out], updated
    in place and returned. Both products in fp32 (factors in another dtype are widened per call:
    keep them fp32 to skip that), added to y in fp32 and rounded once to y's dtype.
    """
    if x.dim() != 2 or y.dim() != 2 or u_stack.dim() != 3 or v_stack.dim() != 3:
        raise ValueError("x [M, d_in], u_stack [L, d_out, R], v_stack [L, R, d_in] and y [M, d_out] expected")
    M, d_in = x.shape
    L, d_out, R = u_stack.shape
    if tuple(v_stack.shape) != (L, R, d_in):
        raise ValueError(
            f"v_stack must be [{L}, {R}, {d_in}] for u_stack {tuple(u_stack.shape)}, got {tuple(v_stack.shape)}"
        )
    if tuple(y.shape) != (M, d_out) or tuple(row_slots.shape) != (M,):
        raise ValueError(f"y must be [{M}, {d_out}] and row_slots [{M}]")
    rs = row_slots.to("cpu", torch.int64)
    if M and (int(rs.max()) >= L or int(rs.min()) < -1):
        raise ValueError(f"row_slots values must lie in [-1, {L - 1}]")
    for s in torch.unique(rs).tolist():
        if s < 0:
            continue
        rows = (rs == s).nonzero(as_tuple=True)[0]
        if rows.numel() == M:
            xs, ys = x, y
        else:
            rows = rows.to(x.device)
            xs, ys = x[rows], y[rows]
        t = xs.float() @ v_stack[s].float().t()  # [rows, R]: the shrink
        out = (ys.float() + t @ u_stack[s].float().t()).to(y.dtype)  # the expand, added in fp32
        if rows.numel() == M:
            y.copy_(out)
        else:
            y[rows] = out
    return y
