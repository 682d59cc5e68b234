"""Per-row 1-bit delta (Punica BGMV style): one program per row and N-tile, for decode batches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The kernel's arguments stay in their groups (pointers, sizes, strides, meta): fmt: skip.
@triton.jit
def _bitdelta_bgmv_kernel(
    # pointers
    x_ptr, s_ptr, alpha_ptr, y_ptr, row_variant_ptr,
    # sizes
    N, K,
    # strides
    stride_xm, stride_xk, stride_sv, stride_sn, stride_av, stride_an, stride_ym, stride_yn,
    # meta
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[r, n] += α_v[n] · Σ_k x[r, k] · S_v[n, k],  v = row_variant[r]; rows with v < 0 are untouched.

    x: [M, K]; s: uint8 [V, N, ceil(K/8)]; α: fp32 [V, N] (stride_an 0: one per matrix);
    row_variant: int [M]; y: [M, N], updated in place. Program (r, pid_n) handles row r
    and BLOCK_N outputs. Each sign byte is loaded once: the K-step is viewed as
    [BLOCK_K/8 bytes, 8 bits] and x is loaded in the same [bytes, 8] shape, so
    no reshape is needed; the sum runs on CUDA cores (no dot for one row).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    v = tl.load(row_variant_ptr + pid_m).to(tl.int64)  # int64 before it multiplies a stride
    valid = v >= 0
    v = tl.maximum(v, 0)  # base-only rows: every load and the store are masked off
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N) & valid
    offs_b = tl.arange(0, 8)
    BYTES: tl.constexpr = BLOCK_K // 8
    s_base = s_ptr + v * stride_sv
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        offs_g = step * BYTES + tl.arange(0, BYTES)  # byte index within the row
        offs_k = offs_g[:, None] * 8 + offs_b[None, :]  # [BYTES, 8] column index
        x = tl.load(x_row + offs_k * stride_xk, mask=(offs_k < K) & valid, other=0.0).to(tl.float32)
        # bytes past the row end (K not a multiple of 8·BYTES) read as 0; x there is 0
        byte = tl.load(
            s_base + offs_n[:, None] * stride_sn + offs_g[None, :],
            mask=n_mask[:, None] & (offs_g[None, :] * 8 < K),
            other=0,
        )  # [BN, BYTES]
        bit = (byte.to(tl.int32)[:, :, None] >> offs_b[None, None, :]) & 1  # [BN, BYTES, 8]
        contrib = tl.where(bit != 0, x[None, :, :], -x[None, :, :])
        acc += tl.sum(tl.sum(contrib, axis=2), axis=1)

    alpha = tl.load(alpha_ptr + v * stride_av + offs_n * stride_an, mask=n_mask, other=0.0)
    y_ptrs = y_ptr + pid_m.to(tl.int64) * stride_ym + offs_n * stride_yn
    y_old = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_old + acc * alpha).to(y_ptr.dtype.element_ty), mask=n_mask)


def bgmv_launch(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    row_variant: torch.Tensor,
    y: torch.Tensor,
    blocks: dict,
) -> torch.Tensor:
    """Launch one program per (row, N-tile); shapes are checked by the caller.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)]; alpha_stack: fp32 [V, d_out] or [V, 1];
    row_variant: int [M] on x's device; y: [M, d_out]. Returns y, updated in place.
    """
    M, K = x.shape
    N = signs_stack.shape[1]
    if M == 0 or N == 0:
        return y
    if blocks["BLOCK_K"] % 8:
        raise ValueError("bgmv BLOCK_K must be a multiple of 8")
    grid = (M, triton.cdiv(N, blocks["BLOCK_N"]))
    _bitdelta_bgmv_kernel[grid](
        x,
        signs_stack,
        alpha_stack,
        y,
        row_variant,
        N,
        K,
        x.stride(0),
        x.stride(1),
        signs_stack.stride(0),
        signs_stack.stride(1),
        alpha_stack.stride(0),
        0 if alpha_stack.shape[1] == 1 else alpha_stack.stride(1),
        y.stride(0),
        y.stride(1),
        BLOCK_N=blocks["BLOCK_N"],
        BLOCK_K=blocks["BLOCK_K"],
        num_warps=blocks["num_warps"],
        num_stages=blocks["num_stages"],
    )
    return y
