"""A tiny random family for the core's tests: a base and fine-tuned variants as plain
checkpoints (no deltas), from `bitdelta.testing.family`'s builders."""

from __future__ import annotations

from pathlib import Path

from bitdelta.model import ModelArgs
from bitdelta.testing.family import make_base, make_finetune


def make_tiny_family(root: Path, n_variants: int = 3, args: ModelArgs | None = None) -> tuple[Path, list[Path]]:
    root = Path(root)
    base = make_base(root / "base", args)
    variants = [make_finetune(base, root / f"variant{i}", seed=100 + i) for i in range(n_variants)]
    return base, variants
