"""Faults (issue #12): kill -9 of a worker and of the delta store, during a load and during a stream;
a store that hangs (SIGSTOP); a disk that fills during Put; a worker that answers garbage.

Each gives the client a clear status or a transparent retry, the other variants keep serving,
nothing half-written becomes visible, and the system recovers by itself when the part comes back
(the router and the other services are never restarted). Real processes throughout
(bitdelta/testing/cluster.py); the one fake is `GarbageWorker`, a deliberately broken gRPC server.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.rpc.clients.delta_store import DeltaStoreClient, DeltaStoreError
from bitdelta.rpc.clients.router import RouterCallError, RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from tests.support.reliability import (
    NEVER,
    PROMPTS,
    TALLY,
    TOKENS,
    RelCluster,
    T,
    routed_tokens,
    serving,
    start_system,
    wait_for,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")
P = PROMPTS[0]


@pytest.fixture(scope="module")
def fc(family, tmp_path_factory):
    """Its own store + two workers + router: these tests kill and restart parts of it."""
    with serving(start_system(family, tmp_path_factory.mktemp("rel_faults"), "faults", shared_memory=True)) as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(fc):
    r = RouterClient(fc.r.address, generate_timeout_s=T)
    ws = [WorkerClient(w.address, generate_timeout_s=T) for w in fc.w]
    yield r, ws
    for c in (r, *ws):
        await c.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ref(family, clients) -> dict[str, list[int]]:
    """Each model's greedy tokens for P, computed alone before any fault."""
    r, _ = clients
    return {m: await tokens(r, m) for m in ["", *family.variants]}


tokens = routed_tokens  # one Generate, tallied (tests.support.reliability)


async def checked(r: RouterClient, ref, model: str) -> list[int]:
    got = await tokens(r, model)
    assert got == ref[model], f"{model!r} mis-answered"
    TALLY.correct += 1
    return got


async def evict_everywhere(ws, name: str) -> None:
    for w in ws:
        await w.evict_delta(name)


async def state_on(w: WorkerClient, name: str) -> int | None:
    s = next((s for s in (await w.status()).slots if s.name == name), None)
    return s.state if s else None


async def all_up(r: RouterClient) -> bool:
    return all(w.up for w in await r.list_workers())


async def system_up(fc: RelCluster, r: RouterClient) -> bool:
    """The store SERVING and every worker up in the router's view: where each test starts (a test
    before may have killed, stopped or restarted any of them)."""
    try:
        async with grpc.aio.insecure_channel(fc.st.address) as ch:
            h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.aio.AioRpcError:
        return False
    return h.status == health_pb2.HealthCheckResponse.SERVING and await all_up(r)


def stop(p) -> None:
    p.popen.send_signal(signal.SIGSTOP)


def cont(p) -> None:
    p.popen.send_signal(signal.SIGCONT)


# -- workers --------------------------------------------------------------------------------------------------


async def test_kill9_of_a_worker_during_a_load_is_a_transparent_retry(fc, clients, ref):
    r, ws = clients
    # the retry needs the other worker up in the router's view (a test before may have restarted one)
    await wait_for(lambda: system_up(fc, r), what="the store and both workers up")
    await checked(r, ref, "v0")
    await evict_everywhere(ws, "v3")
    victim = None
    stop(fc.st)  # the load of v3 cannot finish: the request is caught before its first token
    try:
        try:
            req = asyncio.create_task(tokens(r, "v3"))
            loading = await wait_for(lambda: _loading_worker(ws, "v3"), what="a worker loading v3")
            victim = fc.w[ws.index(loading)]
            fc.kill9(victim, "kill -9 worker during a load")
        finally:
            cont(fc.st)
        assert await req == ref["v3"], "retried on the surviving worker, same tokens"
        TALLY.correct += 1
        await checked(r, ref, "v1")  # others keep serving
    finally:
        if victim is not None:  # restarted even when an assertion failed: the module's other tests need it
            fc.restart(victim)
    fc.wait_serving(victim)
    await wait_for(lambda: all_up(r), what="the restarted worker to be routed to again")
    TALLY.recovered("worker restarted, router routes to it")


