"""The BitDelta delta file, format v2 and v3 (spec: docs/delta-format.md; v1 files are read too).

One safetensors file per variant. For each compressed weight P [d_out, d_in]:
`P.sign` uint8 [d_out, ceil(d_in/8)] (bit convention in `bitdelta_kernels.bits`) and
`P.alpha` float32 [d_out] or [1]. Parameters stored whole: `P.dense`. The
header's `__metadata__` carries the format version, variant, base model and
base fingerprint, the base's architecture and parameter layout (v2), α mode, distillation record, tool version, the original
shapes of compressed weights and a sha256 per tensor.

Format v3 (written only when a delta needs it) adds, per compressed weight, further residual
sign planes `P.sign2`, `P.alpha2`, `P.sign3`, ... (plane i's signs and scale), a scale per
input column as a plane's option (α float32 [d_in]) and a low-rank residual `P.lowrank_u`
float16 [d_out, r] and `P.lowrank_v` float16 [r, d_in]; the metadata's `parts` says, for
every compressed weight, each plane's α axis ("row", "matrix" or "col") and the rank r:

    ΔW ≈ Σ_i α_i ⊙ S_i + U · V

A weight may have no sign plane when it has a rank: an imported LoRA adapter's modules
(`bitdelta.lora_import`), whose update is U · V exactly.

This module parses the header itself (8-byte little-endian length, JSON,
data) instead of trusting a library, so that truncated, malformed and
tampered files give errors that name the bad part, and so the delta store can
stream tensors by file offset.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from bitdelta.generation import GENERATION_CONFIG_KEYS, GenerationError, SamplingDefaults
from bitdelta.model_files import ModelFileError, TemplateSource

FORMAT_NAME = "bitdelta"
FORMAT_VERSION = "2"  # what a delta of one plane per matrix (row or matrix α, no low-rank) is written as
PARTS_VERSION = "3"  # what a delta with further planes, column α's or low-rank factors is written as
READ_VERSIONS = ("1", "2", "3")
# What a v1 file was made for: v1 tools accepted Llama and Mistral bases only, whose layout is this.
V1_ARCHITECTURES = ("llama", "mistral")
V1_LAYOUT = "q,k,v,o,gate,up,down"
DELTA_SUFFIX = ".bitdelta.safetensors"  # file / object name = variant name + DELTA_SUFFIX
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
HASH_BLOCK = 16 * 1024 * 1024

# safetensors dtype strings <-> torch dtypes (the subset a delta may hold).
DTYPES: dict[str, torch.dtype] = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I32": torch.int32,
    "I64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
AXES = ("row", "matrix", "col")  # what one α of a sign plane scales: an output row, the matrix, an input column
LOWRANK_ROLES = ("lowrank_u", "lowrank_v")
# A fine-tune's own file carried in its delta as a tensor of its bytes (uint8 [n], name
# "<file>.file"): the files a delta may carry
FILES = ("tokenizer.json",)


def split_role(suffix: str) -> tuple[str, int] | None:
    """A tensor name's suffix -> (role, plane): "sign" -> ("sign", 1), "alpha3" -> ("alpha", 3),
    "dense" / "lowrank_u" / "lowrank_v" / "file" -> (that, 0); None for anything else."""
    if suffix in ("dense", "file", *LOWRANK_ROLES):
        return suffix, 0
    for role in ("sign", "alpha"):
        if suffix == role:
            return role, 1
        rest = suffix[len(role) :]
        if suffix.startswith(role) and rest.isdigit() and not rest.startswith("0") and int(rest) >= 2:
            return role, int(rest)
    return None


def alpha_axis(axes: dict[str, list[str]], param: str, role: str) -> str:
    """The α axis ("row", "matrix", "col") of the plane a tensor of `param` with role `role`
    ("alpha", "sign3", ...) belongs to, from a header's axes per plane; "row" when it says none."""
    got = split_role(role)
    plane = got[1] if got is not None else 0
    have = axes.get(param, ())
    return have[plane - 1] if 1 <= plane <= len(have) else "row"


def plane_suffix(role: str, plane: int) -> str:
    """("sign", 1) -> ".sign", ("alpha", 2) -> ".alpha2"."""
    return f".{role}" if plane == 1 else f".{role}{plane}"


