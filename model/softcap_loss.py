"""The training loss with its logits' gradient made in the forward: head matmul -> softcap -> cross entropy.

The plain loss (F.linear -> softcap -> F.cross_entropy under autograd) reads the [N, V] bf16 logits twice and
writes their gradient once: once in the forward (the log-sum-exp) and again in the backward (softmax, softcap
derivative). `head_softcap_cross_entropy` computes the gradient while the forward has the row in hand (the way
Liger-Kernel's fused linear cross entropy does, without its chunk loop), saves it in the logits' dtype and
leaves the backward two matmuls: at the default preset (65,536 tokens x V 8192 per micro-batch) Inductor's
generated CUDA code moves 1 GiB less per micro-batch. Same values: the gradient is the plain path's to
rounding, and the incoming gradient (1 / grad-accum steps) scales the matmuls' outputs in float32, which is
exact for a power of two.
"""

import torch
import torch.nn.functional as F

_FUSED_LOSS = []  # [True] while LOSS_KERNEL=liger chose model/fused_loss.py's op (its resolve_loss_kernel)


def fused_loss_active(device: torch.device, /) -> bool:
    """True when LOSS_KERNEL chose the fused loss (GPT.forward then calls model/fused_loss.py's op); never on meta
    (FLOP counting sees the plain loss's matmuls). Here, not in model/fused_loss.py: a record's train_gpt.py holds
    that module only for LOSS_KERNEL=liger."""
    return bool(_FUSED_LOSS) and device.type != "meta"


def use_plain_loss(log=print) -> str:
    """LOSS_KERNEL auto or torch (auto is torch, model/fused_loss.py has the measurement): GPT.forward takes the
    plain loss process-wide; logs "loss:torch", as model/fused_loss.py resolve_loss_kernel does for these values."""
    _FUSED_LOSS.clear()
    log("loss:torch")
    return "torch"


class _HeadSoftcapCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, softcap, /):
        w = weight.to(x.dtype)
        logits = F.linear(x, w)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 math for bf16
        t = torch.tanh(logits / softcap)
        s = softcap * t
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        n = x.size(0)
        # the target's column as a comparison, never an int64 one-hot [N, V] (4 GiB at 65,536 x 8192 in eager)
        is_target = torch.arange(s.size(-1), device=s.device)[None, :] == target[:, None]
        p = torch.exp(s - lse)
        loss = (lse.squeeze(-1) - s.gather(-1, target[:, None]).squeeze(-1)).mean()
        grad = (torch.where(is_target, p - 1, p) * ((1 - t * t) / n)).to(x.dtype)
        ctx.save_for_backward(grad, x, w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss, /):
        grad, x, w = ctx.saved_tensors
        # the incoming gradient (1 / grad-accum steps) scales the products in float32: exact for a power of two
        scale = grad_loss.to(torch.promote_types(grad_loss.dtype, torch.float32))
        grad_x = ((grad @ w).to(scale.dtype) * scale).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = ((grad.t() @ x).to(scale.dtype) * scale).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


# head_softcap_cross_entropy(x, weight, target, softcap) (positional: the Function's apply): mean cross entropy
# (nats, float32 scalar) of softcap * tanh((x @ weight.T) / softcap) against target.
# x [N, D] in the dtype the head multiplies in (GPT.forward casts it to the autocast dtype: CUDA autocast's
# rms_norm returns float32 from torch 2.12, and a float32 x would save a float32 [N, V] gradient and run the
# backward's matmuls in float32); weight [V, D] (float32 parameter, cast to x's dtype as F.linear under
# autocast does); target int64 [N], every entry in [0, V) (no ignore_index).
head_softcap_cross_entropy = _HeadSoftcapCE.apply
