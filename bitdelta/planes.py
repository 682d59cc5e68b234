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
error), so gains of different layers compare; they rank weights of one kind, not kinds (both the
output error and the diagonal Fisher rate the embedding ~10x too high against the projections).

Without `drop`, every weight gets plane 1 (BitDelta itself) and the rest of the budget goes
greedily to the option with the most gain per byte among every weight's next one, so hard
matrices get 2–3 planes and easy ones 1. With `drop`, the budget is first spent by KL measured
per kind of weight (`kind_kl`: what all layers' plane 1 of the kind is worth, and what their
second option removes, against base + every plane 1), in blocks of one kind's option on all its
layers, the most KL per byte first (`spend`): a cheap kind's plane 1 (q_proj) can lose to another
kind's plane 2, and a budget below plane 1 of every weight leaves out whole kinds, only the last
one needed in part (sharing each kind's KL among its weights by output error instead left out 10
down_proj on the hard member, KL 0.084, where all its q_proj cost 0.013). Without a budget every
weight gets the whole chain.
α's are closed-form for the fixed signs (weighted mean of |R| along the axis); scale
distillation (`bitdelta.distill`) then tunes every plane's α and the low-rank factors jointly.

With `feedback`, a projection's planes are not sign(R) and mean|R|: they minimise the error of the
layer's output on the calibration inputs, Σ_n e_n H e_nᵀ with H = E[x xᵀ] (`input_moments`),
not only its diagonal. The signs are chosen column by column and each column's rounding error is
spread over the later columns through H⁻¹ (GPTQ's update, Frantar et al. 2022, applied to the
delta's one bit), and the row α's are refitted to the output error, alternately
(`feedback_plane`). The file, its bytes and the kernels that serve it are the same; at 1/16 the
undistilled held-out KL on the hard member goes from 0.0677 to 0.0326, on the other four members
4–12× lower (reports/hard-member, gentle-1-16, math-1-16). A compressed LM head's signs are chosen
so too, under its inputs; a tied embedding/LM head's under those and its own rows' error as a
lookup (`embedding_moments`).
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field

import torch

from bitdelta.format import AXES, CompressedWeight, SignPlane
from bitdelta_kernels.bits import pack_signs, unpack_signs

ALPHA_CHOICES = (*AXES, "auto")  # "auto": per plane, the axis with the least error
# Bump when what `chain`/`spend` choose changes, so the family's stamped deltas are rebuilt.
# 2: plane 1 of every weight first, the embeddings compete for the rest like the projections;
# 3: the embeddings' planes scale rows (per token) whatever `alpha` says.
# 4: the budget pays the file's header too (a 1/16 budget made a file of 1/15.9).
# 5: a budget below plane 1 of every weight leaves out whole kinds first (`left_out`).
# 6: `drop` spends the budget by measured KL per byte of each kind's plane 1 and second option.
# 7: the budget keeps compress.RECORD_RESERVE bytes free for the distillation record.
# 8: the header names error-feedback signs (`signs`: "feedback"); the same tensors.
# 9: with `feedback`, the embedding/LM head's signs too (`embedding_moments`).
# (`feedback` changed nothing without it: its stamps name it only when on, build.delta_recipe.)
ALGORITHM_VERSION = 9


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
    # Spend `budget` by the KL(ft ‖ ·) per byte measured per kind of weight on calibration tokens
    # (`kind_kl`, `spend`): a kind's plane 1 against another's plane 2, and weights left out (they
    # stay the base's) when that is worth least, as it must be when plane 1 of every weight does not fit.
    drop: bool = False
    # The signs chosen column by column with error feedback under the calibration inputs' second
    # moments (the embeddings': `embedding_moments`), and the row α's fitted to the output error
    # (`feedback_plane`), instead of sign(Δ) and mean|Δ|: the same bytes and file, served by the
    # same kernels.
    feedback: bool = False

    def __post_init__(self):
        if self.alpha not in ALPHA_CHOICES:
            raise ValueError(f"alpha must be one of {', '.join(ALPHA_CHOICES)}, not {self.alpha!r}")
        if self.planes < 1 or self.rank < 0 or self.rank_step < 1:
            raise ValueError(f"planes must be ≥ 1 and rank ≥ 0 (got planes={self.planes}, rank={self.rank})")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"budget must be ≥ 0 bytes, not {self.budget}")
        if self.feedback and self.alpha != "row":
            raise ValueError(f"error-feedback signs fit one α per row (alpha='row'), not alpha={self.alpha!r}")

    @property
    def plain(self) -> bool:
        """One plane of row or matrix α, no low-rank, no budget: BitDelta as the paper has it."""
        return (
            self.planes == 1
            and self.rank == 0
            and self.alpha in ("row", "matrix")
            and self.budget is None
            and not self.feedback
        )


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


