"""Measuring an idle worker's memory (bench/peer_cpu.py, tests/gpu_worker/test_worker_memory.py):
its VmRSS, and `empty_base`, the model whose worker's idle RSS is the runtime's fixed cost in the
worker's account (services/gpu_worker/memory.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EMPTY = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
EMPTY_KV = 64 << 10  # the empty model's worker: one slot, a few KV blocks
EMPTY_FLAGS = ("--max-slots", "1", "--kv-cache", str(EMPTY_KV))


def vm_rss(pid: int) -> int:
    """Resident bytes of process `pid` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def huge_page_bytes(pid: int) -> int:
    """Bytes of process `pid`'s anonymous memory on transparent huge pages (AnonHugePages)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def thp_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise" or "never" (also where the
    kernel has none)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else "never"


def empty_base(base: Path, out: Path) -> Path:
    """A checkpoint with `base`'s tokenizer, vocabulary and config but one layer of width 8 (random
    weights: only its memory is of use), for measuring the runtime's fixed cost."""
    from bitdelta.checkpoint import read_config, save_checkpoint
    from bitdelta.model import ModelArgs, init_random, state_dict_for_save

    cfg = read_config(base)
    cfg.update(EMPTY, head_dim=8)
    cfg.pop("layer_types", None)
    model = init_random(ModelArgs.from_hf(cfg), seed=0)
    save_checkpoint(state_dict_for_save(model), out, cfg)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
