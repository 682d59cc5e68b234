"""The gpu_worker service end to end: a real server on a loopback port, a tiny
random family (real checkpoints and delta files), real gRPC clients.

Correctness is checked against independent references: transformers'
LlamaForCausalLM for the base, and the dense checkpoint W_base + α·S
(`bitdelta.compress.apply`) run through `bitdelta.model` for every variant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from tests.support.worker import drain_and_stop, offline_generate, running_worker, start_worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_kernels")]

N = 16  # new tokens per generation: enough to see divergence, cheap on 2 shared cores
PROMPTS = ["Hello world", "The quick brown fox", "abc xyz", "def f(x):"]
EOS = 256
T = 60  # deadline (s) of every client call in these tests


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("worker_family"), n_variants=3)


@pytest.fixture(scope="module")
def tok(family):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(family.base / "tokenizer.json"))


def config(family, **kw) -> WorkerConfig:
    kw.setdefault("delta_budget", 4 << 20)
    kw.setdefault("kv_cache", 4 << 20)
    return WorkerConfig(base=family.base, delta_dir=str(family.deltas), **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(family):
    async with running_worker(config(family)) as (worker, server, channel):
        yield worker, pb_grpc.GpuWorkerServiceStub(channel), channel


async def generate(stub, model_id, prompt, n=N, timeout=T, **sampling) -> tuple[list[int], str, list]:
    """Token ids, text and the stream's messages (each holds the tokens ready when it was written)."""
    msgs = []
    call = stub.Generate(
        pb.GenerateRequest(
            model_id=model_id, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=n, **sampling)
        ),
        timeout=timeout,
    )
    async for m in call:
        msgs.append(m)
    toks = [t for m in msgs for t in m.tokens]
    return [t.token_id for t in toks], "".join(t.text for t in toks), msgs


async def status(stub) -> pb.StatusResponse:
    return await stub.Status(pb.StatusRequest(), timeout=T)


def slot(st: pb.StatusResponse, name: str) -> pb.DeltaSlot | None:
    return next((s for s in st.slots if s.name == name), None)


# -- correctness ------------------------------------------------------------------------------------


async def test_base_matches_transformers(served, family, tok):
    import torch
    from transformers import LlamaForCausalLM

    _, stub, _ = served
    hf = LlamaForCausalLM.from_pretrained(str(family.base), dtype=torch.float32).eval()
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt).ids
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
            )
        want = out[0, len(ids) :].tolist()
        got, text, msgs = await generate(stub, "", prompt)
        assert got == want
        assert len(set(got)) > 3, "the test model should not repeat one token"
        assert text == tok.decode(got, skip_special_tokens=True)
        last = msgs[-1].tokens[-1]
        assert last.finish_reason in (gen_pb.FINISH_REASON_LENGTH, gen_pb.FINISH_REASON_EOS)
        assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == len(got)
        assert msgs[0].HasField("ttft") and msgs[0].ttft.total_ms > 0 and msgs[0].ttft.prefill_ms > 0


async def test_variants_match_offline_dense_model(served, family, tok):
    _, stub, _ = served
    outs = {}
    for name, prompt in zip(family.variants, PROMPTS):
        ids = tok.encode(prompt).ids
        want = offline_generate(family.merged[name], ids, N, EOS)
        got, _, msgs = await generate(stub, name, prompt)
        assert got == want, name
        outs[name] = got
    base_out = (await generate(stub, "", PROMPTS[0]))[0]
    assert outs["v0"] != base_out, "a variant must not generate what the base generates"


async def test_mixed_batch_equals_alone(served):
    worker, stub, _ = served
    jobs = [("", PROMPTS[0])] + [(v, p) for v, p in zip(("v0", "v1", "v2"), PROMPTS[1:])]
    alone = [(await generate(stub, m, p))[0] for m, p in jobs]
    steps0 = worker.engine.steps
    together = await asyncio.gather(*[generate(stub, m, p) for m, p in jobs])
    assert [t[0] for t in together] == alone
    # They really shared steps: far fewer steps than tokens generated.
    assert worker.engine.steps - steps0 < sum(len(a) for a in alone) * 0.6


# -- sampling -----------------------------------------------------------------------------------------


