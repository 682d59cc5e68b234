"""Several sign planes per variant and per-column α, on every backend, against a float64 oracle.

A k-plane variant occupies k slots of the stacks; a row names its slots in row_slots [M, P]
(−1: nothing), so rows of 1, 2 and 3 planes and base-only rows mix in one batch and one launch.
A plane's α scales output rows ([d_out]), the matrix ([1]) or input columns (col_alpha: one
vector per matrix of a projection group, the group's matrices concatenated along d_out and named
by col_splits). The oracle forms every plane's ΔW = α ⊙ c ⊙ S densely in float64; the kernels
never do. Triton runs in the interpreter on CPU (small shapes), BGMV and SGMV each forced; the C
path runs its host build and its AVX2 build. A 1-D row_slots and its [M, 1] form are one call,
bit for bit, on every backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bitdelta_kernels import bitdelta_delta_batched, bitdelta_linear, cpu_build, plan_batch
from bitdelta_kernels.bits import pack_signs, unpack_signs
from bitdelta_kernels.reference import bitdelta_linear_ref
from bitdelta_kernels.settings import configured
from tests.kernels.test_kernels import nan_buffer, padding_untouched
from tests.support.kernel_cases import bf16_table_bound, rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda  # the CUDA profile runs these with real dots
SHAPES = [(72, 100), (136, 257)]  # (d_out, d_in): ragged against 8, 16 and the blocks
SPLITS = {72: (24, 16, 32), 136: (64, 40, 32), 37: (12, 9, 16)}  # q‖k‖v-like groups along d_out
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALPHAS = ["row", "matrix", "col"]
# each row's slots: k planes of one variant (variant v holds slots 3v, 3v+1, 3v+2), and the mix
LAYOUTS = {
    "k1": [[0], [3], [-1], [6], [3], [0], [-1], [6], [0]],
    "k2": [[0, 1], [3, 4], [-1, -1], [6, 7], [3, 4], [0, 1], [-1, -1], [6, 7], [0, 1]],
    "k3": [[0, 1, 2], [3, 4, 5], [-1, -1, -1], [6, 7, 8], [3, 4, 5], [0, 1, 2], [-1, -1, -1], [6, 7, 8], [0, 1, 2]],
    # 3, 1 and 2 planes, −1 in the middle of a tuple, base-only rows, a slot shared by two variants
    "mixed": [
        [0, 1, 2],
        [3, -1, -1],
        [-1, -1, -1],
        [6, 7, -1],
        [0, 1, 2],
        [-1, 4, -1],
        [2, -1, 8],
        [3, -1, -1],
        [0, 1, 2],
    ],
}
V = 9  # slots


def make_stack(d_out, d_in, alpha_kind, dtype, M=9, seed=0):
    """x [M, d_in] in dtype, signs [V, d_out, bytes], α [V, d_out] | [V, 1], column α's [V, G, d_in] or None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d_in, generator=g).to(dtype)
    signs = torch.stack([pack_signs(torch.randn(d_out, d_in, generator=g)) for _ in range(V)])
    splits = SPLITS[d_out]
    if alpha_kind == "matrix":
        alpha, cols = torch.rand(V, 1, generator=g) * 0.05 + 0.01, None
    elif alpha_kind == "row":
        alpha, cols = torch.rand(V, d_out, generator=g) * 0.05 + 0.01, None
    else:  # groups 0 and 2 per-column α (α = 1 on their rows), group 1 per-row α (c = 1)
        alpha = torch.ones(V, d_out)
        alpha[:, splits[0] : splits[0] + splits[1]] = torch.rand(V, splits[1], generator=g) * 0.05 + 0.01
        cols = torch.rand(V, 3, d_in, generator=g) * 0.05 + 0.01
        cols[:, 1] = 1.0
    return x, signs, alpha, cols, splits


def oracle(x, signs, alpha, cols, splits, row_slots, y0):
    """y0 + Σ_p x · ΔW_sᵀ with ΔW_s = α_s ⊙ c_s ⊙ S_s formed densely in float64."""
    d_out, d_in = signs.shape[1], x.shape[1]
    bounds = [0, splits[0], splits[0] + splits[1], d_out]
    out = y0.double().clone()
    for r, slots in enumerate(row_slots.reshape(x.shape[0], -1).tolist()):
        for s in slots:
            if s < 0:
                continue
            dw = unpack_signs(signs[s], d_in, torch.float64) * alpha[s].double().reshape(-1, 1)
            if cols is not None:
                for g in range(3):
                    dw[bounds[g] : bounds[g + 1]] *= cols[s, g].double()
            out[r] += dw @ x[r].double()
    return out


