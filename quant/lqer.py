"""LQER: a low-rank correction of the quantization error of the few tensors where it is largest (QUANT_LQER=1).

For each of the QUANT_LQER_TOP_N quantized matrices with the largest squared error
||W - deq(Q(W))||^2 (ties: state-dict order), with E = W - deq(Q(W)) (float64) and r =
min(QUANT_LQER_RANK, R, C):
    U, S, V^T = svd(E);  A^T = sqrt(S[:r]) * U[:, :r]^T  [r, R];  B = sqrt(S[:r]) * V^T[:r]  [r, C]
Each factor is stored as asymmetric int4 in groups of LQER_GROUP = 64 consecutive values of its
row-major flattening (the last group padded with the last value): per group
    low = fp16(min), scale = fp16(clamp((max - low) / 15, 2**-24, 65504)) (quant_fp16_scale),
    q = clamp(round_half_even((x - low) / scale), 0, 15),  x' = q * scale + low   (float32)
and the decoder, like the export, computes the weight as (float32)
    W' = deq(Q(W)) + A'^T' @ B'        (A'^T' = dequantized A^T, transposed: [R, r] @ [r, C])
Stored bytes per factor of n values: G = ceil(n / 64) groups -> 32 G bytes of 4-bit codes (two per
byte, the first in the low nibble) + 2 G float16 scales + 2 G float16 lows. The payload keeps them after every
other piece, in the order of the header's "lqer" list [[name, r], ...] (absent without LQER).
Source: LQER (Zhang et al. 2024, "LQER: Low-Rank Quantization Error Reconstruction for LLMs");
in parameter golf PR #1797 and PR #1855 (rank 4 on the tensors with the largest error, factors
asymmetric int4 in groups of 64).

QUANT_LQER_ASYM=1: PR #1855's own form instead (its `_lqer_pack_asym`), with E and its SVD in float32:
    A = U[:, :r] * S[:r]  [R, r]: signed int2 in [-2, 1] with one scale sA = fp16(max|A| / 1.5);
    B = V^T[:r]  [r, C]: signed int4 in [-8, 7] per group of 64 of its flattening (the last group padded
        with zeros; the record needs r * C divisible by 64), scale fp16(max|group| / 7.5);
    W' = deq(Q(W)) + (qA * sA) @ (qB * sB)   (float32, as its dequantize_mixed)
stored as the A codes + 2, four per byte (the first in the low bits; ceil(R r / 4) bytes), sA (2 bytes),
the B codes + 8, two per byte (32 G bytes), G float16 scales (2 G bytes). The header's policy says which form.

Size note: bundled into the counted train_gpt.py (export and decode call it).
"""

import math

import torch

from primitives.env import BUNDLE_KIND
from primitives.rowquant import dequantize_per_row, quant_fp16_scale

# the packed train_gpt.py holds this module only for runs with QUANT_LQER=1 (kit/bundle_when.py)
PACKED_WHEN = "QUANT_LQER"

LQER_GROUP = 64


def lqer_int4(x: torch.Tensor) -> tuple:
    """Asymmetric int4 of x (any shape, float) in groups of 64 -> (codes uint8 [G, 64] in 0..15,
    scale float16 [G], low float16 [G])."""
    f = x.detach().reshape(-1).float()
    f = torch.cat([f, f[-1:].expand(-f.numel() % LQER_GROUP)]).view(-1, LQER_GROUP)
    low = f.amin(1).half().float()
    s = quant_fp16_scale(((f.amax(1) - low) / 15).clamp(2**-24, 65504))
    return torch.round((f - low[:, None]) / s[:, None]).clamp(0, 15).to(torch.uint8), s.half(), low.half()


