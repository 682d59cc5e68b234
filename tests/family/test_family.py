"""The real model family: corpora and their splits, the build's stamps, the
GGUF conversion (bit-exact; the session converts the base into the data
directory if it is not there yet, as `bitdelta family build` would), and
fine-tuning (every compressed weight moves: checked on a short real fine-tune
of the real base, and on every variant the data directory already holds)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from bitdelta import family
from bitdelta.arch import ModelArgs
from bitdelta.family import build as fb
from bitdelta.family import corpora

# --- corpora -------------------------------------------------------------------


@pytest.mark.parametrize("corpus", corpora.CORPORA)
def test_splits_are_disjoint_and_every_subset_has_heldout(corpus):
    train = corpora.documents(corpus, "train")
    held = corpora.documents(corpus, "heldout")
    assert train and held
    assert not {d.name for d in train} & {d.name for d in held}
    assert len(train) + len(held) == len(corpora.documents(corpus, "all"))
    for subset in corpora.subsets(corpus):
        n = len(corpora.documents(corpus, "all", [subset]))
        if n >= 2:
            assert corpora.documents(corpus, "heldout", [subset]), subset
    # No held-out text appears verbatim in the training text (whole documents are held out).
    train_text = corpora.text(corpus, "train")
    assert all(d.text not in train_text for d in held[:20])


def test_subsets_filter_by_prefix():
    nt = corpora.documents("kjv", "all", ["nt"])
    assert {d.subset for d in nt} == {"nt/gospels", "nt/acts", "nt/epistles", "nt/revelation"}
    assert nt[0].name == "Matthew 1" and nt[-1].name == "Revelation 22"
    assert len(corpora.documents("kjv", "all", ["ot"])) + len(nt) == 1189  # chapters in the KJV
    assert {d.name for d in corpora.documents("shakespeare", "all", ["history"])} >= {"henry_v", "richard_iii"}
    assert "asyncio" in corpora.subsets("stdlib")
    with pytest.raises(ValueError, match="known subsets"):
        corpora.documents("kjv", "train", ["apocrypha"])


def test_arithmetic_answers_are_exact_and_deterministic():
    probs = corpora.problems("heldout", ["add", "sub", "mul", "div"])
    assert len(probs) == 4 * 200
    for prompt, answer in probs:
        expr = prompt.removeprefix("Question: What is ").split("?")[0]
        value = eval(compile(ast.parse(expr, mode="eval"), "<p>", "eval"))  # only digits and + - * /
        assert float(answer) == value, prompt
    assert corpora.problems("heldout", ["word"])[:5] == corpora.problems("heldout", ["word"])[:5]
    train = {p for p, _ in corpora.problems("train")}
    assert not train & {p for p, _ in corpora.problems("heldout")}


def test_paths_follow_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BITDELTA_DATA", str(tmp_path))
    p = family.paths()
    assert p.root == tmp_path.resolve() and p.base == tmp_path.resolve() / "base"
    assert set(p.variants) == {"coder", "writer", "scripture", "math"}
    assert p.deltas["math"].name == "math.bitdelta.safetensors"
    assert family.SERVING_MODE == "row-sign-emb-gptq"
    assert p.delta_mode("math", family.SERVING_MODE) == p.deltas["math"]
    for mode in ("matrix", "row-distilled", "row-sign-emb", "row-sign-emb-distilled"):
        assert p.delta_mode("math", mode).parent == p.modes_dir


def test_serving_default_is_one_mode_of_the_report():
    """build() builds MODES[SERVING_MODE] into data/deltas/: BitDelta's one plane of per-row α with
    sign embeddings, its projections' signs by error feedback, undistilled."""
    from dataclasses import replace

    from bitdelta.family.modes import KL_LR, KL_STEPS, MODES, SERVING, Mode

    assert SERVING == MODES[family.SERVING_MODE] == Mode("row", "sign", False, feedback=True)
    assert SERVING == replace(MODES["row-sign-emb"], feedback=True)
    assert MODES["row-distilled"] == Mode("row", "dense", True)
    assert MODES["row-sign-emb-distilled"].plain and not SERVING.plain and not MODES["planes-15"].plain
    # each distilled sign-embedding mode has a twin distilled on KL at KL_LR for KL_STEPS
    for name in ("row-sign-emb-distilled", "planes-16-distilled", "row-sign-emb-16-distilled", "gptq-16-distilled"):
        assert MODES[name].loss == "mse" and MODES[name].lr is None and MODES[name].steps is None
        assert MODES[name + "-kl"] == replace(MODES[name], loss="kl", lr=KL_LR, steps=KL_STEPS)
    # the error-feedback modes are BitDelta's one plane of row α with other signs
    assert MODES["gptq-16"] == replace(MODES["row-sign-emb-16"], feedback=True)
    assert MODES["row-sign-emb-gptq-distilled"] == replace(MODES["row-sign-emb-distilled"], feedback=True)
    assert "row-distilled-kl" not in MODES


