"""The router's pure parts: placement decisions and the admission queue (no I/O)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from bitdelta.rpc.config import ConfigError
from services.router.admission import Admission
from services.router.config import RouterConfig
from services.router.errors import ResourceExhausted
from services.router.placement import WorkerView, choose_worker


def w(addr, **kw) -> WorkerView:
    kw.setdefault("up", True)
    kw.setdefault("capacity", 4)
    kw.setdefault("free_bytes", 100)
    return WorkerView(addr, **kw)


def test_placement_prefers_where_the_variant_already_is():
    cold = [w("a", in_flight=1), w("b")]
    assert choose_worker("v", 10, cold).address == "b"  # anywhere: the least loaded
    assert choose_worker("v", 10, [w("a", in_flight=3, resident=frozenset({"v"})), w("b")]).address == "a"
    assert choose_worker("v", 10, [w("a", loading=frozenset({"v"}), in_flight=2), w("b")]).address == "a"
    # requests in flight for v on a: join them (one batch, one load), even if v is resident on b too
    both = [w("a", in_flight=2, in_flight_by_variant={"v": 2}), w("b", resident=frozenset({"v"}))]
    assert choose_worker("v", 10, both).address == "a"
    # spread only when the worker that runs it is full
    full = [w("a", in_flight=4, in_flight_by_variant={"v": 4}), w("b"), w("c", resident=frozenset({"v"}))]
    assert choose_worker("v", 10, full).address == "c"
    # no eviction needed beats lower load among workers that do not hold it
    assert choose_worker("v", 50, [w("a", free_bytes=10), w("b", in_flight=3, free_bytes=60)]).address == "b"
    # the base runs on the least loaded; down, excluded and full workers are never chosen
    assert choose_worker(None, 0, [w("a", in_flight=2), w("b", in_flight=1)]).address == "b"
    assert choose_worker("v", 10, [w("a", up=False), w("b", in_flight=4), w("c")], exclude={"c"}) is None


async def test_admission_bounds_and_fifo():
    q = Admission(max_total=3, max_per_variant=2)
    t1, t2 = q.join("v", "'v'"), q.join("v", "'v'")
    with pytest.raises(ResourceExhausted) as e:
        q.join("v", "'v'")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "'v'" in str(e.value)
    t3 = q.join("u", "'u'")
    with pytest.raises(ResourceExhausted, match="queue is full"):
        q.join("x", "'x'")
    order = []

    async def waiter(t):
        await q.wait(t)
        order.append(t)
        q.leave(t)

    tasks = [asyncio.create_task(waiter(t)) for t in (t1, t2, t3)]
    await asyncio.sleep(0)
    q.wake_all()
    await asyncio.gather(*tasks)
    assert order == [t1, t2, t3] and len(q) == 0 and not q.by_key
    q.join("x", "'x'")  # room again


async def test_admission_serves_better_priorities_first_then_fifo():
    q = Admission(max_total=8, max_per_variant=8)
    tickets = [(q.join("v", "'v'", priority=p), p) for p in (2, 0, 2, -1, 0)]
    order = []

    async def waiter(t):
        await q.wait(t)
        order.append(t)
        q.leave(t)

    tasks = [asyncio.create_task(waiter(t)) for t, _ in tickets]
    await asyncio.sleep(0)
    q.wake_all()
    await asyncio.gather(*tasks)
    assert order == [t for t, _ in sorted(tickets, key=lambda tp: (tp[1], tp[0]))]


def test_the_priority_travels_to_the_worker():
    from bitdelta.generation import Request
    from bitdelta.rpc.wire.gpu_worker import request_to_pb

    req = Request("v", "hi", priority=-3)
    assert Request.from_pb(request_to_pb(req)).priority == -3


def test_router_config():
    c = RouterConfig.from_args(["--workers", "127.0.0.1:1,127.0.0.1:2", "--delta-store", "127.0.0.1:3"], env={})
    assert c.workers == ("127.0.0.1:1", "127.0.0.1:2") and c.max_queue == 256
    for argv, words in [
        (["--delta-store", "h:1"], "--workers"),
        (["--workers", "h:1"], "--delta-store"),
        (["--workers", "h:1,h:1", "--delta-store", "h:2"], "twice"),
        (["--workers", "nohost", "--delta-store", "h:2"], "HOST:PORT"),
        (["--workers", "h:1", "--delta-store", "h:2", "--poll-s", "0"], "--poll-s"),
    ]:
        with pytest.raises(ConfigError, match=words):
            RouterConfig.from_args(argv, env={})


async def test_a_stale_status_does_not_undo_what_the_router_saw_since():
    """A Status answered before a load finished must not erase the residency the router learnt
    from a token streamed after it asked (that would send the next request where the delta is not)."""
    from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
    from services.router.pool import WorkerPool

    pool = WorkerPool(["127.0.0.1:9"], capacity=4, poll_s=1, call_timeout_s=1)
    w = pool.workers["127.0.0.1:9"]
    stale = wpb.StatusResponse(
        ready=True,
        base_model="b",
        base_fingerprint="f",
        slots=[wpb.DeltaSlot(name="old", state=wpb.DELTA_STATE_RESIDENT)],
    )
    asked = time.monotonic()
    pool.note_resident(w.address, "v")  # a token of v arrived after the poll asked
    pool._apply(w, stale, asked)
    assert w.resident == {"old", "v"}
    pool._apply(w, stale, time.monotonic())  # a poll asked after that: its word holds
    assert w.resident == {"old"}
    await pool.close()


async def test_an_unknown_model_while_the_store_is_down_is_unavailable_not_not_found():
    import grpc as _grpc

    from bitdelta.rpc.clients.delta_store import DeltaStoreClient
    from services.router.errors import Unavailable
    from services.router.pool import BaseInfo
    from services.router.registry import Registry

    async with DeltaStoreClient("127.0.0.1:9", timeout_s=1) as store:  # nothing listens there
        reg = Registry(store, refresh_s=60, call_timeout_s=1)
        assert await reg.refresh() is False and reg.last_error
        with pytest.raises(Unavailable) as e:
            await reg.lookup("coder", BaseInfo("base", "f" * 64))
        assert e.value.code == _grpc.StatusCode.UNAVAILABLE and "unreachable" in str(e.value)
        assert (await reg.lookup("", BaseInfo("base", "f" * 64))).is_base  # the base needs no store
