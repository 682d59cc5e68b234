"""PEFT LoRA adapters served as they are (`bitdelta import-lora`): a tiny random family, adapters
written in PEFT's layout, imported to delta files whose modules are the factors alone (no sign
plane), and a real worker on a loopback port.

The imported file's update is the adapter's, scale · B · A, up to one fp16 rounding of the factors;
greedy tokens of two LoRA variants (one with a per-module rank and alpha) equal transformers' on
the dense model `bitdelta apply` writes, alone and in one batch with a BitDelta variant and the
base, on one process and on two tensor-parallel ranks; what the importer cannot represent is
refused by name."""

from __future__ import annotations

import asyncio
import json
import re
import shutil

import pytest
import pytest_asyncio
import torch

from bitdelta.common.v1 import generation_pb2 as gen_pb
from bitdelta.compress import apply, compress
from bitdelta.format import load_delta, read_header, verify
from bitdelta.gpu_worker.v1 import gpu_worker_pb2 as pb
from bitdelta.gpu_worker.v1 import gpu_worker_pb2_grpc as pb_grpc
from bitdelta.lora_import import import_lora
from bitdelta.merge.adapter import LoraAdapter, LoraModule, load_adapter, save_adapter
from bitdelta.testing.family import FT_SCALE, VARIED_STD, make_base, make_finetune, tiny_args
from services.gpu_worker.config import WorkerConfig
from tests.support import archs
from tests.support.cli import run_cli
from tests.support.worker import running_worker

pytestmark = pytest.mark.usefixtures("cpu_kernels")

N = 16
T = 60
SUFFIX = ".bitdelta.safetensors"
PROMPTS = {"": "Hello world", "bitdelta": "The quick brown fox", "lora_qv": "abc xyz", "lora_all": "def f(x):"}


def random_adapter(base, modules: dict[str, int], seed: int, std: float = 0.25) -> LoraAdapter:
    """Random factors for `modules` (name -> rank) of the base, scale lora_alpha / r with alpha 16."""
    from bitdelta.checkpoint import CheckpointReader

    g = torch.Generator().manual_seed(seed)
    mods = {}
    with CheckpointReader(base) as rb:
        for name, r in modules.items():
            d_out, d_in = rb.shape(name + ".weight")
            a = torch.randn(r, d_in, generator=g) * std
            b = torch.randn(d_out, r, generator=g) * std
            mods[name] = LoraModule(a.to(torch.bfloat16), b.to(torch.bfloat16), 16 / r)
    return LoraAdapter(mods)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_family")
    args = tiny_args()
    base = make_base(root / "base", args, 1, std=VARIED_STD)
    deltas = root / "deltas"
    ft = make_finetune(base, root / "ft", seed=100, scale=FT_SCALE)
    compress(base, ft, deltas / f"bitdelta{SUFFIX}", variant="bitdelta", progress=False)
    layers = range(args.n_layers)
    qv = {f"model.layers.{i}.self_attn.{p}": 4 for i in layers for p in ("q_proj", "v_proj")}
    every = {f"model.layers.{i}.{m}": 8 for i in layers for m in ("self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")}
    every["model.layers.0.mlp.down_proj"] = 2  # a rank_pattern entry
    adapters = {}
    for name, mods, seed in (("lora_qv", qv, 1), ("lora_all", every, 2)):
        adapters[name] = save_adapter(random_adapter(base, mods, seed), root / "adapters" / name)
        import_lora(base, adapters[name], deltas / f"{name}{SUFFIX}")
    dense = {
        name: apply(base, deltas / f"{name}{SUFFIX}", root / f"dense-{name}", progress=False)
        for name in PROMPTS
        if name
    }
    return base, deltas, adapters, dense


def hf_greedy(ckpt, prompt: str) -> list[int]:
    """transformers' greedy tokens of a dense checkpoint (the reference), the prompt's bytes its ids."""
    return archs.hf_greedy(ckpt, list(prompt.encode()), N)


def test_the_file_is_the_adapters_update_in_fp16_with_no_sign_plane(family):
    base, deltas, adapters, _ = family
    for name in ("lora_qv", "lora_all"):
        header = verify(deltas / f"{name}{SUFFIX}")
        meta = header.meta
        assert meta.format_version == "3" and meta.variant == name and meta.extra["source"] == "lora"
        assert all(p["axes"] == [] for p in meta.parts.values())
        bytes_ = header.bytes_by_role()
        assert bytes_["sign"] == bytes_["alpha"] == bytes_["dense"] == 0
        lora = load_adapter(adapters[name])
        assert bytes_["lowrank"] == sum(m.A.numel() + m.B.numel() for m in lora.modules.values()) * 2
        delta = load_delta(deltas / f"{name}{SUFFIX}")
        assert set(delta.compressed) == {m + ".weight" for m in lora.modules}
        for module, m in lora.modules.items():
            cw = delta.compressed[module + ".weight"]
            assert cw.rank == m.rank
            want = m.delta()
            # one fp16 rounding of each factor: relative error ~2^-11 per product term
            assert torch.allclose(cw.dense(), want, rtol=0, atol=2e-3 * want.abs().max().item()), module


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(family):
    base, deltas, _, _ = family
    cfg = WorkerConfig(base=base, delta_dir=str(deltas), delta_budget=16 << 20, kv_cache=4 << 20)
    async with running_worker(cfg) as (worker, _, channel):
        yield worker, pb_grpc.GpuWorkerServiceStub(channel)