# --- build stamps (tiny family, no real model) ----------------------------------


def test_build_delta_is_skipped_when_stamped_and_redone_when_corrupted(tmp_path, capsys):
    from bitdelta.checkpoint import fingerprint
    from bitdelta.testing.family import make_base, make_finetune

    p = family.paths(tmp_path)
    make_base(p.base)
    make_finetune(p.base, p.finetuned["coder"], seed=1)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": fingerprint(p.base)})
    fb.write_stamp(p, "finetuned/coder", {"test": 1}, {"fingerprint": fingerprint(p.finetuned["coder"])})

    out = fb.build_delta(p, "coder", distill_steps=0)
    mtime = out.stat().st_mtime_ns
    fb.build_delta(p, "coder", distill_steps=0)
    assert out.stat().st_mtime_ns == mtime and "up to date" in capsys.readouterr().out

    data = bytearray(out.read_bytes())
    data[-1] ^= 0xFF
    out.write_bytes(bytes(data))
    fb.build_delta(p, "coder", distill_steps=0)
    assert "written" in capsys.readouterr().out
    from bitdelta.format import verify

    verify(out)  # rebuilt whole
    # Recipes compare as JSON (tuples in a config come back as lists).
    recipe = {"config": {"betas": (0.9, 0.95)}}
    fb.write_stamp(p, "finetuned/coder", recipe, {"fingerprint": fingerprint(p.finetuned["coder"])})
    assert fb.is_built(p, "finetuned/coder", recipe, p.finetuned["coder"], "checkpoint")
    assert not fb.is_built(p, "finetuned/coder", {"config": {"betas": (0.9, 0.99)}}, p.finetuned["coder"], "checkpoint")
    # A different recipe (another α mode, dense embeddings) also rebuilds.
    fb.build_delta(p, "coder", alpha="matrix", distill_steps=0)
    assert "written" in capsys.readouterr().out
    fb.build_delta(p, "coder", embeddings="dense", distill_steps=0)
    assert "written" in capsys.readouterr().out


def test_quick_build_keeps_a_full_fine_tune(tmp_path, capsys, monkeypatch):
    """--quick (the first run's recipe) accepts a fine-tune built with the full recipe; a
    full build does not accept a quick one (it is rebuilt)."""
    from dataclasses import replace

    from bitdelta.checkpoint import fingerprint
    from bitdelta.family import finetune as ftmod
    from bitdelta.family.finetune import FinetuneConfig
    from bitdelta.testing.family import make_base, make_finetune

    p = family.paths(tmp_path)
    make_base(p.base)
    make_finetune(p.base, p.finetuned["math"], seed=1)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": fingerprint(p.base)})
    full, quick = FinetuneConfig(), replace(FinetuneConfig(), steps=fb.QUICK_STEPS)
    assert quick.steps < full.steps
    fb.write_stamp(
        p, "finetuned/math", fb.finetune_recipe(p, "math", full), {"fingerprint": fingerprint(p.finetuned["math"])}
    )
    ran = []
    record = {"heldout_ppl_before": 2.0, "heldout_ppl_after": 1.0, "seconds": 0.0}
    monkeypatch.setattr(ftmod, "finetune", lambda *a, **k: ran.append(a) or dict(record))  # no real training
    assert fb.build_finetune(p, "math", quick, also_accept=(full,)) == p.finetuned["math"]
    assert not ran and f"up to date ({full.steps} steps)" in capsys.readouterr().out
    assert fb.finetuned_steps(p, "math") == full.steps
    fb.write_stamp(
        p, "finetuned/math", fb.finetune_recipe(p, "math", quick), {"fingerprint": fingerprint(p.finetuned["math"])}
    )
    fb.build_finetune(p, "math", full)
    assert len(ran) == 1 and ran[0][3] == full and fb.finetuned_steps(p, "math") == full.steps


