"""The worker's parts that need no server: scheduler budgets, text streaming and
stop strings, sampling, delta validation, configuration, and the ragged step
against the reference model."""

from __future__ import annotations

import re

import pytest
import torch

from services.gpu_worker.scheduler import BlockAllocator, Scheduler, SeqState


def test_scheduler_takes_blocks_as_sequences_grow_and_fifo_waits():
    s = Scheduler(BlockAllocator(6), block_size=4, max_running=8, max_batch_tokens=100)
    a, b, c = SeqState(1, [1] * 5, 7, -1), SeqState(2, [2] * 4, 1, 0), SeqState(3, [3] * 2, 2, 1)
    for x in (a, b, c):
        s.add(x)
    first = s.schedule()
    # the prompts' blocks only (a 2, b 1, c 1), not prompt + max_new; chunks are whole prompts
    assert [(w.seq.seq_id, w.n_tokens, w.samples) for w in first] == [(1, 5, True), (2, 4, True), (3, 2, True)]
    assert [len(x.blocks) for x in (a, b, c)] == [2, 1, 1] and s.allocator.n_free == 2
    big = SeqState(4, [4] * 12, 1, -1)  # needs 3 blocks, 2 are free: waits
    small = SeqState(5, [5], 1, -1)  # would fit, but may not overtake the head of the queue
    s.add(big)
    s.add(small)
    for w in first:
        w.seq.computed += w.n_tokens
        w.seq.output.append(0)
    nxt = s.schedule()
    assert sorted(w.seq.seq_id for w in nxt) == [1, 2, 3] and all(w.n_tokens == 1 for w in nxt)
    assert list(s.waiting) == [big, small]
    assert [len(x.blocks) for x in (a, b, c)] == [2, 2, 1], "b's 4th token crossed into a block of its own"
    s.remove(1)  # a finishes: its 2 blocks return
    assert s.allocator.n_free == 3
    assert [w.seq.seq_id for w in s.schedule() if w.seq.seq_id > 3] == [4]
    assert list(s.waiting) == [small] and s.preemptions == 0
    assert s.used_tokens() <= s.capacity_tokens()


def test_scheduler_chunks_prefill_under_the_token_budget():
    s = Scheduler(BlockAllocator(100), block_size=16, max_running=8, max_batch_tokens=10)
    long = SeqState(1, list(range(25)), 4, -1)
    s.add(long)
    chunks = []
    while long.pending:
        (w,) = s.schedule()
        chunks.append((w.n_tokens, w.samples))
        long.computed += w.n_tokens
    assert chunks == [(10, False), (10, False), (5, True)]


