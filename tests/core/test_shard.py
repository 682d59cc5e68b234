"""bitdelta.shard: the tensor-parallel split of every tensor role, checked against the unsharded
computation (column-parallel outputs concatenate, row-parallel partial sums add up, the vocabulary
splits and gathers), on layouts with more and fewer KV heads than ranks, fused and split."""

from __future__ import annotations

import math

import pytest
import torch

from bitdelta.arch import SPARSE_GROUPS, ModelArgs
from bitdelta.shard import EMBED, ShardError, Split, TensorShard, TPLayout, group_kind
from bitdelta.testing.family import tiny_args
from bitdelta_kernels.bits import pack_signs, unpack_signs

LAYOUTS = {
    "gqa 4/2 heads": tiny_args(),
    "1 kv head": tiny_args(n_kv_heads=1),
    "smollm2 9/3 heads": tiny_args(dim=72, n_heads=9, n_kv_heads=3, head_dim=8, intermediate_size=96),
    "phi3 fused": tiny_args(model_type="phi3", n_kv_heads=4, tie_embeddings=False),
    "phi3 fused, 1 kv head": tiny_args(model_type="phi3", n_kv_heads=1, tie_embeddings=False),
    "qwen2 biases": tiny_args(model_type="qwen2", qkv_bias=True),
    "mixtral 4 experts": tiny_args(model_type="mixtral", n_experts=4, experts_per_token=2, intermediate_size=48),
    "qwen3-moe 1 kv head": tiny_args(model_type="qwen3_moe", n_kv_heads=1, n_experts=3, experts_per_token=2),
    "qwen2-moe shared expert": tiny_args(
        model_type="qwen2_moe", qkv_bias=True, n_experts=3, experts_per_token=2, shared_intermediate_size=40
    ),
}


def delta_linear(x, w, signs, alpha, d_in):
    # x: [T, d_in] -> [T, d_out]: x·Wᵀ + α ⊙ (x·Sᵀ), the serving math
    return x @ w.t() + (x @ unpack_signs(signs, d_in, x.dtype).t()) * alpha


def layouts(args: ModelArgs, sizes=(2, 3, 4)):
    for n in sizes:
        try:
            yield n, [TPLayout(args, n, r) for r in range(n)]
        except ShardError:
            continue


@pytest.mark.parametrize("name", LAYOUTS)
def test_units_cover_the_model_once_and_rank0_holds_the_most(name):
    a = LAYOUTS[name]
    for n, ranks in layouts(a):
        heads = [t.heads() for t in ranks]
        assert heads[0][0] == 0 and heads[-1][1] == a.n_heads
        assert all(heads[i][1] == heads[i + 1][0] for i in range(n - 1))  # contiguous, no gaps
        ffn = [t.ffn() for t in ranks]
        assert sum(b - c for c, b in ffn) == a.intermediate_size and all(c % 8 == 0 for c, _ in ffn)
        assert sum(b - c for c, b in (t.vocab() for t in ranks)) == a.vocab_size
        loc = [t.local_args() for t in ranks]
        for f in ("n_heads", "n_kv_heads", "intermediate_size", "vocab_size"):
            assert getattr(loc[0], f) == max(getattr(x, f) for x in loc), f
        assert all(x.layout == a.layout and x.head_dim == a.head_dim for x in loc)
        if n > a.n_kv_heads:  # each KV head replicated on n / n_kv_heads ranks
            assert all(x.n_kv_heads == 1 for x in loc)


