"""Public entry points: pick the Triton kernels, the C CPU path or the torch reference.

Backend choice (`backend_for`):
- CUDA tensors: Triton.
- CPU tensors with TRITON_INTERPRET=1 (CI): the same Triton kernels in the
  interpreter, as long as the call is small (M·N·K ≤ the setting `interpret_max_work`); the
  interpreter costs ~1 ms per program × K-step, so a real model layer would take
  seconds. Bigger calls take the CPU path.
- other CPU tensors: the C CPU path (`cpu_ops`), torch if it cannot be built.
`backend=` on a call, else the process's `bitdelta_kernels.settings` (`BITDELTA_KERNEL_BACKEND`),
forces triton|cpu|torch (the worker's --kernel-backend, benchmarks, debugging).
"""

from __future__ import annotations

import torch

from bitdelta_kernels import cpu_ops
from bitdelta_kernels.bits import packed_cols
from bitdelta_kernels.configs import config_for, fit, interpreting, smem_limit
from bitdelta_kernels.plan import BatchPlan, plan_batch
from bitdelta_kernels.reference import bitdelta_delta_batched_ref, bitdelta_linear_ref, col_bounds
from bitdelta_kernels.settings import BACKENDS, current

try:
    from bitdelta_kernels.triton_bgmv import bgmv_launch
    from bitdelta_kernels.triton_linear import bitdelta_linear_triton, uses_fp32_dot
    from bitdelta_kernels.triton_sgmv import sgmv_launch

    HAVE_TRITON = True
    TRITON_ERROR = ""
except ImportError as e:  # CPU-only installs without triton; on CUDA the worker refuses to start (worker.py)
    HAVE_TRITON = False
    TRITON_ERROR = f"{type(e).__name__}: {e}"


def backend_for(device: torch.device, work: int, backend: str | None = None) -> str:
    """'triton' | 'cpu' | 'torch' for a call on `device` doing `work` multiply-adds: `backend`
    when given, else the process's setting; 'auto' chooses by device (above)."""
    settings = current()
    forced = settings.backend if backend is None else backend
    if forced not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}, got {forced!r}")
    if forced != "auto":
        return forced
    if device.type == "cuda":
        return "triton" if HAVE_TRITON else "torch"
    if HAVE_TRITON and interpreting() and work <= settings.interpret_max_work:
        return "triton"
    return "cpu"


