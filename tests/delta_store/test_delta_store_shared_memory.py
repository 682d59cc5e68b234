"""The same-host transport: the store's host cache in shared memory, mapped by the client.

Real parts throughout: a delta store server on a loopback port, real delta files, files on a real
memory filesystem (/dev/shm) that the store and the client map. What is checked: the bytes are
the same as streamed ones and none travel in messages; a file that is gone, a tampered file and a
full memory filesystem each end well (fallback, DATA_LOSS, private memory); a reader keeps its
bytes when the store drops the entry; files of dead stores are cleaned up.
"""

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
from bitdelta.format import read_header
from bitdelta.rpc.checksums import crc32, crc32_combine, crc32_combine_py
from bitdelta.rpc.clients.delta_store import IntegrityError
from services.delta_store.backends import SUFFIX
from services.delta_store.backends.local import LocalBackend
from services.delta_store.shm import SharedMemoryDir

pytest_plugins = ["tests.support.swift", "tests.support.delta_store"]
pytest.register_assert_rewrite(*pytest_plugins)
from tests.support.delta_store import big_delta, make_delta  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shm_dir():
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")  # a memory filesystem where there is one
    d = base / f"bitdelta-test-{uuid.uuid4().hex[:12]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "store"
    r.mkdir()
    big_delta(r / f"big{SUFFIX}", mib=6, seed=1)
    make_delta(r / f"small{SUFFIX}", seed=2)
    return r


def tensors_of(path: Path) -> list[bytes]:
    data = path.read_bytes()
    return [data[t.start : t.end] for t in read_header(path).tensors]


async def pieces(stream) -> dict[int, bytearray]:
    """Copy every piece, then end the call (which ends a shared stream's lease)."""
    got: dict[int, bytearray] = {}
    try:
        async for p in stream.chunks():
            buf = got.setdefault(p.tensor_index, bytearray())
            assert p.offset == len(buf)
            buf += p.data
    finally:
        stream.cancel()
    return got


async def wait_until(cond, timeout_s: float = 10) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def shared_files(d: Path) -> list[Path]:
    return sorted(d.glob("store-*/*.delta"))


async def test_same_bytes_and_none_in_messages(start_store, root, shm_dir):
    s = await start_store(LocalBackend(root), shared_memory_dir=shm_dir, chunk_bytes=1 << 20)
    want = tensors_of(root / f"big{SUFFIX}")

    stream = await s.client.open_fetch("big", accept_shared_memory=True)
    assert stream.transport == "shared-memory" and stream.verified
    got = await pieces(stream)
    assert [bytes(got[i]) for i in range(len(want))] == want
    assert len(shared_files(shm_dir)) == 1  # the cache entry's file, owner-only
    assert shared_files(shm_dir)[0].stat().st_mode & 0o077 == 0

    async with grpc.aio.insecure_channel(s.target) as ch:  # on the wire: descriptors only
        call = pb_grpc.DeltaStoreServiceStub(ch).Fetch(
            pb.FetchRequest(name="big", accept_shared_memory=True), timeout=30
        )
        first, chunks = await call.read(), []
        while sum(c.length for c in chunks) < sum(map(len, want)):
            chunks.append((await call.read()).chunk)
        assert first.shared_memory.path == str(shared_files(shm_dir)[0]) and first.verified
        assert first.shared_memory.size_bytes == (root / f"big{SUFFIX}").stat().st_size
        assert chunks and all(not c.data and c.length > 0 for c in chunks)
        # the lease: after its last chunk the call stays open, the entry held, until the receiver ends it
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(call.read()), 0.5)
        assert s.store.cache.entries["big"].readers == 1
        call.cancel()
        await wait_until(lambda: s.store.cache.entries["big"].readers == 0)

    # without the flag, the same store streams the bytes, and fetch_into agrees either way
    plain = await s.client.open_fetch("big")
    assert plain.transport == "stream" and plain.verified
    assert [bytes(b) for _, b in sorted((await pieces(plain)).items())] == want
    for accept in (True, False):
        got = {}
        await s.client.fetch_into(
            "big",
            lambda i, t, b: got.__setitem__(i, bytes(b)),  # noqa: B023 (called in this iteration)
            accept_shared_memory=accept,
        )
        assert [got[i] for i in range(len(want))] == want
    assert s.store.transports["shared-memory"] == 3 and s.store.transports["stream"] == 2