class DeltaFormatError(ValueError):
    """A delta file is malformed, truncated or corrupted. `tensor` names the bad tensor, if one."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class BaseMismatchError(ValueError):
    """A delta was built for a different base model than the one it is applied to."""


class ArchMismatchError(BaseMismatchError):
    """A delta was built for another architecture or parameter layout than the base's."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a delta file; `start`/`end` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def role(self) -> str:
        """The name's suffix: "sign", "alpha" or "dense"; in format v3 also "sign2", "alpha2", ...
        (further planes) and "lowrank_u", "lowrank_v" (`split_role` parses it)."""
        return self.name.rsplit(".", 1)[1]

    @property
    def part(self) -> str:
        """What `inspect` adds the tensor's bytes to: "sign", "alpha" (every plane), "lowrank", "dense" or "file"."""
        role, _ = split_role(self.role)
        return "lowrank" if role in LOWRANK_ROLES else role

    @property
    def plane(self) -> int:
        """The sign plane a sign/α tensor belongs to (1, 2, ...); 0 for other roles."""
        return split_role(self.role)[1]

    @property
    def param(self) -> str:
        """The model parameter this tensor belongs to."""
        return self.name.rsplit(".", 1)[0]


@dataclass
class DeltaMeta:
    """What `__metadata__` records. All values are strings in the file."""

    variant: str
    base_model: str
    base_fingerprint: str
    alpha_mode: str  # "row" | "matrix"; v3 also "col" and "auto" (chosen per plane: `parts`)
    architecture: str  # the base's model_type (bitdelta.arch); "" read from a v1 file: llama or mistral
    layout: str  # the base's parameter layout (ModelArgs.layout)
    shapes: dict[str, list[int]] = field(default_factory=dict)  # compressed param -> [d_out, d_in]
    distilled: dict | None = None  # e.g. {"steps": 150, "lr": 1e-5, "final_mse": ...}
    tool_version: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    # v3: compressed param -> {"axes": [α axis of each plane], "rank": r} for every compressed
    # weight; empty: one plane of alpha_mode's axis each, no low-rank (v1/v2)
    parts: dict[str, dict] = field(default_factory=dict)
    # the fine-tune's end-of-sequence tokens (its config's and generation config's eos_token_id),
    # recorded where they are not the base's: its answers end there, as they would served alone;
    # empty: the base's
    eos_token_ids: tuple[int, ...] = ()
    # the fine-tune's own chat template (with its special tokens' text) and sampling defaults (its
    # generation config's GENERATION_CONFIG_KEYS), where they are not the base's: the gateway serves
    # the variant with them (docs/gateway.md); None / empty: the base's
    chat_template: TemplateSource | None = None
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # the sha256 of the fine-tune's own tokenizer.json, carried as the tensor "tokenizer.json.file",
    # where it reads or writes text otherwise than the base's: the worker serves the variant with it;
    # "": the base's tokenizer
    tokenizer_sha256: str = ""
    # the fine-tune's vocabulary where it grew past the base's (tokens added, the embedding and LM
    # head resized: stored dense with its rows, its own tokenizer carried); 0: the base's
    vocab_size: int = 0

    @property
    def format_version(self) -> str:
        return PARTS_VERSION if self.parts else FORMAT_VERSION

    def axes(self, param: str) -> list[str]:
        """The α axis of each sign plane of a compressed weight."""
        return list(self.parts[param]["axes"]) if self.parts else [self.alpha_mode]

    def rank(self, param: str) -> int:
        return int(self.parts[param].get("rank", 0)) if self.parts else 0

    def to_strings(self) -> dict[str, str]:
        from bitdelta import __version__

        if not self.architecture or not self.layout:
            raise ValueError("a delta records the architecture and layout of its base (bitdelta.arch.ModelArgs)")
        out = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "variant": self.variant,
            "base_model": self.base_model,
            "base_fingerprint": self.base_fingerprint,
            "alpha_mode": self.alpha_mode,
            "architecture": self.architecture,
            "layout": self.layout,
            "shapes": json.dumps(self.shapes, sort_keys=True),
            "distilled": json.dumps(self.distilled),
            "tool_version": self.tool_version or f"bitdelta {__version__}",
        }
        if self.parts:
            out["parts"] = json.dumps(self.parts, sort_keys=True)
        if self.eos_token_ids:
            out["eos_token_ids"] = json.dumps(list(self.eos_token_ids))
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template.to_json()
        if self.sampling_defaults:
            out["sampling_defaults"] = json.dumps(self.sampling_defaults, sort_keys=True)
        if self.tokenizer_sha256:
            out["tokenizer_sha256"] = self.tokenizer_sha256
        if self.vocab_size:
            out["vocab_size"] = str(self.vocab_size)
        out.update(self.extra)
        return out

    @classmethod
    def from_strings(cls, md: dict[str, str]) -> DeltaMeta:
        known = {
            "format",
            "format_version",
            "variant",
            "base_model",
            "base_fingerprint",
            "alpha_mode",
            "architecture",
            "layout",
            "shapes",
            "distilled",
            "tool_version",
            "sha256",
            "parts",
            "eos_token_ids",
            "chat_template",
            "sampling_defaults",
            "tokenizer_sha256",
            "vocab_size",
        }
        v2 = md.get("format_version") != "1"
        try:
            return cls(
                architecture=md["architecture"] if v2 else "",
                layout=md["layout"] if v2 else V1_LAYOUT,
                variant=md["variant"],
                base_model=md["base_model"],
                base_fingerprint=md["base_fingerprint"],
                alpha_mode=md["alpha_mode"],
                shapes=json.loads(md["shapes"]),
                distilled=json.loads(md.get("distilled", "null")),
                tool_version=md.get("tool_version", ""),
                extra={k: v for k, v in md.items() if k not in known},
                parts=json.loads(md["parts"]) if md.get("format_version") == PARTS_VERSION else {},
                eos_token_ids=_token_ids(md.get("eos_token_ids")),
                chat_template=_template(md.get("chat_template")),
                sampling_defaults=_sampling(md.get("sampling_defaults")),
                tokenizer_sha256=md.get("tokenizer_sha256", ""),
                vocab_size=int(md.get("vocab_size", "0")),
            )
        except (KeyError, ValueError) as e:
            raise DeltaFormatError(f"metadata is incomplete or malformed: {e}") from None


