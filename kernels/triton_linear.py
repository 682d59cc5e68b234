"""Fused BitDelta linear: y = x · W_baseᵀ + α ⊙ (x · Sᵀ) in one pass over W and the sign bits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.bits import packed_cols
from kernels.configs import config_for, fit, interpreting, linear_blocks, num_sms, smem_limit

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# The kernel's arguments stay in their groups (pointers, sizes, strides, meta): fmt: skip.
@triton.jit
def _bitdelta_linear_kernel(
    # pointers
    x_ptr, w_ptr, s_ptr, alpha_ptr, y_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_an, stride_ym, stride_yn,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
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

    Bits: each K-step loads the sign bytes of the tile ONCE as [BLOCK_N, BLOCK_K/8]
    (not one byte per column) and expands them in registers for all BLOCK_M rows:
    `(byte & 2^j) · (one >> j)` is the bit pattern of B ∈ {0, 1.0} in the dot's dtype
    (the bit pattern of 1.0 has ≥ 7 trailing zeros), two integer ops per weight and a
    free bitcast; [BLOCK_N, BLOCK_K/8, 8] reshapes to [BLOCK_N, BLOCK_K] (bit j of byte b
    is column 8b + j). With SPLIT_K > 1, y is an fp32 buffer the slices atomically add into.
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

    BYTES: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    bitval = 1 << tl.arange(0, 8)  # [8] int32: the mask of bit j
    if DOT_FP32:
        one = (0x3F800000 >> tl.arange(0, 8)).to(tl.int32)  # fp32 1.0 >> j
    elif x_ptr.dtype.element_ty == tl.bfloat16:
        one = (0x3F80 >> tl.arange(0, 8)).to(tl.int32)  # bf16 1.0 >> j
    else:
        one = (0x3C00 >> tl.arange(0, 8)).to(tl.int32)  # fp16 1.0 >> j

    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_first = pid_k * k_steps * BLOCK_K
    acc_w = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x · Wᵀ
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x · Bᵀ
    xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # Σ_k x
    # range over a step count, not range(0, K, BLOCK_K): the latter breaks triton 3.6's interpreter with numpy ≥ 2.4
    for step in range(0, k_steps):
        k0 = k_first + step * BLOCK_K  # a multiple of 8: the tile starts on a byte
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        offs_g = k0 // 8 + tl.arange(0, BYTES)  # the tile's byte columns
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
        # bits past K (last byte of a ragged row) may be 1; x is 0 there
        byte = tl.load(
            s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :],
            mask=n_mask[:, None] & (offs_g[None, :] * 8 < K),
            other=0,
        ).to(tl.int32)  # [BN, BYTES]
        pat = (byte[:, :, None] & bitval[None, None, :]) * one[None, None, :]  # [BN, BYTES, 8]
        pat = tl.reshape(pat, (BLOCK_N, BLOCK_K))
        if DOT_FP32:
            # fp32 inputs (TF32 if torch allows it), and bf16 in the interpreter, whose bf16
            # dot is wrong: bf16 values and 0/1 are exact in fp32, so this is the GPU's math
            b = pat.to(tl.float32, bitcast=True)
            xf = x.to(tl.float32)
            acc_w += tl.dot(xf, tl.trans(w.to(tl.float32)), input_precision=PRECISION)
            acc_b += tl.dot(xf, tl.trans(b), input_precision=PRECISION)
            xsum += tl.sum(xf, axis=1)
        else:
            b = pat.to(tl.int16).to(x.dtype, bitcast=True)
            acc_w += tl.dot(x, tl.trans(w))
            acc_b += tl.dot(x, tl.trans(b))
            xsum += tl.sum(x.to(tl.float32), axis=1)

    # padded rows have α = 0 and padded columns x = 0: neither adds anything
    alpha = tl.load(alpha_ptr + offs_n * stride_an, mask=n_mask, other=0.0)  # [BN] fp32
    acc = acc_w + alpha[None, :] * (2.0 * acc_b - xsum[:, None])
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
    if signs.dtype != torch.uint8 or tuple(signs.shape) != (d_out, packed_cols(d_in)):
        raise ValueError(f"signs must be uint8 [{d_out}, {packed_cols(d_in)}], got {signs.dtype} {tuple(signs.shape)}")
    if signs.stride(1) != 1:
        raise ValueError("signs must have unit column stride")
    if alpha.dim() != 1 or alpha.shape[0] not in (1, d_out):
        raise ValueError(f"alpha must be [{d_out}] or [1], got {tuple(alpha.shape)}")
    if not (x.device == w_base.device == signs.device == alpha.device):
        raise ValueError("x, w_base, signs and alpha must be on one device")


def uses_fp32_dot(dtype: torch.dtype) -> bool:
    """fp32 inputs dot in fp32; bf16 too in the interpreter (its bf16 dot multiplies raw bits)."""
    return dtype == torch.float32 or (interpreting() and dtype == torch.bfloat16)


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
    x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor, config: dict | None = None
) -> torch.Tensor:
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ) with the fused Triton kernel.

    x: [M, d_in] fp16/bf16/fp32; w_base: [d_out, d_in] same dtype; signs: uint8 [d_out, ceil(d_in/8)];
    alpha: [d_out] or [1] -> y: [M, d_out] in x.dtype. `config` overrides the block sizes (tests, tuning).
    """
    _check(x, w_base, signs, alpha)
    M, K = x.shape
    N = w_base.shape[0]
    blocks = launch_blocks(M, N, K, x.dtype, x.device, config)
    if blocks["BLOCK_K"] % 8:
        raise ValueError("BLOCK_K must be a multiple of 8 (a K-step covers whole sign bytes)")
    alpha32 = alpha.to(torch.float32).contiguous()
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
        signs,
        alpha32,
        y,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w_base.stride(0),
        w_base.stride(1),
        signs.stride(0),
        0 if alpha32.numel() == 1 else 1,
        y.stride(0),
        y.stride(1),
        BLOCK_M=blocks["BLOCK_M"],
        BLOCK_N=blocks["BLOCK_N"],
        BLOCK_K=blocks["BLOCK_K"],
        GROUP_M=blocks["GROUP_M"],
        SPLIT_K=split_k,
        DOT_FP32=uses_fp32_dot(x.dtype),
        PRECISION=precision,
        num_warps=blocks["num_warps"],
        num_stages=blocks["num_stages"],
    )
    return y if y.dtype == x.dtype else y.to(x.dtype)
