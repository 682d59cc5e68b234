"""Where deltas come from: a small interface with two implementations.

    source.open(name, base_fingerprint) -> DeltaInfo      (header only, no data)
    await source.stream(info, receiver)                    (bytes into the receiver)

- `LocalDeltaSource`: a directory of `<name>.bitdelta` (or `<name>.safetensors`)
  files. Reads straight into the receiver's buffers (`readinto`, no copy) on a
  thread, so the event loop never waits on the disk.
- `DeltaStoreSource`: the delta_store service over gRPC (`Fetch`), through the
  shared client's `open_fetch`, so chunks land in the receiver without an
  intermediate copy. On the store's host, chunks are copied out of the store's
  shared host cache (`accept_shared_memory`) instead of streamed.

The shared receiver (`bitdelta.rpc.receiver.Receiver`, into the loader's
`SlotWriter`) places bytes and checks crc32 per chunk, and sha256 per tensor
unless the source says the store verified them already (`DeltaInfo.verified`:
the strong hash runs once, where a delta enters the store); sources only move
bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import grpc

from bitdelta.format import (
    READ_VERSIONS,
    V1_LAYOUT,
    DeltaFormatError,
    DeltaMeta,
    alpha_axis,
    check_base,
    check_structure,
    read_header,
)
from bitdelta.rpc.clients.delta_store import DeltaStoreClient, FetchStream
from bitdelta.rpc.receiver import Receiver
from services.gpu_worker.errors import FailedPrecondition, NotFound

# Bytes per read from a local file: large enough for full disk bandwidth,
# small enough that hashing overlaps the next read.
READ_BYTES = 2 << 20
IOV_MAX = 1024  # buffers per preadv (the Linux limit)
FILE_SUFFIXES = (".bitdelta.safetensors", ".safetensors", ".bitdelta", ".delta")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a delta as the source announces it."""

    name: str  # e.g. "model.layers.0.self_attn.q_proj.weight.sign"
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    nbytes: int
    sha256: str
    file_offset: int = 0

    @property
    def param(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def role(self) -> str:
        return self.name.rsplit(".", 1)[1]


def refuse_parts(name: str, meta: DeltaMeta) -> None:
    """What this worker cannot serve of a format v3 delta, refused before any byte moves: an
    embedding or head plane whose α scales its columns (its extras hold α per token). Everything
    else of v3 is served, by one process and by tensor-parallel ranks alike."""
    col = sorted(p for p in meta.shapes if "col" in meta.axes(p) and not p.startswith("model.layers."))
    if col:
        raise FailedPrecondition(
            f"delta {name!r} has an embedding or head plane whose α scales its columns ({col[0]}), which this "
            "worker does not serve: compress it again (bitdelta compress gives them α per token), or evaluate "
            "it offline (bitdelta apply)"
        )


@dataclass
class DeltaInfo:
    """A delta's header: enough to validate and size it before any data moves (the source has
    checked its base and format when it opened it)."""

    name: str
    tensors: list[TensorSpec]
    handle: object = None  # source-private (an open stream, a path)
    # The source verified every byte against the tensors' sha256s (the delta store does, once per
    # version of a delta); the receiver then checks the chunk crc32s only.
    verified: bool = False
    transport: str = "file"  # how the bytes travel: file | stream | shared-memory
    # The base it was made for (format v2); a v1 file: "" and the v1 layout (a Llama/Mistral base).
    architecture: str = ""
    layout: str = V1_LAYOUT
    # Tensor parallelism: the source sent this rank's slices only (`tensors` are the slices), not
    # whole tensors for the rank to cut (parallel.ShardedLoad).
    sliced: bool = False
    version: str = ""  # the store's version of the stored bytes (DeltaInfo.version): a replaced delta's changes
    eos_token_ids: tuple[int, ...] = ()  # the fine-tune's own end-of-sequence tokens (DeltaMeta); (): the base's
    vocab_size: int = 0  # the fine-tune's vocabulary where it grew past the base's (DeltaMeta); 0: the base's
    # Tensor parallelism from the store, each byte fetched once: tensors whose slice's bytes from an
    # offset on another rank fetches and hands to this one (name -> (that rank, offset); offset 0:
    # the store announces the slice, sends no bytes; else it sends the bytes before the offset, a
    # fused qkv's own query rows), and those this rank hands on (name -> (how many ranks receive
    # them, the offset of what they receive in this rank's slice)).
    handed_from: dict[str, tuple[int, int]] = field(default_factory=dict)
    hands_to: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Format v3: compressed param -> the α axis of each of its sign planes ("row", "matrix",
    # "col"), from the header's `parts` (a column α of a square matrix has a row α's shape); empty:
    # one plane of row or matrix α each
    axes: dict[str, list[str]] = field(default_factory=dict)

    def axis(self, t: TensorSpec) -> str:
        """The α axis of tensor `t`'s plane (`alpha_axis`)."""
        return alpha_axis(self.axes, t.param, t.role)

    @property
    def content_id(self) -> str:
        """The delta's contents: a hash over the store's version of it and every tensor's name and
        sha256 (what the receiver verifies the bytes against), so a delta uploaded again with new
        contents has a new one (a tensor-parallel rank's slices have no sha256: the version tells)."""
        h = hashlib.sha256(f"{self.version}\0".encode())
        for t in sorted(self.tensors, key=lambda t: t.name):
            h.update(f"{t.name}\0{t.sha256}\0".encode())
        return h.hexdigest()


class DeltaSource(Protocol):
    async def open(self, name: str, base_fingerprint: str) -> DeltaInfo: ...

    async def stream(self, info: DeltaInfo, receiver: Receiver) -> None: ...

    async def close(self) -> None: ...


class LocalDeltaSource:
    """Delta files in a directory, named `<variant><suffix>` (a tensor-parallel rank reads every
    tensor whole and cuts its slice itself: `parallel.ShardWriter`)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path_of(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise NotFound(f"{name!r} is not a valid delta name")
        for suf in FILE_SUFFIXES:
            p = self.root / f"{name}{suf}"
            if p.is_file():
                return p
        raise NotFound(
            f"no delta named {name!r} in {self.root} (looked for {', '.join(name + s for s in FILE_SUFFIXES)})"
        )

    async def open(self, name: str, base_fingerprint: str) -> DeltaInfo:
        path = self.path_of(name)
        header = await asyncio.to_thread(read_header, path)
        check_base(header.meta, base_fingerprint)
        check_structure(header)
        refuse_parts(name, header.meta)
        specs = [TensorSpec(t.name, t.dtype, t.shape, t.nbytes, header.sha256[t.name], t.start) for t in header.tensors]
        meta = header.meta
        axes = {p: meta.axes(p) for p in meta.parts}
        return DeltaInfo(
            name,
            specs,
            handle=path,
            architecture=meta.architecture,
            layout=meta.layout,
            axes=axes,
            eos_token_ids=meta.eos_token_ids,
            vocab_size=meta.vocab_size,
        )

    async def stream(self, info: DeltaInfo, receiver: Receiver) -> None:
        await asyncio.to_thread(self._read, Path(info.handle), info, receiver)

    @staticmethod
    def _read(path: Path, info: DeltaInfo, receiver: Receiver) -> None:
        """Scatter-read runs of file-contiguous tensors straight into the receiver's buffers:
        one `preadv` per READ_BYTES, however many (small) tensors that covers."""
        fd = os.open(path, os.O_RDONLY)
        try:
            run: list[tuple[int, int, memoryview]] = []  # (tensor, offset in it, destination)
            run_start = run_bytes = 0

            def flush():
                nonlocal run, run_bytes
                if not run:
                    return
                if os.preadv(fd, [v for _, _, v in run], run_start) != run_bytes:
                    # short read (rare: EOF or a signal): redo it buffer by buffer to find where it ends
                    pos = run_start
                    for i, _, v in run:
                        done = 0
                        while done < len(v):
                            k = os.preadv(fd, [v[done:]], pos + done)
                            if k <= 0:
                                t = info.tensors[i]
                                raise DeltaFormatError(f"{path}: file ends inside tensor {t.name}", tensor=t.name)
                            done += k
                        pos += len(v)
                receiver.landed([(i, off, len(v)) for i, off, v in run])
                run, run_bytes = [], 0

            for i, t in enumerate(info.tensors):
                if not t.nbytes:
                    continue  # complete as announced
                dst = receiver.buffer(i)
                off = 0
                while off < t.nbytes:
                    n = min(READ_BYTES - run_bytes, t.nbytes - off)
                    if run and run_start + run_bytes != t.file_offset + off:
                        flush()  # not contiguous with the current run
                        continue
                    if not run:
                        run_start = t.file_offset + off
                    run.append((i, off, dst[off : off + n]))
                    run_bytes += n
                    off += n
                    if run_bytes >= READ_BYTES or len(run) >= IOV_MAX:
                        flush()
            flush()
        finally:
            os.close(fd)

    async def close(self) -> None:
        pass


class DeltaStoreSource:
    """The delta_store service, through the shared client (`bitdelta.rpc.clients.delta_store`):
    the header via `open_fetch`, then chunks straight into the receiver, which verifies them.
    The store's errors arrive as `DeltaStoreError` with the store's status code, which the worker
    passes on unchanged (a store-side INVALID_ARGUMENT stays INVALID_ARGUMENT)."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 600.0,
        chunk_bytes: int = 1 << 20,
        credentials: grpc.ChannelCredentials | None = None,
        shared_memory: bool = True,
        tp=None,
    ):
        """tp: a tensor-parallel rank's `bitdelta.shard.TPLayout`: Fetch only its slices."""
        self.address, self.chunk_bytes, self.shared_memory = address, chunk_bytes, shared_memory
        self.tp = tp
        self.client = DeltaStoreClient(address, fetch_timeout_s=timeout_s, credentials=credentials)  # TLS or None

    async def open(self, name: str, base_fingerprint: str) -> DeltaInfo:
        shard, handed_from, hands_to, partial = (None, {}, {}, {}) if self.tp is None else await self._shard(name)
        stream = await self.client.open_fetch(
            name,
            expect_base_fingerprint=base_fingerprint,
            chunk_bytes=self.chunk_bytes,
            accept_shared_memory=self.shared_memory,
            shard=shard,
        )
        info = stream.info
        try:
            if info.format_version and info.format_version not in READ_VERSIONS:
                raise DeltaFormatError(
                    f"delta {name!r} has format version {info.format_version}; "
                    f"this worker reads {' and '.join(READ_VERSIONS)}"
                )
            meta = DeltaMeta.from_strings(dict(info.metadata))  # malformed metadata fails here, before data moves
        except (DeltaFormatError, ValueError) as e:
            stream.cancel()
            raise DeltaFormatError(f"delta {name!r}: {e}") from None
        try:
            refuse_parts(name, meta)
        except FailedPrecondition:
            stream.cancel()
            raise
        specs = [TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes, t.sha256, t.file_offset) for t in stream.tensors]
        for i, t in enumerate(specs):  # a slice sent in part (its tail handed over): announced whole
            if t.name in partial:
                shape = partial[t.name]
                specs[i] = replace(t, shape=shape, nbytes=t.nbytes // math.prod(t.shape) * math.prod(shape))
        return DeltaInfo(
            info.name or name,
            specs,
            handle=stream,
            verified=stream.verified,
            transport=stream.transport,
            architecture=meta.architecture,
            layout=meta.layout,
            sliced=shard is not None,
            version=info.version,
            handed_from=handed_from,
            hands_to=hands_to,
            axes={p: meta.axes(p) for p in meta.parts},
            eos_token_ids=meta.eos_token_ids,
            vocab_size=meta.vocab_size,
        )

    async def _shard(self, name: str):
        """This rank's split rule for every tensor of `name` that it does not get whole (from its Stat):
        the row runs of a slice that a lower rank also holds are fetched by the lowest of them only
        (`TPLayout.shared_from`), which hands them on. Returns (the Shard, handed_from, hands_to as
        in DeltaInfo, the whole slice's shape of each tensor asked for in part)."""
        from bitdelta.delta_store.v1 import delta_store_pb2 as store_pb
        from bitdelta.shard import Split

        slices, handed_from, hands_to, partial = [], {}, {}, {}
        stat = await self.client.stat(name)
        meta = DeltaMeta.from_strings(dict(stat.info.metadata))
        refuse_parts(name, meta)  # before asking for any slice
        axes = {p: meta.axes(p) for p in meta.parts}  # a column α splits unlike a row α of its shape
        for t in stat.tensors:
            param, role = t.name.rsplit(".", 1)
            shape = tuple(t.shape)
            axis = alpha_axis(axes, param, role)
            sh = self.tp.shard_of(param, role, shape, axis)
            itemsize = t.nbytes // max(1, math.prod(shape))
            got, to = self.tp.shared_from(param, role, shape, axis), self.tp.shared_to(param, role, shape, axis)
            if got is not None:
                handed_from[t.name] = (got[0], sh.leading_bytes(got[1], shape, itemsize))
            if to:
                (j,) = {j for _, j in to}  # every receiver of one part takes the same runs
                hands_to[t.name] = (len(to), sh.leading_bytes(j, shape, itemsize))
            if sh.split is Split.REPLICATED and got is None:
                continue
            runs = sh.rows
            if got is not None and got[1] > 0:  # its own leading runs only; the rest is handed over
                runs, partial[t.name] = sh.rows[: got[1]], sh.shape(shape)
            rows = [store_pb.Range(start=a, end=b) for a, b in runs or ()]
            cols = store_pb.Range(start=sh.cols[0], end=sh.cols[1]) if sh.cols is not None else None
            omit = got is not None and got[1] == 0
            slices.append(store_pb.TensorSlice(tensor=t.name, rows=rows, cols=cols, omit=omit))
        return store_pb.Shard(rank=self.tp.rank, size=self.tp.size, slices=slices), handed_from, hands_to, partial

    async def stream(self, info: DeltaInfo, receiver: Receiver) -> None:
        stream: FetchStream = info.handle
        try:
            async for p in stream.chunks():
                receiver.put(p.tensor_index, p.offset, p.data, p.crc32)
            await receiver.flushed()  # every byte is out of the store's shared memory (if it came that way)
        finally:
            stream.cancel()  # ends the store's lease on its shared file

    async def close(self) -> None:
        await self.client.close()


def source_of(config, tp=None) -> DeltaSource | None:
    """The source a worker's config names (a `WorkerConfig`): the store, a directory, or none. `tp`: a
    tensor-parallel rank's `TPLayout` (the store then sends only its slices; files are cut by the rank)."""
    if config.delta_store:
        return DeltaStoreSource(
            config.delta_store,
            timeout_s=config.store_timeout_s,
            shared_memory=config.store_shared_memory,
            credentials=config.channel_credentials(),  # TLS: the worker's certificate
            tp=tp,
        )
    if config.delta_dir:
        return LocalDeltaSource(config.delta_dir)
    return None
