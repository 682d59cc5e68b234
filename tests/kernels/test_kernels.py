"""Triton kernels against the torch reference (interpreter on CPU, compiled on CUDA).

conftest.py sets TRITON_INTERPRET=1 before `bitdelta_kernels` is imported when there is
no GPU. Inputs live inside NaN-filled buffers with padded rows, so an unmasked
read past a row or tile turns the result into NaN, and an unmasked write shows
up in the padding. Shapes are ragged (not multiples of 8, 16 or the blocks).
"""

from __future__ import annotations

import pytest
import torch

from bitdelta_kernels import bitdelta_delta_batched, bitdelta_linear, plan_batch
from bitdelta_kernels.bits import pack_signs
from bitdelta_kernels.dispatch import backend_for
from bitdelta_kernels.reference import bitdelta_delta_batched_ref, bitdelta_linear_ref
from bitdelta_kernels.triton_linear import bitdelta_linear_triton
from tests.support.kernel_cases import make_linear, rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda  # the CUDA profile: `pytest -m cuda` on a GPU runs these with real dots
SHAPES = [(72, 100), (264, 257)]  # (d_out, d_in): ragged against every block size
MS = [1, 5, 16, 64]
# relative to max|ref|: fp32 dots are exact in the interpreter (TF32 is off by default
# on GPU); fp16 rounds W_eff and y once; the interpreter truncates fp32→bf16 casts.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def nan_buffer(t: torch.Tensor, pad_rows: int = 2, pad_cols: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): a copy of 2-D `t` inside a larger buffer of NaN (0xFF bytes for uint8)."""
    r, c = t.shape
    fill = 255 if t.dtype == torch.uint8 else float("nan")
    buf = torch.full((r + 2 * pad_rows, c + 2 * pad_cols), fill, dtype=t.dtype, device=t.device)
    view = buf[pad_rows : pad_rows + r, pad_cols : pad_cols + c]
    view.copy_(t)
    return view, buf


def padding_untouched(view: torch.Tensor, buf: torch.Tensor) -> bool:
    mask = torch.ones_like(buf, dtype=torch.bool)
    r0 = (view.data_ptr() - buf.data_ptr()) // buf.element_size() // buf.stride(0)
    c0 = (view.data_ptr() - buf.data_ptr()) // buf.element_size() % buf.stride(0)
    mask[r0 : r0 + view.shape[0], c0 : c0 + view.shape[1]] = False
    return bool(buf[mask].isnan().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_row", [True, False], ids=["alpha_row", "alpha_matrix"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("M", MS)
def test_fused_linear_matches_reference(M, shape, per_row, dtype):
    x, w, signs, alpha = make_linear(M, *shape, dtype, per_row)
    ref = bitdelta_linear_ref(x, w, signs, alpha)
    xv, _ = nan_buffer(x.to(DEV))
    wv, _ = nan_buffer(w.to(DEV))
    sv, _ = nan_buffer(signs.to(DEV))
    y = bitdelta_linear_triton(xv, wv, sv, alpha.to(DEV))
    assert y.shape == (M, shape[0]) and y.dtype == dtype
    assert not y.isnan().any()
    assert rel_err(y.cpu(), ref) <= TOL[dtype]


@pytest.mark.parametrize("M", [5, 64])
def test_fused_linear_bf16(M):
    # bf16: the kernel dots in fp32 under the interpreter (its bf16 dot is wrong), bf16 on GPU
    x, w, signs, alpha = make_linear(M, 264, 257, torch.bfloat16, True)
    y = bitdelta_linear_triton(x.to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV))
    assert rel_err(y.cpu(), bitdelta_linear_ref(x, w, signs, alpha)) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("split_k", [2, 3])
def test_fused_linear_split_k(split_k):
    # split-K (small d_out at decode) sums K slices with fp32 atomics
    x, w, signs, alpha = make_linear(3, 72, 300, torch.float16, True)
    cfg = {"SPLIT_K": split_k, "BLOCK_K": 32}
    y = bitdelta_linear_triton(x.to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV), config=cfg)
    assert rel_err(y.cpu(), bitdelta_linear_ref(x, w, signs, alpha)) <= TOL[torch.float16]


