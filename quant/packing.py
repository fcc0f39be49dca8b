"""Dense bit packing of intN values (N = 1..8) into bytes.

Layout: value i of the flattened tensor is stored as the unsigned offset u = q + 2**(N-1) in bits
[N*i, N*i + N) of a little-endian bit stream, LSB first. For int6 this is exactly "4 values in 3
bytes": byte0 = u0 | u1<<6 (low 2 bits), byte1 = u1>>2 | u2<<4, byte2 = u2>>4 | u3<<2. The stream
is padded with zero bits to a whole number of bytes: ceil(n * N / 8) bytes for n values.
Work is done in groups of 8 values (8*N bits = N bytes) held in one int64 word, so any N <= 7 fits
without touching the sign bit; N = 8 is a plain byte view.
"""

import sys

import torch

QUANT_PACKINGS = ("int8", "bits")  # int8 containers (one value per byte) / dense bit packing


def quant_packed_num_bytes(num_values: int, bits: int) -> int:
    """Bytes that pack_bits uses for num_values values of `bits` bits: ceil(num_values*bits/8)."""
    return (num_values * bits + 7) // 8


def _quant_check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r}: expected an int in 1..8")
    assert sys.byteorder == "little", "packing uses little-endian int64 byte views"


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer values q (any shape, values in [-2**(bits-1), 2**(bits-1)-1]) densely.

    Returns uint8 [quant_packed_num_bytes(q.numel(), bits)] on CPU. ValueError if a value is out
    of range or q is not an integer tensor.
    """
    _quant_check_bits(bits)
    if q.is_floating_point() or q.is_complex() or q.dtype == torch.bool:
        raise ValueError(f"pack_bits: expected an integer tensor, got {q.dtype}")
    offset = 1 << (bits - 1)
    u = q.detach().reshape(-1).to("cpu", torch.int64) + offset
    if u.numel() and (int(u.min()) < 0 or int(u.max()) >= 1 << bits):
        raise ValueError(f"pack_bits: values outside [{-offset}, {offset - 1}] for bits={bits}")
    num_bytes = quant_packed_num_bytes(u.numel(), bits)
    if bits == 8:
        return u.to(torch.uint8)
    pad = (-u.numel()) % 8
    groups = torch.cat([u, u.new_zeros(pad)]).view(-1, 8)
    shifts = torch.arange(8, dtype=torch.int64) * bits
    words = (groups << shifts).sum(dim=1)  # disjoint bit fields: sum == bitwise or
    return words.view(torch.uint8).view(-1, 8)[:, :bits].reshape(-1)[:num_bytes].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, num_values: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [ceil(num_values*bits/8)] -> int8 [num_values] (CPU).

    ValueError if `packed` is not uint8 1-D of exactly that length.
    """
    _quant_check_bits(bits)
    num_bytes = quant_packed_num_bytes(num_values, bits)
    if packed.dtype != torch.uint8 or packed.ndim != 1 or packed.numel() != num_bytes:
        raise ValueError(
            f"unpack_bits: expected uint8 [{num_bytes}] for {num_values} values of {bits} bits, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    offset = 1 << (bits - 1)
    b = packed.detach().to("cpu")
    if bits == 8:
        return (b.to(torch.int16) - offset).to(torch.int8)
    num_groups = (num_values + 7) // 8
    padded = torch.cat([b, b.new_zeros(num_groups * bits - num_bytes)]).view(num_groups, bits)
    words = torch.cat([padded, padded.new_zeros(num_groups, 8 - bits)], dim=1).contiguous().view(torch.int64)
    shifts = torch.arange(8, dtype=torch.int64) * bits
    u = (words >> shifts) & ((1 << bits) - 1)  # [G, 1] >> [8] -> [G, 8]
    return (u.reshape(-1)[:num_values] - offset).to(torch.int8)
