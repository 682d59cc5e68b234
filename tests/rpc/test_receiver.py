"""The shared receiver's checks, chunk by chunk: what it accepts and what it refuses.

Tensors of random bytes (one empty, one of a single byte, sizes that no chunk size divides), fed as
the delta store's client feeds them (`put(tensor, offset, bytes, crc32)`) or as the worker's local
source does (bytes read straight into `buffer(i)`, then `landed`). With the store's `verified` the
receiver skips sha256, so the chunk crc32s (checked on the bytes where they landed, in order) must
cover every byte; without it, sha256 catches what no crc32 was asked about.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import dataclass

import grpc
import pytest

from bitdelta.rpc.checksums import crc32
from bitdelta.rpc.receiver import ReceiveError, Receiver
from bitdelta.rpc.wire.delta_store import TENSOR_METADATA_KEY

CHUNK = 1000  # odd on purpose: chunks are not aligned to anything


@dataclass(frozen=True)
class Tensor:
    name: str
    nbytes: int
    sha256: str


class Buffers:
    """A destination of plain bytearrays that records which tensors it was told are complete."""

    def __init__(self, tensors):
        self.bufs = [bytearray(t.nbytes) for t in tensors]
        self.completed: list[int] = []

    def buffer(self, index: int) -> memoryview:
        return memoryview(self.bufs[index])

    def complete(self, index: int) -> None:
        self.completed.append(index)


@pytest.fixture(scope="module")
def delta():
    rng = random.Random(19)
    data = [rng.randbytes(n) for n in (4096, 0, 1, 2500, 70_001, 333)]
    tensors = [Tensor(f"layers.{i}.w.sign", len(b), hashlib.sha256(b).hexdigest()) for i, b in enumerate(data)]
    return tensors, data


def chunks(data):
    """(tensor, offset, bytes) of every tensor, CHUNK bytes at a time, in order."""
    for i, raw in enumerate(data):
        for o in range(0, len(raw), CHUNK):
            yield i, o, raw[o : o + CHUNK]


def receive(delta, pieces, check_sha256: bool) -> Buffers:
    tensors, _ = delta
    dest = Buffers(tensors)

    async def run():
        r = Receiver("v", tensors, dest, check_sha256=check_sha256)
        for i, o, b, c in pieces:
            r.put(i, o, b, c)
        await r.finish()

    asyncio.run(run())
    return dest


def test_verified_chunks_in_order_land_exactly(delta):
    tensors, data = delta
    dest = receive(delta, [(i, o, b, crc32(b)) for i, o, b in chunks(data)], check_sha256=False)
    assert [bytes(b) for b in dest.bufs] == data
    assert sorted(dest.completed) == list(range(len(tensors)))  # the empty tensor too


def test_a_byte_changed_in_transit_fails_its_crc32(delta):
    tensors, data = delta
    pieces = [(i, o, b, crc32(b)) for i, o, b in chunks(data)]
    k = len(pieces) // 2
    i, o, b, c = pieces[k]
    pieces[k] = (i, o, bytes([b[0] ^ 1]) + b[1:], c)  # the crc32 of the original bytes
    with pytest.raises(ReceiveError, match="crc32") as e:
        receive(delta, pieces, check_sha256=False)
    assert e.value.tensor == tensors[i].name and e.value.code == grpc.StatusCode.DATA_LOSS
    assert e.value.trailers == {TENSOR_METADATA_KEY: tensors[i].name}  # the status names it


def test_without_sha256_chunks_must_come_in_order(delta):
    """A repeated chunk in place of a missing one would pass every crc32 and the byte count."""
    tensors, data = delta
    pieces = [(i, o, b, crc32(b)) for i, o, b in chunks(data)]
    big = max(range(len(tensors)), key=lambda i: tensors[i].nbytes)
    ks = [k for k, p in enumerate(pieces) if p[0] == big]
    pieces[ks[1]] = pieces[ks[0]]  # the first chunk twice, the second never
    with pytest.raises(ReceiveError, match="out of order"):
        receive(delta, pieces, check_sha256=False)
    with pytest.raises(ReceiveError, match="sha256 mismatch"):  # checking sha256, the whole tensor fails
        receive(delta, pieces, check_sha256=True)


def test_without_sha256_a_chunk_needs_a_crc32(delta):
    _, data = delta
    with pytest.raises(ReceiveError, match="without a crc32"):
        receive(delta, [(i, o, b, None) for i, o, b in chunks(data)], check_sha256=False)


def test_with_sha256_unchecked_chunks_are_caught_whole(delta):
    """No crc32s (a local file), one byte changed: the tensor's sha256 fails; unchanged, it lands."""
    tensors, data = delta
    good = [(i, o, b, None) for i, o, b in chunks(data)]
    assert [bytes(b) for b in receive(delta, good, check_sha256=True).bufs] == data
    bad = list(good)
    i, o, b, _ = bad[3]
    bad[3] = (i, o, bytes([b[0] ^ 1]) + b[1:], None)
    with pytest.raises(ReceiveError, match="sha256 mismatch") as e:
        receive(delta, bad, check_sha256=True)
    assert e.value.tensor == tensors[i].name


def test_a_bad_tensor_is_never_completed_and_a_missing_one_is_named(delta):
    tensors, data = delta
    pieces = [(i, o, b, crc32(b)) for i, o, b in chunks(data)]
    last = max(k for k, p in enumerate(pieces) if p[0] == 3)
    i, o, b, _ = pieces[last]
    pieces[last] = (i, o, bytes([b[0] ^ 1]) + b[1:], crc32(bytes([b[0] ^ 1]) + b[1:]))  # a consistent lie
    dest = Buffers(tensors)

    async def run(pieces):
        r = Receiver("v", tensors, dest)
        for p in pieces:
            r.put(*p)
        await r.finish()

    with pytest.raises(ReceiveError, match="sha256 mismatch"):
        asyncio.run(run(pieces))
    assert 3 not in dest.completed and {0, 1, 2} <= set(dest.completed)
    dest.completed.clear()
    cut = pieces[:last]  # tensor 3 ends short, the ones after it never come
    with pytest.raises(ReceiveError, match=f"stream ended before tensor {tensors[3].name} was complete"):
        asyncio.run(run(cut))


def test_bytes_that_landed_directly_are_hashed_whole(delta):
    """The local source's way: reads straight into `buffer(i)`, then `landed`; its sha256 catches a change."""
    tensors, data = delta

    async def run(change: bool):
        dest = Buffers(tensors)
        r = Receiver("v", tensors, dest)
        for i, raw in enumerate(data):
            if raw:
                r.buffer(i)[:] = raw
                if change and i == 4:
                    r.buffer(i)[7] ^= 0x20
                r.landed([(i, 0, len(raw))])
        await r.finish()
        return dest

    assert [bytes(b) for b in asyncio.run(run(False)).bufs] == data
    with pytest.raises(ReceiveError, match="sha256 mismatch") as e:
        asyncio.run(run(True))
    assert e.value.tensor == tensors[4].name


def test_a_destination_buffer_of_the_wrong_size_is_refused(delta):
    tensors, data = delta

    class Short(Buffers):
        def buffer(self, index):
            return memoryview(bytearray(tensors[index].nbytes - 1))

    async def run():
        r = Receiver("v", tensors, Short(tensors))
        r.put(0, 0, data[0][:CHUNK], crc32(data[0][:CHUNK]))
        await r.finish()

    with pytest.raises(ValueError, match=f"gave {tensors[0].nbytes - 1} bytes for tensor {tensors[0].name} of"):
        asyncio.run(run())
