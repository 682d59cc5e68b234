"""Generate's stream messages hold every token ready when they are written: a reader that keeps up
gets one token per message (the first one always alone, at once), a slow one fewer, fuller
messages with exactly the same tokens, text and logprobs; n > 1 and cancellation keep working.

A slow reader is a client whose HTTP/2 receive window is small (no BDP growth) and that sleeps
after each message: the worker's writes then wait on flow control, as they do behind any reader
slower than the model, and the tokens made meanwhile go out together.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.testing.family import VARIED_STD, make_base, make_test_family, tiny_args
from services.gpu_worker.config import WorkerConfig
from tests.support.worker import running_worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_kernels")]

T = 60  # deadline (s) of every call
PROMPT = "Hello world"
# a reader whose window holds a few messages: the sender blocks on flow control soon after it stalls
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
SLOW_S = 0.02  # the slow reader's pause after each message


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("streaming_family"), n_variants=1, merged=False)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(family):
    config = WorkerConfig(base=family.base, delta_dir=str(family.deltas), delta_budget=4 << 20, kv_cache=4 << 20)
    async with running_worker(config) as (worker, server, channel):
        slow = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=SMALL_WINDOW)
        try:
            yield worker, pb_grpc.GpuWorkerServiceStub(channel), pb_grpc.GpuWorkerServiceStub(slow)
        finally:
            await slow.close()


def request(model: str = "v0", **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_new_tokens", 200)
    sampling.setdefault("ignore_eos", True)
    return pb.GenerateRequest(model_id=model, prompt=PROMPT, sampling=gen_pb.SamplingParams(**sampling))


async def read(stub, req: pb.GenerateRequest, pause_s: float = 0.0) -> list[pb.GenerateResponse]:
    msgs = []
    async for m in stub.Generate(req, timeout=T):
        msgs.append(m)
        if pause_s:
            await asyncio.sleep(pause_s)
    return msgs


def content(msgs: list[pb.GenerateResponse]) -> list[tuple]:
    """Everything each token carries but its time."""
    return [
        (t.token_id, t.text, t.index, t.logprobs.SerializeToString(), t.finish_reason, t.usage.SerializeToString())
        for m in msgs
        for t in m.tokens
    ]


@pytest.mark.parametrize(
    "sampling",
    [
        dict(logprobs=3),  # greedy, the sampled token's logprob and 3 alternatives per token
        dict(n=3, temperature=0.8, seed=7, logprobs=2),  # three choices, interleaved in the messages
    ],
    ids=["logprobs", "n3"],
)
async def test_a_slow_reader_gets_fewer_messages_with_the_same_tokens(served, sampling):
    _, fast, slow = served
    req = request(**sampling)
    quick = await read(fast, req)
    lagging = await read(slow, req, pause_s=SLOW_S)
    n_tokens = len(content(quick))
    assert n_tokens == 200 * sampling.get("n", 1)
    assert content(lagging) == content(quick), "the same tokens, text, logprobs, choices, finishes and usage"
    assert len(lagging) < n_tokens / 2, f"{len(lagging)} messages for {n_tokens} tokens: not batched"
    for msgs in (quick, lagging):
        assert msgs[0].HasField("ttft") and len(msgs[0].tokens) == 1, "the first token goes alone"
        assert not any(m.HasField("ttft") for m in msgs[1:])
        finished = [t for m in msgs for t in m.tokens if t.finish_reason]
        assert sorted(t.index for t in finished) == list(range(sampling.get("n", 1)))
        assert all(t.usage.completion_tokens == 200 for t in finished)
    ms = [t.elapsed_ms for m in lagging for t in m.tokens if t.index == 0]
    assert ms == sorted(ms), "tokens in the order they were made"
    if sampling.get("n", 1) > 1:
        assert any(len({t.index for t in m.tokens}) > 1 for m in lagging), "choices share messages"
        assert content(quick) != content(await read(fast, request(**{**sampling, "seed": 8}))), "seeded"


async def test_a_reader_that_keeps_up_gets_the_first_token_alone_at_once(served):
    worker, fast, _ = served
    call = fast.Generate(request(max_new_tokens=200), timeout=T)
    first = await call.read()
    running = worker.engine.running  # read on the loop as the first message arrives
    assert len(first.tokens) == 1 and first.HasField("ttft") and first.ttft.total_ms > 0
    assert running == 1, "the first token reached the client while the generation was still running"
    rest = []
    while (m := await call.read()) is not grpc.aio.EOF:
        rest.append(m)
    last = rest[-1].tokens[-1]
    assert last.usage.completion_tokens == 200 and first.tokens[0].elapsed_ms < last.elapsed_ms


async def test_cancelling_a_slow_reader_mid_batch_frees_the_sequence(tmp_path):
    # a base with a 4096-token context and no EOS: the generation cannot end by itself during the test
    base = make_base(
        tmp_path / "long",
        tiny_args(max_seq_len=4096, dim=256, n_layers=4, intermediate_size=688, eos_token_id=None),
        seed=3,
        std=VARIED_STD,
    )
    async with running_worker(WorkerConfig(base=base, kv_cache=16 << 20)) as (worker, server, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=SMALL_WINDOW) as ch:
            stub = pb_grpc.GpuWorkerServiceStub(ch)
            call = stub.Generate(
                pb.GenerateRequest(prompt="Hello", sampling=gen_pb.SamplingParams(max_new_tokens=4000))
            )
            first = await call.read()
            assert len(first.tokens) == 1
            await asyncio.sleep(0.5)  # tokens pile up behind the full window
            batch = await call.read()
            while len(batch.tokens) < 2:
                batch = await call.read()
            assert len(batch.tokens) > 1, "a batched message"
            t = time.monotonic()
            call.cancel()
            while worker.engine.running or worker.scheduler.used_tokens():
                assert time.monotonic() - t < 10, "the cancelled sequence was never freed"
                await asyncio.sleep(0.005)
            produced = worker.engine.steps
            assert produced < 4000, "freed before the generation could have finished"
