"""quant/sdclip.py: SDClip against a plain per-row loop, its k per group, the export round trip."""

import dataclasses
import statistics

import numpy as np
import pytest
import torch

from quant.artifact import decode_artifact, export_artifact, quantize_state_dict
from primitives.rowquant import dequantize_per_row
from quant.gptq import gptq_quantize
from quant.policy import QuantPolicy
from quant.sdclip import sdclip_k_for, sdclip_quantize, sdclip_scale
from tests.test_quant_artifact import CONFIG, QUIET, _state


def reference_sdclip(w: torch.Tensor, bits: int, k: float) -> tuple:
    """The rule of quant/sdclip.py, one row at a time in Python / numpy scalars."""
    m, qs, ss = 2 ** (bits - 1) - 1, [], []
    for row in w.tolist():
        std = statistics.stdev(row)
        s = np.float16(min(max(k * std / m, 2.0**-24), 65504.0))  # nearest float16 (normal range)
        ss.append(float(s))
        qs.append([int(min(max(np.round(np.float32(x) / np.float32(s)), -m), m)) for x in row])
    return torch.tensor(qs, dtype=torch.int8), torch.tensor(ss, dtype=torch.float16)


@pytest.mark.parametrize("bits,k", [(6, 12.85), (7, 15.0), (5, 11.5), (8, 20.0)])
def test_sdclip_matches_the_per_row_loop(bits, k):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(24, 96, generator=g) * torch.rand(24, 1, generator=g) * 0.1
    w[3, 5] = 1.5  # an outlier
    q, s, c = sdclip_quantize(w, bits, k)
    q_ref, s_ref = reference_sdclip(w, bits, k)
    assert c == k and q.dtype == torch.int8 and s.dtype == torch.float16
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)
    q2, _, _ = sdclip_quantize(w, bits, 2.0)  # k = 2: the outlier lies beyond k * std and saturates
    assert int(q2[3, 5]) == 2 ** (bits - 1) - 1 and int(q[3, 5]) < 2 ** (bits - 1) - 1


def test_sdclip_bad_arguments_raise():
    with pytest.raises(ValueError, match="k="):
        sdclip_scale(torch.randn(2, 4), 6, 0.0)
    with pytest.raises(ValueError, match="bits="):
        sdclip_scale(torch.randn(2, 4), 9, 12.0)
    with pytest.raises(ValueError, match="QUANT_SDCLIP_K_MLP"):
        QuantPolicy.from_env({"QUANT_SDCLIP_K_MLP": "-1"})


def test_k_per_group_and_env():
    p = QuantPolicy.from_env({"QUANT_SDCLIP": "1", "QUANT_SDCLIP_K_ATTN": "9", "QUANT_SDCLIP_K_MLP": "8",
                              "QUANT_SDCLIP_K_EMBED": "17", "QUANT_SDCLIP_K_OTHER": "10"})
    assert p.sdclip
    assert sdclip_k_for(p, "blocks.0.attn.c_q.weight", (8, 8)) == 9
    assert sdclip_k_for(p, "blocks.0.mlp.fc.weight", (8, 8)) == 8
    assert sdclip_k_for(p, "tok_emb.weight", (8, 8)) == 17
    assert sdclip_k_for(p, "bigram.proj.weight", (8, 8)) == 10
    assert sdclip_k_for(QuantPolicy(sdclip_k_attn=9), "blocks.0.attn.c_q.weight", (8, 8)) == 0  # QUANT_SDCLIP=0: clip search
    # defaults: the records' numbers; a default policy's dict has no SDClip keys (old artifacts keep their bytes)
    d = QuantPolicy()
    assert (d.sdclip, d.sdclip_k_attn, d.sdclip_k_mlp, d.sdclip_k_embed, d.sdclip_k_other) == (False, 13.0, 11.5, 15.0, 12.85)
    assert not any(k.startswith(("sdclip", "lqer", "grouped")) for k in d.to_dict())
    assert p.to_dict()["sdclip_k_attn"] == 9


def test_export_with_sdclip_decodes_to_what_was_evaluated(tmp_path):
    sd = _state()
    policy = QuantPolicy(sdclip=True, attn_bits=6, mlp_bits=5, embed_bits=7, fit=False, gptq=False)
    report = export_artifact(sd, CONFIG, tmp_path / "a.ptz", code_bytes=0, policy=policy, **QUIET)
    got, _, meta = decode_artifact((tmp_path / "a.ptz").read_bytes())
    entries, _ = quantize_state_dict(sd, policy)
    for name, (shape, bits, q, s, clip) in entries.items():
        if bits:
            assert torch.equal(got[name], dequantize_per_row(q, s).view(shape))
            q_ref, s_ref = reference_sdclip(sd[name].reshape(shape[0], -1), bits, clip)
            assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
            assert clip == sdclip_k_for(policy, name, shape)
    assert meta["policy"]["sdclip"] is True and report["policy"]["sdclip"] is True
    assert {c for n, _, k, c in meta["tensors"] if ".mlp." in n and isinstance(k, int)} == {11.5}


