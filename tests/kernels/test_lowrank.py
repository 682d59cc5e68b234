"""The low-rank residual of a mixed batch (kernels.lowrank) against a float64 oracle."""

from __future__ import annotations

import pytest
import torch

from kernels import lowrank_delta_batched
from tests.support.kernel_cases import rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def factors(L=3, d_out=72, d_in=100, R=8, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(L, d_out, R, generator=g) * 0.05
    v = torch.randn(L, R, d_in, generator=g) * 0.05
    u[1, :, 5:] = 0  # slot 1: a rank-5 variant padded to R = 8
    v[1, 5:] = 0
    return u.to(dtype), v.to(dtype)


@pytest.mark.parametrize("f_dtype", [torch.float16, torch.float32], ids=["factors_fp16", "factors_fp32"])
@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows", [[1], [0, -1, 2, 1, 0], [2, 2, 2], [-1, -1]], ids=["one", "mixed", "one_variant", "none"]
)
def test_lowrank_matches_a_float64_oracle(rows, y_dtype, f_dtype):
    u, v = factors(dtype=f_dtype)
    rs = torch.tensor(rows)
    M = len(rows)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, 100, generator=g).to(y_dtype)
    y0 = torch.randn(M, 72, generator=g).to(y_dtype)
    want = y0.double().clone()
    for r, s in enumerate(rows):
        if s >= 0:
            want[r] += u[s].double() @ (v[s].double() @ x[r].double())
    y = y0.clone().to(DEV)
    out = lowrank_delta_batched(x.to(DEV), u.to(DEV), v.to(DEV), rs, y)
    assert out is y
    y = y.cpu()
    assert torch.equal(y[rs < 0], y0[rs < 0])  # rows without factors: untouched, bit for bit
    assert rel_err(y, want) <= TOL[y_dtype]


def test_lowrank_refuses_bad_shapes():
    u, v = factors()
    x, y = torch.randn(2, 100), torch.zeros(2, 72)
    with pytest.raises(ValueError, match="v_stack must be"):
        lowrank_delta_batched(x, u, v[:, :4], torch.tensor([0, 1]), y)
    with pytest.raises(ValueError, match=r"\[-1, 2\]"):
        lowrank_delta_batched(x, u, v, torch.tensor([0, 3]), y)
    with pytest.raises(ValueError, match="row_slots"):
        lowrank_delta_batched(x, u, v, torch.tensor([0]), y)
