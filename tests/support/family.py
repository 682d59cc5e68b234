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


def add_bos_to_tokenizer(base: Path) -> str:
    """Make `base`'s tiny tokenizer add a BOS itself, as Llama's do (the tiny family's adds none);
    returns the BOS's text (<|endoftext|>, id 256)."""
    import json

    path = base / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = "<|endoftext|>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [256], "tokens": [bos]}},
    }
    path.write_text(json.dumps(spec))
    return bos