def test_fused_linear_grouped_tile_order():
    # 5 row tiles in groups of 3 (one partial group) × 5 column tiles: every tile exactly once
    x, w, signs, alpha = make_linear(130, 264, 257, torch.float16, True)
    cfg = {"BLOCK_M": 32, "GROUP_M": 3}
    y = bitdelta_linear_triton(x.to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV), config=cfg)
    assert rel_err(y.cpu(), bitdelta_linear_ref(x, w, signs, alpha)) <= TOL[torch.float16]


def test_fused_linear_delta_matters():
    # the delta term is really applied: the result differs from the base-only GEMM
    x, w, signs, alpha = make_linear(4, 72, 100, torch.float32, True)
    alpha = alpha * 20
    y = bitdelta_linear_triton(x.to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV)).cpu()
    assert rel_err(y, x @ w.t()) > 0.1
    assert rel_err(y, bitdelta_linear_ref(x, w, signs, alpha)) <= TOL[torch.float32]


def test_fused_linear_rejects_bad_inputs():
    x, w, signs, alpha = make_linear(2, 72, 100, torch.float32, True)
    with pytest.raises(ValueError):
        bitdelta_linear_triton(x, w, signs[:, :-1], alpha)
    with pytest.raises(ValueError):
        bitdelta_linear_triton(x, w.half(), signs, alpha)
    with pytest.raises(ValueError):
        bitdelta_linear_triton(x, w, signs, alpha[:5])


def make_batch(M, d_out, d_in, V, dtype, per_row, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d_in, generator=g).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(d_out, d_in, generator=g)) for _ in range(V)])
    alpha = torch.rand(V, d_out if per_row else 1, generator=g) * 0.05 + 0.01
    # rows of different variants interleaved, every 4th row base-only (−1)
    rv = torch.randint(0, V, (M,), generator=g)
    rv[::4] = -1
    y0 = torch.randn(M, d_out, generator=g).to(dtype)
    return x, signs, alpha, rv, y0


def run_batched(x, signs, alpha, rv, y0, kind):
    """The Triton batched delta on NaN-buffered inputs with the given kernel kind forced."""
    xv, _ = nan_buffer(x.to(DEV))
    yv, ybuf = nan_buffer(y0.to(DEV))
    V = signs.shape[0]
    plan = plan_batch(rv.to(DEV), V, DEV, sgmv_min_rows=1 if kind == "sgmv" else 10**9, block_m=16)
    assert plan.kind in (kind, "none")
    out = bitdelta_delta_batched(xv, signs.to(DEV), alpha.to(DEV), rv.to(DEV), yv, plan=plan)
    assert out.data_ptr() == yv.data_ptr()  # in place
    assert padding_untouched(yv, ybuf)
    return yv.cpu()


# BGMV serves decode batches (≤ 16 rows); 64 rows cost ~7 s per case in the
# interpreter, so on CPU that pair is left out of the grid (SGMV covers M = 64).
KIND_M = [(k, m) for k in ("bgmv", "sgmv") for m in MS if k == "sgmv" or m <= 16 or torch.cuda.is_available()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_row", [True, False], ids=["alpha_row", "alpha_matrix"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind,M", KIND_M, ids=lambda v: str(v))
def test_batched_delta_matches_reference(M, shape, per_row, dtype, kind):
    x, signs, alpha, rv, y0 = make_batch(M, *shape, 3, dtype, per_row)
    ref = bitdelta_delta_batched_ref(x, signs, alpha.expand(3, shape[0]), rv, y0.clone())
    out = run_batched(x, signs, alpha, rv, y0, kind)
    assert not out.isnan().any()
    assert torch.equal(out[rv < 0], y0[rv < 0])  # base-only rows untouched, bit for bit
    assert rel_err(out, ref) <= TOL[dtype]


