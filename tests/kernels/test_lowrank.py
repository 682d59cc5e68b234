"""One variant's low-rank residual over a projection group (bitdelta_kernels.lowrank) against a float64 oracle."""

from __future__ import annotations

import pytest
import torch

from bitdelta_kernels import lowrank_delta
from tests.support.kernel_cases import rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda
D_IN = 100
SPLITS = (48, 16, 16)  # a q‖k‖v group's rows
RANKS = (6, 0, 3)  # k has no low-rank part


def group(dtype=torch.float16, seed=0):
    """The group's V's stacked [Σr, d_in] and (r0, c0, U) per matrix with a rank."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(sum(RANKS), D_IN, generator=g) * 0.05).to(dtype)
    us, r0, c0 = [], 0, 0
    for d, r in zip(SPLITS, RANKS):
        if r:
            us.append((r0, c0, (torch.randn(d, r, generator=g) * 0.05).to(dtype)))
        r0, c0 = r0 + d, c0 + r
    return v, us


@pytest.mark.parametrize("f_dtype", [torch.float16, torch.float32], ids=["factors_fp16", "factors_fp32"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [2], [0, 3]], ids=["all", "one", "some"])
def test_lowrank_matches_a_float64_oracle(rows, x_dtype, f_dtype):
    v, us = group(f_dtype)
    M, d_out = 4, sum(SPLITS)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, D_IN, generator=g).to(x_dtype)
    y0 = torch.randn(M, d_out, generator=g)
    want = y0.double().clone()
    t = x.double() @ v.double().t()
    for r0, c0, u in us:
        add = t[:, c0 : c0 + u.shape[1]] @ u.double().t()
        for r in range(M) if rows is None else rows:
            want[r, r0 : r0 + u.shape[0]] += add[r]
    y = y0.clone().to(DEV)
    idx = None if rows is None else torch.tensor(rows, device=DEV)
    out = lowrank_delta(x.to(DEV), v.to(DEV), [(r0, c0, u.to(DEV)) for r0, c0, u in us], y, idx)
    assert out is y
    y = y.cpu()
    untouched = [r for r in range(M) if rows is not None and r not in rows]
    assert torch.equal(y[untouched], y0[untouched])  # rows of other variants: bit for bit
    assert torch.equal(y[:, 48:64], y0[:, 48:64])  # the matrix without a rank adds nothing
    assert rel_err(y, want) <= 1e-6


def test_lowrank_refuses_bad_shapes():
    v, us = group()
    x, y = torch.randn(2, D_IN), torch.zeros(2, sum(SPLITS))
    with pytest.raises(ValueError, match="v must be"):
        lowrank_delta(x, v[:, :4], us, y)
    with pytest.raises(ValueError, match="does not fit"):
        lowrank_delta(x, v, [(70, 0, us[0][2])], y)
    with pytest.raises(ValueError, match="fp32"):
        lowrank_delta(x, v, us, y.half())
