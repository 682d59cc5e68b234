"""OPCM (arXiv:2501.09522): sequential merging by orthogonal projection, constant memory.

Task vectors τ_t = θ_t − θ0 arrive one at a time. Start: τ_merged = τ_1, λ_1 = 1.
For each new τ_t, per linear layer's weight (viewed as [out, −1]):

    τ_merged = U Σ Vᵀ   (full SVD: U [m, m], V [n, n])
    r = first index i with cumsum(σ)_i / Σσ > α      (α = 0.5)
    P = Uᵀ τ_t V;  P_ii = 0 for all i;  P[:r, :r] = 0;  τ̃ = U P Vᵀ

other parameters (norms, embeddings): τ̃ = τ_t. Then, with norms over the whole model,

    λ_t = ‖λ_{t−1} τ_merged + τ̃‖ / mean_{i≤t} ‖τ_i‖
    τ_merged ← (λ_{t−1} τ_merged + τ̃) / λ_t

so ‖τ_merged‖ = mean_{i≤t} ‖τ_i‖ after every step (checked at run time).
The zeroed blocks remove the new task's components along the merged
vector's leading singular directions and their diagonal couplings, which is
where the new task would interfere with the tasks already merged.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from tqdm import tqdm

DEFAULT_ALPHA = 0.5  # the paper's split of the merged spectrum
NORM_RTOL = 1e-4  # fp32 norms over ~1e8 elements agree to ~1e-6; leave room


def project(tau_merged: torch.Tensor, tau_new: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """τ̃: the new task vector with its interfering components removed (fp32, tau_new's shape).

    Only P's diagonal and its top-left r×r block are zeroed, and both lie in
    the first q = min(m, n) rows and columns, so
        τ̃ = τ_t − U_q (P_q ∘ mask) V_qᵀ,   P_q = U_qᵀ τ_t V_q
    with the thin SVD gives the full-SVD formula's result without forming the
    [m, m] U (which would be 9 GB for a 49152-row LM head).
    """
    if tau_merged.shape != tau_new.shape:
        raise ValueError(f"shape mismatch {tuple(tau_merged.shape)} vs {tuple(tau_new.shape)}")
    if tau_new.dim() < 2:
        return tau_new.float().clone()
    rows = tau_new.shape[0]
    m = tau_merged.reshape(rows, -1).float()  # [m, n]
    t = tau_new.reshape(rows, -1).float()
    u, s, vh = torch.linalg.svd(m, full_matrices=False)  # u [m, q], s [q], vh [q, n]
    total = s.sum()
    if total <= 0:  # nothing merged here yet: nothing to be orthogonal to
        return t.reshape(tau_new.shape).clone()
    r = int((s.cumsum(0) / total > alpha).float().argmax())
    p = u.T @ t @ vh.T  # [q, q]
    mask = torch.zeros_like(p, dtype=torch.bool)
    mask.diagonal().fill_(True)
    mask[:r, :r] = True
    removed = u @ (p * mask) @ vh  # [m, n]
    return (t - removed).reshape(tau_new.shape)


def is_linear_weight(name: str, t: torch.Tensor) -> bool:
    """Which parameters OPCM projects: linear layers' weights (not embeddings, not 1-D)."""
    return t.dim() >= 2 and "embed" not in name


def global_norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


class OPCM:
    """The OPCM merger over {name: task vector} dicts, fed one task at a time.

    >>> m = OPCM(); m.add(tau1); m.add(tau2); m.merged  # θ = θ0 + m.merged
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA):
        self.alpha = alpha
        self.merged: dict[str, torch.Tensor] | None = None
        self.lam = 1.0
        self.norms: list[float] = []

    def add(self, tau: dict[str, torch.Tensor], progress: bool = False) -> None:
        tau_norm = global_norm(tau.values())
        if self.merged is None:
            self.merged = {k: v.float().clone() for k, v in tau.items()}
            self.norms, self.lam = [tau_norm], 1.0
            return
        if set(tau) != set(self.merged):
            raise ValueError(
                f"task vector names differ from the merged ones: {sorted(set(tau) ^ set(self.merged))[:5]}"
            )
        combined = {}
        for k in tqdm(list(tau), desc="opcm", disable=not progress):
            t = tau[k].float()
            t_tilde = project(self.merged[k], t, self.alpha) if is_linear_weight(k, t) else t
            combined[k] = self.lam * self.merged[k] + t_tilde
        self.norms.append(tau_norm)
        target = sum(self.norms) / len(self.norms)
        lam_t = global_norm(combined.values()) / target
        self.merged = {k: v / lam_t for k, v in combined.items()}
        self.lam = lam_t
        check_norm(global_norm(self.merged.values()), target)


def check_norm(merged_norm: float, target: float) -> None:
    """OPCM's invariant: the merged task vector's norm is the mean of the individual norms."""
    if not math.isclose(merged_norm, target, rel_tol=NORM_RTOL, abs_tol=1e-12):
        raise AssertionError(f"OPCM invariant broken: ‖τ_merged‖ = {merged_norm:.6g}, mean ‖τ_i‖ = {target:.6g}")


def opcm_checkpoints(
    base: str | os.PathLike,
    checkpoints: list[str | os.PathLike],
    out: str | os.PathLike,
    alpha: float = DEFAULT_ALPHA,
    progress: bool = True,
) -> Path:
    """OPCM over whole checkpoints in the given order.

    Memory: the merged task vector and one checkpoint's task vector (fp32),
    independent of the number of checkpoints. The λ rescaling needs the norm
    over the whole model, so the merged vector is held whole.
    """
    from bitdelta.checkpoint import CheckpointReader
    from bitdelta.merge.io import ShardedWriter, check_same_keys

    merger = OPCM(alpha)
    with CheckpointReader(base) as r0:
        for c in tqdm(checkpoints, desc="opcm checkpoints", disable=not progress):
            with CheckpointReader(c) as r:
                check_same_keys(r0.keys(), r.keys(), c)
                tau = {k: r.get(k).float() - r0.get(k).float() for k in r0.keys()}
            merger.add(tau, progress=progress)
            del tau
        with ShardedWriter(out, checkpoints[0]) as w:
            for k in r0.keys():
                w0 = r0.get(k)
                w.add(k, (w0.float() + merger.merged[k]).to(w0.dtype))
            return w.close()
