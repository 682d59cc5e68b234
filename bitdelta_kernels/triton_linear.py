"""Fused BitDelta linear: y = x · W_baseᵀ + Σ_p α_p ⊙ (x · S_pᵀ) in one pass over W, one over each plane's bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitdelta_kernels.bits import packed_cols
from bitdelta_kernels.configs import config_for, fit, interpreting, linear_blocks, num_sms, smem_limit

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# The kernel's arguments stay in their groups (pointers, sizes, strides, meta): fmt: skip.
@triton.jit
def _bitdelta_linear_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr, col_ptr, bounds_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sp, stride_sn, stride_ap, stride_an, stride_ym, stride_yn,
    stride_cp, stride_cg,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    PLANES: tl.constexpr, HAS_COL: tl.constexpr, GROUPS: tl.constexpr, COL_PRECISION: tl.constexpr,
    ONE: tl.constexpr,
):  # fmt: skip
    """y[m, n] = Σ_k x[m, k] · W[n, k]  +  α_n · Σ_k x[m, k] · S[n, k],
    S[n, k] = +1 if bit (k mod 8) of s[n, k // 8] else −1.

    x: [M, K]; W: [N, K]; s: uint8 [N, ceil(K/8)]; α: fp32, α_n = alpha[n · stride_an]
    (stride 0: one α per matrix); y: [M, N]. Program (pid, pid_k) computes a
    BLOCK_M × BLOCK_N tile over the pid_k-th of SPLIT_K slices of K.

    Numerics: the delta is its OWN fp32-accumulated term, never merged into W. Real
    deltas are far below W's rounding step (α ≈ 2e-4–7e-4 against |W| ≈ 0.15, whose
    bf16 spacing is ≈ 1e-3): W + α·S rounded to bf16 is W. With S = 2B − 1 (B ∈ {0, 1}),
        Σ_k x·S = 2 · Σ_k x·B − Σ_k x,
    so one dot of x with B (exact in fp16/bf16/fp32) and a row sum of x give it, and
    the result equals the mixed-variant path (base GEMM + batched delta) whatever the batch.

    Bits: each K-step expands the tile's sign bits once for all BLOCK_M rows into the bit
    patterns of B ∈ {0, 1.0} in the dot's dtype (ONE: 1.0's pattern), see `sign_dot`.
    With SPLIT_K > 1, y is an fp32 buffer the slices atomically add into.

    Planes: s holds PLANES sign planes (plane stride stride_sp, α's stride_ap) of one variant,
    y += Σ_p α_p ⊙ (x · S_pᵀ). Plane 0 rides on W's pass as above; each further plane is a pass
    of its own over the same K slice, reading x (from cache) and its bits once, its term
    added in fp32. HAS_COL: column α's c: fp32 [PLANES, GROUPS, K] (group g on outputs
    [bounds[g], bounds[g+1]), int32 [GROUPS + 1]), term α_p ⊙ ((x ⊙ c_p,g) · S_pᵀ); then W's
    pass is the base alone and every plane has its own pass, the tile's groups in turn, x ⊙ c in
    fp32 dotted in COL_PRECISION (tf32x3 on a GPU: about fp32's accuracy).
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # grouped tile order: GROUP_M row tiles share each W column tile while it is in L2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N

    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_first = pid_k * k_steps * BLOCK_K
    acc_w = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x · Wᵀ
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x · Bᵀ
    xacc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # Σ_k x, reduced across threads after the loop
    # range over a step count, not range(0, K, BLOCK_K): the latter breaks triton 3.6's interpreter with numpy ≥ 2.4
    for step in range(0, k_steps):
        k0 = k_first + step * BLOCK_K  # a multiple of 8: the tile starts on a byte
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BM, BK]
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BN, BK]
        if HAS_COL:  # the base alone: every plane takes its own pass below
            if DOT_FP32:
                acc_w += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
            else:
                acc_w += tl.dot(x, tl.trans(w))
        else:
            if DOT_FP32:
                # fp32 inputs (TF32 if torch allows it), and bf16 in the interpreter, whose bf16
                # dot is wrong: bf16 values and 0/1 are exact in fp32, so this is the GPU's math
                acc_w += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
            else:
                acc_w += tl.dot(x, tl.trans(w))
            acc_b = sign_dot(
                acc_b, x, s_ptr, offs_n, stride_sn, n_mask, k0, K, ONE, DOT_FP32, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K
            )
            xacc += x.to(tl.float32)

    xsum = tl.sum(xacc, axis=1)
    if HAS_COL:
        acc = acc_w
        g_first, g_last = tile_col_groups(bounds_ptr, pid_n * BLOCK_N, N, BLOCK_N, GROUPS)
        for p in tl.static_range(PLANES):
            alpha = tl.load(alpha_ptr + p * stride_ap + offs_n * stride_an, mask=n_mask, other=0.0)
            for g in range(g_first, g_last + 1):
                in_g = n_mask & (offs_n >= tl.load(bounds_ptr + g)) & (offs_n < tl.load(bounds_ptr + g + 1))
                c_row = col_ptr + p * stride_cp + g * stride_cg
                acc_c = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (x ⊙ c) · Bᵀ
                xacc_c = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # Σ_k x ⊙ c
                for step in range(0, k_steps):
                    k0 = k_first + step * BLOCK_K
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    k_mask = offs_k < K
                    x = tl.load(
                        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0,
                    ).to(tl.float32)
                    xc = x * tl.load(c_row + offs_k, mask=k_mask, other=0.0)[None, :]
                    acc_c = sign_dot(  # fp32 1.0: x ⊙ c dots in fp32
                        acc_c, xc, s_ptr + p * stride_sp, offs_n, stride_sn, in_g, k0, K,
                        0x3F800000, True, COL_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                    xacc_c += xc
                xsum_c = tl.sum(xacc_c, axis=1)
                acc += tl.where(in_g[None, :], (2.0 * acc_c - xsum_c[:, None]) * alpha[None, :], 0.0)
    else:
        # padded rows have α = 0 and padded columns x = 0: neither adds anything
        alpha = tl.load(alpha_ptr + offs_n * stride_an, mask=n_mask, other=0.0)  # [BN] fp32
        acc = acc_w + alpha[None, :] * (2.0 * acc_b - xsum[:, None])
        for p in tl.static_range(1, PLANES):  # further planes: x (from cache) and their bits, once each
            acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(0, k_steps):
                k0 = k_first + step * BLOCK_K
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < K
                x = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
                acc_b = sign_dot(
                    acc_b, x, s_ptr + p * stride_sp, offs_n, stride_sn, n_mask, k0, K,
                    ONE, DOT_FP32, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                )  # fmt: skip
            alpha = tl.load(alpha_ptr + p * stride_ap + offs_n * stride_an, mask=n_mask, other=0.0)
            acc += alpha[None, :] * (2.0 * acc_b - xsum[:, None])  # Σx of this K slice: the pass above's
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_mask)