def col_args(cols, splits, dev=DEV):
    return {} if cols is None else {"col_alpha": cols.to(dev), "col_splits": splits}


def run_triton(x, signs, alpha, cols, splits, rs, y0, kind):
    xv, _ = nan_buffer(x.to(DEV))
    yv, ybuf = nan_buffer(y0.to(DEV))
    plan = plan_batch(rs, V, DEV, sgmv_min_rows=1 if kind == "sgmv" else 10**9, block_m=4)
    assert plan.kind == kind and plan.planes == rs.reshape(rs.shape[0], -1).shape[1]
    out = bitdelta_delta_batched(xv, signs.to(DEV), alpha.to(DEV), rs.to(DEV), yv, plan=plan, **col_args(cols, splits))
    assert out.data_ptr() == yv.data_ptr() and padding_untouched(yv, ybuf)
    return yv.cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("alpha_kind", ALPHAS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("impl", ["bgmv", "sgmv", "cpu", "torch"])
def test_batched_planes(impl, shape, layout, alpha_kind, dtype):
    if impl in ("bgmv", "sgmv") and not torch.cuda.is_available() and shape == SHAPES[1] and dtype != torch.float32:
        pytest.skip("the interpreter's cost: the small shape covers the Triton half-precision paths")
    x, signs, alpha, cols, splits = make_stack(*shape, alpha_kind, dtype)
    rs = torch.tensor(LAYOUTS[layout])
    y0 = torch.randn(x.shape[0], shape[0], generator=torch.Generator().manual_seed(5)).to(dtype)
    want = oracle(x, signs, alpha, cols, splits, rs, y0)
    if impl in ("bgmv", "sgmv"):
        y = run_triton(x, signs, alpha, cols, splits, rs, y0, impl)
    else:
        y = bitdelta_delta_batched(x, signs, alpha, rs, y0.clone(), backend=impl, **col_args(cols, splits, "cpu"))
    none = (rs < 0).all(dim=1)
    assert torch.equal(y[none], y0[none])  # rows without a slot: untouched, bit for bit
    assert rel_err(y, want) <= TOL[dtype]
    assert rel_err(y - y0.double(), want - y0.double()) <= (TOL[dtype] if dtype == torch.float32 else 0.05)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("alpha_kind", ALPHAS)
def test_batched_planes_c_builds(isa, alpha_kind, x_dtype):
    """The C batched delta's SIMD paths (host build and AVX2 build), fp32 y, against the oracle at
    fp32's tolerance; an exactly-bf16 x too, except where the AVX512-BF16 build sums its planes from
    bf16 tables (without column α's): there within those tables' bound (bf16_table_bound); and
    a batch big enough that one slot goes through unpack-then-GEMM while the rest stay in C.
    d_in = 257 and 100: ragged against the loops' 16 and 32 columns."""
    with configured(cpu_isa=isa):
        assert cpu_build.load_cpu_lib() is not None, cpu_build.unavailable_reason
        bf16_tables = x_dtype == torch.bfloat16 and alpha_kind != "col" and cpu_build.cpu_isa() == "avx512bf16"
        for M, (d_out, d_in) in ((9, SHAPES[1]), (40, SHAPES[1]), (9, SHAPES[0])):
            x, signs, alpha, cols, splits = make_stack(d_out, d_in, alpha_kind, x_dtype, M=M, seed=M)
            rs = torch.tensor(LAYOUTS["mixed"] * 5)[:M]
            y0 = torch.randn(M, d_out)
            y = bitdelta_delta_batched(x, signs, alpha, rs, y0.clone(), backend="cpu", **col_args(cols, splits, "cpu"))
            want = oracle(x, signs, alpha, cols, splits, rs, y0)
            if not bf16_tables:
                assert rel_err(y, want) <= 1e-5
                continue
            a = alpha.abs().expand(V, d_out)
            alpha_abs = torch.stack([sum((a[s] for s in r if s >= 0), torch.zeros(d_out)) for r in rs.tolist()])
            err = (y.double() - want).abs()
            assert (err <= bf16_table_bound(x, alpha_abs) + 1e-5 * want.abs().max()).all()
            assert rel_err(y, want) > 1e-6  # the bf16 tables were taken: not the fp32 tables' sums


@pytest.mark.parametrize("impl", ["bgmv", "sgmv", "cpu", "torch"])
def test_one_plane_column_is_the_1d_call(impl):
    """row_slots [M] and [M, 1] are the same call, bit for bit (today's behaviour for one plane)."""
    x, signs, alpha, _, _ = make_stack(72, 100, "row", torch.bfloat16)
    rs = torch.tensor([0, 3, -1, 6, 3, 0, -1, 6, 0])
    y0 = torch.randn(9, 72).bfloat16()
    if impl in ("bgmv", "sgmv"):
        one = run_triton(x, signs, alpha, None, None, rs, y0, impl)
        two = run_triton(x, signs, alpha, None, None, rs[:, None], y0, impl)
    else:
        one = bitdelta_delta_batched(x, signs, alpha, rs, y0.clone(), backend=impl)
        two = bitdelta_delta_batched(x, signs, alpha, rs[:, None], y0.clone(), backend=impl)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("alpha_kind", ALPHAS)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("impl", ["triton", "cpu", "torch"])
def test_fused_linear_planes(impl, k, alpha_kind, dtype):
    """bitdelta_linear with the k planes of one variant: signs [k, d_out, bytes] = the sum of the planes."""
    M, (d_out, d_in) = 5, SHAPES[0]
    x, signs, alpha, cols, splits = make_stack(d_out, d_in, alpha_kind, dtype, M=M, seed=k)
    w = (torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(9)) * 0.1).to(dtype)
    s, a = signs[:k], alpha[:k]
    c = None if cols is None else cols[:k]
    want = oracle(x, signs, alpha, cols, splits, torch.arange(k).expand(M, k), x.double() @ w.double().t())
    dev = DEV if impl == "triton" else torch.device("cpu")
    y = bitdelta_linear(x.to(dev), w.to(dev), s.to(dev), a.to(dev), backend=impl, **col_args(c, splits, dev)).cpu()
    assert y.dtype == dtype and y.shape == (M, d_out)
    assert rel_err(y, want) <= TOL[dtype]


