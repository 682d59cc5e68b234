"""The worker loading deltas from a real delta_store server on a loopback port."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from tests.support.worker import offline_generate, running_worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_kernels")]
T = 60
N = 12


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_test_family(tmp_path_factory.mktemp("worker_store_family"), n_variants=2)


@pytest_asyncio.fixture(
    scope="module", loop_scope="module", params=["store-verifies", "worker-verifies", "shared-memory"]
)
async def store(family, request, tmp_path_factory):
    """A delta_store over the family's delta directory: it verifies and the worker checks crc32s; with
    verify_reads off, the worker checks sha256s too; with its host cache in shared memory, the worker
    copies the bytes out of it (same host) instead of receiving them."""
    from services.delta_store.config import Config
    from services.delta_store.server import create_server

    shared = request.param == "shared-memory"
    config = Config(
        address="127.0.0.1:0",
        root=family.deltas,
        verify_reads=request.param != "worker-verifies",
        cache_bytes=64 << 20 if shared else 0,
        shared_memory_dir=tmp_path_factory.mktemp("shm") if shared else None,
    )
    config.check()
    server, store = create_server(config)
    await server.start()
    yield f"127.0.0.1:{server.port}", config.verify_reads, store
    await server.stop(0)
    await store.close()


async def generate(stub, model_id, prompt, n=N):
    req = pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=n))
    return [t.token_id async for m in stub.Generate(req, timeout=T) for t in m.tokens]


async def test_load_from_the_delta_store_and_generate(store, family):
    store, store_verifies, delta_store = store
    cfg = WorkerConfig(base=family.base, delta_store=store, delta_budget=4 << 20, kv_cache=4 << 20)
    async with running_worker(cfg) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        r = await stub.LoadDelta(pb.LoadDeltaRequest(name="v1"), timeout=T)
        assert r.slot.state == pb.DELTA_STATE_RESIDENT and r.load_ms > 0
        for name, prompt in (("v1", "Hello world"), ("v0", "def f(x):")):  # v0 loads on first use
            want = offline_generate(family.merged[name], list(prompt.encode()), N, 256)
            assert await generate(stub, name, prompt) == want
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadDelta(pb.LoadDeltaRequest(name=family.other_base), timeout=T)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadDelta(pb.LoadDeltaRequest(name=family.corrupt), timeout=T)
        # the store refuses it (DATA_LOSS) or, not verifying reads, streams it and the worker's sha256 check fails
        assert e.value.code() == grpc.StatusCode.DATA_LOSS, e.value.details()
        if not store_verifies:
            assert "sha256 mismatch" in e.value.details() and ".sign" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadDelta(pb.LoadDeltaRequest(name="missing"), timeout=T)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        st = await stub.Status(pb.StatusRequest(), timeout=T)
        states = {s.name: s.state for s in st.slots}
        assert states["v0"] == states["v1"] == pb.DELTA_STATE_RESIDENT
        assert states[family.corrupt] == pb.DELTA_STATE_FAILED
        assert st.delta_used_bytes <= st.delta_budget_bytes
        assert len(await generate(stub, "", "still serving", n=3)) == 3
        shared = delta_store.cache.shared is not None
        assert delta_store.transports["shared-memory" if shared else "stream"] >= 2  # v1 and v0 at least
        assert delta_store.transports["stream" if shared else "shared-memory"] == 0
        # the worker's Status says how each resident delta arrived; a failed one names none
        transport = {s.name: s.transport for s in st.slots}
        assert transport["v0"] == transport["v1"] == ("shared-memory" if shared else "stream")
        assert transport[family.corrupt] == ""