def _check(x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor) -> None:
    if x.dim() != 2 or w_base.dim() != 2 or x.shape[1] != w_base.shape[1]:
        raise ValueError(f"x [M, d_in] and w_base [d_out, d_in] expected, got {tuple(x.shape)}, {tuple(w_base.shape)}")
    if x.dtype not in _DTYPES or w_base.dtype != x.dtype:
        raise ValueError(f"x and w_base must share one of {_DTYPES}, got {x.dtype}, {w_base.dtype}")
    d_out, d_in = w_base.shape
    lead = tuple(signs.shape[:-2])
    if signs.dtype != torch.uint8 or signs.dim() not in (2, 3) or tuple(signs.shape[-2:]) != (d_out, packed_cols(d_in)):
        raise ValueError(
            f"signs must be uint8 [{d_out}, {packed_cols(d_in)}] or [K, {d_out}, {packed_cols(d_in)}], "
            f"got {signs.dtype} {tuple(signs.shape)}"
        )
    if signs.stride(-1) != 1:
        raise ValueError("signs must have unit column stride")
    if alpha.dim() != len(lead) + 1 or tuple(alpha.shape[:-1]) != lead or alpha.shape[-1] not in (1, d_out):
        raise ValueError(f"alpha must be [{d_out}] or [1] per plane, got {tuple(alpha.shape)} for signs {lead}")
    if not (x.device == w_base.device == signs.device == alpha.device):
        raise ValueError("x, w_base, signs and alpha must be on one device")


