"""The async client of the delta store, for GPU workers and tools.

    async with DeltaStoreClient("delta-store:50052") as store:
        info, tensors = await store.fetch_into(
            "coder", on_tensor,                        # on_tensor(index, TensorInfo, buffer), after verification
            expect_base_fingerprint=base_fp,           # FAILED_PRECONDITION -> BaseMismatch, before any data
            alloc=lambda t: pinned_buffer(t.nbytes),   # where each tensor's bytes go (default: a bytearray)
        )

`fetch_into` places every chunk at its offset in the tensor's buffer, checks
its crc32, checks each tensor's sha256 once complete, and only then calls
`on_tensor` (a function or a coroutine function). Chunks must arrive in order
(the server sends them so). Every call has a deadline (`timeout_s`, per call
overridable). Errors are `DeltaStoreError` subclasses: `DeltaNotFound`,
`BaseMismatch`, `IntegrityError` (a bad chunk or tensor, detected here or by
the server: `.tensor` names it), `StoreUnavailable` (retry later); other
failures are `DeltaStoreError` with the gRPC `.code`.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
from typing import Any, Awaitable, Callable

import aiofiles
import grpc

from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
from services.delta_store.checksums import crc32
from services.delta_store.config import MAX_CHUNK_BYTES

MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)
TENSOR_METADATA_KEY = "bitdelta-tensor"


class DeltaStoreError(Exception):
    """A delta store call failed; `code` is the gRPC status code (None for checks made here)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, tensor: str | None = None):
        super().__init__(message)
        self.code, self.tensor = code, tensor


class DeltaNotFound(DeltaStoreError):
    pass


class BaseMismatch(DeltaStoreError):
    pass


class IntegrityError(DeltaStoreError):
    """Corrupted or inconsistent data; `tensor` names the bad tensor when known."""


class StoreUnavailable(DeltaStoreError):
    pass


_ERRORS = {
    grpc.StatusCode.NOT_FOUND: DeltaNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: BaseMismatch,
    grpc.StatusCode.DATA_LOSS: IntegrityError,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreUnavailable,
}


def _error(e: grpc.aio.AioRpcError) -> DeltaStoreError:
    tensor = dict(e.trailing_metadata() or ()).get(TENSOR_METADATA_KEY)
    return _ERRORS.get(e.code(), DeltaStoreError)(f"{e.code().name}: {e.details()}", e.code(), tensor)


