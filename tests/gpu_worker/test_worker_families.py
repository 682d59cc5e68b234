"""Every supported family served by the worker's own step (runner, slots, loader): a base of each
family (built by transformers), two random fine-tunes (weights, biases, norms moved), compressed
by `bitdelta compress`, loaded into slots by the real loader; one ragged step that mixes both
variants and the base equals the compact model with each delta attached, row by row; so does the
next step, of decodes only."""

from __future__ import annotations

import asyncio

import pytest
import torch

from bitdelta.compress import compress
from bitdelta.format import ArchMismatchError, DeltaFormatError, load_delta
from bitdelta.model import attach_delta, load_model
from bitdelta.rpc.receiver import Receiver
from bitdelta.testing.family import make_finetune
from bitdelta_kernels import cpu_build
from bitdelta_kernels.cpu_decode import DecodeLayers
from services.gpu_worker.loader import SlotWriter, plan_delta
from services.gpu_worker.runner import BaseWeights, KVPool, ModelRunner, SeqWork
from services.gpu_worker.slots import SlotLayout, SlotTensors
from services.gpu_worker.sources import LocalDeltaSource
from tests.support.archs import FAMILY_MEMBERS, LONG, VOCAB, make_hf_base

pytestmark = pytest.mark.usefixtures("cpu_kernels")
FT_SCALE = 0.02


def build(root, name: str, n_variants: int = 2):
    base = make_hf_base(root / "base", name, seed=3)
    for i in range(n_variants):
        ft = make_finetune(base, root / f"ft{i}", seed=10 + i, scale=FT_SCALE)
        compress(base, ft, root / "deltas" / f"v{i}.bitdelta.safetensors", variant=f"v{i}", progress=False)
    return base, root / "deltas"


def runner_with(base, deltas, names):
    runner, layout, _ = runner_and_slots(base, deltas, names)
    return runner, layout


def runner_and_slots(base, deltas, names):
    """A CPU runner with the deltas `names` loaded as the worker loads them (a delta of k sign planes
    into a run of k slots); returns (runner, layout, name -> its first slot)."""
    w, args = BaseWeights.load(base, torch.float32, torch.device("cpu"))
    layout = SlotLayout(args, torch.float32)
    source = LocalDeltaSource(deltas)
    infos, plans = {}, {}
    for name in names:
        infos[name] = asyncio.run(
            source.open(name, load_delta(deltas / f"{name}.bitdelta.safetensors").meta.base_fingerprint)
        )
        plans[name] = plan_delta(layout, infos[name])
    n_slots = sum(p.planes for p in plans.values())
    slots = SlotTensors.allocate(
        layout, n_slots, torch.device("cpu"), w.norms, w.final_norm, w.biases, w.final_norm_bias, w.head_bias
    )
    extras, first, at = {}, {}, 0
    for name in names:
        info, plan = infos[name], plans[name]
        writer = SlotWriter(plan, slots, tuple(range(at, at + plan.planes)))

        async def go(info=info, plan=plan, writer=writer):
            receiver = Receiver(plan.name, plan.tensors, writer)
            await source.stream(info, receiver)
            await receiver.finish()
            return await writer.finish()

        ex = asyncio.run(go())
        if not ex.empty:
            extras[at] = ex
        first[name] = at
        at += plan.planes
    slots.extras = extras
    runner = ModelRunner(w, args, slots, KVPool(args, 32, 8, torch.float32, torch.device("cpu")))
    return runner, layout, first