async def generate(stub, model_id: str, prompt: str) -> list[int]:
    req = pb.GenerateRequest(model_id=model_id, prompt=prompt, sampling=gen_pb.SamplingParams(max_new_tokens=N))
    return [t.token_id async for m in stub.Generate(req, timeout=T) for t in m.tokens]


@pytest.mark.asyncio(loop_scope="module")
async def test_lora_variants_equal_transformers_alone_and_mixed_with_bitdelta(served, family, monkeypatch):
    """On CPU a LoRA variant's decode rows take the C decode layers (its factors in their
    `LowRankTable`), not the layer-by-layer path, and no sign plane (their plane slots all −1)."""
    from bitdelta_kernels.cpu_decode import DecodeLayers

    base, _, _, dense = family
    worker, stub = served
    tables, planes = [], []  # each C call's low-rank table (None: none resident) and rows' plane slots
    c_bind = DecodeLayers.bind

    def bind(self, *a, lowrank=None, row_planes=None, **kw):
        tables.append(lowrank)
        planes.append(None if row_planes is None else torch.as_tensor(row_planes).tolist())
        return c_bind(self, *a, lowrank=lowrank, row_planes=row_planes, **kw)

    monkeypatch.setattr(DecodeLayers, "bind", bind)  # the runner binds each call (bind_steps through it)
    want = {m: hf_greedy(base if m == "" else dense[m], p) for m, p in PROMPTS.items()}
    assert len({tuple(v) for v in want.values()}) == len(want), "every variant answers its own tokens"
    alone = {}
    for m, p in PROMPTS.items():
        tables.clear(), planes.clear()
        alone[m] = await generate(stub, m, p)
        if worker.runner.device.type == "cpu" and m.startswith("lora"):
            assert tables and all(t is not None for t in tables), m
            assert planes and all(rows == [[-1]] for rows in planes), (m, planes)
    assert alone == want
    together = await asyncio.gather(*[generate(stub, m, p) for m, p in PROMPTS.items()])
    assert dict(zip(PROMPTS, together)) == want
    same = await asyncio.gather(*[generate(stub, m, PROMPTS["lora_all"]) for m in PROMPTS])
    assert same == [hf_greedy(base if m == "" else dense[m], PROMPTS["lora_all"]) for m in PROMPTS]
    slots = {s.name: s for s in (await stub.Status(pb.StatusRequest(), timeout=T)).slots}
    assert {"lora_qv", "lora_all", "bitdelta"} <= set(slots)