class DeltaStoreClient:
    """One channel to a delta store; share it. Use `async with` or call `close()`."""

    def __init__(self, target: str, *, timeout_s: float = 30.0, fetch_timeout_s: float = 600.0):
        self.timeout_s, self.fetch_timeout_s = timeout_s, fetch_timeout_s
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ])
        self._stub = pb_grpc.DeltaStoreServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "DeltaStoreClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def list(self, timeout_s: float | None = None) -> list[pb.DeltaInfo]:
        try:
            r = await self._stub.List(pb.ListRequest(), timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return list(r.deltas)

    async def stat(self, name: str, timeout_s: float | None = None) -> pb.StatResponse:
        try:
            return await self._stub.Stat(pb.StatRequest(name=name), timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    async def delete(self, name: str, timeout_s: float | None = None) -> None:
        try:
            await self._stub.Delete(pb.DeleteRequest(name=name), timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None

    async def put(self, name: str, data: bytes | str | os.PathLike, *, overwrite: bool = False,
                  chunk_bytes: int = 1 << 20, timeout_s: float | None = None) -> pb.DeltaInfo:
        """Upload a delta file (a path, or its bytes); returns what the store verified and stored."""
        size = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else os.path.getsize(data)

        async def requests():
            yield pb.PutRequest(header=pb.PutHeader(name=name, size_bytes=size, overwrite=overwrite))
            if isinstance(data, (bytes, bytearray, memoryview)):
                view = memoryview(data)
                for i in range(0, size, chunk_bytes):
                    yield pb.PutRequest(data=bytes(view[i: i + chunk_bytes]))
            else:
                async with aiofiles.open(data, "rb") as f:
                    while piece := await f.read(chunk_bytes):
                        yield pb.PutRequest(data=piece)

        try:
            r = await self._stub.Put(requests(), timeout=timeout_s or self.fetch_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        return r.info

    async def fetch_into(
        self,
        name: str,
        on_tensor: Callable[[int, pb.TensorInfo, Any], Awaitable[None] | None],
        *,
        expect_base_fingerprint: str = "",
        alloc: Callable[[pb.TensorInfo], Any] | None = None,
        chunk_bytes: int = 0,
        timeout_s: float | None = None,
    ) -> tuple[pb.DeltaInfo, list[pb.TensorInfo]]:
        """Stream delta `name` into per-tensor buffers, verifying every chunk and tensor.

        `alloc(tensor)` returns a writable buffer of `tensor.nbytes` bytes (bytearray,
        numpy array, `torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()`);
        `on_tensor(index, tensor, buffer)` is called once per tensor, in file order,
        after its sha256 matched. Returns the delta's info and tensor list.
        """
        alloc = alloc or (lambda t: bytearray(t.nbytes))
        call = self._stub.Fetch(
            pb.FetchRequest(name=name, chunk_bytes=chunk_bytes, expect_base_fingerprint=expect_base_fingerprint),
            timeout=timeout_s or self.fetch_timeout_s,
        )
        info, tensors, current = None, [], None
        try:
            async for m in call:
                if info is None:
                    if not m.HasField("info"):
                        raise IntegrityError(f"delta {name!r}: the first Fetch message lacks the delta's info")
                    info, tensors = m.info, list(m.tensors)
                    if expect_base_fingerprint and info.base_fingerprint != expect_base_fingerprint:
                        raise BaseMismatch(f"delta {name!r} was built for base {info.base_fingerprint[:16]}…, "
                                           f"expected {expect_base_fingerprint[:16]}…")
                    current = _Receiver(name, tensors, alloc)
                    await current.flush_complete(on_tensor)  # empty tensors
                if m.HasField("chunk"):
                    await asyncio.to_thread(current.place, m.chunk)
                    await current.flush_complete(on_tensor)
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        except BaseException:
            call.cancel()
            raise
        if info is None:
            raise IntegrityError(f"delta {name!r}: the Fetch stream was empty")
        current.check_done()
        return info, tensors


class _Receiver:
    """Per-fetch state: buffers, running sha256, the next expected (tensor, offset)."""

    def __init__(self, name: str, tensors: list[pb.TensorInfo], alloc):
        self.name, self.tensors, self.alloc = name, tensors, alloc
        self.i, self.pos = 0, 0  # next expected tensor and offset in it
        self.buf, self.sha = None, None
        self.ready: list[tuple[int, Any]] = []  # verified tensors not yet handed to on_tensor
        self._open_next()

    def _open_next(self) -> None:
        while self.i < len(self.tensors):
            t = self.tensors[self.i]
            self.buf = self.alloc(t)
            if memoryview(self.buf).nbytes != t.nbytes:
                raise ValueError(f"alloc returned {memoryview(self.buf).nbytes} bytes for tensor {t.name} of {t.nbytes}")
            self.sha, self.pos = hashlib.sha256(), 0
            if t.nbytes:
                return
            self._finish()

    def _finish(self) -> None:
        t = self.tensors[self.i]
        if self.sha.hexdigest() != t.sha256:
            raise IntegrityError(f"delta {self.name!r}: tensor {t.name}: sha256 mismatch after receiving it", tensor=t.name)
        self.ready.append((self.i, self.buf))
        self.i += 1

    def place(self, c: pb.Chunk) -> None:
        """Runs on a worker thread: check, copy and hash one chunk."""
        t = self.tensors[self.i] if self.i < len(self.tensors) else None
        if t is None or c.tensor_index != self.i or c.offset != self.pos or self.pos + len(c.data) > t.nbytes:
            where = t.name if t is not None else "after the last tensor"
            raise IntegrityError(f"delta {self.name!r}: chunk (tensor {c.tensor_index}, offset {c.offset}) out of order; "
                                 f"expected tensor {self.i} ({where}) at offset {self.pos}", tensor=t and t.name)
        if crc32(c.data) != c.crc32:
            raise IntegrityError(f"delta {self.name!r}: tensor {t.name}: crc32 mismatch in the chunk at offset {c.offset}",
                                 tensor=t.name)
        memoryview(self.buf).cast("B")[c.offset: c.offset + len(c.data)] = c.data
        self.sha.update(c.data)
        self.pos += len(c.data)
        if self.pos == t.nbytes:
            self._finish()
            self._open_next()

    async def flush_complete(self, on_tensor) -> None:
        ready, self.ready = self.ready, []
        for i, buf in ready:
            r = on_tensor(i, self.tensors[i], buf)
            if inspect.isawaitable(r):
                await r

    def check_done(self) -> None:
        if self.i != len(self.tensors):
            t = self.tensors[self.i]
            raise IntegrityError(f"delta {self.name!r}: the stream ended inside tensor {t.name} "
                                 f"({self.pos} of {t.nbytes} bytes)", tensor=t.name)
