"""The delta store's core: List, Stat, Fetch, Put and Delete over a backend and the host cache.

Knows the delta format (through `bitdelta.format`), not gRPC. Every name is
checked by `check_name` before it reaches a backend. What it reads from a
backend is verified: the header always (a truncated file or a bad header is
`CorruptDelta`), and every byte (`verify_reads`): the first time a version of
a delta is seen (Put, or the first read of a file put there by other means)
by each tensor's sha256, recording the crc32 of every chunk; every later read
of that same version (same inode, mtime and size; same ETag) by those crc32s
alone, which run at memory speed where sha256 would halve a cold read. A byte
changed at rest without a new version (bit rot) fails the crc32; a rewritten
file is a new version and is hashed again. What Put sends is verified
completely before it becomes visible.

Fetch, in order: HEAD the object (its version; if the backend is down, a
complete cached copy is served instead); check the base fingerprint; then
one of: follow a cached or loading entry (hit / join), start the single
loader of a new entry (miss), or stream straight from the backend when the
delta cannot be cached (bypass). A same-host caller that accepts shared
memory gets, for an entry in shared memory (services/delta_store/shm.py),
the entry's file and chunk descriptors (where, how long, crc32) instead of
the bytes. Spans: `delta_store.fetch` with the
attribute `cache.result` (hit | join | miss | bypass), and
`delta_store.backend.read` for every read of a whole delta from the backend.
"""

from __future__ import annotations

import array
import asyncio
import bisect
import hashlib
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from opentelemetry import trace

from bitdelta.format import (
    BaseMismatchError,
    DeltaFormatError,
    DeltaHeader,
    check_base,
    check_structure,
    header_length,
    parse_header,
)
from bitdelta.rpc.checksums import crc32, crc32_combine
from bitdelta.rpc.wire.delta_store import MAX_CHUNK_BYTES, slice_runs
from services.delta_store.backends import Backend, ObjectInfo, Reader, check_name
from services.delta_store.cache import Entry, HostCache
from services.delta_store.errors import (
    AlreadyExists,
    BackendUnavailable,
    BaseMismatch,
    CorruptDelta,
    InvalidShard,
    InvalidUpload,
    NotFound,
    ShardNeedsVerifiedReads,
)

log = logging.getLogger(__name__)
HEADER_PROBE_BYTES = 64 * 1024  # first read of a header; most headers fit
HASH_DEPTH = 8  # blocks a load may read ahead of the checks (they land in the entry: no extra memory)
MAX_CACHED_HEADERS = 4096
MAX_VERIFIED = 4096  # remembered verifications (4 bytes per chunk each: 4 KiB per GB of delta at 1 MiB chunks)
SHARED_CHUNK_BYTES = 8 << 20  # a shared-memory chunk announces this much (fewer messages; its crc32 is combined)


@dataclass(frozen=True)
class StoredDelta:
    """One stored delta: its name, backend version and parsed header."""

    name: str
    size: int
    version: str
    header: DeltaHeader

    def info_proto(self):
        from bitdelta.delta_store.v1 import delta_store_pb2 as pb

        meta, by_role = self.header.meta, self.header.bytes_by_role()
        return pb.DeltaInfo(
            name=self.name,
            size_bytes=self.size,
            base_model=meta.base_model,
            base_fingerprint=meta.base_fingerprint,
            format_version=self.header.metadata.get("format_version", ""),
            alpha_mode={"row": pb.ALPHA_MODE_ROW, "matrix": pb.ALPHA_MODE_MATRIX}.get(meta.alpha_mode, 0),
            distilled=bool(meta.distilled),
            sign_bytes=by_role["sign"],
            alpha_bytes=by_role["alpha"],
            dense_bytes=by_role["dense"],
            metadata=self.header.metadata,
            version=self.version,
        )

    def tensors_proto(self) -> list:
        from bitdelta.delta_store.v1 import delta_store_pb2 as pb

        roles = {
            "sign": pb.TENSOR_ROLE_SIGN,
            "alpha": pb.TENSOR_ROLE_ALPHA,
            "dense": pb.TENSOR_ROLE_DENSE,
            "lowrank": pb.TENSOR_ROLE_LOWRANK,
            "file": pb.TENSOR_ROLE_FILE,
        }
        return [
            pb.TensorInfo(
                name=t.name,
                role=roles[t.part],
                dtype=t.dtype,
                shape=t.shape,
                file_offset=t.start,
                nbytes=t.nbytes,
                sha256=self.header.sha256[t.name],
            )
            for t in self.header.tensors
        ]


