"""1-bit delta kernels. Public API:

    bitdelta_linear(x, w_base, signs, alpha) -> y
        y = x · W_baseᵀ + α ⊙ (x · Sᵀ)          (fused: W_eff never stored)
    bitdelta_linear(x, w_base, signs [K, d_out, bytes], alpha [K, d_out], *, col_alpha=, col_splits=)
        the K sign planes of one variant; per-column α over a projection group's matrices
    bitdelta_delta_batched(x, signs_stack, alpha_stack, row_slots, y, *, col_alpha=, col_splits=, plan=) -> y
        y[r] += Σ_p α_s ⊙ ((x[r] ⊙ c_s) · S_sᵀ), s = row_slots[r, p] ≥ 0   (mixed batch, one launch)
    lowrank_delta(x, v, us, y, rows=None) -> y
        y[rows] += (x[rows] · Vᵀ) · Uᵀ per matrix of a group   (one variant's low-rank residual, fp32)
    dense_linear(x, w, *, out_fp32=False) -> y   y = x · wᵀ (base rows; the C GEMV at decode on CPU)
    plan_batch(row_slots, n_slots, ...) -> BatchPlan     (build once per step, reuse per layer)
    paged_decode(q, k, v, tables, lens, block_size, window) -> out
        decode attention over a paged KV pool, each sequence's blocks read in place (paged_attention.py)

Triton on CUDA (and in the interpreter under TRITON_INTERPRET=1), compiled C on
CPU, torch references as oracle and fallback. See docs/kernels.md.

The sign packing every layer reads is `bitdelta_kernels.bits`. This package imports nothing else
of the project: the core (`bitdelta`) imports it, never the reverse.
"""

from bitdelta_kernels.dispatch import backend_for, bitdelta_delta_batched, bitdelta_linear, dense_linear
from bitdelta_kernels.lowrank import lowrank_delta
from bitdelta_kernels.merged_cache import MergedWeightCache
from bitdelta_kernels.paged_attention import paged_decode, paged_decode_ref
from bitdelta_kernels.plan import BatchPlan, plan_batch
from bitdelta_kernels.reference import bitdelta_delta_batched_ref, bitdelta_linear_ref

__all__ = [
    "bitdelta_linear",
    "bitdelta_delta_batched",
    "dense_linear",
    "lowrank_delta",
    "plan_batch",
    "BatchPlan",
    "MergedWeightCache",
    "backend_for",
    "bitdelta_linear_ref",
    "bitdelta_delta_batched_ref",
    "paged_decode",
    "paged_decode_ref",
]