async def test_sampling_seed_top_p_stop_and_max_tokens(served, tok):
    _, stub, _ = served
    a = (await generate(stub, "v1", PROMPTS[1], temperature=1.0, seed=42))[0]
    b = (await generate(stub, "v1", PROMPTS[1], temperature=1.0, seed=42))[0]
    c = (await generate(stub, "v1", PROMPTS[1], temperature=1.0, seed=43))[0]
    greedy, gtext, _ = await generate(stub, "v1", PROMPTS[1])
    assert a == b
    assert a != c or a != greedy
    # top_p so small that only the most likely token survives: greedy, whatever the seed
    assert (await generate(stub, "v1", PROMPTS[1], temperature=1.0, top_p=1e-6, seed=5))[0] == greedy
    # a stop string cut out of the greedy text: the output ends right before it
    stop = gtext[6:9]
    assert len(stop) == 3 and gtext.find(stop) == 6
    got, text, msgs = await generate(stub, "v1", PROMPTS[1], stop=[stop, "never-produced"])
    assert text == gtext[:6]
    assert msgs[-1].tokens[-1].finish_reason == gen_pb.FINISH_REASON_STOP
    # max tokens
    got, _, msgs = await generate(stub, "v1", PROMPTS[1], n=5)
    assert got == greedy[:5] and msgs[-1].tokens[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert msgs[-1].tokens[-1].usage.completion_tokens == 5


# -- cancellation, deadlines, KV budget ----------------------------------------------------------------


async def wait_idle(stub, timeout=10.0) -> pb.StatusResponse:
    t = time.monotonic()
    while True:
        st = await status(stub)
        if (st.running == 0 and st.waiting == 0 and st.kv_tokens_used == 0) or time.monotonic() - t > timeout:
            return st
        await asyncio.sleep(0.02)


async def test_cancel_and_deadline_free_the_kv_cache(served):
    _, stub, _ = served
    call = stub.Generate(
        pb.GenerateRequest(model_id="v0", prompt=PROMPTS[0], sampling=gen_pb.SamplingParams(max_new_tokens=200)),
        timeout=T,
    )
    got = 0
    async for m in call:
        got += len(m.tokens)
        if got >= 2:
            st = await status(stub)
            assert st.running == 1 and st.kv_tokens_used > 0
            call.cancel()
            break
    st = await wait_idle(stub)
    assert (st.running, st.waiting, st.kv_tokens_used) == (0, 0, 0)
    assert slot(st, "v0").state == pb.DELTA_STATE_RESIDENT


async def test_deadline_ends_a_running_sequence_and_frees_its_kv(tmp_path):
    # A base with a 4096-token context and no EOS, so a generation outlives a short deadline.
    from bitdelta.testing.family import VARIED_STD, make_base, tiny_args

    base = make_base(
        tmp_path / "long",
        tiny_args(max_seq_len=4096, dim=256, n_layers=4, intermediate_size=688, eos_token_id=None),
        seed=3,
        std=VARIED_STD,
    )
    async with running_worker(WorkerConfig(base=base, kv_cache=16 << 20)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        got = []
        call = stub.Generate(
            pb.GenerateRequest(prompt="Hello", sampling=gen_pb.SamplingParams(max_new_tokens=4000)), timeout=0.5
        )
        try:
            async for m in call:
                got.extend(m.tokens)
            # the engine noticed the deadline first and ended the stream itself
            assert got[-1].finish_reason == gen_pb.FINISH_REASON_CANCELLED
        except grpc.aio.AioRpcError as e:  # or gRPC did
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0 < len(got) < 4000
        st = await wait_idle(stub)
        assert (st.running, st.waiting, st.kv_tokens_used) == (0, 0, 0)


async def test_sequences_that_do_not_fit_wait(family):
    # KV cache for ~1.3 sequences of 5 + 48 tokens: the others wait, none is dropped.
    import torch

    from bitdelta.testing.family import tiny_args
    from services.gpu_worker.runner import KVPool

    per_token = KVPool.bytes_per_token(tiny_args(), torch.float32)
    cfg = config(family, kv_cache=per_token * 80, block_size=16)  # 5 blocks; one sequence needs 4
    async with running_worker(cfg) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        alone = (await generate(stub, "v0", "Hello", n=48))[0]
        seen_waiting = 0

        async def watch():
            nonlocal seen_waiting
            while True:
                st = await status(stub)
                seen_waiting = max(seen_waiting, st.waiting)
                assert st.kv_tokens_used <= st.kv_tokens_total
                await asyncio.sleep(0.005)

        w = asyncio.create_task(watch())
        outs = await asyncio.gather(*[generate(stub, "v0", "Hello", n=48) for _ in range(3)])
        w.cancel()
        assert all(o[0] == alone for o in outs)
        assert seen_waiting >= 1
        st = await wait_idle(stub)
        assert st.kv_tokens_used == 0


# -- delta lifecycle -----------------------------------------------------------------------------------


async def test_load_is_idempotent_and_coalesced(family):
    async with running_worker(config(family)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        rs = await asyncio.gather(*[stub.LoadDelta(pb.LoadDeltaRequest(name="v1"), timeout=T) for _ in range(5)])
        assert worker.manager.loads_started == 1
        assert all(r.slot.state == pb.DELTA_STATE_RESIDENT and r.slot.bytes > 0 for r in rs)
        again = await stub.LoadDelta(pb.LoadDeltaRequest(name="v1"), timeout=T)
        assert again.load_ms == 0 and worker.manager.loads_started == 1
        # Evict is idempotent too
        assert (await stub.EvictDelta(pb.EvictDeltaRequest(name="v1"), timeout=T)).state == pb.DELTA_STATE_ABSENT
        assert (await stub.EvictDelta(pb.EvictDeltaRequest(name="v1"), timeout=T)).state == pb.DELTA_STATE_ABSENT
        assert slot(await status(stub), "v1") is None


async def test_budget_is_bytes_and_eviction_follows_the_policy(family):
    from bitdelta.format import read_header

    async with running_worker(config(family)) as (w0, _, _):
        size = w0.layout.slot_bytes + sum(  # what one tiny delta costs: its slot plus its dense embedding
            w0.layout.extra_bytes(t.param, t.role, t.shape)
            for t in read_header(family.delta_path("v0")).tensors
            if t.param in ("model.embed_tokens.weight", "lm_head.weight")
        )
    async with running_worker(config(family, delta_budget=2 * size + size // 2)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        await generate(stub, "v0", "a", n=2)
        await generate(stub, "v1", "a", n=2)
        for _ in range(3):  # v0 is the hot one
            await generate(stub, "v0", "a", n=1)
        st = await status(stub)
        assert {s.name for s in st.slots if s.state == pb.DELTA_STATE_RESIDENT} == {"v0", "v1"}
        expected = worker.manager.policy.plan("v2", size, time.monotonic())
        assert expected == ["v1"]
        await stub.LoadDelta(pb.LoadDeltaRequest(name="v2"), timeout=T)
        st = await status(stub)
        assert {s.name for s in st.slots if s.state == pb.DELTA_STATE_RESIDENT} == {"v0", "v2"}
        assert st.delta_used_bytes <= st.delta_budget_bytes
        # pinned deltas stay; with everything pinned a newcomer is refused, clearly
        await stub.LoadDelta(pb.LoadDeltaRequest(name="v2", pin=True), timeout=T)
        await stub.LoadDelta(pb.LoadDeltaRequest(name="v0", pin=True), timeout=T)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadDelta(pb.LoadDeltaRequest(name="v1"), timeout=T)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "pinned" in e.value.details()
        assert worker.manager.peak_used_bytes <= worker.manager.budget_bytes
        # the variants still generate what they generated alone
        assert (await generate(stub, "v2", PROMPTS[3]))[0] == offline_generate(
            family.merged["v2"], list(PROMPTS[3].encode()), N, EOS
        )


async def test_more_variants_at_once_than_the_budget_holds_all_complete(family):
    """Three concurrent requests for three variants with room for one delta: the
    later loads wait for the earlier requests to finish, none is refused."""
    from bitdelta.format import read_header

    async with running_worker(config(family)) as (w0, _, _):
        size = w0.layout.slot_bytes + sum(
            w0.layout.extra_bytes(t.param, t.role, t.shape)
            for t in read_header(family.delta_path("v0")).tensors
            if t.param in ("model.embed_tokens.weight", "lm_head.weight")
        )
    async with running_worker(config(family, delta_budget=size + size // 2)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        outs = await asyncio.gather(*[generate(stub, f"v{i}", PROMPTS[3], n=4) for i in range(3)])
        for i, (ids, _, _) in enumerate(outs):
            assert ids == offline_generate(family.merged[f"v{i}"], list(PROMPTS[3].encode()), 4, EOS)
        assert worker.manager.peak_used_bytes <= worker.manager.budget_bytes
        assert worker.manager.loads_started == 3


async def test_evicting_a_delta_in_use_waits_for_its_sequences(served):
    _, stub, _ = served
    # long enough that the eviction arrives while it runs, on a machine busy with other tests too
    alone = (await generate(stub, "v2", PROMPTS[2], n=160))[0]
    call = stub.Generate(
        pb.GenerateRequest(model_id="v2", prompt=PROMPTS[2], sampling=gen_pb.SamplingParams(max_new_tokens=160)),
        timeout=T,
    )
    toks = []
    async for m in call:
        toks.extend(t.token_id for t in m.tokens)
        if len(toks) == len(m.tokens):  # after the first message
            r = await stub.EvictDelta(pb.EvictDeltaRequest(name="v2"), timeout=T)
            assert r.state == pb.DELTA_STATE_EVICTING
    assert toks == alone  # the running sequence finished on its delta
    st = await wait_idle(stub)
    assert slot(st, "v2") is None


async def test_wrong_base_and_bad_checksum_are_refused_and_serving_goes_on(served, family):
    _, stub, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.LoadDelta(pb.LoadDeltaRequest(name=family.other_base), timeout=T)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.LoadDelta(pb.LoadDeltaRequest(name=family.corrupt), timeout=T)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert "sha256 mismatch" in e.value.details() and ".sign" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:  # Generate on it fails the same way
        await generate(stub, family.corrupt, "x")
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    st = await status(stub)
    assert slot(st, family.corrupt).state == pb.DELTA_STATE_FAILED and "sha256" in slot(st, family.corrupt).error
    assert slot(st, family.other_base).state == pb.DELTA_STATE_FAILED
    assert st.delta_used_bytes == sum(s.bytes for s in st.slots)  # failed loads hold no bytes
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, "no-such-variant", "x")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # still serving, base and variants
    assert len((await generate(stub, "", "x", n=3))[0]) == 3
    assert len((await generate(stub, "v0", "x", n=3))[0]) == 3


async def test_loading_does_not_stall_generation(family):
    """A slow load (a throttled file source) runs while a resident variant keeps generating."""
    from services.gpu_worker.sources import LocalDeltaSource

    class SlowSource(LocalDeltaSource):
        async def stream(self, info, sink):
            await asyncio.sleep(1.5)
            await super().stream(info, sink)

    async with running_worker(config(family)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        await generate(stub, "v0", "a", n=1)
        worker.manager.source = SlowSource(family.deltas)

        async def load_v1():
            return await stub.LoadDelta(pb.LoadDeltaRequest(name="v1"), timeout=T)

        load = asyncio.create_task(load_v1())
        await asyncio.sleep(0.05)
        assert slot(await status(stub), "v1").state == pb.DELTA_STATE_LOADING
        t = time.monotonic()
        await generate(stub, "v0", PROMPTS[0], n=8)
        assert not load.done(), f"generation took {time.monotonic() - t:.2f}s; it should not wait for the load"
        assert (await load).slot.state == pb.DELTA_STATE_RESIDENT


# -- service lifecycle ---------------------------------------------------------------------------------


async def test_health_reflection_and_drain(family):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from services.gpu_worker.server import create_server
    from services.gpu_worker.worker import Worker

    worker = Worker(dataclasses.replace(config(family), address="127.0.0.1:0"))
    server = create_server(worker, "127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        svc = "bitdelta.gpu_worker.v1.GpuWorkerService"
        r = await health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=T)
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING  # base not loaded yet
        stub = pb_grpc.GpuWorkerServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "", "x", n=1)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        watch = health.Watch(health_pb2.HealthCheckRequest(service=svc), timeout=T)  # streaming health works
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await start_worker(worker, server)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        r = await health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=T)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        alone = (await generate(stub, "", PROMPTS[0], n=30))[0]
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        names = []
        async for resp in refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=T
        ):
            names = [s.name for s in resp.list_services_response.service]
        assert svc in names
        # drain: health goes NOT_SERVING and is still answered (a probe sees NOT_SERVING, not "failed to
        # connect"), new requests are refused, a running stream finishes within the grace period. Each
        # step of the stream takes 20 ms more from here, so that it is still running while the checks
        # below ask (this model's steps take well under a millisecond: its 30 tokens could end first),
        # one step a call (no decode bursts, whose steps run in one call)
        forward = worker.runner.forward
        worker.runner.forward = lambda *a, **kw: time.sleep(0.02) or forward(*a, **kw)
        worker.runner.decode_steps = lambda *a, **kw: None
        call = stub.Generate(
            pb.GenerateRequest(prompt=PROMPTS[0], sampling=gen_pb.SamplingParams(max_new_tokens=30)), timeout=T
        )
        first = await call.read()
        stopper = asyncio.create_task(drain_and_stop(worker, server, grace_s=20))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        r = await health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=T)
        assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "", "x", n=1)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
        st = await status(stub)  # Status stays open while draining, and says so
        assert st.draining and st.ready
        rest = []
        while (m := await call.read()) is not grpc.aio.EOF:
            rest.append(m)
        assert [t.token_id for m in (first, *rest) for t in m.tokens] == alone
        assert rest[-1].tokens[-1].finish_reason in (gen_pb.FINISH_REASON_LENGTH, gen_pb.FINISH_REASON_EOS)
        watch.cancel()
        await stopper


async def test_invalid_requests(served):
    _, stub, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, "", "x", temperature=-1.0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, "", "x" * 300)  # longer than the model's 256-token context
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.LoadDelta(pb.LoadDeltaRequest(name="../etc/passwd"), timeout=T)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