@pytest.mark.parametrize("name", FAMILY_MEMBERS)
def test_a_mixed_step_equals_each_variant_alone(tmp_path, name):
    base, deltas = build(tmp_path, name)
    runner, layout = runner_with(base, deltas, ["v0", "v1"])
    refs = {-1: load_model(base)}
    for slot in (0, 1):
        refs[slot] = attach_delta(load_model(base), load_delta(deltas / f"v{slot}.bitdelta.safetensors"))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (LONG, 9, 23, LONG - 3)]
    slots = [0, -1, 1, 0]
    # the last sequence: a prefill of all but one token, then its last token decodes in the mixed step
    runner.forward([SeqWork(seqs[3][:-1], 0, 0, [12, 13, 14, 15, 16], False)])
    logits = runner.forward(
        [
            SeqWork(seqs[0], 0, 0, [0, 1, 2, 3, 4], True),
            SeqWork(seqs[1], 0, -1, [5, 6], True),
            SeqWork(seqs[2], 0, 1, [7, 8, 9], True),
            SeqWork(seqs[3][-1:], len(seqs[3]) - 1, 0, [12, 13, 14, 15, 16], True),
        ]
    )
    with torch.no_grad():
        want = torch.stack([refs[s](torch.tensor([q]))[0, -1] for q, s in zip(seqs, slots)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # the variants differ from the base and from each other: the slots really served them
    assert (want[0] - refs[-1](torch.tensor([seqs[0]]))[0, -1]).abs().max() > 1e-2
    # then one step of decodes only: on CPU every layer of it in the C call (bitdelta_kernels.cpu_decode)
    # where the family's layer is one it has: every dense family's (a sparse layer runs op by op)
    assert runner._c_decode_serves(4) == (layout.args.family.moe is None)
    nxt = [5, 6, 7, 8]
    tables = [[0, 1, 2, 3, 4, 20], [5, 6], [7, 8, 9], [12, 13, 14, 15, 16]]
    logits = runner.forward([SeqWork([t], len(q), s, b, True) for t, q, s, b in zip(nxt, seqs, slots, tables)])
    with torch.no_grad():
        want = torch.stack([refs[s](torch.tensor([q + [t]]))[0, -1] for t, q, s in zip(nxt, seqs, slots)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_deltas_record_and_check_their_layout(tmp_path):
    """A delta of a Phi-3 base (fused projections) names its architecture and layout; the worker's
    plan of it for a Llama base is refused naming both, before any byte is read."""
    base, deltas = build(tmp_path / "phi3", "phi3-mini", n_variants=1)
    meta = load_delta(deltas / "v0.bitdelta.safetensors").meta
    assert (meta.architecture, meta.layout) == ("phi3", "qkv,o,gate_up,down")
    assert any(p.endswith("qkv_proj.weight") for p in meta.shapes)
    llama = make_hf_base(tmp_path / "llama", "llama-3.1")
    w, args = BaseWeights.load(llama, torch.float32, torch.device("cpu"))
    info = asyncio.run(LocalDeltaSource(deltas).open("v0", meta.base_fingerprint))
    with pytest.raises(ArchMismatchError, match=r"phi3 base with layout 'qkv,o,gate_up,down'.*llama with layout"):
        plan_delta(SlotLayout(args, torch.float32), info)
    with pytest.raises(DeltaFormatError, match="o_proj.bias.dense names a parameter this base does not have"):
        plan_delta(SlotLayout(args, torch.float32), _with_tensor(info, "model.layers.0.self_attn.o_proj.bias.dense"))


def _with_tensor(info, name):
    import dataclasses

    from services.gpu_worker.sources import TensorSpec

    return dataclasses.replace(
        info, architecture="llama", layout="q,k,v,o,gate,up,down", tensors=[TensorSpec(name, "F32", (32,), 128, "x")]
    )


def test_variants_with_sign_heads_share_one_product_with_the_base_head(tmp_path, monkeypatch):
    """Variants whose tied embedding and LM head are compressed to signs (`--embeddings sign`: two
    one-plane ones, one with a low-rank residual too): every row equals the dense model's, and a
    decode step's rows of all of them read the base's head ONCE between them (before: once per
    variant), each adding its own planes, so each row's logits are the ones it has alone, bit for
    bit (without the single-variant form's one-pass sums, which a lone variant row takes where the
    build has them). The C decode layers take every row (the low-rank variant's projections too);
    a step without the low-rank head ends its call with the heads: one GEMV for all of them, then
    each variant's plane over its rows."""
    from bitdelta.compress import apply
    from bitdelta.planes import PlaneConfig
    from services.gpu_worker import runner as runner_mod

    base = make_hf_base(tmp_path / "base", "llama-3.2", seed=3)  # tied embeddings
    kinds = {"v0": {}, "v1": {}, "v2": {"planes": PlaneConfig(rank=8)}}
    for i, (name, kw) in enumerate(kinds.items()):
        ft = make_finetune(base, tmp_path / f"ft{i}", seed=10 + i, scale=FT_SCALE)
        out = tmp_path / "deltas" / f"{name}.bitdelta.safetensors"
        compress(base, ft, out, variant=name, embeddings="sign", progress=False, **kw)
    runner, _ = runner_with(base, tmp_path / "deltas", list(kinds))
    assert all(runner.slots.extras[s].head.signs is not None for s in range(3))  # heads of signs
    assert runner.slots.extras[2].head.u is not None and runner.slots.extras[2].lowrank  # v2: U · V too
    refs = {-1: load_model(base)}
    for s, name in enumerate(kinds):
        refs[s] = load_model(apply(base, tmp_path / "deltas" / f"{name}.bitdelta.safetensors", tmp_path / name, False))
    products = []  # the rows of each product with the base's head outside the C call
    dense = runner_mod.dense_linear
    monkeypatch.setattr(
        runner_mod,
        "dense_linear",
        lambda x, w, **kw: (products.append(x.shape[0]) if w is runner.base.head else None) or dense(x, w, **kw),
    )
    c_heads = []  # each C call's rows' head planes (−1: the base's head alone; None: no plane)
    c_run = DecodeLayers.bind

    def run(self, *a, head_planes=None, **kw):
        c_heads.append(None if head_planes is None else [int(v) for v in head_planes.row_head])
        return c_run(self, *a, head_planes=head_planes, **kw)

    monkeypatch.setattr(DecodeLayers, "bind", run)  # the runner binds each call

    def step(rows: list[tuple[int, int]]) -> torch.Tensor:  # (token, slot) decodes at position 0, a block each
        products.clear(), c_heads.clear()
        return runner.forward([SeqWork([t], 0, s, [b], True) for b, (t, s) in enumerate(rows)])

    rows = [(5, 0), (6, -1), (7, 1), (8, 0), (9, 2)]
    mixed = step(rows)
    with torch.no_grad():
        want = torch.stack([refs[s](torch.tensor([[t]]))[0, -1] for t, s in rows])
    torch.testing.assert_close(mixed, want, rtol=1e-4, atol=1e-4)
    assert (want[0] - refs[-1](torch.tensor([[5]]))[0, -1]).abs().max() > 1e-2  # the head's planes count
    # every row in the C layers (v2's low-rank projections too); v2's head has a U · V the call does
    # not take, so it ends with the final norm and _logits takes the heads: one product with the
    # base's head for the base's, v0's and v1's rows (each adding its plane), one for v2's
    assert c_heads == [None] and sorted(products) == [1, 4], (c_heads, products)
    assert torch.equal(step(rows[2:4]), mixed[2:4]) and c_heads == [[0, 1]] and products == []
    for i, r in enumerate(rows[:4]):  # the decode rows of the C layers: alone as in the batch, ...
        alone = step([r])
        torch.testing.assert_close(alone, mixed[i : i + 1], rtol=1e-5, atol=1e-5)
        runner.use_fused = False  # ... bit for bit but for a lone variant row's one-pass sums (fuse)
        assert torch.equal(step([r]), mixed[i : i + 1])
        runner.use_fused = True
        assert torch.equal(alone, mixed[i : i + 1]) == (r[1] < 0 or cpu_build.cpu_isa() not in ("avx512", "avx512bf16"))


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe"])
def test_a_sparse_layer_gives_each_expert_its_rows_variants_parts(tmp_path, name):
    """A mixed step over variants of every kind of part (two sign planes with a low-rank residual,
    column α's, one plain plane) and the base: each expert runs over the rows that chose it, with
    those rows' variants' parts only (an expert's rows may hold none of a variant's), so every row
    equals its variant's model alone."""
    from bitdelta.planes import PlaneConfig

    base = make_hf_base(tmp_path / "base", name, seed=3)
    modes = {"v0": None, "v1": PlaneConfig(planes=2, rank=8), "v2": PlaneConfig(alpha="col")}
    for i, (v, planes) in enumerate(modes.items()):
        ft = make_finetune(base, tmp_path / f"ft{i}", seed=10 + i, scale=FT_SCALE)
        compress(base, ft, tmp_path / "deltas" / f"{v}.bitdelta.safetensors", variant=v, progress=False, planes=planes)
    runner, _, first = runner_and_slots(base, tmp_path / "deltas", list(modes))
    refs = {-1: load_model(base)}
    for v in modes:
        refs[v] = attach_delta(load_model(base), load_delta(tmp_path / "deltas" / f"{v}.bitdelta.safetensors"))
    assert len(runner.slots.extras[first["v1"]].slots) == 2  # v1's two sign planes: a run of two slots
    g = torch.Generator().manual_seed(1)
    order = ["v1", -1, "v2", "v0", "v1"]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 7, 13, 5, 9)]
    work, b = [], 0
    for v, q in zip(order, seqs):
        n_blocks = -(-len(q) // 8)
        work.append(SeqWork(q, 0, -1 if v == -1 else first[v], list(range(b, b + n_blocks)), True))
        b += n_blocks
    logits = runner.forward(work)
    with torch.no_grad():
        want = torch.stack([refs[v](torch.tensor([q]))[0, -1] for v, q in zip(order, seqs)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # then one decode row each: an expert's few rows often leave a variant out
    nxt = [3, 1, 4, 1, 5]
    logits = runner.forward([SeqWork([t], len(q), w.slot, w.blocks, True) for t, q, w in zip(nxt, seqs, work)])
    with torch.no_grad():
        want = torch.stack([refs[v](torch.tensor([q + [t]]))[0, -1] for v, q, t in zip(order, seqs, nxt)])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_bf16_c_layers_rotate_as_the_layers_do(tmp_path, monkeypatch):
    """bf16, where roundings show: the C decode layers' step equals the layer-by-layer step bit for bit
    on ERNIE 4.5 (its interleaved rope rotated in fp32 and rounded once, `rope_fp32`), on GLM-4
    (interleaved, rounded at each step) and on Cohere and Cohere 2 (LayerNorm rounded once, the
    parallel block, fp32 rotation from bf16 tables, NoPE layers), EXAONE 4 (post-norms rounded as
    Llama's), StableLM (LayerNorms with biases, a partial rope), StarCoder2 (an ungated GELU MLP),
    Command R+ (q and k normed per head by weights of their own) and Nemotron (LayerNorm1P's w + 1 rounded
    to bf16 first, an ungated relu² MLP), Hunyuan (q and k normed after the rope) and Phi ((attention + MLP) + x,
    gelu_new op by op, the head's bias after the call) and OLMo (LayerNorms of implied unit weights, q, k and v
    clipped); the C layers rotating ERNIE's pairs
    step by step do not."""
    from services.gpu_worker import runner as R
    from services.gpu_worker.config import WorkerConfig
    from services.gpu_worker.worker import Worker

    async def steps(name: str, stepwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        base = make_hf_base(tmp_path / name, name, seed=3)
        (tmp_path / "none").mkdir(exist_ok=True)
        cfg = WorkerConfig(
            base=base, delta_dir=str(tmp_path / "none"), dtype="bfloat16", device="cpu", kv_cache=8 << 20
        )
        worker = Worker(cfg)
        await worker.start()
        try:
            r = worker.runner
            prompt, blocks = list(range(40, 40 + LONG - 8)), list(range(8))
            r.forward([SeqWork(prompt, 0, -1, blocks, True)])
            step = [SeqWork([77], len(prompt), -1, blocks, True)]
            r.__dict__["_c_group_shapes"] = None  # the layer-by-layer path
            layers = r.forward(step)
            r.__dict__.pop("_c_group_shapes")
            if stepwise:
                options = R.DecodeOptions
                monkeypatch.setattr(R, "DecodeOptions", lambda **kw: options(**{**kw, "rope_fp32": False}))
            r._c_layers = None
            assert r._c_decode_serves(1)
            return r.forward(step), layers
        finally:
            await worker.close()

    for name in (
        "ernie4.5",
        "glm4",
        "cohere",
        "cohere2",
        "exaone4",
        "stablelm",
        "starcoder2",
        "cohere-qk",
        "nemotron",
        "hunyuan",
        "phi",
        "olmo",
        "gpt-neox",
        "falcon-40b",
        "gptj",
        "stablelm-qk",
    ):
        c, layers = asyncio.run(steps(name, stepwise=False))
        assert torch.equal(c, layers), name
    c, layers = asyncio.run(steps("ernie4.5", stepwise=True))
    assert not torch.equal(c, layers)