@dataclass(frozen=True)
class TensorSlice:
    """A tensor-parallel rank's part of one tensor: runs of rows (None: all), one run of columns (None:
    all; packed signs: bytes). `omit`: another rank fetches the same slice and hands it over, so it is
    announced but none of its bytes are sent."""

    rows: tuple[tuple[int, int], ...] | None = None
    cols: tuple[int, int] | None = None
    omit: bool = False


@dataclass(frozen=True)
class Shard:
    """A Fetch of one rank's slices: `slices` by tensor name (the others whole)."""

    rank: int
    size: int
    slices: dict[str, TensorSlice]

    def runs(self, header: DeltaHeader, name: str) -> dict[int, tuple[list[tuple[int, int]], tuple[int, ...]]]:
        """tensor index -> ((offset, length) runs of its bytes this rank gets — none for an omitted
        slice —, the slice's shape); InvalidShard for a tensor the delta lacks or a slice outside its shape."""
        index = {t.name: i for i, t in enumerate(header.tensors)}
        out = {}
        for tname, sl in self.slices.items():
            if tname not in index:
                raise InvalidShard(f"delta {name!r} has no tensor {tname[:120]!r} (FetchRequest.shard)")
            t = header.tensors[index[tname]]
            shape = tuple(t.shape)
            ok = all(0 <= a <= b <= (shape[0] if shape else 1) for a, b in sl.rows or ())
            if sl.cols is not None:
                ok = ok and len(shape) >= 2 and 0 <= sl.cols[0] <= sl.cols[1] <= shape[1]
            if not ok:
                raise InvalidShard(f"delta {name!r}: the shard's slice of {tname} lies outside its shape {list(shape)}")
            itemsize = t.nbytes // max(1, _numel(shape))
            runs = slice_runs(shape, itemsize, list(sl.rows) if sl.rows else None, sl.cols)
            local = list(shape)
            if sl.rows:
                local[0] = sum(b - a for a, b in sl.rows)
            if sl.cols is not None:
                local[1] = sl.cols[1] - sl.cols[0]
            out[index[tname]] = ([] if sl.omit else runs, tuple(local))
        return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Chunk:
    tensor_index: int
    offset: int  # within the tensor
    data: bytes  # empty when the bytes are in shared memory
    crc32: int
    length: int = 0  # shared memory: the chunk's size (its bytes are at the tensor's start + offset)
    file_offset: int | None = None  # shared memory, a shard's slice: where its bytes are in the file instead

    @property
    def nbytes(self) -> int:
        return self.length or len(self.data)


def _tensor_pieces(tensors, ends: list[int], offset: int, view: memoryview):
    """(index, tensor, offset within the tensor, bytes) of every tensor overlapping [offset, offset + len(view))."""
    end = offset + len(view)
    for i in range(bisect.bisect_right(ends, offset), len(tensors)):
        t = tensors[i]
        if t.start >= end:
            return
        a, b = max(t.start, offset), min(t.end, end)
        if a < b:
            yield i, t, a - t.start, view[a - offset : b - offset]


async def _read_blocks(
    reader: Reader, size: int, block: int, into: memoryview | None, spare: list[bytearray]
) -> AsyncIterator[tuple[int, memoryview]]:
    """(file offset, bytes) of consecutive blocks of the object, the last one short if the object is.

    Into a cache entry, the reader reads ahead on its own (`Reader.fill`: no memory but the entry's);
    otherwise block by block into the `spare` buffers in turn, which the caller must be done with
    `len(spare) - 1` blocks later."""
    if into is not None:
        start = 0
        async for filled in reader.fill(into[:size], block):
            yield start, into[start:filled]
            start = filled
        return
    for i, start in enumerate(range(0, size, block)):
        n = min(block, size - start)
        buf = memoryview(spare[i % len(spare)])[:n]
        got = await reader.readinto(start, buf)
        yield start, buf[:got]
        if got < n:
            return


