"""Byte sizes as people write them: '512MiB', '4GiB', '80GB', '1.5 GB', '4096'."""

from __future__ import annotations

import re

_PREFIX = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_bytes(text: str | int) -> int:
    """'80GB' -> 80·10⁹, '80GiB' -> 80·2³⁰, '141 GB', '512MiB', '2k'; a plain number is bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(text), flags=re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"{text!r} is not a byte size (examples: 512MiB, 4GiB, 80GB, 1048576)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** _PREFIX[m.group(2).upper()])


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
