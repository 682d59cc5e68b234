"""Compression beyond one sign plane: residual sign planes, a low-rank residual and per-column α,
spent under one byte budget for the whole delta.

For one weight's delta Δ [d_out, d_in] the options form a chain, each taken only after the one
before it:

    plane 1: S₁ = sign(Δ), α₁          (the α axis per plane: "row", "matrix", "col" or the best of them)
    plane 2: S₂ = sign(R₁), α₂         R_i = Δ − Σ_{j≤i} α_j ⊙ S_j (BitDelta's "varying fidelity")
    ...      up to `planes`
    rank chunks of `rank_step`: the top singular directions of the residual after the last plane,
             kept as fp16 U [d_out, r] · V [r, d_in], up to `rank`

Each option's gain is how much it lowers the squared error of the layer's OUTPUT on calibration
inputs, Σ_k E[x_k²] · Σ_n (R_nk² − R'_nk²) (with no calibration, E[x²] = 1: the Frobenius
error), so gains of different layers compare. Every weight gets plane 1 (BitDelta itself: a
weight left without it costs far more than its bytes, measured on the hard family member), unless
the budget is below that and `drop` leaves weights out by the KL their plane 1 is measured to be
worth per byte: measured per kind of weight (all layers' q_proj left out at once), whole kinds
left out first, the least KL per byte of the kind first, and only the last kind needed in part,
its weights ranked by the output error (neither the output error nor the diagonal Fisher ranks
kinds: both rate the embedding ~10x too high against the projections, and dropping weights by
either alone on the hard member doubled KL against leaving out one measured kind). The rest of a
budget in bytes is spent greedily: always the option with the most gain per byte among every
weight's next one, so hard matrices get 2–3 planes and easy ones 1. Without a budget every
weight gets the whole chain.
α's are closed-form for the fixed signs (weighted mean of |R| along the axis); scale
distillation (`bitdelta.distill`) then tunes every plane's α and the low-rank factors jointly.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

import torch

from bitdelta.format import AXES, CompressedWeight, SignPlane
from kernels.bits import pack_signs, unpack_signs

ALPHA_CHOICES = (*AXES, "auto")  # "auto": per plane, the axis with the least error
# Bump when what `chain`/`spend` choose changes, so the family's stamped deltas are rebuilt.
# 2: plane 1 of every weight first, the embeddings compete for the rest like the projections;
# 3: the embeddings' planes scale rows (per token) whatever `alpha` says.
# 4: the budget pays the file's header too (a 1/16 budget made a file of 1/15.9).
# 5: a budget below plane 1 of every weight leaves out whole kinds first (`left_out`).
ALGORITHM_VERSION = 5


@dataclass(frozen=True)
class PlaneConfig:
    """How to compress each weight: α axis, at most `planes` sign planes and a low-rank residual of
    at most `rank` (in steps of `rank_step`), within `budget` bytes for the whole delta (None:
    every weight gets all of it)."""

    alpha: str = "row"
    planes: int = 1
    rank: int = 0
    rank_step: int = 8
    budget: int | None = None
    # When plane 1 of every weight does not fit `budget`: leave weights out, the ones whose plane 1
    # is worth the least KL(ft ‖ ·) per byte (measured per kind of weight on calibration tokens,
    # `kind_kl`, shared within a kind by the output signal, `left_out`), until it does.
    drop: bool = False

    def __post_init__(self):
        if self.alpha not in ALPHA_CHOICES:
            raise ValueError(f"alpha must be one of {', '.join(ALPHA_CHOICES)}, not {self.alpha!r}")
        if self.planes < 1 or self.rank < 0 or self.rank_step < 1:
            raise ValueError(f"planes must be ≥ 1 and rank ≥ 0 (got planes={self.planes}, rank={self.rank})")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"budget must be ≥ 0 bytes, not {self.budget}")

    @property
    def plain(self) -> bool:
        """One plane of row or matrix α, no low-rank, no budget: BitDelta as the paper has it."""
        return self.planes == 1 and self.rank == 0 and self.alpha in ("row", "matrix") and self.budget is None


def best_plane(r: torch.Tensor, w: torch.Tensor, alpha: str) -> tuple[SignPlane, float]:
    """The sign plane of residual r [d_out, d_in] fp32 under input weights w [d_in]: (plane, the
    weighted squared error it removes). alpha: an axis, or "auto" for the one with the least error."""
    a = r.abs()
    total = float((r.square() * w).sum())
    cands = {}
    for axis in AXES if alpha == "auto" else (alpha,):
        if axis == "row":
            al = (a * w).sum(1) / w.sum()
            approx = al[:, None]
        elif axis == "matrix":
            al = ((a * w).sum() / (w.sum() * r.shape[0])).reshape(1)
            approx = al.reshape(1, 1)
        else:
            al = a.mean(0)
            approx = al[None, :]
        err = float(((a - approx).square() * w).sum())
        cands[axis] = (err, al)
    axis = min(cands, key=lambda k: cands[k][0])
    err, al = cands[axis]
    return SignPlane(pack_signs(r), al.float().contiguous(), axis), total - err


@dataclass
class _Chain:
    """One weight's options, in order, and how far the greedy took it."""

    shape: tuple[int, int]
    planes: list[SignPlane] = field(default_factory=list)
    plane_gain: list[float] = field(default_factory=list)
    u: torch.Tensor | None = None  # fp16 [d_out, rank]
    v: torch.Tensor | None = None  # fp16 [rank, d_in]
    rank_gain: list[float] = field(default_factory=list)  # per chunk of rank_step
    rank_step: int = 8
    taken: int = 0  # options taken: planes first, then rank chunks

    def cost(self, i: int) -> int:
        d_out, d_in = self.shape
        if i < len(self.planes):
            return self.planes[i].nbytes
        return self.rank_step * (d_out + d_in) * 2

    def gain(self, i: int) -> float:
        return self.plane_gain[i] if i < len(self.planes) else self.rank_gain[i - len(self.planes)]

    @property
    def options(self) -> int:
        return len(self.planes) + len(self.rank_gain)

    def result(self) -> CompressedWeight | None:
        k = min(self.taken, len(self.planes))
        if k == 0:
            return None
        r = (self.taken - k) * self.rank_step
        u, v = (self.u[:, :r].contiguous(), self.v[:r].contiguous()) if r else (None, None)
        return CompressedWeight(self.planes[:k], self.shape, u, v)


