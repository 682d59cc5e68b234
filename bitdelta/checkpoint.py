"""Llama-family checkpoints in the Hugging Face layout: config.json plus one or
more *.safetensors files (sharded with model.safetensors.index.json or not),
read one tensor at a time; and the base fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bitdelta.format import current_umask

FINGERPRINT_CACHE = "bitdelta-fingerprint.json"
# Files besides the weights that a checkpoint directory carries along.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def read_config(ckpt: str | os.PathLike) -> dict:
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} is not a checkpoint directory: no config.json")
    return json.loads(path.read_text())


def weight_files(ckpt: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    ckpt = Path(ckpt)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [ckpt / n for n in names]
    else:
        files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {ckpt}")
    return files


# Where a multimodal wrapper's checkpoint (bitdelta.arch.TEXT_MODELS) keeps its text model: the
# stored prefixes of the text model's causal-LM names (transformers' own saving and the published
# checkpoints use the first; checkpoints saved by transformers 4.5x the second), and its towers'
# prefixes, which are not read.
TEXT_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
TOWER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# safetensors' dtype names of the dtypes a checkpoint's weights come in (an implied tensor takes its file's)
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def causal_lm_name(stored: str) -> str | None:
    """A wrapper's stored tensor name under its text model's causal-LM name; None for a tower's."""
    if stored.startswith(TOWER_PREFIXES):
        return None
    for prefix, causal in TEXT_MODEL_PREFIXES:
        if stored.startswith(prefix):
            return causal + stored[len(prefix) :]
    return stored


