"""The async client of the delta store, for workers, the router and tools.

    async with DeltaStoreClient("delta-store:50052") as store:
        info, tensors = await store.fetch_into(
            "coder", on_tensor,                        # on_tensor(index, TensorInfo, buffer), after verification
            expect_base_fingerprint=base_fp,           # FAILED_PRECONDITION -> BaseMismatch, before any data
            alloc=lambda t: pinned_buffer(t.nbytes),   # where each tensor's bytes go (default: a bytearray)
        )

`fetch_into` places every chunk at its offset in the tensor's buffer, checks
its crc32, checks each tensor's sha256 once complete (the shared
`bitdelta.rpc.receiver.Receiver`), and only then calls `on_tensor`. A caller
with its own destination (the worker's slot writer, which copies to the
device) uses `open_fetch`: the header first, then the chunks in order, as
`Piece`s (tensor, offset, bytes, crc32), which it gives its own `Receiver`.

Same host: with `accept_shared_memory=True`, a store that keeps the delta in
shared memory (`--shared-memory-dir`) names its file, this client maps it
read-only, and each `Piece`'s bytes are a view of that mapping instead of a
gRPC message: memory speed instead of ~0.35 GB/s. The bytes are the same
either way and so are the checks; if the file cannot be mapped (another host,
another user, an entry dropped meanwhile), the client fetches again without
shared memory. The store keeps the file unchanged until the call ends (a
lease, at most a minute after the last chunk): whoever reads `chunks()` of a
shared stream calls `stream.cancel()` once it has copied every piece it got.

Every call has a deadline (`timeout_s`, per call overridable). Errors are
`DeltaStoreError` (an `RpcError`: `.code` is the store's status, kept by
whoever re-raises it) with subclasses by code: `DeltaNotFound`,
`BaseMismatch`, `IntegrityError` (`.tensor` names the bad tensor),
`StoreUnavailable` (retry later); `InvalidRequest` for values the store refuses.
"""

from __future__ import annotations

import inspect
import logging
import mmap
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiofiles
import grpc

from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
from bitdelta.rpc.client_stream import call_with_handshake
from bitdelta.rpc.clients.base import Client
from bitdelta.rpc.errors import RpcError
from bitdelta.rpc.receiver import ReceiveError, Receiver
from bitdelta.rpc.wire.delta_store import MAX_MESSAGE_BYTES, TENSOR_METADATA_KEY

SERVICE = "delta store"
log = logging.getLogger(__name__)


class DeltaStoreError(RpcError):
    """A delta store call failed (or its data failed a check here); `code` is the status."""

    @property
    def tensor(self) -> str | None:
        return self.trailers.get(TENSOR_METADATA_KEY)


