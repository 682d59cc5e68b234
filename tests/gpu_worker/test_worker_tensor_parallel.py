"""One worker as two tensor-parallel ranks on gloo (services/gpu_worker/parallel.py): greedy tokens
equal the single-process worker's, alone and in one mixed batch (a tiny model with ONE KV head,
fewer than the ranks, and the real SmolLM2 family, whose 9 heads and 3 KV heads split unevenly);
one decode step's collectives; Status; a corrupt delta; kill -9 of rank 1 mid-stream; rank 1's load
span in the load's trace.

Rank 1 is a real process that rank 0 spawns (`python -m services.gpu_worker.parallel`)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bitdelta import plan
from bitdelta.checkpoint import read_config
from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.testing.cluster import Cluster
from bitdelta.testing.family import make_test_family, tiny_args
from services.gpu_worker.config import WorkerConfig
from tests.support.worker import running_worker

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("cpu_kernels")]
N = 10


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny family whose base has one KV head (replicated on both ranks), three variants."""
    return make_test_family(
        tmp_path_factory.mktemp("tp_family"), n_variants=3, args=tiny_args(n_kv_heads=1), merged=False
    )


def config(base: Path, deltas: Path, tp: int, **kw) -> WorkerConfig:
    return WorkerConfig(
        base=base, delta_dir=str(deltas), delta_budget=8 << 20, kv_cache=2 << 20, tensor_parallel=tp, **kw
    )


async def answers(cfg: WorkerConfig, prompts: dict[str, str], n: int = N, check=None):
    """Each model's greedy tokens alone, then all at once (one mixed batch); `check(worker, stub)` runs
    before the worker stops."""
    async with running_worker(cfg) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)

        async def gen(m: str, p: str) -> list[int]:
            req = pb.GenerateRequest(model_id=m, prompt=p, sampling=gen_pb.SamplingParams(max_new_tokens=n))
            return [t.token_id async for x in stub.Generate(req, timeout=300) for t in x.tokens]

        alone = {m: await gen(m, p) for m, p in prompts.items()}
        mixed = dict(zip(prompts, await asyncio.gather(*[gen(m, p) for m, p in prompts.items()])))
        if check is not None:
            await check(worker, stub, gen)
    return alone, mixed


async def test_two_ranks_with_one_kv_head_equal_one_process_and_count_the_collectives(family):
    prompts = {"": "Hello world", **{v: f"abc {v} xyz" for v in family.variants}}
    one = await answers(config(family.base, family.deltas, 1), prompts)
    seen = {}

    async def check(worker, stub, gen):
        d = worker.tp
        layers = worker.args.n_layers
        # one decode step: ONE broadcast of its metadata, the embedding's all-reduce, one all-reduce per
        # row-parallel projection (o, down) of each layer, the head's gather; nothing per variant
        want = {"broadcast": 1, "all_reduce": 1 + 2 * layers, "gather": 1}
        await gen("", "Hello world")
        seen["base"] = dict(d.last_step)
        await asyncio.gather(*[gen(m, p) for m, p in prompts.items()])  # its last step: decodes only
        seen["mixed"] = dict(d.last_step)
        assert seen == {"base": want, "mixed": want}
        st = await stub.Status(pb.StatusRequest())
        assert st.tensor_parallel == 2 and [r.rank for r in st.ranks] == [0, 1]
        assert all(r.base_bytes > 0 and r.kv_bytes > 0 for r in st.ranks)
        # rank 0 holds the most of every part (its accounting bounds both): here its half of the vocab
        assert st.ranks[0].base_bytes >= st.ranks[1].base_bytes
        # `bitdelta plan --tensor-parallel 2` per GPU = the worker's own per-rank accounting (fp32 here)
        p = plan.make_plan(read_config(family.base), variants=1, gpu_mem=1e12, gpus=2, tp=2, dtype="fp32")
        assert st.ranks[0].base_bytes == p.base_per_gpu
        assert st.ranks[0].kv_bytes == st.kv_tokens_total * p.kv_per_token_per_gpu
        per = {x.name: x.bytes for x in st.slots}
        assert per[family.variants[0]] == per[family.variants[1]] == p.delta_per_gpu  # α per row, dense embedding
        assert 0 < st.delta_used_bytes <= worker.manager.budget_bytes
        # metrics: the ranks, and the collectives between them (what the steps above counted, at least)
        from prometheus_client import generate_latest

        from services.gpu_worker.server import worker_metrics

        text = generate_latest(worker_metrics(worker).registry).decode()
        assert "bitdelta_worker_tensor_parallel_ranks 2.0" in text
        (n,) = [float(x.split()[1]) for x in text.splitlines() if x.startswith("bitdelta_worker_tp_collectives_total ")]
        assert n >= 2 * sum(want.values())

    two = await answers(config(family.base, family.deltas, 2), prompts, check=check)
    assert two == one
    assert one[0] == one[1]
    assert len({tuple(t) for t in one[0].values()}) == len(prompts)  # every model answers differently


