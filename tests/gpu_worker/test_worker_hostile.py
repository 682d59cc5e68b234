"""The worker against hostile and racing clients (issue #12): a full pinned budget, loads racing for
one slot, evict and cancel during a load, NaN sampling in a mixed batch, huge prompts, floods of
unknown ids, oversized names. Every call has a deadline, so a hang fails the test instead of
stalling it; the assertions are on status codes, messages, tokens and the manager's bookkeeping.

Real parts throughout (a tiny random family, real delta files, a real gRPC server on a loopback
port); the only stand-in is a file source whose reads wait on a gate, so a load can be caught
mid-stream.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.errors import DeltaLoadError, InvalidArgument, SamplingError
from services.gpu_worker.sources import LocalDeltaSource
from tests.support.worker import delta_device_bytes, running_worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_kernels")]

T = 30  # deadline (s) of every client call: a hang shows up as DEADLINE_EXCEEDED, not a stuck run


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    fam = make_test_family(tmp_path_factory.mktemp("hostile_family"), n_variants=3, merged=False)
    # More names at no cost: the worker finds a delta by file name, so copies are distinct deltas.
    for i in range(2):
        shutil.copy(fam.delta_path("v0"), fam.delta_path(f"w{i}"))
    for i in range(5):
        shutil.copy(fam.delta_path(fam.other_base), fam.delta_path(f"ob{i}"))
    return fam


@pytest.fixture(scope="module")
def size(family) -> int:
    return delta_device_bytes(family)


def config(family, **kw) -> WorkerConfig:
    kw.setdefault("delta_budget", 4 << 20)
    kw.setdefault("kv_cache", 4 << 20)
    return WorkerConfig(base=family.base, delta_dir=str(family.deltas), **kw)


async def generate(stub, model_id, prompt, n=4, timeout=T, **sampling) -> list[int]:
    call = stub.Generate(
        pb.GenerateRequest(
            model_id=model_id, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=n, **sampling)
        ),
        timeout=timeout,
    )
    return [t.token_id async for m in call for t in m.tokens]


async def status(stub) -> pb.StatusResponse:
    return await stub.Status(pb.StatusRequest(), timeout=T)


def slot(st: pb.StatusResponse, name: str) -> pb.DeltaSlot | None:
    return next((s for s in st.slots if s.name == name), None)


async def until(cond, timeout=10.0, what="condition"):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class GatedSource(LocalDeltaSource):
    """Delta files whose reads (on a thread, as the real source's) wait until `gate` is set."""

    def __init__(self, root):
        super().__init__(root)
        self.gate, self.reading = threading.Event(), threading.Event()

    async def stream(self, info, sink):
        def read():
            self.reading.set()
            assert self.gate.wait(T), "the test never opened the gate"
            self._read(Path(info.handle), info, sink)

        await asyncio.to_thread(read)


class TogetherSource(LocalDeltaSource):
    """Delta files whose `open` returns only once `n` opens have started, so `n` loads reach the
    budget at the same moment (the race the hostile client hit through a slower delta store)."""

    def __init__(self, root, n: int):
        super().__init__(root)
        self.n, self.started, self.all_in = n, 0, asyncio.Event()

    async def open(self, name, base_fingerprint):
        self.started += 1
        if self.started >= self.n:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), T)
        return await super().open(name, base_fingerprint)


# -- the delta budget ---------------------------------------------------------------------------------


