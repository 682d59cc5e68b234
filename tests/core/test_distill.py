"""Distillation of the scales (bitdelta.distill): α alone moves, and the held-out logit MSE drops."""

from __future__ import annotations

import torch

from bitdelta.format import load_delta


def test_distillation_lowers_heldout_logit_mse(family, delta_file):
    from bitdelta import distill as d

    base, (v0, _) = family
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(0, 256, (4000,), generator=g)
    heldout = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(9))
    cfg = d.DistillConfig(steps=25, lr=5e-4, batch=4, seq_len=32)
    delta, record = d.distill(base, v0, load_delta(delta_file), calib, cfg, heldout, progress=False)
    assert record["heldout_mse_after"] < record["heldout_mse_before"] * 0.97, record
    assert delta.meta.distilled["steps"] == 25
    # Only α changed: signs and dense tensors are the same objects' values.
    before = load_delta(delta_file)
    for k, cw in delta.compressed.items():
        assert torch.equal(cw.signs, before.compressed[k].signs)
    assert any(not torch.equal(cw.alpha, before.compressed[k].alpha) for k, cw in delta.compressed.items())


def test_kl_loss_trains_on_the_report_s_metric(family, delta_file):
    """loss="kl": the run lowers the held-out KL(fine-tune ‖ ·) per token, its record says which loss,
    seed and warmup it ran with; an unknown loss is refused."""
    import pytest

    from bitdelta import distill as d

    base, (v0, _) = family
    calib = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    heldout = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(9))
    cfg = d.DistillConfig(steps=25, lr=5e-4, batch=4, seq_len=32, loss="kl", warmup=3, seed=2)
    delta, record = d.distill(base, v0, load_delta(delta_file), calib, cfg, heldout, progress=False)
    assert record["heldout_kl_after"] < record["heldout_kl_before"] * 0.97, record
    assert "heldout_mse_before" not in record and record["final_train_kl"] > 0
    assert {k: delta.meta.distilled[k] for k in ("loss", "seed", "warmup")} == {"loss": "kl", "seed": 2, "warmup": 3}
    with pytest.raises(ValueError, match="loss must be one of mse, kl"):
        d.DistillConfig(loss="l1")
