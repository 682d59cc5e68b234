"""The precision rule (bitdelta.precision): bf16 only where the hardware does bf16
natively, fp32 elsewhere, the override, and that training follows it and records it.

The suite itself runs with BITDELTA_CPU_PRECISION=fp32 (tests/conftest.py), i.e.
as on a CPU without bf16; these tests set the process's choice themselves (`choose`)."""

from __future__ import annotations

import pytest
import torch

from bitdelta import precision
from bitdelta_kernels import cpu_features


@pytest.fixture
def choose(monkeypatch):
    """precision.configure for one test: the process's choice comes back after it."""
    monkeypatch.setattr(precision, "_choice", precision.process_choice())
    return precision.configure


@pytest.fixture
def cpu_flags(choose, monkeypatch):
    """Pretend the CPU has the given flags (None: /proc/cpuinfo unreadable); auto rule."""
    choose("auto")

    def set_flags(flags, capability="AVX512"):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: None if flags is None else set(flags))
        monkeypatch.setattr(cpu_features, "torch_capability", lambda: capability)
        cpu_features.native_bf16.cache_clear()

    yield set_flags
    cpu_features.native_bf16.cache_clear()


def test_auto_uses_bf16_only_with_native_bf16(cpu_flags):
    cpu_flags({"sse2", "avx2", "fma"})  # the AVX2-only EPYC of the issue
    p = precision.cpu_precision()
    assert (p.name, p.source) == ("fp32", "cpu flags") and p.dtype == torch.float32
    assert "no native bf16" in p.reason
    for native, cap in (
        ({"avx512f", "avx512_bf16"}, "AVX512"),
        ({"amx_bf16", "avx512f"}, "AVX512"),
        ({"asimd", "bf16"}, "DEFAULT"),
    ):  # Arm: the "bf16" feature
        cpu_flags(native, cap)
        p = precision.cpu_precision()
        assert p.name == "bf16" and p.dtype == torch.bfloat16, native
    cpu_flags({"avx512f", "avx512bw"})  # AVX-512 without BF16 is not enough
    assert precision.cpu_precision().name == "fp32"
    cpu_flags({"avx512f", "avx512_bf16"}, "AVX2")  # torch held to AVX2 (ATEN_CPU_CAPABILITY=avx2): emulated
    p = precision.cpu_precision()
    assert p.name == "fp32" and "dispatches AVX2" in p.reason
    cpu_flags(None)
    p = precision.cpu_precision()
    assert p.name == "fp32" and "unreadable" in p.reason


def test_override(cpu_flags, choose):
    cpu_flags({"avx512f", "avx512_bf16"})
    choose("fp32")
    p = precision.cpu_precision()
    assert (p.name, p.source) == ("fp32", "env") and "forced by BITDELTA_CPU_PRECISION=fp32" in p.describe()
    cpu_flags({"avx2"})
    choose("BF16")
    p = precision.cpu_precision()
    assert p.name == "bf16" and "emulated" in p.reason  # allowed, but it says it is slow
    assert precision.cpu_precision("fp32").name == "fp32"  # an explicit choice wins over the process's
    assert precision.choice_from_env({precision.ENV: " BF16 "}) == "bf16"
    assert precision.choice_from_env({}) == "auto"
    with pytest.raises(ValueError, match="BITDELTA_CPU_PRECISION='fp16': use one of auto, fp32, bf16"):
        precision.choice_from_env({precision.ENV: "fp16"})
    with pytest.raises(ValueError, match="use one of auto, fp32, bf16"):
        choose("fp16")


def test_cli_flag_sets_the_process_choice(choose, capsys):
    """`bitdelta --cpu-precision` is the edge that sets the choice (its alias: the variable)."""
    from bitdelta import cli

    assert cli.main(["--cpu-precision", "bf16", "inspect", "/nonexistent.bitdelta.safetensors"]) == 1
    assert precision.process_choice() == "bf16"
    with pytest.raises(SystemExit):
        cli.main(["--cpu-precision", "fp16", "inspect", "x"])
    assert "--cpu-precision='fp16': use one of auto, fp32, bf16" in capsys.readouterr().err