@pytest.mark.parametrize("impl", ["triton", "cpu"])
def test_fused_linear_planes_paths(impl, monkeypatch):
    """The fused path's other shapes: split-K in Triton; on CPU the decode GEMV (M = 1) and W_eff
    merged in 16-row blocks that cross the column groups' bounds (M = 40)."""
    from bitdelta_kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "MERGE_BLOCK_BYTES", 16 * 100 * 4)
    for M, cfg in ((1, {"SPLIT_K": 3, "BLOCK_K": 32}), (40, None)):
        for alpha_kind in ("row", "col"):
            x, signs, alpha, cols, splits = make_stack(
                72, 300 if impl == "triton" else 100, alpha_kind, torch.float32, M=M
            )
            d_in = x.shape[1]
            splits = SPLITS[72]
            w = torch.randn(72, d_in) * 0.1
            want = oracle(x, signs, alpha, cols, splits, torch.arange(3).expand(M, 3), x.double() @ w.double().t())
            if impl == "triton":
                from bitdelta_kernels.dispatch import _bounds_on
                from bitdelta_kernels.reference import col_bounds
                from bitdelta_kernels.triton_linear import bitdelta_linear_triton

                b = None if cols is None else _bounds_on(col_bounds(splits, 72), DEV)
                c = None if cols is None else cols[:3].to(DEV)
                y = bitdelta_linear_triton(
                    x.to(DEV), w.to(DEV), signs[:3].to(DEV), alpha[:3].to(DEV), config=cfg, col_alpha=c, bounds=b
                ).cpu()
            else:
                y = bitdelta_linear(
                    x,
                    w,
                    signs[:3],
                    alpha[:3],
                    backend="cpu",
                    **col_args(None if cols is None else cols[:3], splits, "cpu"),
                )
            assert rel_err(y, want) <= 1e-5, (M, alpha_kind)


