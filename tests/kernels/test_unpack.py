"""The sign unpack kernel (`triton_unpack`) against `bits.unpack_signs`, and `bitdelta_linear`'s
unpacked path (signs to ±1, then the GEMMs: the GPU's prefill-sized calls) against the torch
reference and the fused kernel (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from bitdelta_kernels import bitdelta_linear, dispatch
from bitdelta_kernels.bits import pack_signs, packed_cols, unpack_signs
from bitdelta_kernels.configs import config_for
from bitdelta_kernels.reference import bitdelta_linear_ref
from bitdelta_kernels.triton_linear import bitdelta_linear_triton
from bitdelta_kernels.triton_unpack import unpack_signs_triton
from tests.support.kernel_cases import make_linear, rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda  # the CUDA profile runs these compiled
MIN_ROWS = config_for(DEV)["unpack_min_rows"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (17, 257), (40, 1024), (3, 520)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_unpack_matches_the_reference(shape, dtype):
    R, d_in = shape
    g = torch.Generator().manual_seed(R * d_in)
    signs = torch.randint(0, 256, (R, packed_cols(d_in)), generator=g, dtype=torch.uint8)
    # the rows inside a wider buffer (a stack's slice): bytes past a row are never read as its own
    buf = torch.full((R, packed_cols(d_in) + 3), 0xFF, dtype=torch.uint8)
    buf[:, : signs.shape[1]] = signs
    # out inside a NaN buffer: nothing is written past the [R, d_in] it is given
    flat = torch.full((R * d_in + 64,), float("nan"), dtype=dtype, device=DEV)
    out = flat[32 : 32 + R * d_in].view(R, d_in)
    got = unpack_signs_triton(buf.to(DEV)[:, : signs.shape[1]], d_in, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), unpack_signs(signs, d_in, dtype))
    assert flat[:32].isnan().all() and flat[32 + R * d_in :].isnan().all()
    assert torch.equal(unpack_signs_triton(signs.to(DEV), d_in, dtype).cpu(), unpack_signs(signs, d_in, dtype))


def test_unpack_refuses_what_it_cannot_read():
    signs = torch.zeros(4, 3, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs_triton(signs, 30, torch.float32)  # 30 columns are 4 bytes
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs_triton(signs.to(torch.int16), 24, torch.float32)
    with pytest.raises(ValueError, match="unit column stride"):
        unpack_signs_triton(torch.zeros(4, 6, dtype=torch.uint8, device=DEV)[:, ::2], 24, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        unpack_signs_triton(signs, 24, torch.float32, out=torch.empty(4, 24, dtype=torch.float16, device=DEV))


def _planes(d_out, d_in, K, per_row, seed=0):
    g = torch.Generator().manual_seed(seed)
    signs = torch.stack([pack_signs(torch.randn(d_out, d_in, generator=g)) for _ in range(K)])
    alpha = torch.rand(K, d_out if per_row else 1, generator=g) * 0.05 + 0.01
    return signs, alpha


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("per_row", [True, False], ids=["alpha_row", "alpha_matrix"])
def test_prefill_sized_calls_take_the_unpacked_path(K, per_row, dtype, monkeypatch):
    """From unpack_min_rows rows on, bitdelta_linear unpacks each plane (in blocks of rows: the
    block is made small here so that a matrix takes several) and its result is the reference's,
    as close as the fused kernel's."""
    M, d_out, d_in = MIN_ROWS, 72, 100
    x, w, _, _ = make_linear(M, d_out, d_in, dtype)
    signs, alpha = _planes(d_out, d_in, K, per_row)
    calls = []
    unpacked = dispatch._linear_unpacked
    monkeypatch.setattr(dispatch, "_linear_unpacked", lambda *a: calls.append(1) or unpacked(*a))
    monkeypatch.setattr(dispatch, "UNPACK_BLOCK_BYTES", 20 * d_in * x.element_size())  # 20 rows a block
    s, a = (signs[0], alpha[0]) if K == 1 else (signs, alpha)
    y = bitdelta_linear(x.to(DEV), w.to(DEV), s.to(DEV), a.to(DEV), backend="triton")
    assert calls == [1]
    assert y.dtype == dtype and y.shape == (M, d_out)
    ref = bitdelta_linear_ref(x, w, s, a)
    fused = bitdelta_linear_triton(x.to(DEV), w.to(DEV), s.to(DEV), a.to(DEV)).cpu()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]  # bf16: both round y once
    assert rel_err(y.cpu(), ref) <= tol
    assert rel_err(y.cpu(), fused) <= tol


def test_smaller_calls_and_column_alphas_keep_the_fused_kernel(monkeypatch):
    monkeypatch.setattr(dispatch, "_linear_unpacked", lambda *a: pytest.fail("unpacked path taken"))
    x, w, signs, alpha = make_linear(MIN_ROWS - 1, 72, 100)
    y = bitdelta_linear(x.to(DEV), w.to(DEV), signs.to(DEV), alpha.to(DEV), backend="triton")
    assert rel_err(y.cpu(), bitdelta_linear_ref(x, w, signs, alpha)) <= 1e-5
    x, w, signs, alpha = make_linear(MIN_ROWS, 72, 100)
    cols = torch.rand(2, 100) + 0.5  # q-like and k-like rows scaled per column apart
    y = bitdelta_linear(
        x.to(DEV),
        w.to(DEV),
        signs.to(DEV),
        alpha.to(DEV),
        col_alpha=cols.to(DEV),
        col_splits=(40, 32),
        backend="triton",
    )
    assert rel_err(y.cpu(), bitdelta_linear_ref(x, w, signs[None], alpha[None], cols[None], (40, 32))) <= 1e-5


