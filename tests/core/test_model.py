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
