"""A compact Llama (gpt-fast sized) with Hugging Face parameter names, so HF
checkpoints and delta files map onto it without a renaming table.

    Llama
      model.embed_tokens            [vocab, dim]
      model.layers[i].self_attn.{q,k,v,o}_proj   (nn.Linear or BitDeltaLinear)
      model.layers[i].mlp.{gate,up,down}_proj
      model.layers[i].{input,post_attention}_layernorm
      model.norm
      lm_head                       (tied to embed_tokens when the config says so)

A variant is the base model with its projections swapped for
`BitDeltaLinear` (packed signs and α as buffers, the base weight shared) and
its changed dense parameters replaced: `attach_delta`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import bitdelta_linear
from kernels.bits import unpack_signs

# The projection weights BitDelta compresses (the paper compresses exactly these).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: dim // n_heads
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelArgs:
        """From a Hugging Face LlamaConfig dict."""
        arch = cfg.get("model_type", "llama")
        if arch not in ("llama", "mistral"):
            raise ValueError(f"unsupported model_type {arch!r}: this build serves Llama-family models")
        scaling = cfg.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling} is not supported yet")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("attention/MLP biases are not supported (Llama has none)")
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            head_dim=cfg.get("head_dim") or 0,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    def to_hf(self) -> dict:
        """A LlamaConfig dict (for writing test checkpoints)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    def param_count(self) -> int:
        d, f, hd = self.dim, self.intermediate_size, self.head_dim
        attn = d * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, as HF Llama does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(args: ModelArgs, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [T, head_dim] for integer positions [T] (HF layout: halves concatenated)."""
    inv_freq = 1.0 / (
        args.rope_theta
        ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32, device=positions.device) / args.head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, hd]; cos/sin: [T, hd] or [B, 1, T, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        # x: [B, T, dim]
        a = self.args
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, a.n_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, a.n_kv_heads, a.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if pos is not None and self.kv_cache is not None:
            k, v = self.kv_cache.update(pos, k, v)
            # Query t sees cache slots 0..pos[t].
            mask = torch.arange(k.shape[2], device=x.device)[None, :] <= pos[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=a.n_heads != a.n_kv_heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=a.n_heads != a.n_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, a.n_heads * a.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Body(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
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
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_tables(self.args, positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, pos)
        return self.lm_head(self.model.norm(x)).float()

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
                logits = self(torch.tensor([[nxt]], device=device), torch.tensor([p], device=device))
            return out
        finally:
            self.clear_caches()


class BitDeltaLinear(nn.Module):
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ), S ∈ {−1, +1} packed 8 per byte.

    weight: the base's [d_out, d_in] (shared, never copied); signs: uint8
    [d_out, ceil(d_in/8)]; alpha: fp32 [d_out] or [1]. α is a Parameter so
    scale distillation can train it; everything else is frozen.
    """

    def __init__(self, weight: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor):
        super().__init__()
        d_out, d_in = weight.shape
        if signs.shape != (d_out, (d_in + 7) // 8) or signs.dtype != torch.uint8:
            raise ValueError(f"signs {tuple(signs.shape)} {signs.dtype} do not fit a weight of shape {(d_out, d_in)}")
        if alpha.shape not in ((d_out,), (1,)):
            raise ValueError(f"alpha shape {tuple(alpha.shape)} must be [{d_out}] or [1]")
        self.in_features, self.out_features = d_in, d_out
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.weight.requires_grad_(False)
        self.register_buffer("signs", signs)
        self.alpha = nn.Parameter(alpha.float().clone(), requires_grad=False)
        self._dense_signs: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., d_in] -> [..., d_out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.alpha.requires_grad and torch.is_grad_enabled():
            y = self._differentiable(x2)
        else:
            y = bitdelta_linear(x2, self.weight, self.signs, self.alpha)
        return y.reshape(*lead, self.out_features)

    def _differentiable(self, x: torch.Tensor) -> torch.Tensor:
        # Distillation only: keep ±1 unpacked once (it is re-used every step).
        if self._dense_signs is None:
            self._dense_signs = unpack_signs(self.signs, self.in_features, x.dtype)
        return F.linear(x, self.weight) + F.linear(x, self._dense_signs) * self.alpha.to(x.dtype)

    def merged_weight(self) -> torch.Tensor:
        """W_base + α ⊙ S in the base dtype (computed in fp32)."""
        s = unpack_signs(self.signs, self.in_features, torch.float32)
        return (self.weight.float() + self.alpha.detach()[:, None] * s).to(self.weight.dtype)


def load_model(
    ckpt: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Llama:
    """Load a HF-layout Llama checkpoint into `Llama` (weights cast to `dtype`)."""
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
        if name.endswith((".signs", ".alpha")) or name in out:
            continue
        out[name] = p
    if model.args.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def attach_delta(model: Llama, delta, trainable_alpha: bool = False) -> Llama:
    """Turn `model` (a base) into the variant `delta` in place: swap projections for
    BitDeltaLinear and replace changed dense parameters. Returns the model."""
    modules = dict(model.named_modules())
    for param, cw in delta.compressed.items():
        mod_name = param.removesuffix(".weight")
        base = modules.get(mod_name)
        if isinstance(base, nn.Embedding):
            # A lookup reads only the rows it needs, so the variant's table is
            # materialised once (W + α ⊙ S) instead of a per-call kernel.
            merged = BitDeltaLinear(base.weight, cw.signs, cw.alpha).merged_weight()
            base.weight = nn.Parameter(merged, requires_grad=False)
            continue
        if not isinstance(base, nn.Linear):
            raise ValueError(f"delta compresses {param}, which is not a linear layer of this model")
        if tuple(base.weight.shape) != tuple(cw.shape):
            raise ValueError(f"{param}: delta shape {cw.shape} != model shape {tuple(base.weight.shape)}")
        new = BitDeltaLinear(base.weight, cw.signs.to(base.weight.device), cw.alpha.to(base.weight.device))
        new.alpha.requires_grad_(trainable_alpha)
        parent_name, _, child = mod_name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in delta.dense.items():
        if name not in params:
            raise ValueError(f"delta has a dense tensor for {name}, which this model does not have")
        p = params[name]
        if p.shape != t.shape:
            raise ValueError(f"{name}: delta shape {tuple(t.shape)} != model shape {tuple(p.shape)}")
        parent_name, _, child = name.rpartition(".")
        owner = model.get_submodule(parent_name)
        setattr(owner, child, nn.Parameter(t.to(device=p.device, dtype=p.dtype), requires_grad=False))
    head_changed = "lm_head.weight" in delta.dense or "lm_head.weight" in delta.compressed
    if model.args.tie_embeddings and not head_changed:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def init_random(args: ModelArgs, seed: int = 0, std: float = 0.02) -> Llama:
    """A randomly initialised model (tests and tiny demos)."""
    g = torch.Generator().manual_seed(seed)
    model = Llama(args)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            p.data = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
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
    "PROJECTIONS",
]
