"""The host-memory cache of whole delta files, in front of the backend.

An `Entry` holds one delta's bytes. It is filled by ONE loader task (single
flight) while any number of readers stream from it as the bytes arrive:
`filled` only advances past a tensor's end after that tensor's sha256 was
checked, so no reader ever sends the last byte of a corrupted tensor. If the
load fails, every reader gets the error; if the last reader leaves before the
load finished, the load is cancelled and the memory freed.

Which entries stay is decided by `bitdelta.cache_policy.WeightedLRUPolicy`
(no I/O): entries that are loading or being read are never evicted, so the
budget bounds the memory the cache holds. A delta that does not fit is
streamed without being cached. The buffers of dropped entries are reused for
new ones of similar size while the budget allows: first-touch page faults
of fresh memory cost more than the read itself on some machines.

With a `SharedMemoryDir` (services/delta_store/shm.py) entries live in files
that same-host workers map; they are recycled the same way, since a shared
Fetch counts as a reader until the receiver has copied everything (its lease).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

from bitdelta.cache_policy import WeightedLRUPolicy
from bitdelta.format import DeltaHeader
from services.delta_store.shm import SharedFile, SharedMemoryDir


class Entry:
    """One delta's bytes in host memory, with the fill progress of its loader."""

    def __init__(
        self, name: str, version: str, header: DeltaHeader, chunk_bytes: int, buf: bytearray | SharedFile | None = None
    ):
        self.name, self.version, self.header = name, version, header
        self.size = header.file_size
        self.buf = buf if buf is not None else bytearray(self.size)  # a reused buffer, or a shared file
        mapped = self.buf.map if isinstance(self.buf, SharedFile) else self.buf
        self.view: memoryview | None = memoryview(mapped)[: self.size]  # None once recycled
        self.filled = 0  # [0, filled) is read and every tensor ending in it verified
        self.error: BaseException | None = None
        self.loader: asyncio.Task | None = None
        self.readers = 0
        # crc32 of every chunk of `chunk_bytes`, per tensor, computed while loading,
        # so cache hits with the default chunk size send bytes without touching them.
        self.chunk_bytes = chunk_bytes
        self.crcs: list[list[int]] = [[] for _ in header.tensors]
        self._progress = asyncio.get_running_loop().create_future()

    @property
    def shared(self) -> SharedFile | None:
        """The file same-host readers map, if the entry lives in shared memory."""
        return self.buf if isinstance(self.buf, SharedFile) else None

    @property
    def complete(self) -> bool:
        return self.filled == self.size and self.error is None

    def publish(self, filled: int) -> None:
        self.filled = filled
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        fut, self._progress = self._progress, asyncio.get_running_loop().create_future()
        fut.set_result(None)

    async def wait_for(self, end: int) -> None:
        """Until [0, end) is filled; raises the load's error if it failed."""
        while self.filled < end:
            if self.error is not None:
                raise self.error
            await asyncio.shield(self._progress)

    def crc(self, tensor_index: int, offset: int, chunk_bytes: int) -> int | None:
        """The precomputed crc32 of the chunk at `offset` of a tensor, if there is one."""
        if chunk_bytes != self.chunk_bytes:
            return None
        crcs = self.crcs[tensor_index]
        i = offset // chunk_bytes
        return crcs[i] if i < len(crcs) else None


def _nbytes(buf: bytearray | SharedFile) -> int:
    return buf.size if isinstance(buf, SharedFile) else len(buf)


def _free(buf: bytearray | SharedFile) -> None:
    """A spare the cache lets go of: a shared file is unlinked and unmapped; private memory is just dropped."""
    if isinstance(buf, SharedFile):
        buf.release()


class HostCache:
    """Entries by name, kept under a byte budget by the policy."""

    def __init__(
        self,
        policy: WeightedLRUPolicy,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedMemoryDir | None = None,
    ):
        self.policy = policy
        self.clock = clock
        self.shared = shared
        self.entries: dict[str, Entry] = {}
        self._spare: list[bytearray | SharedFile] = []  # buffers of dropped entries, for reuse
        # Fetches by outcome: hit, join (followed a load in progress: single flight),
        # miss (started the load), bypass (cannot be cached: streamed from the backend); evictions.
        self.stats: Counter[str] = Counter()

    @property
    def used_bytes(self) -> int:
        return self.policy.used_bytes

    @property
    def spare_buffers(self) -> int:
        """Buffers (or shared files) of dropped entries kept for reuse (the tests watch it)."""
        return len(self._spare)

    def lookup(self, name: str, version: str) -> Entry | None:
        """Records a request for `name`; the usable entry of this version, if any."""
        self.policy.record(name, self.clock())
        e = self.entries.get(name)
        if e is not None and (e.version != version or e.error is not None):
            self.drop(name)
            return None
        return e

    def reserve(self, name: str, version: str, header: DeltaHeader, chunk_bytes: int) -> Entry | None:
        """A new, empty entry (evicting others to make room), or None if it cannot be cached."""
        self.drop(name)
        busy = {n for n, e in self.entries.items() if e.readers or not e.complete}
        victims = self.policy.plan(name, header.file_size, self.clock(), busy=busy)
        if victims is None:
            return None
        for v in victims:
            self.drop(v)
            self.stats["eviction"] += 1
        buf = self._take_spare(header.file_size)
        if self.shared is not None and buf is None:
            buf = self.shared.allocate(header.file_size)  # None if the memory filesystem is full
        e = Entry(name, version, header, chunk_bytes, buf)
        self.entries[name] = e
        self.policy.add(name, e.size)
        self._trim_spares()
        return e

    def drop(self, name: str, forget: bool = False) -> None:
        """Remove `name`'s entry (readers that hold it finish undisturbed); cancel its load if no one reads it."""
        e = self.entries.pop(name, None)
        self.policy.forget(name) if forget else self.policy.remove(name)
        if e is None:
            return
        if e.loader is not None and not e.loader.done():
            if not e.readers and e.filled < e.size:
                e.loader.cancel()
            e.loader.add_done_callback(lambda _: self._recycle(e))
        else:
            self._recycle(e)

    def _recycle(self, e: Entry) -> None:
        """Keep a dropped entry's buffer for reuse once nothing can touch its bytes any more."""
        if (
            e.readers
            or (e.loader is not None and not e.loader.done())
            or e.view is None
            or self.entries.get(e.name) is e
        ):
            return
        e.view.release()
        e.view = None
        self._spare.append(e.buf)
        self._trim_spares()

    def _take_spare(self, size: int) -> bytearray | SharedFile | None:
        fits = [b for b in self._spare if size <= _nbytes(b) <= 2 * size]
        if not fits:
            return None
        best = min(fits, key=_nbytes)
        self._spare.remove(best)
        return best

    def _trim_spares(self) -> None:
        while self._spare and self.used_bytes + sum(map(_nbytes, self._spare)) > self.policy.budget_bytes:
            _free(self._spare.pop(0))

    def close(self) -> None:
        """Drop every entry and spare (the store is closing)."""
        for name in list(self.entries):
            self.drop(name)
        while self._spare:
            _free(self._spare.pop())
        if self.shared is not None:
            self.shared.close()

    def release(self, entry: Entry) -> None:
        """A reader is done with `entry`; the last one out of an unfinished load cancels it."""
        entry.readers -= 1
        if entry.readers:
            return
        if entry.filled < entry.size and entry.loader is not None and not entry.loader.done():
            entry.loader.cancel()
            if self.entries.get(entry.name) is entry:
                self.drop(entry.name)
        else:
            self._recycle(entry)  # if it was dropped while being read