class CheckpointReader:
    """Random access to a checkpoint's tensors without loading them all.

    >>> with CheckpointReader(dir) as r: w = r.get("model.norm.weight")

    A multimodal wrapper's checkpoint (Gemma 3's Gemma3ForConditionalGeneration, config.json's
    model_type in bitdelta.arch.TEXT_MODELS) reads as its text model's causal LM: its tensors under
    that model's names (`TEXT_MODEL_PREFIXES`), the vision tower's and projector's left out.

    The tensors a family's checkpoints never store but its model reads as ones (OLMo 1's LayerNorm
    weights: `bitdelta.arch.implied_tensors`, listed in `implied`) read as ones in the dtype of the
    checkpoint's first tensor; such a tensor stored in the files is refused, since transformers would
    not read it.
    """

    def __init__(self, ckpt: str | os.PathLike):
        from bitdelta.arch import TEXT_MODELS, implied_tensors

        self.path = Path(ckpt)
        cfg_file = self.path / "config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        wrapper = cfg.get("model_type") in TEXT_MODELS
        self._handles = [safe_open(str(f), framework="pt") for f in weight_files(ckpt)]
        self._where: dict[str, tuple[object, str]] = {}  # name -> (file handle, the name stored there)
        for h in self._handles:
            for k in h.keys():
                name = causal_lm_name(k) if wrapper else k
                if name is not None:
                    self._where[name] = (h, k)
        self.implied: dict[str, tuple[int, ...]] = implied_tensors(cfg) if cfg else {}
        stored = sorted(n for n in self.implied if n in self._where)
        if stored:
            raise ValueError(
                f"{self.path}: {stored[0]!r} is stored, but a {cfg.get('model_type')} model's norms have no "
                f"weights (transformers would not read it)"
            )
        self._implied_dtype = torch.float32
        if self.implied and self._where:
            h, stored_name = next(iter(self._where.values()))
            self._implied_dtype = _DTYPES.get(h.get_slice(stored_name).get_dtype(), torch.float32)

    def keys(self) -> list[str]:
        return sorted([*self._where, *self.implied])

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self.implied

    def get(self, name: str) -> torch.Tensor:
        if name in self.implied:
            return torch.ones(self.implied[name], dtype=self._implied_dtype)
        try:
            h, stored = self._where[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None
        return h.get_tensor(stored)

    __getitem__ = get

    def shape(self, name: str) -> list[int]:
        if name in self.implied:
            return list(self.implied[name])
        h, stored = self._where[name]
        return list(h.get_slice(stored).get_shape())

    def get_part(self, name: str, rows: tuple[tuple[int, int], ...] | None = None, cols: tuple[int, int] | None = None):
        """Rows (runs of the first dim, concatenated) and columns of one tensor, reading only those
        bytes from the file (a tensor-parallel rank's slice of a base: bitdelta.shard)."""
        if name in self.implied:
            t = self.get(name)
            t = t if cols is None else t[:, slice(*cols)]
            return t if rows is None else torch.cat([t[a:b] for a, b in rows])
        if name not in self._where:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        h, stored = self._where[name]
        sl = h.get_slice(stored)
        c = slice(*cols) if cols is not None else slice(None)
        if rows is None:
            return sl[:, c] if cols is not None else sl[:]
        parts = [sl[a:b, c] if cols is not None else sl[a:b] for a, b in rows]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k in self.keys():
            yield k, self.get(k)

    def close(self) -> None:
        self._handles.clear()
        self._where.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fingerprint(ckpt: str | os.PathLike) -> str:
    """sha256 over (name, dtype, shape, bytes) of every stored tensor, sorted by name.

    Cached in the checkpoint directory, keyed by the weight files' sizes and
    modification times, because hashing a 140 GB base takes minutes.
    """
    ckpt = Path(ckpt)
    files = weight_files(ckpt)
    key = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache = ckpt / FINGERPRINT_CACHE
    if cache.is_file():
        try:
            cached = json.loads(cache.read_text())
            if cached.get("files") == key:
                return cached["fingerprint"]
        except (json.JSONDecodeError, KeyError):
            pass
    h = hashlib.sha256()
    with CheckpointReader(ckpt) as r:
        for name in r.keys():
            t = r.get(name).contiguous()
            h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    fp = h.hexdigest()
    try:
        cache.write_text(json.dumps({"files": key, "fingerprint": fp}))
    except OSError:
        pass  # read-only checkpoint: fine, just slower next time
    return fp


@contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory beside `out` to fill; when the block ends without an
    error it replaces `out` in one rename (with the usual permissions), otherwise
    it is removed, so readers never see a half-written directory."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; outputs are meant to be shared
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(
    state: dict[str, torch.Tensor],
    out: str | os.PathLike,
    config: dict,
    side_files_from: str | os.PathLike | None = None,
    generation_config: dict | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Write a one-file HF checkpoint atomically (see `atomic_dir`); `generation_config`: written as
    its generation_config.json instead of the side files' one; `files`: name -> text, written over
    the side files (e.g. a chat_template.jinja of its own)."""
    with atomic_dir(out) as tmp:
        if side_files_from is not None:
            for name in SIDE_FILES:
                src = Path(side_files_from) / name
                if src.is_file():
                    shutil.copy2(src, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        state = _without_implied(state, config)
        if generation_config is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
    return Path(out)


def is_implied(name: str, tensor: torch.Tensor, config: dict, implied: dict[str, tuple[int, ...]]) -> bool:
    """Whether a checkpoint of `config` leaves tensor `name` out (one of its `implied` ones:
    `bitdelta.arch.implied_tensors(config)`, OLMo 1's LayerNorm weights); such a tensor must be all
    ones, since another value would be lost."""
    if name not in implied:
        return False
    if not bool((tensor == 1).all()):
        raise ValueError(
            f"{name}: a {config.get('model_type')} model's norms have no weights, so a value other than 1 cannot be "
            f"saved"
        )
    return True


def _without_implied(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """state without the tensors a checkpoint of `config` does not store (`is_implied`)."""
    from bitdelta.arch import implied_tensors

    implied = implied_tensors(config)
    return {k: v for k, v in state.items() if not is_implied(k, v, config, implied)}
