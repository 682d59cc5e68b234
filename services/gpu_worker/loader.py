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
from dataclasses import dataclass

import torch

from bitdelta.format import DTYPES, DeltaFormatError, check_arch
from kernels.bits import packed_cols
from services.gpu_worker.slots import EMBED, HEAD, BigTensor, NormPlace, ProjPlace, SlotExtras, SlotLayout, SlotTensors
from services.gpu_worker.sources import DeltaInfo, TensorSpec

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


class Kind(enum.Enum):
    """What a tensor of a delta is to a slot, and so where it goes (`destination`)."""

    PROJ_SIGN = "proj_sign"  # a projection's packed signs: its rows of the slot's sign stack
    PROJ_ALPHA = "proj_alpha"  # its α: its rows of the slot's α stack
    BIAS = "bias"  # a changed bias: its rows of the slot's entry in the bias stack
    NORM = "norm"  # a norm weight: the slot's entry in the norm stack
    BIG_DENSE = "big_dense"  # a changed embedding / LM head, whole: allocated per delta (the slot's extras)
    BIG_SIGN = "big_sign"  # ... compressed: its signs
    BIG_ALPHA = "big_alpha"  # ... and its α

    @property
    def big_field(self) -> str | None:
        """The `BigTensor` field a tensor of this kind fills; None for the stacks' kinds."""
        return {Kind.BIG_DENSE: "weight", Kind.BIG_SIGN: "signs", Kind.BIG_ALPHA: "alpha"}.get(self)

    def allocate(self, layout: SlotLayout, device: torch.device) -> torch.Tensor:
        """A new extra for a BIG_* kind: dtype [vocab, dim], uint8 [vocab, ceil(dim/8)] or fp32 [vocab]."""
        a = layout.args
        if self is Kind.BIG_DENSE:
            return torch.empty(a.vocab_size, a.dim, dtype=layout.dtype, device=device)
        if self is Kind.BIG_SIGN:
            return torch.empty(a.vocab_size, packed_cols(a.dim), dtype=torch.uint8, device=device)
        if self is Kind.BIG_ALPHA:
            return torch.empty(a.vocab_size, dtype=torch.float32, device=device)
        raise ValueError(f"{self} lives in the slot's stacks")

    def destination(self, p: Placement, slots: SlotTensors, slot: int, bigs: dict[str, BigTensor]) -> torch.Tensor:
        """The final place of `p`'s tensor in slot `slot` (a view of the stacks, or its extra in `bigs`)."""
        if self is Kind.PROJ_SIGN:
            return slots.proj_views(slot, p.proj)[0]
        if self is Kind.PROJ_ALPHA:
            return slots.proj_views(slot, p.proj)[1]
        if self is Kind.BIAS:
            return slots.bias_view(slot, p.proj)
        if self is Kind.NORM:
            return slots.norm_view(slot, p.norm)
        return getattr(bigs[p.big], self.big_field)


@dataclass
class Placement:
    """Where one tensor of a delta goes."""

    spec: TensorSpec
    kind: Kind
    proj: ProjPlace | None = None
    norm: NormPlace | None = None
    big: str | None = None  # EMBED or HEAD


