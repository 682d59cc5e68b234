"""Per-GPU launch configurations of the Triton kernels, kept as data in configs.json."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

CONFIG_FILE = Path(__file__).with_name("configs.json")


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors (TRITON_INTERPRET=1, set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    path = os.environ.get("BITDELTA_KERNEL_CONFIGS") or CONFIG_FILE
    with open(path) as f:
        return json.load(f)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


@functools.lru_cache(maxsize=None)
def device_config(device_name: str) -> dict:
    """The entry for a device name ('interpreter' for the interpreter), completed from 'default'."""
    table = _table()
    for key, entry in table.items():
        if key not in ("default", "_doc", "interpreter") and key in device_name:
            return _merge(table["default"], entry)
    if device_name == "interpreter" and "interpreter" in table:
        return _merge(table["default"], table["interpreter"])
    return dict(table["default"])


def config_for(device: torch.device) -> dict:
    """The configuration for tensors on `device`."""
    if device.type != "cuda":
        return device_config("interpreter")
    return device_config(torch.cuda.get_device_name(device))


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
