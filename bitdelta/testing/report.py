"""A benchmark's output: the report printed, and with `--out` the report and its numbers beside it."""

from __future__ import annotations

import json
from pathlib import Path


def save(out: Path | None, text: str, numbers: dict) -> None:
    """Print `text`; with `out`, write it there and `numbers` as JSON beside it (`out` with .json)."""
    print(text)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.rstrip("\n") + "\n")
    out.with_suffix(".json").write_text(json.dumps(numbers, indent=1) + "\n")
