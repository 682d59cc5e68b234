"""The compression modes the family is built and reported in: one table that the build
(`bitdelta.family.build`), the quality report (`bitdelta.family.quality`) and the merging report
read, so none of them imports another for it.

A mode is how a fine-tune becomes a delta file: the projections' α, whether the tied
embedding/LM head is stored dense or as signs too, scale distillation or not (and its loss and
learning rate, `bitdelta.distill.DistillConfig`), and (beyond one
sign plane, `bitdelta.planes`) at most `planes` residual sign planes and a low-rank residual of
at most `rank` per matrix, under a budget of `budget` × the base's bf16 bytes for the whole file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from bitdelta.family import SERVING_MODE
from bitdelta.planes import PlaneConfig


@dataclass(frozen=True)
class Mode:
    alpha: str  # "row" | "matrix"; beyond one plane also "col" and "auto" (per plane, least error)
    embeddings: str  # "dense" | "sign"
    distilled: bool
    planes: int = 1
    rank: int = 0
    budget: Fraction | None = None  # of the base's bf16 bytes (None: no budget)
    drop: bool = False  # the budget spent by measured KL per byte of each kind (PlaneConfig.drop)
    loss: str = "mse"  # the distillation's loss (DistillConfig.loss): "mse" on logits or "kl"
    lr: float | None = None  # the distillation's learning rate (None: the build's DISTILL_LR)
    feedback: bool = False  # the signs by error feedback (PlaneConfig.feedback)
    steps: int | None = None  # the distillation's steps (None: the build's DISTILL_STEPS)

    @property
    def plain(self) -> bool:
        return self.plane_config(0).plain

    def plane_config(self, bf16_bytes: int) -> PlaneConfig:
        """The projections' compression (`bitdelta.compress.compress(planes=...)`) for a base of
        `bf16_bytes` bytes in bf16."""
        budget = None if self.budget is None else int(bf16_bytes * self.budget)
        return PlaneConfig(
            alpha=self.alpha, planes=self.planes, rank=self.rank, budget=budget, drop=self.drop, feedback=self.feedback
        )


# SERVING_MODE ("row-sign-emb-gptq") is the serving default (data/deltas/); the others live in
# data/deltas-modes/. In the distilled sign-embedding modes only the projections' α's (and
# factors) are trained: the tied embedding/LM head keeps mean|Δ| (see build.build_delta).
#
# Beyond one plane, budgets are fractions of the base's bf16 bytes (of the whole file): one plane
# per weight is already 1/15 of them on this 135M model (every weight has a sign, plus its α's and
# the header), so 1/15 is "equal bytes" and 1/16 needs weights left out: every budgeted mode
# spends its budget by the KL per byte measured per kind of weight (PlaneConfig.drop), which
# leaves out the kinds whose plane 1 is worth least (at 1/16 on the hard member, q_proj) and may
# trade a kind's plane 1 for another kind's plane 2.
MODES: dict[str, Mode] = {
    "matrix": Mode("matrix", "dense", False),
    "matrix-distilled": Mode("matrix", "dense", True),
    "row": Mode("row", "dense", False),
    "row-distilled": Mode("row", "dense", True),
    "row-sign-emb": Mode("row", "sign", False),
    "row-sign-emb-distilled": Mode("row", "sign", True),
    # BitDelta's one plane of row α under a 1/16 budget: the weights worth the least KL per byte
    # left out (still a v2 file, which the worker serves): the equal-bytes baseline at 1/16
    **{
        f"row-sign-emb-16{d}": Mode("row", "sign", bool(d), budget=Fraction(1, 16), drop=True)
        for d in ("", "-distilled")
    },
    # up to 3 residual planes, α chosen per plane; or one plane and a low-rank residual of up to
    # rank 64 (in steps of 8): at 1/16, at about BitDelta's own size (1/15) and at 1/12 (and 1/8).
    # A rank-8 chunk of a 576×576 q_proj costs 18 KB against its plane's 42 KB: at 1/16 the
    # measured spend may buy such chunks where a plane 1 is worth less per byte
    **{
        f"planes-{n}{d}": Mode("auto", "sign", bool(d), planes=3, budget=Fraction(1, n), drop=True)
        for n in (16, 15, 12, 8)
        for d in ("", "-distilled")
    },
    **{
        f"lowrank-{n}{d}": Mode("auto", "sign", bool(d), rank=64, budget=Fraction(1, n), drop=True)
        for n in (16, 15, 12)
        for d in ("", "-distilled")
    },
    # One plane of row α whose projection signs are chosen by error feedback under the calibration
    # inputs' second moments and whose α's are fitted to the output error (PlaneConfig.feedback):
    # the same bytes and v2 file as row-sign-emb-16 and row-sign-emb, served by the same kernels
    **{
        f"gptq-16{d}": Mode("row", "sign", bool(d), budget=Fraction(1, 16), drop=True, feedback=True)
        for d in ("", "-distilled")
    },
    **{f"row-sign-emb-gptq{d}": Mode("row", "sign", bool(d), feedback=True) for d in ("", "-distilled")},
}
# "<mode>-distilled-kl": the distillation trains on KL(fine-tune ‖ ·) of the next-token
# distributions, the report's fidelity metric, at KL_LR. Measured on the hard member's 1/16 one
# plane (row-sign-emb-16, 30 steps, held-out KL from 0.0677 undistilled): MSE at lr 1e-5 0.0648
# (Adam moves each α by at most lr × Σ schedule = 1.6e-4, 3 % of a median α), MSE at 1e-4 0.0527;
# KL at 1e-4 0.0331, at 3e-4 0.0247, at 1e-3 0.0421 (overshoots: 94 % of the gain kept). It
# runs KL_STEPS: in 100 steps the same plane reached 0.0162, in 30 0.0247 (one seed each).
KL_LR, KL_STEPS = 3e-4, 100
MODES.update(
    {
        f"{name}-kl": replace(m, loss="kl", lr=KL_LR, steps=KL_STEPS)
        for name, m in list(MODES.items())
        if m.distilled and m.embeddings == "sign"
    }
)
# BitDelta as published (FasterDecoding/BitDelta's bitdelta/train.py): logit MSE, AdamW at lr 1e-4
# with a cosine schedule, 200 steps of 4 × 128 tokens (weight decay 0 here, the paper's AdamW
# default 0.01 moves an α by 1e-6 of itself per step; the windows are the member's train split,
# not C4): "<one plane>-distilled-paper", the baseline a mode beyond one plane must beat.
PAPER_LR, PAPER_STEPS, PAPER_SUFFIX = 1e-4, 200, "-distilled-paper"
MODES["row-sign-emb-16" + PAPER_SUFFIX] = replace(MODES["row-sign-emb-16-distilled"], lr=PAPER_LR, steps=PAPER_STEPS)
SERVING = MODES[SERVING_MODE]
