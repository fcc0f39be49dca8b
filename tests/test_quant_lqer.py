"""quant/lqer.py: int4 factors against a per-group loop, the SVD correction, export round trip, damage."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from quant.artifact import decode_artifact, export_artifact, quant_build_payload, quant_wrap_container, quantize_state_dict
from primitives.rowquant import dequantize_per_row, quantize_per_row
from quant.lqer import LQER_GROUP, lqer_correction, lqer_dequant, lqer_factors, lqer_int4, lqer_nbytes, lqer_pack
from quant.policy import QuantPolicy
from quant.sdclip import sdclip_k_for
from tests.test_quant_artifact import CONFIG, QUIET, _state


def reference_int4(x: torch.Tensor) -> tuple:
    """Asymmetric int4 in groups of 64, one group at a time with numpy scalars."""
    f = x.reshape(-1).tolist()
    f += [f[-1]] * (-len(f) % LQER_GROUP)
    codes, scales, lows = [], [], []
    for i in range(0, len(f), LQER_GROUP):
        g = np.array(f[i:i + LQER_GROUP], dtype=np.float32)
        low = np.float32(np.float16(g.min()))
        s = np.float32(np.float16(min(max((g.max() - low) / np.float32(15), 2.0**-24), 65504.0)))
        codes.append([int(min(max(np.round((v - low) / s), 0), 15)) for v in g])
        scales.append(s)
        lows.append(low)
    return (torch.tensor(codes, dtype=torch.uint8), torch.tensor(np.array(scales, np.float16)),
            torch.tensor(np.array(lows, np.float16)))


@pytest.mark.parametrize("shape", [(4, 64), (3, 100), (1, 7)])
def test_int4_matches_the_per_group_loop(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.3
    got, ref = lqer_int4(x), reference_int4(x)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    back = lqer_dequant(*got, shape)
    assert back.shape == shape and (back - x).abs().max() <= got[1].float().max() / 2 + 1e-7


def test_factors_approximate_the_rank_r_error_and_pick_the_largest_errors():
    sd = _state(seed=7)
    sd["blocks.1.mlp.proj.weight"] = sd["blocks.1.mlp.proj.weight"] * 40  # the largest quantization error
    policy = QuantPolicy(attn_bits=4, mlp_bits=4, embed_bits=6, fit=False, gptq=False)
    entries, _ = quantize_state_dict(sd, policy)
    errs = {n: float((sd[n].reshape(e[0][0], -1) - dequantize_per_row(e[2], e[3])).square().sum())
            for n, e in entries.items() if e[1]}
    factors = lqer_factors(entries, sd, 4, 2)
    assert list(factors) == [n for n in entries if n in sorted(errs, key=errs.get)[-2:]]
    assert "blocks.1.mlp.proj.weight" in factors
    for name, (r, parts) in factors.items():
        e = (sd[name].double().reshape(entries[name][0][0], -1) - dequantize_per_row(entries[name][2], entries[name][3],
                                                                                   torch.double)).numpy()
        u, s, vt = np.linalg.svd(e, full_matrices=False)
        e_r = (u[:, :r] * s[:r]) @ vt[:r]  # the best rank-r approximation (Eckart-Young)
        corr = lqer_correction(parts, r, *e.shape).double().numpy()
        assert r == 4 and np.linalg.norm(corr - e_r) < 0.25 * np.linalg.norm(e_r)  # int4: ~15%
        assert np.linalg.norm(e - corr) < np.linalg.norm(e)  # the correction lowers the error
    assert len(lqer_pack(factors)) == sum(lqer_nbytes(r, entries[n][0][0], entries[n][2].shape[1])
                                          for n, (r, _) in factors.items())


def test_export_with_lqer_decodes_to_what_was_evaluated(tmp_path):
    sd = _state(seed=2)
    policy = QuantPolicy(lqer=True, lqer_rank=3, lqer_top_n=2, attn_bits=5, mlp_bits=5, embed_bits=6, fit=False,
                         gptq=False)
    sizes = {}
    for lq in (False, True):
        p = QuantPolicy(**{**policy.__dict__, "lqer": lq, "compressor": "brotli"})
        sizes[lq] = export_artifact(sd, CONFIG, tmp_path / f"{lq}.ptz", code_bytes=0, policy=p,
                                    **QUIET)["bytes_model"]
    got, _, meta = decode_artifact((tmp_path / "True.ptz").read_bytes())
    entries, _ = quantize_state_dict(sd, policy)
    factors = lqer_factors(entries, sd, 3, 2)
    assert meta["lqer"] == [[n, 3] for n in factors] and len(factors) == 2
    for name, (shape, bits, q, s, _) in entries.items():
        want = dequantize_per_row(q, s) if bits else None
        if name in factors:
            want = want + lqer_correction(factors[name][1], 3, *q.shape)
            plain = dequantize_per_row(q, s)
            w = sd[name].reshape(q.shape)
            assert (got[name].view(q.shape) - w).square().sum() < (plain - w).square().sum()
        if bits:
            assert torch.equal(got[name], want.view(shape)), name
    assert sizes[True] > sizes[False]  # the factors cost bytes


def test_damaged_lqer_entries_are_refused():
    sd = _state(seed=4)
    policy = QuantPolicy(lqer=True, attn_bits=5, mlp_bits=5, fit=False, gptq=False)
    entries, _ = quantize_state_dict(sd, policy)
    factors = lqer_factors(entries, sd, 4, 2)
    name = next(iter(factors))
    wrong_rank = {name: (3, factors[name][1])}
    not_quantized = {"skip_weights": factors[name]}
    for bad in (wrong_rank, not_quantized):
        raw = quant_build_payload(entries, CONFIG, policy.to_dict(), "int8", False, None, bad)
        with pytest.raises(ValueError, match="^artifact: "):
            decode_artifact(quant_wrap_container(raw, "zlib"))
    good = quant_wrap_container(quant_build_payload(entries, CONFIG, policy.to_dict(), "int8", False, None, factors), "zlib")
    assert decode_artifact(good)[2]["lqer"] == [[n, 4] for n in factors]
    with pytest.raises(ValueError, match="checksum"):
        decode_artifact(good[:-100] + bytes(100))


def test_inspect_shows_k_lqer_ranks_and_groups(tmp_path):
    from quant.__main__ import _inspect

    policy = QuantPolicy(sdclip=True, sdclip_k_mlp=10.5, lqer=True, lqer_top_n=2, grouped=True, compressor="zlib",
                         attn_bits=6, mlp_bits=6, fit=False, gptq=False)
    export_artifact(_state(), CONFIG, tmp_path / "a.ptz", code_bytes=0, policy=policy, **QUIET)
    lines = []
    assert _inspect(str(tmp_path / "a.ptz"), lines.append) == 0
    text = "\n".join(lines)
    assert "sdclip: k attn=13 mlp=10.5 embed=15 other=12.85" in text
    assert text.count("+lqer r4") == 2 and text.count("(lqer)") == 2
    assert "group q_mlp" in text and "rows sorted in 4 tensors" in text
    raw = int(text.split("raw payload: ")[1].split(" bytes")[0].replace(",", ""))
    meta = decode_artifact((tmp_path / "a.ptz").read_bytes())[2]
    assert raw == sum(g[2] for g in meta["groups"][1:])  # rows + LQER + header add up to the payload


def test_asym_form_round_trips_and_counts_its_bytes(tmp_path):
    # QUANT_LQER_ASYM=1: PR #1855's form (A = U S int2 with one scale, B = V^T signed int4 per 64)
    sd = _state(seed=5)
    policy = QuantPolicy(lqer=True, lqer_asym=True, lqer_rank=4, lqer_top_n=2, attn_bits=5, mlp_bits=5, embed_bits=6,
                         fit=False, gptq=False)
    entries, _ = quantize_state_dict(sd, policy)
    factors = lqer_factors(entries, sd, 4, 2, asym=True)
    assert len(lqer_pack(factors)) == sum(lqer_nbytes(r, *entries[n][2].shape, asym=True) for n, (r, _) in factors.items())
    for name, (r, ((qa, sa), (qb, sb))) in factors.items():
        assert qa.shape == (entries[name][2].shape[0], r) and int(qa.min()) >= -2 and int(qa.max()) <= 1
        assert int(qb.min()) >= -8 and int(qb.max()) <= 7 and sa.dtype == sb.dtype == torch.float16
    export_artifact(sd, CONFIG, tmp_path / "a.ptz", code_bytes=0, policy=replace(policy, compressor="zlib"), **QUIET)
    got, _, meta = decode_artifact((tmp_path / "a.ptz").read_bytes())
    assert meta["policy"]["lqer_asym"] is True and meta["lqer"] == [[n, 4] for n in factors]
    for name, (shape, _, q, s, _) in entries.items():
        if name in factors:
            plain, w = dequantize_per_row(q, s), sd[name].reshape(q.shape)
            want = plain + lqer_correction(factors[name][1], 4, *q.shape)
            assert torch.equal(got[name], want.view(shape)), name
            assert (want - w).square().sum() < (plain - w).square().sum()


def test_gate_int8_rows_round_trip_and_stay_out_of_the_fit(tmp_path):
    # QUANT_GATE_INT8=1: PR #1855's int8 rows (max |row| / 127) for attention gates of 32..8192 values
    sd = dict(_state(seed=6), **{"blocks.0.attn.attn_gate_w": torch.randn(8, 12) * 0.3,
                                 "blocks.1.attn.attn_gate_w": torch.randn(2, 12) * 0.3})
    policy = QuantPolicy(gate_int8=True, sdclip=True, gptq=False)
    assert policy.bits_for("blocks.0.attn.attn_gate_w", (8, 12)) == 8 and policy.bits_for("blocks.1.attn.attn_gate_w", (2, 12)) is None
    assert not policy.fittable("blocks.0.attn.attn_gate_w", (8, 12)) and sdclip_k_for(policy, "blocks.0.attn.attn_gate_w", (8, 12)) == 0
    assert QuantPolicy().bits_for("blocks.0.attn.attn_gate_w", (8, 12)) is None  # off: float passthrough, as before
    export_artifact(sd, CONFIG, tmp_path / "g.ptz", code_bytes=0, policy=replace(policy, compressor="zlib"), **QUIET)
    got, _, _ = decode_artifact((tmp_path / "g.ptz").read_bytes())
    q, s = quantize_per_row(sd["blocks.0.attn.attn_gate_w"], 8)
    assert torch.equal(got["blocks.0.attn.attn_gate_w"], dequantize_per_row(q, s))
    assert torch.equal(got["blocks.1.attn.attn_gate_w"], sd["blocks.1.attn.attn_gate_w"].half().float())
