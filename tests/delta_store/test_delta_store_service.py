"""The delta store service end to end: gRPC on loopback, real delta files, real backends."""

import asyncio
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bitdelta.delta_store.v1 import delta_store_pb2 as pb
from bitdelta.delta_store.v1 import delta_store_pb2_grpc as pb_grpc
from bitdelta.format import read_header
from bitdelta.rpc.clients.delta_store import (
    BaseMismatch,
    DeltaNotFound,
    DeltaStoreClient,
    IntegrityError,
    StoreUnavailable,
)
from services.delta_store.backends import SUFFIX
from services.delta_store.backends.local import LocalBackend
from services.delta_store.config import Config, ConfigError

pytest_plugins = ["tests.support.swift", "tests.support.delta_store"]
pytest.register_assert_rewrite(*pytest_plugins)
from tests.support.delta_store import BASE_FP, big_delta, make_delta  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


async def fetch_all(client: DeltaStoreClient, name: str, **kw) -> tuple[pb.DeltaInfo, list, dict[int, bytes]]:
    got = {}
    info, tensors = await client.fetch_into(name, lambda i, t, buf: got.__setitem__(i, bytes(buf)), **kw)
    return info, tensors, got


def file_tensors(path: Path) -> list[bytes]:
    data = path.read_bytes()
    return [data[t.start : t.end] for t in read_header(path).tensors]


async def raw_fetch(target: str, name: str, **kw) -> list[pb.FetchResponse]:
    async with grpc.aio.insecure_channel(target) as ch:
        return [m async for m in pb_grpc.DeltaStoreServiceStub(ch).Fetch(pb.FetchRequest(name=name, **kw), timeout=30)]


# -- the API, on both backends ------------------------------------------------------------


async def test_round_trip_of_real_deltas(backend_under_test, start_store, tiny_deltas):
    s = await start_store(backend_under_test.make())
    for name, path in tiny_deltas.items():
        info = await s.client.put(name, path)
        assert info.name == name and info.size_bytes == path.stat().st_size
    listed = await s.client.list()
    assert [d.name for d in listed] == sorted(tiny_deltas)

    for name, path in tiny_deltas.items():
        header = read_header(path)
        st = await s.client.stat(name)
        meta = header.meta
        assert st.info.base_fingerprint == meta.base_fingerprint and st.info.base_model == meta.base_model
        assert st.info.alpha_mode == (pb.ALPHA_MODE_ROW if meta.alpha_mode == "row" else pb.ALPHA_MODE_MATRIX)
        by_role = header.bytes_by_role()
        assert (st.info.sign_bytes, st.info.alpha_bytes, st.info.dense_bytes) == (
            by_role["sign"],
            by_role["alpha"],
            by_role["dense"],
        )
        assert dict(st.info.metadata) == header.metadata
        assert st.header_bytes == header.header_bytes
        assert [(t.name, t.file_offset, t.nbytes, t.sha256) for t in st.tensors] == [
            (t.name, t.start, t.nbytes, header.sha256[t.name]) for t in header.tensors
        ]

        # Byte-identical: header bytes + every tensor's streamed bytes == the file.
        for _ in range(2):  # cold (from the backend), then warm (from the cache)
            info, tensors, got = await fetch_all(s.client, name, expect_base_fingerprint=meta.base_fingerprint)
            data = path.read_bytes()
            assert data[: header.header_bytes] + b"".join(got[i] for i in range(len(tensors))) == data
    assert s.store.cache.stats["miss"] == len(tiny_deltas) and s.store.cache.stats["hit"] == len(tiny_deltas)


