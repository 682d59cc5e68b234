"""Device memory for deltas: where each tensor of a delta lives on this worker.

Data only (vLLM's LoRA split: this is the "adapter data" half; `manager.py`
decides who gets a slot, `runner.py` reads slots by index).

Compressed projections of all resident deltas sit in pre-allocated stacks, one
per (layer, projection group), so one kernel launch can serve a batch that
mixes variants (the stack is the kernel's `signs_stack`/`alpha_stack`):

    signs[l][g]: uint8 [n_slots, d_out_g, ceil(d_in_g/8)]
    alpha[l][g]: fp32  [n_slots, d_out_g]
    norms[l]:    dtype [2, n_slots + 1, dim]   (input, post-attention; index 0 = the base)
    final_norm:  dtype [n_slots + 1, dim]

Projection groups fuse the projections that read the same input, so the base
GEMM and the delta kernel run once per group: qkv = q ‖ k ‖ v, gate_up =
gate ‖ up (concatenated along d_out). A projection a delta leaves unchanged
gets α = 0 in its rows, which adds exactly nothing.

Large dense tensors (a changed embedding or LM head) are the exception: they
are allocated per delta at load time (`SlotExtras`) and count against the same
byte budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bitdelta.model import ModelArgs
from kernels.bits import packed_cols

# group -> the projections it concatenates, in order, and their module path
GROUPS: dict[str, tuple[tuple[str, str], ...]] = {
    "qkv": (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj")),
    "o": (("self_attn", "o_proj"),),
    "gate_up": (("mlp", "gate_proj"), ("mlp", "up_proj")),
    "down": (("mlp", "down_proj"),),
}
NORMS = ("input_layernorm", "post_attention_layernorm")
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


@dataclass(frozen=True)
class ProjPlace:
    """Where one compressed projection of a delta goes: rows [r0, r1) of group `group` of layer `layer`."""

    layer: int
    group: str
    r0: int
    r1: int
    d_in: int


@dataclass(frozen=True)
class NormPlace:
    """Where one norm weight goes: `layer` = −1 for the final norm, `which` 0/1 = input/post-attention."""

    layer: int
    which: int


class SlotLayout:
    """What a delta for this base may contain and where each parameter lands.

    Pure metadata from the base's config; shared by the manager (to size and
    validate deltas before any byte is read) and by `SlotTensors`.
    """

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        self.args, self.dtype = args, dtype
        hd, d, f = args.head_dim, args.dim, args.intermediate_size
        dims = {
            "q_proj": (args.n_heads * hd, d),
            "k_proj": (args.n_kv_heads * hd, d),
            "v_proj": (args.n_kv_heads * hd, d),
            "o_proj": (d, args.n_heads * hd),
            "gate_proj": (f, d),
            "up_proj": (f, d),
            "down_proj": (d, f),
        }
        self.group_shape: dict[str, tuple[int, int]] = {}  # group -> (d_out total, d_in)
        self.proj: dict[str, ProjPlace] = {}
        for g, members in GROUPS.items():
            r = 0
            d_in = dims[members[0][1]][1]
            for i in range(args.n_layers):
                r = 0
                for mod, name in members:
                    d_out, din = dims[name]
                    assert din == d_in
                    self.proj[f"model.layers.{i}.{mod}.{name}.weight"] = ProjPlace(i, g, r, r + d_out, d_in)
                    r += d_out
            self.group_shape[g] = (r, d_in)
        self.norms: dict[str, NormPlace] = {FINAL_NORM: NormPlace(-1, 0)}
        for i in range(args.n_layers):
            for w, n in enumerate(NORMS):
                self.norms[f"model.layers.{i}.{n}.weight"] = NormPlace(i, w)
        self.embed_shape = (args.vocab_size, args.dim)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot of the stacks takes: signs + α of every projection, and the norms."""
        n = 0
        for d_out, d_in in self.group_shape.values():
            n += d_out * packed_cols(d_in) + d_out * 4
        n *= self.args.n_layers
        return n + len(self.norms) * self.args.dim * self.dtype.itemsize

    def extra_bytes(self, param: str, role: str, shape: tuple[int, ...]) -> int:
        """Device bytes a big (embedding/head) tensor of a delta takes in its slot's extras."""
        if role == "dense":
            return self.args.vocab_size * self.args.dim * self.dtype.itemsize
        if role == "sign":
            return shape[0] * shape[1]
        return self.args.vocab_size * 4  # α, always stored per row


