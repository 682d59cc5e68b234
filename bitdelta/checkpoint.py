"""Llama-family checkpoints in the Hugging Face layout: config.json plus one or
more *.safetensors files (sharded with model.safetensors.index.json or not),
read one tensor at a time; and the base fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
Runs = tuple[tuple[int, int], ...]  # rows of a tensor's first dim: runs [a, b), in order, concatenated
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

    A family whose checkpoints name or fuse tensors their own way (GPT-NeoX's and Falcon's: `stored_form`) reads under
    the canonical names every other part of the system uses (`model.layers.N.self_attn.q_proj.weight`,
    ...), a fused tensor's parts as rows of it.

    The tensors a family's checkpoints never store but its model reads as ones (OLMo 1's LayerNorm
    weights: its form's `implied`, listed in `implied`) read as ones in the dtype of the checkpoint's
    first tensor; such a tensor stored in the files is refused, since transformers would not read it.
    """

    def __init__(self, ckpt: str | os.PathLike):
        from bitdelta.arch import TEXT_MODELS

        self.path = Path(ckpt)
        cfg_file = self.path / "config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        wrapper = cfg.get("model_type") in TEXT_MODELS
        form = stored_form(cfg) if cfg else None
        self._handles = [safe_open(str(f), framework="pt") for f in weight_files(ckpt)]
        # name -> (file handle, the name stored there, the stored rows it is (runs; None: the whole tensor))
        self._where: dict[str, tuple[object, str, Runs | None]] = {}
        # name -> the stored tensors (file handle, name) stacked to make it (StableLM 2 12B's per-head norms)
        self._stacks: dict[str, list[tuple[object, str]]] = {}
        if form is not None:
            handle_of = {k: h for h in self._handles for k in h.keys()}
            for name, parts in form.stacks(list(handle_of)).items():
                self._stacks[name] = [(handle_of[k], k) for k in parts]
        for h in self._handles:
            for k in h.keys():
                if form is not None:
                    for name, runs in form.canonical(k):
                        self._where[name] = (h, k, runs)
                    continue
                name = causal_lm_name(k) if wrapper else k
                if name is not None:
                    self._where[name] = (h, k, None)
        self.implied: dict[str, tuple[int, ...]] = form.implied if form is not None else {}
        stored = sorted(n for n in self.implied if n in self._where)
        if stored:
            raise ValueError(
                f"{self.path}: {stored[0]!r} is stored, but a {cfg.get('model_type')} model's norms have no "
                f"weights (transformers would not read it)"
            )
        self._implied_dtype = torch.float32
        if self.implied and self._where:
            h, stored_name, _ = next(iter(self._where.values()))
            self._implied_dtype = _DTYPES.get(h.get_slice(stored_name).get_dtype(), torch.float32)

    def keys(self) -> list[str]:
        return sorted([*self._where, *self._stacks, *self.implied])

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._stacks or name in self.implied

    def get(self, name: str) -> torch.Tensor:
        if name in self.implied:
            return torch.ones(self.implied[name], dtype=self._implied_dtype)
        if name in self._stacks:
            return torch.stack([h.get_tensor(k) for h, k in self._stacks[name]])
        try:
            h, stored, runs = self._where[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None
        return h.get_tensor(stored) if runs is None else self.get_part(name)

    __getitem__ = get

    def shape(self, name: str) -> list[int]:
        if name in self.implied:
            return list(self.implied[name])
        if name in self._stacks:
            h, k = self._stacks[name][0]
            return [len(self._stacks[name]), *h.get_slice(k).get_shape()]
        h, stored, runs = self._where[name]
        shape = list(h.get_slice(stored).get_shape())
        return shape if runs is None else [sum(b - a for a, b in runs), *shape[1:]]

    def get_part(self, name: str, rows: tuple[tuple[int, int], ...] | None = None, cols: tuple[int, int] | None = None):
        """Rows (runs of the first dim, concatenated) and columns of one tensor, reading only those
        bytes from the file (a tensor-parallel rank's slice of a base: bitdelta.shard)."""
        if name in self.implied or name in self._stacks:  # small tensors: made whole, then cut
            t = self.get(name)
            return rows_of(t if cols is None else t[:, slice(*cols)], rows)
        if name not in self._where:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        h, stored, runs = self._where[name]
        if runs is not None:  # a part of a fused tensor: the requested rows among its rows
            rows = _within(runs, rows if rows is not None else ((0, sum(b - a for a, b in runs)),))
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
        self._stacks.clear()

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
        form = stored_form(config)
        if form is not None:  # the family's names, its fused and stacked tensors, without its implied ones
            state = form.to_stored(state)
        if generation_config is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
    return Path(out)


def rows_of(t: torch.Tensor, rows: Runs | None) -> torch.Tensor:
    """Rows `rows` of t (runs of its first dim, concatenated); None: all of t."""
    return t if rows is None else torch.cat([t[a:b] for a, b in rows])


def _within(runs: Runs, want: Runs) -> Runs:
    """The stored rows of rows `want` of a tensor made of stored rows `runs` (both concatenated in order)."""
    out, total = [], sum(b - a for a, b in runs)
    for a, b in want:
        if not 0 <= a <= b <= total:
            raise IndexError(f"rows [{a}, {b}) of a tensor of {total}")
        at = 0
        for s0, s1 in runs:
            lo, hi = max(a, at), min(b, at + s1 - s0)
            if lo < hi:
                out.append((s0 + lo - at, s0 + hi - at))
            at += s1 - s0
    return tuple(out)


class StoredForm:
    """How one family's checkpoints name, fuse, stack or leave out the canonical tensors (`FusedForm`,
    `PerHeadNormsForm`, `ImpliedOnesForm`): the reader reads the canonical ones from the stored ones, every
    writer writes the stored ones."""

    # canonical tensors the checkpoints never store but the model reads as ones: full name -> shape
    implied: dict[str, tuple[int, ...]] = {}

    def canonical(self, stored: str) -> list[tuple[str, Runs | None]]:
        """The canonical tensors one stored tensor holds, each with its rows of it (None: all of it);
        [] for a stored buffer the model does not read."""
        raise NotImplementedError

    def to_stored(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A canonical state as the family stores it (a fused tensor needs all its parts)."""
        raise NotImplementedError

    def fused_parts(self, name: str) -> tuple[str, ...]:
        """The canonical tensors stored fused with `name` (itself among them); (name,) for one stored alone."""
        return (name,)

    def stacks(self, stored: list[str]) -> dict[str, list[str]]:
        """The canonical tensors stacked from several stored ones (StableLM 2 12B's per-head q and k norms):
        canonical name -> its stored parts in order, each of which `canonical` maps to []."""
        return {}


class ImpliedOnesForm(StoredForm):
    """OLMo 1: its LayerNorms have no parameters, so its checkpoints store no norm weight; each reads as
    ones (`bitdelta.arch.implied_tensors`), and a writer leaves them out, refusing a value other than 1
    (it would be lost). Every other tensor under its canonical name."""

    def __init__(self, implied: dict[str, tuple[int, ...]], model_type: str):
        self.implied, self.model_type = implied, model_type

    def canonical(self, stored: str) -> list[tuple[str, Runs | None]]:
        return [(stored, None)]

    def to_stored(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name in self.implied.keys() & state.keys():
            if not bool((state[name] == 1).all()):
                raise ValueError(
                    f"{name}: a {self.model_type} model's norms have no weights, so a value other than 1 cannot be saved"
                )
        return {k: v for k, v in state.items() if k not in self.implied}


class PerHeadNormsForm(StoredForm):
    """StableLM 2 12B: its q and k LayerNorms stored one per head (`self_attn.q_layernorm.norms.H.weight`,
    [head_dim] each), read as one [heads, head_dim] weight (`self_attn.q_layernorm.weight`, Command R+'s form)
    and written back head by head; every other tensor under its canonical name."""

    PART = re.compile(r"(model\.layers\.\d+\.self_attn\.[qk]_layernorm)\.norms\.(\d+)\.weight")
    WHOLE = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_layernorm\.weight")

    def canonical(self, stored: str) -> list[tuple[str, Runs | None]]:
        return [] if self.PART.fullmatch(stored) else [(stored, None)]

    def stacks(self, stored: list[str]) -> dict[str, list[str]]:
        heads: dict[str, dict[int, str]] = {}
        for k in stored:
            if m := self.PART.fullmatch(k):
                heads.setdefault(f"{m[1]}.weight", {})[int(m[2])] = k
        out = {}
        for name, parts in heads.items():
            if sorted(parts) != list(range(len(parts))):
                raise ValueError(f"{name}: the stored heads {sorted(parts)} are not 0 to {len(parts) - 1}")
            out[name] = [parts[h] for h in range(len(parts))]
        return out

    def to_stored(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            if self.WHOLE.fullmatch(name):
                base = name.removesuffix(".weight")
                out |= {f"{base}.norms.{h}.weight": t[h] for h in range(t.shape[0])}
            else:
                out[name] = t
        return out


@dataclass(frozen=True)
class FusedForm(StoredForm):
    """A family whose checkpoints rename the canonical modules (GPT-NeoX's, Falcon's, GPT-J's) and may fuse q, k, v
    (weights and biases) into one `query_key_value`. Its rows come in `groups` groups, each `heads / groups` q
    heads, then one k head, then one v head ([groups, heads / groups + 2, head_dim] flattened): head after
    head, q, k, v in turn, where groups = heads (GPT-NeoX's, Falcon's without multi-query); all q heads, then
    k, then v, where groups = 1 (Falcon-7B's multi-query); one group per KV head (Falcon-40B's and Falcon
    2's); groups = 0: q, k, v stored apart (GPT-J's). Stored buffers the model does not read (an old
    checkpoint's causal mask and rope frequencies) are not read, as transformers does not read them."""

    heads: int
    groups: int
    head_dim: int
    layers: str  # the stored prefix of layer N's modules, "gpt_neox.layers." (then N.)
    attention: str  # the attention's module inside a layer ("attention.", Falcon's "self_attention.")
    renames: tuple[tuple[str, str], ...]  # (stored prefix, canonical prefix) outside the layers, first match
    norms: tuple[tuple[str, str], ...] = ()  # (stored, canonical) norm modules inside a layer (Falcon's ln_attn)
    buffers: tuple[str, ...] = ()  # stored names inside a layer that are not read

    def _runs(self, part: int) -> Runs:
        per = self.heads // self.groups  # q heads of a group
        step, hd = (per + 2) * self.head_dim, self.head_dim
        lo, hi = (0, per * hd) if part == 0 else ((per + part - 1) * hd, (per + part) * hd)
        return tuple((g * step + lo, g * step + hi) for g in range(self.groups))

    def canonical(self, stored: str) -> list[tuple[str, Runs | None]]:
        layer = re.fullmatch(re.escape(self.layers) + r"(\d+)\.(.+)", stored)
        if layer is not None:
            i, rest = layer.groups()
            if rest in self.buffers:
                return []
            fused = re.fullmatch(re.escape(self.attention) + r"query_key_value\.(weight|bias)", rest)
            if fused is not None and self.groups:
                pre = f"model.layers.{i}.self_attn"
                return [(f"{pre}.{p}_proj.{fused[1]}", self._runs(j)) for j, p in enumerate("qkv")]
            if rest.startswith(self.attention):
                rest = "self_attn." + rest[len(self.attention) :]
            for old, new in self.norms:
                if rest.startswith(old + "."):
                    rest = new + rest[len(old) :]
            return [(f"model.layers.{i}.{rest}", None)]
        for old, new in self.renames:
            if stored.startswith(old):
                return [(new + stored[len(old) :], None)]
        return [(stored, None)]

    def fused_parts(self, name: str) -> tuple[str, ...]:
        m = re.fullmatch(r"(model\.layers\.\d+\.self_attn\.)[qkv]_proj\.(weight|bias)", name)
        return (name,) if m is None or not self.groups else tuple(f"{m[1]}{p}_proj.{m[2]}" for p in "qkv")

    def _stored_name(self, name: str) -> str:
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if layer is not None:
            rest = layer[2]
            if rest.startswith("self_attn."):
                rest = self.attention + rest[len("self_attn.") :]
            for old, new in self.norms:
                if rest.startswith(new + "."):
                    rest = old + rest[len(new) :]
            return f"{self.layers}{layer[1]}.{rest}"
        for old, new in self.renames:
            if name.startswith(new):
                return old + name[len(new) :]
        return name

    def to_stored(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        per = self.heads // max(self.groups, 1)
        for name, t in state.items():
            parts = self.fused_parts(name)
            if parts == (name,):
                out[self._stored_name(name)] = t
            elif name == parts[0]:
                missing = [p for p in parts if p not in state]
                if missing:
                    raise ValueError(f"{missing[0]}: this family stores q, k and v fused; all three are needed")
                q, k, v = (state[p] for p in parts)
                rest = q.shape[1:]
                grouped = [q.reshape(self.groups, per, self.head_dim, *rest)]
                grouped += [x.reshape(self.groups, 1, self.head_dim, *rest) for x in (k, v)]
                fused = torch.cat(grouped, dim=1).reshape(-1, *rest)
                stored = self._stored_name(name).replace(f"{self.attention}q_proj", f"{self.attention}query_key_value")
                out[stored] = fused
        return out


def stored_form(cfg: dict) -> StoredForm | None:
    """The stored form of a checkpoint of config `cfg` (`Family.stored_form`); None: the canonical names."""
    from bitdelta.arch import FAMILIES, ModelArgs, implied_tensors

    fam = FAMILIES.get(cfg.get("model_type", "llama"))
    if fam is not None and fam.weightless_norms:  # OLMo 1
        return ImpliedOnesForm(implied_tensors(cfg), fam.model_type)
    if fam is None or fam.stored_form is None:
        return None
    if fam.stored_form == "stablelm":  # only StableLM 2 12B's per-head q and k norms are its own
        return PerHeadNormsForm() if cfg.get("qk_layernorm") else None
    a = ModelArgs.from_hf(cfg)
    if fam.stored_form == "gpt_neox":
        return FusedForm(
            a.n_heads,
            a.n_heads,
            a.head_dim,
            "gpt_neox.layers.",
            "attention.",
            (("gpt_neox.embed_in.", "model.embed_tokens."), ("embed_out.", "lm_head."), ("gpt_neox.", "model.")),
            buffers=("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"),
        )
    if fam.stored_form == "gptj":
        return FusedForm(
            a.n_heads,
            0,
            a.head_dim,
            "transformer.h.",
            "attn.",
            (("transformer.wte.", "model.embed_tokens."), ("transformer.", "model.")),
            norms=(("ln_1", "input_layernorm"),),
            buffers=("attn.bias", "attn.masked_bias"),
        )
    # Falcon: its q/k/v groups are its KV heads (one for multi-query), but for the old layer without
    # multi-query, whose heads each hold their q, k, v; a parallel block's two norms stored as ln_attn, ln_mlp
    per_head = not cfg.get("new_decoder_architecture") and not cfg.get("multi_query", True)
    two = (("ln_attn", "input_layernorm"), ("ln_mlp", "post_attention_layernorm"))
    return FusedForm(
        a.n_heads,
        a.n_heads if per_head else a.n_kv_heads,
        a.head_dim,
        "transformer.h.",
        "self_attention.",
        (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.", "model.")),
        norms=two if a.parallel_mlp_norm else (),
    )
