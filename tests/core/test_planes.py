"""Compression beyond one sign plane (bitdelta.planes, format v3): residual planes, a low-rank
residual and per-column α round-trip through the file exactly, each part lowers the error, a byte
budget is kept and spent where it helps most, scale distillation tunes every part, and a v3 file
that lies about its parts fails verification."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bitdelta.checkpoint import CheckpointReader
from bitdelta.compress import apply, compress
from bitdelta.format import (
    DeltaFormatError,
    load_delta,
    read_header,
    split_role,
    verify,
)
from bitdelta.model import attach_delta, load_model
from bitdelta.planes import (
    KindKL,
    PlaneConfig,
    best_plane,
    chain,
    feedback_plane,
    input_moments,
    kind,
    kind_kl,
    spend,
)
from bitdelta_kernels.bits import unpack_signs
from tests.support.cli import run_cli


def _error(base, ft, delta, moments: dict[str, torch.Tensor] | None = None) -> float:
    """Σ ‖W_ft − (W_base + Δ̂)‖² over the projections; with `moments` (E[x xᵀ] per weight), the
    output error Σ_n e_n H e_nᵀ instead."""
    total = 0.0
    with CheckpointReader(base) as rb, CheckpointReader(ft) as rf:
        for name in rf.keys():
            if ".layers." in name and name.endswith("proj.weight"):
                cw = delta.compressed.get(name)
                e = rf.get(name).float() - rb.get(name).float() - (cw.dense() if cw is not None else 0)
                total += float((e @ moments[name] * e).sum() if moments is not None else e.square().sum())
    return total


def test_split_role_names_every_part():
    assert split_role("sign") == ("sign", 1) and split_role("alpha") == ("alpha", 1)
    assert split_role("sign2") == ("sign", 2) and split_role("alpha13") == ("alpha", 13)
    assert split_role("lowrank_u") == ("lowrank_u", 0) and split_role("dense") == ("dense", 0)
    for bad in ("sign1", "sign02", "signs", "alpha0", "weight", "lowrank"):
        assert split_role(bad) is None, bad


@pytest.mark.parametrize(
    "cfg",
    [
        PlaneConfig(planes=3),
        PlaneConfig(alpha="col"),
        PlaneConfig(alpha="auto", planes=2, rank=8, rank_step=4),
    ],
    ids=["3-planes", "col", "auto-2-planes-rank-8"],
)
def test_parts_round_trip_and_serve_like_apply(family, tmp_path, cfg):
    """The file holds exactly the parts asked for (v3), apply writes W_base + Σ α_i ⊙ S_i + U·V
    computed from the file's own tensors, and the compact model's kernel path equals apply's."""
    base, (v0, _) = family
    out = compress(base, v0, tmp_path / "d.st", planes=cfg, progress=False)
    h = verify(out)
    assert h.metadata["format_version"] == "3"
    delta = load_delta(out)
    for name, cw in delta.compressed.items():
        assert len(cw.planes) == cfg.planes and cw.rank == min(cfg.rank, *cw.shape), name
        if cfg.alpha == "col":
            assert cw.planes[0].axis == "col" and cw.alpha.shape == (cw.shape[1],)
    dense = apply(base, out, tmp_path / "a", progress=False)
    with CheckpointReader(base) as rb, CheckpointReader(dense) as ra:
        for name, cw in delta.compressed.items():
            want = rb.get(name).float()
            for p in cw.planes:
                s = unpack_signs(p.signs, cw.shape[1], torch.float32)
                want = want + s * (p.alpha[None, :] if p.axis == "col" else p.alpha[:, None])
            if cw.rank:
                want = want + cw.u.float() @ cw.v.float()
            torch.testing.assert_close(ra.get(name), want, atol=1e-6, rtol=0)
    ids = torch.randint(0, 250, (2, 13), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(attach_delta(load_model(base), delta)(ids), load_model(dense)(ids), atol=1e-5, rtol=1e-4)


def test_each_plane_and_rank_lowers_the_error(family, tmp_path):
    base, (v0, _) = family
    errors = []
    for i, cfg in enumerate(
        [PlaneConfig(), PlaneConfig(planes=2), PlaneConfig(planes=3), PlaneConfig(planes=3, rank=8)]
    ):
        errors.append(
            _error(base, v0, load_delta(compress(base, v0, tmp_path / f"{i}.st", planes=cfg, progress=False)))
        )
    assert errors[0] > errors[1] > errors[2] > errors[3], errors
    assert errors[1] < 0.5 * errors[0]  # the second plane takes out much of the first one's error


def test_auto_alpha_picks_the_axis_the_delta_has():
    g = torch.Generator().manual_seed(0)
    signs = torch.where(torch.rand(64, 96, generator=g) > 0.5, 1.0, -1.0)
    w = torch.ones(96)
    by_col = signs * torch.linspace(0.1, 2.0, 96)[None, :]
    by_row = signs * torch.linspace(0.1, 2.0, 64)[:, None]
    assert best_plane(by_col, w, "auto")[0].axis == "col"
    assert best_plane(by_row, w, "auto")[0].axis == "row"
    assert best_plane(signs * 0.3, w, "auto")[0].axis in ("row", "matrix", "col")  # all exact: any
    plane, gain = best_plane(by_col, w, "col")
    assert gain == pytest.approx(float(by_col.square().sum()), rel=1e-5)  # exact: all of the error removed


def test_budget_is_kept_and_goes_to_the_hard_matrix():
    """One matrix with a large Gaussian delta and one small, exactly sign-shaped one: both keep
    plane 1, the extra planes go to the hard one, and a budget short of one plane each is refused."""
    g = torch.Generator().manual_seed(1)
    easy = torch.where(torch.rand(32, 64, generator=g) > 0.5, 0.01, -0.01)
    hard = torch.randn(32, 64, generator=g)
    cfg = PlaneConfig(planes=3)
    plane_bytes = 32 * 8 + 32 * 4

    def chains():
        return {"easy": chain(easy, cfg), "hard": chain(hard, cfg)}

    got = spend(chains(), 3 * plane_bytes)
    assert len(got["hard"].planes) == 2 and len(got["easy"].planes) == 1
    assert sum(cw.nbytes for cw in got.values()) <= 3 * plane_bytes
    got = spend(chains(), 4 * plane_bytes + 10)
    assert len(got["hard"].planes) == 3 and len(got["easy"].planes) == 1
    got = spend(chains(), None)
    assert len(got["hard"].planes) == 3 and len(got["easy"].planes) == 3
    with pytest.raises(ValueError, match="less than one sign plane per weight"):
        spend(chains(), 2 * plane_bytes - 1)


def test_budget_of_the_whole_file(family, tmp_path):
    base, (v0, _) = family
    plain = read_header(compress(base, v0, tmp_path / "p.st", progress=False))
    tensors = sum(t.nbytes for t in plain.tensors)
    calib = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(4))
    budget = int(tensors * 1.4)
    cfg = PlaneConfig(alpha="auto", planes=3, rank=8, rank_step=4, budget=budget)
    h = read_header(compress(base, v0, tmp_path / "b.st", planes=cfg, calibration=calib, progress=False))
    assert tensors < sum(t.nbytes for t in h.tensors) and (tmp_path / "b.st").stat().st_size <= budget
    assert max(h.bytes_by_plane()) >= 2
    with pytest.raises(ValueError, match="less than the delta's dense tensors"):
        compress(base, v0, tmp_path / "x.st", planes=PlaneConfig(planes=2, budget=10), progress=False)