@dataclass
class BigTensor:
    """A changed embedding or LM head of one delta: dense (`weight`) or compressed (`signs`, `alpha`)."""

    weight: torch.Tensor | None = None  # dtype [vocab, dim]
    signs: torch.Tensor | None = None  # uint8 [vocab, ceil(dim/8)]
    alpha: torch.Tensor | None = None  # fp32 [vocab]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.signs, self.alpha) if t is not None)


@dataclass
class SlotExtras:
    """Per-slot tensors outside the stacks. `head` None: the base's head serves."""

    embed: BigTensor | None = None
    head: BigTensor | None = None


@dataclass
class SlotTensors:
    """The stacks (pre-allocated once, at start-up) plus per-slot extras."""

    layout: SlotLayout
    n_slots: int
    device: torch.device
    signs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    alpha: list[dict[str, torch.Tensor]] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)
    final_norm: torch.Tensor | None = None
    # Copy-on-write: the manager swaps in a new dict, the engine reads one snapshot per step.
    extras: dict[int, SlotExtras] = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        layout: SlotLayout,
        n_slots: int,
        device: torch.device,
        base_norms: list[tuple[torch.Tensor, torch.Tensor]],
        base_final_norm: torch.Tensor,
    ) -> SlotTensors:
        st = cls(layout, n_slots, device)
        dim = layout.args.dim
        for i in range(layout.args.n_layers):
            st.signs.append(
                {
                    g: torch.zeros(n_slots, d_out, packed_cols(d_in), dtype=torch.uint8, device=device)
                    for g, (d_out, d_in) in layout.group_shape.items()
                }
            )
            st.alpha.append(
                {
                    g: torch.zeros(n_slots, d_out, dtype=torch.float32, device=device)
                    for g, (d_out, _) in layout.group_shape.items()
                }
            )
            norms = torch.empty(2, n_slots + 1, dim, dtype=layout.dtype, device=device)
            norms[0, :] = base_norms[i][0]
            norms[1, :] = base_norms[i][1]
            st.norms.append(norms)
        st.final_norm = torch.empty(n_slots + 1, dim, dtype=layout.dtype, device=device)
        st.final_norm[:] = base_final_norm
        return st

    def reset_slot(self, slot: int) -> None:
        """Make slot `slot` equal the base (α = 0, base norms) before a delta is written in."""
        for i in range(self.layout.args.n_layers):
            for a in self.alpha[i].values():
                a[slot].zero_()
            self.norms[i][:, slot + 1] = self.norms[i][:, 0]
        self.final_norm[slot + 1] = self.final_norm[0]

    def proj_views(self, slot: int, place: ProjPlace) -> tuple[torch.Tensor, torch.Tensor]:
        """signs uint8 [d_out, ceil(d_in/8)] and α fp32 [d_out] of one projection in one slot (views)."""
        return (
            self.signs[place.layer][place.group][slot, place.r0 : place.r1],
            self.alpha[place.layer][place.group][slot, place.r0 : place.r1],
        )

    def norm_view(self, slot: int, place: NormPlace) -> torch.Tensor:
        """dtype [dim] view of one norm weight of one slot."""
        if place.layer < 0:
            return self.final_norm[slot + 1]
        return self.norms[place.layer][place.which, slot + 1]

    @property
    def stack_bytes(self) -> int:
        """Device bytes of the slot stacks (signs, α, norms); for the benchmarks' memory account
        (bench/worker.py)."""
        n = sum(t.numel() * t.element_size() for d in self.signs + self.alpha for t in d.values())
        n += sum(t.numel() * t.element_size() for t in self.norms)
        return n + self.final_norm.numel() * self.final_norm.element_size()
