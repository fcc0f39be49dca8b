"""Grouped container (QUANT_GROUPED=1, compressor id 5): the payload's pieces bucketed by role, the
rows of each int8 matrix sorted by similarity, every bucket compressed on its own by its best coder.

The decoded payload is byte for byte the single-stream payload (quant/artifact.py), so everything
after inflating is unchanged. Encoding: the payload is cut into its pieces (read from its own JSON
header): the q values of each quantized tensor, the scales, the passthrough tensors, the LQER
factors, the JSON header. Each piece goes to one stream by role: q of embedding / attention / MLP /
other matrices, scales + float tensors + LQER, header. The rows of an int8-packed q piece (packing
"int8": one byte per value) with 2..GROUPED_MAX_SORT_ROWS rows are reordered by a greedy
nearest-neighbour walk under L1 distance (start at row 0; next = the closest unvisited row, ties
to the lower index), so similar rows sit next to each other for the coder's match finder; the
permutation is stored as uint16. Each stream is compressed by zstd (22), LZMA (9 extreme, "alone")
and brotli (11, window 2**24), and stored raw if none is smaller; the smallest wins (ties: that
order). Byte-shuffle (PR #1218) is the payload's own "shuffle" flag (both are tried by the export).
Source: grouped serialization of PR #1855 (role buckets, L1-sorted rows, lrzip per group); PR #1218
(byte-shuffle). The python coders stand in for lrzip (an external binary).

Layout of the compressed section (after the 14-byte container header, little-endian):
    uint8 S = len(GROUPED_STREAMS); S x (uint8 coder: 0 stored, 2 zstd, 3 lzma, 4 brotli,
    uint32 raw length, uint32 compressed length); then the S compressed streams in order.
    Stream 0 (index): per payload piece in payload order: uint8 stream id (1..S-1), uint32 bytes,
    uint32 rows (0: kept in order; else the piece is `rows` rows, stored permuted, followed in the
    index by the permutation, uint16 [rows]: stored row i is payload row perm[i]).
Decoding inflates each stream capped at its declared length (the raw lengths must add up to the
payload length L, the index at most 2 L + 4096), checks every permutation and that every byte is
used exactly once; anything else is a ValueError (quant/artifact.py names the file). These checks run in the
package: a record's packed train_gpt.py reads the artifact it has just written, after its CRC check.

Size note: bundled into the counted train_gpt.py (the decoder needs it).
"""

import json
import math
import struct

import torch

from primitives.env import BUNDLE_KIND
from quant.policy import quant_compress, quant_inflate

# the packed train_gpt.py holds this module only for runs with QUANT_GROUPED=1 (kit/bundle_when.py)
PACKED_WHEN = "QUANT_GROUPED"

GROUPED_ID = 5
GROUPED_STREAMS = ("index", "q_embed", "q_attn", "q_mlp", "q_other", "float", "header")
GROUPED_MAX_SORT_ROWS = 4096
GROUPED_CODERS = {0: "stored", 2: "zstd", 3: "lzma", 4: "brotli"}


def _grouped_role(name: str) -> int:
    return 1 if "emb" in name or "lm_head" in name else 2 if ".attn." in name else 3 if ".mlp." in name else 4


def grouped_order(rows: torch.Tensor) -> torch.Tensor:
    """Greedy nearest-neighbour row order of uint8 rows [R, C] under L1 distance -> int64 [R]."""
    x = rows.float()
    d = torch.cdist(x, x, p=1)  # exact: integer sums below 2**24
    d[:, 0], order = math.inf, [0]
    for _ in range(len(x) - 1):
        nxt = int(d[order[-1]].argmin())  # the first minimum: ties to the lower index
        d[:, nxt] = math.inf
        order.append(nxt)
    return torch.tensor(order)


