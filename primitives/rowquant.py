"""Per-row symmetric intN quantization, GPTQ-lite clip search and the QAT fake-quant.

One rounding rule for everything: export (`quantize_per_row`, `gptq_lite_quantize`), the trainer's
late-QAT forward (`fake_quantize_per_row`) and the loader (`dequantize_per_row`) share the functions
below, so the weights QAT trained against are bit-for-bit the weights the artifact stores (clip
quantile 1.0).

Rule, per row r of a matrix w [R, C] and bits N (qmax = 2**(N-1) - 1, e.g. 31 for int6):
    clip[r]  = quantile(|w[r, :]|, clip_quantile)        (1.0 = max |w|)
    scale[r] = fp16(clamp(clip[r] / qmax, 2**-24, 65504))  (subnormals rounded up), rounded to fp16
               BEFORE it is used, so the stored scale is the one the values were rounded with
               (rounded by bit arithmetic, see quant_fp16_scale, so torch.compile cannot skip it)
    q[r, c]  = clamp(round_half_even(w[r, c] / scale[r]), -qmax, qmax)        (int8 container)
    w'[r, c] = q[r, c] * scale[r]                                            (float32)
The range is symmetric: -2**(N-1) is never produced.
Source: per-row int8 export of the official baseline (openai/parameter-golf train_gpt.py),
int6 per-row + GPTQ-lite clip search of the 10-minute records.

Size note: this module is bundled into the counted train_gpt.py (tools/bundle.py), so only what
the trainer run needs lives here; docstrings and comments are free, code and names are not.
"""

import math

import torch

from primitives.baseline_quant import quantize_per_row_baseline
from primitives.env import BUNDLE_KIND

# GPTQ-lite candidates, tried in this order (ties keep the earlier one); 1.0 = plain max-abs.
QUANT_CLIP_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)


def quant_fp16_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 scales x in [0, 65504] -> float32 holding float16 values.

    Normal fp16 range (x >= 2**-14): the nearest fp16 (ties to even), same as x.half().float():
    add half an fp16 ulp (minus one, plus the kept lowest bit for ties to even) to the float32
    bits and clear the 13 bits float16 does not have.
    Subnormal range: rounded UP to a multiple of 2**-24, so a tiny row's max never saturates.
    Done on the bits rather than with a cast, because torch.compile drops float32 -> float16 ->
    float32 round trips (Inductor does not emulate precision casts): with a cast, compiled QAT
    would round with scales the artifact never stores.
    """
    b = x.view(torch.int32)
    return torch.where(x < 2**-14, torch.ceil(x * 2**24) * 2**-24,
                       ((b + 4095 + (b >> 13 & 1)) & -8192).view(torch.float32))


def quantize_per_row(weight: torch.Tensor, nbits: int, clip_quantile: float = 1.0) -> tuple:
    """Symmetric per-row intN quantization (N = nbits) of weight w [R, C] (any float dtype, CPU or CUDA).

    Returns (q int8 [R, C] in [-qmax, qmax], scale float16 [R]); see the module docstring for the
    exact rule. clip_quantile in [0, 1] picks the per-row clip: the quantile of |w| over the row,
    interpolated linearly between order statistics like torch.quantile (which refuses more than
    16M elements), found with topk (the clip quantiles are near 1: a few values per row, no full
    sort); 1.0 = the row max, computed with amax, no sort: the QAT forward path. Values
    beyond the clip saturate.
    ValueError for nbits outside 2..8 in the package (a record's file takes its bits from the policy, which
    refuses others; shapes are the caller's invariant: a non-2-D w fails in torch; a quantile outside [0, 1]
    is a k out of range: RuntimeError).
    """
    if BUNDLE_KIND == "package":
        if type(nbits) is not int or not 1 < nbits < 9:
            raise ValueError(f"bits={nbits!r}: expected an int in 2..8")
    m = (1 << nbits - 1) - 1
    w = weight.detach().float()
    a = w.abs()
    if clip_quantile == 1:
        clip = a.amax(1)
    else:  # linear interpolation between the order statistics k and k + 1 around p (torch.quantile's rule)
        p = clip_quantile * (w.shape[1] - 1)
        k = math.floor(p)
        a = a.topk(w.shape[1] - k, 1).values  # the top C - k of each row, descending: [:, -1] has rank k
        clip = a[:, -1] + (a[:, -2 if p > k else -1] - a[:, -1]) * (p - k)
    s = quant_fp16_scale((clip / m).clamp(2**-24, 65504))
    return torch.round(w / s[:, None]).clamp(-m, m).to(torch.int8), s.half()


def dequantize_per_row(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int [R, C] and scale float16 [R] -> q * scale as `dtype` [R, C] (computed in float32)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def fake_quantize_per_row(weight: torch.Tensor, nbits: int, baseline_clip: float = 0.0) -> torch.Tensor:
    """Straight-through fake quantization for late QAT: weight w [R, C] -> same shape and dtype.

    Forward value: dequantize_per_row(*quantize_per_row(w, nbits)) (clip quantile 1.0) bit for bit,
    eager and torch.compile'd (tested on CPU): computed as dq + (w - w.detach()), whose second term
    is exactly 0 (no FMA contraction or rounding can touch dq), rather than w + (dq - w).detach().
    Backward: identity (straight-through estimator, Bengio et al. 2013). The caller (CastedLinear)
    switches it with an attribute torch.compile guards, so a compiled step without QAT has no such op.
    baseline_clip > 0: primitives/baseline_quant.py's rule at that clip quantile instead (PR #1617's fake_quantize_ste).
    """
    d = weight.detach()
    q = quantize_per_row_baseline(d, nbits, baseline_clip) if baseline_clip else quantize_per_row(d, nbits)
    return dequantize_per_row(*q, weight.dtype) + (weight - d)


def gptq_lite_quantize(weight: torch.Tensor, nbits: int) -> tuple:
    """GPTQ-lite: quantize weight w [R, C] at nbits with each QUANT_CLIP_QUANTILES row clip, keep the lowest whole-matrix MSE.

    Returns (q int8 [R, C], scale float16 [R], clip_quantile float), exactly
    quantize_per_row(w, nbits, clip_quantile). Ties keep the earlier quantile; 1.0 is a candidate,
    so the result is never worse than plain max-abs quantization. Source: "GPTQ-lite" clip search
    of the parameter-golf records (quantiles 0.999 .. 1.0); full GPTQ (Frantar et al. 2022) needs
    calibration data.
    """
    w, best = weight.detach().float(), None
    for c in QUANT_CLIP_QUANTILES:
        q, s = quantize_per_row(w, nbits, c)
        e = (dequantize_per_row(q, s) - w).double().square().sum()
        if best is None or e < best[0]:
            best = e, q, s, c
    return best[1:]
