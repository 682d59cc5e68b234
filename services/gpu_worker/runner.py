"""The model step: one ragged ("packed tokens") forward over a batch that mixes
sequences of several variants and of the base.

    x: [N, dim]   the new tokens of every scheduled sequence, concatenated

For every linear layer the base GEMM runs ONCE over all N rows; then one
`bitdelta_delta_batched` launch adds each row's delta, selected by
`row_slot[r]` (−1 = base row) from the slot stacks. A batch whose rows all
belong to one variant uses the fused `bitdelta_linear` instead. Attention runs
per sequence against its own blocks of the paged KV pool (decode rows of all
sequences in one padded call).

This module sees tensors and slot indices only; who runs (ids, budgets) is the
scheduler's business, which delta sits in which slot is the manager's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bitdelta.bits import unpack_signs
from kernels import bitdelta_delta_batched, bitdelta_linear, plan_batch
from bitdelta.model import ModelArgs, apply_rope, load_model, rope_tables
from services.gpu_worker.slots import GROUPS, NORMS, SlotTensors


@dataclass
class SeqWork:
    """One sequence's part of a step (built by the engine from scheduler output).

    tokens: the new token ids; start: position of tokens[0]; slot: delta slot
    (−1 = base); blocks: its KV block table; want_logits: sample after this step.
    """

    tokens: list[int]
    start: int
    slot: int
    blocks: list[int]
    want_logits: bool


@dataclass
class BaseWeights:
    """The base, resident once. Projections of a group are fused along d_out (see slots.GROUPS)."""

    embed: torch.Tensor  # [vocab, dim]
    layers: list[dict[str, torch.Tensor]]  # group -> [d_out_g, d_in_g]
    norms: list[tuple[torch.Tensor, torch.Tensor]]  # (input, post-attention) [dim]
    final_norm: torch.Tensor  # [dim]
    head: torch.Tensor  # [vocab, dim]; the embedding itself when tied

    @classmethod
    def load(cls, ckpt, dtype: torch.dtype, device: torch.device) -> tuple["BaseWeights", ModelArgs]:
        model = load_model(ckpt, dtype=dtype, device="cpu")
        args = model.args
        layers, norms = [], []
        for blk in model.model.layers:
            fused = {}
            for g, members in GROUPS.items():
                parts = [getattr(getattr(blk, mod), name) for mod, name in members]
                fused[g] = torch.cat([p.weight for p in parts]).to(device).contiguous()
                for p in parts:  # free the host copy layer by layer: peak stays ~ one base
                    p.weight = None
            layers.append(fused)
            norms.append((blk.input_layernorm.weight.to(device), blk.post_attention_layernorm.weight.to(device)))
        embed = model.model.embed_tokens.weight.to(device)
        head = embed if args.tie_embeddings else model.lm_head.weight.to(device)
        final = model.model.norm.weight.to(device)
        del model
        return cls(embed, layers, norms, final, head), args

    @property
    def nbytes(self) -> int:
        ts = [self.embed, self.final_norm] + [t for d in self.layers for t in d.values()]
        ts += [t for pair in self.norms for t in pair]
        if self.head is not self.embed:
            ts.append(self.head)
        return sum(t.numel() * t.element_size() for t in ts)


class KVPool:
    """Paged KV cache: k, v [n_layers, n_blocks * block_size, n_kv_heads, head_dim].

    Token j of a sequence with block table B lives at row B[j // bs] * bs + j % bs.
    Which blocks belong to whom is the scheduler's (`kv.BlockAllocator`).
    """

    def __init__(self, args: ModelArgs, n_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.block_size, self.n_blocks = block_size, n_blocks
        shape = (args.n_layers, n_blocks * block_size, args.n_kv_heads, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
        return 2 * args.n_layers * args.n_kv_heads * args.head_dim * dtype.itemsize

    def rows(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Pool rows of positions [start, end) of a sequence with block table `blocks` (CPU int64)."""
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class StepMeta:
    """Per-step index metadata (vLLM's punica wrapper role): built once, read by every layer."""

    tokens: torch.Tensor  # [N] int64
    cos: torch.Tensor  # [N, 1, hd]
    sin: torch.Tensor
    row_slot: torch.Tensor  # [N] int32, −1 = base
    norm_idx: torch.Tensor | None  # [N] int64 into the norm stacks; None: all rows share `single_norm`
    single_norm: int
    any_delta: bool
    single_slot: int | None  # all rows belong to this one variant: the fused kernel serves
    write_rows: torch.Tensor  # [N] pool rows the new k/v go to
    decode_rows: torch.Tensor | None  # [B] rows of x that are single-token decodes
    decode_gather: torch.Tensor | None  # [B, Lmax] pool rows of their contexts (padded)
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (row0, n, pool rows [L], mask [n, L])
    logit_rows: torch.Tensor  # [R] rows whose logits are wanted
    logit_slots: list[int]  # [R] their slots
    plan: object = None  # kernels.BatchPlan: rows grouped by slot, shared by every layer of the step


class ModelRunner:
    """Holds the base weights, the slot stacks and the KV pool; runs steps."""

    def __init__(self, base: BaseWeights, args: ModelArgs, slots: SlotTensors, kv: KVPool,
                 use_fused: bool = True):  # fmt: skip
        self.base, self.args, self.slots, self.kv = base, args, slots, kv
        self.device = base.embed.device
        self.dtype = base.embed.dtype
        self.use_fused = use_fused

    # -- metadata -------------------------------------------------------------------------------
    def prepare(self, work: list[SeqWork]) -> StepMeta:
        dev = self.device
        tokens, positions, row_slot, write_rows = [], [], [], []
        decode_rows, decode_ctx, prefills, logit_rows, logit_slots = [], [], [], [], []
        r = 0
        for w in work:
            n = len(w.tokens)
            tokens.extend(w.tokens)
            positions.extend(range(w.start, w.start + n))
            row_slot.extend([w.slot] * n)
            ctx = self.kv.rows(w.blocks, 0, w.start + n)  # [L] the whole context incl. the new tokens
            write_rows.append(ctx[w.start:])
            if n == 1:
                decode_rows.append(r)
                decode_ctx.append(ctx)
            else:
                L = w.start + n
                q_pos = torch.arange(w.start, L)[:, None]
                mask = torch.arange(L)[None, :] <= q_pos  # [n, L]: query i sees 0..start+i
                prefills.append((r, n, ctx.to(dev), mask.to(dev)))
            if w.want_logits:
                logit_rows.append(r + n - 1)
                logit_slots.append(w.slot)
            r += n
        slots_set = set(row_slot)
        single = next(iter(slots_set)) if len(slots_set) == 1 else None
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        cos, sin = rope_tables(self.args, pos_t, self.dtype)
        rs = torch.tensor(row_slot, dtype=torch.int32)
        meta = StepMeta(
            tokens=torch.tensor(tokens, dtype=torch.int64, device=dev),
            cos=cos[:, None, :], sin=sin[:, None, :],
            row_slot=rs.to(dev),
            norm_idx=None if single is not None else (rs.to(torch.int64) + 1).to(dev),
            single_norm=(single + 1) if single is not None else 0,
            any_delta=any(s >= 0 for s in slots_set),
            single_slot=single if (single is not None and single >= 0 and self.use_fused) else None,
            write_rows=torch.cat(write_rows).to(dev),
            decode_rows=None, decode_gather=None, decode_mask=None,
            prefills=prefills,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            logit_slots=logit_slots,
        )  # fmt: skip
        if meta.any_delta and meta.single_slot is None:
            meta.plan = plan_batch(rs, self.slots.n_slots, device=dev)  # from the host copy: no device sync
        if decode_rows:
            lmax = max(len(c) for c in decode_ctx)
            gather = torch.zeros(len(decode_ctx), lmax, dtype=torch.int64)
            mask = torch.zeros(len(decode_ctx), lmax, dtype=torch.bool)
            for b, c in enumerate(decode_ctx):
                gather[b, : len(c)] = c
                mask[b, : len(c)] = True
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.int64, device=dev)
            meta.decode_gather = gather.to(dev)
            meta.decode_mask = mask[:, None, None, :].to(dev)
        return meta

    # -- layers ---------------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, layer: int, group: str, m: StepMeta) -> torch.Tensor:
        """y = x · W_baseᵀ, plus y[r] += α_s ⊙ (x[r] · S_sᵀ) for s = row_slot[r] ≥ 0.

        x: [N, d_in] -> y: [N, d_out_g]
        """
        w = self.base.layers[layer][group]
        signs, alpha = self.slots.signs[layer][group], self.slots.alpha[layer][group]
        if m.single_slot is not None:
            return bitdelta_linear(x, w, signs[m.single_slot], alpha[m.single_slot])
        y = x @ w.t()
        if m.any_delta:
            bitdelta_delta_batched(x, signs, alpha, m.row_slot, y, plan=m.plan)
        return y

    def _norm(self, x: torch.Tensor, weights: torch.Tensor, m: StepMeta, eps: float) -> torch.Tensor:
        """RMSNorm with a per-row weight. x: [N, dim]; weights: [n_slots + 1, dim] (row 0 = base)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        w = weights[m.single_norm] if m.norm_idx is None else weights[m.norm_idx]
        return w * xf.to(x.dtype)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, m: StepMeta) -> torch.Tensor:
        """q: [N, H, hd]; k, v: [N, KV, hd] (new tokens) -> [N, H, hd]."""
        kc, vc = self.kv.k[layer], self.kv.v[layer]  # [rows, KV, hd]
        kc[m.write_rows] = k
        vc[m.write_rows] = v
        gqa = self.args.n_heads != self.args.n_kv_heads
        out = torch.empty_like(q)
        if m.decode_rows is not None:
            kd = kc[m.decode_gather].transpose(1, 2)  # [B, KV, Lmax, hd]
            vd = vc[m.decode_gather].transpose(1, 2)
            qd = q[m.decode_rows][:, :, None, :]  # [B, H, 1, hd]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m.decode_mask, enable_gqa=gqa)
            out[m.decode_rows] = od[:, :, 0, :]
        for r0, n, ctx, mask in m.prefills:
            qs = q[r0:r0 + n].transpose(0, 1)[None]  # [1, H, n, hd]
            ks = kc[ctx].transpose(0, 1)[None]  # [1, KV, L, hd]
            vs = vc[ctx].transpose(0, 1)[None]
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
            out[r0:r0 + n] = os_[0].transpose(0, 1)
        return out

    def _embed(self, m: StepMeta) -> torch.Tensor:
        x = self.base.embed[m.tokens]  # [N, dim]
        if not m.any_delta or not self.slots.extras:
            return x
        rs = m.row_slot
        for slot, ex in self.slots.extras.items():
            if ex.embed is None:
                continue
            rows = (rs == slot).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            t = m.tokens[rows]
            if ex.embed.weight is not None:
                x[rows] = ex.embed.weight[t]
            else:
                s = unpack_signs(ex.embed.signs[t], self.args.dim, torch.float32)
                x[rows] = (x[rows].float() + ex.embed.alpha[t][:, None] * s).to(x.dtype)
        return x

    def _logits(self, h: torch.Tensor, m: StepMeta) -> torch.Tensor:
        """h: [R, dim] (final-normed) -> fp32 logits [R, vocab], each row through its variant's head."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(m.logit_slots):
            ex = self.slots.extras.get(s) if s >= 0 else None
            groups.setdefault(s if (ex is not None and ex.head is not None) else -1, []).append(i)
        if list(groups) == [-1]:
            return (h @ self.base.head.t()).float()
        out = torch.empty(h.shape[0], self.base.head.shape[0], dtype=torch.float32, device=h.device)
        for s, idx in groups.items():
            rows = torch.tensor(idx, dtype=torch.int64, device=h.device)
            hr = h[rows]
            if s < 0:
                out[rows] = (hr @ self.base.head.t()).float()
                continue
            head = self.slots.extras[s].head
            if head.weight is not None:
                out[rows] = (hr @ head.weight.t()).float()
            else:
                out[rows] = bitdelta_linear(hr, self.base.head, head.signs, head.alpha).float()
        return out

    # -- step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, work: list[SeqWork]) -> torch.Tensor:
        """Run one step; returns fp32 logits [R, vocab] of the sequences with want_logits, in order."""
        m = self.prepare(work)
        a = self.args
        hd, H, KV = a.head_dim, a.n_heads, a.n_kv_heads
        x = self._embed(m)
        N = x.shape[0]
        for i in range(a.n_layers):
            h = self._norm(x, self.slots.norms[i][0], m, a.norm_eps)
            qkv = self._linear(h, i, "qkv", m)
            q = qkv[:, : H * hd].view(N, H, hd)
            k = qkv[:, H * hd : (H + KV) * hd].view(N, KV, hd)
            v = qkv[:, (H + KV) * hd :].view(N, KV, hd)
            q, k = apply_rope(q, m.cos, m.sin), apply_rope(k, m.cos, m.sin)
            att = self._attention(q, k, v, i, m)
            x = x + self._linear(att.reshape(N, H * hd), i, "o", m)
            h = self._norm(x, self.slots.norms[i][1], m, a.norm_eps)
            gu = self._linear(h, i, "gate_up", m)
            f = a.intermediate_size
            x = x + self._linear(F.silu(gu[:, :f]) * gu[:, f:], i, "down", m)
        if m.logit_rows.numel() == 0:
            return torch.empty(0, a.vocab_size, dtype=torch.float32, device=x.device)
        xl = x[m.logit_rows]
        sub = StepMeta(**{**m.__dict__, "norm_idx": None if m.norm_idx is None else
                          torch.tensor(m.logit_slots, dtype=torch.int64, device=x.device) + 1})
        h = self._norm(xl, self.slots.final_norm, sub, a.norm_eps)
        return self._logits(h, m)


__all__ = ["ModelRunner", "BaseWeights", "KVPool", "SeqWork", "StepMeta", "NORMS"]
