"""KV on demand: sequences take blocks as they grow; when the pool runs out the last running
sequence by (priority, arrival) is preempted and recomputed later. Through the scheduler alone
(which one goes, priority order) and through a real worker (a pool too small for all running
sequences gives every request the same tokens as a large pool, greedy and seeded; with the delta
budget full of pinned deltas at the same time)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bitdelta.generation import Request, Sampling
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.scheduler import BlockAllocator, Scheduler, SeqState
from services.gpu_worker.worker import Worker
from tests.support.worker import delta_device_bytes

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def drive(sched: Scheduler, steps: int = 1000) -> list[int]:
    """Run the scheduler as the engine does (every sampled token is 7); returns the seq ids in the
    order they finished."""
    done = []
    for _ in range(steps):
        if not sched.has_work():
            return done
        work = sched.schedule()
        assert work, "no progress: nothing scheduled while sequences wait"
        for w in work:
            w.seq.computed += w.n_tokens
            assert len(w.seq.blocks) * sched.block_size >= w.seq.computed, "a token without a block"
        for w in work:
            if w.samples:
                w.seq.output.append(7)
                if len(w.seq.output) == w.seq.max_new:
                    sched.remove(w.seq.seq_id)
                    done.append(w.seq.seq_id)
        assert sched.allocator.n_free >= 0
    raise AssertionError("did not finish")


def test_a_decode_without_a_free_block_preempts_the_last_arrival():
    sched = Scheduler(BlockAllocator(4), block_size=4, max_running=8, max_batch_tokens=64)
    seqs = [SeqState(i, [i] * 4, max_new=8, slot=-1) for i in (1, 2, 3)]
    for s in seqs:
        sched.add(s)
    for w in sched.schedule():  # three prompts of one block each: 1 block left
        w.seq.computed += w.n_tokens
        w.seq.output.append(7)
    work = sched.schedule()  # each decode needs a second block: 1 and 2 get one, 3 is preempted
    assert [w.seq.seq_id for w in work] == [1, 2]
    assert sched.preemptions == 1 and seqs[2].preemptions == 1
    s3 = seqs[2]
    assert sched.waiting == [s3] and s3.computed == 0 and s3.blocks == [] and s3.output == [7]
    assert s3.pending == 5, "its prompt and the token it produced are recomputed; nothing is sampled twice"
    assert sched.allocator.n_free == 0


def test_a_tiny_pool_finishes_everything_and_priority_orders_admission():
    sched = Scheduler(BlockAllocator(6), block_size=4, max_running=8, max_batch_tokens=16)
    # 24 tokens each at most: one alone fits the pool (6 blocks), two together do not
    for i, prio in enumerate([0, 0, 1, 0, -1]):
        sched.add(SeqState(i, [i] * 6, max_new=18, slot=-1, priority=prio))
    done = drive(sched)
    assert sorted(done) == [0, 1, 2, 3, 4]
    assert done.index(4) < done.index(2), "priority -1 before priority 1"
    assert sched.preemptions > 0
    assert sched.allocator.n_free == 6


def test_a_better_priority_preempts_a_running_worse_one_but_not_an_equal_one():
    sched = Scheduler(BlockAllocator(4), block_size=4, max_running=2, max_batch_tokens=64)
    low = SeqState(1, [1] * 8, max_new=8, slot=-1, priority=5)
    same = SeqState(2, [2] * 8, max_new=8, slot=-1, priority=5)
    sched.add(low)
    sched.add(same)
    sched.schedule()  # both admitted: 4 blocks, the pool is full
    assert sched.running == [low, same]
    peer = SeqState(3, [3] * 4, max_new=4, slot=-1, priority=5)
    sched.add(peer)
    assert {w.seq.seq_id for w in sched.schedule()} == {1, 2} and sched.waiting == [peer]
    urgent = SeqState(4, [4] * 4, max_new=4, slot=-1, priority=0)
    sched.add(urgent)
    work = sched.schedule()
    assert [w.seq.seq_id for w in work if w.seq is urgent] == [4]
    assert same not in sched.running and sched.waiting[0] is same, "the later of the worse ones went"
    assert [s.seq_id for s in sched.waiting] == [2, 3], "the preempted one keeps its arrival"


def test_forks_of_a_preempted_parent_start_after_its_recompute():
    sched = Scheduler(BlockAllocator(8), block_size=4, max_running=8, max_batch_tokens=64)
    parent = SeqState(1, [1] * 6, max_new=4, slot=-1, forks=1)
    sched.add(parent)
    sched.schedule()
    assert len(parent.reserved) == 1  # its fork's copy of the partial prompt block
    sched.preempt(parent)
    assert parent.reserved == [] and sched.allocator.n_free == 8 and parent.forks == 1
    (w,) = sched.schedule()
    assert w.n_tokens == 6 and len(parent.reserved) == 1


# -- through a real worker ----------------------------------------------------------------------
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # the tiny family's fp32 K and V per token
JOBS = [("", "The quick brown fox"), ("v0", "Hello world, again"), ("v1", "abc xyz 123"), ("v0", "def f(x):")]
N = 24


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("preemption"), n_variants=2, merged=False)


async def _run(family, kv_tokens: int, sampling: Sampling, pin: bool = False, **kw):
    cfg = WorkerConfig(
        base=family.base,
        delta_dir=str(family.deltas),
        kv_cache=kv_tokens * BYTES_PER_TOKEN,
        block_size=4,
        max_batch_tokens=16,
        **kw,
    )
    w = Worker(cfg)
    await w.start()
    try:
        if pin:
            for name in ("v0", "v1"):
                await w.load_delta(name, pin=True)

        async def gen(m, p, i):
            sp = dataclasses.replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)
            return [e.token_id async for e in w.generate(Request(m, p, sp))]

        out = await asyncio.wait_for(asyncio.gather(*[gen(m, p, i) for i, (m, p) in enumerate(JOBS)]), 300)
        return out, w.scheduler.preemptions, w.status()
    finally:
        await w.close()


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(max_new_tokens=N, ignore_eos=True),
        Sampling(max_new_tokens=N, temperature=0.9, seed=11, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_pool_too_small_for_every_sequence_gives_the_same_tokens(family, sampling):
    big, big_pre, _ = asyncio.run(_run(family, 1024, sampling))
    # 48 tokens: any one request fits (prompt + 24), the four together need ~170
    small, small_pre, status = asyncio.run(_run(family, 48, sampling))
    assert big_pre == 0 and small_pre > 0, "the small pool really preempted"
    assert status.preemptions == small_pre and status.kv_tokens_used == 0
    assert all(len(t) == N for t in small)
    assert small == big


def test_no_deadlock_with_the_delta_budget_full_of_pinned_deltas(family, size):
    sampling = Sampling(max_new_tokens=N, ignore_eos=True)
    big, _, _ = asyncio.run(_run(family, 1024, sampling))
    small, pre, status = asyncio.run(_run(family, 48, sampling, pin=True, delta_budget=2 * size, max_slots=2))
    assert pre > 0 and small == big
    assert status.delta_used_bytes == status.delta_budget_bytes == 2 * size
    assert all(s.pinned for s in status.slots)


@pytest.fixture(scope="module")
def size(family) -> int:
    return delta_device_bytes(family)


def test_priority_orders_a_busy_worker(family):
    """One sequence at a time: requests queued behind a running one start by priority, then
    arrival; the first token of each tells the order."""

    async def run():
        cfg = WorkerConfig(base=family.base, delta_dir=str(family.deltas), kv_cache=4 << 20, max_running=1)
        w = Worker(cfg)
        await w.start()
        order = []
        try:

            async def gen(tag, prio, n=4, **sampling):
                sp = Sampling(max_new_tokens=n, ignore_eos=True, **sampling)
                async for e in w.generate(Request("", "Hello", sp, priority=prio)):
                    if e.ttft is not None:
                        order.append(tag)

            # holds the batch until cancelled: seeded, so it takes a step at a time (a greedy one's
            # decode bursts could end its 200 tokens before the others queued: a CI run, 2026-12-06)
            first = asyncio.create_task(gen("first", -5, n=200, temperature=0.8, seed=1))
            while not order:  # its first token came (running, it may not have reached the caller yet)
                await asyncio.sleep(0.001)
            rest = []
            for t, p in [("a", 3), ("b", 0), ("c", 3), ("d", -2)]:  # arrive in this order
                rest.append(asyncio.create_task(gen(t, p)))
                while w.engine.waiting < len(rest):
                    assert not first.done(), "the first sequence ended before the others queued"
                    await asyncio.sleep(0.001)
            assert not first.done()
            first.cancel()
            await asyncio.gather(*rest)
            return order
        finally:
            await w.close()

    order = asyncio.run(run())
    assert order == ["first", "d", "b", "a", "c"]