def test_a_distilled_file_keeps_its_budget(family, tmp_path):
    """The distillation record written after compression fits the budget (RECORD_RESERVE): a
    budget a few bytes above the file every option makes, distilled, stays within it; a record
    beyond the reserve is refused by check_budget."""
    from bitdelta import distill as d
    from bitdelta.compress import RECORD_RESERVE, check_budget

    base, (v0, _) = family
    cfg = PlaneConfig(alpha="auto", planes=2)
    everything = compress(base, v0, tmp_path / "all.st", planes=cfg, progress=False).stat().st_size
    budget = everything + 16  # every option fits with room for no record
    out = compress(base, v0, tmp_path / "b.st", planes=replace(cfg, budget=budget), progress=False)
    assert out.stat().st_size <= budget - RECORD_RESERVE
    calib = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(5))
    delta, _ = d.distill(
        base, v0, load_delta(out), calib, d.DistillConfig(steps=2, lr=1e-4, batch=2, seq_len=16), progress=False
    )
    d.save(delta, tmp_path / "d.st")
    assert (tmp_path / "d.st").stat().st_size <= budget
    check_budget(tmp_path / "d.st", budget)
    delta.meta.distilled["note"] = "x" * 4 * RECORD_RESERVE
    d.save(delta, tmp_path / "big.st")
    with pytest.raises(ValueError, match="over its budget"):
        check_budget(tmp_path / "big.st", budget)