def lqer_dequant(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Inverse of lqer_int4 -> float32 tensor of `shape` (codes * scale + low, padding dropped)."""
    x = codes.float() * scale.float()[:, None] + low.float()[:, None]
    return x.reshape(-1)[:math.prod(shape)].view(shape)


def lqer_asym(e: torch.Tensor, r: int) -> tuple:
    """PR #1855's asym factors of the float32 error e [R, C] at rank r -> ((qA int8 [R, r], sA float16 []),
    (qB int8 [G, 64], sB float16 [G])) (module docstring)."""
    u, sv, vh = torch.linalg.svd(e, full_matrices=False)
    a, b = (u[:, :r] * sv[:r]).contiguous(), vh[:r].reshape(-1)
    sa = (a.abs().amax().clamp_min(1e-10) / 1.5).half()
    b = torch.cat([b, b.new_zeros(-b.numel() % LQER_GROUP)]).view(-1, LQER_GROUP)
    sb = (b.abs().amax(1).clamp_min(1e-10) / 7.5).half()
    return ((torch.round(a / sa.float()).clamp(-2, 1).to(torch.int8), sa),
            (torch.round(b / sb.float()[:, None]).clamp(-8, 7).to(torch.int8), sb))


def lqer_correction(factors: tuple, r: int, rows: int, cols: int) -> torch.Tensor:
    """float32 [rows, cols] correction A'^T' @ B' from the int4 factors ((A^T codes, scale, low),
    (B codes, scale, low)) of rank r, or (qA * sA) @ (qB * sB) from lqer_asym's ((qA, sA), (qB, sB))."""
    if len(factors[0]) == 2:  # the asym form
        (qa, sa), (qb, sb) = factors
        return (qa.float() * float(sa)) @ (qb.float() * sb.float()[:, None]).reshape(-1)[:r * cols].view(r, cols)
    a = lqer_dequant(*factors[0], (r, rows))
    return a.T @ lqer_dequant(*factors[1], (r, cols))


def lqer_factors(entries: dict, state_dict: dict, rank: int, top_n: int, asym: bool = False) -> dict:
    """LQER factors of the top_n quantized entries (quantize_state_dict's) by squared error.

    Returns {name: (r, ((A^T codes, scale, low), (B codes, scale, low)))} in state-dict order, or with
    `asym` {name: (r, lqer_asym's factors)} (E in float32, as PR #1855 computes it).
    """
    errs = []
    for i, (name, (shape, bits, q, s, _)) in enumerate(entries.items()):
        if bits:
            e = state_dict[name].detach().cpu().double().reshape(shape[0], -1) - dequantize_per_row(q, s, torch.double)
            errs.append((-float(e.square().sum()), i, name, e))
    out = {}
    for _, _, name, e in sorted(errs, key=lambda x: x[:2])[:top_n]:
        r = min(rank, *e.shape)
        if asym:
            q, sc = entries[name][2:4]
            out[name] = r, lqer_asym(state_dict[name].detach().cpu().float().reshape(e.shape) - dequantize_per_row(q, sc), r)
            continue
        u, sv, vh = torch.linalg.svd(e, full_matrices=False)
        root = sv[:r].sqrt()
        out[name] = r, (lqer_int4(root[:, None] * u[:, :r].T), lqer_int4(root[:, None] * vh[:r]))
    return dict(sorted(out.items(), key=lambda kv: list(entries).index(kv[0])))


