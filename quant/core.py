"""Per-row symmetric intN quantization, GPTQ-lite clip search and the QAT fake-quant.

One rounding rule for everything: export (`quantize_per_row`), the trainer's late-QAT forward
(`fake_quantize_per_row`) and the evaluator (`dequantize_per_row`) share the functions below, so the
weights QAT trained against are bit-for-bit the weights the artifact stores (clip quantile 1.0).

Rule, per row r of a matrix w [R, C] and bits N (qmax = 2**(N-1) - 1, e.g. 31 for int6):
    clip[r]  = quantile(|w[r, :]|, clip_quantile)        (1.0 = max |w|)
    scale[r] = fp16(clamp(clip[r] / qmax, 2**-24, 65504))  (subnormals rounded up)  rounded to fp16 BEFORE it is used, so
               the stored scale is the one the values were rounded with (rounded by bit
               arithmetic, see quant_fp16_scale, so torch.compile cannot skip it)
    q[r, c]  = clamp(round_half_even(w[r, c] / scale[r]), -qmax, qmax)        (int8 container)
    w'[r, c] = q[r, c] * scale[r]                                            (float32)
The range is symmetric: -2**(N-1) is never produced (the packer still accepts it).
Source: per-row int8 export of the official baseline (openai/parameter-golf train_gpt.py),
int6 per-row + GPTQ-lite clip search of the 10-minute records.
"""

import torch

QUANT_CLIP_QUANTILES = (0.999, 0.9995, 0.9999, 0.99999, 1.0)
QUANT_MIN_BITS = 2
QUANT_MAX_BITS = 8
_QUANT_FP16_MAX = 65504.0
_QUANT_FP16_TINY = 2.0 ** -24  # smallest positive fp16 (subnormal): keeps scale > 0 for zero rows


def quant_qmax(bits: int) -> int:
    """Largest quantized magnitude for `bits` (int, 2..8): 2**(bits-1) - 1. ValueError otherwise."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not QUANT_MIN_BITS <= bits <= QUANT_MAX_BITS:
        raise ValueError(f"bits={bits!r}: expected an int in {QUANT_MIN_BITS}..{QUANT_MAX_BITS}")
    return (1 << (bits - 1)) - 1


def _quant_check_matrix(w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.ndim != 2 or not w.is_floating_point():
        desc = f"{tuple(w.shape)} {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"weight {desc}: expected a 2-D floating-point tensor [R, C]")


def row_abs_quantiles(w: torch.Tensor, quantiles) -> torch.Tensor:
    """Per-row quantiles of |w|: w [R, C] float -> float32 [K, R] for K quantiles in [0, 1].

    Linear interpolation between order statistics, as torch.quantile, but with one sort for all
    K quantiles and no 16M-element limit. Quantile 1.0 alone takes the fast path (row max).
    """
    _quant_check_matrix(w)
    qs = [float(q) for q in quantiles]
    if any(not 0.0 <= q <= 1.0 for q in qs):
        raise ValueError(f"quantiles={qs}: expected values in [0, 1]")
    a = w.detach().float().abs()
    if w.shape[1] == 0:
        return a.new_zeros(len(qs), w.shape[0])
    if all(q == 1.0 for q in qs):
        return a.amax(dim=1).expand(len(qs), -1).contiguous()
    s = a.sort(dim=1).values
    pos = torch.tensor(qs, dtype=torch.float64) * (w.shape[1] - 1)
    lo, hi = pos.floor().long(), pos.ceil().long()
    frac = (pos - lo).to(torch.float32).to(w.device)
    lo_v, hi_v = s[:, lo.to(w.device)], s[:, hi.to(w.device)]
    return (lo_v + (hi_v - lo_v) * frac).T.contiguous()


def quant_fp16_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 scales x in [0, 65504] -> float32 holding float16 values.

    Normal fp16 range (x >= 2**-14): the nearest fp16 (ties to even), same as x.half().float().
    Subnormal range: rounded UP to a multiple of 2**-24, so a tiny row's max never saturates.
    Done on the float32 bits / with exact power-of-two rescales rather than with a cast, because
    torch.compile drops float32 -> float16 -> float32 round trips (Inductor does not emulate
    precision casts): with a cast, compiled QAT would round with scales the artifact never stores.
    """
    b = x.view(torch.int32)
    normal = ((b + 0x0FFF + ((b >> 13) & 1)) & -0x2000).view(torch.float32)
    return torch.where(x < 2.0 ** -14, torch.ceil(x * 2.0 ** 24) * 2.0 ** -24, normal)