async def test_without_a_shared_directory_the_bytes_stream(start_store, root):
    s = await start_store(LocalBackend(root))
    stream = await s.client.open_fetch("big", accept_shared_memory=True)
    assert stream.transport == "stream"
    assert [bytes(b) for _, b in sorted((await pieces(stream)).items())] == tensors_of(root / f"big{SUFFIX}")


async def test_a_delta_too_big_for_the_cache_streams(start_store, root, shm_dir):
    s = await start_store(LocalBackend(root), shared_memory_dir=shm_dir, cache_bytes=1 << 20)  # big does not fit
    stream = await s.client.open_fetch("big", accept_shared_memory=True)
    assert stream.transport == "stream" and s.store.cache.stats["bypass"] == 1
    assert [bytes(b) for _, b in sorted((await pieces(stream)).items())] == tensors_of(root / f"big{SUFFIX}")


async def test_a_shared_file_that_cannot_be_opened_falls_back_to_streaming(start_store, root, shm_dir):
    s = await start_store(LocalBackend(root), shared_memory_dir=shm_dir)
    await pieces(await s.client.open_fetch("big", accept_shared_memory=True))  # cached, in shared memory
    [f] = shared_files(shm_dir)
    f.unlink()  # as if the client ran on another host (or the entry went just before it looked)
    stream = await s.client.open_fetch("big", accept_shared_memory=True)
    assert stream.transport == "stream"
    assert [bytes(b) for _, b in sorted((await pieces(stream)).items())] == tensors_of(root / f"big{SUFFIX}")