def _kinds_chains(cfg: PlaneConfig, scale: dict[str, tuple[float, float]]) -> dict:
    g = torch.Generator().manual_seed(2)
    return {
        f"model.layers.{i}.{k}.weight": chain(torch.randn(32, 64, generator=g) * scale[k][i], cfg)
        for i in range(2)
        for k in scale
    }


def test_a_measured_budget_leaves_out_whole_kinds_worth_least_kl_per_byte():
    """Whole kinds go first, the least measured KL per byte of the kind first; only the last kind
    needed goes in part, its weak weight (least output gain) first. A down_proj with a tiny delta
    stays although its share of down_proj's KL is below anything q_proj's weights are worth."""
    scale = {"self_attn.q_proj": (1, 3), "self_attn.k_proj": (1, 3), "mlp.down_proj": (0.01, 5)}
    kl = {
        "model.layers.*.self_attn.q_proj.weight": KindKL(0.01),
        "model.layers.*.self_attn.k_proj.weight": KindKL(0.02),
        "model.layers.*.mlp.down_proj.weight": KindKL(0.5),
    }
    one = _kinds_chains(PlaneConfig(), scale)["model.layers.0.mlp.down_proj.weight"].cost(0)  # all cost the same

    def left_out(budget: int) -> list[str]:
        chains = _kinds_chains(PlaneConfig(), scale)
        kept = spend(chains, budget, kl)
        assert sum(cw.nbytes for cw in kept.values()) <= budget
        return sorted(set(chains) - set(kept))

    assert left_out(6 * one) == []
    assert left_out(5 * one) == ["model.layers.0.self_attn.q_proj.weight"]
    assert left_out(3 * one) == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert left_out(2 * one) == [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    with pytest.raises(ValueError, match="leaves no weight its sign plane"):
        spend(_kinds_chains(PlaneConfig(), scale), one - 1, kl)
    assert kind("model.layers.12.mlp.up_proj.weight") == "model.layers.*.mlp.up_proj.weight"


def test_a_measured_budget_trades_a_cheap_plane_1_for_a_dear_plane_2():
    """At the bytes of plane 1 everywhere, down_proj's plane 2 (measured to remove 0.2) beats
    q_proj's plane 1 (worth 0.01): q_proj is left out, down_proj gets two planes; by output error
    alone every weight keeps plane 1. Bytes past the measured blocks go by output gain."""
    scale = {"self_attn.q_proj": (1, 1), "mlp.down_proj": (1, 1)}
    cfg = PlaneConfig(planes=3)
    kl = {
        "model.layers.*.self_attn.q_proj.weight": KindKL(0.01, 0.001),
        "model.layers.*.mlp.down_proj.weight": KindKL(0.5, 0.2),
    }
    one = _kinds_chains(cfg, scale)["model.layers.0.mlp.down_proj.weight"].cost(0)  # every option costs the same
    got = spend(_kinds_chains(cfg, scale), 4 * one, kl)
    assert sorted(got) == ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    assert all(len(cw.planes) == 2 for cw in got.values())
    got = spend(_kinds_chains(cfg, scale), 4 * one)
    assert len(got) == 4 and all(len(cw.planes) == 1 for cw in got.values())
    got = spend(_kinds_chains(cfg, scale), 7 * one, kl)  # three blocks whole, q_proj's plane 2 in part
    assert sorted(len(cw.planes) for cw in got.values()) == [1, 2, 2, 2]
    got = spend(_kinds_chains(cfg, scale), 9 * one, kl)  # all four blocks (8), then one plane 3
    assert sorted(len(cw.planes) for cw in got.values()) == [2, 2, 2, 3]


def test_kind_kl_measures_what_each_kind_s_plane_is_worth(family):
    """Each kind's number is KL(ft ‖ base + the plane 1 of every weight but that kind's) −
    KL(ft ‖ base + every plane 1), recomputed here through attach_delta and the evaluator."""
    from bitdelta.evaluate import kl_per_token
    from bitdelta.format import CompressedWeight, Delta, load_delta

    base, (v0, _) = family
    chains = {}
    with CheckpointReader(base) as rb, CheckpointReader(v0) as rf:
        for name in rf.keys():
            if ".layers." in name and name.endswith("proj.weight"):
                chains[name] = chain(rf.get(name).float() - rb.get(name).float(), PlaneConfig(planes=2))
    calib = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(5))
    ft = load_model(v0)
    kl = kind_kl(load_model(base), ft, chains, calib, windows=2, seq_len=32)
    assert set(kl) == {kind(n) for n in chains} and len(kl) == 7
    meta = load_delta(compress(base, v0, Path(str(base) + "-kk.st"), progress=False)).meta
    x = torch.stack([calib[s : s + 32] for s in torch.linspace(0, calib.numel() - 33, 2).long().tolist()])
    ref = ft(x).float().log_softmax(-1)

    def measured(names, two=()) -> float:
        cws = {n: CompressedWeight(chains[n].planes[: 2 if n in two else 1], chains[n].shape) for n in names}
        d = Delta(meta, cws, {})
        return float(kl_per_token(ref, attach_delta(load_model(base), d)(x).float().log_softmax(-1)).mean())

    every = measured(chains)
    for k in ("model.layers.*.self_attn.q_proj.weight", "model.layers.*.mlp.down_proj.weight"):
        want = measured([n for n in chains if kind(n) != k]) - every
        assert kl[k].plane1 == pytest.approx(want, rel=1e-3, abs=1e-7), k
        want = every - measured(chains, two=[n for n in chains if kind(n) == k])
        assert kl[k].second == pytest.approx(want, rel=1e-3, abs=1e-7), k