@pytest.mark.parametrize("name", LAYOUTS)
def test_projection_shards_reproduce_the_unsharded_delta_linear(name):
    a = LAYOUTS[name]
    g = torch.Generator().manual_seed(0)
    for n, ranks in layouts(a):
        for m in a.matrices():
            param = f"model.layers.0.{m.name}.weight"
            w = torch.randn(m.d_out, m.d_in, generator=g, dtype=torch.float64)
            signs = pack_signs(torch.randn(m.d_out, m.d_in, generator=g))
            for alpha in (
                torch.rand(m.d_out, generator=g, dtype=torch.float64),
                torch.tensor([0.3], dtype=torch.float64),
            ):
                x = torch.randn(5, m.d_in, generator=g, dtype=torch.float64)
                full = delta_linear(x, w, signs, alpha, m.d_in)
                parts = []
                for t in ranks:
                    ws = t.shard_of(param, "weight", tuple(w.shape))
                    ss = t.shard_of(param, "sign", tuple(signs.shape))
                    al = t.shard_of(param, "alpha", tuple(alpha.shape))
                    assert ws.split == ss.split
                    wl, sl, alp = ws.take(w), ss.take(signs), al.take(alpha)
                    assert sl.shape == ss.shape(tuple(signs.shape))
                    if m.group in SPARSE_GROUPS:  # every rank routes every token: whole on each
                        assert ws.split is ss.split is al.split is Split.REPLICATED
                        parts.append(delta_linear(x, wl, sl, alp, m.d_in))
                    elif group_kind(m.group) in ("o", "down"):  # row-parallel: input columns, α replicated
                        assert ws.split is Split.ROW and al.split is Split.REPLICATED
                        c0, c1 = ws.cols
                        assert c0 % 8 == 0 and sl.shape[1] == (c1 - c0 + 7) // 8
                        parts.append(delta_linear(x[:, c0:c1], wl, sl, alp, c1 - c0))
                    else:  # column-parallel: output rows of W, signs and α alike
                        assert ws.split is Split.COLUMN and ss.rows == ws.rows
                        parts.append(delta_linear(x, wl, sl, alp, m.d_in))
                if m.group in SPARSE_GROUPS:
                    assert all(torch.equal(p, full) for p in parts)
                elif group_kind(m.group) in ("o", "down"):
                    torch.testing.assert_close(sum(parts), full)  # the one all-reduce
                else:
                    # every rank's rows, in group order: the q, k, v (gate, up) of each rank
                    rows = [ranks[r].shard_of(param, "weight", tuple(w.shape)).rows for r in range(n)]
                    if m.group == "qkv" and n > a.n_kv_heads and m.short in ("k", "v"):
                        continue  # replicated KV heads: checked in the next test
                    order = torch.cat([torch.arange(p, q) for rr in rows for p, q in rr])
                    torch.testing.assert_close(torch.cat(parts, 1), full[:, order])
                    # each row on exactly one rank; a fused qkv's rows of a replicated KV head on each of its ranks
                    once = not (m.group == "qkv" and n > a.n_kv_heads)
                    assert sorted(order.tolist() if once else set(order.tolist())) == list(range(m.d_out))


def v3_linear(x, w, planes, u, v, d_in):
    # x: [T, d_in] -> [T, d_out]: x·Wᵀ + Σ_p α_p ⊙ (x·S_pᵀ) (a column α scales x's columns) + (x·Vᵀ)·Uᵀ
    y = x @ w.t() + (x @ v.t()) @ u.t()
    for signs, alpha, axis in planes:
        s = unpack_signs(signs, d_in, x.dtype)
        y = y + ((x * alpha) @ s.t() if axis == "col" else (x @ s.t()) * alpha)
    return y