# signs, then α's, twice: on 21 of the hard member's projections (layers 0, 15, 29) the second
# round lowered the output error by 0–17 %, by 27–47 % on two o_proj (further rounds not measured)
FEEDBACK_ROUNDS = 2
FEEDBACK_DAMP = 0.01  # × the mean of h's diagonal, added to it before the Cholesky factor (GPTQ's)
FEEDBACK_BLOCK = 128  # columns updated lazily in blocks (GPTQ's): the same result up to rounding


def _output_error(e: torch.Tensor, h: torch.Tensor) -> float:
    """Σ_n e_n h e_nᵀ over the rows of e [d_out, d_in]: the squared output error of weights off by e
    on inputs whose second moments are h [d_in, d_in]."""
    return float((e @ h * e).sum())


def _fit_alpha(r: torch.Tensor, s: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Per row n, the α minimising (r_n − α s_n) h (r_n − α s_n)ᵀ for signs s [d_out, d_in] (±1)."""
    sh = s @ h
    return (sh * r).sum(1) / (sh * s).sum(1).clamp_min(torch.finfo(r.dtype).tiny)


def _feedback_factor(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of the damped h's inverse, which spreads a column's error over the
    later ones (`_feedback_signs`; one per h, whatever the rounds)."""
    d_in = h.shape[0]
    damped = h + FEEDBACK_DAMP * h.diagonal().mean().clamp_min(1e-12) * torch.eye(d_in, dtype=h.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)


def _feedback_signs(r: torch.Tensor, alpha: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Signs ±1 [d_out, d_in] for r ≈ α ⊙ S, chosen column by column: each column's sign rounds the
    residual's column after the error of the columns before it has been spread over the rest by
    the inverse of h (GPTQ's update, the optimal correction of the later columns for the output
    error under h; u = `_feedback_factor(h)`). Works on rᵀ, where a column is a contiguous row:
    1.6–1.7 × faster than on r (SmolLM2's 576 × 1536 and 1536 × 576, one thread), the same signs."""
    d_out, d_in = r.shape
    w = r.t().contiguous()  # [d_in, d_out]
    s = torch.empty_like(w)
    a = alpha.reshape(-1)
    err = torch.empty(FEEDBACK_BLOCK, d_out, dtype=r.dtype)
    for i0 in range(0, d_in, FEEDBACK_BLOCK):
        i1 = min(i0 + FEEDBACK_BLOCK, d_in)
        for j in range(i0, i1):
            s[j] = torch.where(w[j] >= 0, 1.0, -1.0)
            e = err[j - i0]
            torch.sub(w[j], a * s[j], out=e).div_(u[j, j])
            w[j + 1 : i1].addr_(u[j, j + 1 : i1], e, alpha=-1)  # the block's later columns
        w[i1:].addmm_(u[i0:i1, i1:].t(), err[: i1 - i0], alpha=-1)  # the columns after the block, lazily
    return s.t()


def feedback_plane(r: torch.Tensor, h: torch.Tensor) -> tuple[SignPlane, float]:
    """The row-α sign plane of residual r [d_out, d_in] for inputs whose second moments are
    h [d_in, d_in] (E[x xᵀ]): signs by error feedback (`_feedback_signs`) and α's fitted to the
    output error, alternately, starting from sign(r): (plane, the output error it removes,
    Σ_n r_n h r_nᵀ − the same of the residual). With h = I it is sign(r) and mean|r| exactly."""
    r64, h64 = r.double(), h.double()
    s = torch.where(r64 >= 0, 1.0, -1.0).double()
    alpha = _fit_alpha(r64, s, h64)
    u = _feedback_factor(h64)
    for _ in range(FEEDBACK_ROUNDS):
        s = _feedback_signs(r64, alpha, u)
        alpha = _fit_alpha(r64, s, h64)
    removed = _output_error(r64, h64) - _output_error(r64 - alpha[:, None] * s, h64)
    return SignPlane(pack_signs(s), alpha.float().contiguous(), "row"), removed


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

    def option(self, i: int) -> torch.Tensor:
        """Option i's term of the reconstruction: fp32 [d_out, d_in]."""
        if i < len(self.planes):
            p = self.planes[i]
            return unpack_signs(p.signs, self.shape[1], torch.float32) * p.scale()
        j = (i - len(self.planes)) * self.rank_step
        return self.u[:, j : j + self.rank_step].float() @ self.v[j : j + self.rank_step].float()

    def result(self) -> CompressedWeight | None:
        k = min(self.taken, len(self.planes))
        if k == 0:
            return None
        r = (self.taken - k) * self.rank_step
        u, v = (self.u[:, :r].contiguous(), self.v[:r].contiguous()) if r else (None, None)
        return CompressedWeight(self.planes[:k], self.shape, u, v)


def chain(
    delta: torch.Tensor, cfg: PlaneConfig, w: torch.Tensor | None = None, h: torch.Tensor | None = None
) -> _Chain:
    """Every option of one weight (see the module docstring); w: E[x²] per input column (None: 1);
    h: E[x xᵀ] [d_in, d_in], which makes the planes `feedback_plane`s (their gains are then output
    error under h, and w is h's diagonal)."""
    r = delta.float().clone()
    d_out, d_in = r.shape
    if h is not None:
        w = h.diagonal()
    w = torch.ones(d_in) if w is None else w.float().clamp_min(1e-12)
    c = _Chain((d_out, d_in), rank_step=cfg.rank_step)
    for _ in range(cfg.planes):
        plane, gain = best_plane(r, w, cfg.alpha) if h is None else feedback_plane(r, h)
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


def spend(
    chains: dict[str, _Chain], budget: int | None, kl: dict[str, KindKL] | None = None
) -> dict[str, CompressedWeight]:
    """Spend `budget` bytes (None: every option of every weight) on the chains' options.

    Without `kl`: plane 1 of every weight (ValueError when the budget does not cover it), then
    every weight's next option greedily by output gain per byte.

    With `kl` (per kind, what its plane 1 and its second option are measured to be worth,
    `kind_kl`): first the measured stage, in blocks of one kind's option i ∈ {1, 2} on all its
    layers, the block of most measured KL per byte first (a kind's option 2 once its plane 1 is
    in); each block's weights are taken in order of output gain per byte while they fit, so the
    first block that does not fit whole is taken in part and ends the stage. So a kind's plane 1
    can lose to another kind's plane 2 (the embedding's, say, against q_proj's plane 1), and a
    budget below plane 1 of every weight leaves out whole kinds, the least KL per byte first, only
    the last one needed in part. Then the bytes left go to the output-error greedy over the kept
    weights' next options (a weight left without plane 1 stays out). ValueError when no weight
    keeps its plane 1."""
    if budget is None:
        for c in chains.values():
            c.taken = c.options
        return {name: cw for name, c in chains.items() if (cw := c.result()) is not None}
    left = budget
    for c in chains.values():
        c.taken = 0
    if kl is None:
        first = sum(c.cost(0) for c in chains.values())
        if first > budget:
            raise ValueError(f"a budget of {budget} bytes is less than one sign plane per weight ({first} bytes)")
        left -= first
        for c in chains.values():
            c.taken = 1
    else:
        kinds: dict[str, list[str]] = {}
        for name in chains:
            kinds.setdefault(kind(name), []).append(name)

        def block(k: str, i: int) -> tuple[float, str, int] | None:
            names = [n for n in kinds[k] if chains[n].options > i]
            value = kl[k].plane1 if i == 0 else kl[k].second
            if not names or value is None:
                return None
            return (-max(value, 0.0) / sum(chains[n].cost(i) for n in names), k, i)

        blocks = [b for k in kinds if (b := block(k, 0)) is not None]
        heapq.heapify(blocks)
        full = False
        while blocks and not full:
            _, k, i = heapq.heappop(blocks)
            names = [n for n in kinds[k] if chains[n].taken == i and chains[n].options > i]
            for name in sorted(names, key=lambda n: -max(chains[n].gain(i), 0.0) / chains[n].cost(i)):
                if chains[name].cost(i) > left:
                    full = True  # this block is the last, taken in part
                    break
                left -= chains[name].cost(i)
                chains[name].taken = i + 1
            if i == 0 and (b := block(k, 1)) is not None:
                heapq.heappush(blocks, b)
        if all(c.taken == 0 for c in chains.values()):
            raise ValueError(f"a budget of {budget} bytes leaves no weight its sign plane")
    heap = [(-c.gain(c.taken) / c.cost(c.taken), name) for name, c in chains.items() if 0 < c.taken < c.options]
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


def _calibration_windows(tokens: torch.Tensor, windows: int, seq_len: int) -> torch.Tensor:
    """`windows` evenly spread windows [n, seq_len] of the 1-D `tokens` (fewer when it is short)."""
    n = max(1, min(windows, tokens.numel() // (seq_len + 1)))
    starts = torch.linspace(0, tokens.numel() - seq_len - 1, n).long().tolist()
    return torch.stack([tokens[s : s + seq_len] for s in starts])


class _Inputs(Exception):
    """Raised by `_linear_inputs`' hook at the LM head, whose input is the last it needs: the head's
    GEMM (49152 × 576 a token on SmolLM2) was ~a fifth of a calibration pass (8 windows, a Zen 4
    core pair: 2.2 s with it, 1.7–1.9 s without, the hooks' sums included)."""


@torch.no_grad()
def _linear_inputs(base, tokens: torch.Tensor, windows: int, seq_len: int, stat) -> dict[str, torch.Tensor]:
    """The mean over calibration windows of stat(inputs [tokens, d_in] fp32) for every linear layer
    of the base model (a `Llama`): param name ("….weight") -> the mean."""
    from torch import nn

    x = _calibration_windows(tokens, windows, seq_len)
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in base.named_modules():
        if isinstance(mod, nn.Linear):

            def hook(m, inp, name=name):
                a = inp[0].reshape(-1, inp[0].shape[-1]).float()
                sums[name + ".weight"] = sums.get(name + ".weight", 0) + stat(a)
                if m is base.lm_head:
                    raise _Inputs  # the last linear layer: the logits are not needed

            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        for i in range(len(x)):
            try:
                base(x[i : i + 1])
            except _Inputs:
                pass
    finally:
        for h in hooks:
            h.remove()
    return {k: v / len(x) for k, v in sums.items()}


def input_power(base, tokens: torch.Tensor, windows: int = 8, seq_len: int = 128) -> dict[str, torch.Tensor]:
    """E[x²] per input column of every linear layer of the base model (a `Llama`) on calibration
    tokens (1-D): param name ("….weight") -> fp32 [d_in]; `windows` evenly spread windows."""
    return _linear_inputs(base, tokens, windows, seq_len, lambda a: a.square().mean(0))


# Error feedback needs h of full rank on the widest input (down_proj's 1536 here): 4096 tokens.
MOMENT_WINDOWS = 32
# The share of a tied embedding/LM head's h that is the head's (`embedding_moments`). Measured at
# 1/15 (every weight one plane, the projections' signs by error feedback), held-out KL(ft ‖ ·), the
# pair's signs sign(Δ) / by error feedback under the head's inputs alone / half and half: the hard
# member 0.0264 / 0.0191 / 0.0189, math (quick family) 0.0010 / 0.0008 / 0.0008.
TIED_HEAD_SHARE = 0.5


def embedding_moments(name: str, head: torch.Tensor, tied: bool) -> torch.Tensor | None:
    """h for the error-feedback signs of an embedding or LM head (name: its parameter), `head` the
    LM head's input moments (E[x xᵀ] of the final hidden states): an untied head's are its own; a
    tied table is a lookup too, whose error in a row is that row's own (h = I), so its h is
    TIED_HEAD_SHARE of the head's and the rest the identity, each at mean diagonal 1; an untied
    table is a lookup only: None (sign(Δ) and mean|Δ|)."""
    if name == "lm_head.weight" and not tied:
        return head
    if not tied:
        return None
    h = head.double() / head.diagonal().double().mean().clamp_min(1e-30)
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    return (TIED_HEAD_SHARE * h + (1 - TIED_HEAD_SHARE) * eye).float()


def input_moments(
    base, tokens: torch.Tensor, windows: int = MOMENT_WINDOWS, seq_len: int = 128
) -> dict[str, torch.Tensor]:
    """E[x xᵀ] of the inputs of every linear layer of the base model (a `Llama`) on calibration
    tokens (1-D): param name -> fp32 [d_in, d_in]; `windows` evenly spread windows."""
    return _linear_inputs(base, tokens, windows, seq_len, lambda a: a.T @ a / len(a))


def kind(name: str) -> str:
    """A weight's kind: its name without the layer index ("model.layers.*.mlp.down_proj.weight")."""
    return re.sub(r"\.\d+\.", ".*.", name)


@dataclass(frozen=True)
class KindKL:
    """What one kind of weight's options are worth, in KL(fine-tune ‖ ·) per token on calibration
    tokens, against base + every weight's plane 1."""

    plane1: float  # added when the plane 1 of all the kind's layers is left out
    second: float | None = None  # removed when the second option (plane 2, or the first rank chunk)
    # of all the kind's layers that have one is added; None: none has one


@torch.no_grad()
def kind_kl(
    base, finetuned, chains: dict[str, _Chain], tokens: torch.Tensor, windows: int = 8, seq_len: int = 128
) -> dict[str, KindKL]:
    """Per kind of weight, what leaving out its plane 1 adds to and adding its second option
    removes from KL(fine-tune ‖ base + every weight's plane 1), per token (`KindKL`); `base` and
    `finetuned` are `Llama`s (`base` is changed in place), measured on `windows` evenly spread
    windows of `tokens` (1-D)."""
    from bitdelta.evaluate import kl_per_token

    x = _calibration_windows(tokens, windows, seq_len)
    n = len(x)
    ref = [finetuned(x[i : i + 1]).float().log_softmax(-1) for i in range(n)]
    params = dict(base.named_parameters())

    def add(names: list[str], i: int, sign: float) -> None:
        for name in names:
            w = params[name]
            w.add_((sign * chains[name].option(i)).to(w.dtype))

    def kl() -> float:
        return sum(float(kl_per_token(ref[i], base(x[i : i + 1]).float().log_softmax(-1)).mean()) for i in range(n)) / n

    add(list(chains), 0, 1.0)
    every = kl()
    out = {}
    for k in sorted({kind(name) for name in chains}):
        names = [name for name in chains if kind(name) == k]
        add(names, 0, -1.0)
        plane1 = kl() - every
        add(names, 0, 1.0)
        second = None
        if more := [name for name in names if chains[name].options > 1]:
            add(more, 1, 1.0)
            second = every - kl()
            add(more, 1, -1.0)
        out[k] = KindKL(plane1, second)
    return out
