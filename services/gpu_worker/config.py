"""One typed configuration for the worker, from CLI flags and environment variables.

Every flag `--foo-bar` can also be set as `BITDELTA_WORKER_FOO_BAR`; a flag
wins over the environment. Values are checked here, at start-up, with errors
that say what to change.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

from bitdelta.units import parse_bytes

ENV_PREFIX = "BITDELTA_WORKER_"
_TYPES = {"Path": Path, "str": str, "int": int, "float": float, "bool": bool}


@dataclass(frozen=True)
class WorkerConfig:
    base: Path
    address: str = "[::]:50061"  # HOST:PORT to listen on
    base_name: str = ""  # "" -> the checkpoint's _name_or_path or its directory name
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    delta_store: str = ""  # host:port of the delta_store service
    delta_dir: str = ""  # or: a local directory of delta files (development, tests)
    delta_budget: int = 1 << 30  # device bytes for deltas
    max_slots: int = 0  # 0 -> budget // slot bytes (the byte budget then binds first)
    pin_hottest: int = 0  # the N deltas with the highest request rate are never evicted
    rate_half_life_s: float = 60.0
    kv_cache: int = 256 << 20  # device bytes for the KV cache
    block_size: int = 16  # tokens per KV block
    max_running: int = 64  # sequences per batch
    max_batch_tokens: int = 2048  # tokens per step (prefill chunks + decodes)
    max_waiting: int = 1024  # queued sequences beyond which Generate is RESOURCE_EXHAUSTED
    default_max_new_tokens: int = 256
    fused_single_variant: bool = True  # a batch of one variant uses the fused kernel
    grace_s: float = 10.0  # SIGTERM: finish running streams for this long
    store_timeout_s: float = 600.0  # deadline of one Fetch from the delta store

    def __post_init__(self):
        base = Path(self.base)
        if not (base / "config.json").is_file():
            raise ValueError(f"--base {base}: not a checkpoint directory (no config.json)")
        if not (base / "tokenizer.json").is_file():
            raise ValueError(f"--base {base}: no tokenizer.json beside the weights")
        if self.delta_store and self.delta_dir:
            raise ValueError("give --delta-store or --delta-dir, not both")
        if self.delta_dir and not Path(self.delta_dir).is_dir():
            raise ValueError(f"--delta-dir {self.delta_dir}: not a directory")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: use auto, float32, bfloat16 or float16")
        for name in ("delta_budget", "kv_cache", "block_size", "max_running", "max_batch_tokens",
                     "default_max_new_tokens", "max_waiting"):  # fmt: skip
            if getattr(self, name) < (0 if name == "delta_budget" else 1):
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.max_slots < 0 or self.pin_hottest < 0:
            raise ValueError("--max-slots and --pin-hottest must be >= 0")

    @classmethod
    def from_args(cls, argv: list[str] | None = None, env: dict[str, str] | None = None) -> "WorkerConfig":
        env = os.environ if env is None else env
        p = argparse.ArgumentParser(prog="python -m services.gpu_worker",
                                    description="BitDelta GPU worker: one base, many variants, one batch.")
        sizes = {"delta_budget", "kv_cache"}
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env_val = env.get(ENV_PREFIX + f.name.upper())
            typ = _TYPES[f.type] if isinstance(f.type, str) else f.type
            if typ is bool:
                default = env_val.lower() in ("1", "true", "yes") if env_val is not None else f.default
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
                continue
            conv = parse_bytes if f.name in sizes else (str if typ is Path else typ)
            default = env_val if env_val is not None else (None if f.name == "base" else f.default)
            p.add_argument(flag, type=conv, default=conv(default) if isinstance(default, str) else default,
                           required=f.name == "base" and env_val is None, help=f"env {ENV_PREFIX}{f.name.upper()}")
        ns = p.parse_args(argv)
        kw = vars(ns)
        kw["base"] = Path(kw["base"])
        try:
            return cls(**kw)
        except ValueError as e:
            p.error(str(e))