@pytest.mark.parametrize("name", LAYOUTS)
def test_format_v3_parts_shard_so_the_ranks_reproduce_the_unsharded_delta(name):
    """Plane 2's signs and α split like plane 1's, a column α with the input columns (row-parallel)
    or whole (column-parallel), U by rows and V whole (column-parallel), V by columns and U whole
    (row-parallel): concatenated or summed (the one all-reduce), the ranks give the whole term."""
    a = LAYOUTS[name]
    g = torch.Generator().manual_seed(2)
    for n, ranks in layouts(a):
        for m in a.matrices():
            if m.group == "qkv" and n > a.n_kv_heads:
                continue  # replicated KV heads: their rows on several ranks (the test above)
            param, r = f"model.layers.0.{m.name}.weight", 3
            w = torch.randn(m.d_out, m.d_in, generator=g, dtype=torch.float64)
            signs = [pack_signs(torch.randn(m.d_out, m.d_in, generator=g)) for _ in range(3)]
            alphas = [torch.rand(m.d_out, generator=g, dtype=torch.float64) for _ in range(2)]
            alphas.append(torch.rand(m.d_in, generator=g, dtype=torch.float64))  # plane 3: column α's
            axes = ("row", "row", "col")
            u = torch.randn(m.d_out, r, generator=g, dtype=torch.float64)
            v = torch.randn(r, m.d_in, generator=g, dtype=torch.float64)
            x = torch.randn(5, m.d_in, generator=g, dtype=torch.float64)
            full = v3_linear(x, w, list(zip(signs, alphas, axes)), u, v, m.d_in)
            parts = []
            for t in ranks:
                ws = t.shard_of(param, "weight", tuple(w.shape))
                planes = []
                for p, (sg, al, ax) in enumerate(zip(signs, alphas, axes), start=1):
                    suffix = "" if p == 1 else str(p)
                    ss = t.shard_of(param, f"sign{suffix}", tuple(sg.shape), ax)
                    assert ss == t.shard_of(param, "sign", tuple(sg.shape))  # every plane like plane 1
                    planes.append((ss.take(sg), t.shard_of(param, f"alpha{suffix}", tuple(al.shape), ax).take(al), ax))
                ul = t.shard_of(param, "lowrank_u", tuple(u.shape)).take(u)
                vl = t.shard_of(param, "lowrank_v", tuple(v.shape)).take(v)
                if group_kind(m.group) in ("o", "down"):
                    c0, c1 = ws.cols
                    assert ul.shape == u.shape and vl.shape == (r, c1 - c0) and planes[2][1].shape == (c1 - c0,)
                    parts.append(v3_linear(x[:, c0:c1], ws.take(w), planes, ul, vl, c1 - c0))
                else:
                    assert (
                        vl.shape == v.shape and planes[2][1].shape == (m.d_in,) and ul.shape[0] == ws.shape(w.shape)[0]
                    )
                    parts.append(v3_linear(x, ws.take(w), planes, ul, vl, m.d_in))
            if m.group in SPARSE_GROUPS:  # whole on every rank, every part of it
                assert all(torch.equal(p, full) for p in parts)
            elif group_kind(m.group) in ("o", "down"):
                torch.testing.assert_close(sum(parts), full)
            else:
                rows = [t.shard_of(param, "weight", tuple(w.shape)).rows for t in ranks]
                order = torch.cat([torch.arange(p, q) for rr in rows for p, q in rr])
                torch.testing.assert_close(torch.cat(parts, 1), full[:, order])
    # the embedding / head: U by vocabulary rows, V [r, dim] whole on every rank
    t = TPLayout(a, 2, 1)
    assert t.shard_of(EMBED, "lowrank_u", (a.vocab_size, 4)).rows == (t.vocab(),)
    assert t.shard_of(EMBED, "lowrank_v", (4, a.dim)).split is Split.REPLICATED
    assert t.shard_of(EMBED, "sign2", (a.vocab_size, a.dim // 8)) == t.shard_of(EMBED, "sign", (a.vocab_size, 8))


def test_more_ranks_than_kv_heads_replicate_each_kv_head_with_its_query_heads():
    a = tiny_args(n_kv_heads=1)
    for n in (2, 4):
        ranks = [TPLayout(a, n, r) for r in range(n)]
        assert all(t.kv_heads() == (0, 1) for t in ranks)
        q = [t.heads() for t in ranks]
        assert q == [(r * a.n_heads // n, (r + 1) * a.n_heads // n) for r in range(n)]


def test_vocab_parallel_embedding_and_head_gather():
    a = tiny_args()
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(a.vocab_size, a.dim, generator=g)
    tokens = torch.randint(0, a.vocab_size, (9,), generator=g)
    h = torch.randn(4, a.dim, generator=g)
    for _, ranks in layouts(a):
        x = torch.zeros(9, a.dim)
        logits = []
        for t in ranks:
            sh = t.shard_of(EMBED, "dense", tuple(emb.shape))
            assert sh.split is Split.VOCAB
            part, (v0, v1) = sh.take(emb), t.vocab()
            local = tokens - v0
            inside = (local >= 0) & (local < v1 - v0)
            x += part[local.clamp(0, v1 - v0 - 1)] * inside[:, None]  # the embedding's all-reduce
            logits.append(h @ part.t())  # the head's gather
        torch.testing.assert_close(x, emb[tokens])
        torch.testing.assert_close(torch.cat(logits, 1), h @ emb.t())
        assert ranks[0].shard_of(EMBED, "alpha", (1,)).split is Split.REPLICATED


def test_byte_runs_are_the_slice():
    a = LAYOUTS["smollm2 9/3 heads"]
    signs = torch.randint(0, 255, (a.dim, a.n_heads * a.head_dim // 8), dtype=torch.uint8)
    q = torch.randint(0, 255, (a.n_heads * a.head_dim, a.dim // 8), dtype=torch.uint8)
    for t in TPLayout(a, 2, 0), TPLayout(a, 2, 1):
        for param, full in (
            ("model.layers.1.self_attn.o_proj.weight", signs),
            ("model.layers.1.self_attn.q_proj.weight", q),
        ):
            sh = t.shard_of(param, "sign", tuple(full.shape))
            raw = full.numpy().tobytes()
            got = b"".join(raw[o : o + k] for o, k in sh.byte_runs(tuple(full.shape), 1))
            assert got == sh.take(full).numpy().tobytes()


def test_impossible_splits_are_refused_with_the_reason():
    with pytest.raises(ShardError, match="multiple of the KV heads"):
        TPLayout(tiny_args(n_heads=6, n_kv_heads=3), 4, 0)
    with pytest.raises(ShardError, match="whole sign byte"):
        TPLayout(tiny_args(dim=36, n_heads=9, n_kv_heads=9, head_dim=4), 2, 0)


def test_per_head_q_and_k_norm_weights_split_with_their_heads():
    """OLMo 2's q and k norms over every head ([heads · hd]) and Command R+'s of each head's own weights
    ([heads, hd]) split with the rank's heads; with one KV head on two ranks both hold k's whole and only
    the first counts it in a sum over every head (`kv_owner`)."""
    olmo2 = tiny_args(model_type="olmo2", n_heads=4, n_kv_heads=2)
    hd = olmo2.head_dim
    for rank, (q, k) in enumerate((((0, 2 * hd), (0, hd)), ((2 * hd, 4 * hd), (hd, 2 * hd)))):
        t = TPLayout(olmo2, 2, rank)
        assert t.shard_of("model.layers.0.self_attn.q_norm.weight", "weight", (4 * hd,)).rows == (q,)
        assert t.shard_of("model.layers.0.self_attn.k_norm.weight", "dense", (2 * hd,)).rows == (k,)
        assert t.kv_owner()
    one_kv = tiny_args(model_type="olmo2", n_heads=4, n_kv_heads=1)
    assert [TPLayout(one_kv, 2, r).kv_owner() for r in range(2)] == [True, False]
    plus = tiny_args(model_type="cohere", qk_heads=True, n_heads=4, n_kv_heads=2)  # Command R+
    t = TPLayout(plus, 2, 1)
    assert t.shard_of("model.layers.0.self_attn.q_norm.weight", "weight", (4, plus.head_dim)).rows == ((2, 4),)
    assert t.shard_of("model.layers.0.self_attn.k_norm.weight", "weight", (2, plus.head_dim)).rows == ((1, 2),)
    assert t.shard_of("model.layers.0.input_layernorm.weight", "weight", (plus.dim,)).split is Split.REPLICATED


def delta_tensors(a: ModelArgs):
    """(param, role, full shape) of one layer's delta tensors, the norms and the embedding."""
    for m in a.matrices():
        p = f"model.layers.0.{m.name}.weight"
        yield from ((p, "sign", (m.d_out, -(-m.d_in // 8))), (p, "alpha", (m.d_out,)), (p, "alpha", (1,)))
    for n, size in a.layer_norms():
        yield f"model.layers.0.{n}.weight", "dense", (size,)
    yield "model.norm.weight", "dense", (a.dim,)
    yield EMBED, "dense", (a.vocab_size, a.dim)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_owners_of_each_part_fetch_every_element_once(name):
    # a rank fetches its part but the row runs a lower rank holds at the same place (`shared_from`:
    # the whole part, or a fused qkv's shared k/v rows), which that rank hands it
    a = LAYOUTS[name]
    for n, ranks in layouts(a):
        for param, role, shape in delta_tensors(a):
            fetched = 0
            for r, t in enumerate(ranks):
                mine = t.shard_of(param, role, shape)
                got = t.shared_from(param, role, shape)
                if got is None:
                    fetched += math.prod(mine.shape(shape))
                    continue
                o, j = got
                theirs = ranks[o].shard_of(param, role, shape)
                assert o < r and (r, j) in ranks[o].shared_to(param, role, shape), (n, param, role, r)
                if j == 0:
                    assert theirs == mine
                else:  # its own leading runs fetched, the shared tail received
                    assert theirs.rows[j:] == mine.rows[j:] and theirs.rows[:j] != mine.rows[:j]
                    fetched += math.prod(TensorShard(mine.split, rows=mine.rows[:j]).shape(shape))
            assert fetched == math.prod(shape), (n, param, role)
            assert sum(len(t.shared_to(param, role, shape)) for t in ranks) == sum(
                t.shared_from(param, role, shape) is not None for t in ranks
            )
