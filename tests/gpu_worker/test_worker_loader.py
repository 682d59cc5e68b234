"""SlotWriter as the shared receiver's destination: the bytes of a real delta land in the slot.

A real tiny family (checkpoint + compressed delta files); the chunks are the file's own bytes,
fed as the delta store's client would (`put(tensor, offset, bytes, crc32)`) into a `Receiver`
writing into the slot. The receiver's checks, chunk by chunk, are tested in
tests/rpc/test_receiver.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from bitdelta.format import read_header
from bitdelta.model import ModelArgs
from bitdelta.rpc.checksums import crc32
from bitdelta.rpc.receiver import Receiver
from bitdelta.testing.family import make_test_family
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
    norms = {name: torch.zeros(size) for name, size in args.layer_norms()}
    slots = SlotTensors.allocate(layout, 1, torch.device("cpu"), [norms] * args.n_layers, z)
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


def load(fam, pieces, check_sha256: bool) -> SlotWriter:
    f, layout, slots, info = fam
    plan = plan_delta(layout, info)
    w = SlotWriter(plan, slots, (0,))

    async def run():
        r = Receiver(plan.name, plan.tensors, w, check_sha256=check_sha256)
        for i, o, b, c in pieces:
            r.put(i, o, b, c)
        await r.finish()
        await w.finish()

    asyncio.run(run())
    return w


def test_verified_chunks_in_order_land_exactly(fam):
    f, _, slots, info = fam
    w = load(fam, [(i, o, b, crc32(b)) for i, o, b in chunks(f, info)], check_sha256=False)
    data = f.delta_path("v0").read_bytes()
    compared = 0
    for i, t in enumerate(info.tensors):  # every byte that lands in the slot unconverted is the file's
        if not w.targets[i].staged:
            assert (
                bytes(w.targets[i].dest.contiguous().view(torch.uint8).reshape(-1).numpy())
                == data[t.file_offset : t.file_offset + t.nbytes]
            )
            compared += t.nbytes
    assert compared > 0.9 * sum(t.nbytes for t in info.tensors)  # signs and scales: nearly all of it


def test_a_column_alpha_is_placed_by_the_header_not_its_shape(fam, tmp_path):
    """A per-column α of a square matrix has a per-row α's shape: the header's parts say which it
    is, and the plan puts it in the delta's col_alpha (its rows' α 1), not in the α rows."""
    from bitdelta.compress import compress
    from bitdelta.planes import PlaneConfig
    from bitdelta.testing.family import make_finetune
    from services.gpu_worker.loader import Kind

    f, layout = fam[0], fam[1]
    ft = make_finetune(f.base, tmp_path / "ft", seed=5)
    compress(f.base, ft, tmp_path / "cols.safetensors", planes=PlaneConfig(alpha="col"), progress=False)
    fingerprint = read_header(tmp_path / "cols.safetensors").meta.base_fingerprint
    info = asyncio.run(LocalDeltaSource(tmp_path).open("cols", fingerprint))
    plan = plan_delta(layout, info)
    q = next(p for p in plan.placements if p.spec.name == "model.layers.0.self_attn.q_proj.weight.alpha")
    assert q.spec.shape == (layout.proj[q.spec.param].r1,) == (layout.proj[q.spec.param].d_in,)  # square
    assert q.kind is Kind.PROJ_COL and not any(p.kind is Kind.PROJ_ALPHA for p in plan.placements)
