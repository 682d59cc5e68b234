"""Torch references for the 1-bit delta kernels: the test oracle and the fallback.

Same signatures as the public functions in `bitdelta_kernels/__init__.py`; shapes are checked there.
A plane's term is α ⊙ ((x ⊙ c_g) · Sᵀ) on the rows of each column group g (`col_bounds`):
per-row α (α [d_out]), per-matrix α (α [1]), per-column α (c_g [d_in]) or a product of them.
"""

from __future__ import annotations

import torch

from bitdelta_kernels.bits import unpack_signs


def col_bounds(col_splits: tuple[int, ...] | None, d_out: int) -> tuple[int, ...]:
    """Row bounds (0, …, d_out) of the column groups: the matrices a projection group concatenates
    along d_out (q‖k‖v: splits (d_q, d_k, d_v)); None: one group, the whole matrix."""
    if col_splits is None:
        return (0, d_out)
    splits = tuple(int(s) for s in col_splits)
    if not splits or any(s < 0 for s in splits) or sum(splits) != d_out:
        raise ValueError(f"col_splits must be ≥ 0 row counts summing to d_out = {d_out}, got {col_splits}")
    bounds = [0]
    for s in splits:
        bounds.append(bounds[-1] + s)
    return tuple(bounds)


def plane_term(
    x: torch.Tensor,
    signs: torch.Tensor,
    alpha: torch.Tensor,
    col_alpha: torch.Tensor | None = None,
    bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """α ⊙ ((x ⊙ c_g) · Sᵀ) in fp32 -> [M, d_out].

    x: [M, d_in]; signs: uint8 [d_out, ceil(d_in/8)]; alpha: [d_out] or [1];
    col_alpha: None (c = 1) or [G, d_in], group g on rows [bounds[g], bounds[g+1]).
    """
    d_in = x.shape[1]
    s = unpack_signs(signs, d_in, torch.float32)
    xf = x.float()
    a = alpha.float().reshape(-1)
    if col_alpha is None:
        return (xf @ s.t()) * a
    bounds = bounds if bounds is not None else col_bounds(None, s.shape[0])
    a = a.expand(s.shape[0])
    out = torch.empty(x.shape[0], s.shape[0], dtype=torch.float32, device=x.device)
    for g in range(len(bounds) - 1):
        r0, r1 = bounds[g], bounds[g + 1]
        out[:, r0:r1] = ((xf * col_alpha[g].float()) @ s[r0:r1].t()) * a[r0:r1]
    return out


def bitdelta_linear_ref(
    x: torch.Tensor,
    w_base: torch.Tensor,
    signs: torch.Tensor,
    alpha: torch.Tensor,
    col_alpha: torch.Tensor | None = None,
    col_splits: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y = x · W_baseᵀ + Σ_p α_p ⊙ ((x ⊙ c_p) · S_pᵀ)

    x: [M, d_in]; w_base: [d_out, d_in]; signs: uint8 [d_out, ceil(d_in/8)] (one plane) or
    [K, d_out, ceil(d_in/8)] (K planes); alpha: [d_out] or [1] (fp32), [K, d_out] or [K, 1] with K
    planes; col_alpha: None or [G, d_in] ([K, G, d_in] with K planes), see `plane_term`
    -> y: [M, d_out] in x.dtype.
    """
    xf = x.float()
    y = xf @ w_base.float().t()
    planes = signs if signs.dim() == 3 else signs[None]
    alphas = alpha.reshape(planes.shape[0], -1)
    bounds = col_bounds(col_splits, w_base.shape[0])
    for p in range(planes.shape[0]):
        cols = None if col_alpha is None else (col_alpha[p] if signs.dim() == 3 else col_alpha)
        y = y + plane_term(xf, planes[p], alphas[p], cols, bounds)
    return y.to(x.dtype)


def bitdelta_delta_batched_ref(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    row_slots: torch.Tensor,
    y: torch.Tensor,
    col_alpha: torch.Tensor | None = None,
    col_splits: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y[r] += Σ_p α_s ⊙ ((x[r] ⊙ c_s) · S_sᵀ), s = row_slots[r, p] ≥ 0 (a 1-D row_slots: one plane
    per row); rows with no slot are untouched. The planes' terms are summed in fp32, then added.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)]; alpha_stack: fp32 [V, d_out]
    (per-matrix α broadcast to d_out); row_slots: int [M] or [M, P] (−1: nothing);
    col_alpha: None or fp32 [V, G, d_in] over the groups of `col_splits`;
    y: [M, d_out], updated in place and returned.
    """
    M, d_out = y.shape
    rs = row_slots.reshape(M, -1).to("cpu", torch.int64)
    bounds = col_bounds(col_splits, d_out)
    acc = torch.zeros(M, d_out, dtype=torch.float32, device=y.device)
    for p in range(rs.shape[1]):
        for v in torch.unique(rs[:, p]).tolist():
            if v < 0:
                continue
            rows = (rs[:, p] == v).nonzero(as_tuple=True)[0].to(y.device)
            cols = None if col_alpha is None else col_alpha[v]
            acc[rows] += plane_term(x[rows], signs_stack[v], alpha_stack[v], cols, bounds)
    rows = (rs >= 0).any(dim=1).nonzero(as_tuple=True)[0].to(y.device)
    y[rows] = (y[rows].float() + acc[rows]).to(y.dtype)
    return y