def test_what_cannot_be_served_as_it_is_is_refused_by_name(family, tmp_path):
    base, _, adapters, _ = family
    src = adapters["lora_qv"]
    mods = load_adapter(src).modules

    def write(name: str, modules: dict, config: dict | None = None):
        d = save_adapter(LoraAdapter(modules), tmp_path / name)
        if config:
            cfg = json.loads((d / "adapter_config.json").read_text())
            (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
        return d

    q = "model.layers.0.self_attn.q_proj"
    retokenized = write("tokenizer", {q: mods[q]})  # ships a tokenizer that renamed a special token
    tok = json.loads((base / "tokenizer.json").read_text())
    renamed = [{**t, "content": "<|mine|>"} if t["id"] == 258 else t for t in tok["added_tokens"]]
    (retokenized / "tokenizer.json").write_text(json.dumps({**tok, "added_tokens": renamed}))
    resized = write("resized", {q: mods[q]})  # ... and one with a token the model has no row for
    grown = {**tok["added_tokens"][-1], "id": 259, "content": "<|more|>"}
    (resized / "tokenizer.json").write_text(json.dumps({**tok, "added_tokens": [*tok["added_tokens"], grown]}))
    cases = [
        (write("unknown", {"model.layers.9.self_attn.q_proj": mods[q]}), "model.layers.9.self_attn.q_proj"),
        (write("shape", {"model.layers.0.mlp.down_proj": mods[q]}), "model.layers.0.mlp.down_proj"),
        (write("huge", {q: LoraModule(mods[q].A * 1e5, mods[q].B * 1e5, mods[q].scale)}), "float16"),
        (write("dora", {q: mods[q]}, {"use_dora": True}), "DoRA"),
        (resized, "has token 259, but the model's vocabulary has 259 rows"),
    ]
    for adapter, words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            import_lora(base, adapter, tmp_path / f"{adapter.name}{SUFFIX}")
        assert not (tmp_path / f"{adapter.name}{SUFFIX}").exists()
    code, text = run_cli(
        "import-lora", "--base", str(base), "--adapter", str(cases[0][0]), "--out", str(tmp_path / "cli.st")
    )
    assert code != 0 and "model.layers.9.self_attn.q_proj" in text and "Traceback" not in text
    ok = tmp_path / "ok.bitdelta.safetensors"
    code, text = run_cli(
        "import-lora", "--base", str(base), "--adapter", str(src), "--out", str(ok), "--variant", "mine"
    )
    assert code == 0, text
    assert "a LoRA adapter of rank 4, its factors as they are" in text  # what inspect says of it
    assert read_header(tmp_path / "ok.bitdelta.safetensors").meta.variant == "mine"
    # an adapter with a tokenizer of its own (same vocabulary size) brings it, served with it (the
    # worker's tests of variant tokenizers)
    own = import_lora(base, retokenized, tmp_path / f"own{SUFFIX}")
    assert read_header(own).meta.tokenizer_sha256 and not read_header(ok).meta.tokenizer_sha256


class _Runs:
    """An object whose unpickling would run code (it would create `marker`)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_older_peft_bin_adapters_import_alike_and_run_no_code(family, tmp_path):
    """Older PEFT's adapter_model.bin (torch.save) imports to the same factors as the safetensors
    file; a .bin that is not a plain state dict is refused, and nothing in it runs (weights_only)."""
    from safetensors.torch import load_file

    base, _, adapters, _ = family
    legacy = tmp_path / "legacy"
    shutil.copytree(adapters["lora_qv"], legacy)
    weights = legacy / "adapter_model.safetensors"
    torch.save(load_file(weights), legacy / "adapter_model.bin")
    weights.unlink()
    a = load_delta(import_lora(base, adapters["lora_qv"], tmp_path / f"a{SUFFIX}", variant="x"))
    b = load_delta(import_lora(base, legacy, tmp_path / f"b{SUFFIX}", variant="x"))
    assert a.compressed.keys() == b.compressed.keys()
    assert all(torch.equal(a.compressed[k].dense(), b.compressed[k].dense()) for k in a.compressed)
    marker = tmp_path / "ran"
    torch.save({"x": _Runs(marker)}, legacy / "adapter_model.bin")
    with pytest.raises(ValueError, match="not a state dict of tensors"):
        import_lora(base, legacy, tmp_path / f"c{SUFFIX}")
    assert not marker.exists()


@pytest.mark.asyncio(loop_scope="module")
async def test_two_ranks_serve_lora_variants_as_one_process_does(served, family):
    """Tensor parallelism (2 ranks, gloo): the LoRA variants' factors are sharded like any low-rank
    residual (docs/tensor-parallel.md), and every variant's greedy tokens are the one-process
    worker's (transformers' on the merged model), alone and in one batch."""
    base, deltas, _, dense = family
    cfg = WorkerConfig(base=base, delta_dir=str(deltas), delta_budget=16 << 20, kv_cache=4 << 20, tensor_parallel=2)
    want = {m: hf_greedy(base if m == "" else dense[m], p) for m, p in PROMPTS.items()}
    async with running_worker(cfg) as (_, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)
        assert {m: await generate(stub, m, p) for m, p in PROMPTS.items()} == want
        together = await asyncio.gather(*[generate(stub, m, p) for m, p in PROMPTS.items()])
        assert dict(zip(PROMPTS, together)) == want


@pytest.mark.asyncio
async def test_the_triton_kernels_serve_lora_variants_beside_bitdelta(family, monkeypatch):
    """The GPU path (Triton's kernels, in the interpreter on CPU): a LoRA variant's rows take no
    sign plane in the batched kernels (their plane slots −1) and add their factors; the same
    tokens as transformers on the merged models, all four in one batch."""
    from bitdelta_kernels import dispatch

    base, deltas, _, dense = family
    launches = {"sgmv": 0, "bgmv": 0}
    for name in launches:
        real = getattr(dispatch, f"{name}_launch")

        def counted(*a, real=real, name=name, **kw):
            launches[name] += 1
            return real(*a, **kw)

        monkeypatch.setattr(dispatch, f"{name}_launch", counted)
    cfg = WorkerConfig(
        base=base,
        delta_dir=str(deltas),
        delta_budget=16 << 20,
        kv_cache=4 << 20,
        dtype="float32",
        kernel_backend="triton",
    )
    n = 4  # the interpreter costs ~1 s per layer call
    async with running_worker(cfg) as (_, _, channel):
        stub = pb_grpc.GpuWorkerServiceStub(channel)

        async def gen(m: str, p: str) -> list[int]:
            req = pb.GenerateRequest(model_id=m, prompt=p, sampling=gen_pb.SamplingParams(max_new_tokens=n))
            return [t.token_id async for x in stub.Generate(req, timeout=600) for t in x.tokens]

        got = await asyncio.gather(*[gen(m, p) for m, p in PROMPTS.items()])
    want = [hf_greedy(base if m == "" else dense[m], p)[:n] for m, p in PROMPTS.items()]
    assert got == want
    assert launches["sgmv"] and launches["bgmv"], launches  # prefill and decode took the kernels
