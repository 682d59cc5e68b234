"""CPU paths for the 1-bit delta kernels (no bit is unpacked per call at decode).

Building blocks from the C library (`csrc/bitdelta_cpu.c` and its parts):
- `delta_gemv_cpu`: y += α ⊙ (x · Sᵀ) straight from the packed bits ("mask"): with
  AVX-512 x is summed over set bits by lookups in x's tables of 4 columns, 16 sign
  rows per vector (AVX2: tables of 2 columns, 8 rows per vector); the byte lookup table of the
  design doc ("lut8") is kept as the portable alternative and for the benchmark.
- `merge_cpu`: W_base + α·S (or α·S alone) for a block of rows, in fp32/bf16/fp16,
  for the prefill path: merge a row block once, then one BLAS GEMM.
- `linear_gemv_cpu`: the decode GEMV, y = x·Wᵀ (+ α ⊙ (x·Sᵀ) fused, in one pass
  over W and the bits: an FMA and a masked add per 16 columns). Without the delta it
  is the base's decode GEMV (`dense_linear_cpu`), bf16 weights widened in registers.

Which one runs is chosen per M and weight dtype (thresholds below, measured):
decode-sized M takes the base GEMV then the delta GEMV (`gemv_delta`: two passes beat
the fused one from memory), up to FUSED_GEMV_MAX_M the fused GEMV; larger M merges W_eff block by block and
runs one BLAS GEMM, since the merge is one pass over W and the GEMM then does
base and delta in one product.

With the batch-invariant setting (`bitdelta_kernels.settings`, `batch_invariant`) every row count takes
the per-row paths (the GEMV with the delta's second pass, the C batched delta, never a BLAS GEMM):
a row's sums are then formed in one order whatever else its call holds, so its numbers do not
depend on its batch (docs/kernels.md, "Batch invariance"); they need the compiled library.

Without the compiled library everything falls back to torch (unpack per call;
correct, 20–60× slower, logged once by `cpu_build`).
"""

from __future__ import annotations

import torch

from bitdelta_kernels.bits import packed_cols, unpack_signs
from bitdelta_kernels.cpu_build import cpu_isa, load_cpu_lib
from bitdelta_kernels.cpu_features import native_bf16
from bitdelta_kernels.reference import bitdelta_linear_ref
from bitdelta_kernels.settings import current

# Path thresholds, from `python bench/kernels.py --cpu-sweep --only-sweep --threads 1`
# at 2048² and 4096² on a 2-core AVX-512 EPYC (table in docs/kernels.md):
# - up to FUSED_GEMV_MAX_M rows, the one-pass C GEMV (base FMA + delta masked add)
#   is as fast as torch's base GEMV alone (0.9× at M=1; torch's small-M sgemm is
#   slower still). bf16 is lower: torch's bf16 GEMM has hardware bf16 dot products
#   that the fp32 C loop lacks, so merge-then-GEMM in bf16 wins sooner;
# - beyond, merge a row block of W_eff and run ONE BLAS GEMM (merge ≈ one pass over W);
# - without AVX-512 the C GEMV is not vectorised: BLAS + delta GEMV below MERGE_MIN_M;
# - delta only (batched): the delta GEMV costs ≈ a dense GEMM at M ≈ 32, beyond
#   which unpack(α·S)-then-GEMM wins.
FUSED_GEMV_MAX_M = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 24}
# The same GEMV without the delta (a base row): torch's M=1 fp32 GEMV read the weights at
# 16 GB/s and its bf16 GEMV at ~half the fp32 bandwidth, the C GEMV at 21 GB/s (fp32) and at
# the bf16 weights' bandwidth (one thread, 2-core EPYC, SmolLM2-135M shapes). With its register
# blocks of weight rows × x rows (one core of an AMD EPYC, Zen 5, SmolLM2-135M's shapes, thread
# time) it takes 0.42–0.74× torch's time at 8–32 rows in fp32 and 0.5–0.7× at 8 rows in bf16
# (0.94–1.21× at 24); the worker's decode rows go through the C layers up to these counts: 16
# streams 1.4× (bf16) and 1.8× (fp32) the tokens/s of the C layers stopping at 8, 32 fp32 streams
# 1.55×, 24 bf16 streams 1.07× (32 bf16 streams 0.97×: past the crossover). Those blocks are the
# AVX-512 build's (bf16: AVX512-BF16's dot products); other builds stop at 8 (`dense_gemv_max_m`).
# On a Zen 4 core the crossover lies further out (`python bench/cpu_paths.py`, one thread,
# 2026-12-05): fp32 1.53 / 1.23 / 1.15 / 1.04 / 0.99× at 16 / 24 / 32 / 40 / 48 streams, bf16
# 1.64 / 1.36 / 1.16 / 1.07× at 16 / 24 / 32 / 40; one table serves both, so these stay Zen 5's.
DENSE_GEMV_MAX_M = {torch.float32: 32, torch.bfloat16: 24, torch.float16: 8}
DENSE_GEMV_MAX_M_OTHER = 8
# A variant's row by the base GEMV and then its delta from the bits (`gemv_delta`) up to this many
# rows; beyond, the fused one-pass GEMV or merge-then-GEMM (`linear_path_cpu`).
GEMV_DELTA_MAX_M = 8
MERGE_MIN_M = 32
UNPACK_MIN_M = 32
# Merge at most this many bytes of weights at a time: big enough that the
# GEMM on a block runs at full speed, small enough to stay in the L3 cache.
MERGE_BLOCK_BYTES = 8 << 20