async def test_a_corrupt_delta_is_data_loss_and_the_ranks_keep_serving(family):
    async def check(worker, stub, gen):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await gen(family.corrupt, "abc")
        assert e.value.code() == grpc.StatusCode.DATA_LOSS
        assert "model.layers" in e.value.details() or "embed" in e.value.details()  # names the tensor
        assert await gen(family.variants[0], "abc") == want

    (want,) = (await answers(config(family.base, family.deltas, 1), {family.variants[0]: "abc"}))[0].values()
    await answers(config(family.base, family.deltas, 2), {"": "abc"}, check=check)


@pytest.mark.parametrize(
    "member",
    [
        "gemma3",
        "qwen3-moe",
        "qwen2-moe",
        "ministral3-mm",
        "glm4",
        "cohere2",
        "exaone4",
        "nemotron",
        "cohere-qk",
        "olmo",
        "olmo2-1kv",
        "olmoe",
        "phi",
        "gpt-neox",
        "falcon-7b",
        "stablelm-qk",
    ],
)
async def test_family_layers_on_two_ranks_equal_one_process(tmp_path, member):
    """Gemma 3's layer on two ranks (sandwich norms, per-head q/k norms and the sliding layers' own rope
    on each rank's heads, √dim embeddings), the sparse layers of Qwen3-MoE and Qwen2-MoE (the router and
    the shared expert's gate whole on each rank, each expert's columns and the shared expert's split, one
    all-reduce per layer), Cohere 2's parallel block (the attention's and the MLP's sums all-reduced apart,
    both from the one input norm; NoPE and sliding layers), EXAONE 4's post-norms with per-head q/k norms
    on each rank's heads, Nemotron's LayerNorm biases (whole on each rank, a variant's own among them) and
    ungated MLP (its up projection's columns split alone), Command R+'s q and k norms (each rank its heads'
    weights), the q and k norms over every head of OLMo 2 and OLMoE (each rank its heads' sums of squares,
    one all-reduce of both a layer; OLMo 2's one KV head on both ranks counted once; OLMoE's q, k and v
    clipped after them, OLMo 1's as each rank projects them, its LayerNorms' implied weights) and Phi's parallel
    block and head bias (each rank its vocabulary rows): the same greedy tokens as one process, each
    variant alone and all in one batch. (Gemma 2, Mixtral, StableLM and StarCoder2 add nothing to a rank's
    split beyond these: their layers' own parts are checked on one process, test_worker_families.)"""
    from bitdelta.compress import compress
    from bitdelta.testing.family import make_finetune
    from tests.support.archs import make_hf_base

    base = make_hf_base(tmp_path / "base", member, seed=4)
    for i in range(2):
        ft = make_finetune(base, tmp_path / f"ft{i}", seed=20 + i, scale=0.02)
        compress(base, ft, tmp_path / "deltas" / f"v{i}.bitdelta.safetensors", variant=f"v{i}", progress=False)
    prompts = {"": "Hello world, hello", "v0": "abc xyz abc", "v1": "The quick brown fox"}  # past the windows of 8
    one = await answers(config(base, tmp_path / "deltas", 1), prompts)
    assert len({tuple(t) for t in one[0].values()}) == 3  # the variants really differ
    assert await answers(config(base, tmp_path / "deltas", 2), prompts) == one


async def test_real_family_on_two_ranks_equals_one_process(real_base, real_deltas):
    # SmolLM2-135M: 9 query heads in 3 GQA groups -> 2 + 1 groups; 30 layers
    prompts = {"": "The capital of France is", **{v: "def fibonacci(n):" for v in sorted(real_deltas)}}
    deltas = next(iter(real_deltas.values())).parent
    cfg = dataclasses.replace(config(real_base, deltas, 1), delta_budget=1 << 30, kv_cache=16 << 20)
    one = await answers(cfg, prompts, n=8)
    two = await answers(dataclasses.replace(cfg, tensor_parallel=2), prompts, n=8)
    differ = {
        f"{how} {m or 'base'}": {"one process": one[k][m], "two ranks": two[k][m]}
        for k, how in enumerate(("alone", "mixed"))
        for m in prompts
        if one[k][m] != two[k][m]
    }
    assert not differ, f"greedy tokens of two ranks differ from one process's: {differ}"
    assert one[0] == one[1], f"one process: alone {one[0]} but in one mixed batch {one[1]}"


