"""SlotWriter's checks, chunk by chunk: what a load accepts and what it refuses.

A real tiny family (checkpoint + compressed delta files); the chunks are the file's own bytes,
fed as the delta store's client would (`put(tensor, offset, bytes, crc32)`). With the store's
`verified` the writer skips sha256, so the chunk crc32s (checked on the bytes in the slot, in
order) must cover every byte; without it, sha256 catches what a crc32 cannot be asked about.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from bitdelta.format import DeltaFormatError, read_header
from bitdelta.model import ModelArgs
from bitdelta.rpc.checksums import crc32
from bitdelta.testing.family import make_test_family
from services.gpu_worker.errors import ChecksumError
from services.gpu_worker.loader import SlotWriter, plan_delta
from services.gpu_worker.slots import SlotLayout, SlotTensors
from services.gpu_worker.sources import LocalDeltaSource

CHUNK = 1000  # odd on purpose: chunks straddle nothing but are not aligned to anything


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    f = make_test_family(tmp_path_factory.mktemp("loader_family"), n_variants=1, merged=False)
    args = ModelArgs.from_hf(json.loads((f.base / "config.json").read_text()))
    layout = SlotLayout(args, torch.float32)
    z = torch.zeros(args.dim)
    slots = SlotTensors.allocate(layout, 1, torch.device("cpu"), [(z, z)] * args.n_layers, z)
    fingerprint = read_header(f.delta_path("v0")).meta.base_fingerprint  # the family's own base
    info = asyncio.run(LocalDeltaSource(f.deltas).open("v0", fingerprint))
    return f, layout, slots, info


def chunks(f, info):
    """(tensor, offset, bytes) of every tensor of v0, CHUNK bytes at a time, in order."""
    data = f.delta_path("v0").read_bytes()
    for i, t in enumerate(info.tensors):
        raw = data[t.file_offset : t.file_offset + t.nbytes]
        for o in range(0, t.nbytes, CHUNK):
            yield i, o, raw[o : o + CHUNK]


def load(fam, pieces, check_sha256: bool):
    f, layout, slots, info = fam
    w = SlotWriter(plan_delta(layout, info), slots, 0, check_sha256=check_sha256)
    for i, o, b, c in pieces:
        w.put(i, o, b, c)
    return asyncio.run(w.finish()), w


def test_verified_chunks_in_order_land_exactly(fam):
    f, _, slots, info = fam
    _, w = load(fam, [(i, o, b, crc32(b)) for i, o, b in chunks(f, info)], check_sha256=False)
    data = f.delta_path("v0").read_bytes()
    compared = 0
    for i, t in enumerate(info.tensors):  # every byte that lands in the slot unconverted is the file's
        if not w.staged[i]:
            assert (
                bytes(w.dest[i].contiguous().view(torch.uint8).reshape(-1).numpy())
                == data[t.file_offset : t.file_offset + t.nbytes]
            )
            compared += t.nbytes
    assert compared > 0.9 * sum(t.nbytes for t in info.tensors)  # signs and scales: nearly all of it


def test_a_byte_changed_in_transit_fails_its_crc32(fam):
    f, _, _, info = fam
    pieces = [(i, o, b, crc32(b)) for i, o, b in chunks(f, info)]
    k = len(pieces) // 2
    i, o, b, c = pieces[k]
    pieces[k] = (i, o, bytes([b[0] ^ 1]) + b[1:], c)  # the crc32 of the original bytes
    with pytest.raises(ChecksumError, match="crc32") as e:
        load(fam, pieces, check_sha256=False)
    assert e.value.tensor == info.tensors[i].name


def test_without_sha256_chunks_must_come_in_order(fam):
    """A repeated chunk in place of a missing one would pass every crc32 and the byte count."""
    f, _, _, info = fam
    pieces = [(i, o, b, crc32(b)) for i, o, b in chunks(f, info)]
    big = max(range(len(info.tensors)), key=lambda i: info.tensors[i].nbytes)
    ks = [k for k, p in enumerate(pieces) if p[0] == big]
    pieces[ks[1]] = pieces[ks[0]]  # the first chunk twice, the second never
    with pytest.raises(DeltaFormatError, match="out of order"):
        load(fam, pieces, check_sha256=False)


def test_without_sha256_a_chunk_needs_a_crc32(fam):
    f, _, _, info = fam
    with pytest.raises(DeltaFormatError, match="without a crc32"):
        load(fam, [(i, o, b, None) for i, o, b in chunks(f, info)], check_sha256=False)


def test_with_sha256_unchecked_chunks_are_caught_whole(fam):
    """No crc32s (a local file), one byte changed: the tensor's sha256 fails; unchanged, it loads."""
    f, _, _, info = fam
    good = [(i, o, b, None) for i, o, b in chunks(f, info)]
    load(fam, good, check_sha256=True)
    bad = list(good)
    i, o, b, _ = bad[3]
    bad[3] = (i, o, bytes([b[0] ^ 1]) + b[1:], None)
    with pytest.raises(ChecksumError, match="sha256 mismatch") as e:
        load(fam, bad, check_sha256=True)
    assert e.value.tensor == info.tensors[i].name