async def test_fetch_chunking_offsets_and_crcs(backend_under_test, start_store, tmp_path):
    path = make_delta(tmp_path / "d.safetensors", shapes={"a.weight": (300, 1000), "b.weight": (7, 9)})
    s = await start_store(backend_under_test.make(), read_block_bytes=64 * 1024)
    await s.client.put("d", path)
    want = file_tensors(path)
    for chunk in (0, 1000, 4096, 1 << 20):
        msgs = await raw_fetch(s.target, "d", chunk_bytes=chunk)
        assert msgs[0].HasField("info") and len(msgs[0].tensors) == len(want)
        got = [bytearray() for _ in want]
        for m in msgs[1:]:
            c = m.chunk
            assert len(c.data) <= (chunk or 1 << 20)
            assert c.offset == len(got[c.tensor_index])  # in order, contiguous
            assert zlib.crc32(c.data) == c.crc32
            got[c.tensor_index] += c.data
        assert [bytes(g) for g in got] == want


async def test_put_rules(backend_under_test, start_store, tmp_path):
    s = await start_store(backend_under_test.make())
    a = make_delta(tmp_path / "a.safetensors", seed=1)
    b = make_delta(tmp_path / "b.safetensors", seed=2)
    await s.client.put("v", a)
    with pytest.raises(Exception) as e:
        await s.client.put("v", b)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and "overwrite" in str(e.value)
    before = (await s.client.stat("v")).info.version
    await s.client.put("v", b, overwrite=True)
    assert (await s.client.stat("v")).info.version not in ("", before)  # holders of a copy can tell it changed
    _, _, got = await fetch_all(s.client, "v")
    assert [got[i] for i in range(len(got))] == file_tensors(b)


@pytest.mark.parametrize("refusal", ["exists", "garbage_header", "flipped_first_tensor"])
async def test_a_refused_upload_reports_its_status_every_time(backend_under_test, start_store, tmp_path, refusal):
    """grpc's asyncio client reports INTERNAL ("Internal error from Core") instead of the server's
    status when the server ends a client-streaming call while the client still writes
    (grpc/grpc#36066). The store ends a refused header at once (the client waits for the response
    headers before sending data) and drains a refused upload before it answers: the client always
    sees the real code, for a 24 MiB upload refused at its header or at its first data chunk."""
    s = await start_store(backend_under_test.make())
    path = big_delta(tmp_path / "big.safetensors", mib=24)
    data = bytearray(path.read_bytes())
    first = min(read_header(path).tensors, key=lambda t: t.start)
    if refusal == "exists":
        await s.client.put("v", make_delta(tmp_path / "small.safetensors"))
        want = grpc.StatusCode.ALREADY_EXISTS
    elif refusal == "garbage_header":
        data[:8] = (1 << 40).to_bytes(8, "little")  # a header longer than the file
        want = grpc.StatusCode.INVALID_ARGUMENT
    else:
        data[first.start] ^= 1  # detected when the first tensor is complete, with MiBs still to come
        want = grpc.StatusCode.INVALID_ARGUMENT
    for _ in range(6):
        with pytest.raises(Exception) as e:
            await s.client.put("v", bytes(data))
        assert e.value.code == want, str(e.value)
    names = [d.name for d in await s.client.list()]
    assert names == (["v"] if refusal == "exists" else [])
    await s.client.put("v", path, overwrite=True)  # the store still takes a good upload
    assert (await s.client.stat("v")).info.size_bytes == path.stat().st_size


