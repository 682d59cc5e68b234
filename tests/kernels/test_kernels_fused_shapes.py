"""The kernels on the shapes fused projections give (Phi-3's qkv_proj: d_out = q + 2·kv, 3·d without
GQA; gate_up_proj: d_out = 2·I), with α per row that differs from segment to segment of the fused
matrix (q, k, v rows scaled apart), as the worker's groups hold them: the Triton kernels (the
interpreter on CPU) and the CPU path, against the torch reference."""

from __future__ import annotations

import pytest
import torch

from bitdelta_kernels import cpu_ops
from bitdelta_kernels.bits import pack_signs
from bitdelta_kernels.reference import bitdelta_delta_batched_ref, bitdelta_linear_ref
from tests.support.kernel_cases import rel_err

D, KV, FFN = 40, 8, 52  # hidden, kv width, intermediate: ragged against 8, 16 and the blocks
FUSED = {"qkv_mha": (3 * D, D), "qkv_gqa": (D + 2 * KV, D), "gate_up": (2 * FFN, D)}
SEGMENTS = {"qkv_mha": (D, D, D), "qkv_gqa": (D, KV, KV), "gate_up": (FFN, FFN)}


def fused_case(name: str, M: int, V: int = 1, seed: int = 0):
    """x [M, d_in], w [d_out, d_in], signs [V, d_out, ceil(d_in/8)], α [V, d_out]: each segment of
    the fused rows with its own scale (×1, ×5, ×25, ...)."""
    d_out, d_in = FUSED[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) * 0.1
    signs = torch.stack([pack_signs(torch.randn(d_out, d_in, generator=g)) for _ in range(V)])
    scale = torch.cat([torch.full((n,), 5.0**i) for i, n in enumerate(SEGMENTS[name])])
    alpha = (torch.rand(V, d_out, generator=g) * 0.01 + 0.002) * scale
    return x, w, signs, alpha


@pytest.mark.cuda
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("M", [1, 5])
def test_triton_fused_linear_on_fused_shapes(name, M):
    from bitdelta_kernels.triton_linear import bitdelta_linear_triton

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, w, signs, alpha = fused_case(name, M)
    y = bitdelta_linear_triton(x.to(dev), w.to(dev), signs[0].to(dev), alpha[0].to(dev)).cpu()
    assert rel_err(y, bitdelta_linear_ref(x, w, signs[0], alpha[0])) <= 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("kind,M", [("bgmv", 4), ("sgmv", 16)])
def test_triton_batched_delta_on_fused_shapes(name, kind, M):
    from bitdelta_kernels import bitdelta_delta_batched, plan_batch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, _, signs, alpha = fused_case(name, M, V=2)
    rv = torch.arange(M) % 3 - 1  # base, variant 0, variant 1, ...
    y0 = torch.randn(M, FUSED[name][0])
    ref = bitdelta_delta_batched_ref(x, signs, alpha, rv, y0.clone())
    plan = plan_batch(rv.to(dev), 2, dev, sgmv_min_rows=1 if kind == "sgmv" else 10**9, block_m=16)
    assert plan.kind == kind
    y = y0.clone().to(dev)
    bitdelta_delta_batched(x.to(dev), signs.to(dev), alpha.to(dev), rv.to(dev), y, plan=plan)
    assert torch.equal(y.cpu()[rv < 0], y0[rv < 0]) and rel_err(y.cpu(), ref) <= 1e-5


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("path", ["gemv_delta", "fused_gemv", "blas_delta", "merge_gemm"])
@pytest.mark.parametrize("M", [1, 3])
def test_cpu_linear_on_fused_shapes(name, path, M):
    x, w, signs, alpha = fused_case(name, M)
    y = cpu_ops.bitdelta_linear_cpu(x, w, signs[0], alpha[0], path=path)
    assert rel_err(y, bitdelta_linear_ref(x, w, signs[0], alpha[0])) <= 1e-5


@pytest.mark.parametrize("name", FUSED)
def test_cpu_batched_delta_on_fused_shapes(name):
    x, _, signs, alpha = fused_case(name, 7, V=2)
    rv = torch.arange(7) % 3 - 1
    y0 = torch.randn(7, FUSED[name][0])
    ref = bitdelta_delta_batched_ref(x, signs, alpha, rv, y0.clone())
    y = y0.clone()
    cpu_ops.bitdelta_delta_batched_cpu(x, signs, alpha, rv, y)
    assert torch.equal(y[rv < 0], y0[rv < 0]) and rel_err(y, ref) <= 1e-5
