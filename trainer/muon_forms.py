"""Muon's arithmetic of the records (MUON_FORM records / classic): trainer/optim.py's Muon calls these only for those
forms, so a record's train_gpt.py packed for MUON_FORM=torch carries none of this.

records: PR #1855's Muon: gradient and momentum buffer in bf16, buf <- momentum * buf + g, u = g + momentum * buf
(classic Nesterov; the same direction as torch's at a fixed momentum, Newton-Schulz being scale-free), the
Newton-Schulz in its op order. classic: PR #1617's (modded-nanogpt's): the same in float32, its Newton-Schulz order
and the update scaled by sqrt(max(1, R/C)) in bf16 before the step. Shapes: N matrices of one shape, R rows, C columns.
"""

import torch

# the packed train_gpt.py holds them only for runs with one of these forms (kit/bundle_when.py)
PACKED_WHEN = "MUON_FORM != 'torch'"


def newton_schulz_ordered(g: torch.Tensor, steps: int, /, eps: float = 1e-7, coeffs: tuple = (),
                          order: str = "records") -> torch.Tensor:
    """trainer.optim.newton_schulz's iteration in the records' op order, g [N, R, C] -> bfloat16 [N, R, C]:
    x / (|x| + eps); G = x x^T; B = b G + c (G G) ("records", PR #1855's rounding as its bf16 does) or
    b G + (c G) G ("classic", PR #1617's `c * A @ A`); x <- a x + B x, coeffs[i] at step i (the last repeating)."""
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for i in range(steps):
        a, b, c = coeffs[min(i, len(coeffs) - 1)]
        gram = x @ x.mT
        x = a * x + (b * gram + (c * gram @ gram if order == "classic" else c * (gram @ gram))) @ x
    return x.mT if tall else x


def form_update(muon, ps: list, momentum: float, /) -> torch.Tensor:
    """The momentum step of `muon` (trainer.optim.Muon, form records or classic) on parameters ps of one shape:
    buf <- momentum * buf + g per tensor (as the records: bf16 _foreach_mul_ rounds differently on a CPU), returns
    u = g + momentum * buf stacked [N, R, C] (bf16 gradients for records)."""
    grads = [p.grad.bfloat16() if muon.form == "records" else p.grad for p in ps]
    bufs = muon.buffers(ps, grads)
    for buf, g in zip(bufs, grads):
        buf.mul_(momentum).add_(g)
    return torch.stack(grads).add_(torch.stack(bufs), alpha=momentum)


def form_orthogonalize(muon, u: torch.Tensor, scale: float, /) -> torch.Tensor:
    """newton_schulz_ordered(u) [N, R, C] in `muon`'s form as float32; the classic form multiplies it by scale in
    bf16 first (PR #1617: its step then takes lr without the scale)."""
    x = muon.ns(u, muon.ns_steps, coeffs=muon.ns_coeffs, order=muon.form)
    return (x * scale if muon.form == "classic" else x).float()