def quantize_with_clip(w: torch.Tensor, bits: int, clip_abs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize w [R, C] with given per-row clip values clip_abs [R] (float, >= 0).

    Returns (q int8 [R, C] in [-qmax, qmax], scale float16 [R]). Values beyond the clip saturate.
    """
    qmax = quant_qmax(bits)
    _quant_check_matrix(w)
    scale = quant_fp16_scale((clip_abs.detach().float() / qmax).clamp(_QUANT_FP16_TINY, _QUANT_FP16_MAX))
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q, scale.to(torch.float16)


def quantize_per_row(w: torch.Tensor, bits: int, clip_quantile: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row intN quantization of w [R, C] (any float dtype, CPU or CUDA).

    Returns (q int8 [R, C], scale float16 [R]); see the module docstring for the exact rule.
    clip_quantile in [0, 1] picks the per-row clip (1.0 = max-abs, no clipping).
    ValueError for a non-2-D or non-float w, bits outside 2..8, or a quantile outside [0, 1].
    """
    return quantize_with_clip(w, bits, row_abs_quantiles(w, [clip_quantile])[0])


def dequantize_per_row(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 [R, C] and scale float16 [R] -> q * scale as `dtype` [R, C] (computed in float32)."""
    if q.ndim != 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"q {tuple(q.shape)} / scale {tuple(scale.shape)}: expected [R, C] and [R]")
    return (q.float() * scale.float()[:, None]).to(dtype)


def fake_quantize_per_row(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Straight-through fake quantization for late QAT: w [R, C] -> same shape and dtype.

    Forward value: dequantize_per_row(*quantize_per_row(w, bits)) (clip quantile 1.0) bit for bit,
    eager and torch.compile'd (tested on CPU): computed as dq + (w - w.detach()), whose second term
    is exactly 0 (no FMA contraction or rounding can touch dq), rather than w + (dq - w).detach().
    Backward: identity (straight-through estimator, Bengio et al. 2013). The caller gates it with a
    0/1 tensor (not a Python flag, which torch.compile would constant-fold).
    """
    wd = w.detach()
    return dequantize_per_row(*quantize_per_row(wd, bits), dtype=w.dtype) + (w - wd)


def quant_sq_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    """Sum of squared reconstruction errors (float64) of w [R, C] against q/scale."""
    return float((dequantize_per_row(q, scale) - w.detach().float()).double().square().sum())


def gptq_lite_quantize(w: torch.Tensor, bits: int, quantiles=QUANT_CLIP_QUANTILES) -> tuple[torch.Tensor, torch.Tensor, float]:
    """GPTQ-lite: quantize w [R, C] at each row-clip quantile, keep the lowest whole-matrix MSE.

    Returns (q int8 [R, C], scale float16 [R], clip_quantile float). Ties keep the earlier
    quantile. Include 1.0 in `quantiles` (the default does) and the result is never worse than
    plain max-abs quantization. Source: "GPTQ-lite" clip search of the parameter-golf records
    (quantiles 0.999 .. 1.0); full GPTQ (Frantar et al. 2022) needs calibration data.
    """
    clips = row_abs_quantiles(w, quantiles)
    best = None
    for quantile, clip in zip(quantiles, clips):
        q, scale = quantize_with_clip(w, bits, clip)
        err = quant_sq_error(w, q, scale)
        if best is None or err < best[0]:
            best = (err, q, scale, float(quantile))
    return best[1], best[2], best[3]