async def _loading_worker(ws, name):
    for w in ws:
        try:
            if await state_on(w, name) == wpb.DELTA_STATE_LOADING:
                return w
        except Exception:
            pass
    return None


async def test_kill9_of_a_worker_during_a_stream_is_unavailable_and_others_serve(fc, clients, ref):
    r, ws = clients
    await wait_for(lambda: system_up(fc, r), what="the store and both workers up")
    stream = r.generate("v0", "a long one", max_new_tokens=200)
    first = await anext(stream)
    victim = next(p for p in fc.w if p.address == first.worker)
    stop(victim)  # frozen mid-stream, then killed
    fc.kill9(victim, "kill -9 worker during a stream")
    try:
        with pytest.raises(RouterCallError) as e:
            async for _ in stream:
                pass
        assert e.value.code == grpc.StatusCode.UNAVAILABLE  # tokens cannot be taken back: a clear status
        assert "127.0.0.1" not in e.value.details and "TLS" not in e.value.details, e.value.details
        TALLY.reject(e.value.code)
        for m in ("v0", "v2", ""):
            await checked(r, ref, m)  # served by the survivor
    finally:  # restarted even when an assertion failed: the module's other tests need it
        fc.restart(victim)
    fc.wait_serving(victim)
    await wait_for(lambda: all_up(r), what="the restarted worker back")
    TALLY.recovered("worker restarted, router routes to it")


# -- the store ------------------------------------------------------------------------------------------------


async def test_kill9_of_the_store_during_a_load_and_a_stream(fc, clients, ref):
    r, ws = clients
    await wait_for(lambda: system_up(fc, r), what="the store and both workers up")
    await checked(r, ref, "v0")  # resident somewhere
    for cold_one in ("v4", "v5"):  # cold whatever ran before (`ref` itself leaves the last variants resident)
        await evict_everywhere(ws, cold_one)
    long_ref = await tokens(r, "v0", "stream on", n=64)
    stop(fc.st)
    cold = asyncio.create_task(tokens(r, "v4"))
    await wait_for(lambda: _loading_worker(ws, "v4"), what="a worker loading v4")
    streaming = asyncio.create_task(tokens(r, "v0", "stream on", n=64))
    fc.kill9(fc.st, "kill -9 store during a load")
    TALLY.fault("kill -9 store during a stream")
    with pytest.raises(RouterCallError) as e:
        await cold
    assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value  # clear and retryable; not INTERNAL, no hang
    assert "127.0.0.1" not in e.value.details, e.value.details  # public: the store's address stays inside
    assert await streaming == long_ref  # a resident variant's stream does not need the store
    TALLY.correct += 1
    await checked(r, ref, "v0")  # resident: still served with the store dead
    t = time.monotonic()
    with pytest.raises(RouterCallError) as e:  # a cold one fails fast while the store is dead
        await tokens(r, "v5")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t < 30
    fc.restart(fc.st)  # same address; workers and router reconnect by themselves
    fc.wait_serving(fc.st)

    async def served():
        try:
            return await tokens(r, "v4") == ref["v4"]
        except RouterCallError:
            return False

    await wait_for(served, what="v4 served again after the store came back", interval=0.5)
    TALLY.correct += 1
    t = time.monotonic()
    for w in ws:  # every worker, not only the one the router chose: each reconnects by itself, soon
        await w.evict_delta("v4")
        await wait_for(lambda w=w: _loads(w, "v4", ref), timeout=30, what="each worker loading from the store again")
    assert time.monotonic() - t < 20, "a worker took long to reconnect to the store (reconnect backoff)"
    TALLY.recovered("store restarted, loads resume without restarting workers or router")
    # the killed store's shared-memory files were removed by the new one; only its own directory is left
    assert [d.name.split("-")[1] for d in fc.shm.glob("store-*")] == [str(fc.st.popen.pid)]


