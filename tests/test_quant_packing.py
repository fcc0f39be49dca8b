"""quant/artifact.py pack_bits / unpack_bits: dense intN bit packing is exact for every representable value."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quant.artifact import pack_bits, unpack_bits


def quant_packed_num_bytes(num_values, bits):
    return (num_values * bits + 7) // 8


@st.composite
def _values(draw):
    bits = draw(st.integers(1, 8))
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return bits, draw(st.lists(st.integers(lo, hi), max_size=300))


@settings(max_examples=300, deadline=None)
@given(_values())
def test_pack_unpack_roundtrip(case):
    bits, values = case
    q = torch.tensor(values, dtype=torch.int8)
    packed = pack_bits(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (quant_packed_num_bytes(len(values), bits),)
    assert torch.equal(unpack_bits(packed, bits, len(values)), q)


@pytest.mark.parametrize("bits", range(1, 9))
def test_every_value_at_every_bit_offset(bits):
    """Each representable value, at each of the 8 positions of a packing group, round-trips."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.arange(lo, hi + 1, dtype=torch.int8)
    for offset in range(8):
        q = torch.cat([torch.full((offset,), hi, dtype=torch.int8), values, torch.full((3,), lo, dtype=torch.int8)])
        assert torch.equal(unpack_bits(pack_bits(q, bits), bits, q.numel()), q)
    matrix = values.repeat(91)[: 13 * 7].reshape(13, 7)  # 2-D input packs in row-major order
    assert torch.equal(unpack_bits(pack_bits(matrix, bits), bits, matrix.numel()).reshape(13, 7), matrix)


def test_int6_is_four_values_in_three_bytes():
    q = torch.tensor([1, 2, 3, 4, -32, 31, 0, -1], dtype=torch.int8)
    u = [v + 32 for v in q.tolist()]
    expected = []
    for a, b, c, d in (u[:4], u[4:]):
        word = a | b << 6 | c << 12 | d << 18
        expected += [word & 255, word >> 8 & 255, word >> 16]
    assert pack_bits(q, 6).tolist() == expected
    assert quant_packed_num_bytes(4, 6) == 3 and quant_packed_num_bytes(5, 6) == 4


def test_int8_container_is_the_offset_byte():
    """Packing "int8" stores pack_bits(q, 8): q + 128, i.e. the int8 byte with its top bit flipped."""
    q = torch.tensor([-127, -31, -1, 0, 1, 31, 127], dtype=torch.int8)
    assert pack_bits(q, 8).tolist() == [v + 128 for v in q.tolist()]
    assert torch.equal(pack_bits(q, 8), q.view(torch.uint8) ^ 0x80)