_W_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
METHODS = {"mask": 0, "lut8": 1}


def _alpha_f32(alpha: torch.Tensor, d_out: int) -> tuple[torch.Tensor, int]:
    """fp32 contiguous α and its per-row stride (0 for one α per matrix)."""
    a = alpha.reshape(-1).to(torch.float32).contiguous()
    if a.numel() == 1:
        return a, 0
    if a.numel() != d_out:
        raise ValueError(f"alpha has {a.numel()} values; expected {d_out} or 1")
    return a, 1


def _check_signs(signs: torch.Tensor, d_in: int, d_out: int | None = None, *tensors: torch.Tensor | None) -> None:
    """Shapes and devices the C code relies on (it would read out of bounds otherwise)."""
    if signs.dtype != torch.uint8 or signs.dim() != 2:
        raise ValueError(f"signs must be 2-D uint8, got {signs.dtype} {tuple(signs.shape)}")
    if signs.shape[1] != packed_cols(d_in):
        raise ValueError(f"signs have {signs.shape[1]} bytes per row; d_in={d_in} needs {packed_cols(d_in)}")
    if d_out is not None and signs.shape[0] != d_out:
        raise ValueError(f"signs have {signs.shape[0]} rows; expected {d_out}")
    if any(t is not None and t.device.type != "cpu" for t in (signs, *tensors)):
        raise ValueError("the CPU kernels take CPU tensors")