def uses_fp32_dot(dtype: torch.dtype) -> bool:
    """fp32 inputs dot in fp32; bf16 too in the interpreter (its bf16 dot multiplies raw bits)."""
    return dtype == torch.float32 or (interpreting() and dtype == torch.bfloat16)


def col_precision(device: torch.device) -> str:
    """The fp32 dot of x ⊙ c (column α's): tf32x3 (three TF32 products, about fp32's accuracy) on a
    GPU, "ieee" in the interpreter."""
    return "tf32x3" if device.type == "cuda" else "ieee"


_ONE_BITS = {torch.float32: 0x3F800000, torch.bfloat16: 0x3F80, torch.float16: 0x3C00}  # 1.0's bit pattern


def dot_one(dtype: torch.dtype) -> int:
    """`sign_bits`' ONE for the dot of x in `dtype` with the sign tile: 1.0's bit pattern in the
    dot's operand dtype (fp32's where the dot runs in fp32)."""
    return _ONE_BITS[torch.float32 if uses_fp32_dot(dtype) else dtype]


@triton.jit
def sign_bits(
    s_rows, offs_n, stride_sn, keep_n, k0, K, ONE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """int32 [BLOCK_N, BLOCK_K]: ONE where bit k0 + i of sign row n is set, else 0, for the rows
    `s_rows + offs_n · stride_sn` (rows outside keep_n read 0) and columns i (k0 a multiple of 8;
    bit k is bit k mod 8 of byte k // 8). ONE is 1.0's bit pattern in the dot's dtype, so a bitcast
    gives B ∈ {0, 1.0}. Bits past K may read 1; x is 0 there.

    The tile's bytes load once as [BLOCK_N, BLOCK_K/8] and expand in registers: `(byte & 2^j) ·
    (ONE >> j)` is ONE or 0 (1.0's pattern has ≥ 7 trailing zeros), two integer ops per weight,
    then [BLOCK_N, BLOCK_K/8, 8] reshapes to [BLOCK_N, BLOCK_K] (bit j of byte b is column 8b + j).
    A byte loaded per column instead (index k // 8, shift k mod 8: no reshape) measured 1.2-2.3x
    slower on an H200 in every kernel (docs/kernels.md, "On the GPU").
    """
    offs_g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    byte = tl.load(
        s_rows + offs_n[:, None] * stride_sn + offs_g[None, :],
        mask=keep_n[:, None] & (offs_g[None, :] * 8 < K),
        other=0,
    ).to(tl.int32)  # [BN, BK/8]
    j = tl.arange(0, 8)
    shifted_one = tl.full((8,), ONE, tl.int32) >> j
    return tl.reshape((byte[:, :, None] & (1 << j)[None, None, :]) * shifted_one[None, None, :], (BLOCK_N, BLOCK_K))


@triton.jit
def eight_columns(x, R: tl.constexpr, C: tl.constexpr):
    """The 8 slices x[:, :, j] of x [R, C, 8], each [R, C]: j = 4a + 2b + c of [R, C, 2, 2, 2] split
    on c, then b, then a (split's halves lie in one thread: register moves, no shared memory)."""
    even, odd = tl.split(tl.reshape(x, (R, C, 4, 2)))  # j = 0, 2, 4, 6 | 1, 3, 5, 7
    c04, c26 = tl.split(tl.reshape(even, (R, C, 2, 2)))
    c15, c37 = tl.split(tl.reshape(odd, (R, C, 2, 2)))
    c0, c4 = tl.split(c04)
    c2, c6 = tl.split(c26)
    c1, c5 = tl.split(c15)
    c3, c7 = tl.split(c37)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _pattern_dot(acc, x, pat, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x · Bᵀ, B given by its values' bit patterns `pat` (integers): fp32 dots (DOT_FP32,
    PRECISION) or dots in x's 16-bit dtype."""
    if DOT_FP32:
        acc += tl.dot(x.to(tl.float32), tl.trans(pat.to(tl.float32, bitcast=True)), input_precision=PRECISION)
    else:
        acc += tl.dot(x, tl.trans(pat.to(tl.int16).to(x.dtype, bitcast=True)))
    return acc


@triton.jit
def sign_dot(
    acc, x, s_rows, offs_n, stride_sn, keep_n, k0, K,
    ONE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc + x · Bᵀ in fp32 [BLOCK_M, BLOCK_N]: x [BLOCK_M, BLOCK_K] (columns k0 + i), B ∈ {0, 1}
    the sign bits of the rows `s_rows + offs_n · stride_sn` (rows outside keep_n read 0), as the
    kernels' dots take them: in fp32 (DOT_FP32, PRECISION; ONE: fp32 1.0's pattern) or in x's
    16-bit dtype (ONE: its 1.0's pattern).

    From a tile depth of 128 on, the tile's bytes load once as [BLOCK_N, BLOCK_K/8] and x splits
    into its 8 columns of every byte (x[:, 8b + j], `eight_columns`, in registers); bit j of every
    byte is then one dot of depth BLOCK_K/8 against x's column j: eight dots, no [BN, BK/8, 8]
    tile and no reshape of the expanded bits, which went through shared memory element by element
    (16-bit patterns built in 16-bit integers). Compiled for sm_90 with the H200's blocks
    (`bench/kernels_sass.py`): SGMV's loop 6.3 thread-instructions per sign weight instead of 9.0,
    19 shared-memory operations a step instead of 117; the fused linear's at decode 7.1 per weight
    instead of 9.2, 52 instead of 136. Shallower tiles (a 16-bit dot's depth is at least 16)
    expand the bits as [BLOCK_N, BLOCK_K] (`sign_bits`).
    """
    if BLOCK_K >= 128:
        offs_g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        byte = tl.load(
            s_rows + offs_n[:, None] * stride_sn + offs_g[None, :],
            mask=keep_n[:, None] & (offs_g[None, :] * 8 < K),
            other=0,
        )  # [BN, BK/8]
        if DOT_FP32:
            xd = x.to(tl.float32)
            bits = byte.to(tl.int32)
        else:
            xd = x
            bits = byte.to(tl.int16)  # the 16-bit patterns in 16-bit integers
        xs = eight_columns(tl.reshape(xd, (BLOCK_M, BLOCK_K // 8, 8)), BLOCK_M, BLOCK_K // 8)
        for j in tl.static_range(8):
            acc = _pattern_dot(acc, xs[j], (bits & (1 << j)) * (ONE >> j), DOT_FP32, PRECISION)
    else:
        pat = sign_bits(s_rows, offs_n, stride_sn, keep_n, k0, K, ONE, BLOCK_N, BLOCK_K)
        acc = _pattern_dot(acc, x, pat, DOT_FP32, PRECISION)
    return acc


@triton.jit
def tile_col_groups(bounds_ptr, n_first, N, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """(g_first, g_last): the column-α groups that the outputs [n_first, min(n_first + BLOCK_N, N))
    of a tile touch, group g on [bounds[g], bounds[g + 1]) (bounds: int32 [GROUPS + 1])."""
    n_last = tl.minimum(n_first + BLOCK_N, N) - 1
    g_first = 0
    g_last = 0
    for j in tl.static_range(1, GROUPS):
        b = tl.load(bounds_ptr + j)
        g_first += (n_first >= b).to(tl.int32)
        g_last += (n_last >= b).to(tl.int32)
    return g_first, g_last


def launch_blocks(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device, config: dict | None = None) -> dict:
    """The blocks a call of these sizes launches with: bucket by M, tiles and split-K by N and K,
    stages lowered if the resource model says they do not fit this GPU's shared memory."""
    cfg = config_for(device)
    blocks = linear_blocks(cfg, M, N, K, num_sms(device), config)
    if device.type == "cuda":
        es = 4 if uses_fp32_dot(dtype) else dtype.itemsize
        blocks = fit("linear", blocks, es, smem_limit(cfg, device))
    return blocks


def bitdelta_linear_triton(
    x: torch.Tensor,
    w_base: torch.Tensor,
    signs: torch.Tensor,
    alpha: torch.Tensor,
    config: dict | None = None,
    col_alpha: torch.Tensor | None = None,
    bounds: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x · W_baseᵀ + Σ_p α_p ⊙ ((x ⊙ c_p) · S_pᵀ) with the fused Triton kernel.

    x: [M, d_in] fp16/bf16/fp32; w_base: [d_out, d_in] same dtype; signs: uint8 [d_out, ceil(d_in/8)]
    or [K, d_out, ceil(d_in/8)] (K planes); alpha: [d_out] or [1] ([K, d_out] or [K, 1] with K planes);
    col_alpha: None (c = 1) or fp32 [K, G, d_in] with bounds: int32 [G + 1] on x's device (the row
    bounds of the groups) -> y: [M, d_out] in x.dtype. `config` overrides the block sizes (tests, tuning).
    """
    _check(x, w_base, signs, alpha)
    planes = signs if signs.dim() == 3 else signs[None]
    M, K = x.shape
    N = w_base.shape[0]
    has_col = col_alpha is not None
    blocks = launch_blocks(M, N, K, torch.float32 if has_col else x.dtype, x.device, config)  # x ⊙ c: fp32 tiles
    if blocks["BLOCK_K"] % 8:
        raise ValueError("BLOCK_K must be a multiple of 8 (a K-step covers whole sign bytes)")
    alpha32 = alpha.to(torch.float32).reshape(planes.shape[0], -1).contiguous()
    if has_col and (tuple(col_alpha.shape[::2]) != (planes.shape[0], K) or bounds is None):
        raise ValueError(f"col_alpha must be [{planes.shape[0]}, G, {K}] with the groups' bounds")
    n_tiles = triton.cdiv(M, blocks["BLOCK_M"]) * triton.cdiv(N, blocks["BLOCK_N"])
    split_k = blocks["SPLIT_K"]
    if split_k > 1:
        y = torch.zeros(M, N, device=x.device, dtype=torch.float32)  # the K slices add into it
    elif interpreting() and x.dtype == torch.bfloat16:
        # the interpreter truncates fp32→bf16 stores; the GPU rounds to nearest, as torch does:
        # store fp32 and let torch round, so CPU runs see the GPU's numbers
        y = torch.empty(M, N, device=x.device, dtype=torch.float32)
    else:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y.to(x.dtype)
    precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    _bitdelta_linear_kernel[(n_tiles, split_k)](
        x,
        w_base,
        planes,
        alpha32,
        y,
        col_alpha if has_col else alpha32,  # an unread pointer without column α's
        bounds if has_col else alpha32,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w_base.stride(0),
        w_base.stride(1),
        planes.stride(0),
        planes.stride(1),
        alpha32.stride(0),
        0 if alpha32.shape[1] == 1 else 1,
        y.stride(0),
        y.stride(1),
        col_alpha.stride(0) if has_col else 0,
        col_alpha.stride(1) if has_col else 0,
        BLOCK_M=blocks["BLOCK_M"],
        BLOCK_N=blocks["BLOCK_N"],
        BLOCK_K=blocks["BLOCK_K"],
        GROUP_M=blocks["GROUP_M"],
        SPLIT_K=split_k,
        DOT_FP32=uses_fp32_dot(x.dtype),
        PRECISION=precision,
        PLANES=planes.shape[0],
        HAS_COL=has_col,
        GROUPS=col_alpha.shape[1] if has_col else 1,
        COL_PRECISION=col_precision(x.device),
        ONE=dot_one(x.dtype),
        num_warps=blocks["num_warps"],
        num_stages=blocks["num_stages"],
    )
    return y if y.dtype == x.dtype else y.to(x.dtype)
