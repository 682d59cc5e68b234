"""CUDA graphs of decode steps (`graphs.DecodeGraphs`, the worker's --cuda-graphs). On CPU the same
fixed buffers, padded rows and plans run eagerly (no capture) through the Triton kernels in the
interpreter, and each step's logits and KV writes must be the plain step's; on a GPU (the CUDA test
profile) the shapes are captured and replayed for real."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bitdelta.testing.family import make_test_family
from services.gpu_worker.config import WorkerConfig
from services.gpu_worker.graphs import DecodeGraphs
from services.gpu_worker.runner import SeqWork
from services.gpu_worker.slots import SlotExtras
from services.gpu_worker.worker import Worker

pytestmark = pytest.mark.cuda  # the CUDA profile captures the graphs for real
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


async def started(tmp_path) -> tuple[Worker, int, int]:
    fam = make_test_family(tmp_path, n_variants=2)
    cfg = WorkerConfig(
        base=fam.base,
        delta_dir=str(fam.deltas),
        device=DEV.type,
        dtype="float32",
        kernel_backend="triton",  # the layers op by op (on CPU the C layers would take decode rows)
        delta_budget=4 << 20,
        kv_cache=4 << 20,
    )
    worker = Worker(cfg)
    await worker.start()
    for name in ("v0", "v1"):
        await worker.load_delta(name)
    return worker, worker.manager.entries["v0"].slot, worker.manager.entries["v1"].slot


def same_step(runner, graphs, step: list[SeqWork]) -> None:
    """The step eagerly, then through the graphs (it writes the same K and V rows again): the same
    logits and the same KV pool, and the graphs served it."""
    runner.graphs = None
    want = runner.forward(step)
    kv_want = (runner.kv.k.clone(), runner.kv.v.clone())
    runner.graphs, before = graphs, graphs.replays
    got = runner.forward(step)
    runner.graphs = None
    assert graphs.replays == before + 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(runner.kv.k, kv_want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.kv.v, kv_want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.asyncio
async def test_graphed_decode_steps_equal_the_plain_steps(tmp_path):
    worker, s0, s1 = await started(tmp_path)
    try:
        r = worker.runner
        graphs = DecodeGraphs(r, max_rows=8)
        assert graphs.capture == (DEV.type == "cuda") and graphs.buckets == (1, 2, 4, 8)
        # start-up: every bucket's one-plane shapes (KV block 0 is nobody's yet)
        warmed = graphs.warm()
        assert warmed == sorted(
            (B, 1, k) for B in (1, 2, 4, 8) for k in ("none", "bgmv", "sgmv") if k != "sgmv" or B >= 4
        )
        g = torch.Generator().manual_seed(0)
        slots = [s0, -1, s1, s0, s1, s0]
        prompts = [torch.randint(0, 256, (5 + i,), generator=g).tolist() for i in range(6)]
        r.forward([SeqWork(p, 0, s, [i], True) for i, (p, s) in enumerate(zip(prompts, slots))])  # prefill
        replays = graphs.replays
        step = [SeqWork([7 + i], len(p), s, [i], True) for i, (p, s) in enumerate(zip(prompts, slots))]
        # every row (padded to 8: SGMV), three (padded to 4: BGMV), the base alone, one variant alone
        # (the plain step takes the fused kernel there, the graph the batched one)
        for rows in ([0, 1, 2, 3, 4, 5], [0, 1, 2], [1], [0, 3], [0, 1, 2, 3, 4, 5]):
            same_step(r, graphs, [step[i] for i in rows])
        assert sorted(graphs.shapes) == warmed  # every step found its shape warmed
        # a variant of two sign planes (slots s0 and s1) beside one of one plane and the base: [N, 2] slots
        r.slots.extras = {
            **r.slots.extras,
            s0: dataclasses.replace(r.slots.extras.get(s0, SlotExtras()), slots=(s0, s1)),
        }
        same_step(r, graphs, [step[i] for i in (0, 1, 2)])
        assert (4, 2, "bgmv") in graphs.shapes
        # prefill rows, or a variant with a low-rank term or column α's, keep the plain path
        r.graphs = graphs
        r.forward([SeqWork(prompts[0] + [7, 9], 0, s0, [0], True)])
        width, graphs.width = graphs.width, 0  # a block table past the shapes' width (the model's context)
        assert not graphs.serves(r.prepare([step[0]]))
        graphs.width = width
        assert width == min(r.kv.n_blocks, -(-r.args.max_seq_len // r.kv.block_size))
        ex = r.slots.extras[s0]
        r.slots.extras = {**r.slots.extras, s0: dataclasses.replace(ex, cols={(0, "qkv"): torch.ones(1)})}
        assert not graphs.serves(r.prepare([step[0]]))
        assert graphs.replays == replays + 6
    finally:
        worker.runner.graphs = None
        await worker.close()


def test_cuda_graphs_need_one_cuda_device(tmp_path):
    fam = make_test_family(tmp_path, n_variants=1)
    with pytest.raises(
        ValueError, match="--cuda-graphs: CUDA graphs need one CUDA device's own runner, not device cpu"
    ):
        Worker(WorkerConfig(base=fam.base, delta_dir=str(fam.deltas), device="cpu", cuda_graphs=True))
    from tests.support.archs import make_hf_base

    moe = make_hf_base(tmp_path / "mixtral", "mixtral")  # routes on the host: refused on any device
    with pytest.raises(ValueError, match="--cuda-graphs: a mixture-of-experts layer routes its rows on the host"):
        Worker(WorkerConfig(base=str(moe), delta_dir=str(fam.deltas), device="cpu", cuda_graphs=True))


@pytest.mark.asyncio
@pytest.mark.parametrize("member", ["gemma2", "gemma3"])
async def test_graphed_gemma_decode_steps_equal_the_plain_steps(tmp_path, member):
    """Gemma's decode steps through the graphs' fixed buffers: Gemma 3's sliding layers read their own
    rope rows, Gemma 2's soft-capped attention runs in the paged kernel."""
    from bitdelta.compress import compress
    from bitdelta.testing.family import make_finetune
    from tests.support.archs import make_hf_base

    base = make_hf_base(tmp_path / "base", member, seed=2)
    ft = make_finetune(base, tmp_path / "ft", seed=9, scale=0.02)
    compress(base, ft, tmp_path / "deltas" / "v0.bitdelta.safetensors", variant="v0", progress=False)
    cfg = WorkerConfig(
        base=base,
        delta_dir=str(tmp_path / "deltas"),
        device=DEV.type,
        dtype="float32",
        kernel_backend="triton",
        delta_budget=4 << 20,
        kv_cache=4 << 20,
    )
    worker = Worker(cfg)
    await worker.start()
    try:
        await worker.load_delta("v0")
        r, s0 = worker.runner, worker.manager.entries["v0"].slot
        graphs = DecodeGraphs(r, max_rows=4)
        g = torch.Generator().manual_seed(1)
        slots = [s0, -1, s0]
        prompts = [torch.randint(0, 256, (12 + i,), generator=g).tolist() for i in range(3)]  # past the window of 8
        r.forward([SeqWork(p, 0, s, [i, 8 + i], True) for i, (p, s) in enumerate(zip(prompts, slots))])
        step = [SeqWork([7 + i], len(p), s, [i, 8 + i], True) for i, (p, s) in enumerate(zip(prompts, slots))]
        if member == "gemma3":
            assert r.prepare(step).local_cos is not None
        same_step(r, graphs, step)
        same_step(r, graphs, step[1:])
    finally:
        worker.runner.graphs = None
        await worker.close()
