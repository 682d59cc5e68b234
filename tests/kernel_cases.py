"""Inputs and error measure shared by the kernel tests (Triton and CPU paths)."""

from __future__ import annotations

import torch

from bitdelta.bits import pack_signs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def make_linear(M, d_out, d_in, dtype=torch.float32, per_row=True, seed=0):
    """x [M, d_in], w [d_out, d_in] in `dtype`, packed signs, α [d_out] or [1]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d_in, generator=g).to(dtype)
    w = (torch.randn(d_out, d_in, generator=g) * 0.1).to(dtype)
    signs = pack_signs(torch.randn(d_out, d_in, generator=g))
    alpha = torch.rand(d_out if per_row else 1, generator=g) * 0.05 + 0.01
    return x, w, signs, alpha