def test_batched_delta_bf16_and_big_segment():
    # one variant with 40 rows (3 SGMV tiles of 16) plus two single rows, bf16
    M, d_out, d_in = 43, 72, 100
    x, signs, alpha, _, y0 = make_batch(M, d_out, d_in, 3, torch.bfloat16, True)
    rv = torch.zeros(M, dtype=torch.int64)
    rv[7], rv[20], rv[30] = 2, -1, 1
    ref = bitdelta_delta_batched_ref(x, signs, alpha, rv, y0.clone())
    for kind in ("sgmv", "bgmv"):
        assert rel_err(run_batched(x, signs, alpha, rv, y0, kind), ref) <= TOL[torch.bfloat16]


def test_plan_batch_segments():
    rv = torch.tensor([2, 0, -1, 2, 2, 0, -1, 2, 2])
    plan = plan_batch(rv, 3, torch.device("cpu"), sgmv_min_rows=2, block_m=4)
    assert plan.kind == "sgmv" and plan.slot_sets == ((0,), (2,)) and plan.max_rows == 5 and plan.planes == 1
    assert plan.row_idx.tolist() == [1, 5, 0, 3, 4, 7, 8]
    # variant 0: rows [0, 2); variant 2: 5 rows split into tiles of ≤ 4
    assert list(zip(plan.tile_start.tolist(), plan.tile_end.tolist(), plan.tile_slots[:, 0].tolist())) == [
        (0, 2, 0),
        (2, 6, 2),
        (6, 7, 2),
    ]
    assert plan_batch(rv, 3, torch.device("cpu"), sgmv_min_rows=6).kind == "bgmv"
    assert plan_batch(torch.full((4,), -1), 3).kind == "none"
    with pytest.raises(ValueError):
        plan_batch(torch.tensor([0, 3]), 3)  # would read past the stack
    with pytest.raises(ValueError):
        plan_batch(torch.tensor([0, -2]), 3)


def test_batched_all_base_rows_is_noop():
    x, signs, alpha, _, y0 = make_batch(5, 72, 100, 2, torch.float32, True)
    y = y0.clone().to(DEV)
    bitdelta_delta_batched(x.to(DEV), signs.to(DEV), alpha.to(DEV), torch.full((5,), -1, device=DEV), y)
    assert torch.equal(y.cpu(), y0)


def test_public_linear_uses_triton_here_and_keeps_leading_dims():
    x, w, signs, alpha = make_linear(6, 72, 100, torch.float32, False)
    assert backend_for(DEV, 6 * 72 * 100) == "triton"
    y = bitdelta_linear(x.reshape(2, 3, 100).to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV))
    assert y.shape == (2, 3, 72)
    assert rel_err(y.reshape(6, 72).cpu(), bitdelta_linear_ref(x, w, signs, alpha)) <= TOL[torch.float32]


def test_public_batched_default_plan():
    x, signs, alpha, rv, y0 = make_batch(16, 72, 100, 4, torch.float16, True)
    ref = bitdelta_delta_batched_ref(x, signs, alpha, rv, y0.clone())
    y = y0.to(DEV)
    bitdelta_delta_batched(x.to(DEV), signs.to(DEV), alpha.to(DEV), rv.to(DEV), y)
    assert rel_err(y.cpu(), ref) <= TOL[torch.float16]


def test_backend_override():
    from bitdelta_kernels.settings import KernelSettings, configured

    with configured(backend="torch"):
        assert backend_for(DEV, 1) == "torch"
        assert backend_for(DEV, 1, "cpu") == "cpu"  # a caller's own setting wins
    with pytest.raises(ValueError, match="must be one of auto, triton, cpu, torch"):
        backend_for(DEV, 1, "bogus")
    assert KernelSettings.from_env({"BITDELTA_KERNEL_BACKEND": "torch"}).backend == "torch"
    with pytest.raises(ValueError, match="BITDELTA_KERNEL_BACKEND='bogus'"):
        KernelSettings.from_env({"BITDELTA_KERNEL_BACKEND": "bogus"})