def _grouped_pieces(raw: bytes) -> list:
    """(stream id, bytes, rows) of each piece of a payload, in payload order."""
    k = int.from_bytes(raw[-4:], "little")
    head = json.loads(raw[-4 - k:-4])
    tensors, int8 = head["tensors"], head["packing"] == "int8"
    out = [(_grouped_role(n), -(-math.prod(s) * (8 if int8 else kind) // 8), s[0] if int8 and len(s) > 1 else 0)
           for n, s, kind, _ in tensors if type(kind) is int]
    out += [(5, s[0] * 2 if type(kind) is int else math.prod(s) * getattr(torch, kind).itemsize, 0)
            for _, s, kind, _ in tensors]
    rest = len(raw) - 4 - k - sum(p[1] for p in out)  # the LQER factors, if any
    return out + [(5, rest, 0)] * (rest > 0) + [(6, k + 4, 0)]


def grouped_compress(raw: bytes) -> bytes:
    """The compressed section of a grouped container for payload `raw` (module docstring)."""
    streams, index, pos = [bytearray() for _ in GROUPED_STREAMS], bytearray(), 0
    for sid, nbytes, rows in _grouped_pieces(raw):
        piece = raw[pos:pos + nbytes]
        pos += nbytes
        rows = rows if 1 < rows <= GROUPED_MAX_SORT_ROWS else 0
        index += struct.pack("<BII", sid, nbytes, rows)
        if rows:
            t = torch.frombuffer(bytearray(piece), dtype=torch.uint8).view(rows, -1)
            perm = grouped_order(t)
            index += perm.to(torch.int32).numpy().astype("<u2").tobytes()
            piece = t[perm].numpy().tobytes()
        streams[sid] += piece
    streams[0] = index
    table, blobs = bytearray([len(streams)]), []
    for s in streams:
        s = bytes(s)
        coder, blob = min(((c, quant_compress(s, c)) for c in (2, 3, 4, 0)), key=lambda cb: len(cb[1]))
        table += struct.pack("<BII", coder, len(s), len(blob))
        blobs.append(blob)
    return bytes(table) + b"".join(blobs)


def grouped_inflate(data: bytes, n: int) -> tuple:
    """Inverse of grouped_compress -> (payload bytes [n], layout: [[stream, coder, raw bytes,
    compressed bytes, sorted pieces], ...]; None in a record's packed file). ValueError for anything that does
    not fit."""
    count = data[0]
    # the container's checks are the package's: a record's file reads what it just wrote (its CRC checked)
    if BUNDLE_KIND == "package":
        if count != len(GROUPED_STREAMS):
            raise ValueError(f"grouped container with {count} streams, expected {len(GROUPED_STREAMS)}")
    table = [struct.unpack_from("<BII", data, 1 + 9 * i) for i in range(count)]
    if BUNDLE_KIND == "package":
        if sum(t[1] for t in table[1:]) != n or table[0][1] > 2 * n + 4096 or any(t[0] not in GROUPED_CODERS
                                                                                  for t in table):
            raise ValueError(f"grouped stream table {table} does not describe a {n}-byte payload")
    pos, streams = 1 + 9 * count, []
    for coder, size, csize in table:
        streams.append(quant_inflate(data[pos:pos + csize], coder, size))
        pos += csize
        if BUNDLE_KIND == "package":  # the container's checks: a record's file reads what it just wrote (its CRC checked)
            if len(streams[-1]) != size:
                raise ValueError(f"a {GROUPED_CODERS[coder]} stream inflates to {len(streams[-1])} bytes, not {size}")
    if BUNDLE_KIND == "package":
        if pos != len(data):
            raise ValueError(f"grouped container has {len(data) - pos} trailing bytes")
    index, at, cursors, out, sorted_count = streams[0], 0, [0] * count, [], [0] * count
    while at < len(index):
        sid, nbytes, rows = struct.unpack_from("<BII", index, at)
        at += 9
        if BUNDLE_KIND == "package":
            if not 0 < sid < count or cursors[sid] + nbytes > len(streams[sid]):
                raise ValueError(f"grouped index entry ({sid}, {nbytes}) outside its stream")
        piece = streams[sid][cursors[sid]:cursors[sid] + nbytes]
        cursors[sid] += nbytes
        if rows:
            perm = torch.frombuffer(bytearray(index[at:at + 2 * rows]), dtype=torch.int16).long() & 0xFFFF
            at += 2 * rows
            if BUNDLE_KIND == "package":
                if len(perm) != rows or nbytes % rows or not torch.equal(perm.sort().values, torch.arange(rows)):
                    raise ValueError(f"grouped index: a bad row permutation for a {nbytes}-byte piece")
            t = torch.frombuffer(bytearray(piece), dtype=torch.uint8).view(rows, -1)
            piece = t[perm.argsort()].numpy().tobytes()
            if BUNDLE_KIND == "package":  # the layout the kit's readers show
                sorted_count[sid] += 1
        out.append(piece)
    if BUNDLE_KIND == "package":
        if cursors[1:] != [len(s) for s in streams[1:]]:
            raise ValueError("grouped streams hold bytes no index entry uses")
    layout = None  # (a record's file reads the weights only)
    if BUNDLE_KIND == "package":
        layout = [[name, GROUPED_CODERS[c], size, csize, k]
                  for name, (c, size, csize), k in zip(GROUPED_STREAMS, table, sorted_count)]
    return b"".join(out), layout
