"""1-bit delta kernels. Public API:

    bitdelta_linear(x, w_base, signs, alpha) -> y
    bitdelta_delta_batched(x, signs_stack, alpha_stack, row_variant, y) -> y

(Dispatch to Triton / CPU paths is added by the kernels work; until then the
torch references serve.)
"""

from kernels.reference import bitdelta_delta_batched_ref as bitdelta_delta_batched
from kernels.reference import bitdelta_linear_ref as bitdelta_linear

__all__ = ["bitdelta_linear", "bitdelta_delta_batched"]
