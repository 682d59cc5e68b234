"""Decode bursts (`--decode-burst-ms`): a batch of plain greedy decodes runs several steps in one C
call, each row's argmax fed back in C. Through a real worker on CPU: the tokens, texts and finish
reasons are those of single steps (base and variant rows, EOS, stop strings, max_new_tokens), a
batch that needs the Python sampler (seeded sampling, logprobs) takes single steps, and a request
or a cancel that arrives ends a burst (`Interrupt`)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bitdelta.generation import Request, Sampling
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.scheduler import BlockAllocator, Scheduler, SeqState
from services.gpu_worker.worker import Worker

pytestmark = pytest.mark.usefixtures("cpu_kernels")

JOBS = [("", "The quick brown fox"), ("v0", "Hello world, again"), ("v1", "abc xyz 123"), ("v0", "def f(x):")]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("bursts"), n_variants=2, merged=False)


async def _run(family, burst_ms: float, samplings: list[Sampling], times: list | None = None, jobs=JOBS):
    """Every job of `jobs` with its sampling at once -> ([(token ids, text, finish reason)], engine);
    each job's tokens' elapsed_ms appended to `times`."""
    cfg = WorkerConfig(base=family.base, delta_dir=str(family.deltas), kv_cache=4 << 20, decode_burst_ms=burst_ms)
    w = Worker(cfg)
    await w.start()
    try:

        async def gen(m, p, sp):
            events = [e async for e in w.generate(Request(m, p, sp))]
            if times is not None:
                times.append([e.elapsed_ms for e in events])
            return [e.token_id for e in events], "".join(e.text for e in events), events[-1].finish_reason

        out = await asyncio.wait_for(asyncio.gather(*[gen(m, p, sp) for (m, p), sp in zip(jobs, samplings)]), 300)
        return out, w.engine
    finally:
        await w.close()


def test_a_burst_takes_blocks_for_every_sequence_or_none():
    sched = Scheduler(BlockAllocator(5), block_size=4, max_running=8, max_batch_tokens=64)
    a, b = SeqState(1, [1] * 3, max_new=20, slot=-1), SeqState(2, [2] * 4, max_new=20, slot=-1)
    sched.add(a)
    sched.add(b)
    for w in sched.schedule():  # the prompts: a block each
        sched.advance(w.seq, w.n_tokens)
    assert (len(a.blocks), len(b.blocks), sched.allocator.n_free) == (1, 1, 3)
    assert sched.reserve([a, b], 4)  # positions 3..6 and 4..7: a second block each
    assert (len(a.blocks), len(b.blocks), sched.allocator.n_free) == (2, 2, 1)
    assert not sched.reserve([a, b], 8)  # a third block each: one is free, so neither takes it
    assert (len(a.blocks), len(b.blocks), sched.allocator.n_free) == (2, 2, 1)
    assert sched.reserve([a], 8) and (len(a.blocks), sched.allocator.n_free) == (3, 0)


def test_bursts_give_the_tokens_of_single_steps(family):
    samplings = [
        Sampling(max_new_tokens=40, ignore_eos=True),
        Sampling(max_new_tokens=37),  # may end at EOS
        Sampling(max_new_tokens=40),
        Sampling(max_new_tokens=5, ignore_eos=True),
    ]
    free, _ = asyncio.run(_run(family, 0, samplings))
    text = free[2][1]
    samplings[2] = Sampling(max_new_tokens=40, stop=(text[len(text) // 2 : len(text) // 2 + 2],))  # ends mid-way
    single, e1 = asyncio.run(_run(family, 0, samplings))
    times: list[list[float]] = []
    burst, e2 = asyncio.run(_run(family, 1000, samplings, times))
    # the family's variants change their (tied) embedding densely, a head the C call does not take:
    # a batch with one of them takes single steps, so how many bursts the mixed run makes depends on
    # when its jobs end (the base's alone, at the end, burst); the base's jobs alone always do
    base_only = [("", p) for _, p in JOBS]
    alone, e3 = asyncio.run(_run(family, 1000, samplings, jobs=base_only))
    assert e1.bursts == 0 and e3.bursts > 0, "bursts ran only where asked"
    assert alone == asyncio.run(_run(family, 0, samplings, jobs=base_only))[0]
    assert burst == single
    for ms in times:  # each token stamped when its step picked it, not when the burst ended
        assert all(a < b for a, b in zip(ms, ms[1:]))
    assert [len(t) for t, _, _ in single][0::3] == [40, 5]
    assert single[2][2].name == "STOP" and len(single[2][0]) < len(free[2][0])


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(max_new_tokens=12, ignore_eos=True, logprobs=2),
        Sampling(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=3),
        Sampling(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    ],
    ids=["logprobs", "seeded", "penalty"],
)
def test_sequences_that_need_the_sampler_take_single_steps(family, sampling):
    single, _ = asyncio.run(_run(family, 0, [sampling] * 4))
    burst, engine = asyncio.run(_run(family, 1000, [sampling] * 4))
    assert engine.bursts == 0 and burst == single


def test_a_request_or_a_cancel_ends_a_burst_after_its_step(family):
    """The engine's burst calls are held at a gate (before the C call) while a request arrives, and
    later while the stream is cancelled: each such burst then runs one step."""

    async def run():
        cfg = WorkerConfig(base=family.base, delta_dir=str(family.deltas), kv_cache=4 << 20, decode_burst_ms=5000)
        w = Worker(cfg)
        await w.start()
        eng, real = w.engine, w.runner.decode_steps
        gates = {1: threading.Event(), 3: threading.Event()}  # the calls held: the first, the third
        calls: list[tuple[int, int]] = []  # (steps asked, steps run)

        def gated(work, steps, interrupt, deadline, ready):
            n = len(calls) + 1
            if n in gates:
                ready()  # the last step's tokens go to the streams (the engine's hand-over) first
                assert gates[n].wait(30)
            out = real(work, steps, interrupt, deadline, ready)
            calls.append((steps, 0 if out is None else len(out.times)))  # None: not a batch it takes
            return out

        w.runner.decode_steps = gated
        try:
            long = w.generate(Request("", "Hello", Sampling(max_new_tokens=240, ignore_eos=True)))
            await long.__anext__()  # prefilled: the engine is now held in its first burst
            short = asyncio.create_task(
                _collect(w.generate(Request("", "abc", Sampling(max_new_tokens=4, ignore_eos=True))))
            )
            while eng.waiting == 0:
                await asyncio.sleep(0.001)
            assert eng.interrupt.is_set()
            gates[1].set()
            assert len(await asyncio.wait_for(short, 60)) == 4
            assert calls[0][0] > 1 and calls[0][1] == 1, "the arrival ended the first burst after one step"
            while len(calls) < 2:  # the second burst ran (nothing arrived: it was not cut short)
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)  # the third is held now
            await long.aclose()  # the client goes: a cancel
            gates[3].set()
            for _ in range(500):
                if eng.running == 0:
                    break
                await asyncio.sleep(0.01)
            assert eng.running == 0 and w.status().kv_tokens_used == 0
            assert calls[2][0] > 1 and calls[2][1] == 1, "the cancel ended the third burst after one step"
            assert eng.steps < 200, "the long stream ended at its cancel"
        finally:
            for g in gates.values():
                g.set()
            await w.close()

    asyncio.run(run())


async def _collect(events):
    return [e async for e in events]


@pytest.mark.parametrize("member", ["gemma2", "gemma3", "granite", "olmo2"])
def test_other_families_bursts_give_the_tokens_of_torchs_layers(tmp_path, member):
    """Gemma's and Granite's decode rows in the C layers, in bursts (Gemma 3's sliding layers reading
    their own rope rows of the cached tables; the embeddings of token ids scaled in C), give the tokens
    of the layer-by-layer torch path (backend "torch": no C call), fp32, past the windows of 8."""
    from tests.support.archs import make_hf_base

    base = make_hf_base(tmp_path / "base", member, seed=6)
    (tmp_path / "deltas").mkdir()
    jobs = [("", "The quick brown fox"), ("", "Hello world, again and again"), ("", "abc")]
    samplings = [Sampling(max_new_tokens=24, ignore_eos=True)] * 3

    async def run(**kw):
        cfg = WorkerConfig(base=base, delta_dir=str(tmp_path / "deltas"), kv_cache=4 << 20, dtype="float32", **kw)
        w = Worker(cfg)
        await w.start()
        try:
            outs = await asyncio.gather(
                *[_collect(w.generate(Request(m, p, sp))) for (m, p), sp in zip(jobs, samplings)]
            )
            return [[e.token_id for e in out] for out in outs], w.engine.bursts
        finally:
            await w.close()

    torch_steps, _ = asyncio.run(run(kernel_backend="torch"))
    burst, n = asyncio.run(run(decode_burst_ms=1000))
    assert n > 0 and burst == torch_steps
    assert all(len(t) == 24 for t in burst) and len({tuple(t) for t in burst}) == 3
