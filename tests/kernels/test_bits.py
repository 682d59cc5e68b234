"""The sign bit convention (bitdelta_kernels/bits.py): packing matches numpy's little-endian packbits, sign(0) = +1,
and a wrong row width is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitdelta_kernels.bits import pack_signs, unpack_signs


@pytest.mark.parametrize("d_in", [8, 13, 64, 257])
def test_pack_matches_numpy_packbits_little(d_in):
    g = torch.Generator().manual_seed(d_in)
    delta = torch.randn(7, d_in, generator=g)
    delta[0, :5] = 0.0  # sign(0) = +1
    ours = pack_signs(delta).numpy()
    ref = np.packbits((delta >= 0).numpy(), axis=-1, bitorder="little")
    assert ours.shape == (7, (d_in + 7) // 8)
    np.testing.assert_array_equal(ours, ref)
    back = unpack_signs(torch.from_numpy(ref), d_in)
    expected = torch.where(delta >= 0, 1.0, -1.0)
    assert torch.equal(back, expected)


def test_unpack_rejects_wrong_width():
    with pytest.raises(ValueError, match="bytes per row"):
        unpack_signs(torch.zeros(2, 3, dtype=torch.uint8), d_in=30)
