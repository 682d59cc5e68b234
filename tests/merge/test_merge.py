"""MonoSoup, the brief's SVD soup and OPCM: the formulas on hand-computed matrices,
then whole checkpoints of a tiny random family through the library and the CLI."""

import pytest
import torch

from bitdelta.checkpoint import CheckpointReader, read_config
from bitdelta.cli import main
from bitdelta.merge import monosoup as ms
from bitdelta.merge import opcm, svdsoup
from bitdelta.model import load_model
from tests.support.family import make_tiny_family


def _rotations(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q1, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q1, q2


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return make_tiny_family(tmp_path_factory.mktemp("fam"), n_variants=3)


# ----------------------------------------------------------------------------- MonoSoup

# Δ = Q1 diag(10, 1, 0.5, 0.25) Q2ᵀ, worked by hand:
#   p = σ/Σσ = (0.85106, 0.08511, 0.04255, 0.02128), entropy H = 0.56320, exp(H) = 1.7563 -> k = 2
#   P_2 = (100 + 1) / 101.3125 = 0.99692; ρ = (0.5/10)² = 0.0025; cos α = √(1 − P_2) = 0.05554
#   λ_low = 0.0025 + 0.9975 · 0.05554 = 0.05790; λ_high = 0.94210
# energy rule (≥ 0.8 of Σσ²): 100/101.3125 = 0.98705 already -> k = 1
#   P_1 = 0.98705; ρ = (1/10)² = 0.01; cos α = 0.11382; λ_low = 0.01 + 0.99 · 0.11382 = 0.12268
SIGMA = torch.tensor([10.0, 1.0, 0.5, 0.25], dtype=torch.float64)


def _planted(seed=0):
    q1, q2 = _rotations(4, seed)
    w0 = torch.randn(4, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return w0, q1, q2


@pytest.mark.parametrize("rule,k,lam_low", [("entropy", 2, 0.057900), ("energy", 1, 0.122682)])
def test_monosoup_matches_hand_computation(rule, k, lam_low):
    w0, q1, q2 = _planted()
    w1 = w0 + q1 @ torch.diag(SIGMA) @ q2.T
    w, info = ms.monosoup_matrix(w0, w1, rule=rule)
    assert info.k == k and info.rank == 4
    assert info.lambda_low == pytest.approx(lam_low, abs=1e-6)
    assert info.lambda_high == pytest.approx(1 - lam_low, abs=1e-6)
    hi = torch.diag(torch.where(torch.arange(4) < k, SIGMA, 0.0))
    lo = torch.diag(torch.where(torch.arange(4) >= k, SIGMA, 0.0))
    expected = w0 + q1 @ ((1 - lam_low) * hi + lam_low * lo) @ q2.T
    assert w.dtype == torch.float64
    torch.testing.assert_close(w, expected, atol=1e-5, rtol=0)


def test_monosoup_rank_one_full_rank_and_skips():
    w0 = torch.eye(3, dtype=torch.float64)  # fp64: fp32 round-off gives σ_2 ~ 1e-8 and k = 2
    # A rank-1 Δ: k = 1, P_1 = 1 -> cos α = 0, ρ ≈ 0 -> λ_low = 0, λ_high = 1: W = W1.
    u = torch.tensor([[1.0], [2.0], [2.0]], dtype=torch.float64) / 3
    w1 = w0 + 0.3 * u @ u.T
    w, info = ms.monosoup_matrix(w0, w1)
    assert info.k == 1 and info.lambda_high == pytest.approx(1.0)
    torch.testing.assert_close(w, w1)
    # Equal singular values: exp(H) = n exactly -> k = n (no rounding up past the rank).
    w, info = ms.monosoup_matrix(w0, w0 + 0.1 * torch.eye(3, dtype=torch.float64))
    assert info.k == 3 and info.lambda_low == 0.0
    # 1-D parameters and tiny deltas keep the fine-tuned values.
    v1 = torch.tensor([1.0, 2.0])
    assert ms.monosoup_matrix(torch.zeros(2), v1)[1].skipped == "1-D"
    w0 = torch.eye(3)
    w1 = w0 + 1e-8
    w, info = ms.monosoup_matrix(w0, w1)
    assert info.skipped == "tiny delta" and torch.equal(w, w1)


def test_monosoup_svd_in_fp32_for_half_inputs():
    w0, q1, q2 = _planted()
    w1 = w0 + q1 @ torch.diag(SIGMA) @ q2.T
    w, info = ms.monosoup_matrix(w0.bfloat16(), w1.bfloat16())
    assert w.dtype == torch.bfloat16 and info.k == 2


def test_monosoup_checkpoint(family, tmp_path):
    base, (ft, *_) = family
    out, record = ms.monosoup_checkpoint(base, ft, tmp_path / "mono", progress=False)
    with CheckpointReader(base) as r0, CheckpointReader(ft) as r1, CheckpointReader(out) as r:
        assert r.keys() == r1.keys()
        for name in r.keys():
            expected, info = ms.monosoup_matrix(r0.get(name), r1.get(name))
            torch.testing.assert_close(r.get(name), expected)
            if r1.get(name).dim() == 1:
                assert torch.equal(r.get(name), r1.get(name))
    assert (out / "tokenizer.json").is_file() and (out / "monosoup.json").is_file()
    mats = [v for v in record.values() if not v["skipped"]]
    assert mats and all(1 <= v["k"] <= v["rank"] and 0 <= v["lambda_low"] <= 1 for v in mats)
    load_model(out)  # a working checkpoint


def test_sharded_writer_round_trip(family, tmp_path):
    from bitdelta.merge.io import ShardedWriter

    base, _ = family
    with CheckpointReader(base) as r, ShardedWriter(tmp_path / "sharded", base, max_shard_bytes=40_000) as w:
        for name in r.keys():
            w.add(name, r.get(name))
        out = w.close()
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    with CheckpointReader(base) as a, CheckpointReader(out) as b:
        assert a.keys() == b.keys()
        assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


# ----------------------------------------------------------------------------- the brief's SVD soup


def test_svd_soup_hand_computed():
    # Rank 1 keeps each Δ's largest singular direction:
    #   Δ1 = diag(3, 1) -> diag(3, 0);  Δ2 = diag(0.5, 2) -> diag(0, 2);  mean = diag(1.5, 1)
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w1, w2 = w0 + torch.diag(torch.tensor([3.0, 1.0])), w0 + torch.diag(torch.tensor([0.5, 2.0]))
    out = svdsoup.svd_soup_tensor(w0, [w1, w2], rank=1)
    torch.testing.assert_close(out, w0 + torch.diag(torch.tensor([1.5, 1.0])))
    # Full rank: the plain average of the checkpoints.
    torch.testing.assert_close(svdsoup.svd_soup_tensor(w0, [w1, w2], rank=2), (w1 + w2) / 2)
    # 1-D: the mean of the deltas.
    v0 = torch.tensor([1.0, 1.0])
    torch.testing.assert_close(svdsoup.svd_soup_tensor(v0, [v0 + 1, v0 + 3], rank=1), v0 + 2)


def test_svd_soup_truncation_is_eckart_young():
    g = torch.Generator().manual_seed(3)
    d = torch.randn(12, 7, generator=g)
    t = svdsoup.truncate(d, 3)
    s = torch.linalg.svdvals(d)
    assert torch.linalg.matrix_rank(t) == 3
    assert float((d - t).norm()) == pytest.approx(float(s[3:].norm()), rel=1e-5)


def test_svd_soup_checkpoints_and_cli(family, tmp_path, capsys):
    base, variants = family
    out = tmp_path / "soup"
    assert (
        main(
            [
                "merge",
                "svd-soup",
                "--base",
                str(base),
                "--checkpoints",
                *map(str, variants),
                "--rank",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    with CheckpointReader(base) as r0, CheckpointReader(out) as r:
        readers = [CheckpointReader(v) for v in variants]
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            expected = svdsoup.svd_soup_tensor(r0.get(name), [x.get(name) for x in readers], 4)
            torch.testing.assert_close(r.get(name), expected)
    assert read_config(out) == read_config(variants[0])


def test_soup_hook_merges_with_best_every_n_steps(family):
    base, (v1, v2, _) = family
    model = load_model(base)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    params = dict(model.named_parameters())
    w0 = {k: params[k].detach().clone() for k in names}
    states = {1: load_model(v1).state_dict(), 2: load_model(v2).state_dict()}

    def set_state(i):
        for k in names:
            params[k].data.copy_(states[i][k])

    losses = iter([5.0, 4.0, 3.0])  # first call; then current, merged
    hook = svdsoup.SoupHook(w0, rank=2, every=10, evaluate=lambda: next(losses))
    set_state(1)
    assert hook(5, model) is None  # not a merge step
    assert hook(10, model)["kept"] == "current"
    set_state(2)
    rec = hook(20, model)
    assert rec == {"step": 20, "kept": "merged", "loss_best_before": 5.0, "loss_current": 4.0, "loss_merged": 3.0}
    for k in names:  # the model continues from the soup of best (v1) and current (v2)
        expected = svdsoup.svd_soup_tensor(w0[k], [states[1][k], states[2][k]], 2)
        torch.testing.assert_close(params[k].detach(), expected)
        torch.testing.assert_close(hook.best[k], expected)


def test_soup_hook_keeps_best_when_merge_is_worse(family):
    base, (v1, v2, _) = family
    model = load_model(base)
    name = "model.layers.1.self_attn.v_proj.weight"
    p = dict(model.named_parameters())[name]
    w0 = {name: p.detach().clone()}
    s1, s2 = load_model(v1).state_dict()[name], load_model(v2).state_dict()[name]
    losses = iter([1.0, 2.0, 3.0])
    hook = svdsoup.SoupHook(w0, rank=1, every=1, evaluate=lambda: next(losses))
    p.data.copy_(s1)
    hook(1, model)
    p.data.copy_(s2)
    assert hook(2, model)["kept"] == "best"
    torch.testing.assert_close(hook.best[name], s1)


# ----------------------------------------------------------------------------- OPCM


def _reference_project(tm, tt, alpha):
    """The formula as written: full SVD, P = Uᵀ τ V, zero diag and [:r, :r], U P Vᵀ."""
    u, s, vh = torch.linalg.svd(tm, full_matrices=True)
    r = int((s.cumsum(0) / s.sum() > alpha).float().argmax())
    p = u.T @ tt @ vh.T
    p.diagonal().zero_()
    p[:r, :r] = 0
    return u @ p @ vh


def test_opcm_projection_hand_computed():
    # τ_merged = diag(3, 1): U = V = I; cumsum(σ)/Σσ = (0.75, 1) > 0.5 first at index 0 -> r = 0,
    # so only the diagonal goes: τ̃ = [[0, 2], [3, 0]].
    tm, tt = torch.diag(torch.tensor([3.0, 1.0])), torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    torch.testing.assert_close(opcm.project(tm, tt), torch.tensor([[0.0, 2.0], [3.0, 0.0]]))
    # λ_2 = ‖τ_merged + τ̃‖ / mean(‖τ_1‖, ‖τ_2‖) = √23 / ((√10 + √30) / 2) = 1.11021
    m = opcm.OPCM()
    m.add({"w": tm})
    m.add({"w": tt})
    assert m.lam == pytest.approx(1.11021, abs=1e-5)
    torch.testing.assert_close(m.merged["w"], torch.tensor([[3.0, 2.0], [3.0, 1.0]]) / 1.1102100185)


@pytest.mark.parametrize("shape", [(9, 5), (5, 9), (7, 7)])
def test_opcm_thin_projection_equals_full_formula(shape):
    g = torch.Generator().manual_seed(1)
    tm, tt = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    for alpha in (0.3, 0.5, 0.8):
        got = opcm.project(tm.float(), tt.float(), alpha).double()
        torch.testing.assert_close(got, _reference_project(tm, tt, alpha), atol=1e-4, rtol=0)
        # and the zeroed coordinates really are zero in the merged vector's basis
        u, s, vh = torch.linalg.svd(tm)
        p = u.T @ got @ vh.T
        r = int((s.cumsum(0) / s.sum() > alpha).float().argmax())
        assert p.diagonal().abs().max() < 1e-4 and (r == 0 or p[:r, :r].abs().max() < 1e-4)


def test_opcm_norm_is_mean_of_task_norms():
    g = torch.Generator().manual_seed(2)
    m, norms = opcm.OPCM(), []
    for t in range(5):
        scale = 0.5 + t  # tasks of different sizes
        tau = {
            "a.weight": scale * torch.randn(16, 8, generator=g),
            "b.weight": scale * torch.randn(8, 8, generator=g),
            "norm.weight": scale * torch.randn(8, generator=g),
            "embed_tokens.weight": torch.randn(20, 8, generator=g),
        }
        norms.append(opcm.global_norm(tau.values()))
        m.add(tau)
        assert opcm.global_norm(m.merged.values()) == pytest.approx(sum(norms) / len(norms), rel=1e-5)
    with pytest.raises(AssertionError, match="invariant"):
        opcm.check_norm(2.0, 1.0)


def test_opcm_checkpoints_cli(family, tmp_path):
    base, variants = family
    out = tmp_path / "opcm"
    assert main(["merge", "opcm", "--base", str(base), "--checkpoints", *map(str, variants), "--out", str(out)]) == 0
    with CheckpointReader(base) as r0, CheckpointReader(out) as r:
        tau = [r.get(k).float() - r0.get(k).float() for k in r0.keys()]
        individual = []
        for v in variants:
            with CheckpointReader(v) as rv:
                individual.append(opcm.global_norm(rv.get(k).float() - r0.get(k).float() for k in r0.keys()))
    assert opcm.global_norm(tau) == pytest.approx(sum(individual) / len(individual), rel=1e-4)


def test_monosoup_cli_and_errors(family, tmp_path, capsys):
    base, (ft, *_) = family
    out = tmp_path / "m"
    assert (
        main(["merge", "monosoup", "--base", str(base), "--finetuned", str(ft), "--out", str(out), "--rule", "energy"])
        == 0
    )
    text = capsys.readouterr().out
    assert "re-weighted (rank rule energy)" in text and "wrote" in text
    assert main(["merge", "monosoup", "--base", str(tmp_path), "--finetuned", str(ft), "--out", str(out)]) == 1
    assert "not a checkpoint directory" in capsys.readouterr().err
