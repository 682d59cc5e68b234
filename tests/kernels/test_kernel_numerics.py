"""The delta survives every kernel in every dtype, at the magnitudes real fine-tunes have.

Real deltas are small: α ≈ 2e-4–7e-4 against |W| ≈ 0.15 (SmolLM2-135M fine-tunes), whose bf16
spacing is ≈ 1e-3, so a kernel that forms W + α·S and rounds it to bf16 before the dot loses
the delta, and the same request then gives different tokens alone (fused kernel) and in a mixed
batch (base GEMM + batched delta). These tests measure each result in units of the delta term
δ = α ⊙ (x · Sᵀ) (`tests.support.kernel_cases.delta_fidelity`): the share of δ it carries (slope, 1 = all,
0 = vanished) and δ's relative error. The first test shows the measure fails a merged kernel.

bf16 on CPU: the interpreter's bf16 dot is wrong, so the kernels dot bf16 operands in fp32 there
(exact: bf16 values and 0/1 are fp32 values), i.e. the GPU's math up to summation order; the
CUDA profile (`pytest -m cuda`) runs the same tests with real bf16 dots.
"""

from __future__ import annotations

import pytest
import torch

from bitdelta_kernels import bitdelta_delta_batched, plan_batch
from bitdelta_kernels.bits import unpack_signs
from bitdelta_kernels.dispatch import _linear_unpacked
from bitdelta_kernels.reference import bitdelta_delta_batched_ref, bitdelta_linear_ref
from bitdelta_kernels.triton_linear import bitdelta_linear_triton
from tests.support.kernel_cases import delta_fidelity, delta_term, make_realistic

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda  # the CUDA profile: `pytest -m cuda` on a GPU runs these with real dots
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# δ's relative RMS error allowed per dtype. The inputs cancel the base term exactly
# (tests.support.kernel_cases.make_realistic), so the output is δ rounded once to the dtype: half a spacing
# relative (RNE on GPU; the interpreter truncates: up to a whole one), plus fp32 summation.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPE = (1030, 520)  # (d_out, d_in): ragged against every block


def test_the_measure_fails_a_kernel_that_merges_in_bf16():
    # the old fused math: W + α·S formed in fp32, rounded to bf16, one dot
    x, w, signs, alpha = make_realistic(17, *SHAPE, torch.bfloat16, "smollm2")
    s = unpack_signs(signs, SHAPE[1], torch.float32)
    w_eff = (w.float() + alpha[:, None] * s).to(torch.bfloat16)
    merged = (x.float() @ w_eff.float().t()).to(torch.bfloat16)
    base = x.double() @ w.double().t()
    delta = delta_term(x, signs, alpha, SHAPE[1])
    slope, rms = delta_fidelity(merged, base, delta)
    assert rms > 20 * TOL[torch.bfloat16]  # the delta comes out quantised to W's spacing, much of it lost
    good = bitdelta_linear_ref(x, w, signs, alpha)
    slope, rms = delta_fidelity(good, base, delta)
    assert slope == pytest.approx(1.0, abs=0.01) and rms <= TOL[torch.bfloat16]


@pytest.mark.parametrize("regime", ["smollm2", "small_w"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("M", [1, 17])
@pytest.mark.parametrize("impl", ["triton", "unpacked", "reference"])
def test_fused_linear_keeps_a_realistic_delta(impl, M, dtype, regime):
    """The fused kernel, and the unpacked GEMMs that prefill-sized calls take instead."""
    x, w, signs, alpha = make_realistic(M, *SHAPE, dtype, regime, seed=M)
    if impl == "triton":
        y = bitdelta_linear_triton(x.to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV)).cpu()
    elif impl == "unpacked":
        planes, alphas = signs[None].to(DEV), alpha.float().reshape(1, -1).to(DEV)
        y = _linear_unpacked(x.to(DEV), w.to(DEV), planes, alphas).cpu()
    else:
        y = bitdelta_linear_ref(x, w, signs, alpha)
    base = x.double() @ w.double().t()
    delta = delta_term(x, signs, alpha, SHAPE[1])
    slope, rms = delta_fidelity(y, base, delta)
    assert slope == pytest.approx(1.0, abs=0.01)
    assert rms <= TOL[dtype]


@pytest.mark.parametrize("split_k", [1, 3])
def test_fused_linear_split_k_keeps_a_realistic_delta(split_k):
    x, w, signs, alpha = make_realistic(3, 72, 1000, torch.float16, "smollm2")
    y = bitdelta_linear_triton(
        x.to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV), config={"SPLIT_K": split_k, "BLOCK_K": 64}
    ).cpu()
    base = x.double() @ w.double().t()
    delta = delta_term(x, signs, alpha, 1000)
    slope, rms = delta_fidelity(y, base, delta)
    assert slope == pytest.approx(1.0, abs=0.01) and rms <= TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", ["bgmv", "sgmv", "reference"])