def test_a_distilled_mode_reuses_its_compression_built_undistilled(tmp_path, monkeypatch):
    """The distilled twin of a mode already built undistilled starts from a copy of that file (its
    compression, with a budget's KL measurement, takes minutes on the real family): compress is not
    run again, the signs are the undistilled file's and the α's are tuned."""
    import bitdelta.compress
    from bitdelta.checkpoint import fingerprint
    from bitdelta.format import load_delta
    from bitdelta.planes import PlaneConfig
    from bitdelta.testing.family import make_base, make_finetune

    p = family.paths(tmp_path)
    make_base(p.base)
    make_finetune(p.base, p.finetuned["coder"], seed=1)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": fingerprint(p.base)})
    fb.write_stamp(p, "finetuned/coder", {"test": 1}, {"fingerprint": fingerprint(p.finetuned["coder"])})
    cfg = PlaneConfig(planes=2)
    plain = fb.build_delta(p, "coder", distill_steps=0, out=p.modes_dir / "coder.two.st", planes=cfg)

    def again(*args, **kwargs):
        raise AssertionError("compressed again")

    monkeypatch.setattr(bitdelta.compress, "compress", again)
    out = fb.build_delta(p, "coder", distill_steps=2, out=p.modes_dir / "coder.two-distilled.st", planes=cfg)
    d, u = load_delta(out), load_delta(plain)
    assert d.meta.distilled and set(d.compressed) == set(u.compressed)
    for k, cw in d.compressed.items():
        assert all(torch.equal(a.signs, b.signs) for a, b in zip(cw.planes, u.compressed[k].planes)), k
    assert any(not torch.equal(cw.alpha, u.compressed[k].alpha) for k, cw in d.compressed.items())
    # the KL twin reuses it too; its recipe names the loss and lr (an MSE recipe names no loss, so
    # the stamps of deltas distilled before the option stay valid)
    kl = fb.build_delta(
        p, "coder", distill_steps=2, out=p.modes_dir / "coder.two-kl.st", planes=cfg, loss="kl", lr=1e-4
    )
    assert "loss" not in fb.read_stamp(p, "deltas/coder.two-distilled.st")["recipe"]["distill"]
    assert {k: fb.read_stamp(p, "deltas/coder.two-kl.st")["recipe"]["distill"][k] for k in ("loss", "lr")} == {
        "loss": "kl",
        "lr": 1e-4,
    }
    k = load_delta(kl)
    assert k.meta.distilled["loss"] == "kl" and k.meta.distilled["lr"] == 1e-4
    assert any(not torch.equal(cw.alpha, d.compressed[n].alpha) for n, cw in k.compressed.items())
    with pytest.raises(AssertionError, match="compressed again"):  # another compression is not reused
        fb.build_delta(p, "coder", distill_steps=2, out=p.modes_dir / "coder.three.st", planes=PlaneConfig(planes=3))


def test_serving_delta_is_the_error_feedback_plane(tmp_path, capsys):
    """build_mode's default, the serving delta: into data/deltas/, stamped with its error-feedback
    recipe (undistilled, calibrated on the member's train split), one row-α plane per projection
    and the tied pair as signs, the same bytes as BitDelta's plane; it differs from BitDelta's signs
    and is closer to the fine-tune on held-out text."""
    from bitdelta.checkpoint import fingerprint
    from bitdelta.evaluate import score, windows
    from bitdelta.family.finetune import corpus_tokens
    from bitdelta.family.quality import merged_variant
    from bitdelta.format import load_delta, read_header
    from bitdelta.model import load_model
    from bitdelta.testing.family import make_base, make_finetune

    p = family.paths(tmp_path)
    make_base(p.base)
    make_finetune(p.base, p.finetuned["math"], seed=1)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": fingerprint(p.base)})
    fb.write_stamp(p, "finetuned/math", {"test": 1}, {"fingerprint": fingerprint(p.finetuned["math"])})

    out = fb.build_mode(p, "math")
    assert out == p.deltas["math"] and "written" in capsys.readouterr().out
    recipe = fb.read_stamp(p, "deltas/" + out.name)["recipe"]
    assert recipe["planes"]["feedback"] is True and recipe["planes"]["calibration"] == "arithmetic train split"
    assert "distill" not in recipe
    fb.build_mode(p, "math")
    assert "up to date" in capsys.readouterr().out
    plain = fb.build_delta(p, "math", distill_steps=0, out=tmp_path / "plain.safetensors")
    served, bitdelta = load_delta(out), load_delta(plain)
    assert not served.meta.distilled and served.meta.alpha_mode == "row" and served.meta.extra["embeddings"] == "sign"
    assert set(served.compressed) == set(bitdelta.compressed)
    assert read_header(out).bytes_by_role() == read_header(plain).bytes_by_role()  # the same bytes but the header's
    # every weight's signs by error feedback, the tied embedding/LM head's too
    assert all(not torch.equal(cw.signs, bitdelta.compressed[k].signs) for k, cw in served.compressed.items())

    wins = windows(corpus_tokens(p.base, "arithmetic", "heldout"), 4, 32)
    _, ref = score(load_model(p.finetuned["math"]), wins)
    kl_served, kl_bitdelta = (
        score(merged_variant(p.base, d), wins, ref_logp=ref)[0].kl_from_ref for d in (served, bitdelta)
    )
    assert kl_served < 0.9 * kl_bitdelta, (kl_served, kl_bitdelta)


