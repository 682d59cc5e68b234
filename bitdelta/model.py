"""The compact model (gpt-fast sized): ONE forward for every supported family, with Hugging
Face parameter names, so HF checkpoints and delta files map onto it without a renaming table.

    Llama (any family of `bitdelta.arch`)
      model.embed_tokens            [vocab, dim]
      model.layers[i].self_attn.{q,k,v}_proj | qkv_proj   (split or fused, as the family stores them)
      model.layers[i].self_attn.o_proj
      model.layers[i].self_attn.{q,k}_norm                 (Qwen3, Gemma 3: per head; OLMo 2: whole)
      model.layers[i].mlp.{gate,up}_proj | gate_up_proj
      model.layers[i].mlp.down_proj
      model.layers[i].{block_sparse_moe | mlp}.gate                 (a mixture of experts: the router,
      model.layers[i].{block_sparse_moe | mlp}.experts[e].{w1,w3,w2 | gate_proj,up_proj,down_proj}   each expert)
      model.layers[i].{input,post_attention}_layernorm
      model.layers[i].{pre,post}_feedforward_layernorm      (Gemma 2/3's sandwich norms; OLMo 2: post_*
                                                            only, no input_layernorm)
      model.norm
      lm_head                       (tied to embed_tokens when the config says so)

The switches (fused projections, biases, q/k norms, rope variant, sliding window, Gemma's
norms, embedding scale, activation, attention scale and soft-caps, Granite's multipliers, OLMo 2's
post-norms, a sparse layer's experts and routing) come from `ModelArgs` (bitdelta.arch), the one description of a family. A variant
is the base model with its projections swapped for `BitDeltaLinear` (packed signs and α as
buffers, the base weight and bias shared) and its changed dense parameters (norms, biases,
embeddings) replaced: `attach_delta` (a grown vocabulary's embedding and head too, with their rows).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from bitdelta.arch import ModelArgs
from bitdelta_kernels import bitdelta_delta_batched, bitdelta_linear
from bitdelta_kernels.bits import unpack_signs


class RMSNorm(nn.Module):
    """Llama's: normalise in fp32, round, scale by w in the input dtype. Gemma's (`offset`): scale by
    (1 + w) in fp32, then round once (its weights start at 0). OLMo 2's (`once`): scale by w in fp32,
    then round once. Cohere's and StableLM's LayerNorm (`centered`, always `once`): the mean subtracted
    first, its variance about the mean; StableLM's with a `bias` added before the rounding; Nemotron's
    LayerNorm1P (`plus_one`) scales by (w + 1), that sum rounded to w's dtype first."""

    def __init__(
        self,
        dim: int | tuple[int, ...],
        eps: float,
        offset: bool = False,
        once: bool = False,
        centered: bool = False,
        bias: bool = False,
        plus_one: bool = False,
    ):
        super().__init__()
        self.eps, self.offset, self.once, self.centered = eps, offset, once or centered, centered
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if offset or plus_one else torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @classmethod
    def of(cls, args: ModelArgs, dim: int | tuple[int, ...], bias: bool | None = None) -> RMSNorm:
        """The family's norm of `dim` values (a shape: weights of that shape over its last dim); bias: whether
        it has one (None: as the family's norms, `Family.norm_bias`)."""
        fam = args.family
        bias = fam.norm_bias if bias is None else bias
        return cls(dim, args.norm_eps, fam.gemma, fam.norm_once, fam.layer_norm, bias, fam.norm_plus_one)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.centered:
            xf = xf - xf.mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if self.once:
            y = (self.weight + 1 if self.plus_one else self.weight).float() * xf
            return (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(x / cap) (Gemma 2's attention scores and Gemma 2/3's logits); x itself for None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def gate_act(args: ModelArgs, x: torch.Tensor) -> torch.Tensor:
    """The MLP's gate activation of the family (Nemotron's relu²: relu, then the square rounded once; Phi's
    gelu_new: GELU's tanh form op by op, each op rounded, as transformers' NewGELUActivation; GPT-NeoX's exact
    GELU)."""
    if args.act == "relu2":
        return F.relu(x).square()
    if args.act == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if args.act == "gelu":  # GPT-NeoX's: the exact GELU, x · Φ(x)
        return F.gelu(x)
    return F.gelu(x, approximate="tanh") if args.act == "gelu_tanh" else F.silu(x)


def embed_scaled(args: ModelArgs, x: torch.Tensor) -> torch.Tensor:
    """Gemma's embeddings × √dim, the factor rounded to x's dtype first as transformers does; Granite's
    × embedding_multiplier (a Python float)."""
    scale = args.embed_scale
    if scale is not None:
        x = x * torch.tensor(scale, dtype=x.dtype)
    return x if args.embed_multiplier == 1.0 else x * args.embed_multiplier


def residual(args: ModelArgs, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x + h, Granite's h × residual_multiplier first."""
    return x + (h if args.residual_multiplier == 1.0 else h * args.residual_multiplier)


def final_logits(args: ModelArgs, logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits as the family ends: Granite's ÷ logits_scaling, Cohere's × logit_scale, Gemma 2's soft-cap."""
    if args.logits_scaling != 1.0:
        logits = logits / args.logits_scaling
    if args.logit_scale != 1.0:
        logits = logits * args.logit_scale
    return softcap(logits, args.logit_softcap)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, args: ModelArgs
) -> torch.Tensor:
    """Attention of q [.., H, Tq, hd] over k, v [.., KV, Tk, hd] with a bool mask [Tq, Tk] (None:
    causal), at the family's scale; soft-capped scores (Gemma 2) are computed here (SDPA has no cap),
    their softmax in fp32."""
    gqa = q.shape[-3] != k.shape[-3]
    if args.attn_softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=args.attn_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=args.attn_scale)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scale = args.head_dim**-0.5 if args.attn_scale is None else args.attn_scale
    scores = softcap((q @ k.transpose(-1, -2)) * scale, args.attn_softcap)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def rope_tables(
    args: ModelArgs, positions: torch.Tensor, dtype: torch.dtype, seq_lens: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, rotary dims] for integer positions [T] (HF layout: halves concatenated).
    `seq_lens`: see `Rope.tables` (dynamic and LongRoPE depend on the sequence's length)."""
    return args.rope.tables(positions, args.rope.table_dtype(dtype), seq_lens)


class RopeCache:
    """`rope_tables` for a server's steps: each position's cos and sin row gathered from tables
    computed once for positions [0, n), n doubling as positions reach it (vLLM's cos_sin_cache),
    instead of ~8 small ops a step (~80 µs of a one-row CPU decode step). The rows are the values
    `rope_tables` gives (element-wise ops of each position alone). Rope kinds whose tables depend on
    the sequence's length (dynamic, LongRoPE) are computed per step, as before."""

    MIN = 1024  # positions in the first tables

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device):
        self.args, self.dtype, self.device = args, dtype, device
        self._cos: torch.Tensor | None = None  # [n, rotary dims]
        self._sin: torch.Tensor | None = None

    def tables(
        self, positions: torch.Tensor, upto: int, seq_lens: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary dims] for positions [T] (on the device), every one < `upto` (from the
        host's copy: no device read)."""
        if self.args.rope.length_dependent:
            return rope_tables(self.args, positions, self.dtype, seq_lens)
        cos, sin = self.cached(upto)
        return cos[positions], sin[positions]

    def cached(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached tables [n, rotary dims], n ≥ upto, whose row p is position p's (what `tables`
        gathers from; the C decode layers read the rows in place); not for length-dependent rope."""
        if self.args.rope.length_dependent:
            raise ValueError("length-dependent rope has no position tables")
        if self._cos is None or self._cos.shape[0] < upto:
            n = max(self.MIN, 1 << max(upto - 1, 1).bit_length())
            every = torch.arange(n, dtype=torch.int64, device=self.device)
            cos, sin = rope_tables(self.args, every, self.dtype)
            self._cos, self._sin = cos.contiguous(), sin.contiguous()
        return self._cos, self._sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x: [..., hd]; cos/sin broadcast to [..., r] with r ≤ hd: the first r dims rotate (Phi-3's
    partial rotary factor), the rest pass through. The pairs rotated are dims (i, i + r/2), or with
    `interleaved` (GLM's, GPT-J's) dims (2i, 2i + 1), each by cos/sin[i] (the tables' first half)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin, interleaved), x[..., r:]], dim=-1)
    half = r // 2
    if interleaved:  # as transformers' GLM: cos, sin of pair i on both its dims, (x0, x1) -> (−x1, x0)
        cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return x * cos + rotated * sin
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate(rope, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` as the model's rope does it: pairs interleaved or not, in x's dtype or (ERNIE 4.5's and
    Cohere's `Rope.fp32`) in fp32, rounded once (from tables of `Rope.table_dtype`)."""
    if rope.fp32:
        return apply_rope(x.float(), cos, sin, rope.interleaved).to(x.dtype)
    return apply_rope(x, cos, sin, rope.interleaved)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """bool [Tq, Tk]: query at q_pos[i] sees keys at k_pos[j] ≤ q_pos[i] (and > q_pos[i] − window)."""
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


class KVCache(nn.Module):
    """A static per-batch KV cache (gpt-fast style): k, v [B, n_kv_heads, max_len, head_dim]."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device=None):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # pos: [T]; k, v: [B, n_kv, T, hd]
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args, self.layer = args, layer
        self.window = args.window(layer)
        hd, d = args.head_dim, args.dim
        q, kv = args.n_heads * hd, args.n_kv_heads * hd
        if args.family.fused:  # Phi-3 (GLM fuses only the MLP's)
            self.qkv_proj = nn.Linear(d, q + 2 * kv, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(d, q, bias=args.qkv_bias)
            self.k_proj = nn.Linear(d, kv, bias=args.qkv_bias)
            self.v_proj = nn.Linear(d, kv, bias=args.qkv_bias)
        setattr(self, args.family.o_name, nn.Linear(q, d, bias=args.o_bias))  # Phi's dense
        # the q and k norms under the family's names (Hunyuan's query_layernorm, key_layernorm)
        self.qk_names = tuple(n.rsplit(".", 1)[1] for n in args.family.qk_norm_names)
        if args.qk_norm:
            shapes = {key: shape for key, _, shape in args.norm_params()}  # Command R+'s: [heads, head_dim]
            for name, path in zip(self.qk_names, args.family.qk_norm_names):  # no bias (StableLM's have none)
                setattr(self, name, RMSNorm.of(args, shapes[path], bias=False))
        self.kv_cache: KVCache | None = None

    def qk_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through their norms."""
        qn, kn = (getattr(self, n) for n in self.qk_names)
        return qn(q), kn(k)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [B, T, dim]; pos: [T] positions of the T tokens
        a = self.args
        B, T, _ = x.shape
        if a.family.fused:
            kv = a.n_kv_heads * a.head_dim
            q, k, v = self.qkv_proj(x).split([a.n_heads * a.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if a.family.qk_whole:  # OLMo 2, OLMoE: q and k normed whole, before the heads are split
            q, k = self.qk_norms(q, k)
        if a.clip_qkv is not None:  # OLMo 1, OLMoE: clipped as projected (OLMoE's q and k after their norms)
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.reshape(B, T, a.n_heads, a.head_dim)
        k = k.reshape(B, T, a.n_kv_heads, a.head_dim)
        per_head = a.qk_norm and not a.family.qk_whole  # Command R+'s weights [heads, head_dim] broadcast
        if per_head and not a.family.qk_after_rope:
            q, k = self.qk_norms(q, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        if a.rotates(self.layer):  # SmolLM3's NoPE layers take none
            q, k = rotate(a.rope, q, cos, sin), rotate(a.rope, k, cos, sin)
        if per_head and a.family.qk_after_rope:  # Hunyuan: normed after the rope
            q, k = (t.transpose(1, 2) for t in self.qk_norms(q.transpose(1, 2), k.transpose(1, 2)))
        temperature = a.q_temperature(pos)  # Ministral 3: q × its position's factor, in q's dtype
        if temperature is not None:
            q = q * temperature.to(q.dtype)[:, None]
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(pos, k, v)
            out = attend(q, k, v, attention_mask(pos, torch.arange(k.shape[2], device=x.device), self.window), a)
        else:
            out = attend(q, k, v, None if self.window is None else attention_mask(pos, pos, self.window), a)
        o_proj = getattr(self, a.family.o_name)
        return o_proj(out.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.fused = args.family.fused or args.family.fused_mlp
        self.ungated = args.family.ungated_mlp  # StarCoder2's, Nemotron's, Arcee's (up, down) names
        d, f = args.dim, args.intermediate_size
        if self.ungated is not None:
            setattr(self, self.ungated[0], nn.Linear(d, f, bias=args.mlp_bias))
            setattr(self, self.ungated[1], nn.Linear(f, d, bias=args.mlp_bias))
            return
        if self.fused:
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=args.mlp_bias)
        else:
            self.gate_proj = nn.Linear(d, f, bias=args.mlp_bias)
            self.up_proj = nn.Linear(d, f, bias=args.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ungated is not None:  # StarCoder2, Nemotron, Arcee: down(act(up(x)))
            up, down = (getattr(self, n) for n in self.ungated)
            return down(gate_act(self.args, up(x)))
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gate_act(self.args, gate) * up)


class Expert(nn.Module):
    """One expert of a sparse layer: a gated MLP under its family's names (Mixtral's w1, w3, w2)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.names = args.family.expert_names
        d, f = args.dim, args.intermediate_size
        for name, shape in zip(self.names, ((d, f), (d, f), (f, d))):
            setattr(self, name, nn.Linear(*shape, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(gate_act(self.args, gate(x)) * up(x))


def route(args: ModelArgs, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, n_experts] -> (weights, experts) [N, experts_per_token] of each token: the
    softmax in fp32, its top k, renormalised over them where the family does; the weights fp32, or
    rounded to the logits' dtype for Qwen3-MoE and OLMoE (as transformers does)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, args.experts_per_token, dim=-1)
    if args.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if args.family.moe_round:  # transformers' Qwen3-MoE and OLMoE round them to the model's dtype
        weights = weights.to(logits.dtype)
    return weights, experts


class SparseMoE(nn.Module):
    """A sparse layer (Mixtral's block_sparse_moe, Qwen3-MoE's mlp): `gate` routes each token to its
    top experts, whose outputs are summed weighted by `route`'s weights. Qwen2-MoE adds
    `shared_expert`, which every token takes, scaled by sigmoid(`shared_expert_gate` · x)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(args) for _ in range(args.n_experts))
        if args.family.shared_expert:
            self.shared_expert = Expert(dataclasses.replace(args, intermediate_size=args.shared_intermediate_size))
            self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route(self.args, self.gate(flat))
        out = torch.zeros_like(flat)
        for e in experts.unique().tolist():
            rows, k = (experts == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[rows]) * weights[rows, k, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.args.family.shared_expert:  # as transformers: sigmoid(gate) · shared, added to the experts' sum
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.ffn = args.family.moe or "mlp"  # the MLP's (or sparse block's) module name
        setattr(self, self.ffn, SparseMoE(args) if args.family.moe else MLP(args))
        for name, size in args.layer_norms():
            if "." not in name:  # the q/k norms live in self_attn
                setattr(self, name, RMSNorm.of(args, size))

    def forward(self, x, cos, sin, pos):
        a = self.self_attn.args
        inp, attn_out, mlp_in, mlp_out = (None if n is None else getattr(self, n) for n in a.norm_roles())
        h = x if inp is None else inp(x)  # OLMo 2/3: no input norm
        att = self.self_attn(h, cos, sin, pos)
        ffn = getattr(self, self.ffn)
        if a.parallel:  # Cohere, StableLM's parallel residual: the MLP reads the attention's input; x + attention + MLP
            y = ffn(h if mlp_in is None else mlp_in(x))  # GPT-NeoX's MLP: its own norm of x
            if a.family.sublayers_first:  # Phi's, GPT-NeoX's, Falcon's: (attention + MLP) + x
                return x + (att + y)
            return x + att + y
        if attn_out is None:  # Llama's layer
            x = residual(a, x, att)
            return residual(a, x, ffn(mlp_in(x)))
        # Gemma 2/3, GLM-4 (a sandwich), OLMo 2/3 (outputs only): the sublayers' outputs normed
        x = x + attn_out(att)
        y = ffn(x if mlp_in is None else mlp_in(x))
        return x + (y if mlp_out is None else mlp_out(y))


class Body(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        setattr(self, args.family.final_norm, RMSNorm.of(args, args.dim))  # Phi's final_layernorm


class Llama(nn.Module):
    """The compact model of any supported family (the name is the lineage: gpt-fast's Llama)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=args.family.head_bias)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def setup_caches(self, batch: int, max_len: int) -> None:
        dtype, device = self.lm_head.weight.dtype, self.lm_head.weight.device
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(batch, self.args.n_kv_heads, max_len, self.args.head_dim, dtype, device)

    def clear_caches(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.kv_cache = None

    def forward(self, input_ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [B, T] -> logits [B, T, vocab] (fp32).

        Without `pos`: a causal pass over the whole sequence (training, scoring).
        With `pos` [T] and caches set up: incremental decoding.
        """
        B, T = input_ids.shape
        positions = pos if pos is not None else torch.arange(T, device=input_ids.device)
        a = self.args
        x = embed_scaled(a, self.model.embed_tokens(input_ids))
        # the sequence is max(pos) + 1 long at this step (dynamic/LongRoPE read it; one host read)
        seq_len = (int(positions[-1]) + 1) if a.rope.length_dependent else 0
        cos, sin = rope_tables(a, positions, x.dtype, [seq_len] * T if seq_len else None)
        local = None if a.local_rope is None else a.local_rope.tables(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, *(local if a.local(i) else (cos, sin)), positions)
        return final_logits(a, self.lm_head(getattr(self.model, a.family.final_norm)(x)).float())

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy decoding of one sequence with the KV cache; returns the new token ids."""
        device = self.lm_head.weight.device
        total = len(prompt) + max_new_tokens
        self.setup_caches(1, total)
        try:
            ids = torch.tensor([prompt], device=device)
            logits = self(ids, torch.arange(len(prompt), device=device))
            out: list[int] = []
            for i in range(max_new_tokens):
                nxt = int(logits[0, -1].argmax())
                out.append(nxt)
                if nxt in stop_ids or len(out) == max_new_tokens:
                    break
                p = len(prompt) + i
                start = self.args.rope.step_start(p, 1)  # 0: LongRoPE switches, recompute the cache
                ids = torch.tensor([(prompt + out)[start:]], device=device)
                logits = self(ids, torch.arange(start, p + 1, device=device))
            return out
        finally:
            self.clear_caches()


class BitDeltaLinear(nn.Module):
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ), S ∈ {−1, +1} packed 8 per byte.

    weight: the base's [d_out, d_in] (shared, never copied); signs: uint8
    [d_out, ceil(d_in/8)]; alpha: fp32 [d_out] or [1]; bias: the layer's [d_out]
    bias (the base's, or the variant's when it changed), or None. α is a
    Parameter so scale distillation can train it; everything else is frozen.

    Beyond one plane (`bitdelta.planes`): `axis` "col" makes α [d_in] scale input columns,
    `more` adds further sign planes (their α's Parameters too) and `u` [d_out, r], `v` [r, d_in]
    a low-rank residual U · V (Parameters, fp32 here):
    y = x · W_baseᵀ + Σ_i (x · (α_i ⊙ S_i)ᵀ) + (x · Vᵀ) · Uᵀ.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        signs: torch.Tensor,
        alpha: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        axis: str = "row",
        more=(),
        u: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ):
        super().__init__()
        d_out, d_in = weight.shape
        self.in_features, self.out_features = d_in, d_out
        self.axes = [axis] + [p.axis for p in more]
        for i, (s_, a_, ax) in enumerate([(signs, alpha, axis)] + [(p.signs, p.alpha, p.axis) for p in more]):
            if s_.shape != (d_out, (d_in + 7) // 8) or s_.dtype != torch.uint8:
                raise ValueError(f"signs {tuple(s_.shape)} {s_.dtype} do not fit a weight of shape {(d_out, d_in)}")
            ok = ((d_in,),) if ax == "col" else ((d_out,), (1,))
            if a_.shape not in ok:
                raise ValueError(f"alpha shape {tuple(a_.shape)} of plane {i + 1} ({ax}) must be one of {ok}")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.weight.requires_grad_(False)
        self.register_buffer("signs", signs)
        self.alpha = nn.Parameter(alpha.float().clone(), requires_grad=False)
        for i, p in enumerate(more, start=2):
            self.register_buffer(f"signs{i}", p.signs)
            setattr(self, f"alpha{i}", nn.Parameter(p.alpha.float().clone(), requires_grad=False))
        if (u is None) != (v is None) or (
            u is not None and (u.shape[0], v.shape[1], u.shape[1]) != (d_out, d_in, v.shape[0])
        ):
            raise ValueError(f"low-rank factors must be u [{d_out}, r] and v [r, {d_in}]")
        self.u = None if u is None else nn.Parameter(u.float().clone(), requires_grad=False)
        self.v = None if v is None else nn.Parameter(v.float().clone(), requires_grad=False)
        if bias is not None and tuple(bias.shape) != (d_out,):
            raise ValueError(f"bias shape {tuple(bias.shape)} must be [{d_out}]")
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense_signs: list[torch.Tensor] | None = None

    @property
    def plain(self) -> bool:
        """One plane of row or matrix α, no low-rank: the fused kernel's case."""
        return self.axes in (["row"], ["matrix"]) and self.u is None

    def planes(self) -> list[tuple[torch.Tensor, nn.Parameter, str]]:
        """(signs, α, axis) of every plane."""
        out = [(self.signs, self.alpha, self.axes[0])]
        return out + [
            (getattr(self, f"signs{i}"), getattr(self, f"alpha{i}"), ax) for i, ax in enumerate(self.axes[1:], 2)
        ]

    def trainable(self) -> list[nn.Parameter]:
        """What scale distillation tunes: every plane's α and the low-rank factors."""
        return [a for _, a, _ in self.planes()] + [t for t in (self.u, self.v) if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., d_in] -> [..., d_out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.alpha.requires_grad and torch.is_grad_enabled():
            y = self._differentiable(x2)
        elif self.plain:
            y = bitdelta_linear(x2, self.weight, self.signs, self.alpha)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = self._planes(x2)
        return y.reshape(*lead, self.out_features)

    def _planes(self, x: torch.Tensor) -> torch.Tensor:
        """Base GEMM (with plane 1 fused when its α is per row or matrix), then one delta launch per
        further plane and the low-rank term as two small GEMMs."""
        planes = self.planes()
        s1, a1, ax1 = planes[0]
        if ax1 == "col":
            y, rest = F.linear(x, self.weight), planes
        else:
            y, rest = bitdelta_linear(x, self.weight, s1, a1), planes[1:]
        if self.bias is not None:
            y = y + self.bias
        rows = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
        for s, a, ax in rest:
            if ax == "col":
                xs, al = (x.float() * a).to(x.dtype), torch.ones(1, 1, device=x.device)
            else:
                xs, al = x, a.reshape(1, -1)
            y = bitdelta_delta_batched(xs, s[None], al, rows, y)
        if self.u is not None:
            y = y + ((x.float() @ self.v.t()) @ self.u.t()).to(y.dtype)
        return y

    def _differentiable(self, x: torch.Tensor) -> torch.Tensor:
        # Distillation only: keep ±1 unpacked once (it is re-used every step).
        if self._dense_signs is None:
            self._dense_signs = [unpack_signs(s, self.in_features, x.dtype) for s, _, _ in self.planes()]
        y = F.linear(x, self.weight, self.bias)
        for dense, (_, a, ax) in zip(self._dense_signs, self.planes()):
            if ax == "col":
                y = y + F.linear(x * a.to(x.dtype), dense)
            else:
                y = y + F.linear(x, dense) * a.to(x.dtype)
        if self.u is not None:
            y = y + (x @ self.v.t().to(x.dtype)) @ self.u.t().to(x.dtype)
        return y

    def delta(self) -> torch.Tensor:
        """Σ_i α_i ⊙ S_i + U · V in fp32 [d_out, d_in] (the current α's and factors)."""
        d = torch.zeros(self.out_features, self.in_features, dtype=torch.float32, device=self.weight.device)
        for s, a, ax in self.planes():
            sc = a.detach().float().reshape(1, -1) if ax == "col" else a.detach().float().reshape(-1, 1)
            d += unpack_signs(s, self.in_features, torch.float32) * sc
        if self.u is not None:
            d += self.u.detach().half().float() @ self.v.detach().half().float()
        return d

    def merged_weight(self) -> torch.Tensor:
        """W_base + α ⊙ S (every plane, + U · V) in the base dtype (computed in fp32)."""
        if self.plain:
            s = unpack_signs(self.signs, self.in_features, torch.float32)
            return (self.weight.float() + self.alpha.detach()[:, None] * s).to(self.weight.dtype)
        return (self.weight.float() + self.delta()).to(self.weight.dtype)

    def compressed(self):
        """Its delta as a `bitdelta.format.CompressedWeight` (the current α's and factors; the
        factors in fp16, as the file stores them)."""
        from bitdelta.format import CompressedWeight, SignPlane

        planes = [SignPlane(s, a.detach().clone(), ax) for s, a, ax in self.planes()]
        u, v = (None, None) if self.u is None else (self.u.detach().half(), self.v.detach().half())
        return CompressedWeight(planes, (self.out_features, self.in_features), u, v)


def load_model(
    ckpt: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Llama:
    """Load a HF-layout checkpoint of a supported family into `Llama` (weights cast to `dtype`).

    The checkpoint's tensor names must be exactly the ones its config describes (a fused
    Phi-3 checkpoint has qkv_proj, a Qwen2 one has q/k/v biases, ...)."""
    from bitdelta.checkpoint import CheckpointReader, read_config

    args = ModelArgs.from_hf(read_config(ckpt))
    with torch.device("meta"):
        model = Llama(args)
    state = {}
    with CheckpointReader(ckpt) as r:
        for name in r.keys():
            state[name] = r.get(name).to(device=device, dtype=dtype)
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = set(model.state_dict()) - set(state)
    unexpected = set(state) - set(model.state_dict()) - {k for k in state if k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(
            f"{ckpt}: checkpoint does not match the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, assign=True, strict=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()


def state_dict_for_save(model: Llama) -> dict[str, torch.Tensor]:
    """The model's parameters under HF names, BitDeltaLinear merged, tied head left out."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, BitDeltaLinear):
            out[f"{name}.weight"] = mod.merged_weight()
    for name, p in model.state_dict().items():
        if name.rsplit(".", 1)[-1].rstrip("0123456789") in ("signs", "alpha", "u", "v") or name in out:
            continue
        out[name] = p
    if model.args.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def attach_delta(model: Llama, delta, trainable_alpha: bool = False) -> Llama:
    """Turn `model` (a base) into the variant `delta` in place: swap projections for
    BitDeltaLinear and replace changed dense parameters (norms, biases, embeddings).
    A delta made for another architecture or layout is refused (format.ArchMismatchError).
    Returns the model."""
    from bitdelta.format import SignPlane, check_arch

    check_arch(delta.meta.variant, delta.meta.architecture, delta.meta.layout, model.args)
    modules = dict(model.named_modules())
    for param, cw in delta.compressed.items():
        mod_name = param.removesuffix(".weight")
        base = modules.get(mod_name)
        if isinstance(base, nn.Embedding):
            # A lookup reads only the rows it needs, so the variant's table is
            # materialised once (W + α ⊙ S) instead of a per-call kernel.
            merged = (base.weight.float() + cw.dense().to(base.weight.device)).to(base.weight.dtype)
            base.weight = nn.Parameter(merged, requires_grad=False)
            continue
        if not isinstance(base, nn.Linear):
            raise ValueError(f"delta compresses {param}, which is not a linear layer of this model")
        if tuple(base.weight.shape) != tuple(cw.shape):
            raise ValueError(f"{param}: delta shape {cw.shape} != model shape {tuple(base.weight.shape)}")
        dev = base.weight.device
        # a low-rank-only weight (an imported LoRA module): one plane of α = 0 stands in, adding nothing
        planes = cw.planes or [
            SignPlane(torch.zeros(cw.shape[0], (cw.shape[1] + 7) // 8, dtype=torch.uint8), torch.zeros(1), "matrix")
        ]
        more = [type(p)(p.signs.to(dev), p.alpha.to(dev), p.axis) for p in planes[1:]]
        u, v = (None, None) if cw.u is None else (cw.u.to(dev), cw.v.to(dev))
        first = planes[0]
        new = BitDeltaLinear(
            base.weight, first.signs.to(dev), first.alpha.to(dev), base.bias, axis=first.axis, more=more, u=u, v=v
        )
        for t in new.trainable():
            t.requires_grad_(trainable_alpha)
        parent_name, _, child = mod_name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in delta.dense.items():
        if name not in params:
            raise ValueError(f"delta has a dense tensor for {name}, which this model does not have")
        p = params[name]
        grown = delta.meta.vocab_size and name in ("model.embed_tokens.weight", "lm_head.weight")
        if p.shape != t.shape and not (grown and t.shape == (delta.meta.vocab_size, *p.shape[1:])):
            raise ValueError(f"{name}: delta shape {tuple(t.shape)} != model shape {tuple(p.shape)}")
        parent_name, _, child = name.rpartition(".")
        owner = model.get_submodule(parent_name)
        setattr(owner, child, nn.Parameter(t.to(device=p.device, dtype=p.dtype), requires_grad=False))
    head_changed = "lm_head.weight" in delta.dense or "lm_head.weight" in delta.compressed
    if model.args.tie_embeddings and not head_changed:
        model.lm_head.weight = model.model.embed_tokens.weight
    if delta.meta.vocab_size:  # tokens added: the model reads and writes the grown vocabulary
        model.args = dataclasses.replace(model.args, vocab_size=delta.meta.vocab_size)
        model.model.embed_tokens.num_embeddings = model.lm_head.out_features = delta.meta.vocab_size
    return model


def init_random(args: ModelArgs, seed: int = 0, std: float = 0.02) -> Llama:
    """A randomly initialised model (tests and tiny demos)."""
    g = torch.Generator().manual_seed(seed)
    model = Llama(args)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # RMSNorm weights (layers, q/k, final) near 1 (Gemma's: 1 + w near 1)
            p.data = (0.0 if args.family.gemma or args.family.norm_plus_one else 1.0) + 0.1 * torch.randn(
                p.shape, generator=g
            )
        else:
            p.data = torch.randn(p.shape, generator=g) * std
    if args.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.requires_grad_(False).eval()


__all__ = [
    "ModelArgs",
    "Llama",
    "BitDeltaLinear",
    "load_model",
    "attach_delta",
    "state_dict_for_save",
    "init_random",
]
