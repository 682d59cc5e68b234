"""The capacity planner: the brief's arithmetic, the corrections, and agreement
with the bytes `bitdelta compress` actually writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bitdelta import cli, plan

ROOT = Path(__file__).resolve().parents[2]
LLAMA2_70B = json.loads((ROOT / "configs" / "llama-2-70b.json").read_text())


def test_brief_arithmetic_for_70b():
    p = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=80e9, gpus=8)
    assert p.brief["params"] == 70e9
    assert p.brief["base"] == pytest.approx(140e9)
    assert p.brief["delta"] == pytest.approx(8.75e9)
    assert p.brief["total"] == pytest.approx(262.5e9)
    # 8.75 GB at 3-7 GB/s: 1.25-2.9 s, not 200 ms.
    assert p.load["brief_delta_nvme_s"] == pytest.approx([8.75 / 3, 8.75 / 7])


def test_corrected_bytes_for_70b_by_hand():
    s = plan.Shape.from_hf(LLAMA2_70B)
    d, kv, f = 8192, 1024, 28672
    per_layer = d * d * 2 + kv * d * 2 + 3 * d * f
    assert s.projection_params == 80 * per_layer
    assert s.params == 80 * per_layer + 2 * 32000 * d + (2 * 80 + 1) * d  # untied head, norms
    db = plan.delta_bytes(s, "bf16", "row", "dense")
    assert db.signs == 80 * per_layer // 8
    assert db.alpha == 80 * (d + kv + kv + d + f + f + d) * 4
    assert db.dense == (2 * 32000 * d + (2 * 80 + 1) * d) * 2
    assert plan.delta_bytes(s, "bf16", "matrix", "dense").alpha == 80 * 7 * 4
    assert plan.kv_bytes_per_token(s) == 2 * 80 * 8 * 128 * 2  # 320 KiB


def test_per_gpu_placement_and_capacity():
    p = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=80e9, gpus=8, context=4096, reserve_frac=0.1)
    # 1/8 of everything but the replicated norms and row-parallel α's (bitdelta.shard)
    assert p.base_per_gpu == pytest.approx(p.base_bytes / 8, rel=1e-3) and p.base_per_gpu > p.base_bytes / 8
    assert p.kv_per_token_per_gpu == pytest.approx(p.kv_per_token / 8)
    free = 80e9 - 8e9 - p.base_per_gpu - 14 * p.delta_per_gpu
    assert p.free_for_kv_per_gpu == pytest.approx(free)
    assert p.sequences_per_replica == int(free // (p.kv_per_token / 8 * 4096))
    # Two TP-4 replicas: each GPU holds twice the shard; KV heads 8 over 4 GPUs.
    p4 = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=80e9, gpus=8, tp=4)
    assert p4.replicas == 2 and p4.base_per_gpu == pytest.approx(p.base_bytes / 4, rel=1e-3)
    # TP beyond the KV heads replicates them: 16 GPUs, 8 KV heads -> one head per GPU.
    p16 = plan.make_plan(LLAMA2_70B, variants=1, gpu_mem=80e9, gpus=16)
    assert p16.kv_per_token_per_gpu == pytest.approx(p.kv_per_token / 8)
    # Too many variants for one 24 GB GPU: does not fit, zero sequences.
    small = plan.make_plan(LLAMA2_70B, variants=14, gpu_mem=24e9, gpus=8)
    assert not small.fits and small.sequences_per_replica == 0


def test_planner_agrees_with_real_compressed_files(tmp_path):
    """The planner's bytes for a full fine-tune equal what compress() writes (tiny model, fp32)."""
    from bitdelta.checkpoint import read_config
    from bitdelta.compress import compress
    from bitdelta.format import read_header
    from tests.support.family import make_tiny_family

    base, (v0,) = make_tiny_family(tmp_path, n_variants=1)
    cfg = read_config(base)
    s = plan.Shape.from_hf(cfg)
    for alpha, emb in (("row", "dense"), ("matrix", "dense"), ("row", "sign")):
        roles = read_header(
            compress(base, v0, tmp_path / f"{alpha}-{emb}.st", alpha_mode=alpha, embeddings=emb, progress=False)
        ).bytes_by_role()
        want = plan.delta_bytes(s, "fp32", alpha, emb)
        assert (roles["sign"], roles["alpha"], roles["dense"]) == (want.signs, want.alpha, want.dense), (alpha, emb)


