"""CPU paths (compiled C via ctypes, and the torch fallback) against the torch reference."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from bitdelta_kernels import MergedWeightCache, bitdelta_delta_batched, bitdelta_linear, cpu_build, cpu_ops
from bitdelta_kernels.bits import pack_signs, unpack_signs
from bitdelta_kernels.reference import bitdelta_delta_batched_ref, bitdelta_linear_ref
from bitdelta_kernels.settings import KernelSettings, configured
from tests.support.kernel_cases import bf16_table_bound, rel_err
from tests.support.kernel_cases import make_linear as make

SHAPES = [(72, 100), (264, 257), (33, 17), (5, 8), (16, 1)]  # (d_out, d_in), ragged against 8 and 16
MS = [1, 2, 5, 16, 64]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def padded_rows(t: torch.Tensor, extra: int = 3) -> torch.Tensor:
    """`t` as a view with a row stride larger than its width (garbage in the gap)."""
    fill = 255 if t.dtype == torch.uint8 else float("nan")
    buf = torch.full((t.shape[0], t.shape[1] + extra), fill, dtype=t.dtype)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


# The C library's SIMD paths under test: the host's own build and the AVX2 build
# (-march=x86-64-v3, what an AVX2-only CPU runs), which the host can run too. A CPU
# without AVX2 cannot run the AVX2 build: there the parameter fails with its reason.
ISAS = ["native", "avx2"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Make every CPU op in the test use the C library built for one ISA."""
    with configured(cpu_isa=request.param):
        assert cpu_build.load_cpu_lib() is not None, cpu_build.unavailable_reason
        if request.param == "avx2":
            assert cpu_build.cpu_isa() == "avx2"
        yield request.param


@pytest.fixture
def no_cpu_lib():
    """No C library (as where it cannot be built): every CPU op takes the torch path."""
    with configured(cpu_kernels=False):
        yield


def test_library_builds_here():
    # CI has a compiler: a broken C build must fail here, not degrade silently
    assert cpu_build.load_cpu_lib() is not None, cpu_build.unavailable_reason
    assert cpu_build.cpu_isa() in ("avx512bf16", "avx512", "avx2", "scalar")


