"""Deltas beyond one sign plane (format v3) served by the worker: a real server on a loopback port,
a tiny random family, deltas made by `bitdelta compress --planes/--rank/--budget`.

Greedy tokens of a multi-plane variant (3 planes, and 2 planes under a budget that leaves some
matrices at 1), of low-rank variants and of a one-plane variant with error-feedback signs (a v2
file) equal transformers' on the dense model `bitdelta apply` writes, alone and in one batch with a
1-plane variant and the base; what each costs the byte budget and the slots (a 1-plane delta: what
it cost before); a k-plane delta evicted, pinned and refused as one. The same on a tensor-parallel worker of two ranks (gloo, rank 1 a real process): its tokens
equal one process's, each rank's bytes are its slices', evicting a k-plane delta frees its run on
every rank, and what the worker does not serve is refused by name before any byte moves.
"""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
import pytest_asyncio
import torch

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.compress import apply, compress
from bitdelta.format import read_header
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.planes import PlaneConfig
from bitdelta.testing.family import FT_SCALE, VARIED_STD, make_base, make_finetune, tiny_args
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.runner import SeqWork
from tests.support.worker import running_worker

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.usefixtures("cpu_kernels")]

N = 16
EOS = 256
T = 60
SUFFIX = ".bitdelta.safetensors"
# name -> (compress keywords): each v3 variant of one fine-tune, and the plain one-plane BitDelta
VARIANTS = {
    "plain": {},
    "planes3": {"planes": PlaneConfig(planes=3)},
    "rank8": {"planes": PlaneConfig(rank=8)},
    "mixed2": {"planes": PlaneConfig(planes=2, rank=8)},  # budgeted below: some matrices keep 1 plane
    "signemb": {"planes": PlaneConfig(planes=2, rank=8), "embeddings": "sign"},  # the embedding too
    "colauto": {"planes": PlaneConfig(planes=2, alpha="auto")},  # each plane's axis chosen: row or column
    "col": {"planes": PlaneConfig(alpha="col")},  # one plane of column α's everywhere
    # one plane of row α's whose signs were chosen by error feedback: a v2 file like "plain"
    "feedback": {
        "planes": PlaneConfig(feedback=True),
        "calibration": torch.randint(0, 256, (6000,), generator=torch.Generator().manual_seed(5)),
    },
}
PROMPTS = {"": "Hello world", "plain": "The quick brown fox", "planes3": "abc xyz", "rank8": "def f(x):"}
PROMPTS |= {"mixed2": "Once upon", "signemb": "1 + 2 =", "colauto": "zzz", "col": "Qwerty", "feedback": "Hi there"}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("planes_family")
    base = make_base(root / "base", tiny_args(), 1, std=VARIED_STD)
    ft = make_finetune(base, root / "ft", seed=100, scale=FT_SCALE)
    deltas = root / "deltas"
    for name, kw in VARIANTS.items():
        if name == "mixed2":  # the plain file, then about half of what the second planes and their header cost
            one = read_header(deltas / f"plain{SUFFIX}")
            kw = {"planes": PlaneConfig(planes=2, rank=8, budget=one.file_size + one.bytes_by_role()["sign"] * 3 // 4)}
        compress(base, ft, deltas / f"{name}{SUFFIX}", variant=name, progress=False, **kw)
    shutil.rmtree(ft)
    parts = read_header(deltas / f"mixed2{SUFFIX}").meta.parts
    assert {len(p["axes"]) for p in parts.values()} == {1, 2}, "the budget leaves some matrices at one plane"
    assert read_header(deltas / f"planes3{SUFFIX}").meta.format_version == "3"
    axes = {a for p in read_header(deltas / f"colauto{SUFFIX}").meta.parts.values() for a in p["axes"]}
    assert {"row", "col"} <= axes, "auto chose column α's for some planes and row α's for others"
    assert read_header(deltas / f"feedback{SUFFIX}").meta.format_version == "2"
    dense = {name: apply(base, deltas / f"{name}{SUFFIX}", root / f"dense-{name}", progress=False) for name in VARIANTS}
    return base, deltas, dense


def hf_greedy(ckpt, prompt: str) -> list[int]:
    """transformers' greedy tokens of a dense checkpoint (the reference)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = list(prompt.encode())
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(ids) :].tolist()


def config(family, **kw) -> WorkerConfig:
    base, deltas, _ = family
    kw.setdefault("delta_budget", 16 << 20)
    kw.setdefault("kv_cache", 4 << 20)
    return WorkerConfig(base=base, delta_dir=str(deltas), **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(family):
    async with running_worker(config(family)) as (worker, _, channel):
        yield worker, pb_grpc.GpuWorkerServiceStub(channel)


async def generate(stub, model_id: str, prompt: str, n: int = N) -> list[int]:
    req = pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=n))
    return [t.token_id async for m in stub.Generate(req, timeout=T) for t in m.tokens]


async def logprobs(stub, model_id: str, prompt: str, n: int = N) -> list[list[float]]:
    """Each greedy token's log-probability and its 5 most likely alternatives'."""
    sp = gen_pb.SamplingParams(max_new_tokens=n, logprobs=5)
    req = pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=sp)
    return [
        [t.logprobs.sampled.logprob, *(x.logprob for x in t.logprobs.top)]
        async for m in stub.Generate(req, timeout=T)
        for t in m.tokens
    ]


def assert_close(got: list[list[float]], want: list[list[float]], tol: float = 1e-4) -> None:
    """Log-probabilities equal up to fp32 summation order (the ranks' partial sums add up in another order)."""
    worst = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert worst < tol, f"log-probabilities differ by up to {worst:.2e}"


async def status(stub) -> dict[str, pb.DeltaSlot]:
    return {s.name: s for s in (await stub.Status(pb.StatusRequest(), timeout=T)).slots}


async def test_multi_plane_and_low_rank_variants_equal_transformers_alone_and_mixed(served, family, monkeypatch):
    from bitdelta_kernels.cpu_decode import DecodeLayers

    base, _, dense = family
    worker, stub = served
    c_planes = []  # on CPU: (planes per row, fuse) of each C decode call (sign planes of row α's decode there)
    c_run = DecodeLayers.bind

    def run(self, *a, row_planes=None, fuse=False, **kw):
        c_planes.append((1 if row_planes is None else row_planes.shape[1], fuse))
        return c_run(self, *a, row_planes=row_planes, fuse=fuse, **kw)

    monkeypatch.setattr(DecodeLayers, "bind", run)  # the runner binds each call
    want = {m: hf_greedy(base if m == "" else dense[m], p) for m, p in PROMPTS.items()}
    alone = {}
    for m, p in PROMPTS.items():
        c_planes.clear()
        alone[m] = await generate(stub, m, p)
        if worker.runner.device.type == "cpu" and m in ("planes3", "mixed2", "plain"):
            # alone: the single-variant form, every plane in the weights' pass where the build has it
            assert c_planes and set(c_planes) == {({"planes3": 3, "mixed2": 2}.get(m, 1), True)}, m
    assert alone == want
    assert len({tuple(v) for v in want.values()}) == len(want), "every variant answers its own tokens"
    steps = worker.engine.steps
    together = await asyncio.gather(*[generate(stub, m, p) for m, p in PROMPTS.items()])
    assert dict(zip(PROMPTS, together)) == want
    assert worker.engine.steps - steps < sum(len(v) for v in want.values()) * 0.6, "they shared steps"
    # one prompt for every variant in one batch: each row reads its own variant's planes and factors
    same = await asyncio.gather(*[generate(stub, m, PROMPTS["planes3"]) for m in PROMPTS])
    assert same == [hf_greedy(base if m == "" else dense[m], PROMPTS["planes3"]) for m in PROMPTS]


async def test_each_plane_costs_a_slot_and_the_budget_counts_real_bytes(served, family):
    """A k-plane delta holds k slots (a contiguous run here) and costs k slots' bytes plus its
    low-rank factors (exactly the file's fp16 bytes) and embedding; a 1-plane delta costs one slot
    and its embedding, as before v3. Status says both, and its used bytes are their sum."""
    _, deltas, _ = family
    worker, stub = served
    for m in VARIANTS:
        await worker.load_delta(m)
    layout, entries = worker.layout, worker.manager.entries
    st = await status(stub)
    for m in VARIANTS:
        h = read_header(deltas / f"{m}{SUFFIX}")
        planes = max([len(p["axes"]) for k, p in h.meta.parts.items() if "layers" in k] or [1])
        extras = sum(
            layout.extra_bytes(t.param, t.role, t.shape)
            for t in h.tensors
            if t.param in ("model.embed_tokens.weight", "lm_head.weight") or t.part == "lowrank"
        )
        cols = {(p.split(".")[2], layout.proj[p].group) for p, x in h.meta.parts.items() if "col" in x["axes"]}
        for _, g in cols:  # a group with a plane of column α's: [planes, its matrices, d_in] fp32
            extras += planes * len(layout.group_rows[g]) * layout.group_shape[g][1] * 4
        e = entries[m]
        assert len(e.slots) == planes and e.slots == tuple(range(e.slots[0], e.slots[0] + planes))
        assert e.bytes == planes * layout.slot_bytes + extras, m
        assert (st[m].slots, st[m].bytes) == (planes, e.bytes)
    assert (st["plain"].slots, st["planes3"].slots, st["rank8"].slots) == (1, 3, 1)
    lowrank = read_header(deltas / f"rank8{SUFFIX}").bytes_by_role()["lowrank"]
    assert entries["rank8"].bytes - entries["plain"].bytes == lowrank > 0
    assert worker.manager.used_bytes == sum(s.bytes for s in st.values())
    held = sorted(s for e in entries.values() for s in e.slots)
    assert held == sorted(set(held)) and len(held) + len(worker.manager.free_slots) == worker.slots.n_slots
    # alone, the 3 planes are one view for the fused kernel; mixed, every row names its slots in one table
    p3, one = entries["planes3"].slots, entries["plain"].slot
    alone = worker.runner.prepare([SeqWork([1, 2], 0, p3[0], [0], True)])
    assert (alone.single_slot, alone.single_planes, alone.row_slots) == (p3[0], 3, None)
    mixed = worker.runner.prepare([SeqWork([1], 0, s, [i], True) for i, s in enumerate((one, p3[0], -1))])
    assert mixed.row_slots.tolist() == [[one, -1, -1], list(p3), [-1, -1, -1]]
    if worker.runner.device.type == "cpu":
        assert mixed.plan is None  # the C kernels need no launch plan
    else:
        assert mixed.plan.planes == 3  # rows grouped by their 3 slots, planned from the host copy


async def refused_behind_pinned_planes3_then_evicted(stub) -> None:
    """With the 3-plane delta pinned in 3 of 4 slots, a 2-plane load is RESOURCE_EXHAUSTED naming it;
    then the 3-plane delta is evicted as one."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.LoadDelta(pb.LoadDeltaRequest(name="mixed2"), timeout=T)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pinned deltas ['planes3']" in e.value.details() and "(3 of 4 slots)" in e.value.details()
    r = await stub.EvictDelta(pb.EvictDeltaRequest(name="planes3"), timeout=T)
    assert r.state == pb.DELTA_STATE_ABSENT


async def test_a_multi_slot_delta_is_evicted_pinned_and_refused_as_one(family):
    """Slots bind (4 of them, bytes to spare): the 3-plane delta goes as one victim, frees its three
    slots, and pinned it leaves room for no 2-plane delta; a delta of more planes than the worker
    has slots is refused at once, naming both numbers."""
    async with running_worker(config(family, max_slots=4)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        m = worker.manager
        await generate(stub, "planes3", "a", n=1)
        for _ in range(3):  # plain is the hot one
            await generate(stub, "plain", "a", n=1)
        assert len(m.free_slots) == 0
        await stub.LoadDelta(pb.LoadDeltaRequest(name="rank8"), timeout=T)
        st = await status(stub)
        assert set(st) == {"plain", "rank8"} and len(m.free_slots) == 2  # planes3 left whole
        assert (await generate(stub, "rank8", PROMPTS["rank8"])) == hf_greedy(family[2]["rank8"], PROMPTS["rank8"])
        await stub.LoadDelta(pb.LoadDeltaRequest(name="planes3", pin=True), timeout=T)
        st = await status(stub)
        assert st["planes3"].pinned and st["planes3"].slots == 3 and len(st) == 2
        await refused_behind_pinned_planes3_then_evicted(stub)
        assert len(m.free_slots) == 4 - sum(len(x.slots) for x in m.entries.values())
        await stub.LoadDelta(pb.LoadDeltaRequest(name="mixed2"), timeout=T)  # room again
        assert (await generate(stub, "mixed2", "a", n=4)) == hf_greedy(family[2]["mixed2"], "a")[:4]
    async with running_worker(config(family, max_slots=2)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "planes3", "a", n=1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "has 3 sign planes per matrix" in e.value.details() and "this worker has 2 slots" in e.value.details()
        assert worker.manager.loads_started == 1 and "planes3" not in await status(stub)
        assert sorted(worker.manager.free_slots) == [0, 1]
        await generate(stub, "mixed2", "a", n=1)  # 2 planes fit


def tp_bytes(family, name: str, rank: int) -> int:
    """What delta `name` costs rank `rank` of 2, computed from its file alone: its slice of every
    tensor as `bitdelta.shard` splits it (one slot of the rank's stacks per sign plane, its
    embedding's vocabulary rows, its low-rank factors' and column α's parts)."""
    from bitdelta.checkpoint import read_config
    from bitdelta.model import ModelArgs
    from bitdelta.shard import TPLayout
    from services.gpu_worker.slots import SlotLayout

    base, deltas, _ = family
    h = read_header(deltas / f"{name}{SUFFIX}")
    tp = TPLayout(ModelArgs.from_hf(read_config(base)), 2, rank)
    layout = SlotLayout(tp.local_args(), torch.float32)
    axes = {p: x["axes"] for p, x in h.meta.parts.items()}
    planes = max([len(a) for p, a in axes.items() if "layers" in p] or [1])
    n = planes * layout.slot_bytes
    for t in h.tensors:
        if t.param in ("model.embed_tokens.weight", "lm_head.weight") or t.part == "lowrank":
            shape = tp.shard_of(t.param, t.role, tuple(t.shape)).shape(tuple(t.shape))
            n += layout.extra_bytes(t.param, t.role, shape)
    for _, g in {(layout.proj[p].layer, layout.proj[p].group) for p, a in axes.items() if "col" in a}:
        n += planes * len(layout.group_rows[g]) * layout.group_shape[g][1] * 4  # [planes, its matrices, d_in] fp32
    return n


async def test_two_ranks_serve_every_v3_variant_as_one_process_does(served, family):
    """Tensor parallelism (2 ranks, gloo): further planes, low-rank residuals and column α's sharded
    like plane 1 (docs/tensor-parallel.md) give the one-process worker's greedy tokens, which are
    transformers' on `bitdelta apply`'s dense model: alone, mixed with 1-plane variants and the base
    in one batch, and every variant on one prompt; each decode step still costs one broadcast and
    one all-reduce per row-parallel layer (the low-rank partial products ride in it)."""
    async with running_worker(config(family, tensor_parallel=2)) as (worker, _, channel):
        await _two_ranks_serve_every_variant(worker, pb_grpc.GpuWorkerServiceStub(channel), served[1], family)


async def _two_ranks_serve_every_variant(worker, stub, one, family) -> None:
    base, _, dense = family
    want = {m: hf_greedy(base if m == "" else dense[m], p) for m, p in PROMPTS.items()}
    alone = {m: await generate(stub, m, p) for m, p in PROMPTS.items()}
    assert alone == want
    assert alone == {m: await generate(one, m, p) for m, p in PROMPTS.items()}
    together = await asyncio.gather(*[generate(stub, m, p) for m, p in PROMPTS.items()])
    assert dict(zip(PROMPTS, together)) == want
    same = await asyncio.gather(*[generate(stub, m, PROMPTS["planes3"]) for m in PROMPTS])
    assert same == [hf_greedy(base if m == "" else dense[m], PROMPTS["planes3"]) for m in PROMPTS]
    # Status: each rank's bytes of the resident deltas are what it allocated, which its slices of
    # the files say; rank 0's (it holds the most of every part) are what the byte budget counts
    st = await stub.Status(pb.StatusRequest(), timeout=T)
    entries = worker.manager.entries
    rank0 = {m: len(e.slots) * worker.layout.slot_bytes for m, e in entries.items()}
    for m, e in entries.items():
        if e.slot in worker.slots.extras:
            rank0[m] += worker.slots.extras[e.slot].nbytes
    assert rank0 == {m: e.bytes for m, e in entries.items()} == {m: tp_bytes(family, m, 0) for m in entries}
    assert set(entries) == set(PROMPTS) - {""}
    assert [r.delta_bytes for r in st.ranks] == [sum(tp_bytes(family, m, r) for m in entries) for r in (0, 1)]
    assert st.ranks[0].delta_bytes == st.delta_used_bytes > st.ranks[1].delta_bytes
    assert {s.name: s.slots for s in st.slots}["planes3"] == 3
    # one decode step of every variant and the base: ONE broadcast, the embedding's all-reduce, one
    # per row-parallel projection (o, down) of each layer, the head's gather: nothing per variant,
    # nor for their planes, column α's and low-rank terms (run last: it writes KV block 0)
    work = [SeqWork([1], 0, s, [0], True) for s in [entries[m].slot for m in PROMPTS if m] + [-1]]
    logits = await asyncio.to_thread(worker.tp.forward, work)
    assert logits.shape[0] == len(work)
    layers = worker.args.n_layers
    assert dict(worker.tp.last_step) == {"broadcast": 1, "all_reduce": 1 + 2 * layers, "gather": 1}


async def test_a_multi_plane_delta_on_two_ranks_is_evicted_pinned_and_refused_as_one(served, family):
    """Two ranks, 4 slots: a 3-plane delta takes the same run of slots on both; evicted, every rank
    lets its run go (a 1-plane delta without extras in its first slot then adds no stale plane on
    rank 1: its log-probabilities are one process's); pinned, it leaves room for no 2-plane delta;
    a delta of more planes than the slots is refused at once, and one with an embedding plane of
    column α's by name, before any byte moves (what no worker serves)."""
    from bitdelta.checkpoint import CheckpointReader, read_config, save_checkpoint
    from bitdelta.format import SignPlane, load_delta, save_delta

    base, deltas, dense = family
    ft = make_finetune(base, deltas.parent / "ft5", seed=100, scale=FT_SCALE)
    compress(base, ft, deltas / f"planes5{SUFFIX}", variant="planes5", progress=False, planes=PlaneConfig(planes=5))
    # one plane, the embedding as the base's: nothing beside its slot (no extras on any rank)
    with CheckpointReader(ft) as r, CheckpointReader(base) as b:
        state = {n: (b.get(n) if n == "model.embed_tokens.weight" else t).clone() for n, t in r}
    save_checkpoint(state, ft, read_config(base), side_files_from=base)
    compress(base, ft, deltas / f"frozen{SUFFIX}", variant="frozen", progress=False)
    shutil.rmtree(ft)
    assert all("embed" not in t.name for t in read_header(deltas / f"frozen{SUFFIX}").tensors)
    colemb = load_delta(deltas / f"signemb{SUFFIX}")
    emb = colemb.compressed["model.embed_tokens.weight"]
    emb.planes[0] = SignPlane(emb.planes[0].signs, torch.ones(emb.shape[1]), "col")
    save_delta(deltas / f"colemb{SUFFIX}", colemb)
    ref = {m: hf_greedy(dense[m], PROMPTS[m]) for m in ("plain", "planes3", "mixed2")}
    async with running_worker(config(family, tensor_parallel=2, max_slots=4)) as (worker, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        m = worker.manager
        assert await generate(stub, "planes3", PROMPTS["planes3"]) == ref["planes3"]
        assert m.entries["planes3"].slots == (0, 1, 2)
        r = await stub.EvictDelta(pb.EvictDeltaRequest(name="planes3"), timeout=T)
        assert r.state == pb.DELTA_STATE_ABSENT and sorted(m.free_slots) == [0, 1, 2, 3]
        # in planes3's first slot, its planes 2 and 3 still in slots 1 and 2: no rank adds them
        frozen = [await logprobs(x, "frozen", PROMPTS["plain"]) for x in (stub, served[1])]
        assert_close(*frozen)
        assert m.entries["frozen"].slots == (0,)
        await stub.EvictDelta(pb.EvictDeltaRequest(name="frozen"), timeout=T)
        assert await generate(stub, "plain", PROMPTS["plain"]) == ref["plain"]
        assert m.entries["plain"].slots == (0,)
        await stub.LoadDelta(pb.LoadDeltaRequest(name="planes3", pin=True), timeout=T)
        assert m.entries["planes3"].slots == (1, 2, 3)
        assert await generate(stub, "planes3", PROMPTS["planes3"]) == ref["planes3"]
        await refused_behind_pinned_planes3_then_evicted(stub)
        st = await stub.Status(pb.StatusRequest(), timeout=T)
        assert [x.delta_bytes for x in st.ranks] == [tp_bytes(family, "plain", r) for r in (0, 1)]
        got = await asyncio.gather(*[generate(stub, x, PROMPTS[x]) for x in ("mixed2", "plain")])
        assert got == [ref["mixed2"], ref["plain"]]
        assert m.entries["mixed2"].slots == (1, 2)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "planes5", "a", n=1)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "has 5 sign planes per matrix" in e.value.details() and "this worker has 4 slots" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(stub, "colemb", "a", n=1)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model.embed_tokens.weight" in e.value.details() and "scales its columns" in e.value.details()
        st = await status(stub)
        assert "planes5" not in st and st["colemb"].state == pb.DELTA_STATE_FAILED
        assert await generate(stub, "plain", PROMPTS["plain"]) == ref["plain"]


async def test_from_the_delta_store_on_one_process_and_on_two_ranks(family):
    """The same deltas streamed from a real delta store serve the same tokens on one process and on
    two ranks; on two ranks each rank fetches only its slices (a part both hold, as a row-parallel
    matrix's U, goes to rank 0 and is handed on), so a cold load moves each byte of the file once."""
    from services.delta_store.config import Config
    from services.delta_store.server import create_server

    base, deltas, dense = family
    cfg = Config(address="127.0.0.1:0", root=deltas)
    cfg.check()
    server, store = create_server(cfg, metrics=True)
    await server.start()
    address = f"127.0.0.1:{server.port}"
    names = ("planes3", "rank8", "col", "plain")
    want = [hf_greedy(dense[m], PROMPTS[m]) for m in names]

    def served() -> float:
        return store.metrics.registry.get_sample_value("bitdelta_delta_store_served_bytes_total") or 0.0

    try:
        for tp in (1, 2):
            wcfg = WorkerConfig(
                base=base, delta_store=address, delta_budget=16 << 20, kv_cache=4 << 20, tensor_parallel=tp
            )
            async with running_worker(wcfg) as (worker, _, channel):
                stub = pb_grpc.GpuWorkerServiceStub(channel)
                if tp == 2:
                    for m in ("planes3", "rank8", "col"):  # cold, one at a time
                        before = served()
                        await stub.LoadDelta(pb.LoadDeltaRequest(name=m), timeout=T)
                        assert served() - before == sum(t.nbytes for t in read_header(deltas / f"{m}{SUFFIX}").tensors)
                got = await asyncio.gather(*[generate(stub, m, PROMPTS[m]) for m in names])
                assert got == want, f"tensor parallel {tp}"
    finally:
        await server.stop(0)
        await store.close()


SPLITS = {
    # fused qkv_proj / gate_up_proj, one KV head on both ranks: rank 1's slice of a qkv part is its own
    # query rows + k/v rows rank 0 holds too, which rank 0 hands on (U included)
    "phi3 fused, 1 kv head": tiny_args(model_type="phi3", n_kv_heads=1, tie_embeddings=False),
    # 9 heads in 3 GQA groups: 2 + 1 groups, o_proj's input columns 48 + 24
    "9 heads, 3 kv heads": tiny_args(dim=72, n_heads=9, n_kv_heads=3, head_dim=8, intermediate_size=96),
}


@pytest.mark.parametrize("split", SPLITS)
async def test_uneven_and_fused_splits_serve_v3_from_the_store_as_one_process(split, tmp_path):
    """Two ranks on a fused-qkv base with fewer KV heads than ranks and on one whose heads split
    unevenly: a 3-plane, a low-rank and an auto-α variant from a real delta store give the one-process
    worker's greedy tokens, alone and mixed with the base, and its log-probabilities; each byte of a
    cold load is served once."""
    from services.delta_store.config import Config
    from services.delta_store.server import create_server

    base = make_base(tmp_path / "base", SPLITS[split], 1, std=VARIED_STD)
    ft = make_finetune(base, tmp_path / "ft", seed=100, scale=FT_SCALE)
    deltas = tmp_path / "deltas"
    kinds = {
        "planes3": PlaneConfig(planes=3),
        "rank8": PlaneConfig(rank=8),
        "colauto": PlaneConfig(planes=2, alpha="auto"),
    }
    for name, pc in kinds.items():
        compress(base, ft, deltas / f"{name}{SUFFIX}", variant=name, progress=False, planes=pc)
    cfg = Config(address="127.0.0.1:0", root=deltas)
    cfg.check()
    server, store = create_server(cfg, metrics=True)
    await server.start()
    prompts = {"": "Hello world", "planes3": "abc xyz", "rank8": "def f(x):", "colauto": "zzz"}
    got, lps = {}, {}
    try:
        for tp in (1, 2):
            wcfg = WorkerConfig(
                base=base,
                delta_store=f"127.0.0.1:{server.port}",
                delta_budget=16 << 20,
                kv_cache=4 << 20,
                tensor_parallel=tp,
            )
            async with running_worker(wcfg) as (_, _, channel):
                stub = pb_grpc.GpuWorkerServiceStub(channel)
                for m in kinds:
                    before = store.metrics.registry.get_sample_value("bitdelta_delta_store_served_bytes_total") or 0.0
                    await stub.LoadDelta(pb.LoadDeltaRequest(name=m), timeout=T)
                    after = store.metrics.registry.get_sample_value("bitdelta_delta_store_served_bytes_total")
                    assert after - before == sum(t.nbytes for t in read_header(deltas / f"{m}{SUFFIX}").tensors)
                alone = {m: await generate(stub, m, p) for m, p in prompts.items()}
                mixed = dict(zip(prompts, await asyncio.gather(*[generate(stub, m, p) for m, p in prompts.items()])))
                got[tp] = (alone, mixed)
                lps[tp] = {m: await logprobs(stub, m, p) for m, p in prompts.items()}
    finally:
        await server.stop(0)
        await store.close()
    assert got[2] == got[1] and got[1][0] == got[1][1]
    for m in prompts:  # greedy tokens can hide a small wrong term: the log-probabilities cannot
        assert_close(lps[2][m], lps[1][m])
    assert len({tuple(v) for v in got[1][0].values()}) == len(prompts), "every variant answers its own tokens"