def _template(text: str | None) -> TemplateSource | None:
    if text is None:
        return None
    try:
        return TemplateSource.from_json(text, "the delta's metadata")
    except ModelFileError as e:
        raise DeltaFormatError(str(e)) from None


def _sampling(text: str | None) -> dict[str, float]:
    """`sampling_defaults`' JSON object of GENERATION_CONFIG_KEYS, each under its rule (absent: none)."""
    if text is None:
        return {}
    d = json.loads(text)
    if not isinstance(d, dict) or not d or set(d) - set(GENERATION_CONFIG_KEYS):
        raise DeltaFormatError(f"sampling_defaults must be a JSON object of {', '.join(GENERATION_CONFIG_KEYS)}")
    try:
        SamplingDefaults.from_config(d)
    except GenerationError as e:
        raise DeltaFormatError(f"sampling_defaults: {e}") from None
    return d


def _token_ids(text: str | None) -> tuple[int, ...]:
    """`eos_token_ids`' JSON list of token ids (absent: none); DeltaFormatError for anything else."""
    if text is None:
        return ()
    ids = json.loads(text)
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        raise DeltaFormatError(f"eos_token_ids must be a non-empty JSON list of token ids >= 0, not {text[:80]!r}")
    return tuple(ids)


@dataclass
class DeltaHeader:
    """The parsed header of a delta file."""

    metadata: dict[str, str]
    tensors: list[TensorEntry]  # in file order
    header_bytes: int  # 8-byte length prefix + JSON
    sha256: dict[str, str]

    @property
    def meta(self) -> DeltaMeta:
        return DeltaMeta.from_strings(self.metadata)

    @property
    def file_size(self) -> int:
        return self.tensors[-1].end if self.tensors else self.header_bytes

    def bytes_by_role(self) -> dict[str, int]:
        """Bytes of every plane's signs, every plane's α's, low-rank factors, dense tensors and files."""
        out = {"sign": 0, "alpha": 0, "lowrank": 0, "dense": 0, "file": 0}
        for t in self.tensors:
            out[t.part] += t.nbytes
        return out

    def bytes_by_plane(self) -> dict[int, int]:
        """Signs + α bytes of sign plane 1, 2, ... over all compressed weights."""
        out: dict[int, int] = {}
        for t in self.tensors:
            if t.plane:
                out[t.plane] = out.get(t.plane, 0) + t.nbytes
        return dict(sorted(out.items()))