@pytest.mark.parametrize("method", ["mask", "lut8"])
@pytest.mark.parametrize("per_row", [True, False], ids=["alpha_row", "alpha_matrix"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("M", MS)
def test_delta_gemv(M, shape, per_row, method, isa):
    x, w, signs, alpha = make(M, *shape, per_row=per_row)
    ref = bitdelta_linear_ref(x, torch.zeros_like(w), signs, alpha)
    y0 = torch.randn(M, shape[0])
    y = y0.clone()
    cpu_ops.delta_gemv_cpu(x, padded_rows(signs), alpha, y, method=method)
    assert rel_err(y - y0, ref) <= 1e-5


@pytest.mark.parametrize("M", [1, 2])
def test_delta_gemv_every_tail_of_a_row(M, isa):
    # The table loop reads a row's last bytes past its whole chunks in several ways: AVX-512 (64-byte
    # chunks) a 16-byte form twice up to 32 bytes, the 64-byte form beyond; AVX2 (32-byte chunks)
    # the last ≤ 31 bytes split into two halves, from a 16-byte load ending at the row's end and,
    # past 16 bytes, one from their start (rows of < 16 bytes byte by byte: test_delta_gemv). Every
    # length, with ragged bits, garbage past each row, a last block of fewer than 16 rows, and the
    # last row ending its buffer
    for nb in range(64):
        d_out, d_in = 40, 512 + 8 * nb - (nb % 3)
        x, w, signs, alpha = make(M, d_out, d_in, per_row=True)
        ref = bitdelta_linear_ref(x, torch.zeros_like(w), signs, alpha)
        for s in (signs, padded_rows(signs)):
            y = torch.zeros(M, d_out)
            cpu_ops.delta_gemv_cpu(x, s, alpha, y)
            assert rel_err(y, ref) <= 1e-5, (nb, d_in)


def test_delta_sums_of_a_non_finite_x_are_not_finite(isa):
    """A NaN or an infinity in x makes every delta term of its row NaN or infinite on every table
    loop (the AVX2 build's 24-bit tables: that chunk's scale is NaN), never a finite wrong number;
    the other rows keep their sums."""
    x, w, signs, alpha = make(3, 40, 576, per_row=True)
    ref = bitdelta_linear_ref(x, torch.zeros_like(w), signs, alpha)
    for bad in (float("nan"), float("inf"), float("-inf")):
        xb = x.clone()
        xb[1, 300] = bad
        y = cpu_ops.delta_gemv_cpu(xb, signs, alpha, torch.zeros(3, 40))
        assert not torch.isfinite(y[1]).any(), bad
        assert rel_err(y[[0, 2]], ref[[0, 2]]) <= 1e-5, bad


@pytest.mark.parametrize("M", [1, 3])
def test_bf16_rows_sum_their_planes_alike_on_every_path(M, isa):
    """An x of exactly bf16 values (a bf16 model's activations): where the build has AVX512-BF16 the
    table loop sums its planes from bf16 tables, within their bound of the float64 oracle
    (bf16_table_bound; every tail of a row, the loop's ragged ends) and not the fp32 tables' sums;
    elsewhere from the fp32 tables (the AVX2 build: 24-bit ones), x's fp32 copy's sums bit for bit. Either way a row's delta is the
    same bits through the decode GEMV's two passes, the delta GEMV and the batched delta: a row's
    numbers do not depend on the path that serves it."""
    bf16_tables = cpu_build.cpu_isa() == "avx512bf16"
    for nb in (0, 1, 3, 8, 9, 33, 63):
        d_out, d_in = 40, 512 + 8 * nb - (nb % 3)
        x, w, signs, alpha = make(M, d_out, d_in, dtype=torch.bfloat16, per_row=nb % 2 == 0, seed=nb)
        ref = bitdelta_linear_ref(x.double(), torch.zeros_like(w), signs, alpha)
        base = cpu_ops.linear_gemv_cpu(x, w, None, None)
        two_pass = cpu_ops.linear_gemv_cpu(x, w, signs, alpha, two_pass=True)
        gemv = cpu_ops.delta_gemv_cpu(x, signs, alpha, base.clone())
        slots = torch.zeros(M, dtype=torch.int64)
        batched = cpu_ops.bitdelta_delta_batched_cpu(x, signs[None], alpha.reshape(1, -1), slots, base.clone())
        assert torch.equal(two_pass, gemv) and torch.equal(gemv, batched), nb
        alone = cpu_ops.delta_gemv_cpu(x, signs, alpha, torch.zeros(M, d_out))
        fp32_tables = cpu_ops.delta_gemv_cpu(x.float(), signs, alpha, torch.zeros(M, d_out))
        if not bf16_tables:
            assert torch.equal(alone, fp32_tables), nb
            continue
        bound = bf16_table_bound(x, alpha.abs().expand(M, d_out)) + 1e-6 * ref.abs().max()
        assert ((alone.double() - ref).abs() <= bound).all(), nb
        assert not torch.equal(alone, fp32_tables), nb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_in_one_pass_sums_weights_and_signs_in_fp32(isa, dtype):
    """The one-pass GEMV of one row (bf16: exactly-bf16 x over bf16 weights, `delta_rows_dp` where the
    build has AVX512-BF16; fp32: `delta_rows_f32` where it has AVX-512; the masked block loop
    elsewhere): x · Wᵀ + α ⊙ (x · Sᵀ) within fp32 summation's error of the float64 oracle at every
    kind of row end (whole 64-, 32- and 16-column chunks, a scalar tail), row strides wider than the
    rows, α per row and per matrix; and not the two passes' sums."""
    for d_in in (15, 16, 31, 32, 33, 48, 64, 95, 576, 600, 1031):
        x, w, signs, alpha = make(1, 40, d_in, dtype=dtype, per_row=d_in % 2 == 0, seed=d_in)
        s = unpack_signs(signs, d_in, torch.float64)
        a = alpha.double().expand(40)
        ref = x.double() @ w.double().t() + a * (x.double() @ s.t())
        y = cpu_ops.linear_gemv_cpu(x, padded_rows(w), padded_rows(signs), alpha)
        scale = x.double().abs() @ w.double().abs().t() + a * x.double().abs().sum()
        assert y.dtype == torch.float32 and ((y.double() - ref).abs() <= 2**-22 * d_in * scale).all(), d_in
        if one_pass_build(dtype) and d_in >= 576:  # other sums than the table loop's
            assert not torch.equal(y, cpu_ops.linear_gemv_cpu(x, w, signs, alpha, two_pass=True)), d_in


@pytest.mark.parametrize("path", ["gemv_delta", "fused_gemv", "blas_delta", "merge_gemm", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(72, 100), (264, 257), (33, 17)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("M", [1, 3, 16, 64])
def test_linear_paths(M, shape, dtype, path, isa):
    x, w, signs, alpha = make(M, *shape, dtype=dtype, per_row=M % 2 == 1)
    ref = bitdelta_linear_ref(x, w, signs, alpha)
    y = cpu_ops.bitdelta_linear_cpu(x, padded_rows(w), padded_rows(signs), alpha, path=path)
    assert y.dtype == dtype and y.shape == ref.shape
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(72, 576), (264, 257), (33, 17), (9, 1536)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("M", [1, 2, 3, 5, 7, 8])
def test_dense_gemv(M, shape, dtype, isa):
    """The base's decode GEMV (no delta): every weight dtype widened in registers, ragged tails,
    row strides wider than the rows; fp32 accumulation as the fp32 reference. fp32 weights, and bf16
    ones against an x that is exactly bf16, give each row the bits it gets alone, whichever block of
    x rows it falls in (5 rows: 3 + 2; 7: 4 + 3)."""
    x = torch.randn(M, shape[1] + 5)[:, : shape[1]]  # x rows with a wider stride too
    w = (torch.randn(*shape) * 0.1).to(dtype)
    ref = x.double() @ w.double().t()
    y = cpu_ops.linear_gemv_cpu(x, padded_rows(w), None, None)
    assert y.dtype == torch.float32 and rel_err(y.double(), ref) <= 1e-5
    if dtype == torch.float32:
        for m in range(M):
            assert torch.equal(y[m], cpu_ops.linear_gemv_cpu(x[m : m + 1], padded_rows(w), None, None)[0]), m
    assert cpu_ops.dense_path_cpu(M, dtype) == "gemv"
    out = cpu_ops.dense_linear_cpu(x.to(dtype), w)
    assert out.dtype == dtype and rel_err(out.float(), (x.to(dtype).float() @ w.float().t())) <= TOL[dtype]
    assert cpu_ops.dense_linear_cpu(x.to(dtype), w, out_fp32=True).dtype == torch.float32
    if dtype == torch.bfloat16:  # x exactly bf16: the bf16 dot products where the build has them
        xb = x.bfloat16()
        yb = cpu_ops.linear_gemv_cpu(xb, padded_rows(w), None, None)
        assert rel_err(yb.double(), xb.double() @ w.double().t()) <= 1e-5
        for m in range(M):
            assert torch.equal(yb[m], cpu_ops.linear_gemv_cpu(xb[m : m + 1], padded_rows(w), None, None)[0]), m


def _amd_family_19h() -> bool:
    """An AMD CPU of family 19h (Zen 3 and Zen 4), from /proc/cpuinfo."""
    info = open("/proc/cpuinfo").read()
    return "AuthenticAMD" in info and "\ncpu family\t: 25\n" in info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_stream_prefetch_is_the_cpus_choice_and_changes_no_number(dtype, isa):
    """The AVX-512 build's one-weight-row GEMV blocks (one or two x rows) prefetch their weight
    stream except on AMD's family 19h (Zen 4: the hardware prefetchers alone read faster there):
    the default is the CPU's, and on or off every output is the same bits (one and two x rows, x in
    fp32 and exactly bf16: the bf16 dot-product path; a delta's two passes too)."""
    lib = cpu_build.load_cpu_lib()
    want = 0 if cpu_build.cpu_isa() in ("avx512", "avx512bf16") and _amd_family_19h() else 1
    assert lib.bd_set_stream_prefetch(-1) == want
    x, w, signs, alpha = make(2, 265, 576, dtype=dtype)
    got = {}
    try:
        for on in (1, 0):
            assert lib.bd_set_stream_prefetch(on) == on
            got[on] = [
                cpu_ops.linear_gemv_cpu(xm, w, s, a, two_pass=True)
                for xm in (x[:1], x, x.to(dtype))
                for s, a in ((None, None), (signs, alpha))
            ]
    finally:
        lib.bd_set_stream_prefetch(-1)
    assert all(torch.equal(a, b) for a, b in zip(got[1], got[0]))


@pytest.mark.parametrize("d_in", [576, 1031])
@pytest.mark.parametrize("delta", [False, True], ids=["base", "delta"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_rows_do_not_depend_on_m(dtype, delta, d_in, isa):
    """A decode row's GEMV result is bit for bit the same alone and among up to DENSE_GEMV_MAX_M rows
    (every row count the GEMV serves, every register block and the rows left over, 265 output
    rows: not a whole number of blocks; one row alone goes 16 weight rows at a time, their sums
    reduced together; 1031 columns end in a ragged tail): a request's tokens must not depend on its batch."""
    n = cpu_ops.dense_gemv_max_m(dtype)
    x, w, signs, alpha = make(n, 265, d_in, dtype=dtype)
    x = x.to(dtype)
    s, a = (signs, alpha) if delta else (None, None)
    alone = torch.cat([cpu_ops.linear_gemv_cpu(x[i : i + 1], w, s, a, two_pass=delta) for i in range(n)])
    for M in range(2, n + 1):
        assert torch.equal(cpu_ops.linear_gemv_cpu(x[:M], w, s, a, two_pass=delta), alone[:M]), M


def test_dense_linear_large_m_is_blas():
    x, w = torch.randn(64, 40), torch.randn(24, 40)
    assert cpu_ops.dense_path_cpu(64, torch.float32) == "blas"
    assert torch.equal(cpu_ops.dense_linear_cpu(x, w), x @ w.t())


def test_merge_block_loop(monkeypatch):
    # the prefill path merges W_eff a block of rows at a time; force several blocks
    monkeypatch.setattr(cpu_ops, "MERGE_BLOCK_BYTES", 16 * 257 * 4)
    x, w, signs, alpha = make(64, 264, 257)
    y = cpu_ops.bitdelta_linear_cpu(x, w, signs, alpha, path="merge_gemm")
    assert rel_err(y, bitdelta_linear_ref(x, w, signs, alpha)) <= 1e-5
    y32 = torch.zeros(64, 264)
    cpu_ops.delta_rows_cpu(x, signs, alpha, y32, path="unpack_gemm")
    assert rel_err(y32, bitdelta_linear_ref(x, torch.zeros_like(w), signs, alpha)) <= 1e-5


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_merge(w_dtype, out_dtype, isa):
    _, w, signs, alpha = make(1, 40, 75)
    w = None if w_dtype is None else w.to(w_dtype)
    exp = unpack_signs(signs, 75) * alpha.reshape(-1, 1) + (0 if w is None else w.float())
    m = cpu_ops.merge_cpu(w, signs, alpha, 75, 3, 29, dtype=out_dtype)
    assert m.shape == (26, 75) and m.dtype == out_dtype
    # rounded once, to nearest: exactly torch's rounding of the fp32 sum
    assert torch.equal(m, exp[3:29].to(out_dtype))


@pytest.mark.parametrize("per_row", [True, False], ids=["alpha_row", "alpha_matrix"])
@pytest.mark.parametrize("M", MS)
def test_batched_cpu(M, per_row, isa):
    d_out, d_in, V = 264, 257, 3
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, d_in, generator=g)
    signs = torch.stack([pack_signs(torch.randn(d_out, d_in, generator=g)) for _ in range(V)])
    alpha = torch.rand(V, d_out if per_row else 1, generator=g)
    rv = torch.randint(0, V, (M,), generator=g)
    rv[::3] = -1
    y0 = torch.randn(M, d_out, generator=g)
    ref = bitdelta_delta_batched_ref(x, signs, alpha.expand(V, d_out), rv, y0.clone())
    y = y0.clone()
    out = cpu_ops.bitdelta_delta_batched_cpu(x, signs, alpha, rv, y)
    assert out is y
    assert torch.equal(y[rv < 0], y0[rv < 0])
    assert rel_err(y, ref) <= 1e-5


def test_batched_cpu_single_variant_and_unpack(monkeypatch):
    # a whole batch of one variant (no gather), on both the GEMV and the unpack-GEMM paths
    x, _, signs, alpha = make(40, 72, 100)
    stack, astack = signs[None].expand(2, -1, -1), torch.stack([alpha * 0, alpha])
    rv = torch.ones(40, dtype=torch.long)
    ref = bitdelta_delta_batched_ref(x, stack, astack, rv, torch.zeros(40, 72))
    for min_m in (10**9, 1):
        monkeypatch.setattr(cpu_ops, "UNPACK_MIN_M", min_m)
        y = torch.zeros(40, 72, dtype=torch.bfloat16)
        cpu_ops.bitdelta_delta_batched_cpu(x, stack, astack, rv, y)
        assert rel_err(y, ref) <= TOL[torch.bfloat16]


def test_isa_setting_forces_the_avx2_build():
    """cpu_isa="avx2" (BITDELTA_CPU_ISA=avx2) makes the process-wide library the AVX2 build, with
    the paths an AVX2-only CPU takes (BLAS + delta GEMV at decode, no fused AVX-512 GEMV)."""
    assert KernelSettings.from_env({"BITDELTA_CPU_ISA": "AVX2"}).cpu_isa == "avx2"
    with configured(cpu_isa="avx2"):
        lib = cpu_build.load_cpu_lib()
        assert lib is not None, cpu_build.unavailable_reason
        assert cpu_build.cpu_isa() == "avx2"
        assert cpu_ops.linear_path_cpu(1, torch.float32) == "gemv_delta"  # the AVX2 GEMV
        assert cpu_ops.linear_path_cpu(16, torch.float32) == "blas_delta"
        x, w, signs, alpha = make(3, 264, 257)
        y = cpu_ops.bitdelta_linear_cpu(x, w, signs, alpha)
        assert rel_err(y, bitdelta_linear_ref(x, w, signs, alpha)) <= 1e-5
    assert cpu_build.load_cpu_lib() is not lib  # the previous settings' library again


def test_isa_request_errors(monkeypatch):
    with pytest.raises(ValueError, match="BITDELTA_CPU_ISA='avx1024'.*native, avx512bf16, avx512, avx2, scalar"):
        KernelSettings.from_env({"BITDELTA_CPU_ISA": "avx1024"})
    with pytest.raises(ValueError, match="unknown ISA"):
        cpu_build.load_variant("sse9")
    # a forced build the CPU cannot run is refused before it is loaded (no SIGILL)
    monkeypatch.setattr(cpu_build, "_cpu_fingerprint", lambda: "flags\t\t: fpu sse sse2")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    with pytest.raises(RuntimeError, match="lacks: avx2, fma"):
        cpu_build.load_variant("avx2")


def test_scalar_build_matches_the_reference():
    """The portable C loops (-march=x86-64), which a CPU without AVX2 runs."""
    with configured(cpu_isa="scalar"):
        _check_scalar_build()


def _check_scalar_build():
    assert cpu_build.cpu_isa() == "scalar"
    x, w, signs, alpha = make(5, 264, 257)
    ref = bitdelta_linear_ref(x, w, signs, alpha)
    for path in ("gemv_delta", "fused_gemv", "blas_delta", "merge_gemm"):
        assert rel_err(cpu_ops.bitdelta_linear_cpu(x, w, signs, alpha, path=path), ref) <= 1e-5, path
    stack, astack, rv = (
        torch.stack([signs, signs.flip(1)]),
        torch.stack([alpha, alpha * 2]),
        torch.tensor([1, 0, -1, 1, 1]),
    )
    y = cpu_ops.bitdelta_delta_batched_cpu(x, stack, astack, rv, torch.zeros(5, 264))
    assert rel_err(y, bitdelta_delta_batched_ref(x, stack, astack, rv, torch.zeros(5, 264))) <= 1e-5


def test_auto_path_choice():
    if cpu_build.cpu_isa() in ("avx512", "avx512bf16"):
        assert cpu_ops.linear_path_cpu(1, torch.float32) == "gemv_delta"
        assert cpu_ops.linear_path_cpu(16, torch.float32) == "fused_gemv"
    assert cpu_ops.linear_path_cpu(4096, torch.float32) == "merge_gemm"
    assert cpu_ops.linear_path_cpu(4096, torch.bfloat16) == "merge_gemm"


def test_public_functions_on_cpu_backend():
    for M in (4, 64):
        x, w, signs, alpha = make(M, 72, 100)
        y = bitdelta_linear(x, w, signs, alpha, backend="cpu")
        assert rel_err(y, bitdelta_linear_ref(x, w, signs, alpha)) <= 1e-5
    stack = torch.stack([signs, signs.flip(0)])
    astack = torch.stack([alpha, alpha.flip(0)])
    rv = torch.tensor([1, -1, 0, 1])
    ref = bitdelta_delta_batched_ref(x[:4], stack, astack, rv, torch.zeros(4, 72))
    y = bitdelta_delta_batched(x[:4], stack, astack, rv, torch.zeros(4, 72), backend="cpu")
    assert rel_err(y, ref) <= 1e-5


def test_shape_guards_protect_the_c_code():
    x, w, signs, alpha = make(2, 72, 100)
    with pytest.raises(ValueError):
        cpu_ops.linear_gemv_cpu(x, w, signs[:-1], alpha)  # fewer sign rows than W
    with pytest.raises(ValueError):
        cpu_ops.merge_cpu(w, signs, alpha, 100, 60, 80)  # rows past the end
    with pytest.raises(ValueError):
        cpu_ops.delta_gemv_cpu(x, signs, alpha, torch.zeros(2, 71))
    with pytest.raises(ValueError):
        cpu_ops.bitdelta_delta_batched_cpu(x, signs[None], alpha[None], torch.tensor([0, 1]), torch.zeros(2, 72))


def test_big_calls_leave_the_interpreter():
    # under TRITON_INTERPRET a real-model-sized call must not crawl through the interpreter
    from bitdelta_kernels.dispatch import backend_for
    from bitdelta_kernels.settings import current

    assert backend_for(torch.device("cpu"), current().interpret_max_work + 1) == "cpu"


def test_torch_fallback_without_compiler(no_cpu_lib):
    x, w, signs, alpha = make(5, 264, 257)
    ref = bitdelta_linear_ref(x, w, signs, alpha)
    assert cpu_ops.linear_path_cpu(5, torch.float32) == "torch"
    assert rel_err(cpu_ops.bitdelta_linear_cpu(x, w, signs, alpha), ref) <= 1e-5
    y = torch.zeros(5, 264)
    cpu_ops.delta_gemv_cpu(x, signs, alpha, y)
    assert rel_err(y, ref - x @ w.t()) <= 1e-5
    m = cpu_ops.merge_cpu(w, signs, alpha, 257, dtype=torch.bfloat16)
    assert torch.equal(m, (w + unpack_signs(signs, 257) * alpha.reshape(-1, 1)).bfloat16())
    stack, astack, rv = (
        torch.stack([signs, signs.flip(1)]),
        torch.stack([alpha, alpha * 2]),
        torch.tensor([1, 0, -1, 1, 1]),
    )
    y = cpu_ops.bitdelta_delta_batched_cpu(x, stack, astack, rv, torch.zeros(5, 264))
    assert rel_err(y, bitdelta_delta_batched_ref(x, stack, astack, rv, torch.zeros(5, 264))) <= 1e-5


def test_disabled_build_logs_once(caplog):
    assert not KernelSettings.from_env({"BITDELTA_CPU_KERNELS": "0"}).cpu_kernels
    with configured(cpu_kernels=False), caplog.at_level(logging.WARNING, logger="bitdelta_kernels"):
        assert cpu_build.load_cpu_lib() is None
        assert cpu_build.load_cpu_lib() is None
    msgs = [r.getMessage() for r in caplog.records if "pure-torch" in r.getMessage()]
    assert len(msgs) == 1 and "BITDELTA_CPU_KERNELS=0" in msgs[0]


def _outputs() -> list[torch.Tensor]:
    """What the process's library computes on one case through every C entry point."""
    x, w, signs, alpha = make(5, 264, 257)
    ys = [
        cpu_ops.bitdelta_linear_cpu(x, w, signs, alpha, path=p)
        for p in ("gemv_delta", "fused_gemv", "blas_delta", "merge_gemm")
    ]
    stack, astack, rv = torch.stack([signs, signs.flip(1)]), torch.stack([alpha, alpha * 2]), torch.tensor([1, 0, 1])
    ys.append(cpu_ops.bitdelta_delta_batched_cpu(x[:3], stack, astack, rv, torch.zeros(3, 264)))
    return ys


def _no_compiler(monkeypatch, tmp_path):
    """No C compiler reachable: the cc setting names a missing program, PATH has none, and any
    compiler run fails the test."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cpu_build.subprocess, "run", _compiler_must_not_run(cpu_build.subprocess.run))
    return str(tmp_path / "no-such-cc")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """Every fixed target built ahead of time through the entry point an image's build stage runs."""
    out = tmp_path_factory.mktemp("prebuilt")
    args = ["--prebuild", str(out), *(a for isa in cpu_build.PREBUILT_ISAS for a in ("--isa", isa))]
    proc = subprocess.run([sys.executable, "-m", "bitdelta_kernels.cpu_build", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == sorted(str(p) for p in out.iterdir()) and len(proc.stdout.split()) == len(
        cpu_build.PREBUILT_ISAS
    )
    assert all(p.stat().st_mode & 0o004 for p in out.iterdir())  # readable by an image's runtime user
    return out


def test_prebuilt_libraries_load_without_a_compiler(prebuilt, tmp_path, monkeypatch):
    """With prebuilt_dir, the library loads with no compiler anywhere: for native the best
    prebuilt one the CPU runs, each with the same numerics as this host's own build of its ISA."""
    assert KernelSettings.from_env({"BITDELTA_KERNELS_PREBUILT_DIR": str(prebuilt)}).prebuilt_dir == prebuilt
    runnable = [isa for isa in cpu_build.PREBUILT_ISAS if not cpu_build._host_lacks(isa)]
    built_here = {}
    for isa in runnable:
        with configured(cpu_isa=isa):
            assert cpu_build.cpu_isa() == isa, cpu_build.unavailable_reason
            built_here[isa] = _outputs()
    cc = _no_compiler(monkeypatch, tmp_path)
    for request, isa in [("native", runnable[0]), *((i, i) for i in runnable)]:
        with configured(prebuilt_dir=prebuilt, cpu_isa=request, cc=cc):
            assert cpu_build.cpu_isa() == isa, cpu_build.unavailable_reason
            for got, want in zip(_outputs(), built_here[isa], strict=True):
                assert torch.equal(got, want), request
    with configured(cpu_isa="native", cc=cc):  # without the setting: today's build, which needs a compiler
        assert cpu_build.load_cpu_lib() is None and "no C compiler" in cpu_build.unavailable_reason


def test_prebuilt_library_the_cpu_lacks_is_never_loaded(prebuilt, tmp_path, monkeypatch):
    cc = _no_compiler(monkeypatch, tmp_path)
    monkeypatch.setattr(cpu_build, "_cpu_fingerprint", lambda: "flags\t\t: fpu sse sse2 avx2 fma")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    with configured(prebuilt_dir=prebuilt, cc=cc):  # avx512(bf16) and avx2 lie there; this CPU runs none
        assert cpu_build._library_path("native").parent == prebuilt
        assert cpu_build._library_path("native").name.startswith("libbitdelta_cpu_scalar_")
        for isa in ("avx512bf16", "avx512", "avx2"):
            with pytest.raises(RuntimeError, match="lacks: "):
                cpu_build._library_path(isa)
    stale = tmp_path / "stale"  # a library of another source (an older image's) is not loaded
    stale.mkdir()
    (stale / "libbitdelta_cpu_scalar_0123456789abcdef.so").write_bytes(b"not this source")
    with configured(prebuilt_dir=stale, cc=cc):
        with pytest.raises(RuntimeError, match="no prebuilt library for it in .*stale and no C compiler"):
            cpu_build._library_path("native")


def test_prebuild_errors(tmp_path, capsys):
    assert cpu_build.main(["--prebuild", str(tmp_path), "--cc", str(tmp_path / "no-such-cc")]) == 1
    assert "no C compiler found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="native"):  # a host-specific build is no prebuilt target
        cpu_build.prebuild(tmp_path, ["native"])
    assert list(tmp_path.iterdir()) == []


def test_build_cache_reused(tmp_path, monkeypatch):
    # the second build of identical source/flags/CPU is a cache hit (no compiler run)
    cc = cpu_build._compiler()
    assert cc is not None, "the CPU kernels need a C compiler (gcc); the set-up's machine has one"
    first = cpu_build._build(cc, tmp_path)
    mtime = first.stat().st_mtime_ns
    monkeypatch.setattr(cpu_build.subprocess, "run", _compiler_must_not_run(cpu_build.subprocess.run))
    assert cpu_build._build(cc, tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left


def _compiler_must_not_run(run):
    def guarded(cmd, *a, **k):
        if "-o" in cmd:
            raise AssertionError("compiler ran although the library was cached")
        return run(cmd, *a, **k)

    return guarded


def test_merged_cache_lru_and_pinning():
    mats = {k: make(1, 16, 32, seed=i)[1:] for i, k in enumerate("abcd")}
    one = 16 * 32 * 4
    cache = MergedWeightCache(budget_bytes=2 * one)
    for k in "ab":
        cache.get(k, *mats[k])
    cache.pin("a")
    cache.get("c", *mats["c"])  # evicts b (a is pinned)
    assert "a" in cache and "c" in cache and "b" not in cache and cache.bytes_used == 2 * one
    cache.get("a", *mats["a"])
    assert (cache.hits, cache.misses) == (1, 3)
    w, s, a = mats["d"]
    x = torch.randn(3, 32)
    y = cache.linear("d", x, w, s, a)  # evicts c, the only unpinned entry
    assert "c" not in cache and "d" in cache
    assert rel_err(y, bitdelta_linear_ref(x, w, s, a)) <= 1e-5
    big = MergedWeightCache(budget_bytes=one - 1)
    big.get("a", *mats["a"])
    assert len(big) == 0 and big.bytes_used == 0  # too big to keep, still served


def test_bf16_merge_path_keeps_real_sized_deltas():
    """bf16 weights and activations on the merge-then-GEMM path: W + α·S is never rounded to bf16
    (α ~1e-4..1e-3 is below bf16's spacing at |W| ~ 0.1), so the bf16 output is the exact fp32
    result rounded once, as on the other paths. Rounding W_eff first changed about 1 output in 3."""
    from bitdelta_kernels.cpu_ops import linear_merge_gemm_cpu

    g = torch.Generator().manual_seed(3)
    d_out, d_in, M = 256, 512, 40
    w = (torch.randn(d_out, d_in, generator=g) * 0.1).to(torch.bfloat16)
    delta = torch.randn(d_out, d_in, generator=g)
    signs = pack_signs(delta)
    alpha = torch.rand(d_out, generator=g) * 9e-4 + 1e-4
    x = torch.randn(M, d_in, generator=g).to(torch.bfloat16)
    s = torch.where(delta >= 0, 1.0, -1.0)
    exact = x.float() @ w.float().t() + (x.float() @ s.t()) * alpha  # [M, d_out], fp32
    y = linear_merge_gemm_cpu(x, w, signs, alpha)
    assert y.dtype == torch.bfloat16
    mismatch = (y != exact.to(torch.bfloat16)).float().mean().item()
    assert mismatch < 0.02, f"{mismatch:.1%} of outputs differ from the exact result rounded once"


def test_decode_layers_check_their_tensors():
    """The C decode layers index their tensors unchecked: wrong shapes, dtypes and slot indices are
    refused before the call (their results are tested against the model in
    tests/gpu_worker/test_worker_families.py)."""
    from bitdelta_kernels.cpu_decode import DecodeLayer, DecodeLayers, DecodeShape

    D, H, KV, hd, F, S = 32, 2, 1, 16, 48, 1
    shape = DecodeShape(D, H, KV, hd, F, 1e-5)
    dims = {"qkv": ((H + 2 * KV) * hd, D), "o": (D, H * hd), "gate_up": (2 * F, D), "down": (D, F)}

    def layer(**change):
        fields = dict(
            weights=tuple(torch.randn(o, i) for o, i in dims.values()),
            signs=tuple(torch.zeros(S, o, (i + 7) // 8, dtype=torch.uint8) for o, i in dims.values()),
            alpha=tuple(torch.zeros(S, o) for o, _ in dims.values()),
            biases=(None,) * 4,
            norms=(torch.ones(S + 1, D), torch.ones(S + 1, D)),
            k=torch.zeros(16, KV, hd),
            v=torch.zeros(16, KV, hd),
            window=None,
        )
        return DecodeLayer(**{**fields, **change})

    ok = DecodeLayers([layer()], shape, torch.float32)
    with pytest.raises(ValueError, match="group o"):
        DecodeLayers(
            [layer(weights=(torch.randn(64, D), torch.randn(D, D + 1), *layer().weights[2:]))], shape, torch.float32
        )
    with pytest.raises(ValueError, match="norm stacks"):
        DecodeLayers([layer(norms=(torch.ones(S + 1, D).bfloat16(), torch.ones(S + 1, D)))], shape, torch.float32)
    with pytest.raises(ValueError, match="KV pool"):
        DecodeLayers([layer(k=torch.zeros(16, KV, 8), v=torch.zeros(16, KV, 8))], shape, torch.float32)
    args = dict(
        cos=torch.ones(1, hd),
        sin=torch.zeros(1, hd),
        write_rows=torch.tensor([0]),
        tables=torch.zeros(1, 1, dtype=torch.int32),
        lens=torch.ones(1, dtype=torch.int32),
        block_size=16,
    )
    # the slots' range is checked in the C call, before it reads anything
    for rs, rp in (([S], None), ([-2], None), ([0], [[0, S]]), ([-1], [[0, -1]]), ([2**32], None)):
        with pytest.raises(ValueError, match="row_slot and row_planes values|fit int32"):
            ok.run(torch.randn(1, D), torch.tensor(rs), **args, row_planes=None if rp is None else torch.tensor(rp))
    with pytest.raises(ValueError, match="row_planes must be"):
        ok.run(torch.randn(1, D), torch.tensor([0]), **args, row_planes=torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="x must be"):
        ok.run(torch.randn(1, D).bfloat16(), torch.tensor([-1]), **args)
    assert ok.run(torch.randn(1, D), torch.tensor([-1]), **args).shape == (1, D)
    with pytest.raises(ValueError, match="logits need"):
        ok.run(torch.randn(1, D), torch.tensor([-1]), **args, logits=True)
    with pytest.raises(ValueError, match="final_norm must be"):
        DecodeLayers([layer()], shape, torch.float32, final_norm=torch.ones(S + 2, D))
    with pytest.raises(ValueError, match="head must be"):
        DecodeLayers([layer()], shape, torch.float32, final_norm=torch.ones(S + 1, D), head=torch.randn(50, D + 1))
    with pytest.raises(ValueError, match="needs the final norm"):
        DecodeLayers([layer()], shape, torch.float32, head=torch.randn(50, D))
    full = DecodeLayers([layer()], shape, torch.float32, final_norm=torch.ones(S + 1, D), head=torch.randn(50, D))
    assert full.run(torch.randn(1, D), torch.tensor([-1]), **args, logits=True).shape == (1, 50)


def decode_layer_ref(
    x, L, slots, shape, cos, sin, write_rows, tables, lens, bs, planes=None, lowrank=None, opts=None, local=None
):
    """One layer of the runner for decode rows, in float64 from the same tensors (fp32 model):
    norm, each projection x · Wᵀ + Σ_v α_v ⊙ (x · S_vᵀ) over the row's plane slots v ≥ 0 (planes[b],
    default its slot) + the row's slot's low-rank terms (lowrank: (slot, group index) -> (v, [(r0, c0,
    U)])), rope over q's and k's heads, the new k, v written into copies of the pool, attention over
    the row's blocks, the residuals, silu · up. -> the layer's output [B, dim]. What a family
    changes: opts (`DecodeOptions`: Gemma's (1 + w) norms, the MLP's activation, the scores' scale and
    cap, Cohere's LayerNorm and parallel block, Nemotron's (w + 1)), L's q/k norms and sandwich norms, and with L.local the
    rotation `local` (cos, sin)."""
    H, KV, hd, F, eps = shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.intermediate, shape.norm_eps
    planes = [[v] for v in slots] if planes is None else planes
    gemma = opts is not None and opts.gemma
    centered = opts is not None and opts.layer_norm  # Cohere's LayerNorm: the mean subtracted first
    plus_one = opts is not None and opts.norm_plus_one  # Nemotron's LayerNorm1P: × (w + 1)
    biases = dict(zip((id(n) for n in L.norms), L.norm_biases))  # StableLM's, beside its norm's weights
    if L.local:
        cos, sin = local

    def norm(t, w):  # t [B, ..., n]: every row of the last dim with its slot's weights (and bias)
        b_ = biases.get(id(w))
        w = w.double() + (1.0 if gemma or plus_one else 0.0)
        if w.shape[-1] != t.shape[-1]:  # Command R+'s per-head q/k norms: each head its own weights
            w = w.view(w.shape[0], *t.shape[1:])
        t = t - t.mean(-1, keepdim=True) if centered else t
        out = torch.stack(
            [t[b] * torch.rsqrt(t[b].pow(2).mean(-1, keepdim=True) + eps) * w[slots[b] + 1] for b in range(len(t))]
        )
        return out if b_ is None else out + torch.stack([b_.double()[slots[b] + 1] for b in range(len(t))])

    def proj(t, g):
        out = t @ L.weights[g].double().t()
        for b, row in enumerate(planes):
            for v in (v for v in row if v >= 0):
                s = unpack_signs(L.signs[g][v], t.shape[1], torch.float64)
                out[b] += L.alpha[g][v].double() * (s @ t[b])
            term = (lowrank or {}).get((slots[b], g))
            if term is not None:
                shrunk = term[0].double() @ t[b]
                for r0, c0, u in term[1]:
                    out[b, r0 : r0 + u.shape[0]] += u.double() @ shrunk[c0 : c0 + u.shape[1]]
        return out

    def rope(t):  # t [B, heads, hd]: the first r dims rotate (cos, sin [B, r]), the rest pass
        r = cos.shape[-1]
        half = r // 2
        c, s = cos.double()[:, None], sin.double()[:, None]
        if opts is not None and opts.interleaved:  # GLM: pairs (2i, 2i + 1) by c[i], s[i]
            e, o, c, s = t[..., 0:r:2], t[..., 1:r:2], c[..., :half], s[..., :half]
            return torch.cat([torch.stack([e * c - o * s, o * c + e * s], -1).flatten(-2), t[..., r:]], -1)
        lo, hi, rest = t[..., :half], t[..., half:r], t[..., r:]
        return torch.cat([lo * c[..., :half] - hi * s[..., :half], hi * c[..., half:] + lo * s[..., half:], rest], -1)

    x = x.double()
    B = x.shape[0]
    post = L.norms[0] is None  # OLMo 2: no input norm, the outputs normed
    x_in = x if post else norm(x, L.norms[0])
    qkv = proj(x_in, 0)
    q, k_new = qkv[:, : H * hd], qkv[:, H * hd : (H + KV) * hd]
    if L.qk_norms is not None and opts is not None and opts.qk_full:  # q and k normed whole
        q, k_new = norm(q, L.qk_norms[0]), norm(k_new, L.qk_norms[1])
    q, k_new = q.reshape(B, H, hd), k_new.reshape(B, KV, hd)
    after = opts is not None and opts.qk_after_rope  # Hunyuan: the q/k norms after the rope
    if L.qk_norms is not None and not (opts is not None and opts.qk_full) and not after:
        q, k_new = norm(q, L.qk_norms[0]), norm(k_new, L.qk_norms[1])
    if not L.nope:  # SmolLM3's NoPE layers: no rotation
        q, k_new = rope(q), rope(k_new)
    if L.qk_norms is not None and after:
        q, k_new = norm(q, L.qk_norms[0]), norm(k_new, L.qk_norms[1])
    scale = hd**-0.5 if opts is None or opts.attn_scale is None else opts.attn_scale
    cap = None if opts is None else opts.attn_softcap
    k, v = L.k.double().clone(), L.v.double().clone()
    k[write_rows], v[write_rows] = k_new, qkv[:, (H + KV) * hd :].view(B, KV, hd)
    att = torch.zeros(B, H, hd, dtype=torch.float64)
    for b in range(B):
        rows = torch.tensor([int(tables[b, t // bs]) * bs + t % bs for t in range(int(lens[b]))])
        for h in range(H):
            kv = h // (H // KV)
            s = k[rows, kv] @ q[b, h] * scale
            p = torch.softmax(s if cap is None else torch.tanh(s / cap) * cap, 0)
            att[b, h] = p @ v[rows, kv]
    o = proj(att.view(B, H * hd), 1)
    sandwich = len(L.norms) == 4 and L.norms[2] is not None
    rm = 1.0 if opts is None else opts.residual_multiplier
    x = x + rm * (norm(o, L.norms[1]) if sandwich or post else o)
    if opts is None or not opts.parallel:
        x_in = x if post else norm(x, L.norms[2 if sandwich else 1])
    gu = proj(x_in, 2)  # Cohere's parallel block: from the attention's input norm
    g_, kind = gu[:, :F], "silu" if opts is None else opts.act
    act = {
        "gelu_tanh": lambda: torch.nn.functional.gelu(g_, approximate="tanh"),
        "relu2": lambda: torch.nn.functional.relu(g_) ** 2,
        "silu": lambda: torch.nn.functional.silu(g_),
        "gelu_new": lambda: 0.5 * g_ * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g_ + 0.044715 * g_**3))),
    }[kind]()
    down = proj(act if opts is not None and opts.ungated else act * gu[:, F:], 3)  # StarCoder2's: up alone
    return x + rm * (norm(down, L.norms[3]) if sandwich or post else down)


def on_one_and_two_threads(fn) -> dict:
    """{1: fn() on one thread, 2: fn() on two}; the process's thread count restored after."""
    threads = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = fn()
    finally:
        torch.set_num_threads(threads)
    return got


def four_decode_rows(D, hd, bs, g):
    """A step of 4 fp32 decode rows of 7, 3, 8 and 5 tokens, two blocks of bs rows each: their rope
    rotations (cos, sin [4, hd]), block tables, lengths, the pool rows of their new k, v, and x [4, D]."""
    angle = torch.rand(4, hd // 2, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, 1), torch.cat([angle.sin()] * 2, 1)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    lens = torch.tensor([7, 3, 8, 5], dtype=torch.int32)
    write_rows = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens.tolist())])
    return cos, sin, tables, lens, write_rows, torch.randn(4, D, generator=g)


@pytest.mark.parametrize("dims", [(576, 9, 3, 64, 1536), (40, 2, 1, 20, 72)], ids=["smollm2", "ragged"])
def test_decode_layers_against_the_reference(isa, dims):
    """The C decode layers (the base GEMV and each row's plane in one parallel region per projection:
    AVX-512's table loop with its gathered full blocks and transposed partial ones, AVX2's compare
    loop) against the layer in float64, rows of two variants and the base in one step, fp32; on one
    thread and two the same numbers, and a row alone the same as in the batch."""
    from bitdelta_kernels.cpu_decode import DecodeLayer, DecodeLayers, DecodeShape

    D, H, KV, hd, F = dims
    shape = DecodeShape(D, H, KV, hd, F, 1e-5)
    g = torch.Generator().manual_seed(D)
    out_in = (((H + 2 * KV) * hd, D), (D, H * hd), (2 * F, D), (D, F))
    bs, n_slots, B = 4, 2, 4
    L = DecodeLayer(
        weights=tuple(torch.randn(o, i, generator=g) / i**0.5 for o, i in out_in),
        signs=tuple(
            torch.randint(0, 256, (n_slots, o, (i + 7) // 8), generator=g, dtype=torch.uint8) for o, i in out_in
        ),
        alpha=tuple(torch.rand(n_slots, o, generator=g) * 0.02 / i**0.5 for o, i in out_in),
        biases=(None,) * 4,
        norms=(torch.rand(n_slots + 1, D, generator=g) + 0.5, torch.rand(n_slots + 1, D, generator=g) + 0.5),
        k=torch.randn(8 * bs, KV, hd, generator=g),
        v=torch.randn(8 * bs, KV, hd, generator=g),
        window=None,
    )
    slots = [0, -1, 1, 0]
    cos, sin, tables, lens, write_rows, x = four_decode_rows(D, hd, bs, g)
    want = decode_layer_ref(x, L, slots, shape, cos, sin, write_rows, tables, lens, bs)
    layers = DecodeLayers([L], shape, torch.float32)
    got = on_one_and_two_threads(lambda: layers.run(x, torch.tensor(slots), cos, sin, write_rows, tables, lens, bs))
    assert rel_err(got[1], want) <= 1e-5
    assert torch.equal(got[1], got[2])
    for b in range(B):
        one = layers.run(
            x[b : b + 1],
            torch.tensor(slots[b : b + 1]),
            cos[b : b + 1],
            sin[b : b + 1],
            write_rows[b : b + 1],
            tables[b : b + 1],
            lens[b : b + 1],
            bs,
        )
        assert torch.equal(one[0], got[1][b]), b


@pytest.mark.parametrize(
    "kind",
    [
        "gemma3",
        "gemma2",
        "qwen3",
        "granite",
        "olmo2",
        "partial",
        "glm",
        "nope",
        "cohere",
        "stablelm",
        "starcoder2",
        "cohere-qk",
        "nemotron",
        "arcee",
        "hunyuan",
        "phi",
    ],
)
def test_decode_layers_of_other_families_against_the_reference(isa, kind):
    """What Gemma and Qwen3 change in the C decode layers, against the layer in float64: Gemma's
    (1 + w) norms in fp32, the sandwich norms, GELU's tanh form, the scores' own scale; Gemma 2's
    capped scores; Gemma 3's and Qwen3's per-head q/k norms and Gemma 3's local rotation; Granite's
    residual multiplier and scale; OLMo 2's post-norms and whole-projection q/k norms; Phi's partial
    rotary factor (a quarter of each head rotates); GLM's interleaved pairs over half of each head;
    SmolLM3's layer without a rotation (NoPE); Cohere's LayerNorm and parallel block (the MLP from the
    input norm, one norm a layer) with interleaved pairs over the whole head; StableLM's LayerNorms with
    biases (a slot's own) and a quarter of each head rotating; StarCoder2's ungated GELU MLP; Command R+'s q
    and k norms, each head by weights of its own; Nemotron's LayerNorm1P (× (w + 1), with biases), half of
    each head rotating and its ungated relu² MLP; Arcee's ungated relu² MLP under RMSNorms; Hunyuan's per-head
    q and k norms after the rope; Phi's parallel block ((attention + MLP) + x) under one biased LayerNorm and its
    ungated gelu_new MLP; rows of
    two variants and the base in one step, fp32; a row alone the same as in the batch."""
    import dataclasses

    from bitdelta_kernels.cpu_decode import DecodeLayers, DecodeOptions, DecodeShape

    D, H, KV, hd, F = 96, 4, 2, 32, 160
    shape = DecodeShape(D, H, KV, hd, F, 1e-6)
    g = torch.Generator().manual_seed(7)
    ungated = kind in ("starcoder2", "nemotron", "arcee", "phi")
    up = F if ungated else 2 * F  # StarCoder2's, Nemotron's, Arcee's up alone
    out_in = (((H + 2 * KV) * hd, D), (D, H * hd), (up, D), (D, F))
    bs, B, n_slots = 4, 4, 2
    L = random_layer(out_in, D, KV, hd, n_slots, torch.float32, 8 * bs, g)
    gemma = kind.startswith("gemma")

    def norms(n, size):
        return tuple(torch.randn(n_slots + 1, size, generator=g) * 0.3 + (0.0 if gemma else 1.0) for _ in range(n))

    if kind == "olmo2":
        post, ff = norms(2, D)
        L = dataclasses.replace(L, norms=(None, post, None, ff), qk_norms=(norms(1, H * hd)[0], norms(1, KV * hd)[0]))
    elif kind.startswith("cohere"):
        qk = (norms(1, H * hd)[0], norms(1, KV * hd)[0]) if kind == "cohere-qk" else None
        L = dataclasses.replace(L, norms=(norms(1, D)[0], None), qk_norms=qk)
    elif kind == "phi":  # one biased LayerNorm for both halves of the parallel block
        L = dataclasses.replace(L, norms=(norms(1, D)[0], None), norm_biases=(norms(1, D)[0] - 1.0, None))
    elif kind in ("stablelm", "starcoder2", "nemotron"):
        L = dataclasses.replace(L, norms=norms(2, D), norm_biases=tuple(b - 1.0 for b in norms(2, D)))
    else:
        L = dataclasses.replace(
            L,
            norms=norms(4 if gemma else 2, D),
            qk_norms=norms(2, hd) if kind in ("gemma3", "qwen3", "hunyuan") else None,
            local=kind == "gemma3",
            nope=kind == "nope",
        )
    opts = DecodeOptions(
        gemma=gemma,
        act={"starcoder2": "gelu_tanh", "nemotron": "relu2", "arcee": "relu2", "phi": "gelu_new"}.get(
            kind, "gelu_tanh" if gemma else "silu"
        ),
        embed_scale=D**0.5 if gemma else 0.0,
        attn_scale=0.11 if gemma or kind == "granite" else None,
        attn_softcap=1.5 if kind == "gemma2" else None,
        residual_multiplier=0.4 if kind == "granite" else 1.0,
        norm_once=kind == "olmo2",
        qk_full=kind == "olmo2",
        rotary=hd // 4 if kind in ("partial", "stablelm") else hd // 2 if kind in ("glm", "nemotron", "phi") else 0,
        interleaved=kind in ("glm", "cohere", "cohere-qk"),
        rope_fp32=kind.startswith("cohere"),
        layer_norm=kind in ("cohere", "cohere-qk", "stablelm", "starcoder2", "nemotron", "phi"),
        norm_plus_one=kind == "nemotron",
        qk_after_rope=kind == "hunyuan",
        ungated=ungated,
        parallel=kind.startswith("cohere") or kind == "phi",
        sublayers_first=kind == "phi",
        qk_heads=kind == "cohere-qk",
    )
    slots = [0, -1, 1, 0]
    cos, sin, tables, lens, write_rows, x = four_decode_rows(D, hd, bs, g)
    full = (cos, sin)  # the whole head's rotation, for the plain layer
    if opts.rotary:  # tables of the rotated dims only
        angle = torch.rand(4, opts.rotary // 2, generator=g) * 6.28
        cos, sin = torch.cat([angle.cos()] * 2, 1), torch.cat([angle.sin()] * 2, 1)
    angle = torch.rand(4, hd // 2, generator=g) * 6.28
    local = (torch.cat([angle.cos()] * 2, 1), torch.cat([angle.sin()] * 2, 1))
    want = decode_layer_ref(x, L, slots, shape, cos, sin, write_rows, tables, lens, bs, opts=opts, local=local)
    parallel_kind = kind.startswith("cohere") or kind == "phi"
    first = L.norms[:2] if None not in L.norms[:2] else (L.norms[0] if parallel_kind else L.norms[1],) * 2
    plain = decode_layer_ref(x, dataclasses.replace(L, norms=first, qk_norms=None, local=False, nope=False), slots, shape,
                             *full, write_rows, tables, lens, bs, opts=DecodeOptions(ungated=opts.ungated))  # fmt: skip
    assert rel_err(plain, want) > 1e-2  # what the family changes changes the numbers
    layers = DecodeLayers([L], shape, torch.float32, options=opts)
    loc = local if L.local else None
    got = layers.run(x, torch.tensor(slots), cos, sin, write_rows, tables, lens, bs, local=loc)
    assert rel_err(got, want) <= 1e-5
    for b in range(B):
        r = slice(b, b + 1)
        one = layers.run(
            x[r], torch.tensor(slots[r]), cos[r], sin[r], write_rows[r], tables[r], lens[r], bs,
            local=None if loc is None else (loc[0][r], loc[1][r]),
        )  # fmt: skip
        assert torch.equal(one[0], got[b]), b
    if L.local:
        with pytest.raises(ValueError, match="local layers need"):
            layers.run(x, torch.tensor(slots), cos, sin, write_rows, tables, lens, bs)


def test_decode_layers_sum_each_rows_planes(isa):
    """`row_planes`: a variant of k sign planes on k slots (its norms at its first), beside a
    one-plane variant and the base in one step: each row's projections add every plane of its own,
    as the layer in float64 does; on one thread and two the same numbers; a row alone the same as in
    the batch (the one-pass `fuse` form: test_decode_layers_fuse_rows_of_one_variant); bad plane rows
    refused."""
    from bitdelta_kernels.cpu_decode import DecodeLayers, DecodeShape

    D, H, KV, hd, F = 576, 9, 3, 64, 1536
    shape = DecodeShape(D, H, KV, hd, F, 1e-5)
    g = torch.Generator().manual_seed(3)
    out_in = (((H + 2 * KV) * hd, D), (D, H * hd), (2 * F, D), (D, F))
    bs, B = 4, 4
    L = random_layer(out_in, D, KV, hd, 3, torch.float32, 8 * bs, g)
    slots, planes = [0, -1, 2, 0], [[0, 1], [-1, -1], [2, -1], [0, 1]]  # slots 0, 1: one variant's planes
    cos, sin, tables, lens, write_rows, x = four_decode_rows(D, hd, bs, g)
    want = decode_layer_ref(x, L, slots, shape, cos, sin, write_rows, tables, lens, bs, planes)
    one_plane = decode_layer_ref(x, L, slots, shape, cos, sin, write_rows, tables, lens, bs)
    layers = DecodeLayers([L], shape, torch.float32)

    def run(rows, **kw):
        r = torch.tensor(rows)
        return layers.run(
            x[r], torch.tensor(slots)[r], cos[r], sin[r], write_rows[r], tables[r], lens[r], bs,
            row_planes=torch.tensor(planes)[r], **kw,
        )  # fmt: skip

    got = on_one_and_two_threads(lambda: run(range(B)))
    assert rel_err(got[1], want) <= 1e-5 and rel_err(one_plane, want) > 1e-3  # the second plane counts
    assert torch.equal(got[1], got[2])
    for b in range(B):
        assert torch.equal(run([b])[0], got[1][b]), b
    args = (x[:1], torch.tensor([-1]), cos[:1], sin[:1], write_rows[:1], tables[:1], lens[:1], bs)
    for bad, match in (([[3, -1]], "row_planes values"), ([[0]] * 2, "row_planes must be"), ([[0, 1]], "base row")):
        with pytest.raises(ValueError, match=match):
            layers.run(*args, row_planes=torch.tensor(bad))


@pytest.mark.parametrize("dims", [(576, 9, 3, 64, 1536), (40, 2, 1, 20, 72)], ids=["smollm2", "ragged"])
def test_decode_layers_add_each_rows_low_rank_terms(isa, dims):
    """`lowrank` (`LowRankTable`): each row's slot's U · (V · x) per projection group (matrices of
    their own ranks at their own rows, the shrink once per group; fp16 factors, U a transposed
    contiguous Uᵀ as the worker's slots hold it), beside its sign plane, and none for the base or a
    slot without one, as the layer in float64 does; one thread and two the same numbers; a row
    alone the same as in the batch; a variant without a sign plane (plane slots all −1: an imported
    LoRA) its factors only, in a batch and fused alone; factors that do not fit refused by name."""
    from bitdelta_kernels.cpu_decode import DecodeLayers, DecodeShape, LowRankTable

    D, H, KV, hd, F = dims
    shape = DecodeShape(D, H, KV, hd, F, 1e-5)
    g = torch.Generator().manual_seed(11)
    out_in = (((H + 2 * KV) * hd, D), (D, H * hd), (2 * F, D), (D, F))
    bs, B = 4, 4
    L = random_layer(out_in, D, KV, hd, 3, torch.float32, 8 * bs, g)

    def factors(gi, mats):  # mats: (r0, rows, rank) -> (v [R, d_in], [(r0, c0, U view)])
        d_in = out_in[gi][1]
        v = (torch.randn(sum(r for *_, r in mats), d_in, generator=g) * 0.3 / d_in**0.5).half()
        us, c0 = [], 0
        for r0, rows, r in mats:
            us.append((r0, c0, (torch.randn(r, rows, generator=g) * 0.3).half().t()))
            c0 += r
        return v, us

    q, kv_rows = H * hd, KV * hd
    terms = {  # slot 0: q and v of qkv (ranks 4 and 17), down; slot 2: gate_up's up only (rank 8)
        (0, 0): factors(0, [(0, q, 4), (q + kv_rows, kv_rows, 17)]),
        (0, 3): factors(3, [(0, D, 16)]),
        (2, 2): factors(2, [(F, F, 8)]),
    }
    slots = [0, -1, 2, 1]  # slot 1: a plane and no low-rank term
    cos, sin, tables, lens, write_rows, x = four_decode_rows(D, hd, bs, g)
    want = decode_layer_ref(x, L, slots, shape, cos, sin, write_rows, tables, lens, bs, lowrank=terms)
    without = decode_layer_ref(x, L, slots, shape, cos, sin, write_rows, tables, lens, bs)
    layers = DecodeLayers([L], shape, torch.float32)
    groups = ("qkv", "o", "gate_up", "down")
    table = LowRankTable({(s, 0, groups[gi]): t for (s, gi), t in terms.items()}, 3, 1, shape)

    def run(rows):
        r = torch.tensor(rows)
        return layers.run(
            x[r], torch.tensor(slots)[r], cos[r], sin[r], write_rows[r], tables[r], lens[r], bs, lowrank=table
        )

    got = on_one_and_two_threads(lambda: run(range(B)))
    assert rel_err(got[1], want) <= 1e-5
    assert rel_err(without[[0, 2]], want[[0, 2]]) > 1e-3, "the low-rank terms count"
    assert torch.equal(without[[1, 3]], want[[1, 3]])
    assert torch.equal(got[1], got[2])
    for b in range(B):
        assert torch.equal(run([b])[0], got[1][b]), b
    # a variant without a sign plane (an imported LoRA): its row's plane slots all −1, factors only
    no_plane = [[0], [-1], [-1], [1]]
    want = decode_layer_ref(x, L, slots, shape, cos, sin, write_rows, tables, lens, bs, no_plane, terms)
    got = layers.run(
        x, torch.tensor(slots), cos, sin, write_rows, tables, lens, bs, row_planes=torch.tensor(no_plane), lowrank=table
    )
    assert rel_err(got, want) <= 1e-5
    one = layers.run(
        x[2:3], torch.tensor([2]), cos[2:3], sin[2:3], write_rows[2:3], tables[2:3], lens[2:3], bs,
        fuse=True, row_planes=torch.tensor([[-1]]), lowrank=table,
    )  # fmt: skip
    assert rel_err(one, want[2:3]) <= 1e-5
    v, us = terms[(0, 3)]
    for bad, match in (
        ({(0, 0, "down"): (v.float(), us)}, "V must be float16"),
        ({(0, 0, "down"): (v, [(1, 0, us[0][2])])}, "does not fit"),
        ({(0, 0, "down"): (v, [(0, 0, us[0][2].contiguous())])}, "contiguous"),
        ({(3, 0, "down"): (v, us)}, "outside 3 slots"),
    ):
        with pytest.raises(ValueError, match=match):
            LowRankTable(bad, 3, 1, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "dims", [(576, 9, 3, 64, 1536), (40, 2, 1, 20, 72), (41, 3, 1, 20, 73)], ids=["smollm2", "ragged", "odd-rows"]
)
def test_decode_layers_fuse_rows_of_one_variant(isa, dtype, dims):
    """`fuse` with `row_planes` over a step of 1-3 rows of one variant of k sign planes sums them all
    in the weights' pass where the library has that loop (fp32: AVX-512; bf16: AVX512-BF16), up to
    `one_pass_planes(B)` (4, 3 and 1 for 1, 2 and 3 rows; bf16 4 for one row, 1 for 2 and 3; 3 rows,
    bf16's 2 and 3, in blocks of two weight rows; more rows take the table loop): other bits than the
    table loop's, close to them and (fp32) to the layer in float64; every plane counts; every row gets the numbers it gets
    alone, fused (each x row's sums take the same steps whatever the step's rows). More planes than
    the rows' loop sums, or rows of two variants, take the table loop (`fuse` ignored: its bits)."""
    from bitdelta_kernels.cpu_decode import DecodeLayers, DecodeShape

    D, H, KV, hd, F = dims
    g = torch.Generator().manual_seed(D + 7)
    out_in = (((H + 2 * KV) * hd, D), (D, H * hd), (2 * F, D), (D, F))
    bs = 4
    L = random_layer(out_in, D, KV, hd, 5, dtype, 8 * bs, g, alpha_scale=0.2)
    shape = DecodeShape(D, H, KV, hd, F, 1e-5)
    layers = DecodeLayers([L], shape, dtype)
    cos, sin, tables, lens, write_rows, x = four_decode_rows(D, hd, bs, g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    one_pass = one_pass_build(dtype)
    most = [4, 3, 1, 0] if dtype == torch.float32 else [4, 1, 1, 0]  # the planes B = 1..4 rows sum in one pass
    assert [layers.one_pass_planes(B) for B in range(1, 6)] == (most + [0] if one_pass else [0] * 5)

    def run(rows, k: int, fuse: bool, slot: int = 0) -> torch.Tensor:
        r = torch.tensor(rows)
        planes = [[slot + p for p in range(k)] for _ in rows]
        return layers.run(
            x[r].to(dtype), torch.tensor([p[0] for p in planes]), cos[r], sin[r], write_rows[r], tables[r], lens[r],
            bs, fuse=fuse, row_planes=torch.tensor(planes),
        )  # fmt: skip

    for B in (1, 2, 3, 4):
        rows = list(range(B))
        fewer = None
        for k in range(1, most[B - 1] + 2):  # up to one plane past what B rows sum in one pass
            fused, two = run(rows, k, True), run(rows, k, False)
            in_pass = one_pass and k <= most[B - 1]
            assert torch.equal(fused, two) == (not in_pass), (B, k)
            assert rel_err(fused, two) <= tol, (B, k)
            if in_pass and B > 1:
                for b in rows:
                    assert torch.equal(fused[b], run([b], k, True)[0]), (B, k, b)
            if dtype == torch.float32:
                plane_rows = [list(range(k))] * B
                r = slice(0, B)
                want = decode_layer_ref(
                    x[r], L, [0] * B, shape, cos[r], sin[r], write_rows[r], tables[r], lens[r], bs, plane_rows
                )
                assert rel_err(fused, want) <= 1e-5, (B, k)
            if fewer is not None:
                assert rel_err(fused, fewer) > 0.05, (B, k)  # plane k counts
            fewer = fused
    # rows of two variants: the table loop whatever fuse says
    r = torch.arange(2)
    mixed = dict(row_planes=torch.tensor([[0, 1], [2, 3]]))
    args = (x[r].to(dtype), torch.tensor([0, 2]), cos[r], sin[r], write_rows[r], tables[r], lens[r], bs)
    assert torch.equal(layers.run(*args, fuse=True, **mixed), layers.run(*args, fuse=False, **mixed))


def random_layer(out_in, D, KV, hd, n_slots, dtype, kv_rows, g, alpha_scale=0.02):
    """A `DecodeLayer` of random weights in `dtype` (groups' [d_out, d_in] `out_in`), n_slots
    random one-plane deltas (α up to alpha_scale / √d_in), norms per slot and a KV pool of kv_rows
    rows."""
    from bitdelta_kernels.cpu_decode import DecodeLayer

    return DecodeLayer(
        weights=tuple((torch.randn(o, i, generator=g) / i**0.5).to(dtype) for o, i in out_in),
        signs=tuple(
            torch.randint(0, 256, (n_slots, o, (i + 7) // 8), generator=g, dtype=torch.uint8) for o, i in out_in
        ),
        alpha=tuple(torch.rand(n_slots, o, generator=g) * alpha_scale / i**0.5 for o, i in out_in),
        biases=(None,) * 4,
        norms=tuple((torch.rand(n_slots + 1, D, generator=g) + 0.5).to(dtype) for _ in range(2)),
        k=torch.randn(kv_rows, KV, hd, generator=g).to(dtype),
        v=torch.randn(kv_rows, KV, hd, generator=g).to(dtype),
        window=None,
    )


def one_pass_build(dtype: torch.dtype) -> bool:
    """Whether the loaded build sums one row's plane in its weights' pass for this dtype."""
    return cpu_build.cpu_isa() in (("avx512bf16",) if dtype == torch.bfloat16 else ("avx512", "avx512bf16"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_fuse_one_variant_row(isa, dtype):
    """`fuse`: a step of one row of a variant sums each projection's plane, and its head's, in the
    weights' pass where the library has such a loop (bf16: AVX512-BF16; fp32: AVX-512): other sums
    than the table loop's, close to them; the same numbers for that row in a step of two rows of
    the variant where two rows take one pass (fp32; test_decode_layers_fuse_rows_of_one_variant), the
    table loop's where they do not (bf16); the same for a row on one of several head planes given;
    and changes nothing for a row of the
    base, a step of two variants' rows, or a build without it."""
    from bitdelta_kernels.cpu_decode import DecodeLayers, DecodeShape, HeadPlanes

    D, H, KV, hd, F, V = 576, 9, 3, 64, 1536, 1000
    g = torch.Generator().manual_seed(7)
    out_in = (((H + 2 * KV) * hd, D), (D, H * hd), (2 * F, D), (D, F))
    bs, n_slots = 4, 2
    L = random_layer(out_in, D, KV, hd, n_slots, dtype, 8 * bs, g)
    final = (torch.rand(n_slots + 1, D, generator=g) + 0.5).to(dtype)
    head = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    plane = (
        torch.randint(0, 256, (V, (D + 7) // 8), generator=g, dtype=torch.uint8),
        torch.rand(V, generator=g) * 1e-2,
    )
    layers = DecodeLayers([L], DecodeShape(D, H, KV, hd, F, 1e-5), dtype, final_norm=final, head=head)
    x = torch.randn(2, D, generator=g).to(dtype)
    angle = torch.rand(2, hd // 2, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, 1), torch.cat([angle.sin()] * 2, 1)
    tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)
    write_rows = torch.tensor([5, 10])

    other = (torch.randint(0, 256, plane[0].shape, generator=g, dtype=torch.uint8), plane[1].flip(0))

    def run(
        rows: list[int], slots: list[int], fuse: bool, model=layers, heads=None, head_planes=(plane,)
    ) -> torch.Tensor:
        """Each row's logits; its head the base's + the plane where its slot is a variant's (heads)."""
        r, s = torch.tensor(rows), torch.tensor(slots)
        heads = (s >= 0).to(torch.int64) - 1 if heads is None else torch.tensor(heads)
        planes = HeadPlanes(head_planes, heads)
        return model.run(
            x[r], s, cos[r], sin[r], write_rows[r], tables[r], lens[r], bs, logits=True, head_planes=planes, fuse=fuse
        )

    one_pass = one_pass_build(dtype)
    fused, two = run([0], [1], True), run([0], [1], False)
    assert rel_err(fused, two) <= (1e-5 if dtype == torch.float32 else 2e-2)
    assert torch.equal(fused, two) != one_pass
    assert torch.equal(run([0], [-1], True), run([0], [-1], False))
    # two rows of the variant: that row's fused numbers where two rows take one pass (fp32), else the table loop's
    assert torch.equal(run([0, 1], [1, 1], True)[0], fused[0] if layers.one_pass_planes(2) else two[0])
    assert torch.equal(run([0, 1], [0, 1], True), run([0, 1], [0, 1], False))
    # a step's rows all on one head plane of several given: that plane's numbers, fused or not
    for f, want in ((True, fused), (False, two)):
        assert torch.equal(run([0], [1], f, heads=[1], head_planes=(other, plane)), want)
    # the head's plane alone (no layer: x is the final norm's input): within fp32 summation's error
    # of the float64 oracle either way, and the one pass's own sums where the build has it
    head_only = DecodeLayers([], DecodeShape(D, H, KV, hd, F, 1e-5), dtype, final_norm=final[:1], head=head)
    h = (final[0] * torch.nn.functional.rms_norm(x[:1].float(), (D,), eps=1e-5).to(dtype)).double()
    s = unpack_signs(plane[0], D, torch.float64)
    ref = h @ head.double().t() + plane[1].double() * (h @ s.t())
    scale = h.abs() @ head.double().abs().t() + plane[1].double() * h.abs().sum()
    fused, two = run([0], [-1], True, head_only, [0]), run([0], [-1], False, head_only, [0])
    for y in (fused, two):
        assert ((y.double() - ref).abs() <= 2**-22 * D * scale).all()
    assert torch.equal(fused, two) != one_pass


def one_layer_model(D, H, KV, hd, Fi, V, bs, n_slots, dtype, seed):
    """A random one-layer model for the C decode layers: its shape, the layer (a pool of 4 · bs
    rows), the final norm's stack, a head [V, D], and the generator to draw more from."""
    from bitdelta_kernels.cpu_decode import DecodeShape

    g = torch.Generator().manual_seed(seed)
    out_in = (((H + 2 * KV) * hd, D), (D, H * hd), (2 * Fi, D), (D, Fi))
    L = random_layer(out_in, D, KV, hd, n_slots, dtype, 4 * bs, g)
    final = (torch.rand(n_slots + 1, D, generator=g) + 0.5).to(dtype)
    head = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    return DecodeShape(D, H, KV, hd, Fi, 1e-5), L, final, head, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_end_with_the_final_norm_and_the_head(isa, dtype):
    """With the final norm, the C call returns the last layer's output normed by each row's slot's
    weights as the runner's _norm does (w · round(rms_norm(x))); with the head too, the logits of
    exactly `dense_linear_cpu(h, head).float()` (the GEMV the runner's _logits reaches on CPU,
    rounded to the dtype) from that same h; with head planes, each row exactly the runner's _logits."""
    from bitdelta_kernels.cpu_decode import DecodeLayers, HeadPlanes

    D, H, KV, hd, Fi, V, bs, n_slots = 64, 4, 2, 16, 96, 300, 4, 2
    shape, L, final, head, g = one_layer_model(D, H, KV, hd, Fi, V, bs, n_slots, dtype, seed=11)
    slots = torch.tensor([1, -1, 0])
    angle = torch.rand(3, hd // 2, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, 1), torch.cat([angle.sin()] * 2, 1)
    tables = torch.tensor([[0], [1], [2]], dtype=torch.int32)
    lens = torch.tensor([3, 1, 4], dtype=torch.int32)
    write_rows = torch.tensor([2, 4, 11])
    x = torch.randn(3, D, generator=g).to(dtype)

    def run(layers, **kw):
        k, v = L.k.clone(), L.v.clone()  # each call writes its new keys into the pool: the same ones
        out = layers.run(x, slots, cos, sin, write_rows, tables, lens, bs, **kw)
        L.k.copy_(k), L.v.copy_(v)
        return out

    plain = run(DecodeLayers([L], shape, dtype))
    full = DecodeLayers([L], shape, dtype, final_norm=final, head=head)
    h = run(full)
    want = final[slots + 1] * torch.nn.functional.rms_norm(plain.float(), (D,), eps=1e-5).to(dtype)
    assert h.dtype == dtype and rel_err(h.float(), want.float()) <= (1e-6 if dtype == torch.float32 else 1e-2)
    logits = run(full, logits=True)
    assert logits.dtype == torch.float32 and torch.equal(logits, cpu_ops.dense_linear_cpu(h, head).float())
    # a variant's head = the base's + one sign plane (its tied embedding compressed to signs): fp32,
    # not rounded, the runner's _sign_heads bit for bit (the GEMV, then the batched delta's plane)
    planes = [
        (torch.randint(0, 256, (V, (D + 7) // 8), generator=g, dtype=torch.uint8), alpha)
        for alpha in (torch.rand(V, generator=g) * 1e-2, torch.tensor([3e-3]))
    ]
    # one plane for every row (one task: the GEMV beside the planes), and mixes of two planes and
    # the base's head alone: each row as _logits makes it, whatever the other rows take
    for n, rows in ((1, [0, 0, 0]), (2, [1, 1, 1]), (2, [0, -1, 1]), (2, [-1, 1, -1]), (1, [-1, -1, -1])):
        got = run(full, logits=True, head_planes=HeadPlanes(tuple(planes[2 - n :]), torch.tensor(rows)))
        for r, p in enumerate(rows):
            if p < 0:
                assert torch.equal(got[r], logits[r])
                continue
            signs, alpha = planes[2 - n + p]
            want = cpu_ops.dense_linear_cpu(h[r : r + 1], head, out_fp32=True)
            cpu_ops.bitdelta_delta_batched_cpu(
                h[r : r + 1], signs[None], alpha[None], torch.zeros(1, dtype=torch.int64), want
            )
            assert torch.equal(got[r], want[0])
            assert (got[r] - logits[r]).abs().max() > 0  # the plane moved them
    signs, alpha = planes[0]
    with pytest.raises(ValueError, match="head planes need logits"):
        run(full, head_planes=HeadPlanes(((signs, alpha),), torch.zeros(3, dtype=torch.int64)))
    with pytest.raises(ValueError, match="row_head must be"):
        run(full, logits=True, head_planes=HeadPlanes(((signs, alpha),), torch.tensor([0, 1, -1])))
    with pytest.raises(ValueError, match="signs must be uint8"):
        run(full, logits=True, head_planes=HeadPlanes(((signs[:, :-1], alpha),), torch.zeros(3, dtype=torch.int64)))


def test_argmax_rows_is_numpys(isa):
    """The bursts' greedy pick (bd_argmax_rows): numpy's argmax, the first of equal maxima (−0 and +0
    equal), the first NaN above all, at every length around the vector widths."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    lib = cpu_build.load_cpu_lib()
    for n in (1, 7, 8, 15, 16, 17, 31, 33, 100, 49152):
        rows = torch.randn(8, n, generator=g)
        j = torch.randint(0, n, (8,), generator=g)
        rows[1, j[1]] = rows[1].max() + 1  # one maximum anywhere
        rows[2, :] = rows[2, 0]  # all equal: the first
        rows[3, j[3]], rows[3, (j[3] + n // 2) % n] = float("nan"), float("nan")  # the first NaN
        rows[4, :] = float("-inf")
        rows[5, :] = -1.0
        rows[5, j[5]], rows[5, (j[5] + 1) % n] = -0.0, 0.0  # ±0 equal: the first of them
        rows[6, j[6]], rows[6, n - 1] = float("inf"), float("inf")
        out = (ctypes.c_int64 * 8)()
        lib.bd_argmax_rows(rows.data_ptr(), 8, n, out)
        assert list(out) == np.argmax(rows.numpy(), -1).tolist(), n


def token_model(dtype, bs, seed):
    """A one-layer model (dim 40, head_dim 20, vocab 50; blocks of bs) that embeds token ids: its
    DecodeLayers with the final norm, head and embedding, the layer, the shape, the embedding, a
    variant's dense table, another's two sign planes on the embedding (signs, α) and the generator."""
    from bitdelta_kernels.cpu_decode import DecodeLayers

    D, V = 40, 50
    shape, L, final, head, g = one_layer_model(D, 2, 1, 20, 72, V, bs, 2, dtype, seed=seed)
    embed = torch.randn(V, D, generator=g).to(dtype)
    dense = torch.randn(V, D, generator=g).to(dtype)
    signs = torch.randint(0, 256, (2, V, (D + 7) // 8), generator=g, dtype=torch.uint8)
    alpha = torch.rand(2, V, generator=g) * 0.1
    layers = DecodeLayers([L], shape, dtype, final_norm=final, head=head, embed=embed)
    return layers, L, shape, embed, dense, signs, alpha, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_embed_token_ids_and_read_rope_rows(isa, dtype):
    """Given token ids, the C call embeds the rows itself: the base's rows, a variant's dense table,
    or the base's rows + its sign planes (fp32 sums rounded once, the runner's _variant_embeddings);
    and with rope_rows it reads each row's rotation from tables in place. The logits equal those of
    the same step given the embedded rows and each row's rotation, and host ints (a list of ragged
    block lists among them) give what tensors give."""
    from bitdelta_kernels.cpu_decode import DecodeLayers, EmbedPlanes

    D, hd, V, bs = 40, 20, 50, 4
    layers, L, shape, embed, dense, signs, alpha, g = token_model(dtype, bs, seed=12)
    tokens, row_embed, slots = [7, 3, 49], [1, -1, 0], [1, -1, 0]
    # the reference rows: the base's, + each plane's ±α in fp32 (then rounded), the dense table's
    bits = (signs[..., torch.arange(D) // 8] >> (torch.arange(D) % 8)) & 1  # [2, V, D]
    x = embed[tokens].clone()
    acc = embed[tokens[0]].float()
    for p in range(2):
        acc = acc + alpha[p, tokens[0]] * (bits[p, tokens[0]].float() * 2 - 1)
    x[0], x[2] = acc.to(dtype), dense[tokens[2]]
    angle = torch.rand(12, hd // 2, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, 1).to(dtype), torch.cat([angle.sin()] * 2, 1).to(dtype)
    pos = [2, 0, 11]
    blocks, lens, write_rows = [[0], [1], [2, 3, 0]], [3, 1, 12], [2, 4, 3]
    tables = torch.tensor([[0, 0, 0], [1, 0, 0], [2, 3, 0]], dtype=torch.int32)

    def run(*args, **kw):
        k, v = L.k.clone(), L.v.clone()  # each call writes its new keys into the pool: the same ones
        out = layers.run(*args, **kw)
        L.k.copy_(k), L.v.copy_(v)
        return out

    want = run(
        x,
        torch.tensor(slots),
        cos[pos],
        sin[pos],
        torch.tensor(write_rows),
        tables,
        torch.tensor(lens),
        bs,
        logits=True,
    )
    ep = EmbedPlanes((dense, (signs, alpha)), row_embed)
    got = run(tokens, slots, cos, sin, write_rows, blocks, lens, bs, logits=True, rope_rows=pos, embeds=ep)
    assert torch.equal(got, want)
    tensors = run(
        torch.tensor(tokens),
        torch.tensor(slots),
        cos,
        sin,
        torch.tensor(write_rows),
        tables,
        torch.tensor(lens),
        bs,
        logits=True,
        rope_rows=torch.tensor(pos),
        embeds=EmbedPlanes(ep.tables, torch.tensor(row_embed)),
    )
    assert torch.equal(tensors, want)
    strided = torch.empty(D, 3, dtype=dtype).t()  # x not contiguous: a copy the bound call holds
    strided.copy_(x)
    assert torch.equal(run(strided, slots, cos[pos], sin[pos], write_rows, blocks, lens, bs, logits=True), want)
    base = run(tokens, [-1] * 3, cos, sin, write_rows, blocks, lens, bs, logits=True, rope_rows=pos)
    assert not torch.equal(base, want)  # the variants' rows moved
    for bad in (
        dict(x=[7, 3, V]),
        dict(rope_rows=[2, 0, 12]),
        dict(embeds=EmbedPlanes(ep.tables, [2, -1, 0])),
    ):
        kw = dict(x=tokens, rope_rows=pos, embeds=ep) | bad
        with pytest.raises(ValueError, match="token ids must lie"):
            run(kw.pop("x"), slots, cos, sin, write_rows, blocks, lens, bs, logits=True, **kw)
    with pytest.raises(ValueError, match="need token ids"):
        run(x, slots, cos[pos], sin[pos], write_rows, blocks, lens, bs, logits=True, embeds=ep)
    with pytest.raises(ValueError, match="token ids need"):
        DecodeLayers([L], shape, dtype).run(tokens, slots, cos, sin, write_rows, blocks, lens, bs, rope_rows=pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_are_single_steps_fed_their_argmax(isa, dtype):
    """A burst (`bind_steps`) gives each row the tokens of as many single steps, each fed the last
    step's argmax (numpy's) at the next position, writes the same keys and values, and ends with
    the last step's logits; a base row, a row of two sign planes on the embedding and a row of a
    dense embedding at once, block lists crossing a block. A set interrupt or a past deadline stops
    it after one step; positions past the rope rows or the block lists are refused before any
    step."""
    import time

    import numpy as np

    from bitdelta_kernels.cpu_decode import EmbedPlanes, Interrupt

    hd, bs = 20, 8
    layers, L, _, _, dense, signs, alpha, g = token_model(dtype, bs, seed=13)
    angle = torch.rand(16, hd // 2, generator=g) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, 1).to(dtype), torch.cat([angle.sin()] * 2, 1).to(dtype)
    ep = EmbedPlanes((dense, (signs, alpha)), [1, -1, 0])
    tokens, slots, pos, blocks, steps = [7, 3, 49], [1, -1, 0], [1, 6, 3], [[0], [1, 2], [3]], 4
    lens = [p + 1 for p in pos]
    pool = L.k.clone(), L.v.clone()

    def rows(p):
        return [b[q // bs] * bs + q % bs for b, q in zip(blocks, p)]

    want, t, p, logits = [], list(tokens), list(pos), None
    for _ in range(steps):  # single steps, each fed the last one's argmax
        logits = layers.run(t, slots, cos, sin, rows(p), blocks, [q + 1 for q in p], bs, logits=True,
                            rope_rows=p, embeds=ep)  # fmt: skip
        t = np.argmax(logits.numpy(), -1).tolist()
        want.append(t)
        p = [q + 1 for q in p]
    want = [list(r) for r in zip(*want)]  # per row
    after = L.k.clone(), L.v.clone()

    def burst(n, **kw):
        L.k.copy_(pool[0]), L.v.copy_(pool[1])
        call = layers.bind_steps(
            tokens, slots, cos, sin, rows(pos), blocks, lens, bs, n, rope_rows=pos, embeds=ep, **kw
        )
        t0 = time.perf_counter()
        out = call()
        assert len(out.times) == len(out.tokens[0]) and t0 <= out.times[0] <= out.times[-1] <= time.perf_counter()
        return out.tokens, call

    got, call = burst(steps)
    assert got == want and len(set(map(tuple, want))) > 1  # the rows differ: each fed its own
    assert torch.equal(L.k, after[0]) and torch.equal(L.v, after[1])
    assert torch.equal(call.call.out, logits)
    assert burst(2)[0] == [r[:2] for r in want]
    stop = Interrupt()
    stop.set()
    assert burst(steps, interrupt=stop)[0] == [r[:1] for r in want]
    stop.clear()
    assert burst(steps, interrupt=stop)[0] == want
    assert burst(steps, deadline=time.monotonic() - 1)[0] == [r[:1] for r in want]
    assert burst(steps, deadline=time.monotonic() + 60)[0] == want
    with pytest.raises(ValueError, match="a rope row and a block"):
        layers.bind_steps(  # row 1's positions 6..8 and 8 rope rows
            tokens, slots, cos[:8], sin[:8], rows(pos), blocks, lens, bs, 3, rope_rows=pos, embeds=ep
        )()
    with pytest.raises(ValueError, match="a rope row and a block"):
        burst(6)  # row 2's position 8 has no block
    with pytest.raises(ValueError, match="steps must be"):
        burst(0)


# -- batch invariance (KernelSettings.batch_invariant) ---------------------------------------------
# across every default threshold: 8 (GEMV + delta), 24 (fused, the bf16 GEMV), 32 (the fp32 GEMV, unpack, merge)
INV_MS = [1, 2, 7, 9, 24, 25, 33, 40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_setting_gives_a_row_the_same_bits_at_every_row_count(isa, dtype):
    from bitdelta_kernels import dense_linear, lowrank_delta

    g = torch.Generator().manual_seed(7)
    d_out, d_in, r = 200, 136, 6
    x = torch.randn(max(INV_MS), d_in, generator=g).to(dtype)
    w = (torch.randn(d_out, d_in, generator=g) * 0.2).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(d_out, d_in, generator=g)) for _ in range(3)])
    alpha = torch.rand(3, d_out, generator=g) * 1e-3
    v, u = torch.randn(r, d_in, generator=g) * 0.1, torch.randn(d_out, r, generator=g) * 0.1

    def ops(m):  # row 0 of each path for m rows; one slot's rows (no unpack then) and three planes
        x_m = x[:m]
        slots = torch.zeros(m, dtype=torch.int64)
        y = dense_linear(x_m, w, out_fp32=True)
        return [
            dense_linear(x_m, w)[0],
            y[0],
            bitdelta_linear(x_m, w, signs[0], alpha[0])[0],
            bitdelta_linear(x_m, w, signs, alpha)[0],  # three planes of one variant
            bitdelta_delta_batched(x_m, signs, alpha, slots, y.clone())[0],
            lowrank_delta(x_m.float(), v, [(0, 0, u)], y.clone())[0],
        ]

    with configured(batch_invariant=True, backend="cpu"):
        first = ops(1)
        for m in INV_MS[1:]:
            for i, (a, b) in enumerate(zip(first, ops(m))):
                assert torch.equal(a, b), (m, i)
    with configured(backend="cpu"):  # the default picks paths by row count: the check can fail
        assert not all(torch.equal(a, b) for a, b in zip(ops(1), ops(40)))


def test_batch_invariant_setting_needs_the_library(no_cpu_lib):
    with configured(batch_invariant=True), pytest.raises(RuntimeError, match="compiled CPU library"):
        cpu_ops.dense_linear_cpu(torch.randn(3, 8), torch.randn(4, 8))


def test_mm_nt_takes_onednn_for_fp32_and_matches_torch():
    # the prefill paths' GEMM: fp32 through oneDNN (2x torch's MKL on AMD CPUs: bench/kernels.py
    # --gemm), the same product as torch's to fp32 rounding, any layout of x and w
    if torch.backends.mkldnn.is_available():
        assert cpu_ops._onednn_f32(), "torch has oneDNN, but the fp32 GEMM would not use it"
    g = torch.Generator().manual_seed(7)
    for M, K, N in [(1, 5, 3), (37, 100, 72), (300, 257, 129)]:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        for xv, wv in [(x, w), (x.t().contiguous().t(), w.t().contiguous().t()), (padded_rows(x), padded_rows(w))]:
            ref = (xv.double() @ wv.double().t()).float()
            assert rel_err(cpu_ops.mm_nt(xv, wv), ref) <= 1e-6
    w = torch.randn(9, 16, generator=g)
    assert cpu_ops.mm_nt(torch.randn(0, 16), w).shape == (0, 9)
    xh, wh = torch.randn(5, 16, generator=g).half(), w.half()
    assert torch.equal(cpu_ops.mm_nt(xh, wh), xh @ wh.t())  # other dtypes: torch's own product
    xg = torch.randn(5, 16, generator=g, requires_grad=True)
    cpu_ops.mm_nt(xg, w).sum().backward()  # a product autograd tracks stays torch's
    assert torch.allclose(xg.grad, w.sum(0).expand(5, 16))


@pytest.mark.parametrize("N", [72, 3000])  # one block; blocks of w's rows (MERGE_BLOCK_BYTES made small)
def test_mm_nt_widens_bf16_without_native_bf16(N, monkeypatch):
    # torch's bf16 GEMM is emulated on a CPU without bf16 (~6x slower than fp32 on an AVX2 EPYC):
    # there mm_nt multiplies the exactly widened operands in fp32 and rounds each product once,
    # torch's own bf16 math up to summation order; with native bf16 it is torch's product
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 300, generator=g).bfloat16(), torch.randn(N, 300, generator=g).bfloat16()
    monkeypatch.setattr(cpu_ops, "MERGE_BLOCK_BYTES", 300 * 4 * 512)
    exact = x.double() @ w.double().t()
    widened, calls = cpu_ops.mm_nt_fp32, []
    monkeypatch.setattr(cpu_ops, "mm_nt_fp32", lambda *a: calls.append(1) or widened(*a))
    monkeypatch.setattr(cpu_ops, "native_bf16", lambda: (False, "test"))
    y = cpu_ops.mm_nt(x, w)
    assert calls and y.dtype == torch.bfloat16 and y.shape == (37, N)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-3)
    assert ((y.double() - exact).abs() <= ulp).all()  # within one rounding of the exact product
    monkeypatch.setattr(cpu_ops, "native_bf16", lambda: (True, "test"))
    calls.clear()
    assert torch.equal(cpu_ops.mm_nt(x, w), x @ w.t()) and not calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mm_nt_fp32_widens_the_weight_by_blocks(dtype, monkeypatch):
    # fp32 products of any weight dtype (the sign heads' logits, dense_linear's out_fp32, the base
    # GEMM of blas_delta without native bf16) never widen a whole half-precision weight at once
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, 96, generator=g).to(dtype), torch.randn(1000, 96, generator=g).to(dtype)
    monkeypatch.setattr(cpu_ops, "MERGE_BLOCK_BYTES", 96 * 4 * 128)  # blocks of 128 rows
    widened = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.shape[0]) or real_float(t))
    y = cpu_ops.mm_nt_fp32(x, w)
    monkeypatch.undo()
    assert y.dtype == torch.float32 and y.shape == (20, 1000)
    assert rel_err(y, (x.double() @ w.double().t()).float()) <= 1e-6
    assert max(widened) <= (128 if dtype != torch.float32 else 20)  # x once, w by at most 128 rows
    y_out = cpu_ops.dense_linear_cpu(x, w, out_fp32=True)  # its large-M path
    assert y_out.dtype == torch.float32 and rel_err(y_out, y) <= 1e-6


def test_the_build_key_covers_every_part_of_the_source(tmp_path, monkeypatch):
    """The library is bitdelta_cpu.c and the parts it includes (csrc/*.h): a change to any part is
    a new build (key), and another source tree builds from its own parts (load_source)."""
    src = tmp_path / "csrc"
    shutil.copytree(cpu_build.SOURCE.parent, src)
    monkeypatch.setattr(cpu_build, "SOURCE", src / "bitdelta_cpu.c")
    parts = sorted(src.glob("*.h"))
    assert {p.name for p in parts} >= {"pool.h", "planes.h", "linear.h", "decode.h"}
    before = cpu_build._prebuilt_path(tmp_path, "scalar")
    assert cpu_build._prebuilt_path(tmp_path, "scalar") == before
    with open(parts[-1], "a") as f:
        f.write("/* a change in the last part */\n")
    assert cpu_build._prebuilt_path(tmp_path, "scalar") != before
    # a part the copy's own bitdelta_cpu.c includes, not this checkout's: its bd_isa answers 42
    (src / "pool.h").write_text((src / "pool.h").read_text() + "int bd_isa_of_the_copy(void) { return 42; }\n")
    lib = cpu_build.load_source(src / "bitdelta_cpu.c", isa="scalar")
    lib.bd_isa_of_the_copy.restype = ctypes.c_int
    assert lib.bd_isa_of_the_copy() == 42 and lib.bd_isa() == 0