async def _loads(w: WorkerClient, model: str, ref) -> bool:
    """Whether worker `w` answers `model` (a cold one: it loads it from the store) with its tokens."""
    try:
        return [t.token_id for t in await _direct(w, model)] == ref[model]
    except Exception:
        return False


async def test_a_hanging_store_gives_deadline_exceeded_and_resident_variants_keep_serving(fc, clients, ref):
    """The store process stopped (SIGSTOP: it accepts connections, answers nothing), the local
    equivalent of an S3 server that hangs."""
    r, ws = clients
    await wait_for(lambda: system_up(fc, r), what="the store and both workers up")
    await checked(r, ref, "v1")
    await evict_everywhere(ws, "v2")
    stop(fc.st)
    TALLY.fault("store hangs (SIGSTOP)")
    try:
        t = time.monotonic()
        with pytest.raises(RouterCallError) as e:
            await tokens(r, "v2", timeout_s=3)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t < 20
        await checked(r, ref, "v1")  # the resident variant is not held behind the hung load
        assert {m.model_id for m in await r.list_models()} >= {"v1", "v2"}  # the registry answers from memory
    finally:
        cont(fc.st)
    await wait_for(lambda: _served(r, ref, "v2"), what="v2 once the store answers again", interval=0.5)
    TALLY.recovered("store resumed")


async def _served(r, ref, model):
    try:
        return await tokens(r, model) == ref[model]
    except RouterCallError:
        return False


# -- disk full during Put ------------------------------------------------------------------------------------