@pytest.mark.parametrize("impl", ["triton", "cpu", "torch"])
def test_fused_one_plane_stack_is_the_2d_call(impl):
    """signs [1, d_out, bytes] with α [1, d_out] is exactly the one-plane call."""
    x, signs, alpha, _, _ = make_stack(72, 100, "row", torch.float16, M=5)
    w = (torch.randn(72, 100) * 0.1).half()
    dev = DEV if impl == "triton" else torch.device("cpu")
    args = (x.to(dev), w.to(dev))
    one = bitdelta_linear(*args, signs[0].to(dev), alpha[0].to(dev), backend=impl)
    stack = bitdelta_linear(*args, signs[:1].to(dev), alpha[:1].to(dev), backend=impl)
    assert rel_err(stack.cpu(), one.cpu()) <= TOL[torch.float16]
    assert rel_err(one.cpu(), bitdelta_linear_ref(x, w, signs[0], alpha[0])) <= TOL[torch.float16]


def test_plan_groups_rows_by_their_whole_slot_tuple():
    rs = torch.tensor([[0, 1], [2, -1], [0, 1], [-1, -1], [2, -1], [0, 1], [0, -1]])
    plan = plan_batch(rs, 3, torch.device("cpu"), sgmv_min_rows=2, block_m=2)
    assert plan.kind == "sgmv" and plan.planes == 2 and plan.max_rows == 3
    assert plan.slot_sets == ((0, -1), (0, 1), (2, -1))
    assert plan.row_idx.tolist() == [6, 0, 2, 5, 1, 4]
    tiles = list(zip(plan.tile_start.tolist(), plan.tile_end.tolist(), map(tuple, plan.tile_slots.tolist())))
    assert tiles == [(0, 1, (0, -1)), (1, 3, (0, 1)), (3, 4, (0, 1)), (4, 6, (2, -1))]
    assert plan_batch(rs, 3, sgmv_min_rows=4).kind == "bgmv"
    assert plan_batch(torch.full((3, 2), -1), 3).kind == "none"
    with pytest.raises(ValueError, match=r"\[-1, 2\]"):
        plan_batch(torch.tensor([[0, 3]]), 3)
    with pytest.raises(ValueError, match="row_slots"):
        plan_batch(torch.zeros(2, 2, 2, dtype=torch.long), 3)


def test_bad_plane_inputs_are_refused():
    x, signs, alpha, cols, splits = make_stack(72, 100, "col", torch.float32)
    rs = torch.tensor(LAYOUTS["k2"])
    y = torch.zeros(9, 72)
    for backend in ("cpu", "torch"):
        with pytest.raises(ValueError, match="col_alpha must be"):
            bitdelta_delta_batched(x, signs, alpha, rs, y, col_alpha=cols[:, :2], col_splits=splits, backend=backend)
        with pytest.raises(ValueError, match="col_splits must be"):
            bitdelta_delta_batched(x, signs, alpha, rs, y, col_alpha=cols, col_splits=(24, 16, 31), backend=backend)
        with pytest.raises(ValueError, match="col_splits without col_alpha"):
            bitdelta_delta_batched(x, signs, alpha, rs, y, col_splits=splits, backend=backend)
        with pytest.raises(ValueError, match="row_slots"):
            bitdelta_delta_batched(x, signs, alpha, rs[:5], y, backend=backend)
        with pytest.raises(ValueError, match="alpha must be"):
            bitdelta_linear(x, torch.zeros(72, 100), signs[:2], alpha[:3], backend=backend)
    plan = plan_batch(rs[:, :1], V)
    with pytest.raises(ValueError, match="plan was built for 9 rows of 1 slots"):
        bitdelta_delta_batched(x.to(DEV), signs.to(DEV), alpha.to(DEV), rs.to(DEV), y.to(DEV), plan=plan)
    with pytest.raises(ValueError, match=r"\[-1, 8\]"):
        bitdelta_delta_batched(x, signs, alpha, rs + 9, y, backend="cpu")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x_fp32", "x_bf16"])
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_c_rows_sharing_slots_get_their_own_numbers(isa, x_dtype):
    """The C loop pairs two rows with the same slots so each mask load feeds both; a row's result
    must not depend on that: bit for bit the same alone, paired, or in a mixed batch (batch
    invariance), in the batched delta and in the fused decode's second pass."""
    with configured(cpu_isa=isa):
        assert cpu_build.load_cpu_lib() is not None, cpu_build.unavailable_reason
        x, signs, alpha, _, _ = make_stack(136, 257, "row", x_dtype, M=5, seed=3)
        rs = torch.tensor([[0, 1, 2], [3, -1, -1], [0, 1, 2], [0, 1, 2], [3, -1, -1]])
        y0 = torch.randn(5, 136)
        batch = bitdelta_delta_batched(x, signs, alpha, rs, y0.clone(), backend="cpu")
        for r in range(5):
            alone = bitdelta_delta_batched(
                x[r : r + 1], signs, alpha, rs[r : r + 1], y0[r : r + 1].clone(), backend="cpu"
            )
            assert torch.equal(alone[0], batch[r]), r
        w = (torch.randn(136, 257) * 0.1).to(x_dtype)
        from bitdelta_kernels import cpu_ops

        two = cpu_ops.linear_gemv_cpu(x[:3], w, signs[0], alpha[0], two_pass=True)
        for r in range(3):
            assert torch.equal(cpu_ops.linear_gemv_cpu(x[r : r + 1], w, signs[0], alpha[0], two_pass=True)[0], two[r])


