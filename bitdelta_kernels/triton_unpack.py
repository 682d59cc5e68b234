"""Sign bits to ±1 values in memory, for prefill-sized GEMMs on the GPU: S as a dense matrix in the
model's dtype, which cuBLAS then multiplies at its tensor-core rate (`dispatch.bitdelta_linear`'s
unpacked path). The torch reference is `bitdelta_kernels.bits.unpack_signs`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitdelta_kernels.bits import packed_cols

BLOCK_R = 16  # sign rows per program
BLOCK_B = 64  # bytes (8 columns each) per program


# The kernel's arguments stay in their groups (pointers, sizes, strides, meta): fmt: skip.
@triton.jit
def _unpack_signs_kernel(
    # pointers
    s_ptr, out_ptr,
    # sizes
    R, K,
    # strides
    stride_sr, stride_or,
    # meta
    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """out[r, 8b + j] = +1 where bit j of byte s[r, b] is set, else −1, for columns < K: one
    [BLOCK_R, BLOCK_B] tile of bytes per program, written as [BLOCK_R, BLOCK_B, 8] values (no reshape)."""
    pid_r, pid_b = tl.program_id(0), tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    keep = (offs_r[:, None] < R) & (offs_b[None, :] * 8 < K)
    byte = tl.load(s_ptr + offs_r[:, None] * stride_sr + offs_b[None, :], mask=keep, other=0).to(tl.int32)
    j = tl.arange(0, 8)
    bit = (byte[:, :, None] >> j[None, None, :]) & 1  # [BLOCK_R, BLOCK_B, 8]
    col = offs_b[None, :, None] * 8 + j[None, None, :]
    value = tl.where(bit != 0, 1.0, -1.0).to(out_ptr.dtype.element_ty)  # ±1: exact in every float dtype
    tl.store(out_ptr + offs_r[:, None, None] * stride_or + col, value, mask=keep[:, :, None] & (col < K))


def unpack_signs_triton(
    signs: torch.Tensor, d_in: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 [R, ceil(d_in/8)] (rows of unit column stride) -> {−1, +1} [R, d_in] in `dtype`, into
    `out` (a contiguous [R, d_in] of that dtype) when given: `bits.unpack_signs` on the device."""
    if signs.dtype != torch.uint8 or signs.dim() != 2 or signs.shape[1] != packed_cols(d_in):
        raise ValueError(f"signs must be uint8 [R, {packed_cols(d_in)}], got {signs.dtype} {tuple(signs.shape)}")
    if signs.shape[0] and signs.stride(1) != 1:
        raise ValueError("signs must have unit column stride")
    R = signs.shape[0]
    if out is None:
        out = torch.empty(R, d_in, dtype=dtype, device=signs.device)
    elif out.dtype != dtype or tuple(out.shape) != (R, d_in) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} [{R}, {d_in}]")
    if R and d_in:
        grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(packed_cols(d_in), BLOCK_B))
        _unpack_signs_kernel[grid](
            signs, out, R, d_in, signs.stride(0), out.stride(0), BLOCK_R=BLOCK_R, BLOCK_B=BLOCK_B, num_warps=4
        )
    return out


__all__ = ["unpack_signs_triton"]
