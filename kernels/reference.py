"""Torch references for the 1-bit delta kernels: the test oracle and the fallback.

Same signatures as the public functions in `kernels/__init__.py`.
"""

from __future__ import annotations

import torch

from kernels.bits import unpack_signs


def bitdelta_linear_ref(
    x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ)

    x: [M, d_in]; w_base: [d_out, d_in]; signs: uint8 [d_out, ceil(d_in/8)];
    alpha: [d_out] or [1] (fp32) -> y: [M, d_out] in x.dtype.
    """
    d_in = w_base.shape[1]
    s = unpack_signs(signs, d_in, torch.float32)
    xf = x.float()
    y = xf @ w_base.float().t() + (xf @ s.t()) * alpha.float()
    return y.to(x.dtype)


def bitdelta_delta_batched_ref(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    row_variant: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """y[r] += α_v ⊙ (x[r] · S_vᵀ) for v = row_variant[r] ≥ 0; rows with −1 are untouched.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)];
    alpha_stack: fp32 [V, d_out] (per-matrix α broadcast to d_out);
    row_variant: int [M]; y: [M, d_out], updated in place and returned.
    """
    d_in = x.shape[1]
    for v in torch.unique(row_variant).tolist():
        if v < 0:
            continue
        rows = (row_variant == v).nonzero(as_tuple=True)[0]
        s = unpack_signs(signs_stack[v], d_in, torch.float32)
        delta = (x[rows].float() @ s.t()) * alpha_stack[v].float()
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y
