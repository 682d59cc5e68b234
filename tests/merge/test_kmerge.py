"""LoRA adapters (PEFT layout, no PEFT), the K-Merge pool's decisions on synthetic
adapters with planted similar and dissimilar pairs, the LoRA trainer, and `bitdelta kmerge`."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from bitdelta.cli import main
from bitdelta.merge import lora
from bitdelta.merge.adapter import (
    LoraAdapter,
    LoraModule,
    dense_to_lora,
    load_adapter,
    lowrank_sum,
    module_inner,
    save_adapter,
    similarity,
)
from bitdelta.merge.kmerge import AdapterPool, mean_score, scores, stream
from bitdelta.model import load_model
from tests.support.family import make_tiny_family

MODULES = {
    f"model.layers.{i}.self_attn.{p}": shape
    for i in range(2)
    for p, shape in (("q_proj", (64, 64)), ("v_proj", (32, 64)))
}


def random_adapter(seed: int, rank: int = 4, scale: float = 2.0) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    mods = {
        k: LoraModule(torch.randn(rank, d_in, generator=g) / 8, torch.randn(d_out, rank, generator=g) / 8, scale)
        for k, (d_out, d_in) in MODULES.items()
    }
    return LoraAdapter(mods, f"a{seed}")


def near(adapter: LoraAdapter, seed: int, noise: float = 0.3) -> LoraAdapter:
    """A task similar to `adapter`: same A, B perturbed (cosine ≈ 1/√(1+noise²))."""
    g = torch.Generator().manual_seed(seed)
    mods = {
        k: LoraModule(m.A.clone(), m.B + noise * m.B.std() * torch.randn(m.B.shape, generator=g), m.scale)
        for k, m in adapter.modules.items()
    }
    return LoraAdapter(mods, f"near{seed}")


def dense_cos(x: LoraAdapter, y: LoraAdapter) -> float:
    names = set(x.modules) | set(y.modules)
    tot = 0.0
    for k in names:
        if k in x.modules and k in y.modules:
            tot += float(
                torch.nn.functional.cosine_similarity(
                    x.modules[k].delta().flatten(), y.modules[k].delta().flatten(), dim=0
                )
            )
    return tot / len(names)


# ----------------------------------------------------------------------------- adapters


def test_factored_inner_products_equal_dense():
    a, b = random_adapter(1), random_adapter(2, rank=6, scale=0.5)
    for k in MODULES:
        dense = float((a.modules[k].delta() * b.modules[k].delta()).sum())
        assert module_inner(a.modules[k], b.modules[k]) == pytest.approx(dense, rel=1e-4)
    assert similarity(a, b) == pytest.approx(dense_cos(a, b), abs=1e-5)
    assert similarity(a, a) == pytest.approx(1.0, abs=1e-6)
    assert a.norm() == pytest.approx(math.sqrt(sum(float(d.square().sum()) for d in a.dense().values())), rel=1e-5)
    # A module only one adapter has counts as cosine 0 in the mean.
    partial = LoraAdapter({k: m for k, m in a.modules.items() if "q_proj" in k})
    assert similarity(a, partial) == pytest.approx(0.5, abs=1e-6)


def test_lowrank_sum_is_exact_then_eckart_young():
    a, b = (
        random_adapter(1).modules["model.layers.0.self_attn.q_proj"],
        random_adapter(2).modules["model.layers.0.self_attn.q_proj"],
    )
    dense = 0.25 * a.delta() + 0.75 * b.delta()
    exact = lowrank_sum([(0.25, a), (0.75, b)], rank=None)
    assert exact.rank == 8 and exact.scale == 1.0
    torch.testing.assert_close(exact.delta(), dense, atol=1e-5, rtol=1e-4)
    cut = lowrank_sum([(0.25, a), (0.75, b)], rank=3)
    s = torch.linalg.svdvals(dense)
    assert float((cut.delta() - dense).norm()) == pytest.approx(float(s[3:].norm()), rel=1e-3)
    torch.testing.assert_close(dense_to_lora(dense, 3).delta(), cut.delta(), atol=1e-5, rtol=1e-4)


def test_peft_layout_round_trip(tmp_path):
    a = random_adapter(3)
    a.modules["model.layers.1.self_attn.v_proj"] = dense_to_lora(torch.randn(32, 64), 2)  # another rank and scale
    save_adapter(a, tmp_path / "task", base_model="base", extra_files={"heldout.txt": "hello"})
    cfg = json.loads((tmp_path / "task" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["rank_pattern"] == {"model.layers.1.self_attn.v_proj": 2}
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "task" / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in f.keys()
    b = load_adapter(tmp_path / "task")
    assert b.name == "task" and set(b.modules) == set(a.modules)
    for k in a.modules:
        torch.testing.assert_close(b.modules[k].delta(), a.modules[k].delta())


def _write_peft(path, cfg, tensors):
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def test_peft_reader_scales_and_refusals(tmp_path):
    A, B = torch.randn(4, 8), torch.randn(6, 4)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{key}.lora_A.weight": A, f"{key}.lora_B.weight": B}
    _write_peft(tmp_path / "rs", {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True}, tensors)
    assert load_adapter(tmp_path / "rs").modules["model.layers.0.self_attn.q_proj"].scale == pytest.approx(8 / 2)
    _write_peft(
        tmp_path / "pat", {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "alpha_pattern": {"q_proj": 2}}, tensors
    )
    assert load_adapter(tmp_path / "pat").modules["model.layers.0.self_attn.q_proj"].scale == pytest.approx(0.5)
    _write_peft(tmp_path / "dora", {"peft_type": "LORA", "r": 4, "use_dora": True}, tensors)
    with pytest.raises(ValueError, match="DoRA"):
        load_adapter(tmp_path / "dora")
    _write_peft(tmp_path / "bias", {"peft_type": "LORA", "r": 4}, {**tensors, f"{key}.lora_B.bias": torch.zeros(6)})
    with pytest.raises(ValueError, match="not a lora_A/lora_B weight"):
        load_adapter(tmp_path / "bias")
    _write_peft(tmp_path / "rank", {"peft_type": "LORA", "r": 8}, tensors)
    with pytest.raises(ValueError, match="rank 4 but the config says 8"):
        load_adapter(tmp_path / "rank")
    with pytest.raises(FileNotFoundError):
        load_adapter(tmp_path)


# ----------------------------------------------------------------------------- the pool

# Four task families a, b, c, d (independent random adapters); a2 is a's similar sibling, etc.
FAMILY = {f: random_adapter(seed) for f, seed in zip("abcd", (11, 22, 33, 44))}
SIBLINGS = {f"{f}{i}": (FAMILY[f] if i == 1 else near(FAMILY[f], 100 * i + ord(f))) for f in "abcd" for i in (1, 2, 3)}


def _stream(order):
    return [(t, SIBLINGS[t]) for t in order]


def test_planted_similarities():
    assert similarity(SIBLINGS["a1"], SIBLINGS["a2"]) > 0.9
    assert abs(similarity(SIBLINGS["a1"], SIBLINGS["b1"])) < 0.1


def test_kmerge_first_k_take_slots_then_merge_into_most_similar():
    pool = AdapterPool(k=4)
    decisions = stream(pool, _stream(["a1", "b1", "c1", "d1", "a2", "c2", "b2", "d2", "a3"]))
    assert [d.action for d in decisions] == ["new"] * 4 + ["merge"] * 5
    assert pool.task_slot == {"a1": 0, "b1": 1, "c1": 2, "d1": 3, "a2": 0, "c2": 2, "b2": 1, "d2": 3, "a3": 0}
    assert pool.slots[0].tasks == ["a1", "a2", "a3"] and len(pool.slots) == 4


def test_kmerge_plain_fills_free_slots_even_with_a_similar_one():
    pool = AdapterPool(k=3)
    stream(pool, _stream(["a1", "a2", "b1", "b2"]))
    # K-Merge without ++: a2 takes a free slot although a1 is its twin; b2 must merge.
    assert pool.task_slot == {"a1": 0, "a2": 1, "b1": 2, "b2": 2}


def test_kmerge_plus_plus_threshold_merges_similar_early():
    pool = AdapterPool(k=4, threshold=0.5)
    decisions = stream(pool, _stream(["a1", "a2", "b1", "c1", "b2", "d1", "c2", "d2"]))
    assert pool.task_slot == {"a1": 0, "a2": 0, "b1": 1, "c1": 2, "b2": 1, "d1": 3, "c2": 2, "d2": 3}
    assert decisions[1].action == "merge" and decisions[5].action == "new"


def test_running_mean_is_the_mean_of_the_tasks():
    # merge_rank large enough to be exact: the slot's Δ is the plain mean of its tasks' Δ.
    pool = AdapterPool(k=1, merge_rank=12)
    stream(pool, _stream(["a1", "a2", "a3"]))
    for k in MODULES:
        mean = sum(SIBLINGS[t].modules[k].delta() for t in ("a1", "a2", "a3")) / 3
        torch.testing.assert_close(pool.slots[0].adapter.modules[k].delta(), mean, atol=1e-5, rtol=1e-4)
    # Default: the slot keeps its rank (4) and so its size.
    pool = AdapterPool(k=1)
    stream(pool, _stream(["a1", "b1"]))
    assert pool.slots[0].adapter.rank == 4 and pool.nbytes == SIBLINGS["a1"].nbytes


def test_byte_budget_is_never_exceeded():
    one = SIBLINGS["a1"].nbytes
    pool = AdapterPool(k=None, budget_bytes=int(2.5 * one))
    decisions = stream(pool, _stream(["a1", "b1", "c1", "a2", "d1"]))
    assert [d.action for d in decisions] == ["new", "new", "merge", "merge", "merge"]
    assert len(pool.slots) == 2 and pool.nbytes <= 2.5 * one
    big = random_adapter(5, rank=12)  # 3× the bytes: cannot have a slot, but merges at the slot's rank
    assert pool.add("big", big).action == "merge" and pool.nbytes <= 2.5 * one
    empty = AdapterPool(k=None, budget_bytes=int(2.5 * one))
    d = empty.add("big", big)
    assert d.action == "reject" and "larger than the whole budget" in d.reason and empty.adapter_for("big") is None
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add("a1", SIBLINGS["a1"])


def test_pool_refuses_to_break_its_limits():
    pool = AdapterPool(k=2)
    stream(pool, _stream(["a1", "b1"]))
    pool.slots.append(pool.slots[0])  # corrupt it: the next arrival's check must fire
    with pytest.raises(AssertionError, match="> K"):
        pool.add("c1", SIBLINGS["c1"])


def test_opcm_merge_keeps_norm_at_mean_of_task_norms():
    pool = AdapterPool(k=1, merge="opcm")
    stream(pool, _stream(["a1", "b1", "c1"]))
    norms = [SIBLINGS[t].norm() for t in ("a1", "b1", "c1")]
    assert pool.slots[0].adapter.norm() == pytest.approx(sum(norms) / 3, rel=1e-4)
    assert pool.slots[0].adapter.rank == 4 and pool.slots[0].lam > 1


def _cos_metric(own):
    # A stand-in task metric: 1 + cosine between the served adapter and the task's own (base: 1).
    return lambda adapter, task: 1.0 if adapter is None else 1.0 + similarity(adapter, own[task])


def test_quality_gate_keeps_good_merges_and_rejects_bad_ones():
    own = {t: SIBLINGS[t] for t in ("a1", "a2", "b1")}
    pool = AdapterPool(k=1, gate=0.9, evaluate=_cos_metric(own))
    decisions = stream(pool, _stream(["a1", "a2", "b1"]))
    assert [d.action for d in decisions] == ["new", "merge", "reject"]
    assert min(decisions[1].gate.values()) >= 0.9
    assert pool.adapter_for("b1") is None and pool.slots[0].tasks == ["a1", "a2"]
    # With a free slot (K-Merge++ made it try a merge first), the refused adapter takes it.
    pool = AdapterPool(k=2, threshold=-1.0, gate=0.9, evaluate=_cos_metric(own))
    decisions = stream(pool, _stream(["a1", "b1"]))
    assert decisions[1].action == "new" and "refused" in decisions[1].reason


def test_scores_are_merged_over_own():
    own = {t: SIBLINGS[t] for t in ("a1", "b1", "a2")}
    pool = AdapterPool(k=2)
    stream(pool, list(own.items()))
    per_task = scores(pool, own, _cos_metric(own))
    assert per_task["b1"]["score"] == pytest.approx(1.0) and per_task["a2"]["slot"] == 0
    assert 0.9 < per_task["a2"]["score"] < 1.0 and per_task["a1"]["base_score"] == pytest.approx(0.5)
    assert 0.5 < mean_score(per_task) <= 1.0


# ----------------------------------------------------------------------------- training and the CLI


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kfam")
    base, _ = make_tiny_family(root, n_variants=1)
    return root, base


def test_lora_training_lowers_loss_and_leaves_model_unchanged(tiny):
    _, base = tiny
    model = load_model(base)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.tensor(list(b"abcabcabd" * 200))
    cfg = lora.LoraConfig(
        rank=4, alpha=8, steps=25, lr=1e-2, batch=4, seq_len=32, targets=("q_proj", "v_proj", "up_proj")
    )
    adapter, rec = lora.train(model, tokens, cfg, progress=False)
    assert rec["loss_last_5"] < rec["loss_first"] - 0.5
    assert set(adapter.modules) == {
        f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj")
    }
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.endswith("q_proj"))
    # Applying the adapter changes outputs and is undone exactly.
    x = tokens[:33][None]
    y0 = model(x)
    with lora.applied(model, adapter):
        y1 = model(x)
    assert not torch.allclose(y0, y1) and torch.equal(model(x), y0)


def test_lora_applied_matches_wrapped_forward(tiny):
    _, base = tiny
    model = load_model(base)
    wrapped = lora.inject(model, ("q_proj", "v_proj", "down_proj"), rank=4, alpha=8, seed=0)
    for w in wrapped.values():
        w.lora_B.data.normal_(0, 0.05)
    x = torch.randint(0, 256, (2, 16))
    y_wrapped = model(x)
    adapter = lora.eject(model, wrapped)
    with lora.applied(model, adapter):
        torch.testing.assert_close(model(x), y_wrapped, atol=1e-5, rtol=1e-4)


def test_kmerge_cli_on_trained_adapters(tiny, capsys):
    root, base = tiny
    texts = {"ab": b"ab" * 800, "abx": (b"ab" * 7 + b"x") * 100, "qz": b"qqz" * 600}
    dirs = []
    for task, data in texts.items():
        (root / f"{task}.txt").write_bytes(data)
        out = root / "adapters" / task
        assert (
            main(
                [
                    "merge",
                    "train-lora",
                    "--base",
                    str(base),
                    "--text",
                    str(root / f"{task}.txt"),
                    "--heldout",
                    str(root / f"{task}.txt"),
                    "--out",
                    str(out),
                    "--rank",
                    "4",
                    "--steps",
                    "15",
                    "--lr",
                    "1e-2",
                    "--seq-len",
                    "32",
                ]
            )
            == 0
        )
        dirs.append(str(out))
    capsys.readouterr()
    assert (
        main(["kmerge", "--base", str(base), "--adapters", *dirs, "--k", "2", "--windows", "4", "--seq-len", "32"]) == 0
    )
    out = capsys.readouterr().out
    assert "mean score (pool acc / own acc)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in texts}
    assert rows["ab"][1] == "0" and rows["abx"][1] == "1" and rows["qz"][1] in ("0", "1")
    alone = "abx" if rows["qz"][1] == "0" else "ab"
    assert float(rows[alone][5]) == pytest.approx(1.0)  # alone in its slot: served = own
    assert (
        main(
            [
                "kmerge",
                "--base",
                str(base),
                "--adapters",
                *dirs,
                "--budget",
                "1B",
                "--json",
                "--windows",
                "2",
                "--seq-len",
                "32",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert [d["action"] for d in report["decisions"]] == ["reject"] * 3 and report["bytes"] == 0
    assert main(["kmerge", "--base", str(base), "--adapters", str(root)]) == 1
    assert "not a LoRA adapter directory" in capsys.readouterr().err


def test_report_rendering_from_results(tmp_path):
    """The report's tables, computed notes and plots from a results dict (no model runs)."""
    from bitdelta.merge import report

    tasks = ["a1", "b1", "a2", "b2"]
    acc_own = {t: 0.5 for t in tasks}
    cfgs = []
    for label, opts, groups, sc in (
        ("K=4 (every task its own)", {"k": 4}, [["a1"], ["b1"], ["a2"], ["b2"]], 1.0),
        ("K-Merge K=2", {"k": 2}, [["a1", "a2"], ["b1", "b2"]], 0.95),
        ("K=2 + quality gate 0.97", {"k": 2, "gate": 0.97}, [["a1", "a2"], ["b1"]], 0.9),
    ):
        per = {t: {"slot": 0, "acc": 0.5 * sc, "ppl": 10.0, "score": sc, "ppl_ratio": sc} for t in tasks}
        dec = [
            {
                "task": t,
                "action": "reject" if (t == "b2" and "gate" in opts) else "new",
                "slot": 0,
                "reason": "",
                "max_similarity": None,
                "gate": {},
            }
            for t in tasks
        ]
        cfgs.append(
            {
                "label": label,
                "options": opts,
                "slots": len(groups),
                "bytes": 1000 * len(groups),
                "groups": groups,
                "decisions": dec,
                "per_task": per,
                "mean_score": sc,
                "mean_ppl_ratio": sc,
            }
        )
    km = {
        "windows": 2,
        "seq_len": 8,
        "stream": tasks,
        "tasks": {"a1": ["x", ["p"]], "a2": ["x", ["q"]], "b1": ["y", ["p"]], "b2": ["y", ["q"]]},
        "adapter_bytes": 1000,
        "lora": {"rank": 8, "targets": ["q_proj"], "alpha": 16, "steps": 2, "batch": 1, "seq_len": 8, "lr": 0.1},
        "training": {t: {"loss_first": 2.0, "loss_last_5": 1.0, "seconds": 1.0} for t in tasks},
        "similarity": [[1, 0.01, 0.3, 0.02], [0.01, 1, 0.0, 0.4], [0.3, 0.0, 1, 0.03], [0.02, 0.4, 0.03, 1]],
        "own": {t: {"acc": acc_own[t], "ppl": 10.0} for t in tasks},
        "base": {t: {"acc": 0.4, "ppl": 12.0} for t in tasks},
        "configs": cfgs,
        "base_mean_score": 0.8,
    }
    vs = ["v", "w"]
    split = lambda ppl: {"ppl": ppl, "nll": 0.0, "tokens": 1}
    ms = {
        "windows": 2,
        "seq_len": 8,
        "rule": "entropy",
        "variants": vs,
        "base": {"v": split(10.0), "w": split(20.0)},
        "finetuned": {"v": {"v": split(6.0), "w": split(22.0)}, "w": {"v": split(11.0), "w": split(25.0)}},
        "monosoup": {"v": {"v": split(7.0), "w": split(21.0)}, "w": {"v": split(10.5), "w": split(26.0)}},
        "layers": {v: {"k_median": 3, "rank_median": 8, "lambda_high_mean": 0.9} for v in vs},
    }
    report._plot_kmerge(km, tmp_path / "kmerge.png")
    report._plot_monosoup(ms, tmp_path / "monosoup.png")
    text = report.write_readme({"kmerge": km, "monosoup": ms}, tmp_path).read_text()
    assert "| v | 10.00 | 6.00 | 7.00 | 75% |" in text  # gain kept (10 − 7) / (10 − 6)
    assert "| w | 20.00 | 25.00 | 26.00 | n/a (fine-tune ≥ base) |" in text
    assert "its sibling for 4 of 4 tasks" in text
    assert "rejected 1 adapters (b2)" in text and "mean 0.900 vs 0.950 without the gate" in text
    assert (tmp_path / "kmerge.png").stat().st_size > 10_000 and (tmp_path / "monosoup.png").stat().st_size > 10_000
