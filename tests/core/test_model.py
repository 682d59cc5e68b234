"""The model definition (bitdelta.model): the same logits as transformers' Llama, the KV cache's
continuation as full recomputation, and BitDeltaLinear as the merged dense layer."""

from __future__ import annotations

import pytest
import torch

from bitdelta.model import BitDeltaLinear, load_model
from bitdelta.testing.family import make_base, tiny_args
from bitdelta_kernels.bits import pack_signs


@pytest.mark.parametrize("tied", [True, False])
def test_model_matches_transformers(tmp_path, tied):
    import transformers

    args = tiny_args(tie_embeddings=tied, n_kv_heads=2, n_heads=4)
    base = make_base(tmp_path / "m", args, seed=3)
    ours = load_model(base)
    theirs = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, args.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # The KV-cache path gives the same greedy continuation as full recomputation.
    prompt = ids[0, :5].tolist()
    gen = ours.generate(prompt, 8)
    seq = list(prompt)
    for _ in range(len(gen)):
        seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
    assert gen == seq[len(prompt) :]


def test_bitdelta_linear_equals_merged_dense():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 27, generator=g)
    delta = torch.randn(40, 27, generator=g) * 0.01
    signs, alpha = pack_signs(delta), delta.abs().mean(1)
    lin = BitDeltaLinear(w, signs, alpha)
    x = torch.randn(3, 5, 27, generator=g)
    dense = w + alpha[:, None] * torch.where(delta >= 0, 1.0, -1.0)
    torch.testing.assert_close(lin(x), x @ dense.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "member", ["llama-3.1", "llama-linear", "llama-yarn", "qwen2.5", "phi3-mini", "llama-dynamic", "gemma3"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cache_rows_are_the_tables_of_each_position(member, dtype):
    """RopeCache's gathered rows equal rope_tables' for the same positions, bit for bit, before
    and after its tables grow; a length-dependent kind (dynamic) is computed per step."""
    from bitdelta.arch import ModelArgs
    from bitdelta.model import RopeCache, rope_tables
    from tests.support.archs import hf_config

    args = ModelArgs.from_hf(hf_config(member).to_dict())
    cache = RopeCache(args, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for top in (7, RopeCache.MIN + 5, 5000):  # the second and third grow the tables
        pos = torch.cat([torch.randint(0, top, (12,), generator=g), torch.tensor([top - 1])])
        lens = [int(p) + 1 for p in pos]
        got = cache.tables(pos, top, lens)
        want = rope_tables(args, pos, dtype, lens)
        for a, b in zip(got, want):
            assert a.dtype == dtype and torch.equal(a, b)
        if args.rope.length_dependent:
            assert cache._cos is None
        else:
            assert cache._cos.shape[0] >= top
