"""Per-row 1-bit delta (Punica BGMV style): one program per row and N-tile, for decode batches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitdelta_kernels.triton_linear import eight_columns, tile_col_groups


@triton.jit
def _signed_row_sum(
    x_row, stride_xk, c_row, s_rows, offs_n, stride_sn, keep_n, K,
    HAS_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_N]: Σ_k x[k] · c[k] · S[n, k] for the sign rows `s_rows + offs_n · stride_sn`
    (c = 1 without HAS_C; a row outside keep_n reads its bytes as 0, its sum is meaningless and the
    caller drops it), as 2 · Σ_{S = +1} x − Σ x in fp32 on CUDA cores (no dot for one row), the
    form of the dot kernels (`triton_linear`).

    Each K-step loads the tile's bytes once as [BLOCK_N, BLOCK_K/8] and x once as [BLOCK_K/8, 8]
    (16 contiguous bytes a thread), splits x's 8 columns apart in registers (`eight_columns`) and
    visits bit j of every byte against column j: 2-D tiles, no [BN, BK/8, 8] one. x lands in a
    [BLOCK_N, BLOCK_K/8] accumulator where the bit is set (a bit test and a predicated add per sign
    weight), reduced across the threads once after the loop. Compiled for sm_90 with the H200's
    blocks the loop is ~4 thread-instructions per sign weight (`bench/kernels_sass.py`) against ~16
    when every step expanded a [BN, BK/8, 8] tile and reduced it across the threads (shuffles and
    adds: the H200's ~1.2 T sign weights/s of 2026-12-04, docs/kernels.md).
    """
    BYTES: tl.constexpr = BLOCK_K // 8
    acc = tl.zeros((BLOCK_N, BYTES), dtype=tl.float32)  # Σ x where S = +1
    xsum = tl.zeros((BYTES,), dtype=tl.float32)  # Σ x, per byte column
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        offs_g = step * BYTES + tl.arange(0, BYTES)  # byte index within the row
        # bytes past the row end (K not a multiple of 8·BYTES) read as 0; x there is 0
        byte = tl.load(
            s_rows + offs_n[:, None] * stride_sn + offs_g[None, :],
            mask=keep_n[:, None] & (offs_g[None, :] * 8 < K),
            other=0,
        ).to(tl.int32)  # [BN, BYTES]
        offs_k = offs_g[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BYTES, 8]: bit j of byte b is column 8b + j
        x = tl.load(x_row + offs_k * stride_xk, mask=offs_k < K, other=0.0).to(tl.float32)
        if HAS_C:
            x = x * tl.load(c_row + offs_k, mask=offs_k < K, other=0.0)
        xsum += tl.sum(x, axis=1)
        cols = eight_columns(tl.reshape(x, (1, BYTES, 8)), 1, BYTES)  # each [1, BYTES]
        for j in tl.static_range(8):
            acc = tl.where((byte & (1 << j)) != 0, acc + cols[j], acc)
    return 2.0 * tl.sum(acc, axis=1) - tl.sum(xsum, axis=0)


