"""CPU paths for the 1-bit delta kernels (no bit is unpacked per call at decode).

Two building blocks from `csrc/bitdelta_cpu.c`:
- `delta_gemv_cpu`: y += α ⊙ (x · Sᵀ) straight from the packed bits. With
  AVX-512 each 16 sign bits are one lane mask and x is summed over set bits by
  one masked add ("mask"); the byte lookup table of the design doc ("lut8")
  is kept as the portable alternative and for the benchmark.
- `merge_cpu`: W_base + α·S (or α·S alone) for a block of rows, in fp32,
  for the prefill path: merge a row block once, then one BLAS GEMM.

Which one runs is chosen per M (measured on a 2-core AVX-512 EPYC, see
docs/kernels.md): decode-sized M uses base GEMV + delta GEMV; from
MERGE_MIN_M rows on, merge-then-GEMM is cheaper because the merge costs one
pass over the weights and the GEMM then does base and delta in one product.

Without the compiled library everything falls back to torch (unpack per call;
correct, 20–60× slower, logged once by `cpu_build`).
"""

from __future__ import annotations

import torch

from bitdelta.bits import packed_cols, unpack_signs
from kernels.cpu_build import load_cpu_lib
from kernels.reference import bitdelta_linear_ref

# Rows of x from which merge-then-GEMM beats GEMV + delta GEMV (fused linear),
# and from which unpack(α·S)-then-GEMM beats the delta GEMV (delta only).
# Measured with bench/kernels.py --cpu-sweep at 2048² and 4096²; see docs/kernels.md.
MERGE_MIN_M = 48
UNPACK_MIN_M = 48
# Merge at most this many bytes of fp32 weights at a time: big enough that the
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


def _check_signs(signs: torch.Tensor, d_in: int) -> None:
    if signs.dtype != torch.uint8 or signs.dim() != 2:
        raise ValueError(f"signs must be 2-D uint8, got {signs.dtype} {tuple(signs.shape)}")
    if signs.shape[1] != packed_cols(d_in):
        raise ValueError(f"signs have {signs.shape[1]} bytes per row; d_in={d_in} needs {packed_cols(d_in)}")


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
    _check_signs(signs, d_in)
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
        x32.data_ptr(), M, x32.stride(0), s.data_ptr(), d_out, d_in, s.stride(0),
        a.data_ptr(), a_stride, y.data_ptr(), y.stride(0), METHODS[method], torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("bd_delta_gemv could not allocate its scratch")
    return y


