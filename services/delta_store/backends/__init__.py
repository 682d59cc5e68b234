"""Storage backends of the delta store: one interface, swappable.

A backend stores opaque objects (delta files) under variant names. It knows
nothing of the delta format: the core verifies what it reads and writes.

    objects = await backend.list()                 # [ObjectInfo], only committed objects
    info    = await backend.head(name)             # NotFound if absent
    reader  = await backend.open(name)             # reader.readinto(offset, buf) -> bytes read
    async for filled in reader.fill(view, block): ...  # the whole object into view, in order
    upload  = await backend.begin_upload(name, size)
    await upload.write(data) ...; await upload.commit(overwrite)   # atomic: visible all at once
    await backend.delete(name)

Errors: `NotFound`, `AlreadyExists`, and `BackendUnavailable` for anything
that a retry might fix (unreachable, timed out, missing directory or bucket).
Names reaching a backend have passed `check_name`; backends check again
before building a path or key, so no name can address anything outside the store.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from bitdelta.format import DELTA_SUFFIX as SUFFIX  # noqa: F401  (re-exported: object name = variant name + SUFFIX)
from bitdelta.generation import MODEL_ID_RULE, is_model_id
from bitdelta.rpc.errors import clip
from services.delta_store.errors import InvalidName


def check_name(name: str) -> str:
    """Return `name` if it is a plain variant name (the model-id rule every service shares,
    `bitdelta.generation.is_model_id`: no path separators, parent directories, hidden files,
    control characters or empty name), else raise InvalidName."""
    if not is_model_id(name):
        raise InvalidName(f"invalid delta name {clip(str(name))}: use {MODEL_ID_RULE}")
    return name


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    version: str  # changes whenever the object's content may have changed (mtime+inode, ETag)


class Reader(ABC):
    """An open object for (large, sequential) ranged reads."""

    size: int

    @abstractmethod
    async def readinto(self, offset: int, buf: memoryview) -> int:
        """Fill `buf` from `offset`; returns the bytes read, fewer only at the end of the object."""

    async def fill(self, view: memoryview, block: int) -> AsyncIterator[int]:
        """Read the object from its start into `view`, `block` bytes at a time, in order; yields how many
        bytes are in place after each block (the last value is below len(view) only if the object is
        shorter). Nothing is written into `view` once the iteration ended, however it ended.

        This default waits for the caller between blocks; a backend that can read ahead on its own
        (the local disk, from a thread) overrides it."""
        pos = 0
        while pos < len(view):
            want = min(block, len(view) - pos)
            n = await self.readinto(pos, view[pos : pos + want])
            pos += n
            yield pos
            if n < want:
                return

    @abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Reader:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class Upload(ABC):
    """An upload in progress; invisible to `list`/`head`/`open` until `commit`."""

    @abstractmethod
    async def write(self, data: bytes | memoryview) -> None: ...

    @abstractmethod
    async def commit(self, overwrite: bool) -> ObjectInfo:
        """Make the object visible atomically; AlreadyExists if it exists and not `overwrite`."""

    @abstractmethod
    async def abort(self) -> None:
        """Discard the upload (idempotent; safe after a failed commit)."""


class Backend(ABC):
    kind: str

    @abstractmethod
    async def list(self) -> list[ObjectInfo]: ...

    @abstractmethod
    async def head(self, name: str) -> ObjectInfo: ...

    @abstractmethod
    async def open(self, name: str) -> Reader: ...

    @abstractmethod
    async def begin_upload(self, name: str, size: int) -> Upload: ...

    @abstractmethod
    async def delete(self, name: str) -> None: ...

    async def close(self) -> None:  # noqa: B027 (optional: most backends hold nothing to close)
        pass

    async def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Up to `length` bytes from `offset` (fewer at the end of the object)."""
        buf = bytearray(length)
        async with await self.open(name) as r:
            n = await r.readinto(offset, memoryview(buf))
        return bytes(buf[:n])