@pytest.mark.parametrize("damage", ["garbage", "truncated", "trailing", "flipped", "short_upload"])
async def test_invalid_upload_never_appears(backend_under_test, start_store, tmp_path, damage):
    s = await start_store(backend_under_test.make())
    good = make_delta(tmp_path / "good.safetensors").read_bytes()
    header = read_header(tmp_path / "good.safetensors")
    victim = header.tensors[1]
    data = {
        "garbage": os.urandom(len(good)),
        "truncated": good[:-10],
        "trailing": good + b"\0" * 8,
        "flipped": good[: victim.start + 3] + bytes([good[victim.start + 3] ^ 1]) + good[victim.start + 4 :],
        "short_upload": good,
    }[damage]
    client = s.client
    if damage == "short_upload":  # header promises more than is sent

        async def reqs():
            yield pb.PutRequest(header=pb.PutHeader(name="bad", size_bytes=len(good)))
            yield pb.PutRequest(data=good[:1000])

        async with grpc.aio.insecure_channel(s.target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await pb_grpc.DeltaStoreServiceStub(ch).Put(reqs(), timeout=10)
        code, details = e.value.code(), e.value.details()
    else:
        with pytest.raises(Exception) as e:
            await client.put("bad", data)
        code, details = e.value.code, str(e.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    if damage == "flipped":
        assert victim.name in details
    assert await client.list() == []
    with pytest.raises(DeltaNotFound):
        await client.stat("bad")
    if backend_under_test.kind == "local":
        assert list((backend_under_test.root / ".partial").iterdir()) == []
    else:
        s3 = backend_under_test.s3
        assert not s3["client"].list_multipart_uploads(Bucket=s3["bucket"]).get("Uploads")


async def test_corrupted_tensor_is_data_loss_and_others_still_serve(backend_under_test, start_store, tmp_path):
    good = make_delta(tmp_path / "good.safetensors", seed=1)
    bad = make_delta(tmp_path / "bad.safetensors", seed=2)
    header = read_header(bad)
    victim = header.tensors[-1]
    data = bytearray(bad.read_bytes())
    data[victim.start + victim.nbytes // 2] ^= 0xFF  # bit rot in the backend, after upload
    backend_under_test.put_raw("bad", bytes(data))
    backend_under_test.put_raw("good", good.read_bytes())
    s = await start_store(backend_under_test.make())
    assert [d.name for d in await s.client.list()] == ["bad", "good"]  # only a full read can tell
    with pytest.raises(IntegrityError) as e:
        await fetch_all(s.client, "bad")
    assert e.value.code == grpc.StatusCode.DATA_LOSS and e.value.tensor == victim.name
    assert victim.name in str(e.value)
    with pytest.raises(IntegrityError):  # a known-bad version fails at once, and is no longer listed
        await fetch_all(s.client, "bad")
    assert [d.name for d in await s.client.list()] == ["good"]
    _, _, got = await fetch_all(s.client, "good")
    assert [got[i] for i in range(len(got))] == file_tensors(good)
    await s.client.put("bad", bad, overwrite=True)  # repaired by re-upload
    _, _, got = await fetch_all(s.client, "bad")
    assert [got[i] for i in range(len(got))] == file_tensors(bad)


async def test_truncated_file_is_data_loss_naming_the_cut_tensor(backend_under_test, start_store, tmp_path):
    path = make_delta(tmp_path / "t.safetensors")
    header = read_header(path)
    cut = header.tensors[-2]
    backend_under_test.put_raw("t", path.read_bytes()[: cut.start + 5])
    backend_under_test.put_raw("broken-header", b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}")
    s = await start_store(backend_under_test.make())
    for call in (s.client.stat, lambda n: fetch_all(s.client, n)):
        with pytest.raises(IntegrityError) as e:
            await call("t")
        assert e.value.code == grpc.StatusCode.DATA_LOSS and cut.name in str(e.value)
    with pytest.raises(IntegrityError, match="JSON"):
        await s.client.stat("broken-header")
    assert await s.client.list() == []


async def test_names(backend_under_test, start_store, tmp_path):
    s = await start_store(backend_under_test.make())
    with pytest.raises(DeltaNotFound, match="'nope'"):
        await s.client.stat("nope")
    with pytest.raises(DeltaNotFound, match="'nope'"):
        await fetch_all(s.client, "nope")
    with pytest.raises(DeltaNotFound):
        await s.client.delete("nope")
    for bad in ("../outside", "a/b", "..", "/etc/passwd", ".partial", "x\x00y", ""):
        for call in (
            s.client.stat,
            s.client.delete,
            lambda n: fetch_all(s.client, n),
            lambda n: s.client.put(n, b"12345678"),
        ):
            with pytest.raises(Exception) as e:
                await call(bad)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value)
            assert "invalid delta name" in str(e.value)


async def test_no_file_outside_the_store_is_read(start_store, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    outside = make_delta(tmp_path / "outside.safetensors")
    os.symlink(outside, root / "sneaky.safetensors")
    os.symlink(tmp_path, root / "up")
    s = await start_store(LocalBackend(root))
    assert await s.client.list() == []
    for name in ("sneaky", "up", "../outside", "up/outside"):
        with pytest.raises(Exception) as e:
            await fetch_all(s.client, name)
        assert e.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


async def test_base_fingerprint_mismatch_before_any_data(backend_under_test, start_store, tmp_path):
    s = await start_store(backend_under_test.make())
    await s.client.put("v", make_delta(tmp_path / "v.safetensors"))
    with pytest.raises(BaseMismatch) as e:
        await fetch_all(s.client, "v", expect_base_fingerprint="0" * 64)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError):
        msgs = await raw_fetch(s.target, "v", expect_base_fingerprint="0" * 64)
        assert not msgs  # not reached: the call fails before the first message
    info, _, _ = await fetch_all(s.client, "v", expect_base_fingerprint=BASE_FP)
    assert info.base_fingerprint == BASE_FP
    assert s.store.cache.stats["miss"] == 1  # the mismatches loaded nothing


async def test_add_and_remove_while_running(backend_under_test, start_store, tmp_path):
    s = await start_store(backend_under_test.make())
    a = make_delta(tmp_path / "a.safetensors", seed=1)
    backend_under_test.put_raw("dropped-in", a.read_bytes())  # added behind the service's back
    assert [d.name for d in await s.client.list()] == ["dropped-in"]
    await fetch_all(s.client, "dropped-in")
    b = make_delta(tmp_path / "b.safetensors", seed=2)
    backend_under_test.put_raw("dropped-in", b.read_bytes())  # replaced: the cached copy is stale
    if backend_under_test.kind == "local":
        os.utime(backend_under_test.root / ("dropped-in" + SUFFIX), ns=(1, 1))
    _, _, got = await fetch_all(s.client, "dropped-in")
    assert [got[i] for i in range(len(got))] == file_tensors(b)
    await s.client.delete("dropped-in")
    assert await s.client.list() == []
    with pytest.raises(DeltaNotFound):
        await fetch_all(s.client, "dropped-in")  # even though it was cached


async def test_backend_down_is_unavailable_fast_and_recovers(backend_under_test, start_store, tmp_path):
    s = await start_store(backend_under_test.make())
    await s.client.put("hot", make_delta(tmp_path / "hot.safetensors", seed=1))
    await s.client.put("cold", make_delta(tmp_path / "cold.safetensors", seed=2))
    _, _, hot = await fetch_all(s.client, "hot")
    backend_under_test.down()
    try:
        for call in (s.client.list, lambda: s.client.stat("cold"), lambda: fetch_all(s.client, "cold")):
            t = time.monotonic()
            with pytest.raises(StoreUnavailable) as e:
                await call()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t < 5
        _, _, again = await fetch_all(s.client, "hot")  # a complete cached copy is still served
        assert again == hot
    finally:
        backend_under_test.up()
    await asyncio.sleep(0.1)
    await fetch_all(s.client, "cold")
    assert [d.name for d in await s.client.list()] == ["cold", "hot"]


# -- cache, single flight, cancellation, tracing (local backend) --------------------------


class CountingBackend(LocalBackend):
    """The real local backend, counting whole-delta reads (opens) and open readers."""

    def __init__(self, root, delay_s: float = 0.0):
        super().__init__(root)
        self.opens, self.open_readers, self.delay_s = 0, 0, delay_s

    async def open(self, name):
        self.opens += 1
        reader = await super().open(name)
        backend = self
        backend.open_readers += 1
        inner_read, inner_close = reader.readinto, reader.aclose

        async def readinto(offset, buf):
            await asyncio.sleep(backend.delay_s)
            return await inner_read(offset, buf)

        async def aclose():
            backend.open_readers -= 1
            await inner_close()

        reader.readinto, reader.aclose = readinto, aclose
        return reader


def tracer():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_single_flight_and_spans(start_store, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    path = big_delta(root / ("big" + SUFFIX), mib=8)
    backend = CountingBackend(root, delay_s=0.01)
    provider, spans = tracer()
    s = await start_store(backend, tracer_provider=provider, read_block_bytes=1 << 20)
    results = await asyncio.gather(*(fetch_all(s.client, "big") for _ in range(5)))
    assert backend.opens == 2  # five concurrent cold fetches: one header read, one read of the delta
    want = file_tensors(path)
    for _, _, got in results:
        assert [got[i] for i in range(len(got))] == want
    await fetch_all(s.client, "big")
    assert backend.opens == 2

    finished = spans.get_finished_spans()
    fetches = [sp for sp in finished if sp.name == "delta_store.fetch"]
    reads = [sp for sp in finished if sp.name == "delta_store.backend.read"]
    assert sorted(sp.attributes["cache.result"] for sp in fetches) == ["hit", "join", "join", "join", "join", "miss"]
    assert len(reads) == 1
    miss = next(sp for sp in fetches if sp.attributes["cache.result"] == "miss")
    assert reads[0].parent.span_id == miss.context.span_id  # the read is a child of the fetch that caused it
    assert (
        reads[0].attributes["backend.kind"] == "local"
        and reads[0].attributes["delta.size_bytes"] == path.stat().st_size
    )
    assert all(sp.attributes["delta.bytes_sent"] == sum(map(len, want)) for sp in fetches)
    assert [sp.attributes["cache.hit"] for sp in fetches].count(True) == 1


async def test_cancel_mid_stream_frees_everything(start_store, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    big_delta(root / ("big" + SUFFIX), mib=16)
    for cache_bytes in (1 << 30, 0):  # cached load, and streamed straight from the backend
        backend = CountingBackend(root, delay_s=0.02)
        s = await start_store(backend, cache_bytes=cache_bytes, read_block_bytes=1 << 20)
        async with grpc.aio.insecure_channel(s.target) as ch:
            call = pb_grpc.DeltaStoreServiceStub(ch).Fetch(pb.FetchRequest(name="big", chunk_bytes=65536), timeout=30)
            n = 0
            async for _ in call:
                n += 1
                if n == 3:
                    break
            call.cancel()
        for _ in range(100):
            if backend.open_readers == 0 and not s.store.cache.entries:
                break
            await asyncio.sleep(0.05)
        assert backend.open_readers == 0  # the backend file is closed
        assert s.store.cache.entries == {} and s.store.cache.used_bytes == 0  # the half-loaded entry is gone
        _, _, got = await fetch_all(s.client, "big")  # and the service goes on
        assert sum(map(len, got.values())) > 16 << 20


async def test_a_finished_fetch_leaves_the_delta_cached(start_store, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    big_delta(root / ("big" + SUFFIX), mib=1)
    backend = CountingBackend(root)
    s = await start_store(backend, read_block_bytes=64 * 1024)  # many blocks: the reader may finish first
    for _ in range(3):
        await fetch_all(s.client, "big")
    assert s.store.cache.entries["big"].complete
    assert (s.store.cache.stats["miss"], s.store.cache.stats["hit"], backend.opens) == (1, 2, 2)


async def test_dropped_buffers_are_reused_and_fully_overwritten(start_store, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    a = big_delta(root / ("a" + SUFFIX), mib=1, seed=1)
    b = big_delta(root / ("b" + SUFFIX), mib=1, seed=2)
    s = await start_store(LocalBackend(root), read_block_bytes=64 * 1024)
    await fetch_all(s.client, "a")
    old = s.store.cache.entries["a"].buf
    await asyncio.sleep(0.1)  # the loader closes its file
    s.store.cache.drop("a")
    _, _, got = await fetch_all(s.client, "b")
    assert s.store.cache.entries["b"].buf is old  # no fresh memory (first-touch page faults) for b
    assert [got[i] for i in range(len(got))] == file_tensors(b) != file_tensors(a)


async def test_cache_keeps_the_hot_delta(start_store, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    for i, name in enumerate(["hot", "b", "c"]):
        big_delta(root / (name + SUFFIX), mib=2, seed=i)
    size = (root / ("hot" + SUFFIX)).stat().st_size
    s = await start_store(CountingBackend(root), cache_bytes=2 * size + 1000, pin_top_n=0)
    for name in ["hot", "hot", "hot", "b", "c"]:  # c evicts b (touched later than hot, but rarely used)
        await fetch_all(s.client, name)
    assert set(s.store.cache.entries) == {"hot", "c"}
    assert s.store.cache.used_bytes <= 2 * size + 1000


async def test_oversized_delta_streams_uncached(start_store, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    path = big_delta(root / ("big" + SUFFIX), mib=4)
    provider, spans = tracer()
    s = await start_store(
        CountingBackend(root), cache_bytes=1 << 20, read_block_bytes=300 * 1024, tracer_provider=provider
    )
    _, _, got = await fetch_all(s.client, "big", chunk_bytes=100_000)  # chunks straddle the read blocks
    assert [got[i] for i in range(len(got))] == file_tensors(path)
    assert s.store.cache.stats["bypass"] == 1 and s.store.cache.entries == {}
    (fetch,) = [sp for sp in spans.get_finished_spans() if sp.name == "delta_store.fetch"]
    (read,) = [sp for sp in spans.get_finished_spans() if sp.name == "delta_store.backend.read"]
    assert fetch.attributes["cache.result"] == "bypass" and read.parent.span_id == fetch.context.span_id


# -- the client's own checks -----------------------------------------------------------------


async def test_client_rejects_a_bad_chunk(tmp_path):
    """A server that corrupts a chunk in flight (crc mismatch) or lies about a tensor (sha mismatch)."""
    path = make_delta(tmp_path / "v.safetensors")
    header = read_header(path)
    tensors = file_tensors(path)

    class Liar(pb_grpc.DeltaStoreServiceServicer):
        def __init__(self, mode):
            self.mode = mode

        async def Fetch(self, request, context):
            yield pb.FetchResponse(
                info=pb.DeltaInfo(name="v", base_fingerprint=BASE_FP),
                tensors=[
                    pb.TensorInfo(name=t.name, nbytes=t.nbytes, sha256=header.sha256[t.name]) for t in header.tensors
                ],
            )
            for i, data in enumerate(tensors):
                sent = bytes([data[0] ^ 1]) + data[1:] if i == 1 else data
                crc = zlib.crc32(data if self.mode == "crc" else sent)
                yield pb.FetchResponse(chunk=pb.Chunk(tensor_index=i, offset=0, data=sent, crc32=crc))

    for mode, what in (("crc", "crc32"), ("sha", "sha256")):
        server = grpc.aio.server()
        pb_grpc.add_DeltaStoreServiceServicer_to_server(Liar(mode), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with DeltaStoreClient(f"127.0.0.1:{port}") as client:
            seen = []
            with pytest.raises(IntegrityError, match=what) as e:
                await client.fetch_into("v", lambda i, t, b: seen.append(i))  # noqa: B023 (called in this iteration)
            assert e.value.tensor == header.tensors[1].name
            assert seen == [0]  # the bad tensor was never handed over
        await server.stop(0)


async def test_fetch_into_places_bytes_in_caller_buffers(start_store, tmp_path):
    import numpy as np

    path = make_delta(tmp_path / "v.safetensors")
    s = await start_store(LocalBackend(tmp_path))
    await s.client.put("w", path)
    bufs = {}

    def alloc(t):
        bufs[t.name] = np.full(t.nbytes, 0xAA, dtype=np.uint8)
        return bufs[t.name]

    async def on_tensor(i, t, buf):
        assert buf is bufs[t.name]

    await s.client.fetch_into("w", on_tensor, alloc=alloc, chunk_bytes=1024)
    want = {t.name: b for t, b in zip(read_header(path).tensors, file_tensors(path))}
    assert {k: v.tobytes() for k, v in bufs.items()} == want


# -- process: configuration, health, reflection, drain ----------------------------------------


def test_config_from_flags_and_env(tmp_path):
    env = {
        "BITDELTA_DELTA_STORE_ROOT": str(tmp_path),
        "BITDELTA_DELTA_STORE_CACHE_BYTES": "2GiB",
        "BITDELTA_DELTA_STORE_VERIFY_READS": "false",
    }
    c = Config.from_args(["--cache-bytes", "512MiB", "--pin-top-n", "3"], env=env)
    assert (c.root, c.cache_bytes, c.pin_top_n, c.verify_reads) == (tmp_path, 512 << 20, 3, False)
    bad = [
        (["--root", str(tmp_path / "missing")], {}, "not an existing directory"),
        ([], {}, "needs --root"),
        (["--root", str(tmp_path), "--cache-bytes", "lots"], {}, "--cache-bytes"),
        ([], {"BITDELTA_DELTA_STORE_BACKEND": "ftp", "BITDELTA_DELTA_STORE_ROOT": str(tmp_path)}, "'local' or 's3'"),
        (["--backend", "s3"], {}, "--s3-bucket"),
        (["--backend", "s3", "--s3-bucket", "b_ad"], {}, "not a valid S3 bucket"),
        (["--backend", "s3", "--s3-bucket", "deltas", "--s3-endpoint", "localhost:8080"], {}, "http"),
        (["--root", str(tmp_path), "--chunk-bytes", "1GiB"], {}, "--chunk-bytes"),
        (["--root", str(tmp_path), "--address", "nonsense"], {}, "HOST:PORT"),
    ]
    for argv, env, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            Config.from_args(argv, env=env)


def test_bad_configuration_exits_with_a_clear_message(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "services.delta_store", "--root", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--root" in r.stderr and "nope" in r.stderr


async def test_health_reflection_and_sigterm_drain(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    big_delta(root / ("big" + SUFFIX), mib=8)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.delta_store",
            "--root",
            str(root),
            "--address",
            "127.0.0.1:0",
            "--grace-s",
            "20",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = None
        for line in proc.stdout:
            if "listening on port" in line:
                port = int(line.split("listening on port")[1].split()[0])
                break
        assert port, "the server did not start"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            # NOT_SERVING while its start-up lists the backend (run_until_signal), then SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            seen = [(await watch.read()).status]
            while seen[-1] != health_pb2.HealthCheckResponse.SERVING:
                seen.append((await watch.read()).status)
            assert set(seen[:-1]) <= {health_pb2.HealthCheckResponse.NOT_SERVING}, seen
            for service in ("", "bitdelta.delta_store.v1.DeltaStoreService"):
                r = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            async for r in refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            ):
                names = {s.name for s in r.list_services_response.service}
            assert "bitdelta.delta_store.v1.DeltaStoreService" in names and "grpc.health.v1.Health" in names

            fetch = pb_grpc.DeltaStoreServiceStub(ch).Fetch(pb.FetchRequest(name="big", chunk_bytes=65536), timeout=30)
            first = await fetch.read()
            assert first.info.name == "big"
            proc.send_signal(signal.SIGTERM)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            received = 0
            while (m := await fetch.read()) != grpc.aio.EOF:  # the in-flight call finishes within the grace
                received += len(m.chunk.data)
            assert received == sum(t.nbytes for t in read_header(root / ("big" + SUFFIX)).tensors)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_real_family_delta_streams_byte_identically(start_store, real_deltas):
    """A delta of the real SmolLM2-135M family (see conftest `real_deltas`), served by the local
    backend over its directory, arrives byte for byte, with the base fingerprint checked."""
    from services.delta_store.backends.local import LocalBackend

    name, path = sorted(real_deltas.items())[0]
    s = await start_store(LocalBackend(path.parent))
    assert name in [d.name for d in await s.client.list()]
    header = read_header(path)
    info, tensors, got = await fetch_all(s.client, name, expect_base_fingerprint=header.meta.base_fingerprint)
    assert info.size_bytes == path.stat().st_size
    data = path.read_bytes()
    assert data[: header.header_bytes] + b"".join(got[i] for i in range(len(tensors))) == data
