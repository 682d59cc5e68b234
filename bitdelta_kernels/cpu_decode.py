"""Every layer of a step's single-token decode rows in ONE C call (`bd_decode_layers` in
csrc/bitdelta_cpu.c), on CPU.

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
per slot, a variant of k planes on k slots: `run`'s row_planes); anything else (column α's, a
low-rank term) takes the runner's layer-by-layer path.
"""

from __future__ import annotations

import ctypes
import math
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
        ("norm", ctypes.c_void_p * 2),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("window", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class DecodeLayer:
    """One layer's tensors, each group's in GROUPS order: weights [d_out, d_in] (contiguous), the
    slots' sign stacks uint8 [n_slots, d_out, ceil(d_in/8)] and α stacks fp32 [n_slots, d_out],
    bias stacks [n_slots + 1, d_out] or None; the input and post-attention norm stacks
    [n_slots + 1, dim]; this layer's KV pool k, v [rows, KV, hd]; its window (None: full)."""

    weights: tuple[torch.Tensor, ...]
    signs: tuple[torch.Tensor, ...]
    alpha: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    norms: tuple[torch.Tensor, torch.Tensor]
    k: torch.Tensor
    v: torch.Tensor
    window: int | None


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


@dataclass(frozen=True)
class HeadPlanes:
    """Sign planes on the base's LM head for a step's logits (variants whose tied embedding is
    compressed to signs): plane v is (signs uint8 [vocab, ceil(dim/8)], α fp32 [vocab] or [1]);
    row_head: int64 [B], the plane of each row, −1 for the base's head alone."""

    planes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    row_head: torch.Tensor


def _check(layers: list[DecodeLayer], shape: DecodeShape, dtype: torch.dtype) -> None:
    """Everything the C code indexes without checking (it would read out of bounds otherwise)."""
    D, H, KV, hd, F = shape.dim, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.intermediate
    want = {"qkv": ((H + 2 * KV) * hd, D), "o": (D, H * hd), "gate_up": (2 * F, D), "down": (D, F)}
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
        for t in L.norms:
            if t.dtype != dtype or t.dim() != 2 or t.shape[1] != D or not t.is_contiguous():
                raise ValueError(f"layer {i}: norm stacks must be {dtype} [n_slots + 1, {D}], contiguous")
        if L.k.dtype != dtype or L.k.shape != L.v.shape or tuple(L.k.shape[1:]) != (KV, hd):
            raise ValueError(f"layer {i}: the KV pool must be {dtype} [rows, {KV}, {hd}]")
        if not (L.k.is_contiguous() and L.v.is_contiguous()):
            raise ValueError(f"layer {i}: the KV pool must be contiguous")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor: itself when it is one (no torch op)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _slots32(t: torch.Tensor) -> torch.Tensor:
    """Slot indices as the C call reads them (int32; their range is checked there): a wider
    tensor's values first shown to fit, so that no value wraps into a valid slot."""
    if t.dtype != torch.int32 and t.numel() and not -(2**31) <= int(t.min()) <= int(t.max()) < 2**31:
        raise ValueError("slot indices must fit int32")
    return _as(t, torch.int32)


@dataclass
class _HeadArgs:
    """`bd_decode_layers`' head-plane arguments, holding the tensors and arrays they point into."""

    planes: tuple | list = ()
    rows: torch.Tensor | None = None
    signs: ctypes.Array | None = None
    alpha: ctypes.Array | None = None
    strides: ctypes.Array | None = None

    @property
    def args(self) -> tuple:
        """n_heads, head_signs, head_alpha, head_alpha_stride, head_of_row."""
        return (len(self.planes), self.signs, self.alpha, self.strides, _ptr(self.rows))


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
    ):
        """lib: the C library to call (another build, `cpu_build.load_variant`, for tests and
        benchmarks that compare builds); None: the process's (`load_cpu_lib`). final_norm: the
        final norm's stack [n_slots + 1, dim] (`run` then returns the normed output, as the runner's
        _final); head: the base's LM head [vocab, dim] (then `run(logits=True)` returns logits)."""
        if lib is None and not DecodeShape.supported(dtype):
            raise RuntimeError("the C decode layers need the compiled C library (with SIMD)")
        _check(layers, shape, dtype)
        self.layers, self.shape, self.dtype = layers, shape, dtype
        self._lib = lib
        self.n_slots = layers[0].signs[0].shape[0] if layers else 0
        for name, t, rows in (("final_norm", final_norm, self.n_slots + 1), ("head", head, None)):
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
        self.final_norm, self.head = final_norm, head
        self._arr = (_Layer * len(layers))()
        for c, L in zip(self._arr, layers):
            c.w[:] = [_ptr(t) for t in L.weights]
            c.s[:] = [_ptr(t) for t in L.signs]
            c.a[:] = [_ptr(t) for t in L.alpha]
            c.bias[:] = [_ptr(t) for t in L.biases]
            c.norm[:] = [_ptr(t) for t in L.norms]
            c.k, c.v, c.window = L.k.data_ptr(), L.v.data_ptr(), L.window or 0

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
        rows = _as(hp.row_head, torch.int64)
        if tuple(rows.shape) != (B,):  # its values' range: checked in C
            raise ValueError(f"row_head must be [{B}] plane indices in [-1, {len(hp.planes) - 1}]")
        planes = [(s.contiguous(), a.contiguous()) for s, a in hp.planes]
        return _HeadArgs(
            planes,
            rows,
            (ctypes.c_void_p * len(planes))(*[s.data_ptr() for s, _ in planes]),
            (ctypes.c_void_p * len(planes))(*[a.data_ptr() for _, a in planes]),
            (ctypes.c_int64 * len(planes))(*[int(a.shape[0] != 1) for _, a in planes]),
        )

    def run(
        self,
        x: torch.Tensor,
        row_slot: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_rows: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
        logits: bool = False,
        head_planes: HeadPlanes | None = None,
        fuse: bool = False,
        row_planes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every layer for B decode rows -> the last layer's output [B, dim] in the model's dtype,
        normed by each row's final norm if the layers have one; with `logits` (the layers have a
        head) fp32 [B, vocab] = round(h · headᵀ) instead, as `dense_linear(h, head).float()`; with
        `head_planes` too, a row of plane v gets fp32 h · headᵀ + α_v ⊙ (h · S_vᵀ), not rounded, as
        the runner's `_sign_heads` (`dense_linear(h, head, out_fp32=True)`, then
        `bitdelta_delta_batched`), and a row of −1 round(h · headᵀ) as before. `fuse`: a step of B
        rows of one variant (the same slots in every row) of up to `one_pass_planes(B)` planes (4
        and 3 for 1 and 2 rows) sums each projection's planes, and its head's plane, in the weights'
        pass where the library has such a loop (fp32: AVX-512; bf16: AVX512-BF16): other sums than
        the table loop's, so not a row's numbers in a mixed step, though the same as the row's alone
        (the default mode's single-variant form, never the batch-invariant one's); else ignored.

        x: [B, dim] the embedded tokens; row_slot: [B] slot per row (−1: the base; row slot + 1 of
        the norm and bias stacks; the row's one sign plane); row_planes: [B, k] each row's sign-plane
        slots instead (variants of up to k planes, −1 past a variant's own; a base row's all −1),
        their terms summed as `bitdelta_delta_batched` sums a row's planes; cos, sin: [B, head_dim];
        write_rows: [B] the pool rows the new k, v go to; tables: int32 [B, max_blocks], lens: int32
        [B] as `bitdelta_kernels.paged_decode` (lens counts the new token). Pool rows and tables are the caller's (the runner builds them from
        the scheduler's block tables); they must lie inside the pool.
        """
        if logits and self.head is None:
            raise ValueError("logits need the layers' head")
        sh, B = self.shape, x.shape[0]
        heads = self._head_args(head_planes, logits, B)
        hd = sh.head_dim
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != sh.dim:
            raise ValueError(f"x must be {self.dtype} [B, {sh.dim}]")
        if cos.shape != (B, hd) or sin.shape != (B, hd) or row_slot.shape != (B,) or write_rows.shape != (B,):
            raise ValueError(f"cos, sin must be [{B}, {hd}]; row_slot and write_rows [{B}]")
        if tables.dtype != torch.int32 or lens.dtype != torch.int32 or tables.shape[0] != B or lens.shape != (B,):
            raise ValueError(f"tables must be int32 [{B}, max_blocks] and lens int32 [{B}]")
        # each op only where its tensor is not already what the C code reads: after the layers' stream
        # every cache is cold and a torch op costs ~40 µs (the slots' range is checked in C)
        rs, rp = _slots32(row_slot), None if row_planes is None else _slots32(row_planes)
        if rp is not None and (rp.dim() != 2 or rp.shape[0] != B or rp.shape[1] < 1):
            raise ValueError(f"row_planes must be [{B}, k]")
        x32 = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # overwritten in place
        c32, s32, wr = _as(cos, torch.float32), _as(sin, torch.float32), _as(write_rows, torch.int64)
        t, n = _as(tables, torch.int32), _as(lens, torch.int32)
        out = torch.empty(B, self.head.shape[0], dtype=torch.float32) if logits else None
        rc = (self._lib or load_cpu_lib()).bd_decode_layers(
            ctypes.addressof(self._arr),
            len(self.layers),
            self.n_slots,
            x32.data_ptr(),
            B,
            rs.data_ptr(),
            _ptr(rp),
            0 if rp is None else rp.shape[1],
            sh.dim,
            sh.n_heads,
            sh.n_kv_heads,
            hd,
            sh.intermediate,
            sh.norm_eps,
            _DTYPE_CODE[self.dtype],
            c32.data_ptr(),
            s32.data_ptr(),
            wr.data_ptr(),
            t.data_ptr(),
            t.shape[1],
            n.data_ptr(),
            block_size,
            1.0 / math.sqrt(hd),  # as bitdelta_kernels.paged_decode
            _ptr(self.final_norm),
            _ptr(self.head if logits else None),
            0 if out is None else out.shape[1],
            *heads.args,
            _ptr(out),
            torch.get_num_threads(),
            int(fuse),
        )
        if rc == -2:
            raise ValueError(
                f"row_slot and row_planes values must lie in [-1, {self.n_slots - 1}], and a base row (row_slot −1)"
                " has no sign planes"
            )
        if rc == -3:
            raise ValueError(f"row_head must be [{B}] plane indices in [-1, {len(heads.planes) - 1}]")
        if rc != 0:
            raise MemoryError("bd_decode_layers could not allocate its scratch")
        return x32.to(self.dtype) if out is None else out


__all__ = ["DecodeLayer", "DecodeLayers", "DecodeShape", "GROUPS", "HeadPlanes"]