def test_serving_delta_distils_projection_alphas_only(tmp_path):
    """BitDelta's one plane distilled (tied embedding/LM head as signs + α): distillation
    trains the projections' α's; the tied pair's one α stays mean|Δ| (attach_delta
    materialises the table and ties the head to it, so nothing there is trainable), and
    the model attach_delta builds equals the checkpoint `bitdelta apply` writes."""
    from bitdelta.checkpoint import fingerprint
    from bitdelta.compress import apply, compress
    from bitdelta.family.quality import merged_variant
    from bitdelta.format import load_delta
    from bitdelta.model import BitDeltaLinear, attach_delta, load_model
    from bitdelta.testing.family import make_base, make_finetune

    p = family.paths(tmp_path)
    make_base(p.base)
    make_finetune(p.base, p.finetuned["math"], seed=1)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": fingerprint(p.base)})
    fb.write_stamp(p, "finetuned/math", {"test": 1}, {"fingerprint": fingerprint(p.finetuned["math"])})

    out = fb.build_delta(p, "math", distill_steps=2)
    assert out == p.deltas["math"]
    delta = load_delta(out)
    undistilled = load_delta(
        compress(
            p.base, p.finetuned["math"], tmp_path / "u.safetensors", variant="math", embeddings="sign", progress=False
        )
    )
    emb = "model.embed_tokens.weight"
    assert delta.meta.extra["embeddings"] == "sign" and delta.meta.alpha_mode == "row"
    assert emb in delta.compressed and "lm_head.weight" not in delta.compressed  # one pair for the tied head
    assert not any(n.startswith(("model.embed_tokens", "lm_head")) for n in delta.dense)
    assert delta.meta.distilled["alpha_frozen"] == [emb]
    assert torch.equal(delta.compressed[emb].alpha, undistilled.compressed[emb].alpha)
    assert all(
        not torch.equal(cw.alpha, undistilled.compressed[k].alpha) for k, cw in delta.compressed.items() if k != emb
    )

    student = attach_delta(load_model(p.base), delta, trainable_alpha=True)
    trainable = {n for n, t in student.named_parameters() if t.requires_grad}
    assert trainable and all(n.endswith("_proj.alpha") for n in trainable)
    assert not isinstance(student.lm_head, BitDeltaLinear)
    assert student.lm_head.weight is student.model.embed_tokens.weight

    applied = load_model(apply(p.base, out, tmp_path / "applied", progress=False))
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged_variant(p.base, delta)(x), applied(x), rtol=1e-5, atol=1e-5)


def test_test_artifacts_are_cached_in_the_data_dir(tmp_path, monkeypatch, artifact_cache):
    """What the tests build from the real model is made once: a second session (or a
    concurrent one that finished first) gets the same directory without building."""
    monkeypatch.setenv("BITDELTA_DATA", str(tmp_path))
    built = []

    def build(d):
        built.append(d)
        (d / "x.txt").write_text("made once")

    first = artifact_cache("thing", {"a": 1}, build)
    assert first.parent == tmp_path / "test-cache" and (first / "x.txt").read_text() == "made once"
    assert artifact_cache("thing", {"a": 1}, lambda d: pytest.fail("rebuilt a cached artifact")) == first
    assert artifact_cache("thing", {"a": 2}, build) != first and len(built) == 2  # another key, another entry

    def fails(d):
        (d / "half.txt").write_text("")
        raise RuntimeError("crashed")

    with pytest.raises(RuntimeError):
        artifact_cache("broken", {}, fails)
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "test-cache").iterdir()) == ["thing", "thing"]


# --- the real family (needs `bitdelta family build`) ----------------------------

P = family.paths()


def _built(name: str, path: Path) -> bool:
    stamp = fb.read_stamp(P, name)
    return stamp is not None and path.exists()


CHECKED_TENSORS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.17.mlp.down_proj.weight",
    "model.layers.29.post_attention_layernorm.weight",
    "model.norm.weight",
]
CHECKED_CONFIG = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
    "rms_norm_eps",
)