def _small_disk(path: Path, kib: int) -> str:
    """A tmpfs of `kib` KiB at `path` (root only); returns how the disk is limited."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], capture_output=True)
    return "tmpfs" if r.returncode == 0 else ""


async def test_disk_full_during_put_refuses_cleanly_and_recovers(fc, family, tmp_path):
    """A store on a 160 KiB tmpfs (one tiny delta fits, two do not); without the rights to mount, the
    store runs under RLIMIT_FSIZE instead (writes past it fail with EFBIG, like a full disk)."""
    root = tmp_path / "small"
    how = _small_disk(root, 160)
    c = RelCluster(tmp_path / "c", "disk-full")
    if not how:
        root.mkdir(exist_ok=True)
        how = "RLIMIT_FSIZE"
    TALLY.notes.append(f"disk full during Put: simulated with {how}")
    try:
        st = (
            c.start("store", "services.delta_store", ["--backend", "local", "--root", str(root), "--grace-s", "2"])
            if how == "tmpfs"
            else _start_store_with_fsize_limit(c, root, 120 * 1024)
        )
        c.wait_serving(st)
        async with DeltaStoreClient(st.address, timeout_s=T, fetch_timeout_s=T) as s:
            await s.put("first", family.delta_path("v0"))
            listing = asyncio.create_task(_watch_list(s))
            TALLY.fault("disk full during Put")
            with pytest.raises(DeltaStoreError) as e:
                await s.put("second", family.delta_path("v1"))
            TALLY.reject(e.value.code)
            assert e.value.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE), e.value
            assert e.value.code not in NEVER
            assert "space" in str(e.value).lower() or "large" in str(e.value).lower(), str(e.value)
            seen = await _stop(listing)
            assert "second" not in seen, "a partial Put was listed"
            assert [d.name for d in await s.list()] == ["first"]
            assert not [p for p in (root / ".partial").glob("*")] if (root / ".partial").exists() else True
            # room again: the same Put succeeds and the first delta is intact
            await s.delete("first")
            await s.put("second", family.delta_path("v1"))
            info, _ = await s.fetch_into("second", lambda *a: None)
            assert info.size_bytes == family.delta_path("v1").stat().st_size
            TALLY.recovered("disk has room again, Put succeeds")
            assert st.alive()
    finally:
        c.stop_all()
        if how == "tmpfs":
            subprocess.run(["umount", str(root)], capture_output=True)


async def _watch_list(s: DeltaStoreClient) -> set[str]:
    seen: set[str] = set()
    try:
        while True:
            seen |= {d.name for d in await s.list()}
            await asyncio.sleep(0.005)
    except asyncio.CancelledError:
        return seen


async def _stop(task) -> set[str]:
    task.cancel()
    return await task


def _start_store_with_fsize_limit(c: RelCluster, root: Path, limit: int):
    import resource
    import sys

    from bitdelta.testing.cluster import Proc, free_port

    address = f"127.0.0.1:{free_port()}"
    argv = [
        sys.executable,
        "-m",
        "services.delta_store",
        "--address",
        address,
        "--backend",
        "local",
        "--root",
        str(root),
        "--grace-s",
        "2",
    ]
    log = open(c.workdir / "store.log", "ab")  # opened here: the limit applies to files the store writes
    p = subprocess.Popen(
        argv,
        cwd=Path(__file__).resolve().parents[2],
        env=c.env,
        stdout=log,
        stderr=log,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    proc = Proc("store", address, p, c.workdir / "store.log", argv)
    c.procs.append(proc)
    return proc


# -- a worker that returns garbage -----------------------------------------------------------------------------


class GarbageWorker:
    """A DELIBERATE FAKE: a gRPC server on loopback that says it is a healthy worker of this family
    (its Status is a real worker's, forwarded) but answers Generate with bytes that are not a
    GenerateResponse (mode "bytes") or with well-formed nonsense that never finishes (mode "nonsense")."""

    SERVICE = "bitdelta.gpu_worker.v1.GpuWorkerService"

    def __init__(self, real: str, mode: str):
        self.real, self.mode = real, mode
        self.generates = 0

    async def start(self) -> str:
        from grpc_health.v1 import health
        from grpc_health.v1 import health_pb2_grpc as hg

        self.server = grpc.aio.server()
        real = grpc.aio.insecure_channel(self.real)
        self._real = real

        async def status(request: bytes, context):
            st = wpb.StatusResponse.FromString(await real.unary_unary(f"/{self.SERVICE}/Status")(request, timeout=5))
            have = {s.name for s in st.slots}  # claim every variant resident, so the router comes here first
            st.slots.extend(
                wpb.DeltaSlot(name=f"v{i}", state=wpb.DELTA_STATE_RESIDENT, bytes=1)
                for i in range(6)
                if f"v{i}" not in have
            )
            for s in st.slots:
                s.state = wpb.DELTA_STATE_RESIDENT
            return st.SerializeToString()

        async def generate(request: bytes, context):
            self.generates += 1
            if self.mode == "bytes":
                yield b"\xff\xff\xff\xff\x0f garbage"
            else:
                for i in range(5):
                    token = gen_pb.Token(token_id=2**31 - i, text="\x00\ufffd")
                    yield wpb.GenerateResponse(tokens=[token]).SerializeToString()
                await asyncio.sleep(3600)

        ident = dict(request_deserializer=None, response_serializer=None)
        handlers = {
            "Status": grpc.unary_unary_rpc_method_handler(status, **ident),
            "Generate": grpc.unary_stream_rpc_method_handler(generate, **ident),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.SERVICE, handlers),))
        hs = health.HealthServicer()
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        hg.add_HealthServicer_to_server(hs, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        await self.server.stop(0)
        await self._real.close()


async def test_a_worker_that_answers_garbage(fc, clients, ref):
    """Undecodable bytes before the first token: the router retries on the real worker (transparent).
    Well-formed nonsense that never ends: the client's deadline ends it with DEADLINE_EXCEEDED, and
    the real worker keeps serving through the same router."""
    _, ws = clients
    await wait_for(lambda: system_up(fc, clients[0]), what="the store and both workers up")
    real = fc.w[0].address
    for mode in ("bytes", "nonsense"):
        for i in range(6):  # the real worker holds none of them: the router's first choice is the fake
            await ws[0].evict_delta(f"v{i}")
        fake = GarbageWorker(real, mode)
        await fake.start()
        TALLY.fault(f"garbage worker ({mode})")
        rt = fc.router(
            [fake.address, real], fc.st.address, name=f"router-garbage-{mode}", extra=("--call-timeout-s", "3")
        )
        try:
            fc.wait_serving(rt)
            async with RouterClient(rt.address, generate_timeout_s=T) as r:
                await wait_for(lambda: all_up(r), what="the router to see the fake and the real worker up")
                outcomes = []
                # nonsense: each call may run to its 5 s deadline, two show it (four cost ~20 s under load)
                for m in ["v0", "v1", "v3", "v0"] if mode == "bytes" else ["v0", "v3"]:
                    try:
                        got = await tokens(r, m, timeout_s=5 if mode == "nonsense" else None)
                        outcomes.append("ok")
                        assert got == ref[m], f"{m!r}: garbage reached the client as tokens"
                        TALLY.correct += 1
                    except RouterCallError as e:
                        outcomes.append(e.code.name)
                        assert e.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), e
                        if mode == "bytes":
                            raise AssertionError(f"undecodable worker answer not retried: {e}") from None
                        assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert fake.generates > 0, "the fake was never asked: the test tested nothing"
                if mode == "nonsense":  # the router's pool notices nothing; it is the client's deadline
                    TALLY.notes.append(f"garbage worker (nonsense): outcomes {outcomes}")
                assert [x.token_id for x in await _direct(ws[0], "v2")] == ref["v2"]  # the real worker is fine
        finally:
            rt.stop()
            await fake.stop()
    TALLY.recovered("garbage worker removed, real worker serving")


async def _direct(w: WorkerClient, model: str):
    req = wpb.GenerateRequest(model_id=model, prompt=P, sampling=gen_pb.SamplingParams(max_new_tokens=TOKENS))
    return [m async for m in w.generate(req)]


# -- drain ------------------------------------------------------------------------------------------------------


async def test_health_is_not_serving_during_drain_and_the_router_routes_around(fc, clients, ref):
    r, ws = clients
    await wait_for(lambda: system_up(fc, r), what="the store and both workers up")
    victim = fc.w[1]
    async with WorkerClient(victim.address, generate_timeout_s=T) as w:
        from bitdelta.common.v1 import generation_pb2 as gen_pb

        started = [asyncio.Event() for _ in range(6)]
        long = [asyncio.create_task(_drain_collect(w, gen_pb, e)) for e in started]
        # every stream admitted (its first token out) before the drain begins: one that arrives after
        # it is rightly refused
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
        assert not all(t.done() for t in long), "the streams ended before the drain: it would test nothing"
        victim.popen.send_signal(signal.SIGTERM)
        TALLY.fault("SIGTERM (drain) of a worker")
        async with grpc.aio.insecure_channel(victim.address) as ch:
            hs = health_pb2_grpc.HealthStub(ch)

            async def not_serving():
                r_ = await hs.Check(health_pb2.HealthCheckRequest(), timeout=5)
                return r_.status == health_pb2.HealthCheckResponse.NOT_SERVING

            await wait_for(not_serving, timeout=10, interval=0.02, what="NOT_SERVING while draining")

        async def routed_around():
            return not {x.address: x for x in await r.list_workers()}[victim.address].up

        await wait_for(routed_around, timeout=15, interval=0.05, what="the router to see the worker drain")
        await checked(r, ref, "v1")  # served by the other worker
        done = await asyncio.gather(*long, return_exceptions=True)
        # running streams finished, every token of them, in the grace
        assert all(isinstance(x, list) and len(x) == 230 for x in done), done
    fc.restart(victim)
    fc.wait_serving(victim)
    await wait_for(lambda: all_up(r), what="the drained worker back")
    TALLY.recovered("drained worker restarted")


async def _drain_collect(w: WorkerClient, gen_pb, started: asyncio.Event) -> list[int]:
    # ignore_eos: a stream that ends early would not be running when the drain begins; seeded, so the
    # streams take a step at a time (greedy decode bursts end 230 tokens in a few bursts)
    sp = gen_pb.SamplingParams(max_new_tokens=230, ignore_eos=True, temperature=0.8, seed=3)
    req = wpb.GenerateRequest(model_id="", prompt="drain " * 4, sampling=sp)
    out = []
    async for m in w.generate(req):
        out.append(m.token_id)
        started.set()
    return out