def test_a_budget_below_one_plane_each_leaves_kinds_out(family, tmp_path):
    """drop: a file budget below plane 1 of every weight is met by leaving weights out (named in
    the metadata with the KL each kind was measured to cost); the file fits, header included, and
    serves like apply. Without drop, the same budget is refused."""
    base, (v0, _) = family
    plain = compress(base, v0, tmp_path / "p.st", progress=False)
    budget = int(plain.stat().st_size * 0.93)
    calib = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(4))
    cfg = PlaneConfig(alpha="auto", planes=2, budget=budget, drop=True)
    out = compress(base, v0, tmp_path / "d.st", planes=cfg, calibration=calib, progress=False)
    assert out.stat().st_size <= budget
    delta = load_delta(out)
    gone = json.loads(delta.meta.extra["left_out"])
    assert gone and len(json.loads(delta.meta.extra["kl_without_plane1"])) == 7
    assert len(json.loads(delta.meta.extra["kl_second_option"])) == 7
    assert not set(gone) & set(delta.compressed) and len(delta.compressed) + len(gone) == 14  # 2 layers x 7
    dense = apply(base, out, tmp_path / "a", progress=False)
    ids = torch.randint(0, 250, (2, 13), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(attach_delta(load_model(base), delta)(ids), load_model(dense)(ids), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="less than one sign plane per weight"):
        compress(base, v0, tmp_path / "x.st", planes=PlaneConfig(planes=2, budget=budget), progress=False)
    with pytest.raises(ValueError, match="needs calibration tokens"):
        compress(base, v0, tmp_path / "y.st", planes=cfg, progress=False)


def test_distillation_tunes_every_plane_and_the_factors(family, tmp_path):
    from bitdelta import distill as d

    base, (v0, _) = family
    out = compress(
        base, v0, tmp_path / "d.st", planes=PlaneConfig(alpha="auto", planes=2, rank=4, rank_step=4), progress=False
    )
    before = load_delta(out)
    calib = torch.randint(0, 250, (4000,), generator=torch.Generator().manual_seed(0))
    cfg = d.DistillConfig(steps=4, lr=5e-4, batch=2, seq_len=32)
    delta, record = d.distill(base, v0, before, calib, cfg, progress=False)
    assert record["trained"] == "alpha and low-rank factors"
    d.save(delta, tmp_path / "out.st")
    after = load_delta(tmp_path / "out.st")
    for k, cw in after.compressed.items():
        b = before.compressed[k]
        assert [p.axis for p in cw.planes] == [p.axis for p in b.planes]
        for p, q in zip(cw.planes, b.planes):
            assert torch.equal(p.signs, q.signs), k
            assert not torch.equal(p.alpha, q.alpha), k
        assert cw.u.dtype == torch.float16 and not torch.equal(cw.u, b.u), k


def _rewrite_metadata(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header["__metadata__"])
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


def test_v3_files_that_lie_about_their_parts_fail(family, tmp_path):
    base, (v0, _) = family
    out = compress(base, v0, tmp_path / "d.st", planes=PlaneConfig(planes=2, rank=4, rank_step=4), progress=False)
    parts = json.loads(read_header(out).metadata["parts"])
    name = next(iter(parts))

    def one_plane(md):
        md["parts"] = json.dumps({**parts, name: {"axes": ["row"], "rank": 4}})

    def col_alpha(md):
        md["parts"] = json.dumps({**parts, name: {"axes": ["col", "row"], "rank": 4}})

    def as_v2(md):
        md["format_version"] = "2"

    def no_plane(md):  # no plane is only for a weight with a rank (an imported LoRA module)
        md["parts"] = json.dumps({**parts, name: {"axes": [], "rank": 0}})

    for edit, match in (
        (one_plane, "not a part the metadata gives"),
        (col_alpha, "expected float32"),
        (as_v2, "must end in"),
        (no_plane, "needs a sign plane or a rank"),
    ):
        bad = tmp_path / f"{edit.__name__}.st"
        bad.write_bytes(out.read_bytes())
        _rewrite_metadata(bad, edit)
        with pytest.raises(DeltaFormatError, match=match):
            verify(bad)
    # a delta of one plane of row α stays v2: what older tools and the worker read
    assert read_header(compress(base, v0, tmp_path / "p.st", progress=False)).metadata["format_version"] == "2"


def test_cli_compress_with_a_budget(family, tmp_path):
    base, (v0, _) = family
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog " * 200)
    out = tmp_path / "c.st"
    plain = sum(t.nbytes for t in read_header(compress(base, v0, tmp_path / "p.st", progress=False)).tensors)
    code, text = run_cli(
        "compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--alpha", "auto",
        "--planes", "3", "--rank", "8", "--rank-step", "4", "--budget", str(plain * 3 // 2), "--calib", str(calib),
        "--distill", "--steps", "2",
    )  # fmt: skip
    assert code == 0, text
    assert out.stat().st_size <= plain * 3 // 2  # distilled, its record included
    assert "plane 2" in text and "low-rank" in text
    code, text = run_cli("inspect", str(out), "--json")
    info = json.loads(text[text.index("{") :])
    assert info["format_version"] == "3" and info["alpha_mode"] == "auto"
    assert sum(info["bytes_by_plane"].values()) == info["bytes"]["signs"] + info["bytes"]["alpha"]
    code, text = run_cli("verify", str(out), "--base", str(base))
    assert code == 0 and "OK" in text
    code, text = run_cli("compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--budget", "lots")
    assert code != 0 and "--budget must be" in text
    code, text = run_cli("compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--loss", "l1")
    assert code != 0 and "loss must be one of mse, kl" in text
    code, text = run_cli(
        "compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--budget", "1/100"
    )
    assert code != 0 and "less than the delta's dense tensors" in text
    code, text = run_cli("compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--feedback")
    assert code != 0 and "need calibration tokens" in text
    code, text = run_cli(
        "compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--feedback", "--calib", str(calib)
    )
    assert code == 0, text
    assert read_header(out).metadata["format_version"] == "2"  # one plane of row α: the file the worker serves
    code, text = run_cli(
        "compress", "--base", str(base), "--finetuned", str(v0), "--out", str(out), "--feedback", "--alpha", "col",
        "--calib", str(calib),
    )  # fmt: skip
    assert code != 0 and "one α per row" in text


def test_compressed_embeddings_keep_row_scales(family, tmp_path):
    """A tied embedding's planes scale tokens (rows) whatever --alpha says: a scale per column gives
    every token the changed tokens' scale (on the hard member: the head's logits became noise)."""
    base, (v0, _) = family
    cfg = PlaneConfig(alpha="col", planes=2)
    delta = load_delta(compress(base, v0, tmp_path / "e.st", embeddings="sign", planes=cfg, progress=False))
    emb = delta.compressed["model.embed_tokens.weight"]
    assert [p.axis for p in emb.planes] == ["row", "row"]
    assert all(cw.planes[0].axis == "col" for k, cw in delta.compressed.items() if "layers" in k)


def _correlated_inputs(n: int, d_in: int, seed: int) -> torch.Tensor:
    """n inputs [n, d_in] with the strongly correlated, unequal channels of a transformer's."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d_in, d_in, generator=torch.Generator().manual_seed(99)) / d_in**0.5
    scale = torch.logspace(0, -1.5, d_in)
    return (torch.randn(n, d_in, generator=g) * scale) @ mix


def _out_err(r: torch.Tensor, approx: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ (r - approx).T).square().sum())


def test_feedback_plane_with_uncorrelated_inputs_is_bitdelta():
    """h = I: no column's error has anywhere to go, so the signs are sign(r) and α = mean|r|."""
    r = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    plane, removed = feedback_plane(r, torch.eye(40))
    assert torch.equal(plane.signs, best_plane(r, torch.ones(40), "row")[0].signs)
    torch.testing.assert_close(plane.alpha, r.abs().mean(1))
    assert plane.axis == "row" and removed == pytest.approx(float((r.abs().mean(1) ** 2).sum() * 40), rel=1e-5)


def test_feedback_plane_lowers_the_output_error_on_unseen_inputs_too():
    """On correlated inputs the error-feedback plane's output error is well below BitDelta's plane
    (sign(r), α = mean|r| weighed by E[x²]), both on the inputs it was fitted to and on fresh ones
    from the same distribution, and the error it reports removing is what it removes."""
    r = torch.randn(32, 48, generator=torch.Generator().manual_seed(2))
    x = _correlated_inputs(2000, 48, seed=3)
    h = x.T @ x / len(x)
    fresh = _correlated_inputs(2000, 48, seed=4)
    plain, _ = best_plane(r, h.diagonal(), "row")
    fb, removed = feedback_plane(r, h)

    def dense(p):
        return unpack_signs(p.signs, 48, torch.float32) * p.scale()

    for inputs in (x, fresh):
        assert _out_err(r, dense(fb), inputs) < 0.7 * _out_err(r, dense(plain), inputs)
    total = float((x @ r.T).square().sum()) / len(x)
    assert removed == pytest.approx(total - _out_err(r, dense(fb), x) / len(x), rel=1e-4)
    assert (fb.signs != plain.signs).any()  # it did choose other signs


def test_embedding_moments_weigh_a_head_by_its_inputs_and_a_tied_table_by_both_its_roles():
    """An untied head: its inputs' moments; an untied table (a lookup): none, so sign(Δ); a tied
    pair: TIED_HEAD_SHARE of the head's moments and the rest the lookup's identity, each at mean
    diagonal 1."""
    from bitdelta.planes import TIED_HEAD_SHARE, embedding_moments

    x = torch.randn(500, 6, generator=torch.Generator().manual_seed(0)) * torch.arange(1.0, 7.0)
    head = x.T @ x / len(x)
    assert embedding_moments("lm_head.weight", head, tied=False) is head
    assert embedding_moments("model.embed_tokens.weight", head, tied=False) is None
    h = embedding_moments("model.embed_tokens.weight", head, tied=True)
    want = TIED_HEAD_SHARE * head / head.diagonal().mean() + (1 - TIED_HEAD_SHARE) * torch.eye(6)
    torch.testing.assert_close(h, want)
    assert h.diagonal().mean().item() == pytest.approx(1.0)


def test_feedback_compresses_to_the_same_kind_of_file_with_less_output_error(family, tmp_path):
    """PlaneConfig(feedback=True): every projection still one row-α plane (a v2 file the worker
    serves as today, apply equal to the kernel path), the sum of the projections' output errors on
    the calibration inputs lower than plain BitDelta's; refused without calibration or with
    another α axis."""
    base, (v0, _) = family
    calib = torch.randint(0, 250, (6000,), generator=torch.Generator().manual_seed(4))
    plain = load_delta(compress(base, v0, tmp_path / "p.st", progress=False))
    out = compress(base, v0, tmp_path / "f.st", planes=PlaneConfig(feedback=True), calibration=calib, progress=False)
    assert verify(out).metadata["format_version"] == "2"
    fb = load_delta(out)
    assert set(fb.compressed) == set(plain.compressed)
    # the header says how the signs were chosen, and `bitdelta inspect` shows it
    from bitdelta.inspect_report import text

    assert fb.meta.extra["signs"] == "feedback" and "signs" not in plain.meta.extra
    assert ", chosen by error feedback" in text(out) and "chosen by" not in text(tmp_path / "p.st")
    h = input_moments(load_model(base), calib)
    # a random tiny model's inputs are nearly uncorrelated: ~10 % lower
    assert _error(base, v0, fb, h) < 0.95 * _error(base, v0, plain, h)
    dense = apply(base, out, tmp_path / "a", progress=False)
    ids = torch.randint(0, 250, (2, 13), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(attach_delta(load_model(base), fb)(ids), load_model(dense)(ids), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="need calibration tokens"):
        compress(base, v0, tmp_path / "x.st", planes=PlaneConfig(feedback=True), progress=False)
    with pytest.raises(ValueError, match="one α per row"):
        PlaneConfig(alpha="auto", feedback=True)
