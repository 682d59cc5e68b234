"""Every layer of a step's single-token decode rows in ONE C call (`bd_decode_layers` in
csrc/decode.h), on CPU.

A decode step of a small model is short (SmolLM2-135M: ~15 ms of weights to read in fp32) and
the runner's layer-by-layer path spends ~40 % more on top in ~40 small torch ops and four kernel
dispatches per layer (norms, rope, the KV write, residuals, silu). The C call runs the same
layer (norm, the qkv/o/gate_up/down projections through the decode GEMV and the batched delta,
rope, the KV write, paged attention, residuals, silu · up) with the same roundings, op for op:
each result is rounded to the model's dtype where the torch op rounds it. Each row's values do
not depend on the other rows of the step (the GEMVs' per-row sums are the same for every row
count), so a request's tokens do not depend on its batch.

What it serves (`DecodeShape.supported`): the runner's layer with a full-head rotation and no
q/k norms, weights in fp32, bf16 or fp16, a variant's delta as sign planes of row α's (one plane
per slot, a variant of k planes on k slots: `run`'s row_planes) and a low-rank residual U · V per
projection group (`LowRankTable`: a format v3 delta's, or an imported LoRA adapter's, added in fp32
before the projection's one rounding, as `bitdelta_kernels.lowrank`); column α's take the runner's
layer-by-layer path.

The call also makes the step's inputs from host integers (`run` given token ids): each row's
embedding (the base's, or a variant's dense table or sign planes on the base's: `EmbedPlanes`) and
its rotation read in place from the rope tables at its position. After the layers' stream every
cache is cold, and each torch op the runner made before the call cost ~10–150 µs: ~0.3 ms of a
~9.5 ms one-row bf16 SmolLM2-135M step went to building tensors the call then only read.

A burst of greedy steps (`bind_steps`, `bd_decode_steps`) runs up to N steps of the same rows in
one call: each row's argmax is its token and its next input, at the next position, with no Python
between the steps (the ~0.4 ms the engine spends between two calls, ~5 % of that bf16 step). An
`Interrupt` set from another thread (a request or a cancel arrived) ends it after the current step.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bitdelta_kernels.cpu_build import cpu_isa, load_cpu_lib

_DTYPE_CODE = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # the C library's BD_W_*
GROUPS = ("qkv", "o", "gate_up", "down")  # the projection groups of a layer, in the C struct's order


class _Layer(ctypes.Structure):
    """The C library's bd_decode_layer."""

    _fields_ = [
        ("w", ctypes.c_void_p * 4),
        ("s", ctypes.c_void_p * 4),
        ("a", ctypes.c_void_p * 4),
        ("bias", ctypes.c_void_p * 4),
        ("norm", ctypes.c_void_p * 4),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("qk_norm", ctypes.c_void_p * 2),
        ("local", ctypes.c_int64),
        ("nope", ctypes.c_int64),
        ("norm_bias", ctypes.c_void_p * 4),
    ]


class _Opts(ctypes.Structure):
    """The C library's bd_decode_opts."""

    _fields_ = [
        ("gemma", ctypes.c_int32),
        ("act", ctypes.c_int32),
        ("embed_scale", ctypes.c_float),
        ("attn_softcap", ctypes.c_float),
        ("local_cos", ctypes.c_void_p),
        ("local_sin", ctypes.c_void_p),
        ("embed_multiplier", ctypes.c_float),
        ("residual_multiplier", ctypes.c_float),
        ("norm_once", ctypes.c_int32),
        ("qk_full", ctypes.c_int32),
        ("rotary", ctypes.c_int64),
        ("interleaved", ctypes.c_int32),
        ("rope_fp32", ctypes.c_int32),
        ("layer_norm", ctypes.c_int32),
        ("parallel", ctypes.c_int32),
        ("final_norm_bias", ctypes.c_void_p),
        ("ungated", ctypes.c_int32),
        ("qk_heads", ctypes.c_int32),
        ("norm_plus_one", ctypes.c_int32),
        ("qk_after_rope", ctypes.c_int32),
        ("sublayers_first", ctypes.c_int32),
        ("clip_qkv", ctypes.c_float),
        ("parallel_mlp_norm", ctypes.c_int32),
    ]


# The MLP gate activations the C layers compute (DecodeOptions.act -> bd_decode_opts' ACT_* code)
ACTS = {"silu": 0, "gelu_tanh": 1, "relu2": 2, "gelu_new": 3, "gelu": 4}


@dataclass(frozen=True)
class DecodeLayer:
    """One layer's tensors, each group's in GROUPS order: weights [d_out, d_in] (contiguous), the
    slots' sign stacks uint8 [n_slots, d_out, ceil(d_in/8)] and α stacks fp32 [n_slots, d_out],
    bias stacks [n_slots + 1, d_out] or None; the input and post-attention norm stacks
    [n_slots + 1, dim], then for Gemma 2/3's sandwich the pre- and post-feedforward ones (an input
    norm of None and a post-feedforward one: OLMo 2's post-norms); this layer's KV pool k, v [rows,
    KV, hd]; its window (None: full); the q and k norm stacks [n_slots + 1, head_dim] (Qwen3, Gemma
    3; with `DecodeOptions.qk_full` [n_slots + 1, heads · head_dim], OLMo 2) or None; `local`: the
    rotation of the call's local tables (Gemma 3's sliding layers, `DecodeOptions`); `nope`: no
    rotation at all (SmolLM3's NoPE layers); `norm_biases`: StableLM's LayerNorm biases beside `norms`, each
    [n_slots + 1, dim] or None (with `DecodeOptions.layer_norm` only; (): none)."""

    weights: tuple[torch.Tensor, ...]
    signs: tuple[torch.Tensor, ...]
    alpha: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    norms: tuple[torch.Tensor | None, ...]
    k: torch.Tensor
    v: torch.Tensor
    window: int | None
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    local: bool = False
    nope: bool = False
    norm_biases: tuple[torch.Tensor | None, ...] = ()


