"""Checkpoint writing for merges that produce one tensor at a time.

`ShardedWriter` keeps at most one shard (`max_shard_bytes`) in memory and
writes the Hugging Face sharded layout (model-0000i-of-0000n.safetensors plus
model.safetensors.index.json; a single model.safetensors when one shard is
enough), into a temporary directory renamed into place at the end, so a
crashed merge never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bitdelta.checkpoint import SIDE_FILES, read_config, stored_form

DEFAULT_SHARD_BYTES = 2 * 1024**3


class ShardedWriter:
    def __init__(
        self, out: str | os.PathLike, config_from: str | os.PathLike, max_shard_bytes: int = DEFAULT_SHARD_BYTES
    ):
        self.out = Path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        self.config_from = Path(config_from)
        self.max = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total = 0
        # the family's names, fused q, k, v and implied norms (bitdelta.checkpoint.stored_form)
        self._form = stored_form(read_config(self.config_from))
        self._parts: dict[str, torch.Tensor] = {}  # a fused tensor's parts until all are in

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._form is None:
            self._add(name, tensor)
            return
        parts = self._form.fused_parts(name)
        self._parts[name] = tensor
        if all(p in self._parts for p in parts):
            for stored, t in self._form.to_stored({p: self._parts.pop(p) for p in parts}).items():
                self._add(stored, t)

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
        size = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + size > self.max:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += size
        self._total += size

    def _flush(self) -> None:
        path = self.tmp / f"shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self, config: dict | None = None) -> Path:
        try:
            if self._parts:
                raise ValueError(f"{min(self._parts)}: the checkpoint stores it fused with parts never added")
            if self._pending or not self._shards:
                self._flush()
            n = len(self._shards)
            if n == 1:
                os.replace(self._shards[0][0], self.tmp / "model.safetensors")
            else:
                weight_map = {}
                for i, (path, names) in enumerate(self._shards, 1):
                    final = f"model-{i:05d}-of-{n:05d}.safetensors"
                    os.replace(path, self.tmp / final)
                    weight_map.update({k: final for k in names})
                index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
                (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            for name in SIDE_FILES:
                src = self.config_from / name
                if src.is_file():
                    shutil.copy2(src, self.tmp / name)
            (self.tmp / "config.json").write_text(json.dumps(config or read_config(self.config_from), indent=2))
            if self.out.exists():
                shutil.rmtree(self.out)
            os.replace(self.tmp, self.out)
        except BaseException:
            self.abort()
            raise
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()


def check_same_keys(base_keys: list[str], other_keys: list[str], other: str | os.PathLike) -> None:
    missing, extra = set(base_keys) - set(other_keys), set(other_keys) - set(base_keys)
    if missing or extra:
        raise ValueError(
            f"{other} does not have the base's tensors: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}"
        )
