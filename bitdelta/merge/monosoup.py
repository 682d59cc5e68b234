"""MonoSoup (arXiv:2602.09689): re-weight the spectrum of ONE fine-tune's task vector.

For each parameter with ≥ 2 dims (viewed as [out, −1]), in fp32:

    Δ = W1 − W0 = U Σ Vᵀ;  p_i = σ_i / Σσ
    k = ⌈exp(−Σ p_i log p_i)⌉ clamped to [1, rank]      (rule "entropy")
      or the smallest k with Σ_{i≤k} σ² / Σσ² ≥ 0.8     (rule "energy")
    Δ_high = U_k Σ_k V_kᵀ;  Δ_low = Δ − Δ_high
    P_k = Σ_{i≤k} σ² / Σσ²;  ρ = (σ_{k+1} / σ_1)² (0 when k = rank);  cos α = √(1 − P_k)
    λ_low = clamp(ρ + (1 − ρ) cos α, 0, 1);  λ_high = 1 − λ_low
    W = W0 + λ_high Δ_high + λ_low Δ_low

1-D parameters keep W1; a matrix with ‖Δ‖_F / ‖W0‖_F < 1e-6 keeps W1 too.
No data, no hyper-parameters. This is NOT the brief's multi-checkpoint "SVD
soup" (see `bitdelta.merge.svdsoup`).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

MIN_REL_UPDATE = 1e-6  # the paper's skip rule for untouched layers
ENERGY_THRESHOLD = 0.8  # the paper's value for the energy rule
_EPS = 1e-12


@dataclass
class LayerInfo:
    """What MonoSoup did to one parameter."""

    k: int
    rank: int
    p_k: float
    rho: float
    lambda_high: float
    lambda_low: float
    skipped: str = ""  # why the parameter kept W1, if it did


def choose_k(s: torch.Tensor, rule: str = "entropy", energy: float = ENERGY_THRESHOLD) -> int:
    """How many leading singular directions form Δ_high. s: singular values, descending."""
    rank = s.numel()
    if rule == "entropy":
        p = s / s.sum()
        p = p[p > 0]
        eff = math.exp(float(-(p * p.log()).sum()))
        return int(min(max(math.ceil(eff - 1e-9), 1), rank))  # 1e-9: exp(log n) may round above n
    if rule == "energy":
        sq = s.double().square()
        cum = sq.cumsum(0) / sq.sum()
        return int(min(int(torch.searchsorted(cum, torch.tensor([energy], dtype=cum.dtype))[0]) + 1, rank))
    raise ValueError(f"unknown rank rule {rule!r}: use 'entropy' or 'energy'")


def monosoup_matrix(
    w0: torch.Tensor, w1: torch.Tensor, rule: str = "entropy", energy: float = ENERGY_THRESHOLD
) -> tuple[torch.Tensor, LayerInfo]:
    """MonoSoup of one parameter; returns (W in w1's dtype, what was done)."""
    if w0.shape != w1.shape:
        raise ValueError(f"shape mismatch {tuple(w0.shape)} vs {tuple(w1.shape)}")
    if w1.dim() < 2:
        return w1.clone(), LayerInfo(0, 0, 1.0, 0.0, 1.0, 0.0, skipped="1-D")
    shape = w1.shape
    dt = torch.float64 if torch.float64 in (w0.dtype, w1.dtype) else torch.float32  # fp16/bf16 -> fp32 SVD
    a0 = w0.reshape(shape[0], -1).to(dt)  # [out, in·…]
    delta = w1.reshape(shape[0], -1).to(dt) - a0
    dn, bn = float(delta.norm()), float(a0.norm())
    if dn < _EPS or (bn > _EPS and dn / bn < MIN_REL_UPDATE):
        return w1.clone(), LayerInfo(0, min(delta.shape), 1.0, 0.0, 1.0, 0.0, skipped="tiny delta")
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    rank = s.numel()
    k = choose_k(s, rule, energy)
    sq = s.square()
    p_k = float(sq[:k].sum() / sq.sum())
    rho = float((s[k] / s[0]) ** 2) if k < rank else 0.0
    cos_a = math.sqrt(min(max(1.0 - p_k, 0.0), 1.0))
    lam_low = min(max(rho + (1.0 - rho) * cos_a, 0.0), 1.0)
    lam_high = 1.0 - lam_low
    d_high = (u[:, :k] * s[:k]) @ vh[:k]
    d_low = delta - d_high
    w = a0 + lam_high * d_high + lam_low * d_low
    return w.reshape(shape).to(w1.dtype), LayerInfo(k, rank, p_k, rho, lam_high, lam_low)


def monosoup_checkpoint(
    base: str | os.PathLike,
    finetuned: str | os.PathLike,
    out: str | os.PathLike,
    rule: str = "entropy",
    energy: float = ENERGY_THRESHOLD,
    progress: bool = True,
) -> tuple[Path, dict[str, dict]]:
    """MonoSoup of a whole checkpoint, one parameter in memory at a time.

    Writes a Hugging Face checkpoint (the fine-tune's config and tokenizer) and
    returns it with a per-parameter record (k, λ's); the record is also saved
    as monosoup.json beside the weights.
    """
    import json

    from bitdelta.checkpoint import CheckpointReader
    from bitdelta.merge.io import ShardedWriter, check_same_keys

    record: dict[str, dict] = {}
    with CheckpointReader(base) as r0, CheckpointReader(finetuned) as r1, ShardedWriter(out, finetuned) as w:
        check_same_keys(r0.keys(), r1.keys(), finetuned)
        bar = tqdm(r1.keys(), desc=f"monosoup {Path(finetuned).name}", disable=not progress)
        for name in bar:
            merged, info = monosoup_matrix(r0.get(name), r1.get(name), rule, energy)
            w.add(name, merged)
            record[name] = asdict(info)
            if not info.skipped:
                bar.set_postfix(k=info.k, lam_high=f"{info.lambda_high:.2f}")
        path = w.close()
    (path / "monosoup.json").write_text(json.dumps({"rule": rule, "energy": energy, "layers": record}, indent=1))
    return path, record
