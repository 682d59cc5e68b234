"""The brief's "SVD soup": average several checkpoints' rank-r truncated task vectors.

    Δ_i = W_i − W0;  τ_i = U_i[:, :r] Σ_i[:r] V_i[:, :r]ᵀ   (best rank-r approximation)
    W = W0 + (1/n) Σ_i τ_i

for every parameter with ≥ 2 dims (viewed as [out, −1]); 1-D parameters take
the plain mean of their deltas. The brief calls this "MonoSoup", but MonoSoup
(arXiv:2602.09689) is a different, single-checkpoint method
(`bitdelta.merge.monosoup`). The brief uses the soup during training, merging
the current checkpoint with the best so far every N steps: `SoupHook`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm


def truncate(delta: torch.Tensor, rank: int) -> torch.Tensor:
    """Best rank-`rank` approximation (Eckart–Young) of a matrix, computed in fp32."""
    if rank < 1:
        raise ValueError(f"rank must be ≥ 1, got {rank}")
    d = delta.float()
    if rank >= min(d.shape):
        return d.clone()
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def svd_soup_tensor(w0: torch.Tensor, ws: list[torch.Tensor], rank: int) -> torch.Tensor:
    """W0 + mean_i truncate(W_i − W0, rank); returns w0's dtype."""
    if not ws:
        raise ValueError("svd soup of no checkpoints")
    if any(w.shape != w0.shape for w in ws):
        raise ValueError(f"shape mismatch: base {tuple(w0.shape)}, checkpoints {[tuple(w.shape) for w in ws]}")
    a0 = w0.float()
    if w0.dim() < 2:
        mean = sum(w.float() - a0 for w in ws) / len(ws)
    else:
        rows = w0.shape[0]
        mean = sum(truncate((w.float() - a0).reshape(rows, -1), rank) for w in ws).reshape(w0.shape) / len(ws)
    return (a0 + mean).to(w0.dtype)


def svd_soup_checkpoints(
    base: str | os.PathLike,
    checkpoints: list[str | os.PathLike],
    rank: int,
    out: str | os.PathLike,
    progress: bool = True,
) -> Path:
    """The soup of whole checkpoints, one parameter (times n checkpoints) in memory at a time."""
    from bitdelta.checkpoint import CheckpointReader
    from bitdelta.merge.io import ShardedWriter, check_same_keys

    if not checkpoints:
        raise ValueError("svd-soup needs at least one checkpoint")
    readers = [CheckpointReader(c) for c in checkpoints]
    try:
        with CheckpointReader(base) as r0, ShardedWriter(out, checkpoints[0]) as w:
            for c, r in zip(checkpoints, readers):
                check_same_keys(r0.keys(), r.keys(), c)
            for name in tqdm(r0.keys(), desc=f"svd-soup rank {rank}", disable=not progress):
                w.add(name, svd_soup_tensor(r0.get(name), [r.get(name) for r in readers], rank))
            return w.close()
    finally:
        for r in readers:
            r.close()


class SoupHook:
    """Call `hook(step, model)` after each optimiser step; every `every` steps it
    soups the current weights with the best so far (the brief's training use).

        best ← current                                  (first call)
        merged = W0 + ½ (trunc_r(best − W0) + trunc_r(current − W0))
        best ← the lowest-loss of {best, current, merged} when `evaluate`
               is given (a callable returning a validation loss of `model`
               as it is now), else merged
        the model continues from merged (write_back=True)

    `base` is W0 as a {name: tensor} dict over the parameters to soup (all
    parameters of `model` that it names). Returns a record on merge steps.
    """

    def __init__(
        self,
        base: dict[str, torch.Tensor],
        rank: int,
        every: int,
        evaluate: Callable[[], float] | None = None,
        write_back: bool = True,
    ):
        if every < 1:
            raise ValueError("every must be ≥ 1")
        self.base = {k: v.detach().float().clone() for k, v in base.items()}
        self.rank, self.every, self.evaluate, self.write_back = rank, every, evaluate, write_back
        self.best: dict[str, torch.Tensor] | None = None
        self.best_loss: float | None = None
        self.history: list[dict] = []

    def _params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        params = dict(model.named_parameters())
        missing = set(self.base) - set(params)
        if missing:
            raise ValueError(f"the model has no parameters {sorted(missing)[:5]}")
        return {k: params[k] for k in self.base}

    def _snapshot(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: p.detach().float().clone() for k, p in self._params(model).items()}

    @torch.no_grad()
    def _load(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        for k, p in self._params(model).items():
            p.copy_(state[k].to(p.dtype))

    @torch.no_grad()
    def __call__(self, step: int, model: nn.Module) -> dict | None:
        if step % self.every:
            return None
        current = self._snapshot(model)
        if self.best is None:
            self.best = current
            self.best_loss = self.evaluate() if self.evaluate else None
            rec = {"step": step, "kept": "current", "loss": self.best_loss}
            self.history.append(rec)
            return rec
        merged = {k: svd_soup_tensor(self.base[k], [self.best[k], current[k]], self.rank) for k in current}
        rec: dict = {"step": step}
        if self.evaluate is None:
            self.best, rec["kept"] = merged, "merged"
        else:
            cur_loss = self.evaluate()
            self._load(model, merged)
            merged_loss = self.evaluate()
            cands = [
                ("best", self.best_loss, self.best),
                ("current", cur_loss, current),
                ("merged", merged_loss, merged),
            ]
            name, loss, state = min(cands, key=lambda c: c[1])
            self.best, self.best_loss = state, loss
            rec.update(kept=name, loss_best_before=cands[0][1], loss_current=cur_loss, loss_merged=merged_loss)
        self._load(model, merged if self.write_back else current)
        self.history.append(rec)
        return rec
