"""Segmented 1-bit delta (Punica SGMV style): rows grouped by slot set, one tensor-core dot per tile and plane."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitdelta_kernels.triton_linear import col_precision, dot_one, sign_dot, tile_col_groups, uses_fp32_dot


# The kernel's arguments stay in their groups (pointers, sizes, strides, meta): fmt: skip.
@triton.jit
def _bitdelta_sgmv_kernel(
    # pointers
    x_ptr, s_ptr, alpha_ptr, y_ptr, row_idx_ptr, tile_start_ptr, tile_end_ptr, tile_slots_ptr, col_ptr, bounds_ptr,
    # sizes
    N, K,
    # strides
    stride_xm, stride_xk, stride_sv, stride_sn, stride_av, stride_an, stride_ym, stride_yn, stride_tp,
    stride_cv, stride_cg,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, PLANES: tl.constexpr, HAS_COL: tl.constexpr,
    GROUPS: tl.constexpr, COL_PRECISION: tl.constexpr, ONE: tl.constexpr,
):  # fmt: skip
    """y[r, n] += Σ_p α_v[n] · Σ_k x[r, k] · c_v[g(n), k] · S_v[n, k],  v = tile_slots[t, p] ≥ 0,
    for the rows r of one tile, all of one slot set; the planes' terms summed in fp32, then added.

    x: [M, K]; s: uint8 [V, N, ceil(K/8)]; α: fp32 [V, N] (stride_an 0: one per matrix);
    y: [M, N], updated in place. Tile t (program axis 0) covers rows
    row_idx[tile_start[t] : tile_end[t]] (≤ BLOCK_M rows, slots tile_slots[t, :PLANES]);
    axis 1 tiles N. A row belongs to one tile, so no two programs write one y element.
    HAS_COL: column α's c: fp32 [V, GROUPS, K], group g on outputs [bounds[g], bounds[g+1])
    (int32 [GROUPS + 1]); the tile's groups are visited in turn, x scaled by c in fp32 and
    dotted in fp32 (COL_PRECISION: tf32x3 on a GPU, ~fp32 exact); without, c = 1.
    Numerics: with S = 2B − 1 (B ∈ {0, 1}, exact in fp16/bf16/fp32), x · S = 2 · x · B − Σx:
    one dot in x's dtype with fp32 accumulation plus a row sum, scaled by α in fp32.
    Bits: each K-step expands the tile's sign bits ONCE for all rows of the tile
    (triton_linear.sign_dot; ONE: 1.0's bit pattern in the dot's dtype).
    """
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(tile_start_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    offs = start + tl.arange(0, BLOCK_M)
    m_mask = offs < end
    rows = tl.load(row_idx_ptr + offs, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N

    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in tl.static_range(PLANES):
        v = tl.load(tile_slots_ptr + pid_t * stride_tp + p).to(tl.int64)  # int64 before it multiplies a stride
        if v >= 0:
            s_base = s_ptr + v * stride_sv
            alpha = tl.load(alpha_ptr + v * stride_av + offs_n * stride_an, mask=n_mask, other=0.0)
            if HAS_COL:
                g_first, g_last = tile_col_groups(bounds_ptr, pid_n * BLOCK_N, N, BLOCK_N, GROUPS)
                for g in range(g_first, g_last + 1):
                    in_g = n_mask & (offs_n >= tl.load(bounds_ptr + g)) & (offs_n < tl.load(bounds_ptr + g + 1))
                    c_row = col_ptr + v * stride_cv + g * stride_cg
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (x ⊙ c) · Bᵀ
                    xacc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # Σ_k x ⊙ c, reduced after the loop
                    for step in range(0, tl.cdiv(K, BLOCK_K)):
                        offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
                        k_mask = offs_k < K
                        x = tl.load(
                            x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                            mask=m_mask[:, None] & k_mask[None, :],
                            other=0.0,
                        ).to(tl.float32)
                        xc = x * tl.load(c_row + offs_k, mask=k_mask, other=0.0)[None, :]
                        acc = sign_dot(  # fp32 1.0: x ⊙ c dots in fp32
                            acc, xc, s_base, offs_n, stride_sn, in_g, step * BLOCK_K, K,
                            0x3F800000, True, COL_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                        )  # fmt: skip
                        xacc += xc
                    xsum = tl.sum(xacc, axis=1)
                    total += tl.where(in_g[None, :], (2.0 * acc - xsum[:, None]) * alpha[None, :], 0.0)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x · Bᵀ
                xacc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # Σ_k x, reduced after the loop
                # range over a step count, not range(0, K, BLOCK_K): the latter breaks triton 3.6's interpreter with numpy ≥ 2.4
                for step in range(0, tl.cdiv(K, BLOCK_K)):
                    offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
                    k_mask = offs_k < K
                    x = tl.load(
                        x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0,
                    )  # [BM, BK]
                    acc = sign_dot(
                        acc, x, s_base, offs_n, stride_sn, n_mask, step * BLOCK_K, K,
                        ONE, DOT_FP32, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                    xacc += x.to(tl.float32)
                xsum = tl.sum(xacc, axis=1)
                total += (2.0 * acc - xsum[:, None]) * alpha[None, :]

    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_old + total).to(y_ptr.dtype.element_ty), mask=y_mask)


def sgmv_launch(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    y: torch.Tensor,
    row_idx: torch.Tensor,
    tile_start: torch.Tensor,
    tile_end: torch.Tensor,
    tile_slots: torch.Tensor,
    blocks: dict,
    col_alpha: torch.Tensor | None = None,
    bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch over precomputed tiles (see bitdelta_kernels.plan.plan_batch); shapes are checked by the caller.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)]; alpha_stack: fp32 [V, d_out] or [V, 1];
    y: [M, d_out]; row_idx: int32 [rows]; tile_start / tile_end: int32 [T]; tile_slots: int32 [T, P];
    col_alpha: None or fp32 [V, G, d_in] (unit column stride) with bounds: int32 [G + 1].
    Returns y, updated in place.
    """
    n_tiles = tile_start.numel()
    N, K = signs_stack.shape[1], x.shape[1]
    if n_tiles == 0 or N == 0:
        return y
    if blocks["BLOCK_K"] % 8:
        raise ValueError("sgmv BLOCK_K must be a multiple of 8 (a K-step covers whole sign bytes)")
    dot_fp32 = uses_fp32_dot(x.dtype)
    precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    has_col = col_alpha is not None
    grid = (n_tiles, triton.cdiv(N, blocks["BLOCK_N"]))
    _bitdelta_sgmv_kernel[grid](
        x,
        signs_stack,
        alpha_stack,
        y,
        row_idx,
        tile_start,
        tile_end,
        tile_slots,
        col_alpha if has_col else alpha_stack,  # an unread pointer without column α's
        bounds if has_col else tile_start,
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
        tile_slots.stride(0),
        col_alpha.stride(0) if has_col else 0,
        col_alpha.stride(1) if has_col else 0,
        BLOCK_M=blocks["BLOCK_M"],
        BLOCK_N=blocks["BLOCK_N"],
        BLOCK_K=blocks["BLOCK_K"],
        DOT_FP32=dot_fp32,
        PRECISION=precision,
        PLANES=tile_slots.shape[1],
        HAS_COL=has_col,
        GROUPS=col_alpha.shape[1] if has_col else 1,
        COL_PRECISION=col_precision(x.device),
        ONE=dot_one(x.dtype),
        num_warps=blocks["num_warps"],
        num_stages=blocks["num_stages"],
    )
    return y
