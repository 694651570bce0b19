"""`quant.pack_codes` / `unpack_codes`: the stored byte layout (code j of a row at bit j * bits of its bytes,
little-endian) and the exact round trip, at every width a store takes and a row length that pads."""

from __future__ import annotations

import pytest
import torch

from gsm_train.quant import code_center, pack_codes, unpack_codes


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [64, 5])
def test_codes_pack_little_endian_and_unpack_exactly(bits: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(bits * dim)
    codes = torch.randint(0, 2**bits, (3, 2, 7, dim), generator=generator)
    levels = codes.double() - code_center(bits)  # the levels `quantize` gives: half-integers
    packed = pack_codes(levels.float(), bits)
    per = 8 // bits
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 7, -(-dim // per))
    for j in range(dim):  # code j at bit (j % per) * bits of byte j // per
        field = (packed[..., j // per].long() >> ((j % per) * bits)) & (2**bits - 1)
        assert torch.equal(field, codes[..., j])
    assert torch.equal(unpack_codes(packed, bits, dim, torch.float64), levels)