@dataclass(frozen=True)
class DecodeOptions:
    """What a family changes in the layer (the defaults: Llama's): `gemma`, Gemma's RMSNorm (× (1 + w)
    in fp32, one rounding) and token ids' embeddings × round(embed_scale); `act`, the MLP's gate activation
    (ACTS: "silu", GELU's tanh form "gelu_tanh", Nemotron's "relu2", Phi's op-by-op "gelu_new");
    `attn_scale`, the scores' scale (None: 1/√head_dim); `attn_softcap`, Gemma 2's
    cap of the scores; Granite's `embed_multiplier` (token ids' embeddings × it, one rounding) and
    `residual_multiplier` (each sublayer's output × it, rounded, before its residual add); OLMo 2's
    `norm_once` (RMSNorm × w in fp32, one rounding) and `qk_full` (the q and k norms over the whole
    projection); `rotary`, the rotated dims of a head and the rope tables' width (0: head_dim; Phi's
    partial_rotary_factor: the rest of each head passes as it is); `interleaved`, GLM's rope over dims
    (2i, 2i + 1) instead of (i, i + rotary/2); `rope_fp32`, ERNIE 4.5's and Cohere's rotation in fp32
    (from the tables as given), rounded once; `layer_norm`, a LayerNorm in place of every RMSNorm (Cohere's,
    StableLM's: the mean subtracted, × w in fp32, one rounding; StableLM's biases in `DecodeLayer.norm_biases`
    and `final_norm_bias`); `parallel`, Cohere's and StableLM's parallel block (the MLP reads
    the input norm's output: x + attention + MLP; the layers' norms are the input one alone); `ungated`,
    StarCoder2's MLP (the gate_up group is up alone, [intermediate, dim]: down(act(up))); `qk_heads`, Command
    R+'s q and k norms per head, each head by weights of its own (the stacks [n_slots + 1, heads · head_dim]);
    `norm_plus_one`, Nemotron's LayerNorm1P (with `layer_norm`: × round(w + 1) in place of w); `qk_after_rope`,
    Hunyuan's per-head q and k norms after the rope, not before; `sublayers_first`, Phi's parallel block
    ((attention + MLP) + x, with `parallel`); `parallel_mlp_norm`, GPT-NeoX's parallel block, whose MLP reads
    its own norm of the block's input (the layer's second norm stack; with `parallel` and `sublayers_first`);
    `clip_qkv`, OLMo 1's and OLMoE's clipping of q, k and v to ±clip_qkv before the heads are split (after
    `qk_full`'s norms; None: none)."""

    gemma: bool = False
    act: str = "silu"
    embed_scale: float = 0.0
    attn_scale: float | None = None
    attn_softcap: float | None = None
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    norm_once: bool = False
    qk_full: bool = False
    rotary: int = 0
    interleaved: bool = False
    rope_fp32: bool = False
    layer_norm: bool = False
    parallel: bool = False
    ungated: bool = False
    qk_heads: bool = False
    norm_plus_one: bool = False
    qk_after_rope: bool = False
    sublayers_first: bool = False
    parallel_mlp_norm: bool = False
    clip_qkv: float | None = None

    def __post_init__(self):
        if self.act not in ACTS:
            raise ValueError(f"act {self.act!r} is not one of {sorted(ACTS)}")
        if self.norm_plus_one and not self.layer_norm:
            raise ValueError("norm_plus_one is a LayerNorm's (Nemotron's LayerNorm1P): it needs layer_norm")
        if self.sublayers_first and not self.parallel:
            raise ValueError("sublayers_first orders a parallel block's sums (Phi's): it needs parallel")
        if self.parallel_mlp_norm and not self.sublayers_first:
            raise ValueError("parallel_mlp_norm is GPT-NeoX's block, (attention + MLP) + x: it needs sublayers_first")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv must be positive or None, got {self.clip_qkv}")


