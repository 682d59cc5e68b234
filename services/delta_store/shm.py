"""The host cache in shared memory: one file per cached delta on a memory filesystem.

With `--shared-memory-dir` (e.g. /dev/shm/bitdelta), the store keeps every
cached delta in a file there and maps it. A worker on the same host that asks
for it (`FetchRequest.accept_shared_memory`) maps the same file and copies each
announced chunk into its slot at memory speed, instead of receiving the bytes
as gRPC messages (Python gRPC moves ~0.35 GB/s on loopback here; a cold read
of a fast disk is 1+ GB/s).

What keeps it safe:
- A chunk is announced only once the loader verified it, and the receiver
  checks its crc32 on the bytes it copied.
- A lease: a shared Fetch stays open after its last chunk until the receiver
  ends it (it cancels the call once it has copied everything), and an entry
  counts as read, so its file is neither dropped nor reused, until then. Files
  of dropped entries are reused for new entries (fresh memory-filesystem pages
  cost more than a fast disk's read of them: fallocate and first-touch faults
  measured 0.6 s/GB here); a receiver that overstays the lease
  (`bitdelta.rpc.wire.delta_store.SHARED_LEASE_S`) may see the file change, and its crc32 check fails
  (DATA_LOSS), never a silent wrong byte.
- Space is reserved with `posix_fallocate` before the first write, so a full
  memory filesystem is an ENOSPC at reserve time (the entry then lives in
  private memory and streams as usual), never a SIGBUS on a write.
- A dropped entry's file is unlinked; a receiver that has mapped it keeps
  valid bytes until it unmaps, and one that had not yet opened it gets ENOENT
  and fetches again without shared memory.
- Files are private to the store's user (mode 0600 in a 0700 directory): the
  workers must run as the same user. Every store process has its own
  subdirectory, removed at close; those of processes that are gone are removed
  at start.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
PREFIX = "store-"


@dataclass
class SharedFile:
    """One mapped file of the shared cache."""

    path: str
    size: int  # of the file; an entry that reuses it may use fewer bytes
    map: mmap.mmap

    def release(self) -> None:
        """Unlink the file and unmap it here (a receiver's own mapping stays valid)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self.map.close()
        except BufferError:  # a view of it is still alive somewhere: unmapped when that goes
            pass


class SharedMemoryDir:
    """Allocates `SharedFile`s in this process's subdirectory of `root`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._remove_stale()
        self.dir = self.root / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.dir.mkdir(mode=0o700)
        self._n = 0

    def allocate(self, size: int) -> SharedFile | None:
        """A new mapped file of `size` bytes with its space reserved, or None if there is no room."""
        self._n += 1
        path = str(self.dir / f"{self._n}.delta")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, max(size, 1))
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EOPNOTSUPP):
                    raise
                log.warning(
                    "no room for a %d-byte delta in %s (%s): cached in private memory instead",
                    size,
                    self.root,
                    os.strerror(e.errno),
                )
                os.unlink(path)
                return None
            return SharedFile(path, size, mmap.mmap(fd, max(size, 1)))
        except BaseException:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _remove_stale(self) -> None:
        """Subdirectories left by store processes that are gone (a crash leaves its files behind)."""
        for d in self.root.glob(f"{PREFIX}*"):
            pid = d.name[len(PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
                log.info("removed %s, left by a store process that is gone", d)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
