"""SDClip: per-row scale from the row's standard deviation instead of a clip search (QUANT_SDCLIP=1).

Rule, per row r of w [R, C], bits N (qmax = 2**(N-1) - 1) and the group's k:
    scale[r] = fp16(clamp(k * std(w[r, :]) / qmax, 2**-24, 65504))   (primitives.rowquant.quant_fp16_scale)
    q[r, c]  = clamp(round_half_even(w[r, c] / scale[r]), -qmax, qmax)
std is the sample standard deviation (Bessel's correction, torch.std's default). Values beyond
k * std saturate; k is the size knob: a larger k spreads the same values over fewer levels, so
the entropy and the compressed file shrink and the rounding error grows.
k per group (attention / MLP / embedding / other matrices; QUANT_SDCLIP_K_ATTN, _MLP, _EMBED,
_OTHER). Source: PR #1394 (SDClip, "clip_sigmas"); PR #1855 used MLP 11.5, attention 13.0 and
12.85 for the other matrices at int6, PR #1586 the embedding at int7 with 15.0.
With a calibration Hessian, full GPTQ runs with these scales fixed (quant.gptq.gptq_quantize).
The stored format does not change: the decoder only sees q and the float16 scales.

Size note: bundled into the counted train_gpt.py (the export calls it).
"""

import math

import torch

from primitives.rowquant import quant_fp16_scale
from quant.gptq import gptq_quantize

# the packed train_gpt.py holds this module only for runs with QUANT_SDCLIP=1 (kit/bundle_when.py)
PACKED_WHEN = "QUANT_SDCLIP"


def sdclip_k_for(qp, name: str, shape: tuple) -> float:
    """The SDClip k of parameter `name` of `shape` under the QuantPolicy qp: its group's (attn / mlp / embed; anything
    else, an override-quantized control tensor included, sdclip_k_other); 0 (the GPTQ-lite clip search) without
    QUANT_SDCLIP, for an int8 gate, or where the group's k is 0 (e.g. QUANT_SDCLIP_K_EMBED=0: SDClip on the blocks
    only). The kept modules call it only when policy.sdclip is on (a record's file packs this module only then)."""
    group = qp.group_of(name, shape)
    if not qp.sdclip or qp.int8_gate(name, shape):
        return 0.0
    return getattr(qp, f"sdclip_k_{group if group in ('attn', 'mlp', 'embed') else 'other'}")


def sdclip_scale(weight: torch.Tensor, nbits: int, k: float) -> torch.Tensor:
    """float16 [R] SDClip scales of weight [R, C] (C >= 2) at `nbits` with clip k * std(row).

    ValueError for nbits outside 2..8 or k <= 0.
    """
    if type(nbits) is not int or not 1 < nbits < 9 or not k > 0:
        raise ValueError(f"bits={nbits!r}, k={k!r}: expected an int in 2..8 and k > 0")
    std = weight.detach().float().std(1)
    return quant_fp16_scale((k * std / ((1 << nbits - 1) - 1)).clamp(2**-24, 65504)).half()


def sdclip_quantize(weight: torch.Tensor, nbits: int, k: float) -> tuple:
    """SDClip quantization of weight [R, C] at nbits -> (q int8 [R, C] in [-qmax, qmax], scale float16 [R], k)."""
    m, s = (1 << nbits - 1) - 1, sdclip_scale(weight, nbits, k)
    return torch.round(weight.detach().float() / s.float()[:, None]).clamp(-m, m).to(torch.int8), s, float(k)


def sdclip_matrix(weight: torch.Tensor, h, nbits: int, k: float, records: bool = False) -> tuple:
    """The export's (q, scale, k) of matrix weight at nbits under SDClip: k * std(row) scales, kept fixed by full GPTQ
    (quant/gptq.py, QUANT_GPTQ_RECORDS: records) when a calibration Hessian h is given (None: none)."""
    if h is None:
        return sdclip_quantize(weight, nbits, k)
    return gptq_quantize(weight, h, nbits, (float(k),), sdclip_scale(weight, nbits, k), records)


def sdclip_bits_per_value(nbits: int, k: float) -> float:
    """Projected compressed bits per value of SDClip at `nbits` (2..8) and clip k (> 0): the entropy of a
    Gaussian rounded to steps of k / qmax std, tails on the outermost levels, plus the measured coder
    overhead (quant/estimate.py's docstring has the measurement; its size estimate calls this)."""
    m = (1 << nbits - 1) - 1
    cdf = [0.0] + [0.5 * (1 + math.erf((i + 0.5) * k / m / math.sqrt(2))) for i in range(-m, m)] + [1.0]
    h = -sum(p * math.log2(p) for p in (b - a for a, b in zip(cdf, cdf[1:])) if p > 0)
    return h + (0.05 if h >= 2 else 0.17)
