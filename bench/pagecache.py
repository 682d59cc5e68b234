"""The page cache for benchmarks: evict files from it without privileges.

Dropping the whole page cache needs root; `posix_fadvise(POSIX_FADV_DONTNEED)`
evicts one file's clean pages and any user who can open the file may ask for
it (dirty pages are written back first, so they can go too).
"""

from __future__ import annotations

import os
from pathlib import Path


def evict(*paths: Path) -> None:
    """Drop these files' pages from the page cache: the next read of them is cold."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