def test_plan_sets_prefill_sized_slot_sets_apart():
    from bitdelta_kernels import plan_batch

    rs = torch.full((MIN_ROWS + 9,), -1)
    rs[1 : MIN_ROWS + 1] = 0  # a prefill chunk of slot 0
    rs[MIN_ROWS + 2 :: 3] = 1  # a few decode rows of slot 1
    plan = plan_batch(rs, 2, DEV)
    assert [s for s, _ in plan.unpacked] == [(0,)]
    assert plan.unpacked[0][1].cpu().tolist() == list(range(1, MIN_ROWS + 1))
    kept = plan.row_slots[:, 0].cpu()
    assert (kept[1 : MIN_ROWS + 1] == -1).all() and torch.equal(kept[MIN_ROWS + 1 :], rs[MIN_ROWS + 1 :].int())
    assert plan.kind == "bgmv" and plan.slot_sets == ((1,),)
    assert plan_batch(rs, 2, DEV, unpack=False).unpacked == ()
    only = plan_batch(torch.zeros(MIN_ROWS, dtype=torch.int64), 1, DEV)
    assert only.kind == "none" and len(only.unpacked) == 1


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
def test_batched_delta_serves_a_prefill_chunk_unpacked(y_dtype, monkeypatch):
    """A mixed batch: a chunk of a 2-plane variant, a few rows of a 1-plane one, base rows. The
    chunk's planes go through the unpacked GEMMs (small blocks: several per plane), the rest through
    the kernels, and y is the reference's."""
    from bitdelta_kernels import bitdelta_delta_batched, plan_batch
    from bitdelta_kernels.reference import bitdelta_delta_batched_ref

    d_out, d_in, n = 72, 100, MIN_ROWS + 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n + 7, d_in, generator=g).to(y_dtype)
    signs = torch.randint(0, 256, (3, d_out, packed_cols(d_in)), generator=g, dtype=torch.uint8)
    alpha = torch.rand(3, d_out, generator=g) * 0.05 + 0.01
    rs = torch.full((n + 7, 2), -1)
    rs[3 : 3 + n] = torch.tensor([0, 1])  # the chunk: slots 0 and 1 (a variant of two planes)
    rs[[0, n + 4, n + 6], 0] = 2
    y0 = torch.randn(n + 7, d_out, generator=g).to(y_dtype)
    ref = bitdelta_delta_batched_ref(x.float(), signs, alpha, rs, y0.float().clone())
    calls = []
    unpacked = dispatch._delta_unpacked
    monkeypatch.setattr(dispatch, "_delta_unpacked", lambda *a: calls.append(a[3]) or unpacked(*a))
    monkeypatch.setattr(dispatch, "UNPACK_BLOCK_BYTES", 30 * d_in * x.element_size())
    plan = plan_batch(rs, 3, DEV)
    y = y0.clone().to(DEV)
    bitdelta_delta_batched(x.to(DEV), signs.to(DEV), alpha.to(DEV), rs.to(DEV), y, plan=plan, backend="triton")
    assert calls == [(0, 1)]
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[y_dtype]
    assert rel_err(y.cpu(), ref) <= tol
    untouched = [r for r in range(n + 7) if (rs[r] < 0).all()]
    assert torch.equal(y.cpu()[untouched], y0[untouched])


def test_column_alphas_never_take_an_unpacked_plan():
    from bitdelta_kernels import bitdelta_delta_batched, plan_batch
    from bitdelta_kernels.reference import bitdelta_delta_batched_ref

    d_out, d_in, M = 72, 100, MIN_ROWS
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, d_in, generator=g)
    signs = torch.randint(0, 256, (1, d_out, packed_cols(d_in)), generator=g, dtype=torch.uint8)
    alpha = torch.rand(1, d_out, generator=g) * 0.05
    cols = torch.rand(1, 2, d_in, generator=g) + 0.5
    rs = torch.zeros(M, dtype=torch.int64)
    args = (x.to(DEV), signs.to(DEV), alpha.to(DEV), rs.to(DEV))
    kw = dict(col_alpha=cols.to(DEV), col_splits=(40, 32), backend="triton")
    with pytest.raises(ValueError, match="unpack=False"):
        bitdelta_delta_batched(*args, torch.zeros(M, d_out, device=DEV), plan=plan_batch(rs, 1, DEV), **kw)
    y = bitdelta_delta_batched(*args, torch.zeros(M, d_out, device=DEV), **kw)  # plans for itself
    ref = bitdelta_delta_batched_ref(x, signs, alpha, rs, torch.zeros(M, d_out), cols, (40, 32))
    assert rel_err(y.cpu(), ref) <= 1e-5
