"""The async client of the delta store, for workers, the router and tools.

    async with DeltaStoreClient("delta-store:50052") as store:
        info, tensors = await store.fetch_into(
            "coder", on_tensor,                        # on_tensor(index, TensorInfo, buffer), after verification
            expect_base_fingerprint=base_fp,           # FAILED_PRECONDITION -> BaseMismatch, before any data
            alloc=lambda t: pinned_buffer(t.nbytes),   # where each tensor's bytes go (default: a bytearray)
        )

`fetch_into` places every chunk at its offset in the tensor's buffer, checks
its crc32, checks each tensor's sha256 once complete, and only then calls
`on_tensor`. A caller with its own sink (the worker's slot writer, which
checks while it copies to the device) uses `open_fetch`: the header first,
then the raw chunks in order.

Every call has a deadline (`timeout_s`, per call overridable). Errors are
`DeltaStoreError` (an `RpcError`: `.code` is the store's status, kept by
whoever re-raises it) with subclasses by code: `DeltaNotFound`,
`BaseMismatch`, `IntegrityError` (`.tensor` names the bad tensor),
`StoreUnavailable` (retry later); `InvalidRequest` for values the store refuses.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import aiofiles
import grpc

from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
from bitdelta.rpc.checksums import crc32
from bitdelta.rpc.clients.base import Client
from bitdelta.rpc.errors import RpcError

MAX_CHUNK_BYTES = 16 * 1024 * 1024  # largest Fetch chunk payload the store sends
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)  # a chunk plus the first message's header listing
TENSOR_METADATA_KEY = "bitdelta-tensor"  # trailing metadata of DATA_LOSS: the bad tensor's name
SERVICE = "delta store"


class DeltaStoreError(RpcError):
    """A delta store call failed (or its data failed a check here); `code` is the status."""

    @property
    def tensor(self) -> str | None:
        return self.trailers.get(TENSOR_METADATA_KEY)


class DeltaNotFound(DeltaStoreError):
    pass


class InvalidRequest(DeltaStoreError):
    """The store refused the request's values (a name that is not a plain name, a malformed upload)."""


class BaseMismatch(DeltaStoreError):
    pass


class IntegrityError(DeltaStoreError):
    """Corrupted or inconsistent data; `tensor` names the bad tensor when known."""


class StoreUnavailable(DeltaStoreError):
    pass


_TYPES = {
    grpc.StatusCode.NOT_FOUND: DeltaNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: BaseMismatch,
    grpc.StatusCode.DATA_LOSS: IntegrityError,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
}


def _local(cls: type[DeltaStoreError], code: grpc.StatusCode, message: str, tensor: str | None = None):
    """An error found here, not by the store (same types and codes as the store's own)."""
    return cls(message, code, service=SERVICE, trailers={TENSOR_METADATA_KEY: tensor} if tensor else None)


def _integrity(message: str, tensor: str | None = None) -> IntegrityError:
    return _local(IntegrityError, grpc.StatusCode.DATA_LOSS, message, tensor)


