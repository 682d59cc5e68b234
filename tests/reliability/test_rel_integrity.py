"""Integrity at line speed (issue #12): the store hashes a delta (sha256 per tensor) once, where it
enters, records each chunk's crc32, and checks later reads of that same file version by those
crc32s; the worker checks every chunk's crc32 and no longer hashes what the store verified. A
stored file changed after it was verified is never served:

- rewritten (a new mtime: a new version) -> hashed again -> DATA_LOSS naming the tensor;
- bit rot (the byte flipped, inode, size and mtime put back: the same version) -> the recorded
  crc32 of its chunk differs -> DATA_LOSS;

both for a Fetch and for a worker's load through the store, and the worker keeps serving.
A store and a worker as processes; the store without a host cache, so every Fetch reads the disk.
"""

from __future__ import annotations

import os

import grpc
import pytest

from bitdelta.format import read_header
from bitdelta.rpc.clients.delta_store import DeltaStoreClient, IntegrityError
from bitdelta.rpc.clients.worker import WorkerCallError, WorkerClient
from tests.support.reliability import TALLY, RelCluster, T

pytestmark = pytest.mark.asyncio(loop_scope="module")


def flip(path, keep_version: bool) -> str:
    """Flip one byte in the middle of the largest tensor; with keep_version, put the mtime back."""
    h = read_header(path)
    t = max(h.tensors, key=lambda t: t.nbytes)
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(t.start + t.nbytes // 2)
        b = f.read(1)
        f.seek(t.start + t.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    if keep_version:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_ino == st.st_ino
    return t.name


@pytest.mark.parametrize("keep_version", [True, False], ids=["bit-rot-same-version", "rewritten-new-version"])
async def test_a_file_changed_after_it_was_verified_is_never_served(family, tmp_path, keep_version):
    import shutil

    root = tmp_path / "deltas"
    root.mkdir()
    for v in ("v0", "v1"):
        shutil.copy(family.delta_path(v), root / family.delta_path(v).name)
    with RelCluster(tmp_path / "c", "integrity") as c:
        st = c.store(root, extra=("--cache-bytes", "0"))
        w = c.worker(family.base, st.address)
        c.wait_serving(st, w)
        async with (
            DeltaStoreClient(st.address, timeout_s=T, fetch_timeout_s=T) as s,
            WorkerClient(w.address, generate_timeout_s=T) as wc,
        ):
            await s.fetch_into("v0", lambda *a: None)  # first sight: every tensor's sha256, crc32s recorded
            await s.fetch_into("v0", lambda *a: None)  # seen before: checked by the recorded crc32s
            await wc.load_delta("v0")  # a load through the store
            await wc.evict_delta("v0")
            tensor = flip(root / family.delta_path("v0").name, keep_version)
            TALLY.fault("byte flipped in a verified stored file" + (" (mtime kept)" if keep_version else ""))
            with pytest.raises(IntegrityError) as e:
                await s.fetch_into("v0", lambda *a: None)
            assert e.value.code == grpc.StatusCode.DATA_LOSS and e.value.tensor == tensor, e.value
            TALLY.reject(e.value.code)
            with pytest.raises(WorkerCallError) as e:
                await wc.load_delta("v0")
            assert e.value.code == grpc.StatusCode.DATA_LOSS and tensor in e.value.details, e.value
            TALLY.reject(e.value.code)
            await wc.load_delta("v1")  # the others load
            assert "v0" not in {d.name for d in await s.list()}  # a failed delta is left out of List
            shutil.copy(family.delta_path("v0"), root / family.delta_path("v0").name)  # repaired by hand
            await s.fetch_into("v0", lambda *a: None)
            await wc.load_delta("v0")
            TALLY.recovered("repaired delta file served again")
            assert w.alive() and st.alive()
