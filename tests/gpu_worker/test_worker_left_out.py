"""A delta made under a byte budget below one sign plane per weight (`bitdelta compress --budget
--drop`) leaves weights out: it is still a v2 file of one row-α plane per stored weight, and the
worker serves it, alone and in one batch with the base, with the greedy tokens of `bitdelta
apply`'s dense checkpoint (the left-out weights stay the base's: the slot adds nothing for them,
though a full variant held it before)."""

from __future__ import annotations

import json

import pytest
import torch

import bitdelta
from bitdelta.compress import apply, compress
from bitdelta.format import DELTA_SUFFIX, read_header
from bitdelta.generation import Sampling
from bitdelta.planes import PlaneConfig
from bitdelta.testing.family import FT_SCALE, VARIED_STD, make_base, make_finetune
from tests.support.worker import offline_generate

N = 12
PROMPTS = ["Hello world", "def f(x):", "The quick brown fox"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("left_out")
    base = make_base(root / "base", seed=1, std=VARIED_STD)
    deltas = root / "deltas"
    ft = make_finetune(base, root / "ft", seed=100, scale=FT_SCALE)
    full = compress(base, ft, deltas / f"full{DELTA_SUFFIX}", variant="full", progress=False)
    calib = torch.randint(0, 250, (3000,), generator=torch.Generator().manual_seed(4))
    cfg = PlaneConfig(budget=int(full.stat().st_size * 0.8), drop=True)
    part = compress(
        base, ft, deltas / f"part{DELTA_SUFFIX}", variant="part", planes=cfg, calibration=calib, progress=False
    )
    merged = {
        name: apply(base, deltas / f"{name}{DELTA_SUFFIX}", root / f"merged-{name}", progress=False)
        for name in ("full", "part")
    }
    return base, deltas, merged, part


def test_a_delta_with_weights_left_out_is_v2_and_served_like_apply(family):
    base, deltas, merged, part = family
    h = read_header(part)
    assert h.metadata["format_version"] == "2" and json.loads(h.metadata["left_out"])
    # the weights left out change the tokens: serving "full"'s planes for them would be caught
    want = {m: [offline_generate(merged[m], list(p.encode()), N, 256) for p in PROMPTS] for m in merged}
    assert want["part"] != want["full"]
    with bitdelta.LLM(base=base, deltas=deltas, device="cpu", kernel_backend="cpu", max_slots=1) as llm:
        # "full" first, so "part" lands in the slot "full" held: what it leaves out must add nothing
        for models in (["full", "full", "full"], ["part", "part", "part"], ["part", "", "part"]):
            outs = llm.generate(PROMPTS, model=models, sampling=Sampling(max_new_tokens=N))
            for o in outs:
                ckpt = base if o.model == "" else merged[o.model]
                assert list(o.token_ids) == offline_generate(ckpt, list(o.prompt.encode()), N, 256), o.model