def test_autocast_follows_the_rule(choose):
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    choose("fp32")
    with precision.autocast("cpu"):
        assert (a @ b).dtype == torch.float32
    choose("bf16")
    with precision.autocast(torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
    assert precision.precision_for("cuda").name == "bf16"


def test_serving_follows_the_training_rule(cpu_flags, choose):
    cpu_flags({"avx512f", "avx512_bf16"})
    assert precision.serving_dtype("cpu").torch_name == "bfloat16"  # native bf16: bf16 weights
    assert precision.serving_dtype("cuda").torch_name == "bfloat16"
    assert precision.serving_dtype("cpu", "fp32").torch_name == "float32"
    cpu_flags({"avx2", "fma"}, capability="AVX2")
    assert precision.serving_dtype("cpu").torch_name == "float32"  # no native bf16: never emulated
    assert precision.serving_dtype("cpu", "bf16").torch_name == "bfloat16"  # asked for
    choose("fp32")
    assert precision.serving_dtype(torch.device("cpu")).torch_name == "float32"


def test_finetune_and_distill_record_the_precision_and_agree(tmp_path, choose):
    """The choice changes only the matmuls' rounding: fp32 and bf16 distillation of the
    same tiny delta improve the held-out logit MSE (measured in fp32) by nearly the
    same amount, and each run records what it used."""
    from bitdelta import distill as d
    from bitdelta.compress import compress
    from bitdelta.family.finetune import FinetuneConfig, finetune
    from bitdelta.format import load_delta
    from bitdelta.testing.family import make_base, make_finetune

    base = make_base(tmp_path / "base")
    choose("fp32")
    ft = tmp_path / "ft"
    rec = finetune(
        base,
        "arithmetic",
        ft,
        FinetuneConfig(steps=2, batch=2, seq_len=16, warmup=0, eval_windows=1, lr=1e-3),
        progress=False,
    )
    assert rec["precision"]["precision"] == "fp32" and "config" in rec and "autocast" not in rec["config"]
    # Distil a tiny variant with a structured shift (a real gain to recover).
    ft = make_finetune(base, tmp_path / "ft2", seed=1)
    delta = load_delta(compress(base, ft, tmp_path / "v.safetensors", variant="v", progress=False))
    calib = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    heldout = d.token_windows(calib.flip(0), 16, 8, seed=1)
    cfg = d.DistillConfig(steps=8, lr=3e-4, batch=2, seq_len=16)
    rec = {}
    for name in ("fp32", "bf16"):
        choose(name)
        _, rec[name] = d.distill(base, ft, delta, calib, cfg, heldout=heldout, progress=False)
        assert rec[name]["precision"]["precision"] == name
    before = rec["fp32"]["heldout_mse_before"]
    assert rec["bf16"]["heldout_mse_before"] == before  # evaluation is fp32 either way
    gain = {k: before - r["heldout_mse_after"] for k, r in rec.items()}
    assert gain["fp32"] > 0 and gain["bf16"] > 0
    assert abs(gain["bf16"] - gain["fp32"]) <= 0.1 * gain["fp32"]  # measured here: 1 % apart


def test_family_recipes_do_not_depend_on_the_precision(tmp_path, choose):
    """A family built on a CPU without bf16 (fp32) is reused as is on one with it: the
    precision is recorded in the build's result, never in the recipe that decides a rebuild."""
    import json

    from bitdelta import family
    from bitdelta.family import build as fb
    from bitdelta.family.finetune import FinetuneConfig

    p = family.paths(tmp_path)
    fb.write_stamp(p, "base", {"test": 1}, {"fingerprint": "b"})
    fb.write_stamp(p, "finetuned/math", {"test": 1}, {"fingerprint": "f"})
    recipes = []
    for name in ("fp32", "bf16"):
        choose(name)
        recipes.append(
            json.dumps(
                [
                    fb.finetune_recipe(p, "math", FinetuneConfig()),
                    fb.delta_recipe(p, "math", "row", "sign", fb.DISTILL_STEPS),
                ],
                sort_keys=True,
            )
        )
    assert recipes[0] == recipes[1]