@pytest.mark.parametrize("d_in", [576, 760, 1000, 1031])
@pytest.mark.parametrize("alpha_kind", ALPHAS)
@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_c_table_loop_chunk_and_block_edges(isa, alpha_kind, d_in):
    """AVX-512's table loop reads 16 sign rows × 64 bytes at a time (a full block of evenly spaced
    rows: one gather per dword of the 16 rows; else loads and a transpose): d_in ≥ 512 so whole
    chunks run before the tail (576 columns, SmolLM2's width: 72 bytes = 64 + 2 whole dwords, which
    full blocks gather, and the rest load 16 bytes a row and transpose in 128-bit lanes; 760: 95
    bytes = 64 + 16 + 15, that form twice, the second ending inside a dword; 1000: 125 bytes = 64 +
    15 dwords + 1 byte in the 64-byte form, and 1031: 129 bytes = 2 · 64 + a last byte of 7 columns), d_out 37 (two blocks of 16 rows and a partial one; groups that start inside blocks).
    AVX2's reads 16 rows × 32 bytes, transposed in bytes, then the last ≤ 31 bytes in two halves
    (576: 2 chunks + 8 bytes, 4 in each half; 760: 2 + 31 bytes, 16 and 15, the low half loaded from
    the tail's start; 1000: 3 + 29, 15 and 14; 1031: 4 chunks + 1 byte, the high half empty; d_out
    37: two blocks of 16 rows and a partial one). Both:
    sign rows padded with set bits past their bytes (never read); against the oracle, and every row
    the same with one thread or two (the threads split the rows at other block edges) and with the
    full blocks' dwords gathered or loaded and transposed (the CPU picks one: bd_set_gather)."""
    with configured(cpu_isa=isa):
        lib = cpu_build.load_cpu_lib()
        assert lib is not None, cpu_build.unavailable_reason
        x, signs, alpha, cols, splits = make_stack(37, d_in, alpha_kind, torch.float32, M=9, seed=d_in)
        padded = torch.full((*signs.shape[:2], signs.shape[2] + 5), 255, dtype=torch.uint8)
        padded[..., : signs.shape[2]] = signs
        rs = torch.tensor(LAYOUTS["mixed"])
        y0 = torch.randn(9, 37)
        threads = torch.get_num_threads()
        got = {}
        try:
            for gather in (1, 0):
                assert lib.bd_set_gather(gather) == gather
                for n in (1, 2):
                    torch.set_num_threads(n)
                    got[gather, n] = bitdelta_delta_batched(
                        x,
                        padded[..., : signs.shape[2]],
                        alpha,
                        rs,
                        y0.clone(),
                        backend="cpu",
                        **col_args(cols, splits, "cpu"),
                    )
        finally:
            torch.set_num_threads(threads)
            lib.bd_set_gather(-1)
        assert rel_err(got[1, 1], oracle(x, signs, alpha, cols, splits, rs, y0)) <= 1e-5
        for key, y in got.items():
            assert torch.equal(y, got[1, 1]), key


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the grids above compile and run these kernels")
@pytest.mark.parametrize("planes,col", [(3, False), (2, True)], ids=["3_planes", "2_planes_col_alpha"])
def test_kernels_compile_for_hopper(planes, col):
    """The interpreter runs the kernels as Python and type-checks nothing: compile the plane loops
    (a runtime branch per slot, the group loop, the tf32x3 dots) with Triton's real compiler for
    sm_90, the GPU image's target, down to a cubin (the ptxas triton ships), in bf16. In a process
    of its own: the interpreter, once on, patches triton.language for the whole process."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.kernels.test_kernels_planes import compile_for_hopper; compile_for_hopper({planes}, {col})"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ["_bitdelta_bgmv_kernel", "_bitdelta_sgmv_kernel", "_bitdelta_linear_kernel", "_unpack_signs_kernel"]
    assert proc.stdout.split() == names


def compile_for_hopper(planes: int, col: bool) -> None:
    """Compile the three delta kernels and the sign unpack (the GPU's prefill path) for sm_90 (no GPU
    needed); prints each one's name."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bitdelta_kernels.triton_bgmv import _bitdelta_bgmv_kernel
    from bitdelta_kernels.triton_linear import _bitdelta_linear_kernel
    from bitdelta_kernels.triton_sgmv import _bitdelta_sgmv_kernel
    from bitdelta_kernels.triton_unpack import _unpack_signs_kernel

    shared = dict(PLANES=planes, HAS_COL=col, GROUPS=3 if col else 1)
    dots = dict(DOT_FP32=False, PRECISION="ieee", COL_PRECISION="tf32x3", ONE=0x3F80)  # bf16 1.0
    cases = [
        (_bitdelta_bgmv_kernel, dict(BLOCK_N=16, BLOCK_K=512, **shared)),
        (_bitdelta_sgmv_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, **dots, **shared)),
        (_bitdelta_linear_kernel, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=1, **dots, **shared)),
        (_unpack_signs_kernel, dict(BLOCK_R=16, BLOCK_B=64)),
    ]
    pointers = {
        "x_ptr": "*bf16",
        "w_ptr": "*bf16",
        "s_ptr": "*u8",
        "y_ptr": "*fp32",
        "col_ptr": "*fp32",
        "out_ptr": "*bf16",
    }
    for fn, consts in cases:
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = pointers.get(name, "*fp32" if name == "alpha_ptr" else "*i32")
            else:
                sig[name] = "i32"
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        print(fn.__name__)


