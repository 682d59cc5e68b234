"""Capacity planner: from a config.json of a supported family (bitdelta.arch), the bytes of the base, of
one BitDelta delta, of the KV cache, and what fits on a set of GPUs.

    bitdelta plan --config configs/llama-2-70b.json --variants 14 --gpu-mem 80GB --gpus 8

It first reproduces the brief's back-of-envelope numbers (every parameter
1 bit: 70B → 140 GB base, 8.75 GB per delta, 14 variants ≈ 262 GB), then
corrects them:

- a delta holds signs only for the attention/MLP projections (rows padded to
  whole bytes), one fp32 α per output row (or per matrix), and whatever else
  the fine-tune changed stored whole: embeddings, LM head, RMSNorm weights
  (or the embeddings as signs too, `--embeddings sign`);
- with tensor parallelism every GPU holds its slice of the base and of each
  delta, exactly as the tensor-parallel worker splits them (`bitdelta.shard`:
  column/row-parallel projections split the signs and the α's with them, the
  vocabulary-parallel embedding and head split by rows, norms and row-parallel
  α's replicated); KV heads are split across GPUs, or replicated when TP
  exceeds the number of KV heads. Per GPU means rank 0's slice, the largest;
- a delta costs each rank what the worker allocates for it (`RankDelta`): one
  slot of the rank's stacks per sign plane (signs and a row of α for every
  projection, its norms and biases; a k-plane delta of format v3 holds k slots,
  a contiguous run, on every rank), plus what is allocated for that delta alone:
  its slices of a changed embedding / LM head, of low-rank factors and of
  column α's. From a mode (`--alpha`, `--embeddings`: one plane) or from a
  real delta file (`--delta`: its planes, factors and α axes as its header
  says, each tensor cut by `TPLayout.shard_of`);
- the KV cache is what limits concurrent sequences: 2 · layers · kv_heads ·
  head_dim · dtype bytes per token;
- a cold load reads the delta from NVMe at 3–7 GB/s: 8.75 GB takes 1.3–3 s,
  not 200 ms; then PCIe host→GPU (~25 GB/s per GPU on PCIe 5 ×16 in practice).

Units: GB = 10⁹ bytes (the brief's 140 GB is 70·10⁹ · 2 B). `--gpu-mem 80GB`
is decimal; `80GiB` is binary (an "80 GB" H100 has 79.6 GiB ≈ 85.5·10⁹ B).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from bitdelta.arch import ModelArgs
from bitdelta.cli_error import CliError
from bitdelta.format import DeltaHeader, alpha_axis, check_arch, read_header
from bitdelta.shard import EMBED, HEAD, TPLayout
from bitdelta.units import parse_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
GB = 1e9


@dataclass(frozen=True)
class Shape:
    """The sizes the plan needs, read off the one model description (`bitdelta.arch.ModelArgs`,
    so every supported family plans with its own layout: fused or split projections, biases,
    Qwen3's q/k norms, tied embeddings)."""

    args: ModelArgs

    @classmethod
    def from_hf(cls, cfg: dict) -> Shape:
        return cls(ModelArgs.from_hf(cfg))

    @property
    def vocab(self) -> int:
        return self.args.vocab_size

    @property
    def dim(self) -> int:
        return self.args.dim

    @property
    def layers(self) -> int:
        return self.args.n_layers

    @property
    def kv_heads(self) -> int:
        return self.args.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.args.head_dim

    @property
    def tie_embeddings(self) -> bool:
        return self.args.tie_embeddings

    def projections(self) -> list[tuple[int, int]]:
        """[d_out, d_in] of the compressed matrices of ONE layer, as the checkpoint stores them."""
        return [(m.d_out, m.d_in) for m in self.args.matrices()]

    @property
    def projection_params(self) -> int:
        return self.layers * sum(o * i for o, i in self.projections())

    @property
    def embedding_params(self) -> int:
        """Embedding table plus an untied LM head."""
        return self.vocab * self.dim * (1 if self.tie_embeddings else 2)

    @property
    def norm_params(self) -> int:
        """Every norm parameter (the layers' own, Qwen3's q/k norms, the final norm; StableLM's biases too)."""
        return self.args.norm_param_count()

    @property
    def bias_params(self) -> int:
        return self.layers * sum(m.d_out for m in self.args.matrices() if m.bias)

    @property
    def params(self) -> int:
        return self.projection_params + self.embedding_params + self.norm_params + self.bias_params


@dataclass(frozen=True)
class DeltaBytes:
    """A delta file's bytes by part (every plane's signs, every plane's α's, dense tensors, low-rank factors)."""

    signs: int
    alpha: int
    dense: int
    lowrank: int = 0

    @property
    def total(self) -> int:
        return self.signs + self.alpha + self.dense + self.lowrank

    @classmethod
    def of_file(cls, h: DeltaHeader) -> DeltaBytes:
        r = h.bytes_by_role()
        return cls(r["sign"], r["alpha"], r["dense"], r["lowrank"])


@dataclass(frozen=True)
class RankDelta:
    """What one delta costs one tensor-parallel rank's device, as the worker allocates it: `planes`
    slots of the rank's stacks (the same run of slots on every rank), each `slot` bytes, and
    `extra` bytes allocated for this delta alone (its slices of a changed embedding / LM head, of
    low-rank factors, of column α's).

        total = planes · slot + extra"""

    rank: int
    planes: int
    slot: int
    extra: int

    @property
    def total(self) -> int:
        return self.planes * self.slot + self.extra


def delta_bytes(
    s: Shape,
    dtype: str = "bf16",
    alpha: str = "row",
    embeddings: str = "dense",
    norms_changed: bool = True,
    planes: int = 1,
    rank: int = 0,
) -> DeltaBytes:
    """One delta of a full fine-tune (every parameter changed), as `bitdelta compress` writes it
    without a budget: `planes` sign planes and a rank-`rank` fp16 residual on every compressed matrix.

    Dense parts are stored in the fine-tune's dtype (`dtype`)."""
    b = DTYPE_BYTES[dtype]
    mats = [(o, i) for o, i in s.projections()] * s.layers
    if embeddings == "sign":
        mats += [(s.vocab, s.dim)] * (1 if s.tie_embeddings else 2)
    signs = planes * sum(o * math.ceil(i / 8) for o, i in mats)
    a = planes * sum(o if alpha == "row" else 1 for o, _ in mats) * 4
    small = s.norm_params + s.bias_params  # norms and biases: changed in a full fine-tune, stored whole
    dense = (s.embedding_params * b if embeddings == "dense" else 0) + (small * b if norms_changed else 0)
    lowrank = sum(rank * (o + i) * 2 for o, i in mats)
    return DeltaBytes(signs, a, dense, lowrank)


def slot_bytes(local: Shape, dtype: str = "bf16") -> int:
    """One slot of a rank's stacks (`local`: the rank's slice of the model, `TPLayout.local_args`):
    packed signs and an fp32 α per output row of every projection (a per-matrix α too takes its
    rows), and every norm and bias in the serving dtype."""
    per_layer = sum(o * math.ceil(i / 8) + o * 4 for o, i in local.projections())
    return local.layers * per_layer + (local.norm_params + local.bias_params) * DTYPE_BYTES[dtype]


def _extra_bytes(local: Shape, role: str, shape: tuple[int, ...], dtype: str) -> int:
    """Device bytes of one tensor the worker allocates per delta, at the rank's slice's `shape`: a
    changed embedding / head (dense in the serving dtype; per plane its signs and an fp32 α per
    vocabulary row) or a low-rank factor (fp16, as stored)."""
    kind = role.rstrip("0123456789")
    if kind == "alpha":
        return local.vocab * 4
    return math.prod(shape) * {"dense": DTYPE_BYTES[dtype], "sign": 1}.get(kind, 2)


def rank_deltas(
    s: Shape, tp: int, dtype: str = "bf16", embeddings: str = "dense", planes: int = 1, rank: int = 0
) -> list[RankDelta]:
    """Each rank's cost of a delta of a full fine-tune (every parameter changed) in a mode:
    `planes` sign planes and a rank-`rank` residual on every compressed matrix (`delta_bytes`)."""
    tables = [EMBED] if s.tie_embeddings else [EMBED, HEAD]
    lowrank = [(f"model.layers.{i}.{m.name}.weight", m) for i in range(s.layers) for m in s.args.matrices()]
    if embeddings == "sign":
        lowrank += [(t, None) for t in tables]
    out = []
    for r in range(tp):
        layout = TPLayout(s.args, tp, r)
        local = Shape(layout.local_args())
        if embeddings == "dense":
            extra = len(tables) * local.vocab * local.dim * DTYPE_BYTES[dtype]
        else:
            extra = len(tables) * planes * (local.vocab * math.ceil(local.dim / 8) + local.vocab * 4)
        for param, m in lowrank if rank else []:
            d_out, d_in = (s.vocab, s.dim) if m is None else (m.d_out, m.d_in)
            for role, shape in (("lowrank_u", (d_out, rank)), ("lowrank_v", (rank, d_in))):
                extra += _extra_bytes(local, role, layout.shard_of(param, role, shape).shape(shape), dtype)
        out.append(RankDelta(r, planes, slot_bytes(local, dtype), extra))
    return out


def rank_deltas_of_file(h: DeltaHeader, s: Shape, tp: int, dtype: str = "bf16") -> list[RankDelta]:
    """Each rank's cost of the delta file with header `h`: as many slots as its projections' most
    sign planes, and its slice (`TPLayout.shard_of`, with each plane's α axis from the header) of
    every tensor allocated per delta; a group with a plane of column α's holds
    [planes, its matrices, its input columns on the rank] fp32 of them."""
    if h.meta.vocab_size and tp > 1:
        raise ValueError(
            f"delta {h.meta.variant!r} grew the vocabulary to {h.meta.vocab_size} tokens, which tensor-parallel "
            "ranks do not serve (their vocabulary split is the base's): plan it on one GPU (--tp 1)"
        )
    axes = {p: x["axes"] for p, x in h.meta.parts.items()}
    proj = {f"model.layers.{i}.{m.name}.weight": (i, m.group) for i in range(s.layers) for m in s.args.matrices()}
    planes = max([t.plane for t in h.tensors if t.param in proj] or [1])
    col_groups = {proj[p] for p, a in axes.items() if p in proj and "col" in a}
    out = []
    for r in range(tp):
        layout = TPLayout(s.args, tp, r)
        local = Shape(layout.local_args())
        extra = 0
        for t in h.tensors:
            if t.param in (EMBED, HEAD) or t.part == "lowrank":
                shape = tuple(t.shape)
                cut = layout.shard_of(t.param, t.role, shape, alpha_axis(axes, t.param, t.role)).shape(shape)
                extra += _extra_bytes(local, t.role, cut, dtype)
        groups = local.args.group_shapes()
        mats = {g: sum(1 for m in local.args.matrices() if m.group == g) for g in groups}
        extra += sum(planes * mats[g] * groups[g][1] * 4 for _, g in col_groups)
        out.append(RankDelta(r, planes, slot_bytes(local, dtype), extra))
    return out


def kv_bytes_per_token(s: Shape, dtype: str = "bf16") -> int:
    """K and V of one token across all layers (the whole model, not per GPU)."""
    return 2 * s.layers * s.kv_heads * s.head_dim * DTYPE_BYTES[dtype]


# Sizes models are sold by; the brief's arithmetic uses the name ("70B"), not the count (68.98B).
NOMINAL_SIZES_B = (0.135, 0.36, 0.5, 1, 1.5, 2, 3, 7, 8, 9, 13, 14, 27, 32, 34, 65, 70, 72, 110, 405)


def nominal_size(params: int) -> float:
    """The marketing size within 8 % of `params` (68.98B -> 70B), else `params` to 2 significant digits."""
    best = min(NOMINAL_SIZES_B, key=lambda b: abs(b * 1e9 - params))
    if abs(best * 1e9 - params) <= 0.08 * params:
        return best * 1e9
    return float(f"{params:.2g}")


def parse_count(text: str) -> float:
    """'70B' -> 70e9, '135M' -> 135e6."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMBT]?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a parameter count from {text!r} (try 70B)")
    return float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()]


@dataclass
class Plan:
    config: str
    params: int
    base_bytes: int
    delta: DeltaBytes
    delta_sign_emb: DeltaBytes
    kv_per_token: int
    variants: int
    gpus: int
    tp: int
    replicas: int
    gpu_mem: float
    reserve: float
    context: int
    base_per_gpu: float
    delta_per_gpu: float
    delta_per_rank: list[RankDelta]
    kv_per_token_per_gpu: float
    free_for_kv_per_gpu: float
    sequences_per_replica: int
    max_variants_per_gpu: int
    brief: dict
    load: dict
    fits: bool
    delta_from: str = ""  # the delta file planned for ("": the mode's delta)
    rank: int = 0  # the mode's low-rank residual per matrix (0: none; a --delta file's is in `delta`)


def make_plan(
    cfg: dict,
    variants: int,
    gpu_mem: float,
    gpus: int,
    tp: int | None = None,
    dtype: str = "bf16",
    alpha: str = "row",
    embeddings: str = "dense",
    context: int = 4096,
    reserve_frac: float = 0.10,
    min_sequences: int = 1,
    nvme_gbps: tuple[float, float] = (3.0, 7.0),
    pcie_gbps: float = 25.0,
    name: str = "",
    nominal_params: float | None = None,
    delta_file: DeltaHeader | None = None,
    planes: int = 1,
    rank: int = 0,
) -> Plan:
    """The whole plan. `tp` defaults to `gpus` (one tensor-parallel replica over all GPUs);
    `reserve_frac` of each GPU is kept for activations, CUDA context and fragmentation.
    `delta_file`: plan for variants like this delta (its header) instead of the mode's delta
    (`alpha`, `embeddings`, and `planes` sign planes and a rank-`rank` residual on every matrix)."""
    s = Shape.from_hf(cfg)
    tp = tp or gpus
    if gpus % tp:
        raise ValueError(f"--gpus {gpus} is not a multiple of --tp {tp}")
    if planes < 1 or rank < 0:
        raise ValueError(f"--planes must be at least 1 and --rank at least 0 (got {planes}, {rank})")
    if delta_file is not None and (planes, rank) != (1, 0):
        raise ValueError("--planes/--rank describe the mode's delta; a --delta file says its own")
    b = DTYPE_BYTES[dtype]
    base = s.params * b
    if delta_file is not None:
        check_arch(delta_file.meta.variant, delta_file.meta.architecture, delta_file.meta.layout, s.args)
    d = (
        delta_bytes(s, dtype, alpha, embeddings, planes=planes, rank=rank)
        if delta_file is None
        else DeltaBytes.of_file(delta_file)
    )
    d_sign = delta_bytes(s, dtype, alpha, "sign", planes=planes, rank=rank)
    kv = kv_bytes_per_token(s, dtype)
    # rank 0's slice of everything (the largest: bitdelta.shard), as the worker holds it; KV heads
    # split across the TP group, replicated when there are fewer heads than GPUs
    local = Shape(TPLayout(s.args, tp, 0).local_args()) if tp > 1 else s
    kv_gpu = kv_bytes_per_token(local, dtype)
    per_rank = (
        rank_deltas(s, tp, dtype, embeddings, planes, rank)
        if delta_file is None
        else rank_deltas_of_file(delta_file, s, tp, dtype)
    )
    base_gpu, delta_gpu = local.params * b, per_rank[0].total
    reserve = gpu_mem * reserve_frac
    free = gpu_mem - reserve - base_gpu - variants * delta_gpu
    seqs = max(0, int(free // (kv_gpu * context))) if free > 0 else 0
    # Most deltas a GPU can hold while keeping KV room for `min_sequences` full contexts.
    room = gpu_mem - reserve - base_gpu - min_sequences * kv_gpu * context
    max_var = max(0, int(room // delta_gpu)) if room > 0 else 0
    params_brief = nominal_params if nominal_params else nominal_size(s.params)
    brief = {
        "params": params_brief,
        "base": params_brief * 2,
        "delta": params_brief / 8,
        "total": params_brief * 2 + variants * params_brief / 8,
        "cold_load_claim_s": 0.2,
    }
    load = {
        "nvme_s": [d.total / (g * GB) for g in nvme_gbps],
        "nvme_gbps": list(nvme_gbps),
        "pcie_per_gpu_s": delta_gpu / (pcie_gbps * GB),
        "pcie_gbps": pcie_gbps,
        "brief_delta_nvme_s": [brief["delta"] / (g * GB) for g in nvme_gbps],
    }
    return Plan(
        config=name,
        params=s.params,
        base_bytes=base,
        delta=d,
        delta_sign_emb=d_sign,
        kv_per_token=kv,
        variants=variants,
        gpus=gpus,
        tp=tp,
        replicas=gpus // tp,
        gpu_mem=gpu_mem,
        reserve=reserve,
        context=context,
        base_per_gpu=base_gpu,
        delta_per_gpu=delta_gpu,
        delta_per_rank=per_rank,
        kv_per_token_per_gpu=kv_gpu,
        free_for_kv_per_gpu=max(0.0, free),
        sequences_per_replica=seqs,
        max_variants_per_gpu=max_var,
        brief=brief,
        load=load,
        fits=free > 0,
        delta_from=delta_file.meta.variant if delta_file is not None else "",
        rank=rank,
    )


def _gb(x: float) -> str:
    """Bytes in GB, or MB below 1 GB (decimal units)."""
    return f"{x / GB:,.2f} GB" if x >= GB else f"{x / 1e6:,.1f} MB"


def _secs(t: float) -> str:
    return f"{t:.1f} s" if t >= 1 else f"{t * 1000:.0f} ms"


def render(p: Plan, alpha: str = "row", embeddings: str = "dense", dtype: str = "bf16") -> str:
    d, ds, r0 = p.delta, p.delta_sign_emb, p.delta_per_rank[0]
    n = p.variants
    lines = [
        f"# Capacity plan: {p.config or 'model'}, {n} variants on {p.gpus} × {_gb(p.gpu_mem)} "
        f"(TP {p.tp}, {p.replicas} replica{'s' if p.replicas > 1 else ''})",
        "",
        f"{p.params:,} parameters, {dtype} weights, "
        + (
            f"every variant like the delta file of {p.delta_from!r} ({r0.planes} sign plane(s) per matrix at most)."
            if p.delta_from
            else f"α per {alpha}, changed embeddings stored {embeddings}"
            + (f", {r0.planes} sign planes per matrix" if r0.planes > 1 else "")
            + (f", a rank-{p.rank} fp16 residual per matrix" if p.rank else "")
            + "."
        ),
        "",
        "## The brief's arithmetic (every parameter 1 bit)",
        "",
        f"- base {p.brief['params'] / 1e9:g}B × 2 B = {_gb(p.brief['base'])}",
        f"- one delta = {p.brief['params'] / 1e9:g}B / 8 = {_gb(p.brief['delta'])}",
        f"- base + {n} deltas = {_gb(p.brief['total'])} (against {n} full copies: {_gb(n * p.brief['base'])})",
        f"- cold load claimed ~{p.brief['cold_load_claim_s'] * 1000:.0f} ms",
        "",
        "## Corrected",
        "",
        "| part | bytes | note |",
        "|---|---:|---|",
        f"| base ({dtype}) | {_gb(p.base_bytes)} | all {p.params:,} parameters |",
        f"| delta: signs | {_gb(d.signs)} | projections only, rows padded to whole bytes |",
        f"| delta: α | {_gb(d.alpha)} | fp32, one per {'output row' if alpha == 'row' else 'matrix'} |",
        f"| delta: dense | {_gb(d.dense)} | {'embeddings/LM head and ' if embeddings == 'dense' else ''}"
        f"RMSNorm weights, stored whole |",
        *([f"| delta: low-rank | {_gb(d.lowrank)} | fp16 factors U, V of the residuals |"] if d.lowrank else []),
        f"| **one delta** | **{_gb(d.total)}** | {p.base_bytes / d.total:.1f}× smaller than the base "
        f"(with the embeddings as signs too: {_gb(ds.total)}) |",
        f"| base + {n} deltas | {_gb(p.base_bytes + n * d.total)} | against {n} full copies: {_gb(n * p.base_bytes)} |",
        f"| KV cache per token | {p.kv_per_token / 1e6:.3f} MB | 2 × layers × kv_heads × head_dim × {dtype} |",
        "",
        f"## Per GPU (tensor parallel over {p.tp})",
        "",
        f"- base shard {_gb(p.base_per_gpu)}; one delta shard {_gb(p.delta_per_gpu)} "
        f"({r0.planes} slot{'s' if r0.planes > 1 else ''} of {_gb(r0.slot)} + {_gb(r0.extra)} allocated for it "
        f"alone); {n} delta shards {_gb(n * p.delta_per_gpu)}",
        *(
            [f"- one delta shard per rank: {', '.join(f'{r.rank}: {_gb(r.total)}' for r in p.delta_per_rank)}"]
            if p.tp > 1
            else []
        ),
        f"- reserve for activations, CUDA context, fragmentation: {_gb(p.reserve)} ({p.reserve / p.gpu_mem:.0%})",
        f"- KV cache per token per GPU: {p.kv_per_token_per_gpu / 1e3:.1f} kB",
        f"- left for the KV cache: {_gb(p.free_for_kv_per_gpu)} → "
        f"**{p.sequences_per_replica} concurrent sequences of {p.context} tokens per replica**, "
        f"{p.sequences_per_replica * p.replicas} over the {p.replicas} replica(s)",
        f"- at most **{p.max_variants_per_gpu} variants resident** per GPU while keeping room for one full "
        f"{p.context}-token sequence",
    ]
    if not p.fits:
        lines.append(f"- **does not fit**: base shard + {n} delta shards exceed the GPU memory")
    lines += [
        "",
        "## Cold load of one delta",
        "",
        f"- NVMe at {p.load['nvme_gbps'][0]:g}–{p.load['nvme_gbps'][1]:g} GB/s: "
        f"{_secs(p.load['nvme_s'][1])}–{_secs(p.load['nvme_s'][0])} for {_gb(d.total)} "
        f"(the brief's {_gb(p.brief['delta'])}: {_secs(p.load['brief_delta_nvme_s'][1])}–"
        f"{_secs(p.load['brief_delta_nvme_s'][0])}, not {p.brief['cold_load_claim_s'] * 1000:.0f} ms)",
        f"- then host → GPU at ~{p.load['pcie_gbps']:g} GB/s per GPU: {p.load['pcie_per_gpu_s'] * 1000:.0f} ms per "
        "shard, in parallel over the GPUs",
        "- hide it: keep hot deltas resident, prefetch on queue arrival, pin host buffers, read at the "
        "measured disk bandwidth",
    ]
    return "\n".join(lines) + "\n"


def cmd_plan(a: argparse.Namespace) -> None:

    try:
        cfg = json.loads(Path(a.config).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"cannot read the config {a.config}: {e}") from None
    try:
        gpu_mem = parse_bytes(a.gpu_mem)
        header = read_header(a.delta) if a.delta else None
        p = make_plan(
            cfg,
            a.variants,
            gpu_mem,
            a.gpus,
            a.tp,
            a.dtype,
            a.alpha,
            a.embeddings,
            a.context,
            a.reserve,
            name=Path(a.config).stem,
            nominal_params=parse_count(a.nominal) if a.nominal else None,
            delta_file=header,
            planes=a.planes,
            rank=a.rank,
        )
    except (KeyError, ValueError, OSError) as e:
        raise CliError(f"plan: {e}") from None
    if a.json:
        out = asdict(p)
        for k in ("delta", "delta_sign_emb"):
            out[k]["total"] = getattr(p, k).total
        for r, x in zip(out["delta_per_rank"], p.delta_per_rank, strict=True):
            r["total"] = x.total
        print(json.dumps(out, indent=2))
    else:
        print(render(p, a.alpha, a.embeddings, a.dtype), end="")


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("plan", help="capacity plan: base, delta and KV bytes, and what fits on the GPUs")
    c.add_argument(
        "--config",
        required=True,
        type=Path,
        help="a config.json of a supported family (e.g. configs/llama-3.1-70b.json, configs/qwen2.5-72b.json)",
    )
    c.add_argument("--variants", type=int, default=14, help="number of fine-tuned variants to serve")
    c.add_argument("--gpu-mem", default="80GB", help="memory per GPU: 80GB (decimal) or 80GiB")
    c.add_argument("--gpus", type=int, default=8)
    c.add_argument(
        "--tensor-parallel",
        "--tp",
        dest="tp",
        type=int,
        default=None,
        help="tensor-parallel degree, as the worker's --tensor-parallel (default: all GPUs)",
    )
    c.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    c.add_argument("--alpha", choices=["row", "matrix"], default="row")
    c.add_argument("--embeddings", choices=["dense", "sign"], default="dense")
    c.add_argument(
        "--delta",
        type=Path,
        help="plan for variants like this delta file (its sign planes, low-rank factors and α axes, "
        "as each rank allocates them) instead of --alpha/--embeddings' one-plane delta",
    )
    c.add_argument(
        "--planes", type=int, default=1, help="sign planes per matrix of the mode's delta (compress --planes)"
    )
    c.add_argument(
        "--rank", type=int, default=0, help="rank of the fp16 low-rank residual per matrix (compress --rank)"
    )
    c.add_argument("--context", type=int, default=4096, help="tokens per sequence for the KV budget")
    c.add_argument("--reserve", type=float, default=0.10, help="fraction of each GPU kept free (activations etc.)")
    c.add_argument(
        "--nominal",
        help="the size the model is sold as, for the brief's arithmetic (e.g. 70B); "
        "default: guessed from the parameter count",
    )
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_plan)