def merge_cpu(
    w_base: torch.Tensor | None, signs: torch.Tensor, alpha: torch.Tensor | None, d_in: int,
    r0: int = 0, r1: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Rows [r0, r1) of W_base + α·S (w_base None: α·S; alpha None too: S) -> fp32 [r1−r0, d_in]."""
    lib = load_cpu_lib()
    d_out = signs.shape[0]
    r1 = d_out if r1 is None else r1
    _check_signs(signs, d_in)
    if out is None:
        out = torch.empty(r1 - r0, d_in, dtype=torch.float32)
    if lib is None:
        s = unpack_signs(signs[r0:r1], d_in, torch.float32)
        if alpha is not None:
            s *= alpha.float().reshape(-1, 1)[r0:r1] if alpha.numel() > 1 else alpha.float()
        out.copy_(s if w_base is None else w_base[r0:r1].float() + s)
        return out
    if w_base is None:
        w, code, ldw = None, 0, 0
    else:
        w = w_base if w_base.dtype in _W_DTYPE_CODE else w_base.float()
        w = w if w.stride(1) == 1 else w.contiguous()
        code, ldw = _W_DTYPE_CODE[w.dtype], w.stride(0)
    s = signs if signs.stride(1) == 1 else signs.contiguous()
    if alpha is None:
        a, a_stride = None, 0
    else:
        a, a_stride = _alpha_f32(alpha, d_out)
    lib.bd_merge(
        None if w is None else w.data_ptr(), code, ldw, s.data_ptr(), s.stride(0),
        None if a is None else a.data_ptr(), a_stride, r0, r1, d_in,
        out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    return out


def linear_gemv_cpu(x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ) in one pass over W and the bits -> fp32 [M, d_out].

    x: [M, d_in]; w_base: [d_out, d_in] fp32/bf16/fp16; signs: uint8 [d_out, ceil(d_in/8)]; alpha: [d_out] or [1].
    """
    lib = load_cpu_lib()
    M, d_in = x.shape
    d_out = w_base.shape[0]
    _check_signs(signs, d_in)
    if lib is None:
        return bitdelta_linear_ref(x.float(), w_base, signs, alpha)
    x32 = x.to(torch.float32).contiguous()
    w = w_base if w_base.dtype in _W_DTYPE_CODE else w_base.float()
    w = w if w.stride(1) == 1 else w.contiguous()
    s = signs if signs.stride(1) == 1 else signs.contiguous()
    a, a_stride = _alpha_f32(alpha, d_out)
    y = torch.empty(M, d_out, dtype=torch.float32)
    rc = lib.bd_linear_gemv(
        x32.data_ptr(), M, x32.stride(0), w.data_ptr(), _W_DTYPE_CODE[w.dtype], w.stride(0),
        s.data_ptr(), d_out, d_in, s.stride(0), a.data_ptr(), a_stride, y.data_ptr(), y.stride(0),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("bd_linear_gemv could not allocate its scratch")
    return y


def _block_rows(d_in: int, d_out: int) -> int:
    return max(16, min(d_out, MERGE_BLOCK_BYTES // (4 * d_in)))


def bitdelta_linear_cpu(x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ) on CPU; same contract as `bitdelta_linear_ref`.

    x: [M, d_in]; w_base: [d_out, d_in]; signs: uint8 [d_out, ceil(d_in/8)];
    alpha: [d_out] or [1] -> y: [M, d_out] in x.dtype.
    """
    M, d_in = x.shape
    d_out = w_base.shape[0]
    if M < MERGE_MIN_M:
        # decode: base GEMV in the weights' dtype (BLAS), then the delta from the bits
        xw = x if x.dtype == w_base.dtype else x.to(w_base.dtype)
        y = torch.mm(xw, w_base.t()).to(torch.float32)
        delta_gemv_cpu(x, signs, alpha, y)
        return y.to(x.dtype)
    # prefill: merge a block of rows of W_eff at a time (never all of it), one GEMM per block
    x32 = x.to(torch.float32)
    y = torch.empty(M, d_out, dtype=torch.float32)
    rows = _block_rows(d_in, d_out)
    buf = torch.empty(rows, d_in, dtype=torch.float32)
    for r0 in range(0, d_out, rows):
        r1 = min(d_out, r0 + rows)
        blk = merge_cpu(w_base, signs, alpha, d_in, r0, r1, out=buf[: r1 - r0])
        y[:, r0:r1] = x32 @ blk.t()
    return y.to(x.dtype)


def delta_rows_cpu(x: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor, y32: torch.Tensor) -> torch.Tensor:
    """y32 += α ⊙ (x · Sᵀ) for one variant, choosing GEMV or unpack-then-GEMM by M."""
    M, d_in = x.shape
    if M < UNPACK_MIN_M:
        return delta_gemv_cpu(x, signs, alpha, y32)
    x32 = x.to(torch.float32)
    d_out = signs.shape[0]
    rows = _block_rows(d_in, d_out)
    buf = torch.empty(rows, d_in, dtype=torch.float32)
    for r0 in range(0, d_out, rows):
        r1 = min(d_out, r0 + rows)
        blk = merge_cpu(None, signs, alpha, d_in, r0, r1, out=buf[: r1 - r0])  # α·S block
        y32[:, r0:r1] += x32 @ blk.t()
    return y32


def bitdelta_delta_batched_cpu(
    x: torch.Tensor, signs_stack: torch.Tensor, alpha_stack: torch.Tensor, row_variant: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """y[r] += α_v ⊙ (x[r] · S_vᵀ), v = row_variant[r] ≥ 0; same contract as the reference.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)]; alpha_stack: [V, d_out] or [V, 1];
    row_variant: int [M] (−1: base only); y: [M, d_out], updated in place and returned.
    """
    rv = row_variant.to("cpu", torch.int64)
    variants = torch.unique(rv)
    variants = variants[variants >= 0].tolist()
    if not variants:
        return y
    if len(variants) == 1 and bool((rv == variants[0]).all()):
        # one variant for the whole batch: no gather/scatter
        v = variants[0]
        y32 = y if y.dtype == torch.float32 and y.stride(1) == 1 else y.to(torch.float32)
        delta_rows_cpu(x, signs_stack[v], alpha_stack[v], y32)
        if y32 is not y:
            y.copy_(y32)
        return y
    for v in variants:
        rows = (rv == v).nonzero(as_tuple=True)[0]
        y32 = y[rows].to(torch.float32)  # gathered copy: [n_rows, d_out]
        delta_rows_cpu(x[rows], signs_stack[v], alpha_stack[v], y32)
        y[rows] = y32.to(y.dtype)
    return y