def test_delta_loops_stay_light_as_compiled_for_hopper(tmp_path):
    """`bench/kernels_sass.py` compiles the delta kernels for sm_90 with the H200's blocks (no GPU
    needed) and counts their K loops. BGMV's loop must not reduce across threads (shuffles) at every
    step and must stay near 4 thread-instructions per sign weight: the reduced [BN, BK/8, 8] tile
    it replaced took ~16 (its loop 233 shuffles), the bound of the H200's measured BGMV. SGMV and the
    fused linear at decode must take their bits without the reshape through shared memory
    (`sign_dot`: ~20 and ~50 shared-memory operations a step, against 114 and 135 with it). In a
    process of its own, as test_kernels_compile_for_hopper."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sass.md"
    cmd = [sys.executable, "bench/kernels_sass.py", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[0] and cells[2].isdigit():
            rows[cells[0]] = cells
    assert set(rows) == {"bgmv", "sgmv 16 rows", "linear M ≤ 16", "linear M ≤ 128", "linear larger M"}
    bgmv = rows["bgmv"]
    shuffles = int(bgmv[7].split(",")[0])
    assert float(bgmv[3]) <= 6.0 and shuffles <= 2, bgmv
    for name, most in (("sgmv 16 rows", 60), ("linear M ≤ 16", 90)):
        shared = int(rows[name][7].split(",")[1])
        assert shared <= most and float(rows[name][3]) <= 8.0, rows[name]
    for name, cells in rows.items():  # every loop found, and the counts are per weight
        assert int(cells[2]) > 50 and 0 < float(cells[3]) < 100, (name, cells)
