"""The router when a worker dies: `kill -9` of a worker mid-run, with a delta store and two
workers as real processes. Requests that had not started streaming complete on the other worker;
a request that was streaming fails with UNAVAILABLE (tokens cannot be taken back); the dead worker
is reported down and skipped, and comes back by itself when restarted."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as wpb
from bitdelta.rpc.clients.router import RouterCallError, RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from bitdelta.testing.cluster import Cluster
from bitdelta.testing.family import make_test_family

pytestmark = pytest.mark.asyncio(loop_scope="module")
T = 120


async def wait_for(pred, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (r := await pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return r


async def tokens(w: WorkerClient, model: str, prompt: str, n: int) -> list[int]:
    req = wpb.GenerateRequest(model_id=model, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=n))
    return [m.token_id async for m in w.generate(req)]


async def test_kill9_of_a_worker_mid_run(tmp_path):
    fam = make_test_family(tmp_path / "family", n_variants=2, merged=False)
    with Cluster(tmp_path / "cluster") as c:
        st = c.store(fam.deltas)
        victim, survivor = (
            c.worker(fam.base, st.address, name="victim"),
            c.worker(fam.base, st.address, name="survivor"),
        )
        router = c.router([victim.address, survivor.address], st.address, extra=("--call-timeout-s", "3"))
        c.wait_serving(st, victim, survivor, router)
        async with (
            RouterClient(router.address, generate_timeout_s=T) as r,
            WorkerClient(victim.address) as wv,
            WorkerClient(survivor.address) as ws,
        ):
            await wait_for(lambda: _all_up(r), what="both workers up")
            want = await tokens(ws, "v1", "hello there", 8)
            # v1 resident on the victim only, so the router sends its requests there
            await ws.evict_delta("v1")
            await wv.load_delta("v1")

            async def routed_to_victim():
                m = {x.model_id: x for x in await r.list_models()}.get("v1")  # listed once the registry refreshed
                return m is not None and list(m.resident_on) == [victim.address]

            await wait_for(routed_to_victim, what="the router to see v1 on the victim only")
            streaming = r.generate("v1", "a long one", max_new_tokens=200)
            first = await anext(streaming)
            assert first.worker == victim.address
            victim.popen.send_signal(signal.SIGSTOP)  # frozen: requests sent now wait there, unanswered
            pending = [asyncio.create_task(_collect(r, "v1", "hello there", 8)) for _ in range(6)]
            await asyncio.sleep(0.5)
            assert not any(p.done() for p in pending)
            victim.kill9()
            results = await asyncio.gather(*pending)
            for msgs in results:  # every request that had not started streaming completed on the survivor
                assert msgs[0].worker == survivor.address and [t.token_id for m in msgs for t in m.tokens] == want
            with pytest.raises(RouterCallError) as e:  # the one that was streaming cannot be retried
                async for _ in streaming:
                    pass
            assert e.value.code == grpc.StatusCode.UNAVAILABLE

            workers = {w.address: w for w in await r.list_workers()}
            assert not workers[victim.address].up and workers[victim.address].reason
            assert workers[survivor.address].up
            again = await asyncio.gather(*[_collect(r, "v1", "hello there", 8) for _ in range(3)])
            assert all(
                m[0].worker == survivor.address and [t.token_id for x in m for t in x.tokens] == want for m in again
            )

            c.restart(victim)  # it comes back by itself: no restart of the router
            c.wait_serving(victim)
            await wait_for(lambda: _all_up(r), what="the restarted worker to be routed to again")


async def _all_up(r: RouterClient) -> bool:
    return all(w.up for w in await r.list_workers())


async def _collect(r: RouterClient, model: str, prompt: str, n: int):
    return [m async for m in r.generate(model, prompt, max_new_tokens=n)]