def chain(delta: torch.Tensor, cfg: PlaneConfig, w: torch.Tensor | None = None) -> _Chain:
    """Every option of one weight (see the module docstring); w: E[x²] per input column (None: 1)."""
    r = delta.float().clone()
    d_out, d_in = r.shape
    w = torch.ones(d_in) if w is None else w.float().clamp_min(1e-12)
    c = _Chain((d_out, d_in), rank_step=cfg.rank_step)
    for _ in range(cfg.planes):
        plane, gain = best_plane(r, w, cfg.alpha)
        c.planes.append(plane)
        c.plane_gain.append(gain)
        r -= unpack_signs(plane.signs, d_in, torch.float32) * plane.scale()
    rank = min(cfg.rank, d_out, d_in)
    if rank:
        sw = w.sqrt()
        U, S, Vh = torch.linalg.svd(r * sw, full_matrices=False)
        rank -= rank % cfg.rank_step
        root = S[:rank].sqrt()
        c.u = (U[:, :rank] * root).half()
        c.v = (root[:, None] * Vh[:rank] / sw).half()
        sq = S[:rank].square()
        c.rank_gain = [float(sq[i : i + cfg.rank_step].sum()) for i in range(0, rank, cfg.rank_step)]
    return c


def spend(chains: dict[str, _Chain], budget: int | None) -> dict[str, CompressedWeight]:
    """Plane 1 of every weight, then the other options greedily by gain per byte until `budget`
    (None: all of them). ValueError when the budget does not cover plane 1 of every weight."""
    if budget is None:
        for c in chains.values():
            c.taken = c.options
    else:
        first = sum(c.cost(0) for c in chains.values())
        if first > budget:
            raise ValueError(f"a budget of {budget} bytes is less than one sign plane per weight ({first} bytes)")
        left = budget - first
        for c in chains.values():
            c.taken = 1
        heap = [(-c.gain(1) / c.cost(1), name) for name, c in chains.items() if c.options > 1]
        heapq.heapify(heap)
        while heap:
            _, name = heapq.heappop(heap)
            c = chains[name]
            cost = c.cost(c.taken)
            if cost > left:
                continue  # this weight's chain stops here; cheaper options elsewhere may still fit
            left -= cost
            c.taken += 1
            if c.taken < c.options:
                heapq.heappush(heap, (-c.gain(c.taken) / c.cost(c.taken), name))
    return {name: cw for name, c in chains.items() if (cw := c.result()) is not None}


