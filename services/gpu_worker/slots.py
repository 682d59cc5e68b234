"""Device memory for deltas: where each tensor of a delta lives on this worker.

Data only (vLLM's LoRA split: this is the "adapter data" half; `manager.py`
decides who gets a slot, `runner.py` reads slots by index).

Compressed projections of all resident deltas sit in pre-allocated stacks, one
per (layer, projection group), so one kernel launch can serve a batch that
mixes variants (the stack is the kernel's `signs_stack`/`alpha_stack`):

    signs[l][g]:  uint8 [n_slots, d_out_g, ceil(d_in_g/8)]
    alpha[l][g]:  fp32  [n_slots, d_out_g]
    norms[l][n]:  dtype [n_slots + 1, size_n]   (every norm parameter of the layer, `ModelArgs.norm_params`:
                                               each norm's weight, StableLM's biases too; index 0 = the base)
    biases[l][g]: dtype [n_slots + 1, d_out_g]  (groups whose base has biases; index 0 = the base)
    final_norm:   dtype [n_slots + 1, dim]      (and final_norm_bias where the norms have biases)

Projection groups gather the matrices that read the same input, so the base
GEMM and the delta kernel run once per group: qkv = q ‖ k ‖ v, gate_up =
gate ‖ up (concatenated along d_out). Which matrices a group holds comes from
the checkpoint's own layout (`ModelArgs.matrices()`): a Phi-3 base stores qkv
and gate_up fused, so its groups hold one matrix each, with one sign matrix
and one α per row of it. A projection a delta leaves unchanged gets α = 0 in
its rows, which adds exactly nothing; a bias or norm it leaves unchanged keeps
the base's row.

A delta of k sign planes per matrix (format v3, `bitdelta.planes`) holds k slots: plane p of
every matrix is in its p-th slot (`SlotExtras.slots`), and a matrix with fewer planes has α = 0 in
that slot's rows. Its first slot is the delta's own (its norms, biases, extras, and the id a
sequence carries); the others hold sign planes only. The kernels add every plane of a row's
variant in one pass over its slots.

Tensors of a size only the delta knows are the exception: a changed embedding or LM head, and the
low-rank residual U·V of its matrices (`LowRank`, per layer and group). They are allocated per
delta at load time (`SlotExtras`) and count against the same byte budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from bitdelta.arch import ModelArgs
from bitdelta.format import LOWRANK_ROLES, split_role
from bitdelta.shard import HEAD_BIAS
from bitdelta_kernels.bits import packed_cols

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


@dataclass(frozen=True)
class ProjPlace:
    """Where one compressed matrix of a delta goes: rows [r0, r1) of group `group` of layer `layer`."""

    layer: int
    group: str
    r0: int
    r1: int
    d_in: int


@dataclass(frozen=True)
class NormPlace:
    """Where one norm parameter (or another dense vector a slot keeps whole) goes: `layer` = −1 for the final
    norm (`name` "norm", or "norm.bias" for its bias) and Phi's head bias ("head.bias"), else the layer's norm
    parameter `name` (a key of `ModelArgs.norm_params`)."""

    layer: int
    name: str
    size: int
    shape: tuple[int, ...] = ()  # the parameter's own shape (Command R+'s q/k norms: [heads, head_dim]); (): [size]


class SlotLayout:
    """What a delta for this base may contain and where each parameter lands.

    Pure metadata from the base's config; shared by the manager (to size and
    validate deltas before any byte is read) and by `SlotTensors`.
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        self.args, self.dtype = args, dtype
        self.group_shape: dict[str, tuple[int, int]] = args.group_shapes()  # group -> (d_out total, d_in)
        self.biased_groups = tuple(dict.fromkeys(m.group for m in args.matrices() if m.bias))
        self.proj: dict[str, ProjPlace] = {}  # "model.layers.i.<matrix>.weight" -> place
        self.bias: dict[str, ProjPlace] = {}  # "model.layers.i.<matrix>.bias" -> place
        for i in range(args.n_layers):
            rows: dict[str, int] = {}
            for m in args.matrices():
                r0 = rows.get(m.group, 0)
                place = ProjPlace(i, m.group, r0, r0 + m.d_out, m.d_in)
                rows[m.group] = r0 + m.d_out
                self.proj[f"model.layers.{i}.{m.name}.weight"] = place
                if m.bias:
                    self.bias[f"model.layers.{i}.{m.name}.bias"] = place
        final = args.final_norm_path  # "model.norm" (Phi's "model.final_layernorm")
        self.norms: dict[str, NormPlace] = {f"{final}.weight": NormPlace(-1, "norm", args.dim)}
        if args.family.norm_bias:
            self.norms[f"{final}.bias"] = NormPlace(-1, "norm.bias", args.dim)
        if args.family.head_bias:  # Phi's, a variant's own kept whole like a norm's
            self.norms[HEAD_BIAS] = NormPlace(-1, "head.bias", args.vocab_size)
        for i in range(args.n_layers):
            for key, param, shape in args.norm_params():
                self.norms[f"model.layers.{i}.{param}"] = NormPlace(i, key, math.prod(shape), shape)
        self.embed_shape = (args.vocab_size, args.dim)
        # group -> the d_out of each of its matrices, in order (the kernels' col_splits)
        self.group_rows: dict[str, tuple[int, ...]] = {}
        for m in args.matrices():
            self.group_rows[m.group] = (*self.group_rows.get(m.group, ()), m.d_out)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot of the stacks takes: signs + α of every projection, the norms and biases."""
        n = 0
        for d_out, d_in in self.group_shape.values():
            n += d_out * packed_cols(d_in) + d_out * 4
        n *= self.args.n_layers
        n += sum(p.size for p in self.norms.values()) * self.dtype.itemsize
        return n + sum(p.r1 - p.r0 for p in self.bias.values()) * self.dtype.itemsize

    def extra_bytes(self, param: str, role: str, shape: tuple[int, ...], vocab: int = 0) -> int:
        """Device bytes one tensor of a delta takes in its slot's extras: a big (embedding/head)
        tensor's, or a low-rank factor's (fp16, as stored). role: the tensor's ("sign2", "lowrank_u", ...);
        vocab: a resized vocabulary's rows (0: the base's)."""
        role = split_role(role)[0]
        if role == "dense":
            return (vocab or self.args.vocab_size) * self.args.dim * self.dtype.itemsize
        if role in LOWRANK_ROLES:
            return shape[0] * shape[1] * 2
        if role == "sign":
            return shape[0] * shape[1]
        return self.args.vocab_size * 4  # α, always stored per row


@dataclass
class BigTensor:
    """A changed embedding or LM head of one delta: dense (`weight`) or compressed (k sign planes
    `signs`, `alpha`, and a low-rank residual `u` · `v` when it has one)."""

    weight: torch.Tensor | None = None  # dtype [vocab, dim]
    signs: torch.Tensor | None = None  # uint8 [k, vocab, ceil(dim/8)]
    alpha: torch.Tensor | None = None  # fp32 [k, vocab]
    u: torch.Tensor | None = None  # fp16 [vocab, r]
    v: torch.Tensor | None = None  # fp16 [r, dim]

    @property
    def nbytes(self) -> int:
        ts = (self.weight, self.signs, self.alpha, self.u, self.v)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class LowRank:
    """The low-rank residual of one projection group of one delta: y += (x · vᵀ) · Uᵀ, with v fp16
    [R, d_in] every matrix's V of the group stacked (R = the sum of their ranks) and, per matrix
    with a rank, (r0, c0, U fp16 [d_out_m, r_m]): its rows r0.. of the group's output, its rows c0..
    of v; U is the transposed view of a contiguous Uᵀ [r_m, d_out_m] (the C decode layers' expand
    runs over its rows). Bytes: exactly the file's factors."""

    v: torch.Tensor
    u: list[tuple[int, int, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return self.v.numel() * 2 + sum(t.numel() * 2 for _, _, t in self.u)


@dataclass
class SlotExtras:
    """A delta's tensors outside its slot of the stacks. `head` None: the base's head serves.
    `slots`: every slot it holds, plane 1's first (the delta's own), when it has more than one sign
    plane; empty: its own only. `sign_planes` 0: its slot holds no sign plane (an imported LoRA's
    factors alone), so its rows take none. `lowrank[(layer, group)]`: its low-rank residuals
    (absent: none)."""

    embed: BigTensor | None = None
    head: BigTensor | None = None
    slots: tuple[int, ...] = ()
    sign_planes: int = 1
    lowrank: dict[tuple[int, str], LowRank] = field(default_factory=dict)
    # (layer, group) -> fp32 [k, G, d_in]: the column α's of each of its k planes for each of the
    # group's G matrices (1 where a matrix's plane scales rows; its α rows in the slot are then 1):
    # the kernels' col_alpha, for the groups where some matrix has a plane of column α's
    cols: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    vocab_size: int = 0  # its vocabulary where it grew past the base's (its dense embedding's rows); 0: the base's

    @property
    def nbytes(self) -> int:
        """Device bytes these extras hold (a tied head is the embedding's, counted once)."""
        bigs = [b for b in (self.embed, self.head) if b is not None]
        n = sum(b.nbytes for i, b in enumerate(bigs) if all(b is not c for c in bigs[:i]))
        n += sum(lr.nbytes for lr in self.lowrank.values())
        return n + sum(c.numel() * c.element_size() for c in self.cols.values())

    @property
    def empty(self) -> bool:
        """Nothing the runner reads beyond the delta's own slot (a plain one-plane delta)."""
        return (
            self.embed is None
            and self.head is None
            and len(self.slots) <= 1
            and self.sign_planes == 1
            and not self.lowrank
            and not self.cols
        )


def _carved(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Zeroed tensors of `shapes`, one after another in one buffer (each on a 64-byte boundary)."""
    align = 64 // dtype.itemsize
    sizes = [-(-math.prod(s) // align) * align for s in shapes]
    buf = torch.zeros(max(sum(sizes), 1), dtype=dtype, device=device)
    out, at = [], 0
    for shape, n in zip(shapes, sizes):
        out.append(buf[at : at + math.prod(shape)].view(shape))
        at += n
    return out


@dataclass
class SlotTensors:
    """The stacks (allocated once, at start-up) plus per-slot extras.

    The sign stacks (~95 % of a slot's bytes) are allocated empty: on CPU their pages become
    resident only as deltas are written into slots, so an idle worker holds the α, norm and bias
    rows of every slot (zeroed: a slot without a delta adds exactly nothing) and the signs of the
    slots in use, not the whole budget. A slot's signs are only read for rows of that slot, after
    a load wrote them (a matrix the delta leaves unchanged has α = 0 there)."""

    layout: SlotLayout
    n_slots: int
    device: torch.device
    signs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    alpha: list[dict[str, torch.Tensor]] = field(default_factory=list)
    norms: list[dict[str, torch.Tensor]] = field(default_factory=list)
    biases: list[dict[str, torch.Tensor]] = field(default_factory=list)
    final_norm: torch.Tensor | None = None
    final_norm_bias: torch.Tensor | None = None  # StableLM's (Family.norm_bias)
    head_bias: torch.Tensor | None = None  # Phi's [n_slots + 1, vocab] (Family.head_bias)
    # Copy-on-write: the manager swaps in a new dict, the engine reads one snapshot per step.
    # Keyed by a delta's own slot (its first); a plain one-plane delta has no entry.
    extras: dict[int, SlotExtras] = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        layout: SlotLayout,
        n_slots: int,
        device: torch.device,
        base_norms: list[dict[str, torch.Tensor]],
        base_final_norm: torch.Tensor,
        base_biases: list[dict[str, torch.Tensor]] | None = None,
        base_final_norm_bias: torch.Tensor | None = None,
        base_head_bias: torch.Tensor | None = None,
    ) -> SlotTensors:
        """Stacks for `n_slots` deltas; row 0 of the norm and bias stacks holds the base's
        (base_norms[l][key], base_biases[l][group]: see runner.BaseWeights), every slot starts equal."""
        st = cls(layout, n_slots, device)
        dt = layout.dtype

        def stack(base: torch.Tensor) -> torch.Tensor:
            t = torch.empty(n_slots + 1, *base.shape, dtype=dt, device=device)
            t[:] = base
            return t

        groups, n_layers = layout.group_shape.items(), layout.args.n_layers
        # every layer's α stacks carved from one buffer (one allocation, not one per stack: each large
        # host allocation holds a resident page of its own beside its pages, ~0.25 MB for SmolLM2's 120).
        # The sign stacks stay buffers of their own: a slot's rows become resident as a delta is
        # written into them, page by page, where one buffer of them all went on 2 MB pages and a
        # written slot held a 2 MB page of each stack (fp32 SmolLM2-135M, 4 variants loaded: +514 MB
        # resident against +133 MB)
        alpha = _carved([(n_slots, d_out) for _ in range(n_layers) for _, (d_out, _) in groups], torch.float32, device)
        for i in range(n_layers):
            st.signs.append(  # empty: a slot's pages become resident when a delta is written into it
                {
                    g: torch.empty(n_slots, d_out, packed_cols(d_in), dtype=torch.uint8, device=device)
                    for g, (d_out, d_in) in groups
                }
            )
            st.alpha.append({g: alpha.pop(0) for g in layout.group_shape})
            st.norms.append({name: stack(w) for name, w in base_norms[i].items()})
            st.biases.append({g: stack(b) for g, b in (base_biases[i] if base_biases else {}).items()})
            if set(st.biases[i]) != set(layout.biased_groups):
                raise ValueError(
                    f"layer {i}: base biases for {sorted(st.biases[i])}, layout has {layout.biased_groups}"
                )
        st.final_norm = stack(base_final_norm)
        if (base_final_norm_bias is not None) != layout.args.family.norm_bias:
            raise ValueError(f"the final norm's bias: {base_final_norm_bias is not None}, the family's norms' biases: "
                             f"{layout.args.family.norm_bias}")  # fmt: skip
        st.final_norm_bias = None if base_final_norm_bias is None else stack(base_final_norm_bias)
        if (base_head_bias is not None) != layout.args.family.head_bias:
            raise ValueError(
                f"the head's bias: {base_head_bias is not None}, the family's: {layout.args.family.head_bias}"
            )
        st.head_bias = None if base_head_bias is None else stack(base_head_bias)
        return st

    def reset_slot(self, slot: int) -> None:
        """Make slot `slot` equal the base (α = 0, base norms and biases) before a delta is written in."""
        for i in range(self.layout.args.n_layers):
            for a in self.alpha[i].values():
                a[slot].zero_()
            for t in (*self.norms[i].values(), *self.biases[i].values()):
                t[slot + 1] = t[0]
        self.final_norm[slot + 1] = self.final_norm[0]
        for t in (self.final_norm_bias, self.head_bias):
            if t is not None:
                t[slot + 1] = t[0]

    def proj_views(self, slot: int, place: ProjPlace) -> tuple[torch.Tensor, torch.Tensor]:
        """signs uint8 [d_out, ceil(d_in/8)] and α fp32 [d_out] of one projection in one slot (views)."""
        return (
            self.signs[place.layer][place.group][slot, place.r0 : place.r1],
            self.alpha[place.layer][place.group][slot, place.r0 : place.r1],
        )

    def bias_view(self, slot: int, place: ProjPlace) -> torch.Tensor:
        """dtype [d_out] view of one matrix's bias in one slot."""
        return self.biases[place.layer][place.group][slot + 1, place.r0 : place.r1]

    def norm_view(self, slot: int, place: NormPlace) -> torch.Tensor:
        """dtype [size] view of one norm parameter of one slot (in the parameter's own shape)."""
        if place.layer < 0:
            final = {"norm": self.final_norm, "norm.bias": self.final_norm_bias, "head.bias": self.head_bias}
            return final[place.name][slot + 1]
        return self.norms[place.layer][place.name][slot + 1].view(place.shape or (place.size,))

    @property
    def stack_bytes(self) -> int:
        """Device bytes of the slot stacks (signs, α, norms); for the benchmarks' memory account
        (bench/worker.py)."""
        ts = [t for d in self.signs + self.alpha + self.norms + self.biases for t in d.values()]
        ts += [t for t in (self.final_norm, self.final_norm_bias, self.head_bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)
