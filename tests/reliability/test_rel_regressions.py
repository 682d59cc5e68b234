"""Regression tests for the defects earlier hostile testing found (tests/gpu_worker/test_worker_hostile.py,
tests/rpc/test_rpc_layer.py), here through the router and the whole system where the path allows:
a pinned budget (fails fast, names the pins; no deadlock), EvictDelta during a load (ABORTED at
once), NaN sampling next to a batch of good requests, huge prompts, Health.Watch on every service,
a store-side status reaching the router's client unchanged across two hops, long names clipped in
errors. (Health NOT_SERVING during drain: test_rel_faults.py.)
"""

from __future__ import annotations

import asyncio
import math
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.rpc.clients.delta_store import DeltaStoreClient, DeltaStoreError
from bitdelta.rpc.clients.router import RouterCallError, RouterClient
from bitdelta.rpc.clients.worker import WorkerCallError, WorkerClient
from tests.support.reliability import MAX_DETAILS, PROMPTS, TALLY, TOKENS, T, routed_tokens, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")
P = PROMPTS[0]


run = routed_tokens  # one Generate, tallied (tests.support.reliability)


async def refused(r: RouterClient, model: str, prompt: str = P, **kw) -> RouterCallError:
    with pytest.raises(RouterCallError) as e:
        await run(r, model, prompt, **kw)
    assert len(e.value.details) < MAX_DETAILS
    return e.value


def ok(expected, model, got, prompt=P):
    assert got == expected[(model, prompt)], f"{model!r} mis-answered"
    TALLY.correct += 1


async def test_pinned_budget_fails_fast_through_the_router_and_frees_by_evict(system, expected):
    async with RouterClient(system.r.address, generate_timeout_s=T) as r:
        ws = [WorkerClient(w.address, generate_timeout_s=T) for w in system.w]
        try:
            for w in ws:  # each worker's budget (two deltas) full of pins
                for i in range(6):
                    await w.evict_delta(f"v{i}")
                await w.load_delta("v0", pin=True)
                await w.load_delta("v1", pin=True)
            t = time.monotonic()
            e = await refused(r, "v4")
            assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "'v0'" in e.details and "'v1'" in e.details, e
            assert time.monotonic() - t < 15, "a load that can never fit must not wait"
            ok(expected, "v0", await run(r, "v0"))  # the pinned ones serve
        finally:
            for w in ws:
                await w.evict_delta("v0")  # unpins
                await w.evict_delta("v1")
        ok(expected, "v4", await run(r, "v4"))
        for w in ws:
            await w.close()


async def test_evict_during_a_load_is_aborted_at_once_through_the_router(system, expected):
    async with RouterClient(system.r.address, generate_timeout_s=T) as r:
        ws = [WorkerClient(w.address) for w in system.w]
        for w in ws:
            await w.evict_delta("v5")
        system.st.popen.send_signal(signal.SIGSTOP)
        try:
            reqs = [asyncio.create_task(run(r, "v5")) for _ in range(3)]

            async def loading():
                for w in ws:
                    if any(s.name == "v5" and s.state == wpb.DELTA_STATE_LOADING for s in (await w.status()).slots):
                        return w
                return None

            w = await wait_for(loading, what="v5 loading")
            TALLY.fault("EvictDelta during a load")
            t = time.monotonic()
            # evicting aborts every request waiting on the load at once; one still on its way to the
            # worker when it was evicted starts a new load, which the next eviction aborts
            while not all(q.done() for q in reqs):
                await w.evict_delta("v5")
                await asyncio.wait(reqs, timeout=0.2)
                assert time.monotonic() - t < 15, "requests waiting on an evicted load were not aborted"
            got = await asyncio.gather(*reqs, return_exceptions=True)
            assert all(isinstance(g, RouterCallError) and g.code == grpc.StatusCode.ABORTED for g in got), got
        finally:
            system.st.popen.send_signal(signal.SIGCONT)
        ok(expected, "v5", await run(r, "v5"))  # sent again: loads anew
        for w in ws:
            await w.close()


async def test_nan_sampling_is_refused_while_a_batch_runs(system, expected):
    async with RouterClient(system.r.address, generate_timeout_s=T) as r:
        good = [asyncio.create_task(run(r, m)) for m in ("v0", "", "v1", "v0")]
        for bad in (
            dict(temperature=math.nan),
            dict(top_p=math.nan),
            dict(temperature=math.inf),
            dict(temperature=-1.0),
        ):
            e = await refused(r, "v0", **bad)
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT and ("temperature" in e.details or "top_p" in e.details)
        for m, g in zip(("v0", "", "v1", "v0"), await asyncio.gather(*good)):
            ok(expected, m, g)
        # sampled requests next to greedy ones: the greedy ones keep their tokens
        sampled = [asyncio.create_task(run(r, "v2", temperature=1.5, top_p=0.9, seed=s)) for s in range(3)]
        ok(expected, "v2", await run(r, "v2"))
        # sampled answers complete (they may end early: a sampled token can be the end of sequence)
        assert all(1 <= len(x) <= TOKENS for x in await asyncio.gather(*sampled))


async def test_huge_prompts(system, expected):
    async with RouterClient(system.r.address, generate_timeout_s=T) as r:
        e = await refused(r, "v0", "x" * 70_000)  # over the router's --max-prompt-bytes (64 KiB here)
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.details
        e = await refused(r, "v0", "ab " * 20_000)  # within the bytes, far over the model's 256-token context
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.details, e  # the worker's, unchanged
        t = time.monotonic()
        e = await refused(r, "v0", "y" * (80 << 20))  # past every message limit
        assert e.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), e
        assert time.monotonic() - t < 30
        ok(expected, "v0", await run(r, "v0"))


async def test_health_watch_on_every_service(system):
    for p in (system.r, *system.w, system.st):
        async with grpc.aio.insecure_channel(p.address) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            first = await call.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING, p.name
            call.cancel()


async def test_a_store_status_reaches_the_router_client_unchanged(system, family, expected):
    """DATA_LOSS found by the store (a corrupted delta dropped into its directory) → worker → router →
    client, the code unchanged over two hops; FAILED_PRECONDITION (another base) likewise."""
    bad = system.root / "rot.bitdelta.safetensors"
    bad.write_bytes(family.delta_path(family.corrupt).read_bytes())
    TALLY.fault("corrupted delta on disk")
    try:
        async with RouterClient(system.r.address, generate_timeout_s=T) as r:

            async def listed():
                return "rot" in {m.model_id for m in await r.list_models()}

            await wait_for(listed, what="the router to list the dropped-in delta")
            e = await refused(r, "rot")
            assert e.code == grpc.StatusCode.DATA_LOSS and "sha256" in e.details, e
            e = await refused(r, "otherbase")
            assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
            ok(expected, "v3", await run(r, "v3"))
    finally:
        bad.unlink()


async def test_long_names_are_clipped_in_every_service_s_errors(system):
    name = "n" * 20_000
    async with (
        RouterClient(system.r.address) as r,
        WorkerClient(system.w[0].address) as w,
        DeltaStoreClient(system.st.address) as s,
    ):
        e = await refused(r, name)
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT
        for call in (lambda: w.load_delta(name), lambda: w.evict_delta(name)):
            with pytest.raises(WorkerCallError) as we:
                await call()
            assert we.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(we.value.details) < MAX_DETAILS
        for call in (lambda: s.stat(name), lambda: s.delete(name), lambda: s.open_fetch(name)):
            with pytest.raises(DeltaStoreError) as se:
                await call()
            assert se.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(se.value.details) < MAX_DETAILS
