"""Validate a delta against this base and give its tensors their places in a slot.

`plan_delta` checks every announced tensor against the slot layout (names,
roles, dtypes, shapes) and sizes the delta BEFORE any byte moves, so a wrong
delta fails fast and the budget is reserved exactly. Each tensor's `Kind`
knows where in a slot it goes.

`SlotWriter` is the destination of the shared receiver
(`bitdelta.rpc.receiver.Receiver`, which places the bytes and checks every
chunk's crc32 and each tensor's sha256). Every tensor has one host buffer: on
CPU the slot memory itself (bytes land where the kernels read them, no copy),
on CUDA a staging buffer (pinned) that is copied to the slot on a side stream
once the tensor passed its checks, so loading never waits for, or stalls, the
decode stream; the slot becomes usable only after every tensor passed (the
manager flips the state).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
from dataclasses import dataclass

import torch

from bitdelta.format import DTYPES, FILES, LOWRANK_ROLES, DeltaFormatError, check_arch, split_role
from bitdelta_kernels.bits import packed_cols
from services.gpu_worker.slots import (
    EMBED,
    HEAD,
    BigTensor,
    LowRank,
    NormPlace,
    ProjPlace,
    SlotExtras,
    SlotLayout,
    SlotTensors,
)
from services.gpu_worker.sources import DeltaInfo, TensorSpec

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class Kind(enum.Enum):
    """What a tensor of a delta is to a slot, and so where it goes (`destination`)."""

    PROJ_SIGN = "proj_sign"  # a projection's packed signs of one plane: its rows of that plane's slot's sign stack
    PROJ_ALPHA = "proj_alpha"  # that plane's α: its rows of the plane's slot's α stack
    PROJ_COL = "proj_col"  # ... a plane's α of input columns: its row of the group's col_alpha (extras), α rows 1
    PROJ_U = "proj_u"  # a projection's low-rank U: allocated per delta (the slot's extras, `LowRank`)
    PROJ_V = "proj_v"  # ... and its V, in its group's stacked v
    BIAS = "bias"  # a changed bias: its rows of the slot's entry in the bias stack
    NORM = "norm"  # a norm weight: the slot's entry in the norm stack
    BIG_DENSE = "big_dense"  # a changed embedding / LM head, whole: allocated per delta (the slot's extras)
    BIG_SIGN = "big_sign"  # ... compressed: one plane's signs
    BIG_ALPHA = "big_alpha"  # ... that plane's α
    BIG_U = "big_u"  # ... its low-rank U
    BIG_V = "big_v"  # ... and V
    FILE = "file"  # a file of the fine-tune (its tokenizer.json): host bytes, read by the worker, not the runner

    @property
    def big_field(self) -> str | None:
        """The `BigTensor` field a tensor of this kind fills; None for the other kinds."""
        return {
            Kind.BIG_DENSE: "weight",
            Kind.BIG_SIGN: "signs",
            Kind.BIG_ALPHA: "alpha",
            Kind.BIG_U: "u",
            Kind.BIG_V: "v",
        }.get(self)

    def destination(
        self, p: Placement, slots: SlotTensors, ids: tuple[int, ...], bigs: dict[str, BigTensor], low: dict, cols: dict
    ) -> torch.Tensor:
        """The final place of `p`'s tensor for a delta in slots `ids` (a view of the stacks, or of its
        extras: `bigs`, `low` (layer, group) -> LowRank and `cols` (layer, group) -> col_alpha)."""
        if self is Kind.PROJ_SIGN:
            return slots.proj_views(ids[p.plane - 1], p.proj)[0]
        if self is Kind.PROJ_ALPHA:
            return slots.proj_views(ids[p.plane - 1], p.proj)[1]
        if self is Kind.PROJ_COL:
            starts = list(itertools.accumulate(slots.layout.group_rows[p.proj.group], initial=0))
            return cols[(p.proj.layer, p.proj.group)][p.plane - 1, starts.index(p.proj.r0)]
        if self in (Kind.PROJ_U, Kind.PROJ_V):
            lr = low[(p.proj.layer, p.proj.group)]
            u = next((c0, t) for r0, c0, t in lr.u if r0 == p.proj.r0)
            return u[1] if self is Kind.PROJ_U else lr.v[u[0] : u[0] + u[1].shape[1]]
        if self is Kind.BIAS:
            return slots.bias_view(ids[0], p.proj)
        if self is Kind.NORM:
            return slots.norm_view(ids[0], p.norm)
        t = getattr(bigs[p.big], self.big_field)
        return t[p.plane - 1] if self in (Kind.BIG_SIGN, Kind.BIG_ALPHA) else t


@dataclass
class Placement:
    """Where one tensor of a delta goes."""

    spec: TensorSpec
    kind: Kind
    proj: ProjPlace | None = None
    norm: NormPlace | None = None
    big: str | None = None  # EMBED or HEAD
    plane: int = 1  # the sign plane of a sign / α tensor (format v3: 2, 3, ...)


@dataclass
class DeltaPlan:
    name: str
    placements: list[Placement]
    slot_bytes: int  # one slot of the stacks
    extra_bytes: int  # embedding / head tensors and low-rank factors, outside the stacks
    whole: bool = False  # tensor parallelism: tensors arrive whole, the rank keeps its slice (parallel.ShardWriter)
    planes: int = 1  # sign planes of its matrices at most: the slots it holds (plane p of every matrix in the p-th)
    sign_planes: int = 1  # the same, 0 where no matrix has one (an imported LoRA: its one slot holds no plane)
    vocab_size: int = 0  # its vocabulary where it grew past the base's (its dense embedding's rows); 0: the base's

    @property
    def total_bytes(self) -> int:
        """What the delta costs the byte budget: each of its slots, and its extras."""
        return self.planes * self.slot_bytes + self.extra_bytes

    @property
    def lowrank(self) -> bool:
        return any(p.kind in (Kind.PROJ_U, Kind.BIG_U) for p in self.placements)

    @property
    def tensors(self) -> list[TensorSpec]:
        """The tensors in the order the source announced them (the receiver's indices)."""
        return [p.spec for p in self.placements]


def _bad(name: str, t: TensorSpec, why: str) -> DeltaFormatError:
    return DeltaFormatError(f"delta {name!r}: tensor {t.name} {why}", tensor=t.name)


def plan_delta(layout: SlotLayout, info: DeltaInfo) -> DeltaPlan:
    """Map every tensor of `info` to its place, or raise DeltaFormatError naming the tensor
    (ArchMismatchError when the delta was made for another architecture or layout)."""
    a = layout.args
    check_arch(info.name, info.architecture, info.layout, a)
    vocab = info.vocab_size or a.vocab_size  # a resized vocabulary: its embedding / head rows
    if info.vocab_size and info.vocab_size < a.vocab_size:
        raise DeltaFormatError(f"delta {info.name!r}: a vocabulary of {info.vocab_size}, less than the base's")
    if info.eos_token_ids and max(info.eos_token_ids) >= vocab:
        raise DeltaFormatError(
            f"delta {info.name!r}: its eos_token_ids hold {max(info.eos_token_ids)}, not below "
            + ("its own" if info.vocab_size else "the base's")
            + f" vocabulary size {vocab}"
        )
    out: list[Placement] = []
    parts: dict[str, list[tuple[str, int, TensorSpec]]] = {}  # compressed param -> (role, plane, tensor)
    extra = 0
    big_roles: dict[str, set[str]] = {}
    col_groups: set[tuple[int, str]] = set()  # (layer, group) where some matrix has a plane of column α's
    for t in info.tensors:
        param = t.param
        role, plane = split_role(t.role) or (t.role, 0)
        numel = 1
        for d in t.shape:
            numel *= d
        if t.dtype not in DTYPES or numel * DTYPES[t.dtype].itemsize != t.nbytes:
            raise _bad(info.name, t, f"has dtype {t.dtype} and shape {list(t.shape)} but {t.nbytes} bytes")
        if role in ("sign", "alpha", *LOWRANK_ROLES) and param in (*layout.proj, EMBED, HEAD):
            parts.setdefault(param, []).append((role, plane, t))
        if param in layout.proj:
            p = layout.proj[param]
            d_out = p.r1 - p.r0
            if role == "sign":
                if t.dtype != "U8" or t.shape != (d_out, packed_cols(p.d_in)):
                    raise _bad(
                        info.name,
                        t,
                        f"must be uint8 [{d_out}, {packed_cols(p.d_in)}] for this base, is {t.dtype} {list(t.shape)}",
                    )
                out.append(Placement(t, Kind.PROJ_SIGN, proj=p, plane=plane))
            elif role == "alpha" and info.axis(t) == "col":
                if t.dtype != "F32" or t.shape != (p.d_in,):
                    raise _bad(info.name, t, f"must be float32 [{p.d_in}] (α per column), is {t.dtype} {list(t.shape)}")
                col_groups.add((p.layer, p.group))
                out.append(Placement(t, Kind.PROJ_COL, proj=p, plane=plane))
            elif role == "alpha":
                if t.dtype != "F32" or t.shape not in ((d_out,), (1,)):
                    raise _bad(info.name, t, f"must be float32 [{d_out}] or [1], is {t.dtype} {list(t.shape)}")
                out.append(Placement(t, Kind.PROJ_ALPHA, proj=p, plane=plane))
            elif role in LOWRANK_ROLES:
                u = role == "lowrank_u"
                if t.dtype != "F16" or len(t.shape) != 2 or t.shape[0 if u else 1] != (d_out if u else p.d_in):
                    want = f"[{d_out}, r]" if u else f"[r, {p.d_in}]"
                    raise _bad(info.name, t, f"must be float16 {want}, is {t.dtype} {list(t.shape)}")
                extra += layout.extra_bytes(param, t.role, t.shape)
                out.append(Placement(t, Kind.PROJ_U if u else Kind.PROJ_V, proj=p))
            else:
                raise _bad(info.name, t, "replaces a projection densely; the worker serves compressed projections only")
        elif param in layout.bias:
            p = layout.bias[param]
            if role != "dense" or t.shape != (p.r1 - p.r0,) or t.dtype not in FLOAT_DTYPES:
                raise _bad(info.name, t, f"must be a dense float [{p.r1 - p.r0}] bias")
            out.append(Placement(t, Kind.BIAS, proj=p))
        elif param in layout.norms:
            n = layout.norms[param]
            want = n.shape or (n.size,)
            if role != "dense" or t.shape != want or t.dtype not in FLOAT_DTYPES:
                what = "head bias" if n.name == "head.bias" else "norm weight"  # Phi's head bias sits among the norms
                raise _bad(info.name, t, f"must be a dense float {list(want)} {what}")
            out.append(Placement(t, Kind.NORM, norm=n))
        elif role == "file":
            if param not in FILES or t.dtype != "U8" or len(t.shape) != 1:
                raise _bad(info.name, t, f"is not a file a delta carries ({', '.join(FILES)}: uint8 [n])")
            out.append(Placement(t, Kind.FILE))  # host memory, outside the device budget
        elif param in (EMBED, HEAD):
            big_roles.setdefault(param, set()).add(role)
            if role == "dense":
                if t.shape != (vocab, a.dim) or t.dtype not in FLOAT_DTYPES:
                    raise _bad(info.name, t, f"must be a dense float {[vocab, a.dim]}")
                kind = Kind.BIG_DENSE
            elif info.vocab_size:
                raise _bad(info.name, t, "is compressed, but a resized vocabulary's embedding and head are dense")
            elif role == "sign":
                if t.dtype != "U8" or t.shape != (a.vocab_size, packed_cols(a.dim)):
                    raise _bad(info.name, t, f"must be uint8 [{a.vocab_size}, {packed_cols(a.dim)}]")
                kind = Kind.BIG_SIGN
            elif role == "alpha":
                if t.dtype != "F32" or t.shape not in ((a.vocab_size,), (1,)):
                    raise _bad(info.name, t, f"must be float32 [{a.vocab_size}] or [1]")
                kind = Kind.BIG_ALPHA
            elif role in LOWRANK_ROLES:
                u = role == "lowrank_u"
                if t.dtype != "F16" or len(t.shape) != 2 or t.shape[0 if u else 1] != (a.vocab_size if u else a.dim):
                    raise _bad(info.name, t, f"must be float16 {f'[{a.vocab_size}, r]' if u else f'[r, {a.dim}]'}")
                kind = Kind.BIG_U if u else Kind.BIG_V
            else:
                raise _bad(info.name, t, "is not a part of an embedding or head the worker knows")
            extra += layout.extra_bytes(param, t.role, t.shape, vocab)
            out.append(Placement(t, kind, big=param, plane=plane))
        else:
            raise _bad(info.name, t, "names a parameter this base does not have (or the worker cannot place)")
    planes = 0
    for param, got in parts.items():
        signs = sorted(pl for r, pl, _ in got if r == "sign")
        alphas = sorted(pl for r, pl, _ in got if r == "alpha")
        k = len(signs)
        low = {r: t for r, _, t in got if r in LOWRANK_ROLES}
        # no plane: a projection's low-rank part alone (an imported LoRA module); its rows keep α = 0
        if (not k and not (low and param in layout.proj)) or signs != alphas or signs != list(range(1, k + 1)):
            raise DeltaFormatError(
                f"delta {info.name!r}: {param} has sign planes {signs} and α's {alphas}, but needs both .sign "
                "and .alpha of every plane (format v3: .signN and .alphaN for N = 2 up to its number of planes; "
                "none only for a projection with a low-rank part)",
                tensor=param,
            )
        if low and (len(low) != 2 or low["lowrank_u"].shape[1] != low["lowrank_v"].shape[0]):
            raise DeltaFormatError(
                f"delta {info.name!r}: {param} needs both .lowrank_u [d_out, r] and .lowrank_v [r, d_in] of one rank r",
                tensor=param,
            )
        if param in layout.proj:
            planes = max(planes, k)
    for param, roles in big_roles.items():
        if "dense" in roles and roles - {"dense"}:
            raise DeltaFormatError(f"delta {info.name!r}: {param} is both dense and compressed", tensor=param)
    for _, group in col_groups:  # each such group's col_alpha: [planes, matrices of the group, d_in] fp32
        extra += planes * len(layout.group_rows[group]) * layout.group_shape[group][1] * 4
    if info.vocab_size and EMBED not in big_roles:
        raise DeltaFormatError(f"delta {info.name!r}: a resized vocabulary without its embedding", tensor=EMBED)
    return DeltaPlan(
        info.name,
        out,
        layout.slot_bytes,
        extra,
        planes=max(planes, 1),
        sign_planes=planes,
        vocab_size=info.vocab_size,
    )


@dataclass
class _Target:
    """One tensor's place in the slot and the host bytes it lands in first."""

    dest: torch.Tensor  # its final place: a view of the slot's stacks, or an extra
    host: torch.Tensor | None  # where its bytes land: `dest` itself (direct), or staging until copied
    staged: bool  # the bytes land in staging (CUDA, another dtype or shape) and are copied to `dest`


class SlotWriter:
    """The receiver's destination for one load into the slots `ids` (the delta's own first, then one
    per further sign plane: `plan.planes` of them; see the module docstring). Not reusable.

    writer = SlotWriter(plan, slots, ids, load_stream)
    receiver = Receiver(plan.name, plan.tensors, writer, check_sha256=not info.verified)
    await source.stream(info, receiver); await receiver.finish()
    extras = await writer.finish()
    """

    def __init__(self, plan: DeltaPlan, slots: SlotTensors, ids: tuple[int, ...], load_stream=None):
        if tuple(ids) != tuple(range(ids[0], ids[0] + plan.planes)):
            raise ValueError(f"delta {plan.name!r} has {plan.planes} sign planes: a run of as many slots, not {ids}")
        self.plan, self.slots, self.ids = plan, slots, tuple(ids)
        self.device = slots.device
        self.cuda = self.device.type == "cuda"
        self.stream = load_stream
        bigs: dict[str, BigTensor] = {}
        low: dict[tuple[int, str], LowRank] = {}
        cols: dict[tuple[int, str], torch.Tensor] = {}
        # On CUDA everything a load does runs on the load stream: the reset is ordered before the
        # copies, and the extras come from that stream's pool, never from blocks the decode stream
        # just freed while its kernels may still read them.
        with _on_stream(self.stream):
            for i in self.ids:
                slots.reset_slot(i)
            self._allocate(plan, slots.layout, bigs, low, cols)
            for p in plan.placements:  # a plane of column α's: its rows' α is 1, its vector in col_alpha
                if p.kind is Kind.PROJ_COL:
                    slots.proj_views(self.ids[p.plane - 1], p.proj)[1].fill_(1.0)
        self.extras = SlotExtras(
            embed=bigs.get(EMBED),
            head=bigs.get(HEAD) or (bigs.get(EMBED) if slots.layout.args.tie_embeddings else None),
            slots=self.ids if len(self.ids) > 1 else (),
            sign_planes=plan.sign_planes,
            lowrank=low,
            cols=cols,
            vocab_size=plan.vocab_size,
        )
        self.targets: list[_Target] = []
        self.files: dict[str, torch.Tensor] = {}  # the fine-tune's files it carries: host bytes
        for p in plan.placements:
            if p.kind is Kind.FILE:
                d = self.files[p.spec.param] = torch.empty(p.spec.nbytes, dtype=torch.uint8)
                self.targets.append(_Target(d, d, staged=False))
                continue
            d = p.kind.destination(p, slots, self.ids, bigs, low, cols)
            direct = (
                not self.cuda
                and d.dtype == DTYPES[p.spec.dtype]
                and tuple(d.shape) == tuple(p.spec.shape)
                and d.is_contiguous()
            )
            self.targets.append(_Target(d, d if direct else None, staged=not direct))

    def _allocate(self, plan: DeltaPlan, layout: SlotLayout, bigs: dict, low: dict, cols: dict) -> None:
        """The delta's extras: its embedding / head (k planes: [k, ...] stacks), the low-rank
        factors of each projection group, every matrix's V stacked in the group's order, and the
        col_alpha of each group with a plane of column α's (ones where a plane scales rows)."""
        a, dev = layout.args, self.device
        for p in plan.placements:
            if p.kind is Kind.PROJ_COL and (key := (p.proj.layer, p.proj.group)) not in cols:
                shape = (plan.planes, len(layout.group_rows[p.proj.group]), layout.group_shape[p.proj.group][1])
                cols[key] = torch.ones(shape, dtype=torch.float32, device=dev)
        planes: dict[str, int] = {}  # embedding / head -> its sign planes
        for p in plan.placements:
            if p.kind is Kind.BIG_SIGN:
                planes[p.big] = max(planes.get(p.big, 0), p.plane)
        for p in plan.placements:
            if p.kind.big_field is None:
                continue
            b = bigs.setdefault(p.big, BigTensor())
            if getattr(b, p.kind.big_field) is not None:
                continue  # another plane's tensor allocated it
            k = planes.get(p.big, 0)
            r = p.spec.shape[1 if p.kind is Kind.BIG_U else 0] if p.kind in (Kind.BIG_U, Kind.BIG_V) else 0
            # the layout's vocabulary rows (a tensor-parallel rank's), not the announced tensor's
            shape, dtype = {
                Kind.BIG_DENSE: ((plan.vocab_size or a.vocab_size, a.dim), layout.dtype),
                Kind.BIG_SIGN: ((k, a.vocab_size, packed_cols(a.dim)), torch.uint8),
                Kind.BIG_ALPHA: ((k, a.vocab_size), torch.float32),
                Kind.BIG_U: ((a.vocab_size, r), torch.float16),  # low-rank factors: fp16, as stored
                Kind.BIG_V: ((r, a.dim), torch.float16),
            }[p.kind]
            setattr(b, p.kind.big_field, torch.empty(shape, dtype=dtype, device=dev))
        ranks: dict[tuple[int, str], list[tuple[int, int, int]]] = {}  # (layer, group) -> (r0, d_out, r)
        for p in plan.placements:
            if p.kind is Kind.PROJ_U:
                ranks.setdefault((p.proj.layer, p.proj.group), []).append(
                    (p.proj.r0, p.proj.r1 - p.proj.r0, p.spec.shape[1])
                )
        for (layer, group), mats in ranks.items():
            mats.sort()
            d_in = layout.group_shape[group][1]
            v = torch.empty(sum(r for _, _, r in mats), d_in, dtype=torch.float16, device=dev)
            us, c0 = [], 0
            for r0, d_out, r in mats:  # U held as Uᵀ [r, d_out] (its rows the expand's AXPYs; a view as U)
                us.append((r0, c0, torch.empty(r, d_out, dtype=torch.float16, device=dev).t()))
                c0 += r
            low[(layer, group)] = LowRank(v, us)

    # -- the receiver's Destination (any thread) -------------------------------------------------
    def buffer(self, index: int) -> memoryview:
        """Tensor `index`'s host bytes: the slot itself, or a staging buffer (pinned on CUDA)."""
        t = self.targets[index]
        if t.host is None:
            t.host = torch.empty(self.plan.placements[index].spec.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        return _bytes_view(t.host)

    def complete(self, index: int) -> None:
        """Tensor `index` passed its checks: a staged one is copied (converted) to its place."""
        t, spec = self.targets[index], self.plan.placements[index].spec
        if t.staged and spec.nbytes:
            src = self.select(index, t.host.view(DTYPES[spec.dtype]).reshape(spec.shape))
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    staged = src.to(self.device, non_blocking=True)
                    t.dest.copy_(staged.to(t.dest.dtype).expand_as(t.dest))
            else:
                t.dest.copy_(src.to(t.dest.dtype).expand_as(t.dest))
            t.host = None  # staging freed as soon as it is copied

    def select(self, index: int, src: torch.Tensor) -> torch.Tensor:
        """The part of tensor `index` (as it arrived) that this slot holds: all of it here; a
        tensor-parallel rank's slice in `parallel.ShardWriter`."""
        return src

    async def finish(self) -> SlotExtras:
        """After the receiver finished: the copies to the device are done. Returns the slot's extras."""
        if self.cuda and self.stream is not None:
            await asyncio.to_thread(self.stream.synchronize)
        return self.extras

    def tokenizer(self) -> VariantTokenizer | None:
        """The fine-tune's own tokenizer when the delta carries one, else None; after the receiver
        finished. DeltaFormatError for a file `tokenizers` cannot read."""
        data = self.files.get("tokenizer.json")
        if data is None:
            return None
        from tokenizers import Tokenizer

        # its sha256 is the one the source announced, which the receiver checked the bytes against
        spec = next(p.spec for p in self.plan.placements if p.kind is Kind.FILE and p.spec.param == "tokenizer.json")
        raw = data.numpy().tobytes()
        try:
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
            raise DeltaFormatError(
                f"delta {self.plan.name!r}: its tokenizer.json is not a tokenizer ({e})", tensor="tokenizer.json.file"
            ) from None
        return VariantTokenizer(tok, spec.sha256, raw)


@dataclass(frozen=True)
class VariantTokenizer:
    """A variant's own tokenizer (its delta's tokenizer.json): what reads its prompts and writes its
    text on the worker, and what its grammars compile for."""

    tokenizer: object  # tokenizers.Tokenizer
    sha256: str  # of `json`
    json: bytes


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(bytearray())