class ByteTok:
    """tokenizers-like decode over raw bytes (token id = byte)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stream_all(text_bytes: bytes, stop: list[str]) -> tuple[str, str | None]:
    """The text a stream sends, and the stop string that ended it (None: it ran to the end)."""
    from services.gpu_worker.sampling import TextStream

    ts = TextStream(ByteTok(), [], stop)
    pieces = []
    for b in text_bytes:
        out, stopped = ts.add(b)
        pieces.append(out)
        if stopped is not None:
            return "".join(pieces), stopped
    return "".join(pieces) + ts.flush(), None


def test_text_stream_multibyte_and_stop_strings():
    s = "héllo wörld €uro END tail"
    assert stream_all(s.encode(), []) == (s, None)
    assert stream_all(s.encode(), ["END"]) == ("héllo wörld €uro ", "END")
    assert stream_all(s.encode(), ["€u"]) == ("héllo wörld ", "€u")
    # two strings completed by the same token: the one that starts first stopped it
    assert stream_all(s.encode(), ["ND", "END"]) == ("héllo wörld €uro ", "END")
    assert stream_all(s.encode(), ["ENX"]) == (s, None)  # a held-back prefix is released at the end
    # nothing that could start a stop string leaves early
    from services.gpu_worker.sampling import TextStream

    ts = TextStream(ByteTok(), [], ["abc"])
    assert ts.add(ord("x")) == ("x", None)
    assert ts.add(ord("a")) == ("", None)
    assert ts.add(ord("b")) == ("", None)
    assert ts.add(ord("d")) == ("abd", None)


def test_sampler_seed_and_top_p():
    from bitdelta.generation import Sampling
    from services.gpu_worker.sampling import Sampler

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    sampler = lambda seed, top_p: Sampler(Sampling(temperature=1.0, top_p=top_p, seed=seed))
    draws = lambda seed, top_p=1.0: (
        [sampler(seed, top_p).sample(logits) for _ in range(1)]
        + [s.sample(logits) for s in [sampler(seed, top_p)] for _ in range(20)]
    )
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert set(draws(3, top_p=1e-9)) == {int(logits.argmax())}
    # top-p keeps the smallest set reaching p: with p = 0.5 only tokens inside it are ever drawn
    p = torch.softmax(logits, 0)
    order = p.argsort(descending=True)
    k = int((p[order].cumsum(0) < 0.5).sum()) + 1
    assert set(draws(11, top_p=0.5)) <= set(order[:k].tolist())


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05)])
def test_top_k_top_p_min_p_cut_like_transformers_warpers(top_k, top_p, min_p):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from bitdelta.generation import Sampling
    from services.gpu_worker.sampling import Sampler

    logits = torch.randn(300, generator=torch.Generator().manual_seed(top_k + int(100 * top_p)))
    s = Sampler(Sampling(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, seed=1))
    ours = s.distribution(s.process(logits))
    hf = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    for w in (
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(top_k) if top_k else None,
        TopPLogitsWarper(top_p) if top_p < 1 else None,
        MinPLogitsWarper(min_p) if min_p else None,
    ):
        if w is not None:
            hf = w(ids, hf)
    want = torch.softmax(hf[0], -1)
    assert torch.equal(ours > 0, want > 0), "the same tokens are kept"
    assert torch.allclose(ours, want, atol=1e-6)
    assert 0 < int((ours > 0).sum()) < 300


def test_plan_delta_rejects_what_does_not_fit_this_base():
    from bitdelta.format import DeltaFormatError
    from bitdelta.testing.family import tiny_args
    from services.gpu_worker.loader import Kind, plan_delta
    from services.gpu_worker.slots import SlotLayout
    from services.gpu_worker.sources import DeltaInfo, TensorSpec

    layout = SlotLayout(tiny_args(), torch.float32)
    q = "model.layers.0.self_attn.q_proj.weight"
    good = [TensorSpec(q + ".sign", "U8", (64, 8), 512, "x"), TensorSpec(q + ".alpha", "F32", (64,), 256, "x")]
    plan = plan_delta(layout, DeltaInfo("d", good))
    assert plan.total_bytes == layout.slot_bytes and [p.kind for p in plan.placements] == [
        Kind.PROJ_SIGN,
        Kind.PROJ_ALPHA,
    ]
    cases = {
        "must be uint8 [64, 8]": [TensorSpec(q + ".sign", "U8", (64, 9), 576, "x"), good[1]],
        "needs both": [good[0]],
        "does not have": good + [TensorSpec("model.layers.9.mlp.up_proj.weight.dense", "F32", (4,), 16, "x")],
        "compressed projections only": [TensorSpec(q + ".dense", "F32", (64, 64), 64 * 64 * 4, "x")],
        "bytes": [TensorSpec(q + ".sign", "U8", (64, 8), 100, "x"), good[1]],
        # format v3: planes 1..k each with signs and α, the low-rank factors in pairs of one rank
        "sign planes [1, 3] and α's [1, 3]": good
        + [s3 := TensorSpec(q + ".sign3", "U8", (64, 8), 512, "x")]
        + [TensorSpec(q + ".alpha3", "F32", (64,), 256, "x")],
        "sign planes [1, 3] and α's [1]": good + [s3],
        "both .lowrank_u [d_out, r] and .lowrank_v": good
        + [u := TensorSpec(q + ".lowrank_u", "F16", (64, 4), 512, "x")],
        "of one rank": good + [u, TensorSpec(q + ".lowrank_v", "F16", (8, 64), 1024, "x")],
        "must be float16 [64, r]": good + [TensorSpec(q + ".lowrank_u", "F32", (64, 4), 1024, "x")],
    }
    for why, tensors in cases.items():
        with pytest.raises(DeltaFormatError, match=re.escape(why)):
            plan_delta(layout, DeltaInfo("d", tensors))
    # two planes and a rank-4 residual: two slots, plus the factors' fp16 bytes
    v3 = good + [
        TensorSpec(q + ".sign2", "U8", (64, 8), 512, "x"),
        TensorSpec(q + ".alpha2", "F32", (1,), 4, "x"),
        u,
        TensorSpec(q + ".lowrank_v", "F16", (4, 64), 512, "x"),
    ]
    plan = plan_delta(layout, DeltaInfo("d", v3))
    assert (plan.planes, plan.total_bytes, plan.lowrank) == (2, 2 * layout.slot_bytes + 1024, True)


def test_config_from_flags_and_env(tmp_path):
    from bitdelta.rpc.config import ConfigError
    from bitdelta.testing.family import make_base
    from services.gpu_worker.config import WorkerConfig

    base = make_base(tmp_path / "base")
    c = WorkerConfig.from_args(
        ["--base", str(base), "--delta-budget", "64MiB", "--no-fused-single-variant"],
        env={"BITDELTA_WORKER_KV_CACHE": "1GB", "BITDELTA_WORKER_PIN_HOTTEST": "3"},
    )
    assert (c.delta_budget, c.kv_cache, c.pin_hottest, c.fused_single_variant) == (64 << 20, 10**9, 3, False)
    c = WorkerConfig.from_args([], env={"BITDELTA_WORKER_BASE": str(base)})
    assert c.base == base
    with pytest.raises(ConfigError, match="no config.json"):
        WorkerConfig.from_args(["--base", str(tmp_path)], env={})
    with pytest.raises(ConfigError, match="--base .*BITDELTA_WORKER_BASE.* is required"):
        WorkerConfig.from_args([], env={})
    with pytest.raises(ConfigError, match="not both"):
        WorkerConfig(base=base, delta_dir=str(tmp_path), delta_store="x:1")
    assert WorkerConfig.from_args([], env={"BITDELTA_WORKER_BASE": str(base)}).kernel_backend == ""
    c = WorkerConfig.from_args(["--base", str(base), "--kernel-backend", "torch"], env={})
    assert c.kernel_backend == "torch"
    with pytest.raises(ConfigError, match="--kernel-backend 'cuda': use auto, triton, cpu, torch"):
        WorkerConfig(base=base, kernel_backend="cuda")


def test_ragged_step_matches_the_reference_model(tmp_path):
    """One ragged step over 3 sequences (two prefills of different lengths, chunked context) equals
    the reference Llama's logits for the same tokens."""
    from bitdelta.model import load_model
    from bitdelta.testing.family import VARIED_STD, make_base, tiny_args
    from services.gpu_worker.runner import BaseWeights, KVPool, ModelRunner, SeqWork
    from services.gpu_worker.slots import SlotLayout, SlotTensors

    base = make_base(tmp_path / "b", tiny_args(), seed=5, std=VARIED_STD)
    w, args = BaseWeights.load(base, torch.float32, torch.device("cpu"))
    layout = SlotLayout(args, torch.float32)
    slots = SlotTensors.allocate(layout, 1, torch.device("cpu"), w.norms, w.final_norm, w.biases)
    runner = ModelRunner(w, args, slots, KVPool(args, 16, 8, torch.float32, torch.device("cpu")))
    ref = load_model(base)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (11, 3, 20)]
    # seq 2 first feeds 12 tokens, then the remaining 8 in the same step as the others
    runner.forward([SeqWork(seqs[2][:12], 0, -1, [4, 5], False)])
    logits = runner.forward(
        [
            SeqWork(seqs[0], 0, -1, [0, 1], True),
            SeqWork(seqs[1], 0, -1, [2], True),
            SeqWork(seqs[2][12:], 12, -1, [4, 5, 6], True),
        ]
    )
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([s]))[0, -1] for s in seqs])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # then one decode token each: the paged decode attention reads the blocks in place
    nxt = [int(t) for t in logits.argmax(-1)]
    tables = [[0, 1], [2], [4, 5, 6]]
    logits = runner.forward([SeqWork([t], len(s), -1, b, True) for s, t, b in zip(seqs, nxt, tables)])
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([s + [t]]))[0, -1] for s, t in zip(seqs, nxt)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