def parse_header(prefix: bytes, file_size: int | None = None) -> DeltaHeader:
    """Parse a delta header from the first bytes of a file.

    `prefix` must hold at least the whole header (see `header_length`). With
    `file_size`, truncation is detected here too.
    """
    n = header_length(prefix)
    if len(prefix) < 8 + n:
        raise DeltaFormatError(f"file is truncated inside its header (need {8 + n} bytes, have {len(prefix)})")
    try:
        raw = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DeltaFormatError(f"header is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DeltaFormatError("header is not a JSON object")
    md = raw.pop("__metadata__", None)
    if not isinstance(md, dict) or md.get("format") != FORMAT_NAME:
        raise DeltaFormatError("not a BitDelta file: __metadata__.format is not 'bitdelta'")
    if md.get("format_version") not in READ_VERSIONS:
        raise DeltaFormatError(
            f"unsupported delta format version {md.get('format_version')!r} "
            f"(this tool reads {' and '.join(READ_VERSIONS)})"
        )
    try:
        sha = json.loads(md["sha256"])
    except (KeyError, json.JSONDecodeError):
        raise DeltaFormatError("header has no valid per-tensor sha256 table") from None

    base = 8 + n
    entries = []
    for name, info in raw.items():
        try:
            dtype, shape, (s, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise DeltaFormatError(f"tensor {name}: malformed header entry", tensor=name) from None
        if dtype not in DTYPES:
            raise DeltaFormatError(f"tensor {name}: unsupported dtype {dtype}", tensor=name)
        suffix = name.rsplit(".", 1)[1] if "." in name else ""
        parsed = split_role(suffix)
        if parsed is None or (
            md.get("format_version") != PARTS_VERSION and (parsed[1] > 1 or parsed[0] in LOWRANK_ROLES)
        ):
            raise DeltaFormatError(
                f"tensor {name}: name must end in .sign, .alpha, .dense or .file"
                + (
                    " (v3: also .signN, .alphaN, .lowrank_u, .lowrank_v)"
                    if md.get("format_version") == PARTS_VERSION
                    else ""
                ),
                tensor=name,
            )
        numel = 1
        for d in shape:
            numel *= d
        if e - s != numel * DTYPES[dtype].itemsize or s < 0:
            raise DeltaFormatError(f"tensor {name}: data offsets do not match its shape and dtype", tensor=name)
        if name not in sha:
            raise DeltaFormatError(f"tensor {name}: no sha256 recorded", tensor=name)
        entries.append(TensorEntry(name, dtype, shape, base + s, base + e))
    entries.sort(key=lambda t: t.start)
    pos = base
    for t in entries:
        if t.start != pos:
            raise DeltaFormatError(f"tensor {t.name}: data is not contiguous (gap or overlap)", tensor=t.name)
        pos = t.end
    header = DeltaHeader(metadata=md, tensors=entries, header_bytes=base, sha256=sha)
    _ = header.meta  # validates the remaining metadata
    if file_size is not None and file_size < header.file_size:
        short = next(t for t in entries if t.end > file_size)
        raise DeltaFormatError(
            f"file is truncated: {file_size} bytes, header promises {header.file_size}; tensor {short.name} is cut",
            tensor=short.name,
        )
    if file_size is not None and file_size > header.file_size:
        raise DeltaFormatError(f"file has {file_size - header.file_size} trailing bytes after the last tensor")
    return header


def header_length(prefix: bytes) -> int:
    """Length of the JSON header, from the first 8 bytes."""
    if len(prefix) < 8:
        raise DeltaFormatError("file is truncated: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n == 0 or n > MAX_HEADER_BYTES:
        raise DeltaFormatError(f"header length {n} is not plausible; not a delta file or corrupted")
    return n


def read_header(path: str | os.PathLike) -> DeltaHeader:
    """Read and check the header of a delta file on disk (not the data)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        n = header_length(first)
        prefix = first + f.read(n)
    return parse_header(prefix, file_size=size)


def verify(path: str | os.PathLike, base_fingerprint: str | None = None) -> DeltaHeader:
    """Check a delta file completely: header, sizes, every tensor's sha256,
    shapes of signs and scales, and (if given) the base fingerprint.

    Raises DeltaFormatError naming the bad tensor, or BaseMismatchError.
    """
    header = read_header(path)
    meta = header.meta
    if base_fingerprint is not None:
        check_base(meta, base_fingerprint)
    check_structure(header)
    with open(path, "rb") as f:
        for t in header.tensors:
            f.seek(t.start)
            digest = _sha256_stream(f, t.nbytes)
            if digest != header.sha256[t.name]:
                raise DeltaFormatError(f"tensor {t.name}: sha256 mismatch (corrupted data)", tensor=t.name)
    return header


def check_base(meta: DeltaMeta, base_fingerprint: str) -> None:
    if meta.base_fingerprint != base_fingerprint:
        raise BaseMismatchError(
            f"delta {meta.variant!r} was built for base {meta.base_model!r} with fingerprint "
            f"{meta.base_fingerprint[:16]}…, but the base here has fingerprint {base_fingerprint[:16]}…"
        )


def check_arch(variant: str, architecture: str, layout: str, args) -> None:
    """A delta (its recorded `architecture` and `layout`; "" = a v1 file) was made for a base of
    `args`' architecture and layout (a bitdelta.arch.ModelArgs), else ArchMismatchError naming both."""
    made_for = (architecture,) if architecture else V1_ARCHITECTURES
    if args.model_type not in made_for or layout != args.layout:
        raise ArchMismatchError(
            f"delta {variant!r} was made for a {architecture or '/'.join(V1_ARCHITECTURES) + ' (format v1)'} "
            f"base with layout {layout!r}, but the base here is {args.model_type} with layout {args.layout!r}"
        )


def check_structure(header: DeltaHeader) -> None:
    """Signs and scales pair up and have the shapes the metadata promises."""
    meta = header.meta
    modes = ("row", "matrix", "col", "auto") if meta.parts else ("row", "matrix")
    if meta.alpha_mode not in modes:
        raise DeltaFormatError(f"alpha_mode must be one of {', '.join(modes)}, not {meta.alpha_mode!r}")
    if meta.parts and set(meta.parts) != set(meta.shapes):
        raise DeltaFormatError("metadata 'parts' must describe exactly the compressed weights of 'shapes'")
    by_name = {t.name: t for t in header.tensors}
    expected: set[str] = set()
    for param, (d_out, d_in) in meta.shapes.items():
        try:
            axes, rank = meta.axes(param), meta.rank(param)
        except (KeyError, TypeError, ValueError):
            raise DeltaFormatError(f"tensor {param}: malformed 'parts' entry", tensor=param) from None
        if (not axes and rank <= 0) or any(a not in AXES for a in axes) or rank < 0:
            raise DeltaFormatError(
                f"tensor {param}: planes {axes} / rank {rank} are not valid (a weight needs a sign plane or a rank)",
                tensor=param,
            )
        for i, axis in enumerate(axes, start=1):
            names = (param + plane_suffix("sign", i), param + plane_suffix("alpha", i))
            sign, alpha = by_name.get(names[0]), by_name.get(names[1])
            if sign is None or alpha is None:
                raise DeltaFormatError(
                    f"tensor {param}: compressed weight lacks {names[0]} or {names[1]}", tensor=param
                )
            if sign.dtype != "U8" or sign.shape != (d_out, (d_in + 7) // 8):
                raise DeltaFormatError(
                    f"tensor {sign.name}: expected uint8 [{d_out}, {(d_in + 7) // 8}]", tensor=sign.name
                )
            want = {"row": (d_out,), "matrix": (1,), "col": (d_in,)}[axis]
            if alpha.dtype != "F32" or alpha.shape != want:
                raise DeltaFormatError(f"tensor {alpha.name}: expected float32 {list(want)}", tensor=alpha.name)
            expected.update(names)
        if rank:
            for role, want in (("lowrank_u", (d_out, rank)), ("lowrank_v", (rank, d_in))):
                t = by_name.get(f"{param}.{role}")
                if t is None or t.dtype != "F16" or t.shape != want:
                    raise DeltaFormatError(f"tensor {param}.{role}: expected float16 {list(want)}", tensor=param)
                expected.add(t.name)
    files = {t.param: t for t in header.tensors if t.part == "file"}
    for name, t in files.items():
        if name not in FILES or t.dtype != "U8" or len(t.shape) != 1:
            raise DeltaFormatError(
                f"tensor {t.name}: a delta carries {', '.join(FILES)} as uint8 [n] only", tensor=t.name
            )
    tok = files.get("tokenizer.json")
    if (tok is not None and header.sha256[tok.name] != meta.tokenizer_sha256) or (
        tok is None and meta.tokenizer_sha256
    ):
        raise DeltaFormatError(
            "metadata 'tokenizer_sha256' must be the sha256 of the tensor tokenizer.json.file, and both or neither there",
            tensor="tokenizer.json.file",
        )
    if meta.vocab_size:  # a resized vocabulary: read with its own tokenizer, its embedding rows stored whole
        embed = by_name.get("model.embed_tokens.weight.dense")
        if meta.vocab_size < 1 or tok is None or embed is None or embed.shape[0] != meta.vocab_size:
            raise DeltaFormatError(
                f"metadata 'vocab_size' {meta.vocab_size}: a resized vocabulary needs the fine-tune's tokenizer.json "
                "and its whole embedding of that many rows (model.embed_tokens.weight.dense)"
            )
    for t in header.tensors:
        if t.part not in ("dense", "file") and t.name not in expected:
            why = "no shape recorded for" if t.param not in meta.shapes else "not a part the metadata gives"
            raise DeltaFormatError(f"tensor {t.name}: {why} {t.param}", tensor=t.name)


def _sha256_stream(f: BinaryIO, n: int) -> str:
    h = hashlib.sha256()
    left = n
    while left:
        block = f.read(min(HASH_BLOCK, left))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a tensor, as safetensors stores them."""
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_delta(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: DeltaMeta) -> DeltaHeader:
    """Write a delta file atomically (temporary file in the same directory, fsync, rename).

    `tensors` maps full names (`P.sign`, `P.alpha`, `P.dense`) to tensors.
    An interrupted write leaves no file at `path`.
    """
    path = Path(path)
    names = sorted(tensors)
    header: dict = {}
    offset = 0
    sha = {}
    for name in names:
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} is not storable")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        sha[name] = hashlib.sha256(tensor_bytes(t)).hexdigest()
        offset += nbytes
    md = meta.to_strings()
    md["sha256"] = json.dumps(sha, sort_keys=True)
    header["__metadata__"] = md
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align data to 8 bytes, as safetensors does
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name in names:
                f.write(tensor_bytes(tensors[name]))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; the file is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return read_header(path)


def current_umask() -> int:
    """The process's umask (to give atomically written files the usual permissions)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass
class SignPlane:
    """α ⊙ S: signs uint8 [d_out, ceil(d_in/8)], alpha fp32 [d_out] ("row"), [1] ("matrix") or
    [d_in] ("col")."""

    signs: torch.Tensor
    alpha: torch.Tensor
    axis: str = "row"

    def scale(self) -> torch.Tensor:
        """α shaped to broadcast over [d_out, d_in]."""
        a = self.alpha.float()
        return a.reshape(1, -1) if self.axis == "col" else a.reshape(-1, 1)

    @property
    def nbytes(self) -> int:
        return self.signs.numel() + self.alpha.numel() * 4


@dataclass
class CompressedWeight:
    """One compressed weight's delta: Σ_i α_i ⊙ S_i over its sign planes, + U · V when it has a
    low-rank residual (u fp16 [d_out, r], v fp16 [r, d_in]). Plain BitDelta: one plane; an imported
    LoRA module: none, U · V only."""

    planes: list[SignPlane]
    shape: tuple[int, int]
    u: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def signs(self) -> torch.Tensor:
        """The first plane's signs."""
        return self.planes[0].signs

    @property
    def alpha(self) -> torch.Tensor:
        """The first plane's α."""
        return self.planes[0].alpha

    @property
    def plain(self) -> bool:
        """One plane of row or matrix α and no low-rank part: what format v2 stores."""
        return len(self.planes) == 1 and self.planes[0].axis != "col" and self.u is None

    @property
    def rank(self) -> int:
        return 0 if self.u is None else self.u.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes) + sum(t.numel() * 2 for t in (self.u, self.v) if t is not None)

    def dense(self) -> torch.Tensor:
        """The delta as fp32 [d_out, d_in]."""
        from bitdelta_kernels.bits import unpack_signs

        d = torch.zeros(self.shape, dtype=torch.float32)
        for p in self.planes:
            d += unpack_signs(p.signs, self.shape[1], torch.float32) * p.scale()
        if self.u is not None:
            d += self.u.float() @ self.v.float()
        return d

    def tensors(self, param: str) -> dict[str, torch.Tensor]:
        """The file's tensors of this weight, by full name."""
        out = {}
        for i, p in enumerate(self.planes, start=1):
            out[param + plane_suffix("sign", i)] = p.signs
            out[param + plane_suffix("alpha", i)] = p.alpha.float()
        if self.u is not None:
            out[param + ".lowrank_u"], out[param + ".lowrank_v"] = self.u.half(), self.v.half()
        return out

    def part(self) -> dict:
        """Its `parts` entry (format v3)."""
        return {"axes": [p.axis for p in self.planes], "rank": self.rank}


@dataclass
class Delta:
    """A delta in memory: compressed weights and dense replacements, by parameter name."""

    meta: DeltaMeta
    compressed: dict[str, CompressedWeight]
    dense: dict[str, torch.Tensor]
    files: dict[str, bytes] = field(default_factory=dict)  # the fine-tune's own files (FILES) it carries

    @property
    def nbytes(self) -> int:
        c = sum(w.nbytes for w in self.compressed.values()) + sum(len(b) for b in self.files.values())
        return c + sum(t.numel() * t.element_size() for t in self.dense.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of its file, by full name."""
        out = {}
        for name, cw in self.compressed.items():
            out.update(cw.tensors(name))
        for name, t in self.dense.items():
            out[name + ".dense"] = t
        for name, data in self.files.items():
            out[name + ".file"] = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            )
        return out

    def with_parts(self) -> DeltaMeta:
        """Its metadata with `parts` filled in unless every weight is one plane of the delta's α mode
        (row or matrix): then v2, else v3."""
        from dataclasses import replace

        plain = all(cw.plain and cw.planes[0].axis == self.meta.alpha_mode for cw in self.compressed.values())
        return replace(self.meta, parts={} if plain else {k: cw.part() for k, cw in self.compressed.items()})


def save_delta(path: str | os.PathLike, delta: Delta) -> DeltaHeader:
    """Write an in-memory delta to a file (atomically): v2, or v3 when some weight is not plain; the
    metadata names the sha256 of the tokenizer it carries, if one."""
    from dataclasses import replace

    tok = delta.files.get("tokenizer.json")
    if delta.meta.vocab_size and tok is None:
        raise ValueError(
            f"delta {delta.meta.variant!r}: a grown vocabulary is written with the tokenizer that names it"
        )
    meta = replace(delta.with_parts(), tokenizer_sha256=hashlib.sha256(tok).hexdigest() if tok is not None else "")
    return write_delta(path, delta.tensors(), meta)


def delta_from_tensors(meta: DeltaMeta, tensors: dict[str, torch.Tensor]) -> Delta:
    compressed, dense = {}, {}
    for param, shape in meta.shapes.items():
        planes = [
            SignPlane(tensors[param + plane_suffix("sign", i)], tensors[param + plane_suffix("alpha", i)], axis)
            for i, axis in enumerate(meta.axes(param), start=1)
        ]
        u, v = (tensors[f"{param}.lowrank_u"], tensors[f"{param}.lowrank_v"]) if meta.rank(param) else (None, None)
        compressed[param] = CompressedWeight(planes, tuple(shape), u, v)
    files = {}
    for name, t in tensors.items():
        if name.endswith(".dense"):
            dense[name[: -len(".dense")]] = t
        elif name.endswith(".file"):
            files[name[: -len(".file")]] = t.numpy().tobytes()
    return Delta(meta, compressed, dense, files)


def load_delta(path: str | os.PathLike, base_fingerprint: str | None = None, verify_hashes: bool = True) -> Delta:
    """Load a delta file into memory, checking it (hashes unless told not to) and its base."""
    path = Path(path)
    header = verify(path, base_fingerprint) if verify_hashes else read_header(path)
    if not verify_hashes:
        if base_fingerprint is not None:
            check_base(header.meta, base_fingerprint)
        check_structure(header)
    tensors = {}
    with open(path, "rb") as f:
        for t in header.tensors:
            f.seek(t.start)
            buf = bytearray(f.read(t.nbytes))
            tensors[t.name] = (
                torch.frombuffer(buf, dtype=DTYPES[t.dtype]).reshape(t.shape)
                if t.nbytes
                else torch.empty(t.shape, dtype=DTYPES[t.dtype])
            )
    return delta_from_tensors(header.meta, tensors)
