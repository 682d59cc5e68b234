"""A bounded soak (issue #12): mixed variants through the router, more variants than the workers'
delta budgets hold (six variants, two per worker: every few requests evict one), requests cancelled
at random, bursts past the router's queue bounds.

Asserted: no request lost or mis-answered (every completed greedy answer equals that variant's
tokens computed once alone; every request ends with tokens, a cancellation we caused, or
RESOURCE_EXHAUSTED from a full queue); bursts get RESOURCE_EXHAUSTED at once instead of queues that
grow; afterwards nothing is left behind (no running or waiting sequence, no KV block in use, no
request in flight at the router); and every process's RSS is flat after warm-up.

The RSS bound: after a warm-up of a quarter of the run (every variant loaded and evicted many
times, every code path taken), the mean RSS over the last third may exceed the mean over the
third after warm-up by at most max(16 MiB, 5 %). The steady state holds nothing that grows with
the number of requests (KV blocks and delta slots are preallocated; Status entries and the
router's tables are bounded), so growth means a leak; 16 MiB leaves room for the allocator's
arenas and gRPC's buffers settling (observed: a few MiB), and catches a leak of one delta slot
(~84 KB) per eviction or a few KB per request over the run's thousands of requests.

Length: BITDELTA_SOAK_S seconds (default 60; e.g. 1800 for a long run by hand).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time

import grpc
import pytest

from bitdelta.generation import Sampling
from bitdelta.router.v1 import router_pb2 as pb
from bitdelta.rpc.clients.router import RouterCallError, RouterClient
from bitdelta.rpc.clients.worker import WorkerClient
from tests.support.reliability import PROMPTS, TALLY, TOKENS, T, vm_rss_kib, wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")
SOAK_S = float(os.environ.get("BITDELTA_SOAK_S", "60"))
CLIENTS = 6
BURST = 100  # requests for one variant at once: > in-flight (8 per worker) + per-variant queue (12) of the router
# Each burst request holds its slot for this many steps (EOS ignored): the 100 calls reach the router
# one by one, and short requests could finish as fast as the rest arrive on a loaded machine (a CI run
# saw a burst of 64-token requests with no refusal at all), so the queue would never be full.
BURST_TOKENS = 192  # + the prompt fits the tiny model's 256 positions


def _request(model: str, prompt: str, n: int) -> pb.GenerateRequest:
    sampling = Sampling(max_new_tokens=n, ignore_eos=n == BURST_TOKENS)
    return pb.GenerateRequest(model_id=model, prompt=prompt, sampling=sampling.to_pb())


async def test_soak(system, family, expected):
    models = ["", *family.variants]
    rng = random.Random(1234)
    outcome: dict[str, int] = {"correct": 0, "cancelled": 0, "deadline": 0, "exhausted": 0}
    samples: dict[str, list[tuple[float, int]]] = {p.name: [] for p in (system.st, *system.w, system.r)}
    t0 = time.monotonic()
    end = t0 + SOAK_S
    burst_exhausted = []

    async with RouterClient(system.r.address, generate_timeout_s=T) as r:

        async def loads() -> int:
            total = 0
            for w in system.w:
                async with WorkerClient(w.address) as wc:
                    total += (await wc.status()).loads_started
            return total

        loads_before = await loads()
        burst_ref = {}  # alone, before the soak
        for m in models:
            burst_ref[m] = [
                t.token_id async for x in r.generate_request(_request(m, PROMPTS[0], BURST_TOKENS)) for t in x.tokens
            ]
            assert len(burst_ref[m]) == BURST_TOKENS

        async def one(model: str, prompt: str, mode: str, n: int = TOKENS) -> None:
            TALLY.sent += 1
            try:
                if mode == "cancel":  # leave after the first token: the call is cancelled downstream
                    stream = r.generate_request(_request(model, prompt, n))
                    await anext(stream)
                    await stream.aclose()
                    outcome["cancelled"] += 1
                    return
                timeout = rng.uniform(0.01, 0.3) if mode == "deadline" else None
                got = [
                    t.token_id
                    async for m in r.generate_request(_request(model, prompt, n), timeout_s=timeout)
                    for t in m.tokens
                ]
                want = expected[(model, prompt)] if n == TOKENS else burst_ref[model]
                assert got == want, f"{model!r} {prompt!r} mis-answered"
                outcome["correct"] += 1
                TALLY.correct += 1
            except RouterCallError as e:
                TALLY.reject(e.code)
                if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and mode == "deadline":
                    outcome["deadline"] += 1
                elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    outcome["exhausted"] += 1
                    raise _Exhausted() from None
                else:
                    raise

        async def client(i: int) -> None:
            while time.monotonic() < end:
                mode = rng.choices(["plain", "cancel", "deadline"], [0.8, 0.1, 0.1])[0]
                try:
                    await one(rng.choice(models), rng.choice(PROMPTS), mode)
                except _Exhausted:
                    await asyncio.sleep(0.05)

        async def bursts() -> None:
            while time.monotonic() < end - 5:
                await asyncio.sleep(SOAK_S / 4)
                model = rng.choice(models)
                got = await asyncio.gather(
                    *[one(model, PROMPTS[0], "plain", BURST_TOKENS) for _ in range(BURST)], return_exceptions=True
                )
                bad = [g for g in got if g is not None and not isinstance(g, _Exhausted)]
                assert not bad, bad[:3]
                burst_exhausted.append(sum(isinstance(g, _Exhausted) for g in got))

        async def sample() -> None:
            while time.monotonic() < end:
                for p in (system.st, *system.w, system.r):
                    k = vm_rss_kib(p.popen.pid)
                    if k is not None:
                        samples[p.name].append((time.monotonic() - t0, k))
                await asyncio.sleep(1.0)

        await asyncio.gather(*[client(i) for i in range(CLIENTS)], bursts(), sample())

        churn = await loads() - loads_before
        assert churn >= 10, f"only {churn} loads: the workload did not make eviction churn"
        # nothing left behind
        workers = [WorkerClient(w.address) for w in system.w]
        try:

            async def idle():
                sts = [await w.status() for w in workers]
                models_ = await r.list_models()
                return all(s.running == 0 and s.waiting == 0 and s.kv_tokens_used == 0 for s in sts) and all(
                    m.in_flight == 0 for m in models_
                )

            await wait_for(idle, timeout=30, what="workers and router idle after the soak")
            for w in workers:
                s = await w.status()
                assert s.delta_used_bytes <= s.delta_budget_bytes
        finally:
            for w in workers:
                await w.close()

    for p in (system.st, *system.w, system.r):
        assert p.alive(), f"{p.name} died during the soak"
        TALLY.rss(f"system/{p.name}", p.popen.pid)
    TALLY.notes.append(
        f"soak {SOAK_S:.0f} s: {outcome}; bursts of {BURST}: RESOURCE_EXHAUSTED {burst_exhausted}; "
        f"{churn} delta loads (eviction churn)"
    )
    assert outcome["correct"] > 0 and burst_exhausted and all(n > 0 for n in burst_exhausted), (
        "bursts past the queue bounds must be refused, not queued"
    )
    # RSS flat after warm-up
    lines = []
    for name, xs in samples.items():
        after = [k for t, k in xs if t >= SOAK_S / 4]
        if len(after) < 6:
            continue
        third = len(after) // 3
        early, late = statistics.mean(after[:third]), statistics.mean(after[-third:])
        growth = late - early
        lines.append(f"{name}: {early / 1024:.1f} -> {late / 1024:.1f} MiB")
        assert growth <= max(16 * 1024, 0.05 * early), f"{name}: RSS grew {growth / 1024:.1f} MiB after warm-up"
    TALLY.notes.append("soak RSS (mean after warm-up, first third -> last third): " + "; ".join(lines))


class _Exhausted(Exception):
    pass
