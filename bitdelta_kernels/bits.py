"""The one bit convention of the project (kernels, delta files, the worker's slots).

Column k of a row is bit (k mod 8) of byte (k div 8), least significant bit
first; bit 1 means +1 (Δ ≥ 0, so sign(0) = +1) and bit 0 means −1. This is
`numpy.packbits(delta >= 0, axis=-1, bitorder="little")`.

    signs: uint8 [d_out, ceil(d_in / 8)]
"""

from __future__ import annotations

import torch

_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def packed_cols(d_in: int) -> int:
    """Bytes per row of packed signs for `d_in` columns."""
    return (d_in + 7) // 8


def pack_signs(delta: torch.Tensor) -> torch.Tensor:
    """delta: [d_out, d_in] (any float dtype) -> uint8 [d_out, ceil(d_in/8)]."""
    if delta.dim() != 2:
        raise ValueError(f"pack_signs expects a 2-D tensor, got shape {tuple(delta.shape)}")
    d_out, d_in = delta.shape
    pad = packed_cols(d_in) * 8 - d_in
    bits = (delta >= 0).to(torch.uint8)
    if pad:
        # Padding columns are 0 bits; readers never look at them.
        bits = torch.nn.functional.pad(bits, (0, pad))
    bits = bits.view(d_out, -1, 8)
    return (bits * _BIT_WEIGHTS.to(bits.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(signs: torch.Tensor, d_in: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [d_out, ceil(d_in/8)] -> {−1, +1} [d_out, d_in] in `dtype`."""
    if signs.dtype != torch.uint8 or signs.dim() != 2:
        raise ValueError(f"signs must be a 2-D uint8 tensor, got {signs.dtype} {tuple(signs.shape)}")
    if signs.shape[1] != packed_cols(d_in):
        raise ValueError(f"signs have {signs.shape[1]} bytes per row; d_in={d_in} needs {packed_cols(d_in)}")
    shifts = torch.arange(8, device=signs.device, dtype=torch.uint8)
    bits = (signs.unsqueeze(-1) >> shifts) & 1  # [d_out, n_bytes, 8]
    bits = bits.reshape(signs.shape[0], -1)[:, :d_in]
    return bits.to(dtype) * 2 - 1