def delta_gemv_cpu(
    x: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor, y: torch.Tensor, method: str = "mask"
) -> torch.Tensor:
    """y += α ⊙ (x · Sᵀ), in place, from packed bits.

    x: [M, d_in] (any float dtype); signs: uint8 [d_out, ceil(d_in/8)];
    alpha: [d_out] or [1]; y: fp32 [M, d_out] with unit column stride.
    """
    lib = load_cpu_lib()
    M, d_in = x.shape
    d_out = signs.shape[0]
    _check_signs(signs, d_in, d_out, x, alpha, y)
    if y.dtype != torch.float32 or y.shape != (M, d_out) or (d_out > 1 and y.stride(1) != 1):
        raise ValueError(f"y must be fp32 [{M}, {d_out}] with unit column stride")
    if lib is None:
        s = unpack_signs(signs, d_in, torch.float32)
        y += (x.float() @ s.t()) * alpha.float().reshape(1, -1)
        return y
    x32 = x.to(torch.float32).contiguous()
    s = signs if signs.stride(1) == 1 else signs.contiguous()
    a, a_stride = _alpha_f32(alpha, d_out)
    rc = lib.bd_delta_gemv(
        x32.data_ptr(),
        M,
        x32.stride(0),
        s.data_ptr(),
        d_out,
        d_in,
        s.stride(0),
        a.data_ptr(),
        a_stride,
        y.data_ptr(),
        y.stride(0),
        METHODS[method],
        int(x.dtype == torch.bfloat16),  # exactly bf16 values: the table loop may take bf16 tables
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("bd_delta_gemv could not allocate its scratch")
    return y


def merge_cpu(
    w_base: torch.Tensor | None,
    signs: torch.Tensor,
    alpha: torch.Tensor | None,
    d_in: int,
    r0: int = 0,
    r1: int | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows [r0, r1) of W_base + α·S (w_base None: α·S; alpha None too: S) -> [r1−r0, d_in] in `dtype`.

    w_base: [d_out, d_in] fp32/bf16/fp16; signs: uint8 [d_out, ceil(d_in/8)]; alpha: [d_out] or [1].
    The sum is formed in fp32 and rounded once to `dtype` (fp32, bf16 or fp16).
    """
    lib = load_cpu_lib()
    d_out = signs.shape[0]
    r1 = d_out if r1 is None else r1
    _check_signs(signs, d_in, None, w_base, alpha, out)
    if not 0 <= r0 <= r1 <= d_out or (w_base is not None and tuple(w_base.shape) != (d_out, d_in)):
        raise ValueError(f"rows [{r0}, {r1}) of a [{d_out}, {d_in}] matrix requested")
    if out is None:
        out = torch.empty(r1 - r0, d_in, dtype=dtype)
    if out.dtype not in _W_DTYPE_CODE or out.shape != (r1 - r0, d_in) or (d_in > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be fp32/bf16/fp16 [{r1 - r0}, {d_in}] with unit column stride")
    if lib is None:
        m = unpack_signs(signs[r0:r1], d_in, torch.float32)
        if alpha is not None:
            a = alpha.float().reshape(-1)
            m *= a[r0:r1].reshape(-1, 1) if a.numel() > 1 else a
        if w_base is not None:
            m += w_base[r0:r1].float()
        return out.copy_(m)
    if w_base is None:
        w, code, ldw = None, 0, 0
    else:
        w = w_base if w_base.dtype in _W_DTYPE_CODE else w_base.float()
        w = w if w.stride(1) == 1 else w.contiguous()
        code, ldw = _W_DTYPE_CODE[w.dtype], w.stride(0)
    s = signs if signs.stride(1) == 1 else signs.contiguous()
    a, a_stride = (None, 0) if alpha is None else _alpha_f32(alpha, d_out)
    lib.bd_merge(
        None if w is None else w.data_ptr(),
        code,
        ldw,
        s.data_ptr(),
        s.stride(0),
        None if a is None else a.data_ptr(),
        a_stride,
        r0,
        r1,
        d_in,
        out.data_ptr(),
        _W_DTYPE_CODE[out.dtype],
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def linear_gemv_cpu(
    x: torch.Tensor,
    w_base: torch.Tensor,
    signs: torch.Tensor | None,
    alpha: torch.Tensor | None,
    two_pass: bool = False,
) -> torch.Tensor:
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ) in one pass over W and the bits -> fp32 [M, d_out]
    (`two_pass`: W's pass alone, then the delta's over the bits, in the same call);
    signs None: y = x · W_baseᵀ alone (the base's decode GEMV, at the weights' bandwidth).

    x: [M, d_in]; w_base: [d_out, d_in] fp32/bf16/fp16; signs: uint8 [d_out, ceil(d_in/8)]; alpha: [d_out] or [1].
    """
    lib = load_cpu_lib()
    M, d_in = x.shape
    d_out = w_base.shape[0]
    if signs is not None:
        _check_signs(signs, d_in, d_out, x, w_base, alpha)
    elif any(t.device.type != "cpu" for t in (x, w_base)):
        raise ValueError("the CPU kernels take CPU tensors")
    if w_base.shape[1] != d_in:
        raise ValueError(f"w_base has {w_base.shape[1]} columns; x has {d_in}")
    if lib is None:
        if signs is None:
            return x.float() @ w_base.float().t()
        return bitdelta_linear_ref(x.float(), w_base, signs, alpha)
    x32 = x.to(torch.float32).contiguous()
    w = w_base if w_base.dtype in _W_DTYPE_CODE else w_base.float()
    w = w if w.stride(1) == 1 else w.contiguous()
    if signs is None:
        s, lds, a, a_stride = None, 0, None, 0
    else:
        s = signs if signs.stride(1) == 1 else signs.contiguous()
        lds = s.stride(0)
        a, a_stride = _alpha_f32(alpha, d_out)
    y = torch.empty(M, d_out, dtype=torch.float32)
    rc = lib.bd_linear_gemv(
        x32.data_ptr(),
        M,
        x32.stride(0),
        w.data_ptr(),
        _W_DTYPE_CODE[w.dtype],
        w.stride(0),
        None if s is None else s.data_ptr(),
        d_out,
        d_in,
        lds,
        None if a is None else a.data_ptr(),
        a_stride,
        y.data_ptr(),
        y.stride(0),
        int(x.dtype == torch.bfloat16),  # exactly bf16 values: the bf16 dot products may read them
        int(two_pass),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("bd_linear_gemv could not allocate its scratch")
    return y


def row_invariant() -> bool:
    """Whether the process asks for batch-invariant kernels (`KernelSettings.batch_invariant`): the
    per-row paths at every row count. Raises if the compiled library, which has them, is missing."""
    if not current().batch_invariant:
        return False
    if load_cpu_lib() is None:
        raise RuntimeError(
            "batch-invariant kernels need the compiled CPU library, which did not build or is switched off "
            "(BITDELTA_CPU_KERNELS=0); see the log of bitdelta_kernels.cpu_build"
        )
    return True


def dense_path_cpu(M: int, w_dtype: torch.dtype) -> str:
    """Which path `dense_linear_cpu` takes for M rows: the C GEMV ("gemv") or torch's GEMM ("blas")."""
    if row_invariant():
        return "gemv"  # whatever the ISA: the portable loop is per row too
    if load_cpu_lib() is None or cpu_isa() == "scalar":
        return "blas"
    return "gemv" if M <= dense_gemv_max_m(w_dtype) else "blas"


def dense_gemv_max_m(w_dtype: torch.dtype) -> int:
    """The most rows the C GEMV takes for weights of w_dtype in this process's build (beyond: torch's
    GEMM); the worker's C decode layers take as many decode rows."""
    isa = cpu_isa()
    blocked = isa == "avx512bf16" or (isa == "avx512" and w_dtype == torch.float32)
    n = DENSE_GEMV_MAX_M.get(w_dtype, 0)
    return n if blocked else min(n, DENSE_GEMV_MAX_M_OTHER)


def dense_linear_cpu(x: torch.Tensor, w: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
    """y = x · wᵀ with no delta (a base row's projection, the base's LM head) -> [M, d_out] in
    x.dtype (fp32 with `out_fp32`). Decode-sized M reads W once at bandwidth in the C GEMV
    (fp32 accumulation; bf16 weights widened in registers); larger M is torch's GEMM."""
    if dense_path_cpu(x.shape[0], w.dtype) == "gemv":
        y = linear_gemv_cpu(x, w, None, None)
        return y if out_fp32 else y.to(x.dtype)
    if out_fp32:
        return mm_nt_fp32(x, w)
    return mm_nt(x, w)


def mm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · wᵀ for CPU matrices x [M, K] and w [N, K] (a GEMM of the prefill paths). fp32 by
    fp32 runs oneDNN's matmul where this torch has it: torch's own fp32 GEMM is MKL's, which takes
    its AVX-512 code on Intel CPUs only (one core of an AMD EPYC of the Zen 5 generation, 559 × 576
    by 576 × 1536: MKL 100–117 GFLOPS, an AVX2 rate, oneDNN 200–260; docs/kernels.md, "fp32
    GEMMs"). bf16 by bf16 is torch's (oneDNN's) GEMM where the CPU has native bf16, else widened
    to fp32 (`mm_nt_fp32`, then rounded once to bf16). Other dtypes, and products autograd tracks, are torch's."""
    tracked = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    if x.dtype == torch.float32 and w.dtype == torch.float32 and x.shape[0] and not tracked and _onednn_f32():
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.contiguous(), None, "none", [], "")
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and not tracked and not native_bf16()[0]:
        return mm_nt_fp32(x, w).to(torch.bfloat16)
    return x @ w.t()


def mm_nt_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · wᵀ in fp32 (fp32 accumulation and output) for CPU matrices of any float dtype: x widened
    once, w in blocks of its rows (MERGE_BLOCK_BYTES), so a bf16 or fp16 weight (an LM head of
    128K × 4096: 2 GB in fp32) never has a whole fp32 copy, each block through `mm_nt`'s fp32 GEMM.
    Where torch emulates bf16 this is also the fast bf16 product: one core of an AMD EPYC of the Zen
    3 generation, 559 × 576 by 576 × 1536, 20 ms against 131 in torch's bf16 GEMM."""
    xf, d_out = x.float(), w.shape[0]
    if w.dtype == torch.float32:
        return mm_nt(xf, w)
    rows = _block_rows(w.shape[1], d_out, 4)
    if rows >= d_out:
        return mm_nt(xf, w.float())
    y = torch.empty(x.shape[0], d_out, dtype=torch.float32)
    for r0 in range(0, d_out, rows):
        r1 = min(d_out, r0 + rows)
        y[:, r0:r1] = mm_nt(xf, w[r0:r1].float())
    return y


_ONEDNN_F32: bool | None = None  # torch's oneDNN linear op runs here (decided once, by a check)


def _onednn_f32() -> bool:
    """Whether torch's oneDNN linear op (`torch.ops.mkldnn._linear_pointwise`, what torch.compile's
    CPU code calls) exists and gives x · wᵀ here: checked once on a small product against torch's."""
    global _ONEDNN_F32
    if _ONEDNN_F32 is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w = torch.randn(3, 40, generator=g), torch.randn(24, 40, generator=g)
            y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            _ONEDNN_F32 = bool(torch.backends.mkldnn.is_available()) and torch.allclose(y, x @ w.t(), atol=1e-5)
        except (AttributeError, RuntimeError, NotImplementedError):
            _ONEDNN_F32 = False
    return _ONEDNN_F32


def _compute_dtype(x: torch.Tensor, w_base: torch.Tensor) -> torch.dtype:
    """The GEMM dtype on CPU: the weights' when x matches them and BLAS is fast in it (fp32; bf16
    where the CPU has native bf16, `native_bf16`), else fp32."""
    if x.dtype == w_base.dtype and (
        w_base.dtype == torch.float32 or (w_base.dtype == torch.bfloat16 and native_bf16()[0])
    ):
        return w_base.dtype
    return torch.float32


def _block_rows(d_in: int, d_out: int, itemsize: int) -> int:
    """Rows of W_eff merged at a time: a block of MERGE_BLOCK_BYTES, at least 16 rows, at most d_out."""
    return min(d_out, max(16, MERGE_BLOCK_BYTES // (itemsize * d_in)))


def linear_merge_gemm_cpu(
    x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """Prefill path: merge a block of rows of W_eff at a time (never all of it), one fp32 GEMM per block.

    x: [M, d_in]; w_base: [d_out, d_in] -> y: [M, d_out] in x.dtype.
    """
    M, d_in = x.shape
    d_out = w_base.shape[0]
    # W_eff is formed and used in fp32 whatever the weights' dtype: rounding W + α·S to bf16
    # would erase most of the delta (α ~1e-4..1e-3 is below bf16's spacing at |W| ~ 0.1).
    ct = torch.float32
    xc = x.to(ct)
    rows = _block_rows(d_in, d_out, torch.finfo(ct).bits // 8)
    buf = torch.empty(rows, d_in, dtype=ct)
    if rows >= d_out:
        return mm_nt(xc, merge_cpu(w_base, signs, alpha, d_in, out=buf)).to(x.dtype)
    y = torch.empty(M, d_out, dtype=ct)
    for r0 in range(0, d_out, rows):
        r1 = min(d_out, r0 + rows)
        blk = merge_cpu(w_base, signs, alpha, d_in, r0, r1, out=buf[: r1 - r0])
        y[:, r0:r1] = mm_nt(xc, blk)
    return y.to(x.dtype)


def linear_blas_delta_cpu(
    x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """Base GEMM by BLAS in the weights' dtype, then the delta GEMV from the bits -> [M, d_out] in x.dtype."""
    ct = _compute_dtype(x, w_base)
    y = mm_nt_fp32(x, w_base) if ct == torch.float32 else mm_nt(x, w_base).float()
    delta_gemv_cpu(x, signs, alpha, y)
    return y.to(x.dtype)


def linear_gemv_delta_cpu(
    x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor
) -> torch.Tensor:
    """Decode path: the base's C GEMV, then the delta from the bits, one C call -> [M, d_out] in
    x.dtype. Two passes: the weights' pass stays a pure stream at bandwidth (one pass with the masked adds
    interleaved ran at 0.6-0.8x of it), the second reads only the bits (1/32 of fp32 W's bytes)."""
    return linear_gemv_cpu(x, w_base, signs, alpha, two_pass=True).to(x.dtype)


def linear_path_cpu(M: int, w_dtype: torch.dtype) -> str:
    """Which CPU path `bitdelta_linear_cpu` takes for M rows (measured; docs/kernels.md)."""
    if load_cpu_lib() is None:
        return "torch"
    if row_invariant() or (M <= GEMV_DELTA_MAX_M and dense_path_cpu(M, w_dtype) == "gemv"):
        return "gemv_delta"
    if cpu_isa() in ("avx512", "avx512bf16"):
        return "fused_gemv" if M <= FUSED_GEMV_MAX_M.get(w_dtype, 0) else "merge_gemm"
    return "blas_delta" if M < MERGE_MIN_M else "merge_gemm"


def bitdelta_linear_cpu(
    x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor, path: str | None = None
) -> torch.Tensor:
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ) on CPU; same contract as `bitdelta_linear_ref`.

    x: [M, d_in]; w_base: [d_out, d_in]; signs: uint8 [d_out, ceil(d_in/8)];
    alpha: [d_out] or [1] -> y: [M, d_out] in x.dtype. `path` forces a path (benchmarks).
    """
    path = path or linear_path_cpu(x.shape[0], w_base.dtype)
    if path == "gemv_delta":
        return linear_gemv_delta_cpu(x, w_base, signs, alpha)
    if path == "fused_gemv":
        return linear_gemv_cpu(x, w_base, signs, alpha).to(x.dtype)
    if path == "blas_delta":
        return linear_blas_delta_cpu(x, w_base, signs, alpha)
    if path == "merge_gemm":
        return linear_merge_gemm_cpu(x, w_base, signs, alpha)
    if path == "torch":
        return bitdelta_linear_ref(x, w_base, signs, alpha)
    raise ValueError(f"unknown CPU path {path!r}")


def delta_rows_cpu(
    x: torch.Tensor,
    signs: torch.Tensor,
    alpha: torch.Tensor,
    y32: torch.Tensor,
    path: str | None = None,
    col_alpha: torch.Tensor | None = None,
    bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y32 += α ⊙ ((x ⊙ c_g) · Sᵀ) for one plane: the delta GEMV for few rows, unpack(α·S)-then-GEMM for many.

    x: [M, d_in]; signs: uint8 [d_out, ceil(d_in/8)]; alpha: [d_out] or [1]; y32: fp32 [M, d_out];
    col_alpha: None (c = 1) or fp32 [G, d_in] over the row groups `bounds` (G + 1 row bounds):
    each group is the same call on its rows with x ⊙ c_g.
    """
    M, d_in = x.shape
    d_out = signs.shape[0]
    if col_alpha is not None:
        a = alpha.reshape(-1).float().expand(d_out)
        for g in range(len(bounds) - 1):
            r0, r1 = bounds[g], bounds[g + 1]
            if r1 > r0:
                xs = x.float() * col_alpha[g]
                delta_rows_cpu(xs, signs[r0:r1], a[r0:r1], y32[:, r0:r1], path)
        return y32
    path = path or ("delta_gemv" if M < UNPACK_MIN_M or row_invariant() else "unpack_gemm")
    if path == "delta_gemv" or load_cpu_lib() is None:
        return delta_gemv_cpu(x, signs, alpha, y32)
    x32 = x.to(torch.float32)
    rows = _block_rows(d_in, d_out, 4)
    buf = torch.empty(rows, d_in, dtype=torch.float32)
    for r0 in range(0, d_out, rows):
        r1 = min(d_out, r0 + rows)
        blk = merge_cpu(None, signs, alpha, d_in, r0, r1, out=buf[: r1 - r0])  # α·S rows
        y32[:, r0:r1] += mm_nt(x32, blk)
    return y32


def bitdelta_delta_batched_cpu(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    row_slots: torch.Tensor,
    y: torch.Tensor,
    col_alpha: torch.Tensor | None = None,
    bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y[r] += Σ_p α_s ⊙ ((x[r] ⊙ c_s) · S_sᵀ), s = row_slots[r, p] ≥ 0; same contract as the reference.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)]; alpha_stack: [V, d_out], [V, 1] or [V];
    row_slots: int [M] or [M, P] (−1: nothing); col_alpha: None or fp32 [V, G, d_in] over the row
    groups `bounds` (G + 1 row bounds, 0 … d_out); y: [M, d_out], updated in place and returned.
    A slot with ≥ UNPACK_MIN_M rows at one plane position goes through unpack-then-GEMM;
    every other (row, plane) through ONE call of the C batched delta (one parallel region:
    on a busy host every extra region can cost a scheduler slice), which loops over a row's
    planes inside and adds their fp32 sum to y once.
    """
    M, d_in = x.shape
    V, d_out, _ = signs_stack.shape
    if signs_stack.dtype != torch.uint8 or signs_stack.shape[2] != packed_cols(d_in):
        raise ValueError(f"signs_stack must be uint8 [V, d_out, {packed_cols(d_in)}], got {tuple(signs_stack.shape)}")
    if tuple(y.shape) != (M, d_out) or row_slots.dim() not in (1, 2) or row_slots.shape[0] != M:
        raise ValueError(f"y must be [{M}, {d_out}] and row_slots [{M}] or [{M}, P]")
    if alpha_stack.shape[0] != V:
        raise ValueError(f"alpha_stack must be [{V}, ...]")
    bounds = (0, d_out) if bounds is None else tuple(bounds)
    G = len(bounds) - 1
    if bounds[0] != 0 or bounds[-1] != d_out or any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must rise from 0 to {d_out}, got {bounds}")
    if col_alpha is not None and tuple(col_alpha.shape) != (V, G, d_in):
        raise ValueError(f"col_alpha must be [{V}, {G}, {d_in}], got {tuple(col_alpha.shape)}")
    if any(t is not None and t.device.type != "cpu" for t in (x, signs_stack, alpha_stack, y, col_alpha)):
        raise ValueError("the CPU kernels take CPU tensors")
    rs = row_slots.to("cpu", torch.int64).reshape(M, -1).contiguous()
    P = rs.shape[1]
    if not rs.numel():
        return y
    lo, hi = (int(v) for v in rs.aminmax())
    if hi >= V or lo < -1:
        raise ValueError(f"row_slots values must lie in [-1, {V - 1}]")
    if hi < 0:
        return y
    alpha_stack = alpha_stack.reshape(V, -1)
    cols = None if col_alpha is None else col_alpha.to(torch.float32).contiguous()
    lib = load_cpu_lib()
    y32 = y if y.dtype == torch.float32 and y.stride(1) == 1 else y.to(torch.float32)
    gemv_rs = rs
    unpack = lib is None or (M >= UNPACK_MIN_M and not row_invariant())
    for p in range(P if unpack else 0):  # fewer rows (or batch-invariant): all in the C call
        slots, counts = torch.unique(rs[:, p][rs[:, p] >= 0], return_counts=True)
        for v, c in zip(slots.tolist(), counts.tolist()):
            if lib is not None and c < UNPACK_MIN_M:
                continue  # left to the single batched call below
            on = rs[:, p] == v
            rows = on.nonzero(as_tuple=True)[0]
            part = y32[rows]  # gathered copy: [n_rows, d_out]
            col = None if cols is None else cols[v]
            delta_rows_cpu(x[rows], signs_stack[v], alpha_stack[v], part, None, col, bounds)
            y32[rows] = part
            gemv_rs = gemv_rs.clone() if gemv_rs is rs else gemv_rs
            gemv_rs[on, p] = -1
    if gemv_rs is rs or bool((gemv_rs >= 0).any()):
        x32 = x.to(torch.float32).contiguous()
        s = signs_stack if signs_stack.stride(2) == 1 else signs_stack.contiguous()
        a = alpha_stack.to(torch.float32).contiguous()
        b = None if cols is None else torch.tensor(bounds, dtype=torch.int64)
        rc = lib.bd_delta_batched(
            x32.data_ptr(),
            M,
            x32.stride(0),
            s.data_ptr(),
            s.stride(0),
            d_out,
            d_in,
            s.stride(1),
            a.data_ptr(),
            a.stride(0),
            0 if a.shape[1] == 1 else 1,
            gemv_rs.data_ptr(),
            P,
            None if cols is None else cols.data_ptr(),
            0 if cols is None else cols.stride(0),
            0 if cols is None else cols.stride(1),
            None if b is None else b.data_ptr(),
            G,
            y32.data_ptr(),
            y32.stride(0),
            int(x.dtype == torch.bfloat16),  # exactly bf16 values: the table loop may take bf16 tables
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("bd_delta_batched could not allocate its scratch")
    if y32 is not y:
        y.copy_(y32)
    return y


def linear_planes_cpu(
    x: torch.Tensor,
    w_base: torch.Tensor,
    signs: torch.Tensor,
    alpha: torch.Tensor,
    col_alpha: torch.Tensor | None = None,
    bounds: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """y = x · W_baseᵀ + Σ_p α_p ⊙ ((x ⊙ c_p) · S_pᵀ) for the K planes of one variant -> [M, d_out] in x.dtype.

    x: [M, d_in]; w_base: [d_out, d_in]; signs: uint8 [K, d_out, ceil(d_in/8)]; alpha: fp32 [K, d_out]
    or [K, 1]; col_alpha: None or fp32 [K, G, d_in] over the row groups `bounds`.
    Decode-sized M: the base's C GEMV, then every plane from its bits in one batched-delta call
    (the numbers a mixed batch computes for the same rows). Larger M: W_eff = W + Σ_p α_p ⊙ c_p ⊙ S_p
    merged in fp32 a row block at a time, one GEMM per block (K + 1 GEMMs otherwise).
    """
    M, d_in = x.shape
    K, d_out, _ = signs.shape
    if dense_path_cpu(M, w_base.dtype) == "gemv" or load_cpu_lib() is None:
        y = dense_linear_cpu(x, w_base, out_fp32=True)
        slots = torch.arange(K, dtype=torch.int64).expand(M, K)
        return bitdelta_delta_batched_cpu(x, signs, alpha, slots, y, col_alpha, bounds).to(x.dtype)
    bounds = (0, d_out) if bounds is None else tuple(bounds)
    x32 = x.to(torch.float32)
    rows = _block_rows(d_in, d_out, 4)
    buf, tmp = torch.empty(rows, d_in), torch.empty(rows, d_in)
    y = torch.empty(M, d_out)
    for r0 in range(0, d_out, rows):
        r1 = min(d_out, r0 + rows)
        blk = buf[: r1 - r0].copy_(w_base[r0:r1])
        for p in range(K):
            part = merge_cpu(None, signs[p], alpha[p], d_in, r0, r1, out=tmp[: r1 - r0])  # α_p·S_p rows
            if col_alpha is not None:
                for g in range(len(bounds) - 1):
                    a, b = max(r0, bounds[g]), min(r1, bounds[g + 1])
                    if a < b:
                        part[a - r0 : b - r0] *= col_alpha[p, g]
            blk += part
        y[:, r0:r1] = x32 @ blk.t()
    return y.to(x.dtype)