@dataclass
class FetchStream:
    """An open Fetch: the delta's info and tensor list, then its chunks in order (`async for`)."""

    info: pb.DeltaInfo
    tensors: list[pb.TensorInfo]
    _call: Any
    _client: "DeltaStoreClient"

    async def chunks(self) -> AsyncIterator[pb.Chunk]:
        try:
            while (m := await self._call.read()) is not grpc.aio.EOF:  # read(): the header came by read() too
                if m is None:  # grpc's aio stub yields None for bytes it cannot decode
                    raise _integrity(f"delta {self.info.name!r}: the store sent a message that is not a FetchResponse")
                if m.HasField("chunk"):
                    if m.chunk.tensor_index >= len(self.tensors):
                        raise _integrity(f"delta {self.info.name!r}: a chunk for tensor #{m.chunk.tensor_index}, "
                                         f"but the store announced {len(self.tensors)} tensors")
                    yield m.chunk
        except grpc.aio.AioRpcError as e:
            raise self._client._error(e, f"Fetch({self.info.name[:80]!r})") from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class DeltaStoreClient(Client):
    """One channel to a delta store; share it. Use `async with` or call `close()`."""

    SERVICE = SERVICE
    ERROR = DeltaStoreError
    ERROR_TYPES = _TYPES
    MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES

    def __init__(self, target: str, *, timeout_s: float = 30.0, fetch_timeout_s: float = 600.0,
                 credentials: grpc.ChannelCredentials | None = None, token: str = ""):
        super().__init__(target, timeout_s=timeout_s, credentials=credentials, token=token)  # TLS, bearer
        self.fetch_timeout_s = fetch_timeout_s
        self._stub = pb_grpc.DeltaStoreServiceStub(self.channel)

    async def list(self, timeout_s: float | None = None) -> list[pb.DeltaInfo]:
        return list((await self._unary(self._stub.List, pb.ListRequest(), "List", timeout_s)).deltas)

    async def stat(self, name: str, timeout_s: float | None = None) -> pb.StatResponse:
        return await self._unary(self._stub.Stat, pb.StatRequest(name=name), f"Stat({name[:80]!r})", timeout_s)

    async def delete(self, name: str, timeout_s: float | None = None) -> None:
        await self._unary(self._stub.Delete, pb.DeleteRequest(name=name), f"Delete({name[:80]!r})", timeout_s)

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

        r = await self._unary(self._stub.Put, requests(), f"Put({name[:80]!r})", timeout_s or self.fetch_timeout_s)
        return r.info

    async def open_fetch(self, name: str, *, expect_base_fingerprint: str = "", chunk_bytes: int = 0,
                         timeout_s: float | None = None) -> FetchStream:
        """Start streaming delta `name`: returns once its header arrived (nothing else has moved).

        A base mismatch fails here (the store checks `expect_base_fingerprint` before any data, and
        so does this client). The caller reads `chunks()` and verifies what it places.
        """
        call = self._stub.Fetch(
            pb.FetchRequest(name=name, chunk_bytes=chunk_bytes, expect_base_fingerprint=expect_base_fingerprint),
            timeout=timeout_s or self.fetch_timeout_s,
        )
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"Fetch({name[:80]!r})") from None
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF or first is None or not first.HasField("info"):
            call.cancel()
            raise _integrity(f"delta {name!r}: the first Fetch message lacks the delta's info")
        info = first.info
        if expect_base_fingerprint and info.base_fingerprint != expect_base_fingerprint:
            call.cancel()
            raise _local(BaseMismatch, grpc.StatusCode.FAILED_PRECONDITION,
                         f"delta {name!r} was built for base {info.base_model!r} with fingerprint "
                         f"{info.base_fingerprint[:16]}…, expected {expect_base_fingerprint[:16]}…")
        return FetchStream(info, list(first.tensors), call, self)

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
        stream = await self.open_fetch(name, expect_base_fingerprint=expect_base_fingerprint, chunk_bytes=chunk_bytes,
                                       timeout_s=timeout_s)  # fmt: skip
        receiver = _Receiver(name, stream.tensors, alloc or (lambda t: bytearray(t.nbytes)))
        try:
            await receiver.flush_complete(on_tensor)  # empty tensors
            async for chunk in stream.chunks():
                await asyncio.to_thread(receiver.place, chunk)
                await receiver.flush_complete(on_tensor)
        finally:
            stream.cancel()
        receiver.check_done()
        return stream.info, stream.tensors


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
            raise _integrity(f"delta {self.name!r}: tensor {t.name}: sha256 mismatch after receiving it", t.name)
        self.ready.append((self.i, self.buf))
        self.i += 1

    def place(self, c: pb.Chunk) -> None:
        """Runs on a worker thread: check, copy and hash one chunk."""
        t = self.tensors[self.i] if self.i < len(self.tensors) else None
        if t is None or c.tensor_index != self.i or c.offset != self.pos or self.pos + len(c.data) > t.nbytes:
            where = t.name if t is not None else "after the last tensor"
            raise _integrity(f"delta {self.name!r}: chunk (tensor {c.tensor_index}, offset {c.offset}) out of order; "
                             f"expected tensor {self.i} ({where}) at offset {self.pos}", t and t.name)
        if crc32(c.data) != c.crc32:
            raise _integrity(f"delta {self.name!r}: tensor {t.name}: crc32 mismatch in the chunk at offset {c.offset}",
                             t.name)
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
            raise _integrity(f"delta {self.name!r}: the stream ended inside tensor {t.name} "
                             f"({self.pos} of {t.nbytes} bytes)", t.name)