@dataclass(frozen=True)
class DecodeShape:
    """The model's dimensions the C layers need."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float

    @staticmethod
    def supported(dtype: torch.dtype) -> bool:
        """Whether the C library can run the layers here: built with SIMD (the scalar build's GEMV
        is far slower than BLAS) and a dtype it rounds to."""
        return dtype in _DTYPE_CODE and load_cpu_lib() is not None and cpu_isa() != "scalar"


class _LowRank(ctypes.Structure):
    """The C library's bd_lowrank."""

    _fields_ = [
        ("v", ctypes.c_void_p),
        ("R", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("r0", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("c0", ctypes.c_void_p),
        ("rank", ctypes.c_void_p),
        ("u", ctypes.c_void_p),
    ]


class LowRankTable:
    """The slots' low-rank residuals as the C call reads them: for slot s, layer l and group g (GROUPS
    order), y += U_m · (V · x)[c0_m : c0_m + r_m] into the group's rows r0_m.. of each matrix m, V fp16
    [R, d_in] contiguous and U_m fp16 [d_out_m, r_m] the transposed view of a contiguous Uᵀ
    (services/gpu_worker/slots.py `LowRank`). Built once per set of resident deltas (it holds their
    tensors), checked against the layers' shapes."""

    def __init__(self, terms: dict, n_slots: int, n_layers: int, shape: DecodeShape):
        """terms: (slot, layer, group name) -> (v, [(r0, c0, U), ...])."""
        dims = shape_of_groups(shape)
        self._ptrs = (ctypes.c_void_p * (n_slots * n_layers * len(GROUPS)))()
        self._keep: list = []
        for (s, layer, group), (v, us) in terms.items():
            d_out, d_in = dims[group]
            if not (0 <= s < n_slots and 0 <= layer < n_layers):
                raise ValueError(
                    f"low-rank term of slot {s}, layer {layer}: outside {n_slots} slots, {n_layers} layers"
                )
            if v.dtype != torch.float16 or v.dim() != 2 or v.shape[1] != d_in or not v.is_contiguous():
                raise ValueError(f"{group}'s V must be float16 [R, {d_in}], contiguous, is {v.dtype} {list(v.shape)}")
            for r0, c0, u in us:
                if u.dtype != torch.float16 or u.dim() != 2 or not u.t().is_contiguous():
                    raise ValueError(f"{group}'s U must be float16 [rows, rank], a contiguous Uᵀ's view")
                if r0 < 0 or r0 + u.shape[0] > d_out or c0 < 0 or c0 + u.shape[1] > v.shape[0]:
                    raise ValueError(f"{group}'s U {list(u.shape)} at rows {r0}, ranks {c0} does not fit")
            r0s = torch.tensor([r0 for r0, _, _ in us], dtype=torch.int64)
            c0s = torch.tensor([c0 for _, c0, _ in us], dtype=torch.int64)
            rows = torch.tensor([u.shape[0] for _, _, u in us], dtype=torch.int64)
            ranks = torch.tensor([u.shape[1] for _, _, u in us], dtype=torch.int64)
            u_ptrs = (ctypes.c_void_p * len(us))(*[u.data_ptr() for _, _, u in us])
            c = _LowRank(v.data_ptr(), v.shape[0], len(us), r0s.data_ptr(), rows.data_ptr(), c0s.data_ptr(),
                         ranks.data_ptr(), ctypes.addressof(u_ptrs))  # fmt: skip
            self._keep += [v, us, r0s, c0s, rows, ranks, u_ptrs, c]
            self._ptrs[(s * n_layers + layer) * len(GROUPS) + GROUPS.index(group)] = ctypes.addressof(c)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._ptrs)


def shape_of_groups(shape: DecodeShape) -> dict[str, tuple[int, int]]:
    """Each projection group's (d_out, d_in) in the C layers."""
    q = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    hd = shape.n_heads * shape.head_dim
    return {
        "qkv": (q, shape.dim),
        "o": (shape.dim, hd),
        "gate_up": (2 * shape.intermediate, shape.dim),
        "down": (shape.dim, shape.intermediate),
    }


class Interrupt:
    """A flag that a burst of decode steps (`DecodeLayers.bind_steps`) reads before each step after
    its first: set from any thread, the burst ends after the step it is in."""

    def __init__(self) -> None:
        self._flag = ctypes.c_int32(0)

    def set(self) -> None:
        self._flag.value = 1

    def clear(self) -> None:
        self._flag.value = 0

    def is_set(self) -> bool:
        return bool(self._flag.value)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._flag)


@dataclass(frozen=True)
class HeadPlanes:
    """Sign planes on the base's LM head for a step's logits (variants whose tied embedding is
    compressed to signs): plane v is (signs uint8 [vocab, ceil(dim/8)], α fp32 [vocab] or [1]);
    row_head: int64 [B], the plane of each row, −1 for the base's head alone."""

    planes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    row_head: torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class EmbedPlanes:
    """Variants' own embeddings for a step whose rows the layers embed (`run` given token ids):
    variant v's is a dense table (dtype [vocab, dim]) or the base's rows + its k sign planes
    (signs uint8 [k, vocab, ceil(dim/8)], α fp32 [k, vocab]), `tables[v]` = the table or the
    (signs, α) pair; row_embed: the variant of each row, −1 for the base's embedding alone."""

    tables: tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], ...]
    row_embed: torch.Tensor | Sequence[int]


