"""A small LoRA trainer for the compact Llama, and the glue between adapters and models.

    y = x Wᵀ + scale · (x Aᵀ) Bᵀ      # x: [..., d_in]; A: [r, d_in]; B: [d_out, r]

Initialisation follows PEFT (A Kaiming-uniform with a=√5, B zero), so
adapters trained here behave like PEFT's; all tasks use the same seed for A
by default, as one training script with a fixed seed does. Serving needs no
PEFT: `applied(model, adapter)` adds scale·BA into the projection weights and
restores them exactly afterwards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from bitdelta.merge.adapter import LoraAdapter, LoraModule
from bitdelta.model import Llama


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (training only)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        d_out, d_in = base.weight.shape
        a = torch.empty(rank, d_in)
        # PEFT's default: nn.init.kaiming_uniform_(A, a=sqrt(5)) -> U(-1/sqrt(d_in), 1/sqrt(d_in)).
        bound = 1.0 / math.sqrt(d_in)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., d_in] -> [..., d_out]
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, child = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), child


def target_names(model: Llama, targets: tuple[str, ...]) -> list[str]:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    if not names:
        raise ValueError(f"no linear modules named {targets} in the model")
    return names


def inject(model: Llama, targets: tuple[str, ...], rank: int, alpha: float, seed: int) -> dict[str, LoRALinear]:
    """Wrap the target projections in LoRALinear (in place). Module order fixes the RNG use."""
    g = torch.Generator().manual_seed(seed)
    wrapped = {}
    for name in target_names(model, targets):
        parent, child = _parent(model, name)
        wrapped[name] = LoRALinear(getattr(parent, child), rank, alpha, g)
        setattr(parent, child, wrapped[name])
    return wrapped


def eject(model: Llama, wrapped: dict[str, LoRALinear]) -> LoraAdapter:
    """Undo `inject` and return the trained factors as an adapter."""
    mods = {}
    for name, w in wrapped.items():
        parent, child = _parent(model, name)
        setattr(parent, child, w.base)
        mods[name] = LoraModule(w.lora_A.detach().clone(), w.lora_B.detach().clone(), w.scale)
    return LoraAdapter(mods)


@contextmanager
def applied(model: Llama, adapter: LoraAdapter | None) -> Iterator[Llama]:
    """Temporarily add the adapter's Δ into the model's weights (None: the base)."""
    if adapter is None:
        yield model
        return
    saved = {}
    try:
        for name, m in adapter.modules.items():
            lin = model.get_submodule(name)
            if not isinstance(lin, nn.Linear) or tuple(lin.weight.shape) != m.shape:
                raise ValueError(f"adapter module {name} {m.shape} does not fit the model")
            saved[name] = lin.weight.detach().clone()
            lin.weight.data += m.delta().to(lin.weight.dtype)
        yield model
    finally:
        for name, w in saved.items():
            model.get_submodule(name).weight.data.copy_(w)


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    # 4×64 tokens per step: 2.0 CPU-s per step on SmolLM2-135M (4×128: 4.8 s), so
    # 24 steps train an adapter in under a CPU-minute.
    steps: int = 24
    lr: float = 3e-3
    batch: int = 4
    seq_len: int = 64
    seed: int = 0  # A's initialisation (shared by all tasks)
    data_seed: int = 0  # which windows are drawn


def train(
    model: Llama, tokens: torch.Tensor, cfg: LoraConfig, progress: bool = True, desc: str = "lora"
) -> tuple[LoraAdapter, dict]:
    """Train a LoRA adapter on a 1-D token stream with next-token cross-entropy.

    AdamW, linear warm-up over the first tenth then cosine decay. The model is
    left unchanged (the wrappers are removed). Returns the adapter and a record.
    """
    from bitdelta.distill import token_windows

    wrapped = inject(model, cfg.targets, cfg.rank, cfg.alpha, cfg.seed)
    try:
        params = [p for w in wrapped.values() for p in (w.lora_A, w.lora_B)]
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        warm = max(1, cfg.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: (
                (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, cfg.steps - warm)))
            ),
        )
        windows = token_windows(tokens, cfg.seq_len + 1, cfg.steps * cfg.batch, cfg.data_seed)
        losses, t0, c0 = [], time.perf_counter(), time.process_time()
        bar = tqdm(range(cfg.steps), desc=desc, disable=not progress)
        for step in bar:
            x = windows[step * cfg.batch : (step + 1) * cfg.batch]  # [batch, seq_len + 1]
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        adapter = eject(model, wrapped)
    record = {
        "steps": cfg.steps,
        "lr": cfg.lr,
        "batch": cfg.batch,
        "seq_len": cfg.seq_len,
        "rank": cfg.rank,
        "alpha": cfg.alpha,
        "targets": list(cfg.targets),
        "seed": cfg.seed,
        "loss_first": losses[0],
        "loss_last_5": sum(losses[-5:]) / len(losses[-5:]),
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - c0, 1),
    }
    return adapter, record
