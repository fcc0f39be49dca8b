"""The attention's per-token ops, with backwards written for the step's memory traffic.

Shape legend: B batch, T time, H heads (query or key/value), D head dim, R rotated dims per head (ROPE_DIMS).

Inductor fuses what autograd gives it, but it cannot see that a per-head gain's gradient is the row sum the
RMSNorm backward already makes. `qk_norm_rope` keeps the forward values of the plain ops and hands Inductor a
backward that reads each [B, T, H, D] tensor once (tools/bench_step.py --cpu-twin measures the bytes;
docs/benchmarks.md has the table).
"""

import torch
import torch.nn.functional as F


def autocast_dtype(x: torch.Tensor, default: torch.dtype | None = None, /) -> torch.dtype:
    """The autocast dtype of x's device while autocast is on there, else `default` (x's own dtype when None). The meta
    device (FLOP counting) has no autocast state: `default`."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev) else default or x.dtype


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*cos.size(-1) dims of each head (half-split RoPE); the rest pass unrotated.

    x [B, T, H, D]; cos, sin [T, R/2]. Partial RoPE as in the records (ROPE_DIMS=32 of 64): x * (cos, cos, 1...)
    + (x2, x1, rest) * (sin, -sin, 0...) for x = (x1, x2, rest), x1 and x2 R/2 dims each; the tables made [1, T, 1, D]
    in x's dtype.
    """
    h, d = cos.size(-1), x.size(-1)
    i = torch.arange(d, device=x.device)  # made on x's device: no host-to-device copy per call
    c, s = (torch.cat((t, u, t.new_full((t.size(0), d - 2 * h), f)), -1)[None, :, None, :].to(x.dtype)
            for t, u, f in ((cos, cos, 1.0), (sin, -sin, 0.0)))
    return x * c + x[..., torch.where(i < 2 * h, (i + h) % (2 * h), i)] * s


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, gain=None, /):
        n = F.rms_norm(x, (x.size(-1),)).to(x.dtype)  # float32 under CUDA autocast from torch 2.12: back to x's dtype
        out = apply_partial_rope(n, cos, sin)
        if gain is not None:
            out = out * gain.to(out.dtype)[None, None, :, None]
        ctx.save_for_backward(x, cos, sin, gain)
        return out

    @staticmethod
    def backward(ctx, grad_out, /):
        x, cos, sin, gain = ctx.saved_tensors
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        math = xf.dtype
        # as F.rms_norm computes it, with its default eps: the epsilon of its math type (float32 for bf16/fp16)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + torch.finfo(math).eps)
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


# qk_norm_rope(x, cos, sin, gain=None): QK-norm, partial RoPE and the per-head query gain:
# apply_partial_rope(rms_norm(x), cos, sin) * gain[h] (the Function's apply: positional arguments).
# x [B, T, H, D] (a projection's output, bf16 under autocast); cos, sin float32 [T, R/2]; gain float32 [H]
# or None (keys) -> [B, T, H, D] in x's dtype, the plain ops' values. The backward saves only x (rstd is
# recomputed) and gets the gain's gradient from the RMSNorm backward's own row sum: at the default preset
# the compiled step no longer writes the rotated queries for a separate gain reduction (0.9 GiB less per
# micro-batch in the generated CUDA code). QK gain: PR #1413/#1493; QK-norm and partial RoPE as
# in the records.
qk_norm_rope = _QKNormRope.apply

