"""Paged decode attention (bitdelta_kernels.paged_attention) on a grid of shapes: the Triton kernel (the
interpreter on CPU, compiled on CUDA), the C kernel (CPU) and the torch reference against a
float64 loop over each sequence's own tokens. The pool's rows that no sequence owns are NaN, so a
read outside a sequence's blocks or past its length turns its output into NaN; block tables are
shuffled and padded, lengths ragged (a partial last block, one token, a window that starts inside a
block)."""

from __future__ import annotations

import math

import pytest
import torch

from bitdelta_kernels.dispatch import HAVE_TRITON
from bitdelta_kernels.paged_attention import paged_decode, paged_decode_ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def case(B, H, KV, D, bs, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    n_blocks = sum(need) + 3
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables = torch.zeros(B, max(need) + 2, dtype=torch.int32)  # padded: entries past a length are never read
    for b, k in enumerate(need):
        blocks, perm = perm[:k], perm[k:]
        tables[b, :k] = torch.tensor(blocks, dtype=torch.int32)
    rows = n_blocks * bs
    k = torch.full((rows, KV, D), math.nan)
    v = torch.full((rows, KV, D), math.nan)
    for b, n in enumerate(lens):  # only a sequence's own tokens hold numbers
        for t in range(n):
            r = int(tables[b, t // bs]) * bs + t % bs
            k[r] = torch.randn(KV, D, generator=g)
            v[r] = torch.randn(KV, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return (q.to(dtype), k.to(dtype), v.to(dtype), tables, lens_t)


def naive(q, k, v, tables, lens, bs, window, scale=None, softcap=None):
    B, H, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    G = H // k.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        ts = [t for t in range(n) if window is None or t > n - 1 - window]
        rows = [int(tables[b, t // bs]) * bs + t % bs for t in ts]
        for h in range(H):
            kk = k[rows, h // G].double()
            vv = v[rows, h // G].double()
            s = kk @ q[b, h].double() * scale
            p = torch.softmax(s if softcap is None else torch.tanh(s / softcap) * softcap, 0)
            out[b, h] = p @ vv
    return out


GRID = [
    # B, H, KV, D, bs, lens, window
    (1, 4, 4, 16, 16, [1], None),
    (3, 8, 2, 64, 16, [17, 5, 40], None),
    (4, 6, 2, 24, 5, [11, 1, 30, 10], None),  # block size and head dim not powers of two
    (2, 4, 1, 32, 8, [37, 9], 12),  # a sliding window starting inside a block
    (2, 4, 4, 16, 4, [3, 20], 4),
    (2, 6, 3, 16, 16, [150, 64], None),  # the C kernel's chunks of 16 keys: nine and a part; exactly four
    (1, 4, 2, 8, 7, [200], 90),  # a window that starts inside a chunk and a block
    (2, 8, 2, 128, 16, [70, 3], None),  # D of 8 AVX-512 vectors (16 AVX2 ones: key_parts_any)
]


def backends():
    out = ["torch"]
    if DEV.type == "cpu":
        out += ["cpu", "cpu-avx2"]  # the host's C build and the AVX2 one (D of 4 and 8 AVX2 vectors)
    if HAVE_TRITON:
        out.append("triton")
    return out


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("B,H,KV,D,bs,lens,window", GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reads_only_each_sequences_tokens(backend, B, H, KV, D, bs, lens, window, dtype):
    q, k, v, tables, lens_t = case(B, H, KV, D, bs, lens, dtype)
    want = naive(q.float(), k.float(), v.float(), tables, lens_t, bs, window)
    q, k, v, tables, lens_t = (t.to(DEV) for t in (q, k, v, tables, lens_t))
    if backend == "torch":
        # the reference reads every padded position: the NaN rows are masked, but NaN · 0 is NaN
        # in SDPA's product, so it gets a pool whose unowned rows are zero
        k, v = k.nan_to_num(), v.nan_to_num()
    if backend == "cpu-avx2":
        from bitdelta_kernels import cpu_build
        from bitdelta_kernels.settings import configured

        with configured(cpu_isa="avx2"):
            assert cpu_build.load_cpu_lib() is not None, cpu_build.unavailable_reason
            got = paged_decode(q, k, v, tables, lens_t, bs, window, backend="cpu")
    else:
        got = paged_decode(q, k, v, tables, lens_t, bs, window, backend=backend)
    assert got.dtype == dtype and got.shape == (B, H, D)
    assert torch.isfinite(got).all(), "read a row it does not own"
    err = (got.double().cpu() - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("B,H,KV,D,bs,lens,window", [GRID[1], GRID[3], GRID[5]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_and_soft_capped_scores(backend, B, H, KV, D, bs, lens, window, dtype):
    """Gemma's attention: another scale than 1/√D (query_pre_attn_scalar) and Gemma 2's scores capped
    by cap · tanh(s / cap), a cap small enough to change every softmax."""
    q, k, v, tables, lens_t = case(B, H, KV, D, bs, lens, dtype, seed=3)
    scale, cap = 0.37, 1.5
    want = naive(q.float(), k.float(), v.float(), tables, lens_t, bs, window, scale, cap)
    assert (want - naive(q.float(), k.float(), v.float(), tables, lens_t, bs, window, scale)).abs().max() > 0.05
    q, k, v, tables, lens_t = (t.to(DEV) for t in (q, k, v, tables, lens_t))
    if backend == "torch":
        k, v = k.nan_to_num(), v.nan_to_num()
    kw = dict(scale=scale, softcap=cap)
    if backend == "cpu-avx2":
        from bitdelta_kernels import cpu_build
        from bitdelta_kernels.settings import configured

        with configured(cpu_isa="avx2"):
            assert cpu_build.load_cpu_lib() is not None, cpu_build.unavailable_reason
            got = paged_decode(q, k, v, tables, lens_t, bs, window, backend="cpu", **kw)
    else:
        got = paged_decode(q, k, v, tables, lens_t, bs, window, backend=backend, **kw)
    assert torch.isfinite(got).all(), "read a row it does not own"
    err = (got.double().cpu() - want).abs().max() / want.abs().max()
    assert err < TOL[dtype], float(err)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode(q, k, v, tables, lens_t, bs, window, softcap=0.0)


def test_the_reference_and_the_dispatch_agree_on_an_empty_batch():
    q = torch.empty(0, 4, 8)
    k = torch.zeros(16, 2, 8)
    t = torch.zeros(0, 1, dtype=torch.int32)
    n = torch.zeros(0, dtype=torch.int32)
    assert paged_decode(q, k, k, t, n, 8).shape == (0, 4, 8)
    assert paged_decode_ref(q, k, k, t, n, 8).shape == (0, 4, 8)


def test_bad_shapes_are_refused():
    q = torch.zeros(2, 6, 8)
    k = torch.zeros(16, 4, 8)  # 6 heads over 4 KV heads: not a multiple
    t = torch.zeros(2, 2, dtype=torch.int32)
    n = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode(q, k, k, t, n, 8)
    with pytest.raises(ValueError, match="int32"):
        paged_decode(torch.zeros(2, 4, 8), k, k, t.long(), n, 8)
