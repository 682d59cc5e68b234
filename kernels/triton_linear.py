"""Fused BitDelta linear: y = x · (W_base + α ⊙ S)ᵀ without W_eff in memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitdelta.bits import packed_cols
from kernels.configs import config_for, interpreting, num_sms

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    """y[m, n] = Σ_k x[m, k] · (W[n, k] + α_n · S[n, k]),  S[n, k] = +1 if bit (k mod 8) of s[n, k // 8] else −1.

    x: [M, K]; W: [N, K]; s: uint8 [N, ceil(K/8)]; α: fp32, α_n = alpha[n · stride_an]
    (stride 0: one α per matrix); y: [M, N]. Program (pid, pid_k) computes a
    BLOCK_M × BLOCK_N tile over the pid_k-th of SPLIT_K slices of K; each K-step
    loads a W tile and the matching sign bytes, merges them in registers (fp32)
    and feeds ONE tensor-core dot, so prefill costs one GEMM, not two. With
    SPLIT_K > 1, y is an fp32 buffer the slices atomically add into.
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
    alpha = tl.load(alpha_ptr + offs_n * stride_an, mask=n_mask, other=0.0)  # [BN] fp32
    pos = alpha[None, :]
    neg = -alpha[None, :]

    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_first = pid_k * k_steps * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, k_steps):
        offs_k = k_first + step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        # x: [BM, BK]; W tile and its bits transposed: [BK, BN]
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        wk_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=wk_mask, other=0.0)
        byte = tl.load(s_ptr + offs_n[None, :] * stride_sn + (offs_k[:, None] // 8), mask=wk_mask, other=0)
        bit = (byte.to(tl.int32) >> (offs_k[:, None] % 8)) & 1
        # merged in fp32 (no int→bf16 cast: the interpreter gets it wrong); padded
        # columns merge to −α but meet x = 0, padded rows have α = 0
        w_eff = w.to(tl.float32) + tl.where(bit != 0, pos, neg)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w_eff, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w_eff.to(x.dtype))

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


def _pick_split_k(cfg: dict, blocks: dict, n_tiles: int, K: int, device: torch.device) -> int:
    split = blocks["SPLIT_K"]
    if split != "auto":
        return int(split)
    want = cfg["target_ctas_per_sm"] * num_sms(device)
    if want <= n_tiles:
        return 1
    max_split = max(1, K // max(cfg["min_k_per_split"], blocks["BLOCK_K"]))
    return max(1, min(max_split, want // n_tiles))


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
    cfg = config_for(x.device)
    blocks = dict(cfg["linear_decode"] if M <= cfg["decode_max_m"] else cfg["linear_prefill"])
    if config:
        blocks.update(config)
    alpha32 = alpha.to(torch.float32).contiguous()
    n_tiles = triton.cdiv(M, blocks["BLOCK_M"]) * triton.cdiv(N, blocks["BLOCK_N"])
    split_k = _pick_split_k(cfg, blocks, n_tiles, K, x.device)
    if split_k > 1:
        y = torch.zeros(M, N, device=x.device, dtype=torch.float32)  # the K slices add into it
    else:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y.to(x.dtype)
    # the interpreter's bf16 dot multiplies raw bits: dot in fp32 there (exact); fp32 follows torch's TF32 switch
    dot_fp32 = x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16)
    precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    _bitdelta_linear_kernel[(n_tiles, split_k)](
        x, w_base, signs, alpha32, y,
        M, N, K,
        x.stride(0), x.stride(1), w_base.stride(0), w_base.stride(1), signs.stride(0),
        0 if alpha32.numel() == 1 else 1, y.stride(0), y.stride(1),
        BLOCK_M=blocks["BLOCK_M"], BLOCK_N=blocks["BLOCK_N"], BLOCK_K=blocks["BLOCK_K"],
        GROUP_M=blocks["GROUP_M"], SPLIT_K=split_k, DOT_FP32=dot_fp32, PRECISION=precision,
        num_warps=blocks["num_warps"], num_stages=blocks["num_stages"],
    )  # fmt: skip
    return y if y.dtype == x.dtype else y.to(x.dtype)
