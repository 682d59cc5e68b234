"""Decode attention over a paged KV pool, reading each sequence's blocks in place.

    paged_decode(q, k, v, tables, lens, block_size, window=None, *, scale=None, softcap=None, backend=None) -> out

q: [B, H, D], one query token per sequence (the last of its `lens[b]` tokens, whose K/V is already
in the pool); k, v: one layer of the pool, [rows, KV, D], token t of sequence b at row
tables[b, t // block_size] * block_size + t % block_size; H a multiple of KV (GQA); window: a
sliding window (the query sees keys t > lens[b] − 1 − window); scale: what q · k is multiplied by
(default 1/√D); softcap: scores become softcap · tanh(score / softcap) before the softmax (Gemma 2).
The softmax accumulates in fp32; out is [B, H, D] in q's dtype.

Backends (`bitdelta_kernels.backend_for`): Triton on CUDA (`triton_paged_decode.py`, also the interpreter),
the C kernel on CPU (`csrc/attention.h: bd_paged_decode`), both one pass over each sequence's
keys and values with an online softmax; `paged_decode_ref` is the torch reference (and the fallback
without either): it gathers every sequence's context into a padded tensor, which is what the
kernels avoid.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bitdelta_kernels.dispatch import HAVE_TRITON, backend_for

_KV_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # the C library's BD_W_*


def paged_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The reference: gather each context (padded to the longest), then one masked attention in fp32."""
    B, H, D = q.shape
    if B == 0:
        return torch.empty_like(q)
    lens_l = [int(x) for x in lens.tolist()]
    lmax = max(lens_l)
    pos = torch.arange(lmax, device=q.device)
    t = tables.to(torch.int64)
    rows = t[:, (pos // block_size).clamp(max=t.shape[1] - 1)] * block_size + pos % block_size  # [B, Lmax]
    n = torch.tensor(lens_l, device=q.device)
    ok = pos[None, :] < n[:, None]
    if window is not None:
        ok &= pos[None, :] > n[:, None] - 1 - window
    kd = k[rows].float().transpose(1, 2)  # [B, KV, Lmax, D]
    vd = v[rows].float().transpose(1, 2)
    scale = D**-0.5 if scale is None else scale
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q.float()[:, :, None, :], kd, vd, attn_mask=ok[:, None, None, :], enable_gqa=H != k.shape[1], scale=scale
        )
        return out[:, :, 0, :].to(q.dtype)
    G = H // k.shape[1]
    kd, vd = kd.repeat_interleave(G, dim=1), vd.repeat_interleave(G, dim=1)  # [B, H, Lmax, D]
    s = torch.einsum("bhd,bhld->bhl", q.float(), kd) * scale
    s = (torch.tanh(s / softcap) * softcap).masked_fill(~ok[:, None, :], float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(s, dim=-1), vd).to(q.dtype)


def _check(q, k, v, tables, lens, block_size) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"q must be [B, H, D] and k, v [rows, KV, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    B, H, D = q.shape
    if k.shape[2] != D or H % k.shape[1]:
        raise ValueError(f"q has {H} heads of {D}; k has {k.shape[1]} of {k.shape[2]} (H must be a multiple)")
    if tables.dim() != 2 or tables.shape[0] != B or lens.shape != (B,):
        raise ValueError(f"tables must be [{B}, max_blocks] and lens [{B}]")
    if tables.dtype != torch.int32 or lens.dtype != torch.int32:
        raise ValueError("tables and lens must be int32")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")


def paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    window: int | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """See the module docstring. `lens` must not exceed the tables' blocks (the kernels do not check
    on the device; the runner builds both from the scheduler's block tables)."""
    _check(q, k, v, tables, lens, block_size)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    work = int(q.shape[0]) * int(q.shape[1]) * int(q.shape[2]) * max(1, int(tables.shape[1])) * block_size
    path = backend_for(q.device, work, backend)
    if path == "triton" and HAVE_TRITON:
        from bitdelta_kernels.triton_paged_decode import paged_decode_triton

        return paged_decode_triton(q.contiguous(), k, v, tables, lens, block_size, window, scale, softcap)
    if path == "cpu" and q.device.type == "cpu" and k.dtype in _KV_DTYPE_CODE and k.is_contiguous():
        out = _paged_decode_cpu(q, k, v, tables, lens, block_size, window, scale, softcap=softcap)
        if out is not None:
            return out
    return paged_decode_ref(q, k, v, tables, lens, block_size, window, scale, softcap)


def _paged_decode_cpu(
    q, k, v, tables, lens, block_size, window, scale, lib=None, softcap: float | None = None
) -> torch.Tensor | None:
    """bd_paged_decode of `lib` (None: the process's library; a benchmark passes another build);
    None where there is no library."""
    from bitdelta_kernels.cpu_build import load_cpu_lib

    lib = lib or load_cpu_lib()
    if lib is None:
        return None
    B, H, D = q.shape
    qf = q.float().contiguous()
    out = torch.empty(B, H, D, dtype=torch.float32)
    t, n = tables.contiguous(), lens.contiguous()
    rc = lib.bd_paged_decode(
        qf.data_ptr(),
        B,
        H,
        k.shape[1],
        D,
        k.data_ptr(),
        v.data_ptr(),
        _KV_DTYPE_CODE[k.dtype],
        t.data_ptr(),
        t.shape[1],
        n.data_ptr(),
        block_size,
        window or 0,
        scale,
        softcap or 0.0,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("bd_paged_decode: out of memory")
    return out.to(q.dtype)


__all__ = ["paged_decode", "paged_decode_ref"]