def _retrieve(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


class _TensorChecks:
    """sha256 of every tensor (if `verify`) and crc32 of every `chunk_bytes` chunk (if `crcs`), fed the file's bytes.

    A tensor's pieces must be fed in order; different tensors are independent,
    so `feed_parallel` hashes them on worker threads at once (hashlib and zlib
    release the GIL), chained per tensor. A mismatch raises DeltaFormatError
    naming the tensor.
    """

    def __init__(
        self,
        header: DeltaHeader,
        verify: bool = True,
        chunk_bytes: int = 0,
        crcs: list[list[int]] | None = None,
        expect: list | None = None,
    ):
        self.header, self.verify, self.chunk_bytes, self.crcs = header, verify, chunk_bytes, crcs
        self.expect = expect  # per tensor, the crc32s recorded when this version was verified: compare
        self._ends = [t.end for t in header.tensors]
        self._state: dict[int, list] = {}  # tensor index -> [sha256, running crc] while in progress
        self._finished: set[int] = set()
        self._tails: dict[int, asyncio.Future] = {}  # last scheduled update per tensor
        for i, t in enumerate(header.tensors):
            if not t.nbytes:
                self._finish(i, t, hashlib.sha256())

    def _finish(self, i: int, t, sha) -> None:
        if self.verify and sha.hexdigest() != self.header.sha256[t.name]:
            raise DeltaFormatError(f"tensor {t.name}: sha256 mismatch (corrupted data)", tensor=t.name)
        self._finished.add(i)

    def _update(self, i: int, t, pos: int, piece: memoryview) -> None:
        state = self._state.get(i)
        if state is None:
            state = self._state[i] = [hashlib.sha256() if self.verify else None, 0]
        if self.verify:
            state[0].update(piece)
        end = pos + len(piece)
        if self.crcs is not None:
            crc, chunk, out = state[1], self.chunk_bytes, self.crcs[i]
            while piece:
                part, piece = piece[: chunk - pos % chunk], piece[chunk - pos % chunk :]
                crc = crc32(part, crc)
                pos += len(part)
                if pos % chunk == 0 or pos == t.nbytes:
                    if self.expect is not None and self.expect[i][len(out)] != crc:
                        raise DeltaFormatError(
                            f"tensor {t.name}: the chunk at offset {len(out) * chunk} changed since "
                            "the delta was verified (crc32 mismatch: corrupted at rest)",
                            tensor=t.name,
                        )
                    out.append(crc)
                    crc = 0
            state[1] = crc
        if end == t.nbytes:
            del self._state[i]
            self._finish(i, t, state[0])

    def feed(self, offset: int, view: memoryview) -> None:
        for i, t, pos, piece in _tensor_pieces(self.header.tensors, self._ends, offset, view):
            self._update(i, t, pos, piece)

    def feed_parallel(self, offset: int, view: memoryview) -> asyncio.Future:
        """Schedule the pieces of [offset, offset + len(view)); the result is done when they are checked."""
        steps = []
        if not self.verify and self.crcs is None:
            return asyncio.gather()  # nothing to compute
        for i, t, pos, piece in _tensor_pieces(self.header.tensors, self._ends, offset, view):
            step = asyncio.ensure_future(self._step(self._tails.get(i), i, t, pos, piece))
            self._tails[i] = step
            steps.append(step)
        return asyncio.gather(*steps)

    async def _step(self, previous, i, t, pos, piece) -> None:
        if previous is not None:
            await previous
        if len(piece) < 65536:
            self._update(i, t, pos, piece)
        else:
            await asyncio.to_thread(self._update, i, t, pos, piece)
        if self._tails.get(i) is asyncio.current_task():
            del self._tails[i]

    async def settle(self) -> None:
        """Wait until no scheduled update runs (a thread may be reading a buffer that is about to go)."""
        await asyncio.gather(*self._tails.values(), return_exceptions=True)

    def done(self) -> bool:
        return len(self._finished) == len(self.header.tensors)


class Delivery:
    """One Fetch as the store serves it: `delta` first, then the chunks (`async for`); use it as
    `async with`. (The receiving end is the client's `FetchStream`.)"""

    def __init__(
        self,
        delta: StoredDelta,
        chunks: AsyncIterator[Chunk],
        span: trace.Span,
        release=None,
        *,
        verified: bool = False,
        shared_path: str | None = None,
        runs: dict[int, tuple[list[tuple[int, int]], tuple[int, ...]]] | None = None,
    ):
        self.delta, self._chunks, self._span, self._release = delta, chunks, span, release
        self.runs = runs  # a shard's: tensor index -> (byte runs it sends, the slice's shape); the others whole
        self.verified = verified  # every byte was checked against the sha256s (or the crc32s recorded then)
        self.shared_path = shared_path  # chunks carry no data: their bytes are in this file
        self.bytes_sent = 0

    def tensors_proto(self) -> list:
        """The tensors as this Fetch sends them: a shard's slices with their shapes and sizes (no
        sha256: the chunk crc32s cover them, the store verified the whole)."""
        out = self.delta.tensors_proto()
        for i, (_, shape) in (self.runs or {}).items():
            t = out[i]
            itemsize = t.nbytes // max(1, _numel(t.shape))
            del t.shape[:]
            t.shape.extend(shape)
            t.nbytes, t.sha256 = _numel(shape) * itemsize, ""
        return out

    def __aiter__(self):
        return self

    async def __anext__(self) -> Chunk:
        c = await self._chunks.__anext__()
        self.bytes_sent += c.nbytes
        return c

    async def __aenter__(self) -> Delivery:
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await self._chunks.aclose()
        finally:
            if self._release is not None:
                self._release()
            self._span.set_attribute("delta.bytes_sent", self.bytes_sent)
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
                self._span.record_exception(exc)
                self._span.set_status(trace.StatusCode.ERROR, str(exc))
            elif exc_type is asyncio.CancelledError or exc_type is GeneratorExit:
                self._span.set_attribute("fetch.cancelled", True)
            self._span.end()


async def _sliced(
    chunks: AsyncIterator[Chunk], runs: dict[int, tuple[list[tuple[int, int]], tuple]], chunk: int
) -> AsyncIterator[Chunk]:
    """A shard's chunks, from the whole delta's (in tensor order): a tensor with runs keeps only
    their bytes, re-cut into chunks of at most `chunk` bytes of the slice, each with its crc32; the
    others pass as they are."""
    cur, buf, pos, ri = -1, bytearray(), 0, 0  # tensor, its slice bytes not sent yet, where buf starts, next run

    def cut(final: bool):
        nonlocal buf, pos
        while buf and (len(buf) >= chunk or final):
            data = bytes(buf[:chunk])
            del buf[:chunk]
            yield Chunk(cur, pos, data, crc32(data))
            pos += len(data)

    try:
        async for c in chunks:
            if c.tensor_index != cur:
                for out in cut(True):
                    yield out
                cur, pos, ri = c.tensor_index, 0, 0
            if cur not in runs:
                yield c
                continue
            rs, a0, a1 = runs[cur][0], c.offset, c.offset + len(c.data)
            while ri < len(rs):
                o, n = rs[ri]
                if o >= a1:
                    break
                lo, hi = max(o, a0), min(o + n, a1)
                if hi > lo:
                    buf += c.data[lo - a0 : hi - a0]
                if o + n > a1:
                    break
                ri += 1
            for out in cut(False):
                yield out
        for out in cut(True):
            yield out
    finally:
        await chunks.aclose()


class DeltaStore:
    def __init__(
        self,
        backend: Backend,
        cache: HostCache,
        *,
        chunk_bytes: int = 1 << 20,
        read_block_bytes: int = 8 << 20,
        verify_reads: bool = True,
        tracer_provider: trace.TracerProvider | None = None,
    ):
        self.backend, self.cache = backend, cache
        self.chunk_bytes, self.read_block_bytes, self.verify_reads = chunk_bytes, read_block_bytes, verify_reads
        self.tracer = trace.get_tracer("services.delta_store", tracer_provider=tracer_provider)
        self._headers: OrderedDict[str, tuple[str, DeltaHeader]] = OrderedDict()
        self._bad: dict[
            str, tuple[str, CorruptDelta]
        ] = {}  # name -> (version, error) of deltas that failed verification
        self._header_reads: dict[tuple[str, str], asyncio.Future] = {}
        # name -> (version, chunk crc32s per tensor) of deltas whose every tensor passed sha256
        self._verified: OrderedDict[str, tuple[str, list]] = OrderedDict()
        self.transports: Counter[str] = Counter()  # Fetches opened, by how their bytes travel: stream | shared-memory

    async def close(self) -> None:
        self.cache.close()
        await self.backend.close()

    # -- List / Stat -------------------------------------------------------------------
    async def list(self) -> list[StoredDelta]:
        objects = await self.backend.list()
        sem = asyncio.Semaphore(8)

        async def describe(o: ObjectInfo) -> StoredDelta | None:
            async with sem:
                try:
                    return await self._describe(o)
                except (CorruptDelta, NotFound) as e:  # invalid files and ones deleted meanwhile are not listed
                    log.debug("not listing %s: %s", o.name, e)
                    return None

        found = await asyncio.gather(*(describe(o) for o in objects))
        return sorted((d for d in found if d is not None), key=lambda d: d.name)

    async def stat(self, name: str) -> StoredDelta:
        check_name(name)
        return await self._describe(await self.backend.head(name))

    async def _describe(self, o: ObjectInfo) -> StoredDelta:
        bad = self._bad.get(o.name)
        if bad is not None and bad[0] == o.version:
            raise bad[1]
        cached = self._headers.get(o.name)
        if cached is not None and cached[0] == o.version:
            self._headers.move_to_end(o.name)
            return StoredDelta(o.name, o.size, o.version, cached[1])
        key = (o.name, o.version)
        read = self._header_reads.get(key)
        if read is None:  # single flight for headers too
            read = self._header_reads[key] = asyncio.ensure_future(self._read_header(o))
            read.add_done_callback(lambda _: self._header_reads.pop(key, None))
        header = await asyncio.shield(read)
        self._remember_header(o.name, o.version, header)
        return StoredDelta(o.name, o.size, o.version, header)

    async def _read_header(self, o: ObjectInfo) -> DeltaHeader:
        try:
            prefix = await self.backend.read_range(o.name, 0, min(o.size, HEADER_PROBE_BYTES))
            need = 8 + header_length(prefix)
            if need > len(prefix) and o.size >= need:
                prefix += await self.backend.read_range(o.name, len(prefix), need - len(prefix))
            header = parse_header(prefix, file_size=o.size)
            check_structure(header)
            return header
        except DeltaFormatError as e:
            raise self._corrupt(o, e) from None

    def _remember_verified(self, name: str, version: str, crcs: list[list[int]]) -> None:
        self._verified[name] = (version, [array.array("I", c) for c in crcs])
        self._verified.move_to_end(name)
        while len(self._verified) > MAX_VERIFIED:
            self._verified.popitem(last=False)

    def verified_crcs(self, name: str, version: str) -> list | None:
        """The chunk crc32s recorded when this version of `name` passed sha256, or None."""
        rec = self._verified.get(name)
        return rec[1] if rec is not None and rec[0] == version else None

    def _remember_header(self, name: str, version: str, header: DeltaHeader) -> None:
        self._headers[name] = (version, header)
        self._headers.move_to_end(name)
        while len(self._headers) > MAX_CACHED_HEADERS:
            self._headers.popitem(last=False)

    def _corrupt(self, o: ObjectInfo, e: DeltaFormatError) -> CorruptDelta:
        err = CorruptDelta(o.name, str(e), tensor=e.tensor)
        self._verified.pop(o.name, None)
        self._bad[o.name] = (o.version, err)
        log.error("%s", err)
        return err

    def _forget(self, name: str, history: bool = False) -> None:
        self._headers.pop(name, None)
        self._bad.pop(name, None)
        self._verified.pop(name, None)
        self.cache.drop(name, forget=history)

    # -- Fetch -------------------------------------------------------------------------
    async def fetch(
        self,
        name: str,
        chunk_bytes: int = 0,
        expect_base_fingerprint: str = "",
        accept_shared_memory: bool = False,
        shard: Shard | None = None,
    ) -> Delivery:
        """Open a Fetch: raises NotFound, BaseMismatch, CorruptDelta, BackendUnavailable before any data.
        `shard`: only one tensor-parallel rank's slices (InvalidShard, ShardNeedsVerifiedReads)."""
        check_name(name)
        chunk = min(chunk_bytes or self.chunk_bytes, MAX_CHUNK_BYTES)
        span = self.tracer.start_span("delta_store.fetch", attributes={"delta.name": name, "fetch.chunk_bytes": chunk})
        try:
            with trace.use_span(span, end_on_exit=False):
                if shard is not None and not self.verify_reads:
                    raise ShardNeedsVerifiedReads(
                        f"a sharded Fetch of {name!r} needs a store that verifies its reads (--verify-reads): "
                        "a slice has no sha256 of its own"
                    )
                stream = await self._open(name, chunk, expect_base_fingerprint, span, accept_shared_memory, shard)
        except BaseException as e:
            span.record_exception(e)
            span.set_status(trace.StatusCode.ERROR, str(e))
            span.end()
            raise
        return stream

    async def _open(
        self, name: str, chunk: int, expect: str, span: trace.Span, accept_shared: bool, shard: Shard | None = None
    ) -> Delivery:
        try:
            o = await self.backend.head(name)
            delta = await self._describe(o)
        except BackendUnavailable:
            e = self.cache.entries.get(name)
            if e is None or not e.complete:
                raise
            log.warning("backend unavailable; serving %s from the cache", name)
            o = ObjectInfo(name, e.size, e.version)
            delta = StoredDelta(name, e.size, e.version, e.header)
        span.set_attribute("delta.size_bytes", delta.size)
        if expect:
            try:
                check_base(delta.header.meta, expect)
            except BaseMismatchError as e:
                raise BaseMismatch(str(e)) from None
        runs = None if shard is None else shard.runs(delta.header, name)  # InvalidShard before any reservation
        if shard is not None:
            span.set_attribute("fetch.shard", f"{shard.rank}/{shard.size}")
        entry = self.cache.lookup(name, o.version)
        if entry is not None:
            result = "hit" if entry.complete else "join"
        else:
            entry = self.cache.reserve(name, o.version, delta.header, self.chunk_bytes)
            result = "miss" if entry is not None else "bypass"
        self.cache.stats[result] += 1
        span.set_attribute("cache.result", result)
        span.set_attribute("cache.hit", result == "hit")
        if entry is None:
            self._count_transport(span, False)
            chunks = self._chunks_direct(delta, chunk, span)
            chunks = chunks if runs is None else _sliced(chunks, runs, chunk)
            return Delivery(delta, chunks, span, verified=self.verify_reads, runs=runs)
        entry.readers += 1  # before any await: the loader lives while someone reads
        if result == "miss":
            entry.loader = asyncio.get_running_loop().create_task(self._load(entry), name=f"load {name}")
        shared = entry.shared.path if accept_shared and entry.shared is not None else None
        self._count_transport(span, shared is not None)
        if runs is None:
            chunks = self._chunks_from(entry, chunk, shared is not None)
        elif shared is not None:
            chunks = self._shared_slices(entry, runs)
        else:
            chunks = _sliced(self._chunks_from(entry, chunk), runs, chunk)
        return Delivery(
            delta,
            chunks,
            span,
            runs=runs,
            release=lambda: self.cache.release(entry),
            verified=self.verify_reads,
            shared_path=shared,
        )

    def _count_transport(self, span: trace.Span, shared: bool) -> None:
        transport = "shared-memory" if shared else "stream"
        self.transports[transport] += 1
        span.set_attribute("fetch.transport", transport)

    async def _chunks_from(self, entry: Entry, chunk: int, shared: bool = False) -> AsyncIterator[Chunk]:
        """The entry's chunks as it fills; `shared`: descriptors only (the bytes are in the entry's shared
        file), SHARED_CHUNK_BYTES at a time, their crc32s combined from those computed while loading."""
        if shared:
            chunk = max(1, SHARED_CHUNK_BYTES // entry.chunk_bytes) * entry.chunk_bytes
        for i, t in enumerate(entry.header.tensors):
            for off in range(0, t.nbytes, chunk):
                n = min(chunk, t.nbytes - off)
                if entry.filled < t.start + off + n:
                    await entry.wait_for(t.start + off + n)
                if shared:
                    yield Chunk(i, off, b"", self._shared_crc(entry, i, off, n), n)
                    continue
                data = bytes(entry.view[t.start + off : t.start + off + n])
                crc = entry.crc(i, off, chunk)
                yield Chunk(i, off, data, crc32(data) if crc is None else crc)

    async def _shared_slices(self, entry: Entry, runs) -> AsyncIterator[Chunk]:
        """A shard's descriptors into the entry's shared file: one per run of its slice's bytes (adjacent
        runs merged, each at most SHARED_CHUNK_BYTES), with where the bytes lie in the file (they are
        not at the tensor's start + offset) and their crc32; the other tensors as `_chunks_from` does."""
        for i, t in enumerate(entry.header.tensors):
            if i not in runs:
                for off in range(0, t.nbytes, SHARED_CHUNK_BYTES):
                    n = min(SHARED_CHUNK_BYTES, t.nbytes - off)
                    if entry.filled < t.start + off + n:
                        await entry.wait_for(t.start + off + n)
                    yield Chunk(i, off, b"", crc32(entry.view[t.start + off : t.start + off + n]), n)
                continue
            merged: list[list[int]] = []
            for o, n in runs[i][0]:
                if merged and merged[-1][0] + merged[-1][1] == o and merged[-1][1] + n <= SHARED_CHUNK_BYTES:
                    merged[-1][1] += n
                else:
                    merged.append([o, n])
            pos = 0
            for o, n in merged:
                a = t.start + o
                if entry.filled < a + n:
                    await entry.wait_for(a + n)
                yield Chunk(i, pos, b"", crc32(entry.view[a : a + n]), n, file_offset=a)
                pos += n

    @staticmethod
    def _shared_crc(entry: Entry, i: int, off: int, n: int) -> int:
        """crc32 of bytes [off, off + n) of tensor i, combined from the chunk crc32s its loader recorded
        (every announced chunk has them: they are computed before its bytes are published)."""
        step = entry.chunk_bytes
        crc = entry.crc(i, off, step)
        for o in range(off + step, off + n, step):
            crc = crc32_combine(crc, entry.crc(i, o, step), min(step, off + n - o))
        return crc

    async def _chunks_direct(self, delta: StoredDelta, chunk: int, fetch_span: trace.Span) -> AsyncIterator[Chunk]:
        """Stream without caching: blocks from the backend, cut into chunks."""
        header = delta.header
        with self.tracer.start_as_current_span(
            "delta_store.backend.read",
            attributes=self._read_attrs(delta),
            context=trace.set_span_in_context(fetch_span),
        ):
            async with await self.backend.open(delta.name) as reader:
                i, pos = 0, 0  # tensor index, offset within it
                carry = bytearray()  # a chunk that spans two blocks
                async for start, view in self._verified_blocks(delta, reader):
                    end = start + len(view)
                    while i < len(header.tensors):
                        t = header.tensors[i]
                        if pos == t.nbytes:
                            i, pos = i + 1, 0
                            continue
                        n = min(chunk, t.nbytes - pos)
                        a = t.start + pos + len(carry)
                        b = t.start + pos + n
                        if b > end:
                            carry += view[a - start :]
                            break
                        data = (
                            bytes(carry + view[a - start : b - start]) if carry else bytes(view[a - start : b - start])
                        )
                        carry = bytearray()
                        yield Chunk(i, pos, data, crc32(data))
                        pos += n

    def _read_attrs(self, delta: StoredDelta) -> dict:
        return {
            "delta.name": delta.name,
            "delta.size_bytes": delta.size,
            "backend.kind": self.backend.kind,
            "verify_reads": self.verify_reads,
        }

    async def _load(self, entry: Entry) -> None:
        """The one loader of an entry: read the whole delta into it, verifying as it goes."""
        delta = StoredDelta(entry.name, entry.size, entry.version, entry.header)
        try:
            with self.tracer.start_as_current_span("delta_store.backend.read", attributes=self._read_attrs(delta)):
                async with await self.backend.open(entry.name) as reader:
                    async for start, view in self._verified_blocks(delta, reader, into=entry.view, crcs=entry.crcs):
                        entry.publish(start + len(view))
        except asyncio.CancelledError:
            entry.fail(BackendUnavailable(f"loading {entry.name!r} was cancelled"))
            raise
        except Exception as e:
            if self.cache.entries.get(entry.name) is entry:
                self.cache.drop(entry.name)
            entry.fail(e)

    async def _verified_blocks(
        self, delta: StoredDelta, reader: Reader, into: memoryview | None = None, crcs: list[list[int]] | None = None
    ) -> AsyncIterator[tuple[int, memoryview]]:
        """Consecutive blocks of the whole file, (file offset, bytes), read sequentially.

        Reads land in `into` (the cache entry) or in a few reused buffers. While
        the next blocks are read, worker threads hash the tensors of earlier ones
        (several tensors at once); a block is yielded, in order, once all its
        bytes are checked, so every tensor that ends in it has passed its sha256
        check (if verify_reads). Chunk crc32s go to `crcs` if given.
        """
        size, block = delta.size, self.read_block_bytes
        o = ObjectInfo(delta.name, delta.size, delta.version)
        if reader.size != size:
            raise BackendUnavailable(f"delta {delta.name!r} changed while it was being read; retry")
        depth = HASH_DEPTH if into is not None else 2  # blocks read ahead of the checks
        spare = [] if into is not None else [bytearray(min(block, size)) for _ in range(depth + 1)]
        expect = self.verified_crcs(delta.name, delta.version) if self.verify_reads else None
        if self.verify_reads and crcs is None:
            crcs = [[] for _ in delta.header.tensors]  # recorded (first sight) or compared (seen before)
        # sha256 at first sight of this version; afterwards the recorded chunk crc32s check every byte
        checks = _TensorChecks(delta.header, self.verify_reads and expect is None, self.chunk_bytes, crcs, expect)
        inflight: deque = deque()  # (start, view, checks done)
        end = 0
        try:
            async for start, buf in _read_blocks(reader, size, block, into, spare):
                end = start + len(buf)
                inflight.append((start, buf, checks.feed_parallel(start, buf)))
                while inflight and (inflight[0][2].done() or len(inflight) >= depth):
                    first, view, checked = inflight.popleft()
                    await checked
                    yield first, view
            if end < size:
                cut = next((t.name for t in delta.header.tensors if t.end > end), None)
                raise self._corrupt(
                    o, DeltaFormatError(f"file is truncated at byte {end}; tensor {cut} is cut", tensor=cut)
                )
            while inflight:
                first, view, checked = inflight.popleft()
                await checked
                yield first, view
            if self.verify_reads and expect is None and checks.done():
                self._remember_verified(delta.name, delta.version, crcs)
        except DeltaFormatError as e:
            raise self._corrupt(o, e) from None
        finally:
            for _, _, checked in inflight:  # checks nobody waits for any more must not log when collected
                checked.add_done_callback(_retrieve)
            await checks.settle()

    # -- Put / Delete --------------------------------------------------------------------
    async def put(
        self,
        name: str,
        size: int,
        overwrite: bool,
        data: AsyncIterator[bytes],
        *,
        accepted: Callable[[], Awaitable[None]] | None = None,
    ) -> StoredDelta:
        """Store a delta from consecutive pieces of its file; visible only once verified completely.

        `accepted` is awaited once the name, size and overwrite rule have passed and the upload has
        begun, before `data` is read (the server answers the client's header with it)."""
        check_name(name)
        if size < 8:
            raise InvalidUpload(f"size_bytes={size} is too small for a delta file")
        if not overwrite:
            try:
                await self.backend.head(name)
            except NotFound:
                pass
            else:
                raise AlreadyExists(f"a delta named {name!r} exists; Delete it first or Put with overwrite=true")
        with self.tracer.start_as_current_span(
            "delta_store.put", attributes={"delta.name": name, "delta.size_bytes": size}
        ):
            upload = await self.backend.begin_upload(name, size)
            try:
                if accepted is not None:
                    await accepted()
                header, crcs = await self._receive(name, size, data, upload)
                info = await upload.commit(overwrite)
            except BaseException:
                await asyncio.shield(upload.abort())
                raise
        self._forget(name)
        self._remember_header(name, info.version, header)
        if info.size == size:
            self._remember_verified(name, info.version, crcs)  # hashed as it arrived: no second pass
        log.info("stored delta %s (%d bytes)", name, info.size)
        return StoredDelta(name, info.size, info.version, header)

    async def _receive(self, name: str, size: int, data: AsyncIterator[bytes], upload) -> tuple[DeltaHeader, list]:
        prefix, got = bytearray(), 0
        header, sha = None, None
        try:
            async for piece in data:
                if got + len(piece) > size:
                    raise InvalidUpload(f"upload of {name!r} sent more than size_bytes={size} bytes")
                if header is None:
                    prefix += piece
                    if len(prefix) >= 8 and len(prefix) >= 8 + header_length(prefix):
                        header = parse_header(bytes(prefix), file_size=size)
                        check_structure(header)
                        crcs = [[] for _ in header.tensors]
                        sha = _TensorChecks(header, chunk_bytes=self.chunk_bytes, crcs=crcs)
                        await asyncio.to_thread(sha.feed, 0, memoryview(prefix))
                        prefix = None
                else:
                    if len(piece) > 65536:
                        await asyncio.to_thread(sha.feed, got, memoryview(piece))
                    else:
                        sha.feed(got, memoryview(piece))
                await upload.write(piece)
                got += len(piece)
            if got != size:
                raise InvalidUpload(f"upload of {name!r} ended after {got} of size_bytes={size} bytes")
            if header is None or not sha.done():
                raise InvalidUpload(f"upload of {name!r} is not a complete delta file")
            return header, crcs
        except DeltaFormatError as e:
            raise InvalidUpload(f"upload of {name!r} is not a valid delta: {e}") from None

    async def delete(self, name: str) -> None:
        check_name(name)
        await self.backend.delete(name)
        self._forget(name, history=True)
        log.info("deleted delta %s", name)