def test_batched_delta_keeps_a_realistic_delta(kind, dtype):
    # y starts as the base GEMM's output in `dtype`, as in the worker; 3 variants and base rows
    M, (d_out, d_in) = 12, SHAPE
    x, w, _, _ = make_realistic(M, d_out, d_in, dtype, "smollm2")
    signs = torch.stack([make_realistic(1, d_out, d_in, dtype, "smollm2", seed=10 + v)[2] for v in range(3)])
    alpha = torch.stack([make_realistic(1, d_out, d_in, dtype, "smollm2", seed=20 + v)[3] for v in range(3)])
    rv = torch.tensor([0, 1, 2, -1, 0, 0, 1, 2, 2, 0, -1, 1])
    y0 = (x.float() @ w.float().t()).to(dtype)
    if kind == "reference":
        y = bitdelta_delta_batched_ref(x, signs, alpha, rv, y0.clone())
    else:
        plan = plan_batch(rv.to(DEV), 3, DEV, sgmv_min_rows=1 if kind == "sgmv" else 10**9, block_m=16)
        assert plan.kind == kind
        y = y0.clone().to(DEV)
        bitdelta_delta_batched(x.to(DEV), signs.to(DEV), alpha.to(DEV), rv.to(DEV), y, plan=plan)
        y = y.cpu()
    delta = torch.zeros(M, d_out, dtype=torch.float64)
    for r in range(M):
        if rv[r] >= 0:
            delta[r] = delta_term(x[r : r + 1], signs[rv[r]], alpha[rv[r]], d_in)[0]
    act = rv >= 0
    assert torch.equal(y[~act], y0[~act])
    slope, rms = delta_fidelity(y[act], y0[act], delta[act])
    assert slope == pytest.approx(1.0, abs=0.01)
    assert rms <= TOL[dtype]


def test_cuda_profile_really_runs_on_the_gpu():
    # bench/gpu.sh sets BITDELTA_REQUIRE_CUDA=1: the profile must not pass by running on CPU
    import os

    from bitdelta_kernels import backend_for

    if os.environ.get("BITDELTA_REQUIRE_CUDA") == "1":
        assert torch.cuda.is_available() and DEV.type == "cuda"
        assert backend_for(DEV, 1 << 30) == "triton"
    else:
        assert backend_for(DEV, 1) == "triton"  # CPU: the same kernels, in the interpreter


@pytest.mark.parametrize("axis", ["row", "col"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", ["bgmv", "sgmv", "cpu", "reference"])
def test_sign_planes_keep_a_realistic_delta(kind, dtype, axis):
    """Residual planes at real magnitudes (plane p's α about α₁/3^p, as the residual shrinks), per-row
    or per-column α: the sum of the planes' terms survives the kernels as one fp32 term. Rows have
    3, 2, 1 and no planes; y starts as the base GEMM's output in `dtype`."""
    M, d_out, d_in = 6, 264, 520
    x, w, _, _ = make_realistic(M, d_out, d_in, dtype, "smollm2")
    signs = torch.stack([make_realistic(1, d_out, d_in, dtype, "smollm2", seed=10 + s)[2] for s in range(3)])
    if axis == "row":
        alpha = torch.stack([make_realistic(1, d_out, d_in, dtype, "smollm2", seed=20)[3] / 3**s for s in range(3)])
        cols, extra = None, {}
    else:  # the α's scale input columns: row α 1, column α's at the real magnitude
        alpha = torch.ones(3, d_out)
        g = torch.Generator().manual_seed(30)
        cols = torch.stack([(torch.rand(1, d_in, generator=g) * 5e-4 + 2e-4) / 3**s for s in range(3)])
        extra = {"col_alpha": cols.to(DEV)}
    rs = torch.tensor([[0, 1, 2], [0, 1, -1], [-1, -1, -1], [0, -1, -1], [0, 1, 2], [0, 1, 2]])
    y0 = (x.float() @ w.float().t()).to(dtype)
    if kind == "reference":
        y = bitdelta_delta_batched_ref(x, signs, alpha, rs, y0.clone(), cols)
    elif kind == "cpu":
        y = bitdelta_delta_batched(
            x, signs, alpha, rs, y0.clone(), backend="cpu", **({} if cols is None else {"col_alpha": cols})
        )
    else:
        plan = plan_batch(rs, 3, DEV, sgmv_min_rows=1 if kind == "sgmv" else 10**9, block_m=16)
        y = y0.clone().to(DEV)
        bitdelta_delta_batched(x.to(DEV), signs.to(DEV), alpha.to(DEV), rs.to(DEV), y, plan=plan, **extra)
        y = y.cpu()
    delta = torch.zeros(M, d_out, dtype=torch.float64)
    for r in range(M):
        for s in rs[r].tolist():
            if s >= 0:
                xs = x[r : r + 1].double() * (1.0 if cols is None else cols[s, 0].double())
                delta[r] += delta_term(xs, signs[s], alpha[s], d_in)[0]
    act = (rs >= 0).any(dim=1)
    assert torch.equal(y[~act], y0[~act])
    slope, rms = delta_fidelity(y[act], y0[act], delta[act])
    assert slope == pytest.approx(1.0, abs=0.01)
    assert rms <= TOL[dtype]