@pytest.mark.parametrize(
    "text,value",
    [
        ("80GB", 80e9),
        ("80GiB", 80 * 2**30),
        ("141 GB", 141e9),
        ("512MiB", 512 * 2**20),
        ("1e3", None),
        ("2k", 2000),
        ("3 kB", 3000),
    ],
)
def test_parse_bytes(text, value):
    if value is None:
        with pytest.raises(ValueError):
            plan.parse_bytes(text)
    else:
        assert plan.parse_bytes(text) == value


def test_nominal_size():
    assert plan.nominal_size(68_976_648_192) == 70e9
    assert plan.nominal_size(6_738_415_616) == 7e9
    assert plan.nominal_size(134_515_008) == 0.135e9


def test_cli_plan(capsys):
    rc = cli.main(
        [
            "plan",
            "--config",
            str(ROOT / "configs" / "llama-2-70b.json"),
            "--variants",
            "14",
            "--gpu-mem",
            "80GB",
            "--gpus",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "base + 14 deltas = 262.50 GB" in out and "one delta = 70B / 8 = 8.75 GB" in out
    assert "not 200 ms" in out and "concurrent sequences" in out
    rc = cli.main(["plan", "--config", "/nonexistent.json"])
    assert rc == 1 and "cannot read the config" in capsys.readouterr().err


# v3 deltas (bitdelta compress --planes/--rank/--alpha col/--embeddings sign) of one tiny fine-tune
V3 = {
    "plain": {},
    "planes3": {"planes": {"planes": 3}},
    "rank8": {"planes": {"planes": 2, "rank": 8}},
    "signemb": {"planes": {"planes": 2, "rank": 8}, "embeddings": "sign"},
    "col": {"planes": {"planes": 2, "alpha": "col"}},
    "colauto": {"planes": {"planes": 2, "alpha": "auto"}},  # each plane's axis chosen: row or column
    "mixed2": {"planes": {"planes": 2, "rank": 8}},  # under a budget (below): some matrices keep 1 plane
}


@pytest.fixture(scope="module", params=[{}, {"n_kv_heads": 1, "tie_embeddings": False}], ids=["tied", "kv1-untied"])
def v3_deltas(request, tmp_path_factory):
    from bitdelta.checkpoint import read_config
    from bitdelta.compress import RECORD_RESERVE, compress
    from bitdelta.format import read_header
    from bitdelta.planes import PlaneConfig
    from bitdelta.testing.family import FT_SCALE, VARIED_STD, make_base, make_finetune, tiny_args

    root = tmp_path_factory.mktemp("plan_v3")
    base = make_base(root / "base", tiny_args(**request.param), 1, std=VARIED_STD)
    ft = make_finetune(base, root / "ft", seed=100, scale=FT_SCALE)
    out = {}
    for name, kw in V3.items():
        if name == "mixed2":  # the plain file and about half of what the second planes cost
            one = read_header(out["plain"])
            # (a budget keeps RECORD_RESERVE of the header free for a distillation record)
            extra = RECORD_RESERVE + one.bytes_by_role()["sign"] * 3 // 4
            kw = {"planes": {**kw["planes"], "budget": one.file_size + extra}}
        kw = {**kw, "planes": PlaneConfig(**kw["planes"])} if "planes" in kw else kw
        out[name] = compress(
            base, ft, root / "deltas" / f"{name}.bitdelta.safetensors", variant=name, progress=False, **kw
        )
    return read_config(base), out


def _worker_rank_bytes(path, args, tp: int, rank: int) -> int:
    """What the tensor-parallel worker's own planning (`ShardedLoad.plan`: each tensor cut by
    `TPLayout.shard_of`, then `plan_delta` on the rank's layout) reserves for the delta on `rank`."""
    import asyncio

    import torch

    from bitdelta.format import read_header
    from bitdelta.shard import TPLayout
    from services.gpu_worker.parallel import ShardedLoad
    from services.gpu_worker.slots import SlotLayout
    from services.gpu_worker.sources import LocalDeltaSource

    name = path.name.split(".")[0]
    info = asyncio.run(LocalDeltaSource(path.parent).open(name, read_header(path).meta.base_fingerprint))
    layout = TPLayout(args, tp, rank)
    return ShardedLoad(layout, SlotLayout(layout.local_args(), torch.float32), None, 1.0).plan(info).total_bytes


def _shard_bytes(h, args, tp: int, rank: int) -> int:
    """The sum of rank `rank`'s slices of every tensor of the file, as `TPLayout.shard_of` cuts them."""
    import math

    from bitdelta.format import alpha_axis
    from bitdelta.shard import TPLayout

    layout, axes = TPLayout(args, tp, rank), {p: x["axes"] for p, x in h.meta.parts.items()}
    n = 0
    for t in h.tensors:
        cut = layout.shard_of(t.param, t.role, tuple(t.shape), alpha_axis(axes, t.param, t.role)).shape(tuple(t.shape))
        n += t.nbytes // math.prod(t.shape) * math.prod(cut)
    return n


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_per_rank_bytes_of_v3_files_are_the_workers_and_their_slices(v3_deltas, tp):
    """`bitdelta plan --delta FILE --tensor-parallel N`: each rank's bytes of a real v3 delta are
    what the worker reserves for it there; a k-plane delta holds k slots on every rank; for a file
    of row α's the bytes are the sum of the rank's slices of its tensors (`shard_of`) and, in each
    further plane's slot, the norm and bias rows that slot has but does not use."""
    from bitdelta.format import read_header

    cfg, files = v3_deltas
    s = plan.Shape.from_hf(cfg)
    seen = {}
    for name, path in files.items():
        h = read_header(path)
        ranks = plan.rank_deltas_of_file(h, s, tp, "fp32")
        assert [r.rank for r in ranks] == list(range(tp))
        assert [r.total for r in ranks] == [_worker_rank_bytes(path, s.args, tp, r) for r in range(tp)], name
        planes = {r.planes for r in ranks}
        assert planes == {max(t.plane for t in h.tensors if ".layers." in t.name)}, name
        seen[name] = planes.pop()
        axes = [x["axes"] for x in h.meta.parts.values()]
        if all(len(a) == seen[name] and "col" not in a for a in axes):  # every matrix: all planes, row α's
            norms = [t for t in h.tensors if t.param in norm_params(s) or t.param.endswith(".bias")]
            assert {t.param for t in norms} >= norm_params(s), "every norm changed: a slot's norm rows are the file's"
            unused = sum(t.nbytes for t in norms)  # each further plane's slot: norm and bias rows left as the base's
            for r in ranks:
                assert r.total == _shard_bytes(h, s.args, tp, r.rank) + (r.planes - 1) * unused, (name, r.rank)
        # the plan itself: rank 0's (the largest) per GPU, every rank's listed
        p = plan.make_plan(cfg, variants=3, gpu_mem=1e9, gpus=tp, dtype="fp32", delta_file=h)
        assert p.delta_per_rank == ranks and p.delta_per_gpu == ranks[0].total == max(r.total for r in ranks)
        assert p.delta.total == h.file_size - h.header_bytes
    assert seen == {"plain": 1, "planes3": 3, "rank8": 2, "signemb": 2, "col": 2, "colauto": 2, "mixed2": 2}
    assert {len(x["axes"]) for x in read_header(files["mixed2"]).meta.parts.values()} == {1, 2}
    one = plan.rank_deltas_of_file(read_header(files["plain"]), s, tp, "fp32")
    assert one == plan.rank_deltas(s, tp, "fp32")  # a plain file: the mode's one-plane delta
    three = plan.rank_deltas_of_file(read_header(files["planes3"]), s, tp, "fp32")
    assert [r.total for r in three] == [3 * r.slot + r.extra for r in three]
    assert [r.slot for r in three] == [r.slot for r in one] and [r.extra for r in three] == [r.extra for r in one]


def norm_params(s: plan.Shape) -> set[str]:
    """Every RMSNorm weight's name of the model."""
    return {f"model.layers.{i}.{n}.weight" for i in range(s.layers) for n, _ in s.args.layer_norms()} | {
        "model.norm.weight"
    }


def test_cli_plan_with_a_v3_delta_file(v3_deltas, tmp_path, capsys):
    cfg, files = v3_deltas
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["plan", "--config", str(tmp_path / "config.json"), "--variants", "2", "--gpu-mem", "1GB", "--gpus", "2"]
    assert cli.main([*argv, "--dtype", "fp32", "--delta", str(files["planes3"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["planes"] for r in out["delta_per_rank"]] == [3, 3] and out["delta_from"] == "planes3"
    assert out["delta_per_gpu"] == out["delta_per_rank"][0]["total"]
    assert cli.main([*argv, "--delta", str(files["rank8"])]) == 0
    text = capsys.readouterr().out
    assert "2 slots of" in text and "delta: low-rank" in text and "one delta shard per rank: 0:" in text
    assert cli.main([*argv, "--delta", str(tmp_path / "missing.bitdelta.safetensors")]) == 1
    assert "plan:" in capsys.readouterr().err


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_mode_with_planes_and_rank_is_the_file_compress_writes(v3_deltas, tp):
    """`bitdelta plan --planes K --rank R` (no file): the bytes and each rank's cost of the delta
    `compress --planes K --rank R` writes without a budget, dense or sign embeddings."""
    from bitdelta.format import read_header

    cfg, files = v3_deltas
    s = plan.Shape.from_hf(cfg)
    for name, (emb, k, r) in {"planes3": ("dense", 3, 0), "rank8": ("dense", 2, 8), "signemb": ("sign", 2, 8)}.items():
        h = read_header(files[name])
        want = plan.DeltaBytes.of_file(h)
        got = plan.delta_bytes(s, "fp32", "row", emb, planes=k, rank=r)
        assert got == want, name
        assert plan.rank_deltas(s, tp, "fp32", emb, planes=k, rank=r) == plan.rank_deltas_of_file(h, s, tp, "fp32")
        p = plan.make_plan(cfg, variants=3, gpu_mem=1e9, gpus=tp, dtype="fp32", embeddings=emb, planes=k, rank=r)
        assert p.delta == want and p.delta_per_gpu == plan.rank_deltas_of_file(h, s, tp, "fp32")[0].total
    with pytest.raises(ValueError, match="--planes"):
        plan.make_plan(cfg, 1, 1e9, tp, planes=0)
    with pytest.raises(ValueError, match="a --delta file says its own"):
        plan.make_plan(cfg, 1, 1e9, tp, delta_file=read_header(files["plain"]), planes=2)


def test_cli_plan_mode_with_planes_and_rank(v3_deltas, tmp_path, capsys):
    cfg, _ = v3_deltas
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv = ["plan", "--config", str(tmp_path / "config.json"), "--variants", "2", "--gpu-mem", "1GB", "--gpus", "2"]
    assert cli.main([*argv, "--planes", "2", "--rank", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["planes"] for r in out["delta_per_rank"]] == [2, 2] and out["delta"]["lowrank"] > 0
    assert cli.main([*argv, "--planes", "2", "--rank", "8"]) == 0
    text = capsys.readouterr().out
    assert "2 sign planes per matrix, a rank-8 fp16 residual per matrix" in text and "delta: low-rank" in text
    assert cli.main([*argv, "--rank", "-1"]) == 1
    assert "--rank at least 0" in capsys.readouterr().err
