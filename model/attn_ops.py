"""The attention's per-token ops, with backwards written for the step's memory traffic.

Shape legend: B batch, T time, H heads (query or key/value), D head dim, R rotated dims per head (ROPE_DIMS).

Inductor fuses what autograd gives it, but it cannot see that a per-head gain's gradient is the row sum the
RMSNorm backward already makes. `qk_norm_rope` keeps the forward values of the plain ops and hands Inductor a
backward that reads each [B, T, H, D] tensor once (tools/bench_step.py --cpu-twin measures the bytes;
docs/benchmarks.md has the table).
"""

import torch
import torch.nn.functional as F


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*cos.size(-1) dims of each head (half-split RoPE); the rest pass unrotated.

    x [B, T, H, D]; cos, sin [T, R/2]. Partial RoPE as in the records (ROPE_DIMS=32 of 64).
    """
    return x * _full(cos, x, 1.0) + _rotate_half(x, cos.size(-1)) * _full(sin, x, 0.0, signed=True)


def _full(t: torch.Tensor, x: torch.Tensor, fill: float, signed: bool = False) -> torch.Tensor:
    """cos or sin [T, R/2] -> [1, T, 1, D] in x's dtype: (t, t, fill...), or (t, -t, fill...) when signed."""
    d = x.size(-1) - 2 * t.size(-1)
    full = torch.cat((t, -t if signed else t, t.new_full((t.size(0), d), fill)), dim=-1)
    return full[None, :, None, :].to(x.dtype)


def _rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    """x [..., D] -> (x2, x1, rest) for x = (x1, x2, rest) with x1, x2 `half` dims each."""
    idx = torch.arange(x.size(-1), device=x.device)  # made on x's device: no host-to-device copy per call
    return x[..., torch.where(idx < 2 * half, (idx + half) % (2 * half), idx)]


def _rms_eps(dtype: torch.dtype) -> float:
    """F.rms_norm's default eps for an input of `dtype`: the epsilon of its math type (float32 for bf16/fp16)."""
    return torch.finfo(dtype if dtype == torch.float64 else torch.float32).eps


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, gain):
        n = F.rms_norm(x, (x.size(-1),)).to(x.dtype)  # float32 under CUDA autocast from torch 2.12: back to x's dtype
        out = apply_partial_rope(n, cos, sin)
        if gain is not None:
            out = out * gain.to(out.dtype)[None, None, :, None]
        ctx.save_for_backward(x, cos, sin, gain)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, cos, sin, gain = ctx.saved_tensors
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        math = xf.dtype
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + _rms_eps(x.dtype))  # as F.rms_norm computes it
        n = xf * rstd  # the normalized input, recomputed from x: the only [B, T, H, D] tensor saved
        g = apply_partial_rope(grad_out.to(math), cos, -sin)  # RoPE's transpose is its inverse: the gradient at gain * n
        row = (g * n).sum(-1, keepdim=True)  # per head and token: the gain's gradient, before the sum over B, T
        grad_gain = None
        if gain is not None:
            gm = gain.to(x.dtype).to(math)[None, None, :, None]  # the forward multiplied by the gain in x's dtype
            grad_gain = row.sum((0, 1, 3)).to(gain.dtype)
            g, row = g * gm, row * gm
        grad_x = rstd * (g - n * (row / x.size(-1)))  # RMSNorm's backward: rstd (g - n mean(g n))
        return grad_x.to(x.dtype), None, None, grad_gain


def qk_norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, gain: torch.Tensor = None) -> torch.Tensor:
    """QK-norm, partial RoPE and the per-head query gain: apply_partial_rope(rms_norm(x), cos, sin) * gain[h].

    x [B, T, H, D] (a projection's output, bf16 under autocast); cos, sin float32 [T, R/2]; gain float32 [H]
    or None (keys) -> [B, T, H, D] in x's dtype, the plain ops' values. The backward saves only x (rstd is
    recomputed) and gets the gain's gradient from the RMSNorm backward's own row sum: at the default preset
    the compiled step no longer writes the rotated queries for a separate gain reduction (0.9 GiB less per
    micro-batch in the generated CUDA code). QK gain: PR #1413/#1493; QK-norm and partial RoPE as
    in the records.
    """
    return _QKNormRope.apply(x, cos, sin, gain)