def lqer_nbytes(r: int, rows: int, cols: int, asym: bool = False) -> int:
    """Stored bytes of one tensor's two factors (module docstring)."""
    if asym:
        return -(-r * rows // 4) + 2 + 34 * -(-r * cols // LQER_GROUP)
    return sum(36 * -(-r * n // LQER_GROUP) for n in (rows, cols))


def lqer_pack(factors: dict) -> bytes:
    """The payload's LQER piece: per tensor, per factor (A^T, B): 4-bit codes, scales, lows."""
    out = []
    for _, parts in factors.values():
        if len(parts[0]) == 2:  # the asym form
            (qa, sa), (qb, sb) = parts
            a = torch.cat([(qa.reshape(-1) + 2).to(torch.uint8), qa.new_zeros(-qa.numel() % 4, dtype=torch.uint8)])
            a, b = a.view(-1, 4), (qb.reshape(-1, 2) + 8).to(torch.uint8)
            out += [(a[:, 0] | a[:, 1] << 2 | a[:, 2] << 4 | a[:, 3] << 6).numpy().tobytes(), sa.reshape(1).numpy().tobytes(),
                    (b[:, 0] | b[:, 1] << 4).numpy().tobytes(), sb.numpy().tobytes()]
            continue
        for codes, s, low in parts:
            c = codes.reshape(-1, 2)
            out += [(c[:, 0] | c[:, 1] << 4).numpy().tobytes(), s.numpy().tobytes(), low.numpy().tobytes()]
    return b"".join(out)


def lqer_unpack(blob: torch.Tensor, specs: list, shapes: dict, asym: bool = False) -> dict:
    """Inverse of lqer_pack: uint8 blob, header specs [[name, r], ...], name -> 2-D shape, the form ->
    {name: (r, factors)}. ValueError for a spec that does not name a distinct quantized tensor, a
    rank outside 1..min(R, C) or a blob of the wrong size."""
    if BUNDLE_KIND == "package":  # a record's file reads the artifact it just wrote (its CRC checked)
        if len({n for n, _ in specs}) != len(specs) or any(
                n not in shapes or type(r) is not int or not 0 < r <= min(shapes[n]) for n, r in specs):
            raise ValueError(f"lqer entries {specs!r} do not match the quantized tensors")
    sizes, out = [], {}
    for n, r in specs:
        rows, cols = shapes[n]
        g = -(-r * cols // LQER_GROUP)
        sizes += ([-(-r * rows // 4), 2, 32 * g, 2 * g] if asym  # A codes, sA, B codes, B scales
                  else [k * -(-r * m // LQER_GROUP) for m in (rows, cols) for k in (32, 2, 2)])  # codes, scales, lows
    pieces = iter(blob.split(sizes))  # raises unless the blob is exactly these pieces
    for n, r in specs:
        rows = shapes[n][0]
        if asym:
            a, sa, b, sb = (next(pieces) for _ in range(4))
            qa = torch.stack([a >> i & 3 for i in (0, 2, 4, 6)], 1).reshape(-1)[:r * rows].to(torch.int8) - 2
            qb = torch.stack([b & 15, b >> 4], 1).view(-1, LQER_GROUP).to(torch.int8) - 8
            out[n] = r, ((qa.view(rows, r), sa.clone().view(torch.float16)[0]), (qb, sb.clone().view(torch.float16)))
        else:
            parts = []
            for b in (next(pieces) for _ in range(2)):  # A^T, then B: its codes, then its scales and lows
                parts.append((torch.stack([b & 15, b >> 4], 1).view(-1, LQER_GROUP),
                              *(next(pieces).clone().view(torch.float16) for _ in range(2))))
            out[n] = r, tuple(parts)
    return out


def lqer_shapes(head: dict) -> tuple:
    """(name -> 2-D shape (rows, cols) of each quantized tensor, the asym form) of an artifact's header."""
    shapes = {name: (shape[0], math.prod(shape[1:])) for name, shape, kind, _ in head["tensors"] if type(kind) is int}
    return shapes, dict(head.get("policy") or {}).get("lqer_asym") is True


def lqer_piece_bytes(head: dict) -> int:
    """Stored bytes of the LQER piece an artifact's header lists (its "lqer": [[name, r], ...])."""
    shapes, asym = lqer_shapes(head)
    return sum(lqer_nbytes(r, *shapes.get(name, (0, 0)), asym) for name, r in head["lqer"])


def lqer_add_corrections(state_dict: dict, blob: torch.Tensor, head: dict) -> None:
    """Add the LQER piece blob (uint8) an artifact's header lists to the decoded float32 weights of state_dict, in
    place: W' = deq(Q) + A'^T' @ B' (float32 [rows, cols] per listed tensor), as the export evaluated it;
    lqer_unpack's ValueError."""
    shapes, asym = lqer_shapes(head)
    for name, (r, factors) in lqer_unpack(blob, head["lqer"], shapes, asym).items():
        state_dict[name] += lqer_correction(factors, r, *shapes[name]).view(state_dict[name].shape)


def lqer_add_estimate(total: float, param_shapes: dict, policy) -> float:
    """`total` (the size estimate's bytes, quant/estimate.py) plus the factors of the policy's QUANT_LQER_TOP_N
    largest quantized tensors of param_shapes (name -> shape; by size here: the export picks them by error)."""
    quantized = [(math.prod(s), s) for n, s in param_shapes.items() if math.prod(s) and policy.bits_for(n, s)]
    for _, shape in sorted(quantized, key=lambda x: -x[0])[:policy.lqer_top_n]:
        r = min(policy.lqer_rank, shape[0], math.prod(shape[1:]))
        total += lqer_nbytes(r, shape[0], math.prod(shape[1:]), policy.lqer_asym)
    return total