@pytest.fixture(scope="session")
def gguf_state(artifact_cache):
    """The checked tensors and config values of the GGUF as transformers loads it (dequantising
    takes ~12 s on a quiet machine, a minute on a busy one), cached under <data>/test-cache/
    keyed by the GGUF's bytes and the transformers version."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    from bitdelta.family.convert import file_sha256, gguf_path, load_gguf_state

    def build(d: Path) -> None:
        state, cfg, _ = load_gguf_state()
        save_file({n: state[n].contiguous() for n in CHECKED_TENSORS}, str(d / "tensors.safetensors"))
        (d / "config.json").write_text(json.dumps({k: getattr(cfg, k) for k in CHECKED_CONFIG}))

    key = {
        "gguf_sha256": file_sha256(gguf_path()),
        "transformers": transformers.__version__,
        "tensors": CHECKED_TENSORS,
        "config": CHECKED_CONFIG,
    }
    d = artifact_cache("gguf-reference", key, build)
    return load_file(str(d / "tensors.safetensors")), json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("name", CHECKED_TENSORS)
def test_conversion_is_bit_exact(real_base, gguf_state, name):
    from bitdelta.checkpoint import CheckpointReader

    state, _ = gguf_state
    with CheckpointReader(P.base) as r:
        ours = r.get(name)
    ref = state[name]
    assert ours.dtype == ref.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), ref.contiguous().view(torch.int32))  # bit-exact, NaN-safe


def test_converted_config_matches_the_gguf(real_base, gguf_state):
    from bitdelta.checkpoint import read_config

    _, cfg = gguf_state
    ours = read_config(P.base)
    for key in CHECKED_CONFIG:
        assert ours[key] == cfg[key], key
    assert "quantization_config" not in ours
    assert (P.base / "tokenizer.json").is_file()


@pytest.fixture(scope="session")
def short_finetune(real_base, real_finetune_cache) -> Path:
    """Two real optimizer steps of the family's fine-tuning on the real base (seconds, not
    minutes; cached under <data>/test-cache/ by conftest's real_finetune_cache)."""
    from bitdelta.family.finetune import FinetuneConfig

    cfg = FinetuneConfig(steps=2, batch=1, seq_len=32, warmup=0, eval_windows=1)
    return real_finetune_cache(real_base, {"math": "arithmetic"}, cfg, delta=False) / "finetuned" / "math"


def test_every_compressed_weight_moves_in_fine_tuning(short_finetune):
    """Full-parameter fine-tuning: every projection of the short fine-tune, and of
    every variant already built in the data directory, differs from the base in
    (nearly) every element; built deltas compress exactly those projections."""
    from bitdelta.checkpoint import CheckpointReader, read_config
    from bitdelta.format import read_header

    names = sorted(ModelArgs.from_hf(read_config(P.base)).compressed_names())
    checked = {"short": short_finetune}
    checked.update({v: P.finetuned[v] for v in family.VARIANTS if _built(f"finetuned/{v}", P.finetuned[v])})
    for label, ckpt in checked.items():
        with CheckpointReader(P.base) as rb, CheckpointReader(ckpt) as rf:
            assert set(names) <= set(rf.keys())
            for name in names:
                delta = rf.get(name) - rb.get(name)
                assert (delta != 0).float().mean() > 0.99, (label, name)
        if label != "short" and P.deltas[label].is_file():
            # The serving default compresses the projections and the tied embedding/LM head.
            meta = read_header(P.deltas[label]).meta
            assert set(meta.shapes) == set(names) | {"model.embed_tokens.weight"}
            assert meta.extra["embeddings"] == "sign" and meta.alpha_mode == "row"


def test_the_hard_member_is_full_build_only(tmp_path):
    """bard: writer's corpus, 4x the steps at 3x the learning rate; a member of the family
    (paths, status, the quality report) but not of the serving four, and --quick refuses it."""
    from bitdelta.family.finetune import FinetuneConfig

    p = family.paths(tmp_path / "data")
    assert p.variants == tuple(family.VARIANTS) and "bard" not in p.variants
    assert p.members == (*family.VARIANTS, "bard") and p.corpus["bard"] == "shakespeare"
    cfg = fb.member_config("bard", FinetuneConfig())
    assert (cfg.lr, cfg.steps) == (3e-4, 4 * FinetuneConfig().steps)
    assert fb.member_config("writer", FinetuneConfig()) == FinetuneConfig()
    assert "finetuned/bard" in fb.status(tmp_path / "data")
    with pytest.raises(ValueError, match="full recipe only"):
        fb.build(["bard"], root=tmp_path / "data", quick=True)