@dataclass
class DeltaPlan:
    name: str
    placements: list[Placement]
    slot_bytes: int  # one slot of the stacks
    extra_bytes: int  # embedding / head tensors outside the stacks
    whole: bool = False  # tensor parallelism: tensors arrive whole, the rank keeps its slice (parallel.ShardWriter)

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes + self.extra_bytes

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
    out: list[Placement] = []
    seen: dict[str, set[str]] = {}
    extra = 0
    big_roles: dict[str, set[str]] = {}
    for t in info.tensors:
        param, role = t.param, t.role
        seen.setdefault(param, set()).add(role)
        numel = 1
        for d in t.shape:
            numel *= d
        if t.dtype not in DTYPES or numel * DTYPES[t.dtype].itemsize != t.nbytes:
            raise _bad(info.name, t, f"has dtype {t.dtype} and shape {list(t.shape)} but {t.nbytes} bytes")
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
                out.append(Placement(t, Kind.PROJ_SIGN, proj=p))
            elif role == "alpha":
                if t.dtype != "F32" or t.shape not in ((d_out,), (1,)):
                    raise _bad(info.name, t, f"must be float32 [{d_out}] or [1], is {t.dtype} {list(t.shape)}")
                out.append(Placement(t, Kind.PROJ_ALPHA, proj=p))
            else:
                raise _bad(info.name, t, "replaces a projection densely; the worker serves compressed projections only")
        elif param in layout.bias:
            p = layout.bias[param]
            if role != "dense" or t.shape != (p.r1 - p.r0,) or t.dtype not in FLOAT_DTYPES:
                raise _bad(info.name, t, f"must be a dense float [{p.r1 - p.r0}] bias")
            out.append(Placement(t, Kind.BIAS, proj=p))
        elif param in layout.norms:
            n = layout.norms[param]
            if role != "dense" or t.shape != (n.size,) or t.dtype not in FLOAT_DTYPES:
                raise _bad(info.name, t, f"must be a dense float [{n.size}] norm weight")
            out.append(Placement(t, Kind.NORM, norm=n))
        elif param in (EMBED, HEAD):
            big_roles.setdefault(param, set()).add(role)
            if role == "dense":
                if t.shape != layout.embed_shape or t.dtype not in FLOAT_DTYPES:
                    raise _bad(info.name, t, f"must be a dense float {list(layout.embed_shape)}")
                kind = Kind.BIG_DENSE
            elif role == "sign":
                if t.dtype != "U8" or t.shape != (a.vocab_size, packed_cols(a.dim)):
                    raise _bad(info.name, t, f"must be uint8 [{a.vocab_size}, {packed_cols(a.dim)}]")
                kind = Kind.BIG_SIGN
            else:
                if t.dtype != "F32" or t.shape not in ((a.vocab_size,), (1,)):
                    raise _bad(info.name, t, f"must be float32 [{a.vocab_size}] or [1]")
                kind = Kind.BIG_ALPHA
            extra += layout.extra_bytes(param, role, t.shape)
            out.append(Placement(t, kind, big=param))
        else:
            raise _bad(info.name, t, "names a parameter this base does not have (or the worker cannot place)")
    for param, roles in seen.items():
        if (param in layout.proj or roles & {"sign", "alpha"}) and roles & {"sign", "alpha"} != {"sign", "alpha"}:
            raise DeltaFormatError(
                f"delta {info.name!r}: {param} has {sorted(roles)} but needs both .sign and .alpha", tensor=param
            )
    for param, roles in big_roles.items():
        if "dense" in roles and roles & {"sign", "alpha"}:
            raise DeltaFormatError(f"delta {info.name!r}: {param} is both dense and compressed", tensor=param)
    return DeltaPlan(info.name, out, layout.slot_bytes, extra)


@dataclass
class _Target:
    """One tensor's place in the slot and the host bytes it lands in first."""

    dest: torch.Tensor  # its final place: a view of the slot's stacks, or an extra
    host: torch.Tensor | None  # where its bytes land: `dest` itself (direct), or staging until copied
    staged: bool  # the bytes land in staging (CUDA, another dtype or shape) and are copied to `dest`


class SlotWriter:
    """The receiver's destination for one load into one slot (see the module docstring). Not reusable.

    writer = SlotWriter(plan, slots, slot, load_stream)
    receiver = Receiver(plan.name, plan.tensors, writer, check_sha256=not info.verified)
    await source.stream(info, receiver); await receiver.finish()
    extras = await writer.finish()
    """

    def __init__(self, plan: DeltaPlan, slots: SlotTensors, slot: int, load_stream=None):
        self.plan, self.slots, self.slot = plan, slots, slot
        self.device = slots.device
        self.cuda = self.device.type == "cuda"
        self.stream = load_stream
        self.extras = SlotExtras()
        bigs: dict[str, BigTensor] = {}
        # On CUDA everything a load does runs on the load stream: the reset is ordered before the
        # copies, and the extras come from that stream's pool, never from blocks the decode stream
        # just freed while its kernels may still read them.
        with _on_stream(self.stream):
            slots.reset_slot(slot)
            for p in plan.placements:  # extras (embedding / head) are allocated per delta
                if p.kind.big_field is not None:
                    setattr(
                        bigs.setdefault(p.big, BigTensor()),
                        p.kind.big_field,
                        p.kind.allocate(slots.layout, self.device),
                    )
        self.extras.embed = bigs.get(EMBED)
        self.extras.head = bigs.get(HEAD) or (self.extras.embed if slots.layout.args.tie_embeddings else None)
        self.targets: list[_Target] = []
        for p in plan.placements:
            d = p.kind.destination(p, slots, slot, bigs)
            direct = (
                not self.cuda
                and d.dtype == DTYPES[p.spec.dtype]
                and tuple(d.shape) == tuple(p.spec.shape)
                and d.is_contiguous()
            )
            self.targets.append(_Target(d, d if direct else None, staged=not direct))

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


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(bytearray())
