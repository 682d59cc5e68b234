"""Checkpoints (bitdelta.checkpoint): a sharded checkpoint loads like the single file."""

from __future__ import annotations

import json
import shutil

import torch

from bitdelta.checkpoint import CheckpointReader
from bitdelta.model import load_model


def test_sharded_checkpoint_loads_like_single(tmp_path, family):
    base, _ = family
    with CheckpointReader(base) as r:
        state = dict(r)
    names = sorted(state)
    half = len(names) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    from safetensors.torch import save_file

    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / fname))
        weight_map.update({k: fname for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(base / "config.json", out / "config.json")
    ids = torch.arange(20).reshape(1, 20)
    assert torch.equal(load_model(out)(ids), load_model(base)(ids))
