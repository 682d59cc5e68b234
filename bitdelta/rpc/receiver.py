"""The one receiver of a delta's tensors arriving in pieces: it places the bytes in a destination's
buffers and checks them before the destination may use a tensor.

    receiver = Receiver(name, tensors, destination, check_sha256=not stream.verified)
    receiver.put(i, offset, data, crc32)      # a Fetch piece: queued, copied in arrival order
    receiver.landed([(i, offset, n)])         # or: bytes were read straight into receiver.buffer(i)
    await receiver.finish()                   # every tensor complete and checked, or the first error

The checks: each piece's crc32 on the bytes as they lie where they landed (ISA-L
when installed: several GB/s), and each complete tensor's sha256 (a running
hash over in-order pieces, else the whole buffer), unless the sender verified
every byte already (`check_sha256=False`: the delta store hashed it once, when
the delta entered the store); then every piece must carry a crc32 and come in
order, so that together the crc32s cover every byte. Only a tensor that passed
is handed to `Destination.complete`. A failure is a `ReceiveError` (DATA_LOSS)
naming the tensor.

Pieces are copied and hashed on one thread in arrival order; complete tensors
are checked (and completed) on a small pool, in parallel. Torch-free: the
delta store's client (`fetch_into`, the CLI) and the worker's loader (whose
`SlotWriter` is the destination) share it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from bitdelta.rpc.checksums import crc32 as crc32_of
from bitdelta.rpc.errors import ServiceError
from bitdelta.rpc.wire.delta_store import TENSOR_METADATA_KEY

# Threads checking complete tensors (sha256 releases the GIL): hashing keeps up with a fast disk.
HASH_THREADS = min(4, os.cpu_count() or 1)
HASH_TASK_BYTES = 1 << 20  # small tensors are checked together: one task per ~1 MiB


class Announced(Protocol):
    """A tensor as the sender announced it (`delta_store_pb2.TensorInfo`, the worker's `TensorSpec`)."""

    name: str
    nbytes: int
    sha256: str  # hex, of its bytes


class Destination(Protocol):
    def buffer(self, index: int) -> memoryview:
        """Writable bytes (format "B", `nbytes` long) where tensor `index`'s pieces land. Asked once
        per tensor, on any thread; never for an empty tensor."""

    def complete(self, index: int) -> None:
        """Tensor `index` arrived whole and passed its checks: use it (copy it to its final place, hand
        it over). Runs on a checking thread; the receiver no longer touches its buffer."""


class ReceiveError(ServiceError):
    """Bytes that arrived are not the announced tensor: a checksum fails, or pieces are missing,
    repeated, out of place. `tensor` names it (also in the trailers)."""

    code = grpc.StatusCode.DATA_LOSS

    def __init__(self, message: str, tensor: str):
        super().__init__(message)
        self.tensor = tensor
        self.trailers = {TENSOR_METADATA_KEY: tensor}


@dataclass
class _Progress:
    """One tensor on its way in."""

    tensor: Announced
    view: memoryview | None = None  # the destination's buffer, once asked for, until completed
    got: int = 0  # bytes received
    next: int = 0  # where the next in-order piece starts
    sha: Any = None  # running sha256 of the in-order pieces (when checking sha256)
    in_order: bool = True  # every piece so far came through `put`, in order: the running hash is valid
    done: bool = False


class Receiver:
    """Receives one delta into one destination (see the module docstring). Not reusable."""

    def __init__(self, name: str, tensors: Sequence[Announced], destination: Destination, *, check_sha256: bool = True):
        self.name, self.destination, self.check_sha256 = name, destination, check_sha256
        self._tensors = [_Progress(t, sha=hashlib.sha256() if check_sha256 else None) for t in tensors]
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"receive-{name[:40]}")
        self._pool = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix=f"check-{name[:40]}")
        self._last: concurrent.futures.Future | None = None
        self._checks: list[concurrent.futures.Future] = []
        for i, p in enumerate(self._tensors):
            if p.tensor.nbytes == 0:
                self._complete(i)

    # -- what sources call (any thread) ----------------------------------------------------------
    def buffer(self, index: int) -> memoryview:
        """Tensor `index`'s buffer in the destination, for a source that reads straight into it
        (then `landed`)."""
        p = self._tensors[index]
        with self._lock:
            if p.view is None:
                view = self.destination.buffer(index)
                if view.nbytes != p.tensor.nbytes:
                    raise ValueError(
                        f"the destination gave {view.nbytes} bytes for tensor {p.tensor.name} of {p.tensor.nbytes}"
                    )
                p.view = view
            return p.view

    def put(self, index: int, offset: int, data: bytes | memoryview, crc32: int | None = None) -> None:
        """Bytes [offset, offset + len(data)) of tensor `index`, with the sender's crc32 of them. Queued:
        the caller may let go of `data` after `flushed()`."""
        self._last = self._io.submit(self._guard, self._put, index, offset, data, crc32)

    def landed(self, pieces: list[tuple[int, int, int]]) -> None:
        """Each (index, offset, n): bytes [offset, offset + n) of tensor `index` were written into
        `buffer(index)`. Thread-safe."""
        complete = []
        with self._lock:
            for i, _, n in pieces:
                p = self._tensors[i]
                p.in_order = False  # hashed whole once complete, in parallel with further reads
                p.got += n
                if p.got >= p.tensor.nbytes:
                    complete.append(i)
        # Check in tasks of about HASH_TASK_BYTES: small tensors share one, big ones get their own.
        group, size = [], 0
        for i in complete:
            group.append(i)
            size += self._tensors[i].tensor.nbytes
            if size >= HASH_TASK_BYTES:
                self._complete(*group)
                group, size = [], 0
        if group:
            self._complete(*group)

    async def flushed(self) -> None:
        """Until every `put` so far has copied its bytes (errors are kept for `settled` and `finish`)."""
        if self._last is not None:
            await asyncio.wait([asyncio.wrap_future(self._last)])

    async def settled(self) -> None:
        """Until every piece so far is placed and every tensor it completed is checked and completed;
        raises the first error."""
        if self._last is not None:
            await asyncio.wait([asyncio.wrap_future(self._last)])
        with self._lock:
            self._checks = [f for f in self._checks if not f.done()]
            checks = list(self._checks)
        if checks:
            await asyncio.wait([asyncio.wrap_future(f) for f in checks])
        if self._error is not None:
            raise self._error

    async def finish(self) -> None:
        """Every tensor complete and checked; raises the first error (or names the first tensor that
        never completed). The receiver's threads end."""
        try:
            await self.settled()
            missing = [p.tensor.name for p in self._tensors if not p.done]
            if missing:
                raise ReceiveError(
                    f"delta {self.name!r}: stream ended before tensor {missing[0]} was complete", missing[0]
                )
        finally:
            self._io.shutdown(wait=False)
            self._pool.shutdown(wait=False)

    def abort(self) -> None:
        """Stop: queued pieces and checks are dropped (one running on a thread finishes)."""
        self._error = self._error or RuntimeError("receive aborted")
        self._io.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- on the receiver's threads ---------------------------------------------------------------
    def _guard(self, fn, *args) -> None:
        if self._error is None:
            try:
                fn(*args)
            except BaseException as e:  # reported by settled() / finish()
                self._error = e

    def _put(self, index: int, offset: int, data, crc32: int | None) -> None:
        if not 0 <= index < len(self._tensors):
            raise ReceiveError(
                f"delta {self.name!r}: a piece of tensor #{index}, but {len(self._tensors)} were announced",
                f"#{index}",
            )
        p = self._tensors[index]
        t, n = p.tensor, len(data)
        if offset + n > t.nbytes:
            raise ReceiveError(
                f"delta {self.name!r}: tensor {t.name}: chunk [{offset}, {offset + n}) runs past its {t.nbytes} bytes",
                t.name,
            )
        if p.got + n > t.nbytes:
            raise ReceiveError(
                f"delta {self.name!r}: tensor {t.name}: chunk at offset {offset} is more than its {t.nbytes} "
                "bytes (a piece sent twice)",
                t.name,
            )
        if crc32 is None and not self.check_sha256:
            raise ReceiveError(
                f"delta {self.name!r}: tensor {t.name}: a chunk without a crc32 while "
                "sha256 checks are off: its bytes could not be verified",
                t.name,
            )
        dst = self.buffer(index)[offset : offset + n]
        dst[:] = data
        if crc32 is not None and crc32_of(dst) != crc32:  # the bytes as they lie where they will be used
            raise ReceiveError(
                f"delta {self.name!r}: tensor {t.name}: chunk at offset {offset} fails "
                "its crc32 (corrupted in transit)",
                t.name,
            )
        if offset == p.next and p.in_order:
            if self.check_sha256:
                p.sha.update(dst)
            p.next = offset + n
        elif not self.check_sha256:  # only in-order chunks prove, with their crc32s, that every byte came
            raise ReceiveError(
                f"delta {self.name!r}: tensor {t.name}: chunk at offset {offset} out of order "
                f"(expected offset {p.next})",
                t.name,
            )
        else:
            p.in_order = False
        with self._lock:
            p.got += n
            complete = p.got >= t.nbytes
        if complete:
            self._complete(index)

    def _complete(self, *indices: int) -> None:
        f = self._pool.submit(self._guard, self._check, indices)
        with self._lock:
            self._checks.append(f)

    def _check(self, indices: tuple[int, ...]) -> None:
        for i in indices:
            p = self._tensors[i]
            t = p.tensor
            if p.got != t.nbytes:
                raise ReceiveError(
                    f"delta {self.name!r}: tensor {t.name}: received {p.got} of {t.nbytes} bytes", t.name
                )
            if not p.in_order:  # bytes that landed unchecked, or pieces out of order: hash them whole
                digest = hashlib.sha256(p.view if t.nbytes else b"").hexdigest()
            elif self.check_sha256:
                digest = p.sha.hexdigest()
            else:
                digest = t.sha256  # verified by the sender; every chunk passed its crc32, in order
            if digest != t.sha256:
                raise ReceiveError(
                    f"delta {self.name!r}: tensor {t.name}: sha256 mismatch "
                    "(the data is corrupted; re-upload or re-compress the delta)",
                    t.name,
                )
            p.view, p.sha = None, None
            self.destination.complete(i)
            p.done = True