async def test_a_tampered_shared_file_is_never_delivered(start_store, root, shm_dir):
    s = await start_store(LocalBackend(root), shared_memory_dir=shm_dir)
    await pieces(await s.client.open_fetch("big", accept_shared_memory=True))
    [f] = shared_files(shm_dir)
    header = read_header(root / f"big{SUFFIX}")
    victim = max(header.tensors, key=lambda t: t.nbytes)
    with open(f, "r+b") as fh:  # one flipped byte in the middle of the largest tensor
        fh.seek(victim.start + victim.nbytes // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x10]))
    for accept in (True, False):  # mapped or streamed: the chunk's recorded crc32 no longer matches
        with pytest.raises(IntegrityError) as e:
            await s.client.fetch_into("big", lambda *a: None, accept_shared_memory=accept)
        assert e.value.code == grpc.StatusCode.DATA_LOSS and e.value.tensor == victim.name
    got = {}
    await s.client.fetch_into("small", lambda i, t, b: got.__setitem__(i, bytes(b)), accept_shared_memory=True)
    assert [got[i] for i in range(len(got))] == tensors_of(root / f"small{SUFFIX}")  # others still served


async def test_a_leased_file_is_never_reused_and_a_released_one_is(start_store, tmp_path, shm_dir):
    """A receiver holds its file until it ends the call, even after the entry was dropped; only then
    does the file serve another delta (recycled: fresh memory-filesystem pages are slow)."""
    root = tmp_path / "same-size"
    root.mkdir()
    paths = {n: big_delta(root / f"{n}{SUFFIX}", mib=4, seed=i) for i, n in enumerate(["b1", "b2", "b3"])}
    assert len({p.stat().st_size for p in paths.values()}) == 1
    s = await start_store(LocalBackend(root), shared_memory_dir=shm_dir)

    want1 = tensors_of(paths["b1"])
    first = await s.client.open_fetch("b1", accept_shared_memory=True)
    views = [p async for p in first.chunks()]  # every piece announced; not copied yet, call still open
    await s.client.delete("b1")  # the entry is dropped while its receiver holds the file
    second = await s.client.open_fetch("b2", accept_shared_memory=True)
    got2 = await pieces(second)
    assert second.shared is not None
    assert [bytes(got2[i]) for i in range(len(got2))] == tensors_of(paths["b2"])
    assert len(shared_files(shm_dir)) == 2  # b2 got a file of its own: b1's is leased
    b1 = {}
    for p in views:  # copied only now: b1's bytes were not touched meanwhile
        b1.setdefault(p.tensor_index, bytearray()).extend(p.data)
    first.cancel()
    assert [bytes(b1[i]) for i in range(len(b1))] == want1

    await wait_until(lambda: not any(e.readers for e in s.store.cache.entries.values()) and s.store.cache.spare_buffers)
    third = await s.client.open_fetch("b3", accept_shared_memory=True)
    got3 = await pieces(third)
    assert [bytes(got3[i]) for i in range(len(got3))] == tensors_of(paths["b3"])
    assert len(shared_files(shm_dir)) == 2  # b3 reused b1's file


def test_no_room_in_shared_memory_means_private_memory(tmp_path):
    """A memory filesystem that is full: space is reserved before the first write, so the store gets
    None (and caches in private memory) instead of a SIGBUS later. The limit is RLIMIT_FSIZE in a
    child process (posix_fallocate past it fails with EFBIG, as past a full tmpfs with ENOSPC)."""
    code = f"""
import resource, sys
sys.path.insert(0, {str(ROOT)!r})
from services.delta_store.shm import SharedMemoryDir
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
d = SharedMemoryDir({str(tmp_path / "shm")!r})
print(d.allocate(4 << 20) is None, d.allocate(64 << 10) is not None)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


def test_directories_of_stores_that_are_gone_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"store-{int(dead.stdout)}-0000"
    live = tmp_path / f"store-{os.getppid()}-0000"
    for d in (stale, live):
        d.mkdir()
        (d / "1.delta").write_bytes(b"x")
    mine = SharedMemoryDir(tmp_path)
    assert not stale.exists() and live.exists() and mine.dir.is_dir()
    mine.close()
    assert not mine.dir.exists() and live.exists()


@pytest.mark.parametrize("combine", [crc32_combine, crc32_combine_py], ids=["installed", "pure-python"])
def test_crc32_combine_is_the_crc32_of_the_joined_bytes(combine):
    """A shared chunk's crc32 is combined from the recorded per-chunk ones; both implementations agree
    with zlib's crc32 of the joined bytes (including empty and odd lengths)."""
    import random
    import zlib

    rng = random.Random(7)
    for _ in range(40):
        a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(rng.choice([0, 1, 7, rng.randint(2, 70000)]))
        assert combine(crc32(a), crc32(b), len(b)) == zlib.crc32(a + b)


async def test_racing_receivers_and_a_cancel_mid_load(start_store, tmp_path, shm_dir):
    """Three shared Fetches of one cold delta race (one load, two joins); one cancels after its first
    piece, while the load may still run. The others get every byte right, each holds the entry until
    it ends its call, nothing leaks, and the next receiver reuses the same file."""
    root = tmp_path / "race"
    root.mkdir()
    path = big_delta(root / f"r{SUFFIX}", mib=24, seed=3)
    want = tensors_of(path)
    s = await start_store(LocalBackend(root), shared_memory_dir=shm_dir)
    streams = await asyncio.gather(*(s.client.open_fetch("r", accept_shared_memory=True) for _ in range(3)))
    assert all(st.transport == "shared-memory" for st in streams)
    assert s.store.cache.stats["miss"] == 1 and s.store.cache.stats["join"] == 2
    quitter = streams[0].chunks()
    await anext(quitter)
    streams[0].cancel()  # gone after one piece
    got = await asyncio.gather(*(pieces(st) for st in streams[1:]))
    for g in got:
        assert [bytes(g[i]) for i in range(len(want))] == want
    await wait_until(lambda: all(e.readers == 0 for e in s.store.cache.entries.values()))
    again = await pieces(await s.client.open_fetch("r", accept_shared_memory=True))
    assert [bytes(again[i]) for i in range(len(want))] == want
    assert len(shared_files(shm_dir)) == 1


async def test_a_cancel_before_the_load_finished_frees_the_entry(start_store, tmp_path, shm_dir):
    """The only receiver of a cold shared Fetch leaves at once and the entry is dropped: its load is
    cancelled or finishes, its file goes back to the spares, and a later Fetch reuses one."""
    root = tmp_path / "cancel"
    root.mkdir()
    path = big_delta(root / f"c{SUFFIX}", mib=48, seed=4)
    s = await start_store(LocalBackend(root), shared_memory_dir=shm_dir)
    for _ in range(3):
        st = await s.client.open_fetch("c", accept_shared_memory=True)
        st.cancel()
        s.store.cache.drop("c")  # as an eviction would, while the cancelled load may still be reading
    # every load stopped or finished and every file went back to the spares: nothing leaked
    await wait_until(lambda: s.store.cache.spare_buffers == len(shared_files(shm_dir)) > 0)
    files = shared_files(shm_dir)
    got = await pieces(await s.client.open_fetch("c", accept_shared_memory=True))
    assert [bytes(got[i]) for i in range(len(got))] == tensors_of(path)
    assert shared_files(shm_dir) == files  # a spare was reused, no new file