def _check(layers: list[DecodeLayer], shape: DecodeShape, dtype: torch.dtype, options: DecodeOptions) -> None:
    """Everything the C code indexes without checking (it would read out of bounds otherwise)."""
    D, H, KV, hd, F = shape.dim, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.intermediate
    up = F if options.ungated else 2 * F  # StarCoder2's up alone, else gate ‖ up
    want = {"qkv": ((H + 2 * KV) * hd, D), "o": (D, H * hd), "gate_up": (up, D), "down": (D, F)}
    for i, L in enumerate(layers):
        for g, w, s, a, b in zip(GROUPS, L.weights, L.signs, L.alpha, L.biases):
            d_out, d_in = want[g]
            n_slots = s.shape[0]
            ok = (
                tuple(w.shape) == (d_out, d_in)
                and w.dtype == dtype
                and w.is_contiguous()
                and s.dtype == torch.uint8
                and tuple(s.shape) == (n_slots, d_out, (d_in + 7) // 8)
                and s.is_contiguous()
                and a.dtype == torch.float32
                and tuple(a.shape) == (n_slots, d_out)
                and a.is_contiguous()
                and (b is None or (b.dtype == dtype and tuple(b.shape) == (n_slots + 1, d_out) and b.is_contiguous()))
            )
            if not ok:
                raise ValueError(f"layer {i}, group {g}: tensors do not fit a [{d_out}, {d_in}] {dtype} projection")
        if options.parallel:
            own = L.norms[1] if len(L.norms) > 1 else None  # GPT-NeoX's: the MLP's own norm
            if (
                len(L.norms) not in (2, 4)
                or L.norms[0] is None
                or (own is not None) != options.parallel_mlp_norm
                or any(n is not None for n in L.norms[2:])
            ):
                raise ValueError(
                    f"layer {i}: a parallel block's layer has its input norm alone (GPT-NeoX's: and the MLP's, second)"
                )
        elif len(L.norms) not in (2, 4) or L.norms[1] is None or (L.norms[0] is None and len(L.norms) == 2):
            raise ValueError(
                f"layer {i}: 2 norm stacks, or 4 with the sandwich's or the post-norms' (None where absent)"
            )
        rows = L.norms[0 if options.parallel else 1].shape[0]
        for t in L.norms:
            if t is not None and (t.dtype != dtype or t.dim() != 2 or t.shape[1] != D or not t.is_contiguous()):
                raise ValueError(f"layer {i}: norm stacks must be {dtype} [n_slots + 1, {D}], contiguous")
        if any(b is not None for b in L.norm_biases) and not options.layer_norm:
            raise ValueError(f"layer {i}: norm biases are a LayerNorm's (DecodeOptions.layer_norm)")
        for n, b in zip(L.norms, L.norm_biases):
            if b is not None and (n is None or b.dtype != dtype or b.shape != n.shape or not b.is_contiguous()):
                raise ValueError(f"layer {i}: a norm bias stack must be its norm's shape and dtype, contiguous")
        if len(L.norm_biases) > len(L.norms):
            raise ValueError(f"layer {i}: more norm biases than norms")
        for t, width in zip(L.qk_norms or (), (H, KV)):
            size = width * hd if options.qk_full or options.qk_heads else hd
            if t.dtype != dtype or tuple(t.shape) != (rows, size) or not t.is_contiguous():
                raise ValueError(f"layer {i}: q/k norm stacks must be {dtype} [n_slots + 1, {size}], contiguous")
        if L.k.dtype != dtype or L.k.shape != L.v.shape or tuple(L.k.shape[1:]) != (KV, hd):
            raise ValueError(f"layer {i}: the KV pool must be {dtype} [rows, {KV}, {hd}]")
        if not (L.k.is_contiguous() and L.v.is_contiguous()):
            raise ValueError(f"layer {i}: the KV pool must be contiguous")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor: itself when it is one (no torch op)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _ints(v: torch.Tensor | Sequence[int], dtype: torch.dtype) -> torch.Tensor | ctypes.Array:
    """Integers as the C call reads them: a tensor as a contiguous `dtype` one (`_as`), host ints
    as a ctypes array of that width (no torch op: the runner's step passes lists)."""
    if isinstance(v, torch.Tensor):
        return _as(v, dtype)
    return ((ctypes.c_int32 if dtype == torch.int32 else ctypes.c_int64) * len(v))(*v)


def _n(v: torch.Tensor | ctypes.Array) -> int:
    return v.numel() if isinstance(v, torch.Tensor) else len(v)


def _addr(v: torch.Tensor | ctypes.Array | None) -> int | ctypes.Array | None:
    return v.data_ptr() if isinstance(v, torch.Tensor) else v


def _slots32(t: torch.Tensor | Sequence[int]) -> torch.Tensor | ctypes.Array:
    """Slot indices as the C call reads them (int32; their range is checked there): a wider
    tensor's values, or host ints, first shown to fit, so that no value wraps into a valid slot."""
    if isinstance(t, torch.Tensor):
        lo, hi = (int(t.min()), int(t.max())) if t.dtype != torch.int32 and t.numel() else (0, 0)
    else:
        lo, hi = (min(t), max(t)) if len(t) else (0, 0)
    if not -(2**31) <= lo <= hi < 2**31:
        raise ValueError("slot indices must fit int32")
    return _ints(t, torch.int32)


@dataclass
class _HeadArgs:
    """`bd_decode_layers`' head-plane arguments, holding the tensors and arrays they point into."""

    planes: tuple | list = ()
    rows: torch.Tensor | ctypes.Array | None = None
    signs: ctypes.Array | None = None
    alpha: ctypes.Array | None = None
    strides: ctypes.Array | None = None

    @property
    def args(self) -> tuple:
        """n_heads, head_signs, head_alpha, head_alpha_stride, head_of_row."""
        return (len(self.planes), self.signs, self.alpha, self.strides, _addr(self.rows))


@dataclass
class _EmbedArgs:
    """`bd_decode_layers`' embedding arguments, holding the tensors and arrays they point into."""

    tensors: tuple = ()
    rows: torch.Tensor | ctypes.Array | None = None
    weights: ctypes.Array | None = None
    signs: ctypes.Array | None = None
    alpha: ctypes.Array | None = None
    planes: ctypes.Array | None = None

    @property
    def args(self) -> tuple:
        """n_embeds, embed_weight, embed_signs, embed_alpha, embed_planes, embed_of_row."""
        n = 0 if self.weights is None else len(self.weights)
        return (n, self.weights, self.signs, self.alpha, self.planes, _addr(self.rows))


class DecodeLayers:
    """The C layers over fixed tensors: checked and turned into the C struct array once (the base,
    the slot stacks and the KV pool are allocated once and never move; this keeps them alive)."""

    def __init__(
        self,
        layers: list[DecodeLayer],
        shape: DecodeShape,
        dtype: torch.dtype,
        lib: ctypes.CDLL | None = None,
        *,
        final_norm: torch.Tensor | None = None,
        head: torch.Tensor | None = None,
        embed: torch.Tensor | None = None,
        options: DecodeOptions = DecodeOptions(),
        final_norm_bias: torch.Tensor | None = None,
    ):
        """lib: the C library to call (another build, `cpu_build.load_variant`, for tests and
        benchmarks that compare builds); None: the process's (`load_cpu_lib`). final_norm: the
        final norm's stack [n_slots + 1, dim] (`run` then returns the normed output, as the runner's
        _final); head: the base's LM head [vocab, dim] (then `run(logits=True)` returns logits);
        embed: the base's embedding [vocab, dim] (then `run` takes token ids); options: what the family
        changes in the layer (default: Llama's); final_norm_bias: StableLM's, beside final_norm."""
        if lib is None and not DecodeShape.supported(dtype):
            raise RuntimeError("the C decode layers need the compiled C library (with SIMD)")
        _check(layers, shape, dtype, options)
        if not (0 <= options.rotary <= shape.head_dim and options.rotary % 2 == 0):
            raise ValueError(f"rotary must be an even number of dims up to {shape.head_dim} (0: all)")
        self.layers, self.shape, self.dtype = layers, shape, dtype
        self._lib = lib
        self.n_slots = layers[0].signs[0].shape[0] if layers else 0
        for name, t, rows in (
            ("final_norm", final_norm, self.n_slots + 1),
            ("final_norm_bias", final_norm_bias, self.n_slots + 1),
            ("head", head, None),
            ("embed", embed, None),
        ):
            if t is not None and (
                t.dtype != dtype
                or t.dim() != 2
                or t.shape[1] != shape.dim
                or (rows is not None and t.shape[0] != rows)
                or not t.is_contiguous()
            ):
                raise ValueError(f"{name} must be {dtype} [{rows or 'vocab'}, {shape.dim}], contiguous")
        if head is not None and final_norm is None:
            raise ValueError("a head needs the final norm before it")
        if final_norm_bias is not None and (final_norm is None or not options.layer_norm):
            raise ValueError("a final norm bias needs the final norm, a LayerNorm (DecodeOptions.layer_norm)")
        if options.rope_fp32 and not options.interleaved:
            raise ValueError("rope_fp32 is the interleaved rotation's (ERNIE 4.5's, Cohere's) only")
        self.final_norm, self.head, self.embed, self.options = final_norm, head, embed, options
        self.final_norm_bias = final_norm_bias
        self.any_local = any(L.local for L in layers)
        self._arr = (_Layer * len(layers))()
        for c, L in zip(self._arr, layers):
            c.w[:] = [_ptr(t) for t in L.weights]
            c.s[:] = [_ptr(t) for t in L.signs]
            c.a[:] = [_ptr(t) for t in L.alpha]
            c.bias[:] = [_ptr(t) for t in L.biases]
            c.norm[:] = [_ptr(t) for t in L.norms] + [None] * (4 - len(L.norms))
            c.k, c.v, c.window = L.k.data_ptr(), L.v.data_ptr(), L.window or 0
            c.qk_norm[:] = [_ptr(t) for t in L.qk_norms] if L.qk_norms else [None, None]
            c.local = int(L.local)
            c.nope = int(L.nope)
            c.norm_bias[:] = [_ptr(t) for t in L.norm_biases] + [None] * (4 - len(L.norm_biases))

    def one_pass_planes(self, rows: int = 1) -> int:
        """Up to how many sign planes of one variant `run(fuse=True)` sums in the weights' own pass
        for a step of `rows` rows of these layers' dtype on this library (0: none; more planes or
        rows take the table loop)."""
        return (self._lib or load_cpu_lib()).bd_one_pass_planes(_DTYPE_CODE[self.dtype], rows)

    def _head_args(self, hp: HeadPlanes | None, logits: bool, B: int) -> _HeadArgs:
        """`hp` checked (the C code reads its planes and rows unchecked) as the C call's arguments."""
        if hp is None:
            return _HeadArgs()
        if not logits:
            raise ValueError("head planes need logits")
        V, D = self.head.shape
        for signs, alpha in hp.planes:
            if signs.dtype != torch.uint8 or tuple(signs.shape) != (V, (D + 7) // 8):
                raise ValueError("a head plane's signs must be uint8 [vocab, ceil(dim/8)]")
            if alpha.dtype != torch.float32 or alpha.dim() != 1 or alpha.shape[0] not in (1, V):
                raise ValueError("a head plane's α must be fp32 [vocab] or [1]")
        rows = _ints(hp.row_head, torch.int64)
        if _n(rows) != B:  # its values' range: checked in C
            raise ValueError(f"row_head must be [{B}] plane indices in [-1, {len(hp.planes) - 1}]")
        planes = [(s.contiguous(), a.contiguous()) for s, a in hp.planes]
        return _HeadArgs(
            planes,
            rows,
            (ctypes.c_void_p * len(planes))(*[s.data_ptr() for s, _ in planes]),
            (ctypes.c_void_p * len(planes))(*[a.data_ptr() for _, a in planes]),
            (ctypes.c_int64 * len(planes))(*[int(a.shape[0] != 1) for _, a in planes]),
        )

    def _embed_args(self, ep: EmbedPlanes | None, B: int) -> _EmbedArgs:
        """`ep` checked (the C code reads its tables and rows unchecked, but for the rows' range) as
        the C call's arguments."""
        if ep is None:
            return _EmbedArgs()
        if self.embed is None:
            raise ValueError("variants' embeddings need the layers' embedding")
        V, D = self.embed.shape
        weights, signs, alpha, planes = [], [], [], []
        for t in ep.tables:
            if isinstance(t, torch.Tensor):
                if t.dtype != self.dtype or tuple(t.shape) != (V, D) or not t.is_contiguous():
                    raise ValueError(f"a variant's dense embedding must be {self.dtype} [{V}, {D}], contiguous")
                weights.append(t)
                signs.append(None)
                alpha.append(None)
                planes.append(0)
                continue
            s, a = t
            k = s.shape[0] if s.dim() == 3 else -1
            if s.dtype != torch.uint8 or tuple(s.shape[1:]) != (V, (D + 7) // 8) or not s.is_contiguous():
                raise ValueError("a variant's embedding planes must be uint8 [k, vocab, ceil(dim/8)], contiguous")
            if a.dtype != torch.float32 or tuple(a.shape) != (k, V) or not a.is_contiguous():
                raise ValueError("a variant's embedding α must be fp32 [k, vocab], contiguous")
            weights.append(None)
            signs.append(s)
            alpha.append(a)
            planes.append(k)
        rows = _ints(ep.row_embed, torch.int64)
        if _n(rows) != B:  # its values' range: checked in C
            raise ValueError(f"row_embed must be [{B}] variant indices in [-1, {len(ep.tables) - 1}]")
        n = len(ep.tables)
        return _EmbedArgs(
            (weights, signs, alpha),
            rows,
            (ctypes.c_void_p * n)(*[_ptr(t) for t in weights]),
            (ctypes.c_void_p * n)(*[_ptr(t) for t in signs]),
            (ctypes.c_void_p * n)(*[_ptr(t) for t in alpha]),
            (ctypes.c_int64 * n)(*planes),
        )

    def run(self, *args, **kwargs) -> torch.Tensor:
        """Every layer for B decode rows: `bind`'s call, made now."""
        return self.bind(*args, **kwargs)()

    def bind(
        self,
        x: torch.Tensor | Sequence[int],
        row_slot: torch.Tensor | Sequence[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_rows: torch.Tensor | Sequence[int],
        tables: torch.Tensor | Sequence[Sequence[int]],
        lens: torch.Tensor | Sequence[int],
        block_size: int,
        logits: bool = False,
        head_planes: HeadPlanes | None = None,
        fuse: bool = False,
        row_planes: torch.Tensor | None = None,
        *,
        rope_rows: torch.Tensor | Sequence[int] | None = None,
        embeds: EmbedPlanes | None = None,
        lowrank: LowRankTable | None = None,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Callable[[], torch.Tensor]:
        """The C call for B decode rows, its inputs checked and converted: calling it runs every
        layer (the GIL released) -> the last layer's output [B, dim] in the model's dtype,
        normed by each row's final norm if the layers have one; with `logits` (the layers have a
        head) fp32 [B, vocab] = round(h · headᵀ) instead, as `dense_linear(h, head).float()`; with
        `head_planes` too, a row of plane v gets fp32 h · headᵀ + α_v ⊙ (h · S_vᵀ), not rounded, as
        the runner's `_sign_heads` (`dense_linear(h, head, out_fp32=True)`, then
        `bitdelta_delta_batched`), and a row of −1 round(h · headᵀ) as before. `fuse`: a step of B
        rows of one variant (the same slots in every row) of up to `one_pass_planes(B)` planes (4,
        3 and 1 for 1, 2 and 3 rows; bf16 4 for one row, 1 for 2 and 3) sums each projection's planes, and its head's plane, in the weights'
        pass where the library has such a loop (fp32: AVX-512; bf16: AVX512-BF16): other sums than
        the table loop's, so not a row's numbers in a mixed step, though the same as the row's alone
        (the default mode's single-variant form, never the batch-invariant one's); else ignored.

        x: [B, dim] the embedded tokens (the model's dtype), or the rows' token ids, which the
        layers embed (they need their `embed`): the base's rows, and each variant's own of `embeds`
        (its dense table, or the base's rows + its sign planes, as the runner's
        `_variant_embeddings`); row_slot: [B] slot per row (−1: the base; row slot + 1 of the norm
        and bias stacks; the row's one sign plane); row_planes: [B, k] each row's sign-plane slots
        instead (variants of up to k planes, −1 past a variant's own; a base row's all −1), their
        terms summed as `bitdelta_delta_batched` sums a row's planes; cos, sin: [B, head_dim] (fp32
        or a model dtype, read as they are), or with `rope_rows` ([B]) tables [n, head_dim] whose row
        rope_rows[b] is row b's (the runner's cached tables and the rows' positions); write_rows: [B]
        the pool rows the new k, v go to;
        tables: [B, max_blocks] (or each row's block list), lens: [B] as
        `bitdelta_kernels.paged_decode` (lens counts the new token). Pool rows and tables are the
        caller's (the runner builds them from the scheduler's block tables); they must lie inside
        the pool. lowrank: the slots' low-rank residuals (`LowRankTable`), each row's slot's added to
        its projections. local: the local layers' cos, sin (as cos and sin: the same rows and dtype),
        needed where a layer is `local`. Every index argument is a tensor or host ints (the runner's step passes host ints:
        after the layers' stream every cache is cold, and each torch op before the call costs
        ~10–150 µs). The runner binds the call, hands the last step's tokens to the event loop's
        thread, and then calls it: a torch op between the two (most release the GIL) let that
        thread take the GIL for its whole turn, ~0.2 ms of a one-row step, before the call.
        """
        if logits and self.head is None:
            raise ValueError("logits need the layers' head")
        sh, hd = self.shape, self.shape.head_dim
        tokens = None if isinstance(x, torch.Tensor) and x.is_floating_point() else _ints(x, torch.int64)
        B = _n(tokens) if tokens is not None else x.shape[0]
        if tokens is None and (x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != sh.dim):
            raise ValueError(f"x must be {self.dtype} [B, {sh.dim}], or token ids")
        x = None if tokens is not None else _as(x, self.dtype)  # held by the bound call (below)
        if tokens is not None and self.embed is None:
            raise ValueError("token ids need the layers' embedding")
        heads, embs = self._head_args(head_planes, logits, B), self._embed_args(embeds, B)
        if embeds is not None and tokens is None:
            raise ValueError("variants' embeddings need token ids")
        n_rope, rot = B, self.options.rotary or hd
        if rope_rows is not None:
            rope_rows, n_rope = _ints(rope_rows, torch.int64), cos.shape[0]
        if (
            cos.dtype not in _DTYPE_CODE
            or sin.dtype != cos.dtype
            or cos.shape != (n_rope, rot)
            or sin.shape != cos.shape
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError(f"cos, sin must be float [{n_rope}, {rot}] of one dtype, contiguous")
        if self.any_local and (
            local is None or any(t.dtype != cos.dtype or t.shape != cos.shape or not t.is_contiguous() for t in local)
        ):
            raise ValueError(f"local layers need local cos, sin tables like cos: {cos.dtype} [{n_rope}, {hd}]")
        op = self.options
        opts = _Opts(
            int(op.gemma),
            ACTS[op.act],
            op.embed_scale,
            op.attn_softcap or 0.0,
            *((local[0].data_ptr(), local[1].data_ptr()) if self.any_local else (None, None)),
            op.embed_multiplier,
            op.residual_multiplier,
            int(op.norm_once),
            int(op.qk_full),
            op.rotary,
            int(op.interleaved),
            int(op.rope_fp32),
            int(op.layer_norm),
            int(op.parallel),
            _ptr(self.final_norm_bias),
            int(op.ungated),
            int(op.qk_heads),
            int(op.norm_plus_one),
            int(op.qk_after_rope),
            int(op.sublayers_first),
            op.clip_qkv or 0.0,
            int(op.parallel_mlp_norm),
        )
        rs, wr = _slots32(row_slot), _ints(write_rows, torch.int64)
        if rope_rows is None:
            rope_rows = (ctypes.c_int64 * B)(*range(B))
        if not isinstance(tables, torch.Tensor):
            width = max(map(len, tables), default=0)  # padded with block 0, never read
            tables = (ctypes.c_int32 * (B * width))(*[i for r in tables for i in (*r, *(0,) * (width - len(r)))])
            max_blocks = width
        elif tables.dtype != torch.int32 or tables.dim() != 2 or tables.shape[0] != B:
            raise ValueError(f"tables must be int32 [{B}, max_blocks]")
        else:
            tables, max_blocks = _as(tables, torch.int32), tables.shape[1]
        n = _ints(lens, torch.int32)
        if _n(rs) != B or _n(wr) != B or _n(n) != B or _n(rope_rows) != B or _n(tables) != B * max_blocks:
            raise ValueError(f"row_slot, write_rows, lens and rope_rows must be [{B}], tables [{B}, max_blocks]")
        rp = None if row_planes is None else _slots32(row_planes)
        if rp is not None and (rp.dim() != 2 or rp.shape[0] != B or rp.shape[1] < 1):
            raise ValueError(f"row_planes must be [{B}, k]")
        out = torch.empty(B, self.head.shape[0], dtype=torch.float32) if logits else None
        h = None if logits else torch.empty(B, sh.dim, dtype=torch.float32)
        args = (
            ctypes.addressof(self._arr),
            len(self.layers),
            self.n_slots,
            _ptr(x),
            _addr(tokens),
            _ptr(self.embed),
            0 if self.embed is None else self.embed.shape[0],
            *embs.args,
            _ptr(h),
            B,
            _addr(rs),
            _addr(rp),
            0 if rp is None else rp.shape[1],
            sh.dim,
            sh.n_heads,
            sh.n_kv_heads,
            hd,
            sh.intermediate,
            sh.norm_eps,
            _DTYPE_CODE[self.dtype],
            cos.data_ptr(),
            sin.data_ptr(),
            _DTYPE_CODE[cos.dtype],
            _addr(rope_rows),
            n_rope,
            _addr(wr),
            _addr(tables),
            max_blocks,
            _addr(n),
            block_size,
            1.0 / math.sqrt(hd) if op.attn_scale is None else op.attn_scale,  # as bitdelta_kernels.paged_decode
            _ptr(self.final_norm),
            _ptr(self.head if logits else None),
            0 if out is None else out.shape[1],
            *heads.args,
            _ptr(out),
            torch.get_num_threads(),
            int(fuse),
            None if lowrank is None else lowrank.address,
            ctypes.addressof(opts),
        )
        return _Bound(
            (self._lib or load_cpu_lib()).bd_decode_layers,
            args,
            (x, tokens, rs, wr, cos, sin, rope_rows, tables, n, rp, heads, embs, lowrank, opts, local),
            self.dtype,
            h,
            out,
            (self.n_slots, B, len(heads.planes), len(embeds.tables) if embeds else 0, n_rope),
        )

    def bind_steps(
        self,
        tokens: Sequence[int],
        row_slot: Sequence[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_rows: Sequence[int],
        tables: Sequence[Sequence[int]],
        lens: Sequence[int],
        block_size: int,
        steps: int,
        *,
        rope_rows: Sequence[int],
        interrupt: Interrupt | None = None,
        deadline: float | None = None,
        **kwargs,
    ) -> Callable[[], Burst]:
        """Up to `steps` greedy decode steps of B rows in one call (`bd_decode_steps`): `bind`'s
        first step given token ids (its other arguments as there: `head_planes`, `fuse`,
        `row_planes`, `embeds`), each row's argmax of its logits (the first maximum, a NaN above
        all: numpy's) its token and its next input, at the next position: rope row + 1, the pool
        row of that position in its block list (`tables` must hold the blocks of every position of
        the burst, the cos/sin tables a row for each), lens + 1. A step after the first starts
        only while `interrupt` is not set and `time.monotonic()` is before `deadline`. Calling it
        -> a `Burst`: each row's tokens, one per step run (≥ 1), the same tokens as as many single
        steps with the argmax of each step's logits, and when each step's were picked."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if not isinstance(tables, torch.Tensor) and any(
            (n - 1 + steps - 1) // block_size >= len(t) for t, n in zip(tables, lens)
        ):  # a ragged list is padded for the call: its row's own length is checked here
            raise ValueError(_BURST_ROOM)
        first = self.bind(
            tokens, row_slot, cos, sin, write_rows, tables, lens, block_size, logits=True, rope_rows=rope_rows, **kwargs
        )
        B = first.sizes[1]
        out, times = (ctypes.c_int64 * (B * steps))(), (ctypes.c_double * steps)()
        stop = None if interrupt is None else interrupt.address
        args = (*first.args, steps, stop, deadline or 0.0, out, times)  # bd_decode_layers', then the burst's
        lib = self._lib or load_cpu_lib()
        keep = (*first.keep, interrupt)
        call = _Bound(lib.bd_decode_steps, args, keep, first.dtype, first.h, first.out, first.sizes)
        return _BoundSteps(call, out, times, steps)


_BURST_ROOM = (
    "a burst's positions need a rope row and a block each: the cos/sin tables and each row's block list must"
    " cover position lens - 1 + steps - 1"
)


@dataclass
class _Bound:
    """A bound `bd_decode_layers` call (`DecodeLayers.bind`): its arguments, what they point into,
    its outputs, and what each error code of it means."""

    f: Callable
    args: tuple
    keep: tuple
    dtype: torch.dtype
    h: torch.Tensor | None  # the last layer's output (no logits)
    out: torch.Tensor | None  # the logits
    sizes: tuple[int, int, int, int, int]  # n_slots, B, head planes, variants' embeddings, rope rows

    def __call__(self) -> torch.Tensor:
        self.check(self.f(*self.args))
        return self.h.to(self.dtype) if self.out is None else self.out

    def check(self, rc: int) -> None:
        """Raise what a negative return code of the call means."""
        n_slots, B, n_heads, n_embeds, n_rope = self.sizes
        if rc == -2:
            raise ValueError(
                f"row_slot and row_planes values must lie in [-1, {n_slots - 1}], and a base row (row_slot −1)"
                " has no sign planes"
            )
        if rc == -3:
            raise ValueError(f"row_head must be [{B}] plane indices in [-1, {n_heads - 1}]")
        if rc == -4:
            raise ValueError(
                f"token ids must lie in the embedding, row_embed values in [-1, {n_embeds - 1}] and rope_rows in"
                f" [0, {n_rope - 1}]"
            )
        if rc == -5:
            raise ValueError(_BURST_ROOM)
        if rc < 0:
            raise MemoryError("bd_decode_layers could not allocate its scratch")


@dataclass(frozen=True)
class Burst:
    """What a burst of decode steps made: tokens[b] row b's, one per step run; times[s] when step s's
    tokens were picked (`time.perf_counter()`'s clock: CLOCK_MONOTONIC)."""

    tokens: list[list[int]]
    times: list[float]


@dataclass
class _BoundSteps:
    """A bound `bd_decode_steps` call (`DecodeLayers.bind_steps`)."""

    call: _Bound
    tokens: ctypes.Array
    times: ctypes.Array
    steps: int

    def __call__(self) -> Burst:
        n = self.call.f(*self.call.args)
        self.call.check(n)
        t, k = self.tokens, self.steps
        return Burst([t[b * k : b * k + n] for b in range(self.call.sizes[1])], self.times[:n])


__all__ = [
    "Burst",
    "DecodeLayer",
    "DecodeLayers",
    "DecodeOptions",
    "DecodeShape",
    "EmbedPlanes",
    "GROUPS",
    "HeadPlanes",
    "Interrupt",
]
