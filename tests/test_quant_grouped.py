"""quant/grouped.py: the L1 nearest-neighbour row order, the grouped container's round trip and damage."""

import struct
import zlib

import pytest
import torch

import quant.grouped as grouped
from quant.artifact import QUANT_PREFIX, decode_artifact, export_artifact, quant_build_payload, quant_wrap_container
from quant.artifact import quantize_state_dict
from quant.grouped import GROUPED_ID, GROUPED_STREAMS, grouped_compress, grouped_inflate, grouped_order
from quant.policy import QuantPolicy
from tests.test_quant_artifact import CONFIG, QUIET, _state


def reference_order(rows: list) -> list:
    """Greedy nearest neighbour under L1, ties to the lower index, in plain Python."""
    order, left = [0], set(range(1, len(rows)))
    while left:
        cur = rows[order[-1]]
        nxt = min(left, key=lambda j: (sum(abs(a - b) for a, b in zip(cur, rows[j])), j))
        order.append(nxt)
        left.remove(nxt)
    return order


def test_order_matches_the_plain_greedy_walk():
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(120, 136, (40, 16), generator=g, dtype=torch.uint8)
    rows[7] = rows[3]  # a tie: equal rows
    assert grouped_order(rows).tolist() == reference_order(rows.tolist())


def _payload(packing="int8", shuffle=False, lqer=None, seed=1):
    sd = _state(seed=seed)
    policy = QuantPolicy(attn_bits=6, mlp_bits=5, embed_bits=8, fit=False, gptq=False)
    entries, _ = quantize_state_dict(sd, policy)
    return quant_build_payload(entries, CONFIG, policy.to_dict(), packing, shuffle, {"train_seq_len": 64}, lqer)


def _wrap(body: bytes, n: int) -> bytes:
    head = struct.pack("<5sBI", QUANT_PREFIX, GROUPED_ID, n)
    return head + struct.pack("<I", zlib.crc32(body, zlib.crc32(head))) + body


@pytest.mark.parametrize("packing,shuffle", [("int8", False), ("int8", True), ("bits", True)])
def test_grouped_decodes_to_the_same_weights_as_one_stream(packing, shuffle):
    raw = _payload(packing, shuffle)
    body = grouped_compress(raw)
    back, layout = grouped_inflate(body, len(raw))
    assert back == raw
    assert [g[0] for g in layout] == list(GROUPED_STREAMS) and sum(g[2] for g in layout[1:]) == len(raw)
    sorted_pieces = [0] * 7
    for name, _, kind, _ in decode_artifact(quant_wrap_container(raw, "zlib"))[2]["tensors"]:
        if isinstance(kind, int) and packing == "int8":
            sorted_pieces[grouped._grouped_role(name)] += 1
    assert [g[4] for g in layout] == sorted_pieces and sorted_pieces[1] == (packing == "int8") and sum(sorted_pieces) in (0, 11)
    one = decode_artifact(quant_wrap_container(raw, "brotli"))
    sd, config, meta = decode_artifact(quant_wrap_container(raw, "grouped"))
    assert config == CONFIG and meta["compressor"] == "grouped" and meta["groups"] == layout
    assert sd.keys() == one[0].keys() and all(torch.equal(sd[k], one[0][k]) for k in sd)


def test_export_tries_the_grouped_candidates(tmp_path):
    sd = _state(seed=3)
    base = dict(attn_bits=6, mlp_bits=6, fit=False, gptq=False)
    on = export_artifact(sd, CONFIG, tmp_path / "g.ptz", code_bytes=0, policy=QuantPolicy(grouped=True, **base), **QUIET)
    off = export_artifact(sd, CONFIG, tmp_path / "o.ptz", code_bytes=0, policy=QuantPolicy(**base), **QUIET)
    assert on["bytes_model"] <= off["bytes_model"] + len(', "grouped": true')  # the header stores the setting
    a, b = decode_artifact((tmp_path / "g.ptz").read_bytes())[0], decode_artifact((tmp_path / "o.ptz").read_bytes())[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_damaged_grouped_files_are_refused(monkeypatch):
    raw = _payload()
    good = _wrap(grouped_compress(raw), len(raw))
    assert decode_artifact(good)[2]["compressor"] == "grouped"
    body = good[14:]
    cases = {
        "trailing": _wrap(body + b"\0", len(raw)),
        "length": _wrap(body, len(raw) + 1),
        "streams": _wrap(bytes([3]) + body[1:], len(raw)),
        "truncated": _wrap(body[:-5], len(raw)),
    }
    monkeypatch.setattr(grouped, "grouped_order", lambda rows: torch.zeros(len(rows), dtype=torch.long))
    cases["permutation"] = _wrap(grouped_compress(raw), len(raw))
    for label, blob in cases.items():
        with pytest.raises(ValueError, match="^artifact: "):
            decode_artifact(blob, "artifact")
            pytest.fail(f"{label}: decoded")
    with pytest.raises(ValueError, match="checksum"):
        decode_artifact(good[:20] + bytes([good[20] ^ 1]) + good[21:])