# The kernel's arguments stay in their groups (pointers, sizes, strides, meta): fmt: skip.
@triton.jit
def _bitdelta_bgmv_kernel(
    # pointers
    x_ptr, s_ptr, alpha_ptr, y_ptr, slots_ptr, col_ptr, bounds_ptr,
    # sizes
    N, K,
    # strides
    stride_xm, stride_xk, stride_sv, stride_sn, stride_av, stride_an, stride_ym, stride_yn, stride_rm,
    stride_cv, stride_cg,
    # meta
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PLANES: tl.constexpr, HAS_COL: tl.constexpr,
    GROUPS: tl.constexpr,
):  # fmt: skip
    """y[r, n] += Σ_p α_v[n] · Σ_k x[r, k] · c_v[g(n), k] · S_v[n, k],  v = slots[r, p] ≥ 0 (p < PLANES);
    a row without any slot is untouched. The planes' terms are summed in fp32, then added to y once.

    x: [M, K]; s: uint8 [V, N, ceil(K/8)]; α: fp32 [V, N] (stride_an 0: one per matrix);
    slots: int32 [M, PLANES]; y: [M, N], updated in place. HAS_COL: column α's c: fp32
    [V, GROUPS, K], group g on outputs [bounds[g], bounds[g+1]) (int32 [GROUPS + 1]); without, c = 1.
    Program (r, pid_n) handles row r and BLOCK_N outputs; each sign byte is read once per plane
    (`_signed_row_sum`; no dot for one row). With column α's the tile's groups are visited in turn
    (a tile crosses a group boundary rarely), x scaled by the group's c in fp32.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    any_slot = tl.load(slots_ptr + pid_m * stride_rm) >= 0
    for p in tl.static_range(PLANES):
        v = tl.load(slots_ptr + pid_m * stride_rm + p).to(tl.int64)  # int64 before it multiplies a stride
        if p > 0:
            any_slot = any_slot | (v >= 0)
        if v >= 0:
            s_base = s_ptr + v * stride_sv
            alpha = tl.load(alpha_ptr + v * stride_av + offs_n * stride_an, mask=n_in, other=0.0)
            if HAS_COL:
                g_first, g_last = tile_col_groups(bounds_ptr, pid_n * BLOCK_N, N, BLOCK_N, GROUPS)
                for g in range(g_first, g_last + 1):
                    in_g = n_in & (offs_n >= tl.load(bounds_ptr + g)) & (offs_n < tl.load(bounds_ptr + g + 1))
                    c_row = col_ptr + v * stride_cv + g * stride_cg
                    acc = _signed_row_sum(
                        x_row, stride_xk, c_row, s_base, offs_n, stride_sn, in_g, K, True, BLOCK_N, BLOCK_K
                    )
                    total += tl.where(in_g, acc * alpha, 0.0)
            else:
                acc = _signed_row_sum(
                    x_row, stride_xk, x_row, s_base, offs_n, stride_sn, n_in, K, False, BLOCK_N, BLOCK_K
                )
                total += acc * alpha

    n_mask = n_in & any_slot  # a row without a slot: no load, no store
    y_ptrs = y_ptr + pid_m.to(tl.int64) * stride_ym + offs_n * stride_yn
    y_old = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_old + total).to(y_ptr.dtype.element_ty), mask=n_mask)


def bgmv_launch(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    row_slots: torch.Tensor,
    y: torch.Tensor,
    blocks: dict,
    col_alpha: torch.Tensor | None = None,
    bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch one program per (row, N-tile); shapes are checked by the caller.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)]; alpha_stack: fp32 [V, d_out] or [V, 1];
    row_slots: int32 [M, P] on x's device; y: [M, d_out]; col_alpha: None or fp32 [V, G, d_in] (unit
    column stride) with bounds: int32 [G + 1] on x's device. Returns y, updated in place.
    """
    M, K = x.shape
    N = signs_stack.shape[1]
    if M == 0 or N == 0:
        return y
    if blocks["BLOCK_K"] % 8:
        raise ValueError("bgmv BLOCK_K must be a multiple of 8")
    has_col = col_alpha is not None
    grid = (M, triton.cdiv(N, blocks["BLOCK_N"]))
    _bitdelta_bgmv_kernel[grid](
        x,
        signs_stack,
        alpha_stack,
        y,
        row_slots,
        col_alpha if has_col else alpha_stack,  # an unread pointer without column α's
        bounds if has_col else row_slots,
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
        row_slots.stride(0),
        col_alpha.stride(0) if has_col else 0,
        col_alpha.stride(1) if has_col else 0,
        BLOCK_N=blocks["BLOCK_N"],
        BLOCK_K=blocks["BLOCK_K"],
        PLANES=row_slots.shape[1],
        HAS_COL=has_col,
        GROUPS=col_alpha.shape[1] if has_col else 1,
        num_warps=blocks["num_warps"],
        num_stages=blocks["num_stages"],
    )
    return y