class DeltaNotFound(DeltaStoreError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidRequest(DeltaStoreError):
    """The store refused the request's values (a name that is not a plain name, a malformed upload)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class BaseMismatch(DeltaStoreError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class IntegrityError(DeltaStoreError):
    """Corrupted or inconsistent data; `tensor` names the bad tensor when known."""

    code = grpc.StatusCode.DATA_LOSS


class StoreUnavailable(DeltaStoreError):
    code = grpc.StatusCode.UNAVAILABLE


_TYPES = {cls.code: cls for cls in (DeltaNotFound, InvalidRequest, BaseMismatch, IntegrityError, StoreUnavailable)}


def _local(cls: type[DeltaStoreError], message: str, tensor: str | None = None):
    """An error found here, not by the store (same types and codes as the store's own)."""
    return cls(message, cls.code, service=SERVICE, trailers={TENSOR_METADATA_KEY: tensor} if tensor else None)


def _integrity(message: str, tensor: str | None = None) -> IntegrityError:
    return _local(IntegrityError, message, tensor)


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + len(data)) of tensor `tensor_index`, with the store's crc32 of them.
    `data` is the message's bytes, or a read-only view of the store's shared file."""

    tensor_index: int
    offset: int
    data: bytes | memoryview
    crc32: int


@dataclass
class FetchStream:
    """An open Fetch: the delta's info and tensor list, then its pieces in order (`async for`)."""

    info: pb.DeltaInfo
    tensors: list[pb.TensorInfo]
    _call: Any
    _client: DeltaStoreClient
    # The store checked every byte against the sha256s (at Put or first sight of this version) or the
    # chunk crc32s recorded then: a receiver that trusts the store needs only the crc32s.
    verified: bool = False
    shared: memoryview | None = None  # the mapped shared file, when the bytes come through shared memory
    omitted: frozenset[str] = frozenset()  # a shard's tensors announced but not sent (TensorSlice.omit)

    @property
    def transport(self) -> str:
        return "shared-memory" if self.shared is not None else "stream"

    async def chunks(self) -> AsyncIterator[Piece]:
        """The pieces in order. A shared stream ends after its last byte, without waiting for the call to
        end (the store holds the file for us until `cancel()`); a streamed one ends with the call."""
        name = self.info.name
        left = sum(t.nbytes for t in self.tensors if t.name not in self.omitted) if self.shared is not None else -1
        try:
            while left and (m := await self._call.read()) is not grpc.aio.EOF:  # the header came by read() too
                if m is None:  # grpc's aio stub yields None for bytes it cannot decode
                    raise _integrity(f"delta {name!r}: the store sent a message that is not a FetchResponse")
                if not m.HasField("chunk"):
                    continue
                c = m.chunk
                if c.tensor_index >= len(self.tensors):
                    raise _integrity(
                        f"delta {name!r}: a chunk for tensor #{c.tensor_index}, "
                        f"but the store announced {len(self.tensors)} tensors"
                    )
                if self.shared is None:
                    if c.length and c.length != len(c.data):
                        raise _integrity(f"delta {name!r}: a chunk of {c.length} bytes carries {len(c.data)}")
                    yield Piece(c.tensor_index, c.offset, c.data, c.crc32)
                    continue
                t = self.tensors[c.tensor_index]
                start = c.file_offset if c.HasField("file_offset") else t.file_offset + c.offset  # a shard's run
                if c.data or not c.length or c.offset + c.length > t.nbytes or start + c.length > len(self.shared):
                    raise _integrity(
                        f"delta {name!r}: tensor {t.name}: a shared-memory chunk (offset {c.offset}, "
                        f"{c.length} bytes) outside the tensor or the shared file",
                        t.name,
                    )
                left -= c.length
                yield Piece(c.tensor_index, c.offset, self.shared[start : start + c.length], c.crc32)
        except grpc.aio.AioRpcError as e:
            raise self._client._error(e, f"Fetch({name[:80]!r})") from None
        finally:
            if self.shared is None:
                self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class DeltaStoreClient(Client):
    """One channel to a delta store; share it. Use `async with` or call `close()`."""

    SERVICE = SERVICE
    ERROR = DeltaStoreError
    ERROR_TYPES = _TYPES
    MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 30.0,
        fetch_timeout_s: float = 600.0,
        credentials: grpc.ChannelCredentials | None = None,
        token: str = "",
    ):
        super().__init__(target, timeout_s=timeout_s, credentials=credentials, token=token)  # TLS, bearer
        self.fetch_timeout_s = fetch_timeout_s
        self._stub = pb_grpc.DeltaStoreServiceStub(self.channel)

    async def list(self, timeout_s: float | None = None) -> list[pb.DeltaInfo]:
        return list((await self._unary(self._stub.List, pb.ListRequest(), "List", timeout_s)).deltas)

    async def stat(self, name: str, timeout_s: float | None = None) -> pb.StatResponse:
        return await self._unary(self._stub.Stat, pb.StatRequest(name=name), f"Stat({name[:80]!r})", timeout_s)

    async def delete(self, name: str, timeout_s: float | None = None) -> None:
        await self._unary(self._stub.Delete, pb.DeleteRequest(name=name), f"Delete({name[:80]!r})", timeout_s)

    async def put(
        self,
        name: str,
        data: bytes | str | os.PathLike,
        *,
        overwrite: bool = False,
        chunk_bytes: int = 1 << 20,
        timeout_s: float | None = None,
        on_sent: Callable[[int], None] | None = None,
    ) -> pb.DeltaInfo:
        """Upload a delta file (a path, or its bytes); returns what the store verified and stored.
        `on_sent(n)` is called as each piece of n bytes goes out (a progress bar)."""
        size = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else os.path.getsize(data)  # noqa: ASYNC240 (one stat)
        header = pb.PutRequest(header=pb.PutHeader(name=name, size_bytes=size, overwrite=overwrite))

        async def read():
            if isinstance(data, (bytes, bytearray, memoryview)):
                view = memoryview(data)
                for i in range(0, size, chunk_bytes):
                    yield bytes(view[i : i + chunk_bytes])
            else:
                async with aiofiles.open(data, "rb") as f:
                    while piece := await f.read(chunk_bytes):
                        yield piece

        async def pieces():
            async for piece in read():
                yield pb.PutRequest(data=piece)
                if on_sent is not None:
                    on_sent(len(piece))

        try:  # the store answers the header before any data moves (bitdelta.rpc.client_stream)
            return (
                await call_with_handshake(self._stub.Put(timeout=timeout_s or self.fetch_timeout_s), header, pieces())
            ).info
        except grpc.aio.AioRpcError as e:
            raise self._error(e, f"Put({name[:80]!r})") from None

    async def open_fetch(
        self,
        name: str,
        *,
        expect_base_fingerprint: str = "",
        chunk_bytes: int = 0,
        timeout_s: float | None = None,
        accept_shared_memory: bool = False,
        shard: pb.Shard | None = None,
    ) -> FetchStream:
        """Start streaming delta `name`: returns once its header arrived (nothing else has moved).

        A base mismatch fails here (the store checks `expect_base_fingerprint` before any data, and
        so does this client). The caller reads `chunks()` and verifies what it places.
        `accept_shared_memory`: see the module docstring; `transport` says what was used.
        `shard`: only a tensor-parallel rank's slices (the announced tensors are the slices).
        """
        call = self._stub.Fetch(
            pb.FetchRequest(
                name=name,
                chunk_bytes=chunk_bytes,
                expect_base_fingerprint=expect_base_fingerprint,
                accept_shared_memory=accept_shared_memory,
                shard=shard,
            ),
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
            raise _local(
                BaseMismatch,
                f"delta {name!r} was built for base {info.base_model!r} with fingerprint "
                f"{info.base_fingerprint[:16]}…, expected {expect_base_fingerprint[:16]}…",
            )
        shared = None
        if accept_shared_memory and first.HasField("shared_memory"):  # unasked for, its chunks fail as empty
            try:
                shared = _map_shared(first.shared_memory, info.size_bytes)
            except OSError as e:
                call.cancel()
                log.warning("cannot map the store's shared memory for %r (%s); fetching it as a stream", name[:80], e)
                return await self.open_fetch(
                    name,
                    expect_base_fingerprint=expect_base_fingerprint,
                    chunk_bytes=chunk_bytes,
                    timeout_s=timeout_s,
                    shard=shard,
                )
        omitted = frozenset(s.tensor for s in shard.slices if s.omit) if shard is not None else frozenset()
        return FetchStream(info, list(first.tensors), call, self, first.verified, shared, omitted)

    async def fetch_into(
        self,
        name: str,
        on_tensor: Callable[[int, pb.TensorInfo, Any], Awaitable[None] | None],
        *,
        expect_base_fingerprint: str = "",
        alloc: Callable[[pb.TensorInfo], Any] | None = None,
        chunk_bytes: int = 0,
        timeout_s: float | None = None,
        accept_shared_memory: bool = False,
    ) -> tuple[pb.DeltaInfo, list[pb.TensorInfo]]:
        """Stream delta `name` into per-tensor buffers, verifying every chunk and tensor.

        `alloc(tensor)` returns a writable buffer of `tensor.nbytes` bytes (bytearray,
        numpy array, `torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()`);
        `on_tensor(index, tensor, buffer)` is called once per tensor, in file order,
        after its sha256 matched. Returns the delta's info and tensor list.
        """
        stream = await self.open_fetch(
            name,
            expect_base_fingerprint=expect_base_fingerprint,
            chunk_bytes=chunk_bytes,
            timeout_s=timeout_s,
            accept_shared_memory=accept_shared_memory,
        )
        buffers = _Buffers(stream.tensors, alloc or (lambda t: bytearray(t.nbytes)))
        receiver = Receiver(name, stream.tensors, buffers)
        try:
            await receiver.settled()  # empty tensors
            await buffers.hand_over(on_tensor)
            async for p in stream.chunks():
                receiver.put(p.tensor_index, p.offset, p.data, p.crc32)
                await receiver.settled()  # placed and, if it completed a tensor, checked
                await buffers.hand_over(on_tensor)
            await receiver.finish()
            await buffers.hand_over(on_tensor)
        except ReceiveError as e:
            raise _integrity(str(e), e.tensor) from None
        finally:
            receiver.abort()
            stream.cancel()
        return stream.info, stream.tensors


def _map_shared(shared: pb.SharedMemory, size: int) -> memoryview:
    """A read-only mapping of the store's shared file for a delta of `size` bytes; OSError if it cannot be."""
    if not os.path.isabs(shared.path):
        raise OSError(f"{shared.path!r} is not an absolute path")
    fd = os.open(shared.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        have = os.fstat(fd).st_size  # a reused file may be larger than the delta it holds now
        if not size or have < size or shared.size_bytes != size:
            raise OSError(f"{shared.path} has {have} bytes; the delta has {size}")
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))  # unmapped when the last view goes
    finally:
        os.close(fd)


class _Buffers:
    """`fetch_into`'s destination: a buffer from `alloc` per tensor, handed to `on_tensor` in file
    order once the receiver checked it."""

    def __init__(self, tensors: list[pb.TensorInfo], alloc: Callable[[pb.TensorInfo], Any]):
        self.tensors, self.alloc = tensors, alloc
        self._bufs: dict[int, Any] = {}
        self._checked: set[int] = set()
        self._next = 0  # the next tensor to hand over
        self._lock = threading.Lock()

    def _alloc(self, index: int) -> Any:
        with self._lock:
            if index not in self._bufs:
                self._bufs[index] = self.alloc(self.tensors[index])
            return self._bufs[index]

    def buffer(self, index: int) -> memoryview:
        return memoryview(self._alloc(index)).cast("B")

    def complete(self, index: int) -> None:
        self._alloc(index)  # an empty tensor gets its (empty) buffer here
        with self._lock:
            self._checked.add(index)

    async def hand_over(self, on_tensor) -> None:
        while True:
            with self._lock:
                i = self._next
                if i not in self._checked:
                    return
                self._next += 1
                buf = self._bufs.pop(i)
            r = on_tensor(i, self.tensors[i], buf)
            if inspect.isawaitable(r):
                await r