@torch.no_grad()
def input_power(base, tokens: torch.Tensor, windows: int = 8, seq_len: int = 128) -> dict[str, torch.Tensor]:
    """E[x²] per input column of every linear layer of the base model (a `Llama`) on calibration
    tokens (1-D): param name ("….weight") -> fp32 [d_in]; `windows` evenly spread windows."""
    from torch import nn

    n = max(1, min(windows, tokens.numel() // (seq_len + 1)))
    starts = torch.linspace(0, tokens.numel() - seq_len - 1, n).long().tolist()
    x = torch.stack([tokens[s : s + seq_len] for s in starts])
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in base.named_modules():
        if isinstance(mod, nn.Linear):

            def hook(m, inp, out, name=name):
                a = inp[0].reshape(-1, inp[0].shape[-1]).float()
                sums[name + ".weight"] = sums.get(name + ".weight", 0) + a.square().mean(0)

            hooks.append(mod.register_forward_hook(hook))
    try:
        for i in range(n):
            base(x[i : i + 1])
    finally:
        for h in hooks:
            h.remove()
    return {k: v / n for k, v in sums.items()}


def kind(name: str) -> str:
    """A weight's kind: its name without the layer index ("model.layers.*.mlp.down_proj.weight")."""
    return re.sub(r"\.\d+\.", ".*.", name)


@torch.no_grad()
def kind_kl(
    base, finetuned, chains: dict[str, _Chain], tokens: torch.Tensor, windows: int = 8, seq_len: int = 128
) -> dict[str, float]:
    """Per kind of weight, the KL(fine-tune ‖ ·) per token that leaving out the plane 1 of every
    weight of that kind adds to base + every weight's plane 1; `base` and `finetuned` are `Llama`s
    (`base` is changed in place), measured on `windows` evenly spread windows of `tokens` (1-D)."""
    from bitdelta.evaluate import kl_per_token

    n = max(1, min(windows, tokens.numel() // (seq_len + 1)))
    starts = torch.linspace(0, tokens.numel() - seq_len - 1, n).long().tolist()
    x = torch.stack([tokens[s : s + seq_len] for s in starts])
    ref = [finetuned(x[i : i + 1]).float().log_softmax(-1) for i in range(n)]
    params = dict(base.named_parameters())

    def plane1(name: str, sign: float) -> None:
        p, d_in = chains[name].planes[0], chains[name].shape[1]
        w = params[name]
        w.add_((sign * unpack_signs(p.signs, d_in, torch.float32) * p.scale()).to(w.dtype))

    def kl() -> float:
        return sum(float(kl_per_token(ref[i], base(x[i : i + 1]).float().log_softmax(-1)).mean()) for i in range(n)) / n

    for name in chains:
        plane1(name, 1.0)
    every = kl()
    out = {}
    for k in sorted({kind(name) for name in chains}):
        names = [name for name in chains if kind(name) == k]
        for name in names:
            plane1(name, -1.0)
        out[k] = kl() - every
        for name in names:
            plane1(name, 1.0)
    return out


def left_out(chains: dict[str, _Chain], kl: dict[str, float], budget: int) -> list[str]:
    """The weights to leave out so that plane 1 of every other weight fits `budget`: whole kinds
    first, the least measured KL (`kind_kl`) per byte of the whole kind first; only the last kind
    needed is left out in part, its weights ranked by their share of the kind's KL (their plane 1's
    output gain: the output signal ranks weights of one kind, not kinds; sharing every kind's KL
    this way left out 10 down_proj and 1 o_proj on the hard member, KL 0.084, where all its q_proj
    cost 0.013). ValueError when not even one weight's plane 1 would be left."""
    kinds: dict[str, list[str]] = {}
    for name in chains:
        kinds.setdefault(kind(name), []).append(name)
    cost = {k: sum(chains[n].cost(0) for n in names) for k, names in kinds.items()}
    need = sum(cost.values()) - budget
    out: list[str] = []
    for k in sorted(kinds, key=lambda k: max(kl[k], 0.0) / cost[k]):
        if need <= 0:
            break
        names = kinds[k]
        if cost[k] > need:  # the last kind needed: its weights with the least output gain per byte first
            names = sorted(names, key=lambda n: max(chains[n].plane_gain[0], 0.0) / chains[n].cost(0))
        for name in names:
            if need <= 0:
                break
            out.append(name)
            need -= chains[name].cost(0)
    if need > 0 or len(out) == len(chains):
        raise ValueError(f"a budget of {budget} bytes leaves no weight its sign plane")
    return out
