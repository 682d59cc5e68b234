"""Public entry points: pick the Triton kernels, the C CPU path or the torch reference.

Backend choice (`backend_for`):
- CUDA tensors: Triton.
- CPU tensors with TRITON_INTERPRET=1 (CI): the same Triton kernels in the
  interpreter, as long as the call is small (M·N·K ≤ the setting `interpret_max_work`); the
  interpreter costs ~1 ms per program × K-step, so a real model layer would take
  seconds. Bigger calls take the CPU path.
- other CPU tensors: the C CPU path (`cpu_ops`), torch if it cannot be built.
`backend=` on a call, else the process's `kernels.settings` (`BITDELTA_KERNEL_BACKEND`),
forces triton|cpu|torch (the worker's --kernel-backend, benchmarks, debugging).
"""

from __future__ import annotations

import torch

from kernels import cpu_ops
from kernels.bits import packed_cols
from kernels.configs import config_for, fit, interpreting, smem_limit
from kernels.plan import BatchPlan, plan_batch
from kernels.reference import bitdelta_delta_batched_ref, bitdelta_linear_ref
from kernels.settings import BACKENDS, current

try:
    from kernels.triton_bgmv import bgmv_launch
    from kernels.triton_linear import bitdelta_linear_triton, uses_fp32_dot
    from kernels.triton_sgmv import sgmv_launch

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
    x: torch.Tensor, w_base: torch.Tensor, signs: torch.Tensor, alpha: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """y = x · W_baseᵀ + α ⊙ (x · Sᵀ), never forming W_base + α·S in memory on GPU.

    x: [..., d_in] fp16/bf16/fp32; w_base: [d_out, d_in]; signs: uint8 [d_out, ceil(d_in/8)]
    (kernels.bits convention); alpha: [d_out] (per row) or [1] (per matrix)
    -> y: [..., d_out] in x.dtype. `backend`: see `backend_for`.
    """
    d_out, d_in = w_base.shape
    if x.shape[-1] != d_in:
        raise ValueError(f"x has {x.shape[-1]} features; w_base expects {d_in}")
    if signs.dtype != torch.uint8 or tuple(signs.shape) != (d_out, packed_cols(d_in)):
        raise ValueError(f"signs must be uint8 [{d_out}, {packed_cols(d_in)}], got {signs.dtype} {tuple(signs.shape)}")
    alpha = alpha.reshape(-1)
    if alpha.numel() not in (1, d_out):
        raise ValueError(f"alpha must have {d_out} values or 1, got {alpha.numel()}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d_in)
    backend = backend_for(x.device, x2.shape[0] * d_out * d_in, backend)
    if backend == "triton":
        xw = x2 if x2.dtype == w_base.dtype else x2.to(w_base.dtype)
        y = bitdelta_linear_triton(xw, w_base, signs.contiguous(), alpha).to(x.dtype)
    elif backend == "cpu":
        y = cpu_ops.bitdelta_linear_cpu(x2, w_base, signs, alpha)
    else:
        y = bitdelta_linear_ref(x2, w_base, signs, alpha)
    return y.reshape(*lead, d_out)


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
    if not out_fp32:
        return x @ w.t()
    global _MM_OUT_DTYPE
    if x.device.type == "cuda" and _MM_OUT_DTYPE is not False:
        try:  # cuBLAS: bf16 inputs, fp32 output (torch >= 2.8)
            y = torch.mm(x, w.t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE = True
            return y
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE = False  # older torch: upcast instead (slower, same numbers)
    return x.float() @ w.float().t()


_MM_OUT_DTYPE: bool | None = None  # torch.mm(..., out_dtype=) works here (CUDA, torch ≥ 2.8)


def bitdelta_delta_batched(
    x: torch.Tensor,
    signs_stack: torch.Tensor,
    alpha_stack: torch.Tensor,
    row_variant: torch.Tensor,
    y: torch.Tensor,
    *,
    plan: BatchPlan | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """y[r] += α_v ⊙ (x[r] · S_vᵀ) for v = row_variant[r] ≥ 0; rows with −1 are untouched.

    x: [M, d_in]; signs_stack: uint8 [V, d_out, ceil(d_in/8)]; alpha_stack: [V, d_out] or [V, 1]
    (or [V]: one α per matrix); row_variant: int [M]; y: [M, d_out], updated in place and returned.
    The base GEMM (y = x · W_baseᵀ) runs once for the whole batch outside. On GPU, rows are
    segmented by variant (SGMV) when some variant has several rows, else one row per program
    (BGMV); `plan` (kernels.plan_batch) lets all layers of a step share that grouping.
    `backend`: see `backend_for`.
    """
    if x.dim() != 2 or y.dim() != 2 or signs_stack.dim() != 3:
        raise ValueError("x [M, d_in], signs_stack [V, d_out, bytes] and y [M, d_out] expected")
    M, d_in = x.shape
    V, d_out, n_bytes = signs_stack.shape
    if signs_stack.dtype != torch.uint8 or n_bytes != packed_cols(d_in):
        raise ValueError(f"signs_stack must be uint8 [V, d_out, {packed_cols(d_in)}], got {tuple(signs_stack.shape)}")
    if alpha_stack.dim() == 1:
        alpha_stack = alpha_stack.reshape(-1, 1)
    if alpha_stack.shape[0] != V or alpha_stack.shape[1] not in (1, d_out):
        raise ValueError(f"alpha_stack must be [{V}, {d_out}] or [{V}, 1], got {tuple(alpha_stack.shape)}")
    if tuple(y.shape) != (M, d_out) or row_variant.shape != (M,):
        raise ValueError(f"y must be [{M}, {d_out}] and row_variant [{M}]")
    backend = backend_for(x.device, M * d_out * d_in, backend)
    if backend == "cpu":
        return cpu_ops.bitdelta_delta_batched_cpu(x, signs_stack, alpha_stack, row_variant, y)
    if backend == "torch":
        return bitdelta_delta_batched_ref(x, signs_stack, alpha_stack.expand(V, d_out), row_variant, y)
    cfg = config_for(x.device)
    if plan is None:
        plan = plan_batch(row_variant, V, x.device)
    elif plan.m != M:
        raise ValueError(f"plan was built for {plan.m} rows, batch has {M}")
    if plan.kind == "none":
        return y
    s = signs_stack if signs_stack.stride(2) == 1 else signs_stack.contiguous()
    a = alpha_stack.to(torch.float32)
    kind = plan.kind
    blocks = dict(cfg[kind], BLOCK_M=plan.block_m) if kind == "sgmv" else dict(cfg[kind])
    if x.device.type == "cuda":  # fewer stages if the resource model says these blocks overflow this GPU
        blocks = fit(kind, blocks, 4 if uses_fp32_dot(x.dtype) else x.element_size(), smem_limit(cfg, x.device))
    if kind == "bgmv":
        return bgmv_launch(x, s, a, plan.row_variant, y, blocks)
    return sgmv_launch(x, s, a, y, plan.row_idx, plan.tile_start, plan.tile_end, plan.tile_variant, blocks)