async def test_full_pinned_budget_fails_fast_for_concurrent_loads(family, size):
    """Two pinned deltas fill the budget; two concurrent Generates for two other cold variants used to
    wait for each other until their deadline. Both, and a later one, now fail at once, naming the pins."""
    async with running_worker(config(family, delta_budget=2 * size + size // 2)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        for name in ("v0", "v1"):
            await stub.LoadDelta(pb.LoadDeltaRequest(name=name, pin=True), timeout=T)
        worker.manager.source = TogetherSource(family.deltas, n=2)
        t = time.monotonic()
        both = await asyncio.gather(generate(stub, "v2", "a"), generate(stub, "w0", "a"), return_exceptions=True)
        later = await asyncio.gather(generate(stub, "w1", "a"), return_exceptions=True)
        assert time.monotonic() - t < 10, "loads that can never fit must not wait"
        for e in both + later:
            assert isinstance(e, grpc.aio.AioRpcError), e
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert "'v0'" in e.details() and "'v1'" in e.details() and "EvictDelta" in e.details()
        assert set(worker.manager.entries) == {"v0", "v1"}  # the refused loads left nothing behind
        assert not worker.manager._wanted
        # unpinning one by evicting it makes room; the variant then serves
        worker.manager.source = LocalDeltaSource(family.deltas)
        await stub.EvictDelta(pb.EvictDeltaRequest(name="v0"), timeout=T)
        assert len(await generate(stub, "v2", "a")) == 4
        assert worker.manager.peak_used_bytes <= worker.manager.budget_bytes


async def test_two_loads_racing_for_one_slot_both_complete(family, size):
    async with running_worker(config(family, delta_budget=size + size // 2)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        a, b = await asyncio.gather(*[stub.LoadDelta(pb.LoadDeltaRequest(name=n), timeout=T) for n in ("v0", "v1")])
        assert a.slot.state == b.slot.state == pb.DELTA_STATE_RESIDENT
        assert worker.manager.loads_started == 2  # each loaded once: no ping-pong
        st = await status(stub)
        assert len([s for s in st.slots if s.state == pb.DELTA_STATE_RESIDENT]) == 1
        # and requests racing for the one slot all complete
        outs = await asyncio.gather(*[generate(stub, n, "ab") for n in ("v0", "v1", "v2", "v0")])
        assert [len(o) for o in outs] == [4, 4, 4, 4]
        assert worker.manager.peak_used_bytes <= worker.manager.budget_bytes


# -- evict and cancel during a load -----------------------------------------------------------------------


async def test_evict_during_load_aborts_every_waiter_at_once(family):
    async with running_worker(config(family)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        alone = await generate(stub, "v1", "hello", n=6)
        await stub.EvictDelta(pb.EvictDeltaRequest(name="v1"), timeout=T)
        src = worker.manager.source = GatedSource(family.deltas)
        gen = asyncio.create_task(generate(stub, "v1", "hello", n=6))
        load = asyncio.ensure_future(stub.LoadDelta(pb.LoadDeltaRequest(name="v1"), timeout=T))
        await until(src.reading.is_set, what="the load to start reading")
        assert slot(await status(stub), "v1").state == pb.DELTA_STATE_LOADING
        evict = asyncio.ensure_future(stub.EvictDelta(pb.EvictDeltaRequest(name="v1"), timeout=T))
        done, _ = await asyncio.wait({gen, load}, timeout=5)
        assert done == {gen, load}, "requests waiting on an evicted load must end at once"
        for task in (gen, load):
            e = task.exception()
            assert isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.ABORTED, e
            assert "evicted" in e.details() and "'v1'" in e.details()
        # The read thread still writes into the slot: it stays reserved (EVICTING) until the read stops.
        await asyncio.sleep(0.1)
        assert not evict.done()
        st = await status(stub)
        assert slot(st, "v1").state == pb.DELTA_STATE_EVICTING and st.delta_used_bytes == slot(st, "v1").bytes > 0
        src.gate.set()
        assert (await evict).state == pb.DELTA_STATE_ABSENT
        st = await status(stub)
        assert slot(st, "v1") is None and st.delta_used_bytes == 0
        assert sorted(worker.manager.free_slots) == list(range(worker.slots.n_slots))
        # a new request loads it anew, into clean bytes
        assert await generate(stub, "v1", "hello", n=6) == alone
        assert worker.manager.loads_started == 3


async def test_cancel_during_load_leaves_the_load_to_finish(family):
    async with running_worker(config(family)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        src = worker.manager.source = GatedSource(family.deltas)
        gen = asyncio.create_task(generate(stub, "v2", "hello"))
        await until(src.reading.is_set, what="the load to start reading")
        gen.cancel()  # the client goes away while its delta loads
        with pytest.raises(asyncio.CancelledError):
            await gen
        await until(lambda: "v2" not in worker.manager._wanted, what="the server to see the cancel")
        assert worker.manager.state_of("v2").name == "LOADING"
        src.gate.set()
        await until(lambda: worker.manager.state_of("v2").name == "RESIDENT", what="the load to finish")
        e = worker.manager.entries["v2"]
        assert e.refs == 0 and not worker.manager._wanted  # nothing leaked: it can be evicted at once
        assert (await stub.EvictDelta(pb.EvictDeltaRequest(name="v2"), timeout=T)).state == pb.DELTA_STATE_ABSENT


async def test_evict_before_the_load_task_runs(family):
    """An evict in the same loop turn as the load that it cancels (the task never started)."""
    async with running_worker(config(family)) as (worker, _, _):
        m = worker.manager
        waiter = asyncio.create_task(m.load("v0"))
        await asyncio.sleep(0)  # the waiter has created the load task, which has not run yet
        assert m.state_of("v0").name == "LOADING"
        assert (await asyncio.wait_for(m.evict("v0"), 5)).name == "ABSENT"
        with pytest.raises(Exception, match="evicted"):
            await asyncio.wait_for(waiter, 5)
        assert not m.entries and m.used_bytes == 0
        assert (await asyncio.wait_for(m.load("v0"), T)).state.name == "RESIDENT"


# -- sampling -------------------------------------------------------------------------------------------


async def collect(queue: asyncio.Queue) -> list[int] | BaseException:
    toks = []
    while True:
        ev = await asyncio.wait_for(queue.get(), T)
        if isinstance(ev, BaseException):
            return ev
        toks.append(ev.token_id)
        if ev.finish_reason is not None:
            return toks


async def test_nan_sampling_ends_its_sequence_alone_in_a_mixed_batch(family):
    """Three sequences in one batch (a variant greedy, the base sampled, the base with temperature NaN
    that got past the edge): the NaN one ends with SamplingError, the others with their own tokens."""
    from bitdelta.generation import ArrivalState, Request, Sampling
    from services.gpu_worker.engine import Sequence
    from services.gpu_worker.sampling import Sampler, TextStream
    from services.gpu_worker.scheduler import SeqState

    async with running_worker(config(family)) as (worker, _, _):

        async def solo(model_id, prompt, **kw):
            req = Request(model_id, prompt, Sampling(max_new_tokens=8, **kw))
            return [ev.token_id async for ev in worker.generate(req)]

        greedy = await solo("v0", "Hello")
        sampled = await solo("", "abc", temperature=0.8, seed=5)
        slot_v0 = await worker.manager.acquire("v0")
        queues, seqs = [], []
        for i, (name, prompt, sampler) in enumerate(
            [
                ("v0", "Hello", Sampler(Sampling())),
                (None, "abc", Sampler(Sampling(temperature=0.8, seed=5))),
                (None, "xyz", Sampler(Sampling(temperature=math.nan, seed=1))),
            ]
        ):
            ids = worker.tokenizer.encode(prompt).ids
            q = asyncio.Queue()
            queues.append(q)
            seqs.append(
                Sequence(
                    state=SeqState(10_000 + i, ids, 8, slot_v0 if name else -1),
                    sampler=sampler,
                    text=TextStream(worker.tokenizer, ids, []),
                    eos_ids=worker.eos_ids,
                    emit=q.put_nowait,
                    delta_name=name,
                    arrival=ArrivalState.RESIDENT if name else ArrivalState.BASE,
                    t_arrival=time.perf_counter(),
                )
            )
        steps = worker.engine.steps
        with worker.engine._cv:  # all three reach the engine in one inbox batch, so they share every step
            for s in seqs:
                worker.engine.submit(s)
        outs = await asyncio.gather(*[collect(q) for q in queues])
        assert outs[0] == greedy and outs[1] == sampled
        assert isinstance(outs[2], SamplingError) and "temperature=nan" in str(outs[2])
        # one batch throughout: as many steps as the longest output (one prefill step, then decodes)
        assert worker.engine.steps - steps == max(len(outs[0]), len(outs[1]))
        await until(lambda: worker.manager.entries["v0"].refs == 0, what="the slot references to be released")


async def test_bad_sampling_values_are_invalid_argument_naming_the_field(family):
    async with running_worker(config(family)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        cases = [
            ({"temperature": math.nan}, "temperature"),
            ({"temperature": math.inf}, "temperature"),
            ({"temperature": 1e-45}, "temperature"),
            ({"temperature": -1.0}, "temperature"),
            ({"temperature": 1.0, "top_p": math.nan}, "top_p"),
            ({"top_p": math.inf}, "top_p"),
            ({"top_p": 1.5}, "top_p"),
            ({"stop": ["s"] * 17}, "stop"),
            ({"stop": ["s" * 257]}, "stop"),
        ]
        for sampling, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await generate(stub, "v0", "a", **sampling)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (sampling, e.value.details())
            assert f"sampling.{field}" in e.value.details(), e.value.details()
        assert not worker.manager.entries  # refused before any delta was loaded
        assert len(await generate(stub, "", "a", temperature=1e-3, top_p=1.0)) == 4  # the edges still serve


# -- prompts, ids and names -----------------------------------------------------------------------------


async def test_prompt_limits_are_checked_before_and_after_tokenising(family):
    async with running_worker(config(family, max_prompt_bytes=64 << 10, max_prompt_tokens=10)) as (_, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "", "é" * (40 << 10))  # 40 Ki characters, 80 KiB of UTF-8
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "81920 bytes" in e.value.details() and "65536 (--max-prompt-bytes)" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "", "x" * 11)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "11 tokens" in e.value.details() and "10 (--max-prompt-tokens)" in e.value.details()
        assert len(await generate(stub, "", "x" * 10)) == 4


async def test_tokenising_a_large_prompt_does_not_block_the_loop(family):
    from bitdelta.generation import Request

    async with running_worker(config(family, max_prompt_bytes=8 << 20)) as (worker, _, _):
        gaps, stop = [], False

        async def tick():
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        t = time.perf_counter()
        with pytest.raises(InvalidArgument, match="context"):  # 2 M tokens: longer than the context
            async for _ in worker.generate(Request("", "hello world " * 175_000)):
                pass
        took = time.perf_counter() - t
        stop = True
        await ticker
        assert took > 0.3, f"tokenising took {took:.2f}s: too fast to show anything; use a longer prompt"
        # on the loop, the stall would be the whole tokenisation; off it, scheduler noise on a busy machine
        assert max(gaps) < max(0.25, took / 4), f"the loop stalled for {max(gaps):.2f}s while tokenising ({took:.2f}s)"


async def test_unknown_ids_leave_no_status_entries_and_failures_are_bounded(family, monkeypatch):
    from services.gpu_worker import manager as manager_mod

    async with running_worker(config(family)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        names = [f"unknown-{i}" for i in range(200)]
        for k in range(0, len(names), 50):
            outs = await asyncio.gather(*[generate(stub, n, "a") for n in names[k : k + 50]], return_exceptions=True)
            assert all(isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.NOT_FOUND for e in outs)
        with pytest.raises(DeltaLoadError) as e:  # the core API: the same, as a domain error
            await worker.load_delta("unknown-x")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        st = await status(stub)
        assert list(st.slots) == [] and st.ByteSize() < 500
        assert not worker.manager.entries and not worker.manager._wanted
        assert worker.manager.policy.score("unknown-0", time.monotonic()) == 0.0  # no request history either
        # Deltas that exist but fail (here: built for another base) stay visible, the latest few only.
        monkeypatch.setattr(manager_mod, "MAX_FAILED_ENTRIES", 3)
        for i in range(5):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.LoadDelta(pb.LoadDeltaRequest(name=f"ob{i}"), timeout=T)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        st = await status(stub)
        assert [(s.name, s.state) for s in st.slots] == [(f"ob{i}", pb.DELTA_STATE_FAILED) for i in (2, 3, 4)]


async def test_long_and_odd_names_are_invalid_argument_with_a_short_echo(family):
    async with running_worker(config(family)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        long = "x" * 5000
        calls = {
            "Generate": lambda n: generate(stub, n, "a"),
            "LoadDelta": lambda n: stub.LoadDelta(pb.LoadDeltaRequest(name=n), timeout=T),
            "EvictDelta": lambda n: stub.EvictDelta(pb.EvictDeltaRequest(name=n), timeout=T),
        }
        for rpc, call in calls.items():
            for bad in (long, "../etc/passwd", "a/b", "a\nb", ".hidden", "v0 "):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(bad)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, bad[:20], e.value.details()[:200])
                assert len(e.value.details()) < 400 and "letters, digits" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(long)
            assert "5000 characters" in e.value.details()
        assert not worker.manager.entries
        assert len(await generate(stub, "v0", "a")) == 4  # a good name still serves


async def test_max_new_tokens_beyond_the_context_or_the_kv_cache_is_invalid_argument(family):
    """Asked for explicitly, more tokens than the context leaves is refused naming both numbers (never
    cut short to end with `length`); a request larger than the whole KV cache can never run, so it is
    INVALID_ARGUMENT (a client retries RESOURCE_EXHAUSTED). A default is cut to both instead."""
    from bitdelta.generation import FinishReason, Request, Sampling

    kv = 64 * 2 * 2 * 2 * 16 * 4  # the tiny family's bytes per token (fp32 K and V) times 64 tokens
    async with running_worker(config(family, kv_cache=kv, block_size=16)) as (worker, _, ch):
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        assert worker.scheduler.capacity_tokens() < worker.args.max_seq_len
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "", "abc", n=300)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        d = e.value.details()
        assert d.startswith("sampling.max_new_tokens: 300") and "prompt's 3 tokens" in d and "253 of 256" in d, d
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "", "abc", n=200)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "whole KV cache" in e.value.details()
        # one that fits serves
        assert [ev async for ev in worker.generate(Request("", "abc", Sampling(max_new_tokens=40)))]
        # a default (the caller's, or the worker's own 256) is not an ask: cut to what the pool holds
        held = worker.scheduler.capacity_tokens() - 3
        for s in (Sampling(default_max_new_tokens=10_000, ignore_eos=True), Sampling(ignore_eos=True)):
            last = [ev async for ev in worker.generate(Request("", "abc", s))][-1]
            assert last.finish_reason is FinishReason.LENGTH and last.usage.completion_tokens == held
        last = [ev async for ev in worker.generate(Request("", "abc", Sampling(default_max_new_tokens=5)))][-1]
        assert last.usage.completion_tokens <= 5


async def test_a_templated_prompt_gets_no_second_bos(family, tmp_path):
    """A tokenizer that adds BOS itself (as Llama's do): a rendered chat template that wrote BOS
    (`templated`) is tokenised without another one; a plain prompt gets the tokenizer's."""
    from bitdelta.generation import Request, Sampling
    from tests.support.family import add_bos_to_tokenizer

    base = tmp_path / "base"
    shutil.copytree(family.base, base)
    bos = add_bos_to_tokenizer(base)
    async with running_worker(WorkerConfig(base=str(base), kv_cache=4 << 20)) as (worker, _, _):

        async def prompt_tokens(prompt: str, templated: bool) -> int:
            req = Request("", prompt, Sampling(max_new_tokens=1), templated=templated)
            return [ev async for ev in worker.generate(req)][-1].usage.prompt_tokens

        assert await prompt_tokens("hi", templated=False) == 3  # BOS + 2 bytes
        assert await prompt_tokens(bos + "hi", templated=False) == 4  # what a doubled BOS looks like
        assert await prompt_tokens(bos + "hi", templated=True) == 3