def bitdelta_linear(
    x: torch.Tensor,
    w_base: torch.Tensor,
    signs: torch.Tensor,
    alpha: torch.Tensor,
    *,
    col_alpha: torch.Tensor | None = None,
    col_splits: tuple[int, ...] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y = x · W_baseᵀ + Σ_p α_p ⊙ ((x ⊙ c_p) · S_pᵀ), never forming W_base + α·S in memory on GPU.

    x: [..., d_in] fp16/bf16/fp32; w_base: [d_out, d_in]; signs: uint8 [d_out, ceil(d_in/8)]
    (bitdelta_kernels.bits convention) with alpha [d_out] (per row) or [1] (per matrix), or the K planes of
    one variant, signs [K, d_out, ceil(d_in/8)] with alpha [K, d_out] or [K, 1] (the sum of the
    planes' terms, in fp32) -> y: [..., d_out] in x.dtype.
    col_alpha (per-column α): None (c = 1), else [G, d_in] ([K, G, d_in] with K planes): ΔW_p[o, c]
    = α_p[o] · c_p[g(o), c] · S_p[o, c], g(o) the group of output row o among `col_splits` (G row
    counts summing to d_out, the matrices of a projection group in d_out order, q‖k‖v; None: G = 1).
    A matrix of the group with per-row α has c = 1 on its rows; one with per-column α has α = 1
    on its rows and its vector in c. `backend`: see `backend_for`.
    """
    d_out, d_in = w_base.shape
    if x.shape[-1] != d_in:
        raise ValueError(f"x has {x.shape[-1]} features; w_base expects {d_in}")
    planes, alphas, cols, bounds = _check_planes(signs, alpha, col_alpha, col_splits, d_out, d_in, "signs")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    plain = signs.dim() == 2 and cols is None  # one plane of row or matrix α: the kernels of old
    backend = backend_for(x.device, x2.shape[0] * d_out * d_in * planes.shape[0], backend)
    if backend == "triton":
        xw = x2 if x2.dtype == w_base.dtype else x2.to(w_base.dtype)
        if cols is None and x2.shape[0] >= config_for(x.device)["unpack_min_rows"]:  # prefill-sized
            y = _linear_unpacked(xw, w_base, planes, alphas)
        elif plain:
            y = bitdelta_linear_triton(xw, w_base, signs.contiguous(), alpha.reshape(-1))
        else:
            dev_bounds = None if cols is None else _bounds_on(bounds, x.device)
            y = bitdelta_linear_triton(xw, w_base, planes.contiguous(), alphas, col_alpha=cols, bounds=dev_bounds)
        y = y.to(x.dtype)
    elif backend == "cpu":
        if plain:
            y = cpu_ops.bitdelta_linear_cpu(x2, w_base, signs, alpha.reshape(-1))
        else:
            y = cpu_ops.linear_planes_cpu(x2, w_base, planes, alphas, cols, bounds)
    else:
        y = bitdelta_linear_ref(x2, w_base, planes, alphas, cols, col_splits)
    return y.reshape(*lead, d_out)


def _check_planes(
    signs: torch.Tensor,
    alpha: torch.Tensor,
    col_alpha: torch.Tensor | None,
    col_splits: tuple[int, ...] | None,
    d_out: int,
    d_in: int,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """Shapes of signs [d_out, bytes] or [L, d_out, bytes], their α and column α's ->
    (signs [L, d_out, bytes], fp32 α [L, d_out] or [L, 1], fp32 contiguous column α's [L, G, d_in]
    or None, the groups' row bounds)."""
    n_bytes = packed_cols(d_in)
    if signs.dtype != torch.uint8 or signs.dim() not in (2, 3) or tuple(signs.shape[-2:]) != (d_out, n_bytes):
        raise ValueError(
            f"{name} must be uint8 [{d_out}, {n_bytes}] or [K, {d_out}, {n_bytes}], got {signs.dtype} {tuple(signs.shape)}"
        )
    lead = tuple(signs.shape[:-2])
    planes = signs if signs.dim() == 3 else signs[None]
    L = planes.shape[0]
    if not lead:  # one plane: any shape of d_out values or one
        a = alpha.reshape(1, -1)
    else:
        a = alpha.reshape(-1, 1) if alpha.dim() == 1 else alpha  # [V] for a stack: one α per matrix
    if a.dim() != 2 or a.shape[0] != L or a.shape[1] not in (1, d_out):
        what = f"[{d_out}] or [1]" if not lead else f"[{L}, {d_out}] or [{L}, 1]"
        raise ValueError(f"alpha must be {what}, got {tuple(alpha.shape)}")
    bounds = col_bounds(col_splits, d_out)
    cols = None
    if col_alpha is not None:
        G = len(bounds) - 1
        if tuple(col_alpha.shape) != (*lead, G, d_in):
            raise ValueError(
                f"col_alpha must be {[*lead, G, d_in]} (the groups of col_splits), got {tuple(col_alpha.shape)}"
            )
        cols = col_alpha.to(torch.float32).reshape(L, G, d_in).contiguous()
    elif col_splits is not None:
        raise ValueError("col_splits without col_alpha")
    return planes, a.to(torch.float32).reshape(L, -1), cols, bounds


_BOUNDS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _bounds_on(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The groups' row bounds as int32 on `device`, made once per (bounds, device): no copy per call."""
    key = (bounds, device)
    if key not in _BOUNDS:
        _BOUNDS[key] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return _BOUNDS[key]


def dense_linear(
    x: torch.Tensor, w: torch.Tensor, *, out_fp32: bool = False, backend: str | None = None
) -> torch.Tensor:
    """y = x · wᵀ, no delta (a step's base rows, the base's LM head). x: [M, d_in]; w: [d_out, d_in]
    -> [M, d_out] in x.dtype, or fp32 (accumulated and returned in fp32) with `out_fp32`.

    On CPU with the C kernels, decode-sized M runs the C GEMV (`cpu_ops.dense_linear_cpu`:
    the weights read once, bf16 widened in registers); elsewhere torch's GEMM.
    """
    if x.device.type == "cpu" and backend_for(x.device, 0, backend) == "cpu":
        return cpu_ops.dense_linear_cpu(x, w, out_fp32)
    return _mm_f32(x, w) if out_fp32 else x @ w.t()


def _mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · wᵀ accumulated and returned in fp32 (torch's GEMM; cuBLAS reads bf16/fp16 as they are)."""
    global _MM_OUT_DTYPE
    if x.device.type == "cuda" and x.dtype != torch.float32 and _MM_OUT_DTYPE is not False:
        try:  # cuBLAS: bf16 inputs, fp32 output (torch >= 2.8)
            y = torch.mm(x, w.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return y
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE = False  # older torch: upcast instead (slower, same numbers)
    return x.float() @ w.float().t()


_MM_OUT_DTYPE: bool | None = None  # torch.mm(..., out_dtype=) works here (CUDA, torch ≥ 2.8)

# The most bytes of unpacked signs `_add_unpacked` holds at once (rows of S per GEMM).
UNPACK_BLOCK_BYTES = 64 << 20


def _add_unpacked(x: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor, acc: torch.Tensor) -> None:
    """acc += α ⊙ (x · Sᵀ) in fp32 for one plane (signs uint8 [d_out, bytes], α [d_out] or [1]; acc fp32
    [M, d_out]): S unpacked to ±1 in x's dtype (`triton_unpack`) ≤ UNPACK_BLOCK_BYTES of rows at a time,
    each block's product by cuBLAS with fp32 output. Prefill-sized M: the GEMMs run at the tensor
    cores' rate, where the fused kernel and SGMV expand the bits in every tile's inner loop (at M ≥ 512
    the fused kernel took 4.9–8.5× the base's GEMM on an H200, bench/results/2026-12-04-NVIDIA-H200;
    SGMV's tiles of block_m rows each expand the whole matrix's bits, 32 times for 512 rows)."""
    from bitdelta_kernels.triton_unpack import unpack_signs_triton

    d_out, d_in = signs.shape[0], x.shape[1]
    block = max(1, UNPACK_BLOCK_BYTES // max(1, d_in * x.element_size()))
    buf = torch.empty(min(block, d_out), d_in, dtype=x.dtype, device=x.device)
    for r0 in range(0, d_out, block):
        r1 = min(d_out, r0 + block)
        s = unpack_signs_triton(signs[r0:r1], d_in, x.dtype, out=buf[: r1 - r0])
        acc[:, r0:r1] += _mm_f32(x, s) * (alpha if alpha.numel() == 1 else alpha[r0:r1])


def _linear_unpacked(x: torch.Tensor, w_base: torch.Tensor, planes: torch.Tensor, alphas: torch.Tensor) -> torch.Tensor:
    """y = x · W_baseᵀ + Σ_p α_p ⊙ (x · S_pᵀ), `bitdelta_linear` from unpack_min_rows rows on (a
    prefill): the base's GEMM with fp32 output, each plane's term added in fp32 (`_add_unpacked`),
    rounded once to x's dtype, as the fused kernel does. x: [M, d_in] in w_base's dtype; planes: uint8
    [K, d_out, bytes]; alphas: fp32 [K, d_out] or [K, 1]."""
    y = _mm_f32(x, w_base)
    for p in range(planes.shape[0]):
        _add_unpacked(x, planes[p], alphas[p], y)
    return y.to(x.dtype)


def _delta_unpacked(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    slots: tuple[int, ...],
    rows: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """y[rows] += Σ_p α_v ⊙ (x[rows] · S_vᵀ), v = slots[p] ≥ 0: a plan's unpacked slot set (a prefill
    chunk's rows in a mixed batch), the planes' terms summed in fp32 (`_add_unpacked`) and added to y
    once, as SGMV does."""
    xr = x[rows]
    acc = torch.zeros(xr.shape[0], signs_stack.shape[1], dtype=torch.float32, device=x.device)
    for v in slots:
        if v >= 0:
            _add_unpacked(xr, signs_stack[v], alpha_stack[v], acc)
    y[rows] = (y[rows].float() + acc).to(y.dtype)


def bitdelta_delta_batched(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    row_slots: torch.Tensor,
    y: torch.Tensor,
    *,
    col_alpha: torch.Tensor | None = None,
    col_splits: tuple[int, ...] | None = None,
    plan: BatchPlan | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y[r] += Σ_p α_s ⊙ ((x[r] · c_s) · S_sᵀ) over the slots s = row_slots[r, p] ≥ 0; a row with
    no slot is untouched. ONE launch (one C parallel region) per call on every backend.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)] (V slots, one sign plane each);
    alpha_stack: [V, d_out] or [V, 1] (or [V]: one α per matrix); y: [M, d_out], updated in place
    and returned. row_slots: int [M], one slot per row (−1: base only), or [M, P]: row r adds the
    plane of every slot row_slots[r, p] ≥ 0 (−1: nothing), so a k-plane variant occupies k slots of
    the same stacks and rows of different plane counts mix in one batch. The planes' terms are
    summed in fp32, then added to y once (y may be fp32 while x is bf16).
    col_alpha (per-column α): None (c = 1) or [V, G, d_in]: ΔW_s[o, c] = α_s[o] · c_s[g(o), c] ·
    S_s[o, c], g(o) the group of output row o among `col_splits` (G row counts summing to d_out:
    the matrices of a projection group, q‖k‖v or gate‖up; None: G = 1). A matrix with per-row α
    has c = 1 on its rows, one with per-column α has α = 1 on its rows; with col_alpha every
    slot's term is scaled by its c. The base GEMM (y = x · W_baseᵀ) runs once for the whole
    batch outside. On GPU, rows are segmented by slot set (SGMV) when some set has several rows,
    else one row per program (BGMV), and a set of ≥ unpack_min_rows rows (a prefill chunk's) takes its
    planes unpacked to ±1 and cuBLAS GEMMs; `plan` (bitdelta_kernels.plan_batch) lets all layers of a
    step share that grouping. `backend`: see `backend_for`.
    """
    if x.dim() != 2 or y.dim() != 2 or signs_stack.dim() != 3:
        raise ValueError("x [M, d_in], signs_stack [V, d_out, bytes] and y [M, d_out] expected")
    M, d_in = x.shape
    V, d_out, _ = signs_stack.shape
    _, alpha_stack, cols, bounds = _check_planes(
        signs_stack, alpha_stack, col_alpha, col_splits, d_out, d_in, "signs_stack"
    )
    if tuple(y.shape) != (M, d_out) or row_slots.dim() not in (1, 2) or row_slots.shape[0] != M:
        raise ValueError(f"y must be [{M}, {d_out}] and row_slots [{M}] or [{M}, P]")
    P = 1 if row_slots.dim() == 1 else row_slots.shape[1]
    backend = backend_for(x.device, M * d_out * d_in * P, backend)
    if backend == "cpu":
        return cpu_ops.bitdelta_delta_batched_cpu(x, signs_stack, alpha_stack, row_slots, y, cols, bounds)
    if backend == "torch":
        return bitdelta_delta_batched_ref(x, signs_stack, alpha_stack.expand(V, d_out), row_slots, y, cols, col_splits)
    cfg = config_for(x.device)
    if plan is None:
        plan = plan_batch(row_slots, V, x.device, unpack=cols is None)
    elif plan.m != M or plan.planes != P:
        raise ValueError(f"plan was built for {plan.m} rows of {plan.planes} slots, batch has {M} of {P}")
    if plan.unpacked and cols is not None:
        raise ValueError("column α's need a plan without unpacked slot sets (plan_batch(..., unpack=False))")
    for slots, rows in plan.unpacked:
        _delta_unpacked(x, signs_stack, alpha_stack, slots, rows, y)
    if plan.kind == "none":
        return y
    s = signs_stack if signs_stack.stride(2) == 1 else signs_stack.contiguous()
    dev_bounds = None if cols is None else _bounds_on(bounds, x.device)
    kind = plan.kind
    blocks = dict(cfg[kind], BLOCK_M=plan.block_m) if kind == "sgmv" else dict(cfg[kind])
    if x.device.type == "cuda":  # fewer stages if the resource model says these blocks overflow this GPU
        es = 4 if uses_fp32_dot(x.dtype) or cols is not None else x.element_size()
        blocks = fit(kind, blocks, es, smem_limit(cfg, x.device))
    if kind == "bgmv":
        return bgmv_launch(x, s, alpha_stack, plan.row_slots, y, blocks, cols, dev_bounds)
    return sgmv_launch(
        x, s, alpha_stack, y, plan.row_idx, plan.tile_start, plan.tile_end, plan.tile_slots, blocks, cols, dev_bounds
    )