def test_larger_k_gives_a_smaller_file(tmp_path):
    sd = _state(dim=128, seed=3)
    sizes = []
    for k in (6.0, 12.0, 24.0):
        policy = QuantPolicy(sdclip=True, sdclip_k_attn=k, sdclip_k_mlp=k, sdclip_k_embed=k, attn_bits=6, mlp_bits=6,
                             fit=False, gptq=False, compressor="brotli")
        sizes.append(export_artifact(sd, CONFIG, tmp_path / f"{k}.ptz", code_bytes=0, policy=policy,
                                     **QUIET)["bytes_model"])
    assert sizes[0] > sizes[1] > sizes[2]


def test_gptq_keeps_the_sdclip_scales():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(16, 32, generator=g), torch.randn(256, 32, generator=g)
    q0, s0, _ = sdclip_quantize(w, 6, 12.0)
    q, s, c = gptq_quantize(w, x.T @ x, 6, (12.0,), s0)
    assert torch.equal(s, s0) and c == 12.0
    h = x.T @ x
    err = lambda q_: float((((q_.float() * s0.float()[:, None] - w) @ h) * (q_.float() * s0.float()[:, None] - w)).sum())  # noqa: E731
    assert err(q) < err(q0)  # error feedback lowers the output error at the same scales


def test_the_size_estimate_knows_sdclip_and_lqer(tmp_path):
    """The pre-training estimate with QUANT_SDCLIP=1 is the rounded Gaussian's entropy (plus the coder's
    overhead), not the GPTQ-lite table (~2 bits per value more at int6, k 11.5): it tracks real exports of
    Gaussian weights at each k and bits; QUANT_LQER=1 adds the top-N factors' exact bytes."""
    import math

    from quant.estimate import estimate_artifact_bytes, sdclip_bits_per_value

    z = torch.randn(200_000, dtype=torch.float64)
    for bits, k in ((6, 11.5), (4, 6.0), (8, 40.0)):  # the entropy formula against the rounded draws' entropy
        m = (1 << bits - 1) - 1
        counts = torch.unique(torch.round(z / (k / m)).clamp(-m, m), return_counts=True)[1].double() / len(z)
        assert abs(sdclip_bits_per_value(bits, k) - 0.05 - float(-(counts * counts.log2()).sum())) < 0.02
    sd = _state(num_layers=3, dim=256, vocab=1024, seed=4)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    for fields in (dict(), dict(attn_bits=5, mlp_bits=5, sdclip_k_mlp=8.0), dict(mlp_bits=4, sdclip_k_mlp=6.0)):
        # brotli: zstd-22 loses ~8% on a payload that mixes int8 and int5 rows (per tensor it is within 1%)
        policy = QuantPolicy(sdclip=True, gptq=False, compressor="brotli", shuffle="off", fit=False, **fields)
        real = export_artifact(sd, CONFIG, tmp_path / "m.ptz", code_bytes=0, byte_budget=10**9, policy=policy,
                               **QUIET)["bytes_model"]
        est = estimate_artifact_bytes(shapes, policy)
        assert 0.97 * real <= est <= 1.04 * real, (fields, est, real)
        assert estimate_artifact_bytes(shapes, dataclasses.replace(policy, sdclip=False)) > 1.2 * est
    lqer = QuantPolicy(lqer=True, lqer_rank=4, lqer_top_n=2)
    big = sorted((math.prod(s), s) for n, s in shapes.items() if len(s) == 2 and lqer.bits_for(n, s))[-2:]
    extra = sum(36 * -(-4 * d // 64) for _, (r, c) in big for d in (r, c))
    assert estimate_artifact_bytes(shapes, lqer) - estimate_artifact_bytes(shapes, QuantPolicy()) == extra


def test_k_zero_keeps_the_clip_search_for_its_group(tmp_path):
    """QUANT_SDCLIP_K_EMBED=0: SDClip on the blocks, the embedding by the GPTQ-lite clip search, exactly as
    without SDClip; the size estimate follows the same split."""
    from quant.estimate import estimate_artifact_bytes

    sd = _state()
    blocks_only = QuantPolicy(sdclip=True, sdclip_k_embed=0, gptq=False, fit=False, compressor="zlib")
    entries, _ = quantize_state_dict(sd, blocks_only)
    lite, _ = quantize_state_dict(sd, dataclasses.replace(blocks_only, sdclip=False))
    every_group = dataclasses.replace(blocks_only, sdclip_k_embed=15.0)
    full, _ = quantize_state_dict(sd, every_group)
    emb = "tok_emb.weight"
    assert torch.equal(entries[emb][2], lite[emb][2]) and not torch.equal(entries[emb][2], full[emb][2])
    block = next(n for n in entries if ".mlp." in n and entries[n][1])
    assert torch.equal(entries[block][2], full[block][2]) and not torch.equal(entries[block][2], lite[block][2])
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    assert (estimate_artifact_bytes(shapes, every_group) < estimate_artifact_bytes(shapes, blocks_only)
            < estimate_artifact_bytes(shapes, dataclasses.replace(blocks_only, sdclip=False)))
