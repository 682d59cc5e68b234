"""Inputs and error measure shared by the kernel tests (Triton and CPU paths)."""

from __future__ import annotations

import torch

from bitdelta_kernels.bits import pack_signs


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


# Realistic delta magnitudes. SmolLM2-135M fine-tunes: mean α 2e-4..7e-4 against mean |W| ≈ 0.15
# (bf16 spacing there ≈ 1e-3); the small-weight regime: α 1e-4..1e-3, |W| 0.02..0.05.
REALISTIC = {
    "smollm2": dict(w_std=0.18, alpha_lo=2e-4, alpha_hi=7e-4),
    "small_w": dict(w_std=0.04, alpha_lo=1e-4, alpha_hi=1e-3),
}


def make_realistic(M, d_out, d_in, dtype, regime, per_row=True, seed=0, cancel=True):
    """x [M, d_in] ~ N(0, 1), W ~ N(0, w_std²) in `dtype`, random signs, α ~ U(lo, hi) fp32.

    cancel: columns come in pairs with equal W and opposite x (an odd last column has x = 0),
    so x · Wᵀ is exactly 0 and the output is the delta term alone: its rounding is then the
    delta's own, and a delta lost by rounding W + α·S shows plainly. Without it, a bf16
    output's spacing at |x · W| is about the size of the whole delta term.
    """
    r = REALISTIC[regime]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) * r["w_std"]
    if cancel:
        h = d_in // 2
        x[:, 1 : 2 * h : 2] = -x[:, 0 : 2 * h : 2]
        w[:, 1 : 2 * h : 2] = w[:, 0 : 2 * h : 2]
        if d_in % 2:
            x[:, -1] = 0
    x, w = x.to(dtype), w.to(dtype)
    signs = pack_signs(torch.randn(d_out, d_in, generator=g))
    alpha = torch.rand(d_out if per_row else 1, generator=g) * (r["alpha_hi"] - r["alpha_lo"]) + r["alpha_lo"]
    return x, w, signs, alpha


def delta_term(x, signs, alpha, d_in) -> torch.Tensor:
    """α ⊙ (x · Sᵀ) in fp64 from the (already rounded) inputs: [M, d_out]."""
    from bitdelta_kernels.bits import unpack_signs

    return (x.double() @ unpack_signs(signs, d_in, torch.float64).t()) * alpha.double()


def delta_fidelity(y: torch.Tensor, y_without: torch.Tensor, delta: torch.Tensor) -> tuple[float, float]:
    """How much of the delta term a result carries, measured in units of the delta itself.

    e = y − y_without (the result minus the exact, fp64 result without the delta term):
    slope = ⟨e, δ⟩ / ⟨δ, δ⟩ is 1 when the delta is applied and 0 when it vanished (output
    rounding is noise uncorrelated with δ and averages out over the elements);
    rms = ‖e − δ‖ / ‖δ‖ is the delta's relative error, output rounding included.
    """
    e = y.double() - y_without.double()
    d = delta.double()
    return float((e * d).sum() / (d * d).sum()), float((e - d).norm() / d.norm())


BF16_UNIT = 2.0**-8  # bf16's unit roundoff: 8 significant bits


def bf16_table_bound(x: torch.Tensor, alpha_abs: torch.Tensor) -> torch.Tensor:
    """How far the C table loop's bf16 tables (the AVX512-BF16 build, an x of exactly bf16 values)
    may move a delta term: each table entry, a sum of ≤ 4 of x's values, is rounded once to bf16,
    |error| ≤ u·|entry| ≤ u·Σ|x| over its columns, so α·(2·Σ_set x − Σ x) moves by at most
    2·u·|α|·‖x‖₁ per plane. alpha_abs [M, d_out]: Σ |α| over each row's planes -> [M, d_out] fp64."""
    return 2 * BF16_UNIT * alpha_abs.double() * x.double().abs().sum(1, keepdim=True)
