"""PR #1617's rounding, the official baseline's rule (QUANT_BASELINE_CLIP): per-row for matrices, per-tensor for
vectors. The export (quant/artifact.py) and the late-QAT forward (primitives/rowquant.py fake_quantize_per_row) call
these only with QUANT_BASELINE_CLIP > 0, so a record's train_gpt.py packed without it carries none of this.
"""

import torch

# the packed train_gpt.py holds it only for runs that set it (kit/bundle_when.py)
PACKED_WHEN = "QUANT_BASELINE_CLIP > 0"


def quantize_per_row_baseline(weight: torch.Tensor, nbits: int, clip_quantile: float) -> tuple:
    """The official baseline's per-row rule, PR #1617's quantize_float_tensor (QUANT_BASELINE_CLIP): weight w [R, C] at
    nbits clamped
    to its row clip (torch.quantile of |w[r]|, as there: at most 16M values), scale = max(clip / qmax, 1 / qmax) in
    float32, q = round(w / scale); returns (q int8 [R, C], the scale rounded to float16 [R]), so the values are
    rounded with a scale the artifact does not store and rows with a clip below 1 share the fixed grid 1 / qmax (the
    baseline's clamp_min(1 / 127))."""
    m = (1 << nbits - 1) - 1
    w = weight.detach().float()
    clip = torch.quantile(w.abs(), clip_quantile, dim=1, keepdim=True)  # its clip to the bit (fp32 rounding)
    s = (clip / m).clamp_min(1.0 / m)
    return torch.round(torch.maximum(torch.minimum(w, clip), -clip) / s).clamp(-m, m).to(torch.int8), s[:, 0].half()


def quantize_per_tensor_baseline(t: torch.Tensor, nbits: int, clip_quantile: float) -> torch.Tensor:
    """The baseline's per-tensor rule at nbits for a vector t (PR #1617's quantize_float_tensor + its dequantization): clip =
    the clip_quantile quantile of |t|, scale = clip / qmax in float32 (1 for an all-zero t), no floor; returns the
    dequantized float32 tensor q * scale (its values, stored as they are: the kit's rows keep float16 scales)."""
    m = (1 << nbits - 1) - 1
    t = t.detach().float()
    clip = float(torch.quantile(t.abs().flatten(), clip_quantile)) if t.numel() else 0.0
    s = torch.tensor(clip / m if clip > 0 else 1.0)
    return torch.round(t.clamp(-clip, clip) / s).clamp(-m, m) * s
