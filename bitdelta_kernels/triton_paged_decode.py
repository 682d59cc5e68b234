"""Paged decode attention: one query token per sequence against its KV blocks, read in place.

One program per (sequence, KV head): the group of query heads that share the KV head (GQA) is
handled together, so every key and value row is loaded once. The blocks of the sequence's
table are walked in order with an online softmax in fp32 (running max, sum and the weighted sum
of values), so nothing is gathered or padded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The kernel's arguments stay in their groups (pointers, sizes, strides, meta): fmt: skip.
@triton.jit
def _paged_decode_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr,
    # sizes
    G, D, block_size, window, scale, softcap,
    # strides
    stride_qb, stride_qh, stride_kr, stride_kh, stride_tb, stride_ob, stride_oh,
    # meta
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """out[b, h] = Σ_j softmax_j(cap(q[b, h] · k_j · scale)) v_j over the keys j the query sees; cap: the
    identity, or softcap · tanh(s / softcap) with HAS_SOFTCAP (Gemma 2).

    q, out: [B, H, D]; k, v: [rows, KV, D], token t of sequence b at row table[b, t // bs] * bs + t % bs;
    lens[b]: its length (the query is token lens[b] − 1); window > 0: keys t > lens[b] − 1 − window only.
    Program (b, g) serves query heads g·G … g·G + G − 1 (KV head g).
    """
    b = tl.program_id(0)
    g = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_T)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = g * G + offs_g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [G, D]
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(n - window, 0)
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for j in range(lo // block_size, tl.cdiv(n, block_size)):
        blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + j).to(tl.int64)
        pos = j * block_size + offs_t
        t_mask = (offs_t < block_size) & (pos < n) & (pos >= lo)
        rows = blk * block_size + offs_t
        kv_off = rows[:, None] * stride_kr + g * stride_kh + offs_d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, T]
        if HAS_SOFTCAP:  # tanh(x) = 1 − 2 / (e^{2x} + 1), exact at both ends in fp32
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        corr = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        s = s * corr + tl.sum(p, axis=1)
        acc = acc * corr[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / s[:, None]
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    window: int | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Launch one program per (sequence, KV head); shapes are checked by the caller (bitdelta_kernels.paged_attention).

    q: [B, H, D]; k, v: [rows, KV, D] (unit stride in D); tables: int32 [B, max_blocks]; lens: int32 [B]
    -> [B, H, D] in q's dtype.
    """
    B, H, D = q.shape
    KV = k.shape[1]
    out = torch.empty_like(q)
    if B == 0:
        return out
    G = H // KV
    _paged_decode_kernel[(B, KV)](
        q,
        k,
        v,
        tables,
        lens,
        out,
        G,
        D,
        block_size,
        window or 0,
        scale,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_G=triton.next_power_of_2(G),
        BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(D),
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )
    return out