async def test_a_rank_that_exits_or_never_answers_fails_the_start_saying_so():
    """Rank 0's start waits for each follower on the TCPStore (parallel._wait_for): a spawned rank
    that exits fails it at once with its exit code, one that never posts fails at
    --tp-start-timeout-s, each naming what did not happen."""
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from services.gpu_worker.parallel import _wait_for

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code 3 before rank 1 joining"):
        _wait_for(store, "joined/1", "rank 1 joining", [dead], 60)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank 1 loading its shards .* within --tp-start-timeout-s 1 s"):
            _wait_for(store, "rank/1", "rank 1 loading its shards of the base", [alive], 1)
        assert time.monotonic() - t0 < 5
        store.set("rank/1", "{}")
        _wait_for(store, "rank/1", "rank 1 loading its shards of the base", [alive], 1)  # there: returns
    finally:
        alive.kill()
        alive.wait()


def _ranks_of(pid: int) -> list[int]:
    """The pids of the ranks worker `pid` spawned."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"services.gpu_worker.parallel" in cmd:
            out.append(int(p.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    st = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(st) and st.rsplit(")", 1)[1].split()[0] != "Z"


async def test_kill9_of_rank1_mid_stream_stops_the_worker_and_the_router_uses_another(family, tmp_path):
    from bitdelta.rpc.clients.router import RouterCallError, RouterClient
    from bitdelta.rpc.clients.worker import WorkerCallError, WorkerClient

    with Cluster(tmp_path) as c:
        st = c.store(family.deltas)
        tp = c.worker(family.base, st.address, name="tp", extra=("--tensor-parallel", "2"))
        single = c.worker(family.base, st.address, name="single")
        c.wait_serving(st, tp, single)
        r = c.router([tp.address, single.address], st.address)
        c.wait_serving(r)
        (rank1,) = _ranks_of(tp.popen.pid)
        w = WorkerClient(tp.address, generate_timeout_s=60)
        router = RouterClient(r.address, generate_timeout_s=60)
        try:
            want = [t.token_id async for m in router.generate("v0", "Hello", max_new_tokens=N) for t in m.tokens]
            got, t_kill = [], None
            sampling = gen_pb.SamplingParams(max_new_tokens=200, ignore_eos=True)
            req = pb.GenerateRequest(model_id="v1", prompt="abc", sampling=sampling)
            with pytest.raises(WorkerCallError) as e:
                async for ev in w.generate(req):
                    got.append(ev.token_id)
                    if len(got) == 3:
                        os.kill(rank1, signal.SIGKILL)
                        t_kill = time.monotonic()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            assert time.monotonic() - t_kill < 30
            assert 3 <= len(got) < 200
            health = health_pb2_grpc.HealthStub(grpc.insecure_channel(tp.address))
            try:  # NOT_SERVING while it drains, then gone
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            except grpc.RpcError as gone:
                assert gone.code() == grpc.StatusCode.UNAVAILABLE
            tp.popen.wait(timeout=60)
            assert tp.popen.returncode == 1  # rank 0 exits, and says it failed
            assert not _alive(rank1) and _ranks_of(tp.popen.pid) == []  # no orphan
            for _ in range(3):  # the router sends new requests to the other worker
                try:
                    assert [
                        t.token_id async for m in router.generate("v0", "Hello", max_new_tokens=N) for t in m.tokens
                    ] == want
                except RouterCallError as retry:  # its first request may still find the dead one
                    assert retry.code == grpc.StatusCode.UNAVAILABLE
            c.restart(tp)  # a restart restores service
            c.wait_serving(tp)
            w2 = WorkerClient(tp.address, generate_timeout_s=60)
            req = pb.GenerateRequest(model_id="v0", prompt="Hello", sampling=gen_pb.SamplingParams(max_new_tokens=N))
            assert [ev.token_id async for ev in w2.generate(req)] == want
            assert (await w2.status()).tensor_parallel == 2
            await w2.close()
        finally:
            await w.close()
            await router.close()


async def test_requests_cut_before_their_first_token_by_a_kill9_complete_on_the_other_worker(family, tmp_path):
    """kill -9 of rank 1 while requests wait on its worker (--max-running 1: one streams, the others
    are queued there, no token yet): the one with tokens ends UNAVAILABLE, the router retries the
    others on the other worker and they complete with its tokens, no error."""
    from bitdelta.router.v1 import router_pb2 as rpb
    from bitdelta.rpc.clients.router import RouterCallError, RouterClient
    from bitdelta.rpc.clients.worker import WorkerClient

    v, queued = family.variants[1], 3
    with Cluster(tmp_path) as c:
        st = c.store(family.deltas)
        tp = c.worker(family.base, st.address, name="tp", extra=("--tensor-parallel", "2", "--max-running", "1"))
        single = c.worker(family.base, st.address, name="single")
        c.wait_serving(st, tp, single)
        r = c.router([tp.address, single.address], st.address)
        c.wait_serving(r)
        (rank1,) = _ranks_of(tp.popen.pid)
        w, w1 = WorkerClient(tp.address, generate_timeout_s=60), WorkerClient(single.address, generate_timeout_s=60)
        router = RouterClient(r.address, generate_timeout_s=120)
        try:
            short = gen_pb.SamplingParams(max_new_tokens=N)
            ref = pb.GenerateRequest(model_id=v, prompt="Hello", sampling=short)
            await w.load_delta(v)  # on tp only
            want = [e.token_id async for e in w.generate(ref)]  # what the single worker must answer too
            deadline = time.monotonic() + 30
            while True:  # the router places v's requests where v is resident: tp
                (m,) = [m for m in await router.list_models() if m.model_id == v]
                if list(m.resident_on) == [tp.address]:
                    break
                assert time.monotonic() < deadline, f"the router never saw {v} resident on tp only: {m}"
                await asyncio.sleep(0.2)

            async def streamed(req: rpb.GenerateRequest, first: asyncio.Event | None = None):
                got, where = [], ""
                try:
                    async for msg in router.generate_request(req):
                        where = where or msg.worker
                        got.extend(t.token_id for t in msg.tokens)
                        if first is not None and len(got) >= 3:
                            first.set()
                except RouterCallError as e:
                    return got, where, e
                return got, where, None

            long = gen_pb.SamplingParams(max_new_tokens=200, ignore_eos=True)
            started = asyncio.Event()
            streaming = asyncio.create_task(
                streamed(rpb.GenerateRequest(model_id=v, prompt="abc", sampling=long), started)
            )
            await asyncio.wait(
                [streaming, asyncio.create_task(started.wait())], timeout=60, return_when="FIRST_COMPLETED"
            )
            assert started.is_set(), (
                f"the long stream did not start: {streaming.result() if streaming.done() else 'no token in 60 s'}"
            )
            waiting = [
                asyncio.create_task(streamed(rpb.GenerateRequest(model_id=v, prompt="Hello", sampling=short)))
                for _ in range(queued)
            ]
            deadline = time.monotonic() + 30
            while (s := await w.status()).waiting < queued:  # all queued on tp behind the streaming one
                assert not streaming.done() and time.monotonic() < deadline, f"tp status: {s}"
                await asyncio.sleep(0.05)
            assert s.running == 1
            os.kill(rank1, signal.SIGKILL)
            t_kill = time.monotonic()
            got, where, err = await asyncio.wait_for(streaming, 60)
            assert where == tp.address and 3 <= len(got) < 200
            assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE, err  # tokens cannot be taken back
            assert time.monotonic() - t_kill < 30
            for got, where, err in await asyncio.wait_for(asyncio.gather(*waiting), 120):
                assert err is None, f"a request cut before its first token failed instead of moving: {err}"
                assert (where, got) == (single.address, want)
            tp.popen.wait(timeout=60)
            assert tp.popen.returncode == 1
        finally:
            await w.close()
            await w1.close()
            await router.close()


@pytest.fixture(scope="module")
def fused_family(tmp_path_factory):
    """A Phi-3 family (fused qkv_proj and gate_up_proj) whose base has one KV head: each rank's qkv
    slice is its own query rows + the k and v rows both ranks hold."""
    args = tiny_args(model_type="phi3", n_kv_heads=1, tie_embeddings=False)
    return make_test_family(tmp_path_factory.mktemp("tp_fused"), n_variants=1, args=args, merged=False)


@pytest.mark.parametrize(
    "kind, transport",
    [("llama", "stream"), ("llama", "shared-memory"), ("fused", "stream"), ("fused", "shared-memory")],
)
async def test_a_cold_load_from_the_store_moves_each_byte_once(request, tmp_path, kind, transport):
    from bitdelta.checkpoint import read_config
    from bitdelta.format import read_header
    from bitdelta.model import ModelArgs
    from bitdelta.rpc.clients.worker import WorkerClient
    from bitdelta.shard import TPLayout
    from bitdelta.testing.cluster import free_port
    from tests.support.metrics import scrape

    def served(port: int) -> float:
        return sum(v for (n, _), v in scrape(port).items() if n == "bitdelta_delta_store_served_bytes_total")

    family = request.getfixturevalue("family" if kind == "llama" else "fused_family")
    mport = free_port()
    with Cluster(tmp_path) as c:
        shm = ("--shared-memory-dir", str(tmp_path / "shm")) if transport == "shared-memory" else ()
        st = c.store(family.deltas, extra=("--metrics-address", f"127.0.0.1:{mport}", *shm))
        tp = c.worker(family.base, st.address, name="tp", extra=("--tensor-parallel", "2"))
        single = c.worker(family.base, st.address, name="single")
        c.wait_serving(st, tp, single)
        w, w1 = WorkerClient(tp.address, generate_timeout_s=60), WorkerClient(single.address, generate_timeout_s=60)
        try:
            v = family.variants[0]
            header = read_header(family.delta_path(v))
            args = ModelArgs.from_hf(read_config(family.base))
            whole = sum(t.nbytes for t in header.tensors)
            # each byte leaves the store once: the sliced tensors' parts add up to them; a part both ranks
            # hold (the norms, o/down's α, here also k and v: one KV head on both ranks) goes to rank 0 only,
            # which hands it to rank 1
            handed = {t.name: TPLayout(args, 2, 1).shared_from(t.param, t.role, tuple(t.shape)) for t in header.tensors}
            assert any(h == (0, 0) for n, h in handed.items() if "norm" in n)
            if kind == "llama":  # k_proj, v_proj: rank 1's slices are rank 0's
                assert any(h == (0, 0) for n, h in handed.items() if ".k_proj." in n)
            else:  # qkv_proj: rank 1 fetches its query rows, rank 0 hands it the k and v rows after them
                assert all(handed[n] == (0, 1) for n in handed if ".qkv_proj." in n)
            before = served(mport)
            await w.load_delta(v)  # cold: both ranks fetch their slices
            assert served(mport) - before == whole
            (slot,) = [x for x in (await w.status()).slots if x.name == v]
            assert slot.transport == transport  # through shared memory, each rank copies only its runs
            req = pb.GenerateRequest(model_id=v, prompt="Hello", sampling=gen_pb.SamplingParams(max_new_tokens=N))
            assert [e.token_id async for e in w.generate(req)] == [e.token_id async for e in w1.generate(req)]
            # a corrupt delta: DATA_LOSS naming the tensor and the rank, the worker keeps serving
            with pytest.raises(Exception) as e:
                await w.load_delta(family.corrupt)
            assert e.value.code == grpc.StatusCode.DATA_LOSS
            assert "rank" in str(e.value) and "model." in str(e.value)
            assert (await w.status()).tensor_parallel == 2
        finally:
            await w.close()
            await w1.close()


async def test_a_hung_rank_stops_the_worker_at_the_collective_timeout(family, tmp_path):
    from bitdelta.rpc.clients.worker import WorkerCallError, WorkerClient

    with Cluster(tmp_path) as c:
        st = c.store(family.deltas)
        tp = c.worker(family.base, st.address, name="tp", extra=("--tensor-parallel", "2", "--tp-timeout-s", "5"))
        c.wait_serving(st, tp)
        (rank1,) = _ranks_of(tp.popen.pid)
        w = WorkerClient(tp.address, generate_timeout_s=60)
        try:
            sampling = gen_pb.SamplingParams(max_new_tokens=200, ignore_eos=True)
            req = pb.GenerateRequest(model_id="", prompt="abc", sampling=sampling)
            got, t_stop = 0, None
            with pytest.raises(WorkerCallError) as e:
                async for _ in w.generate(req):
                    got += 1
                    if got == 3:
                        os.kill(rank1, signal.SIGSTOP)  # alive, but never answers a collective again
                        t_stop = time.monotonic()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
            assert time.monotonic() - t_stop < 5 + 10  # the timeout, not forever
            tp.popen.wait(timeout=60)
            assert tp.popen.returncode == 1
            deadline = time.monotonic() + 10
            while _alive(rank1) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not _alive(rank1)  # killed, not left stopped
        finally:
            await w.close()


async def test_torchrun_starts_the_ranks_and_they_serve_the_same_tokens(family, tmp_path):
    import subprocess
    import sys

    from bitdelta.rpc.clients.worker import WorkerClient
    from bitdelta.testing.cluster import free_port

    prompts = {"": "Hello world", family.variants[0]: "abc"}
    want, _ = await answers(config(family.base, family.deltas, 1), prompts, n=8)
    port = free_port()
    log = open(tmp_path / "torchrun.log", "wb")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
    ]
    worker = ["-m", "services.gpu_worker", "--tensor-parallel", "2", "--base", str(family.base)]
    flags = [
        "--delta-dir",
        str(family.deltas),
        "--address",
        f"127.0.0.1:{port}",
        "--kv-cache",
        "2MiB",
        "--grace-s",
        "2",
    ]
    env = {**os.environ, "BITDELTA_KERNEL_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*torchrun, *worker, *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health, deadline = health_pb2_grpc.HealthStub(ch), time.monotonic() + 120
            while True:
                assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "the torchrun worker never became SERVING"
                await asyncio.sleep(0.3)
        w = WorkerClient(f"127.0.0.1:{port}", generate_timeout_s=60)
        try:
            for m, p in prompts.items():
                req = pb.GenerateRequest(model_id=m, prompt=p, sampling=gen_pb.SamplingParams(max_new_tokens=8))
                assert [e.token_id async for e in w.generate(req)] == want[m]
            st = await w.status()
            assert st.tensor_parallel == 2 and [r.rank for r in st.ranks] == [0, 1]
        finally:
            await w.close()
    finally:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks
        proc.wait(timeout=60)
        log.close()


async def test_each_rank_load_is_a_span_in_the_load_trace(family, tmp_path):
    """Each rank's own load of its slice is a `worker.rank_load` span, exported by that rank itself
    (same OTLP endpoint), with its rank, bytes and transport: rank 0's and rank 1's are siblings
    under rank 0's load in one trace."""
    from bitdelta import traces
    from bitdelta.rpc.clients.worker import WorkerClient

    sink = traces.OtlpFileSink(tmp_path / "spans.jsonl")
    try:
        with Cluster(tmp_path) as c:
            st = c.store(family.deltas)
            otlp = ("--otlp-endpoint", f"127.0.0.1:{sink.port}")
            tp = c.worker(family.base, st.address, name="tp", extra=("--tensor-parallel", "2", *otlp))
            c.wait_serving(st, tp)
            w = WorkerClient(tp.address, generate_timeout_s=60)
            try:
                await w.load_delta(family.variants[0])
            finally:
                await w.close()
            deadline = time.monotonic() + 30  # batched exports: a second or so after the span ends
            spans: list[traces.Span] = []
            while time.monotonic() < deadline:
                spans = traces.read_file(sink.path) if sink.path.exists() else []
                if sum(s.name == "worker.rank_load" for s in spans) == 2 and any(
                    s.name == "worker.LoadDelta" for s in spans
                ):
                    break
                await asyncio.sleep(0.2)
    finally:
        sink.stop()
    (root,) = [s for s in spans if s.name == "worker.LoadDelta"]
    r0, r1 = sorted((s for s in spans if s.name == "worker.rank_load"), key=lambda s: s.attrs["rank"])
    assert (r0.attrs["rank"], r1.attrs["rank"]) == (0, 1)  # one per rank, rank 0's too
    in_trace = {s.span_id for s in spans if s.trace_id == root.trace_id and s.service == "bitdelta-worker"}
    assert r0.trace_id == r1.trace_id == root.trace_id and r1.parent_id == r0.parent_id in in_trace
    size = family.delta_path(family.variants[0]).stat().st_size
    for r in (r0, r1):
        assert r.attrs["model_id"] == family.variants[0] and r.attrs["transport"] == "stream"
        assert 0 < r.attrs["bytes"] < size
        assert r.service == "bitdelta-worker" and r.end_ns >= r.start_ns
    assert r0.attrs["bytes"] >= r1.attrs["bytes"]  # rank 0 holds the most of every part
