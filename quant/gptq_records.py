"""PR #1855's GPTQ arithmetic (QUANT_GPTQ_RECORDS): quant/gptq.py's gptq_quantize calls it only with the setting
on, so a record's train_gpt.py packed without it carries none of this.
"""

import torch

# the packed train_gpt.py holds it only for runs that set it (kit/bundle_when.py)
PACKED_WHEN = "QUANT_GPTQ_RECORDS"


def gptq_records_order(h: torch.Tensor, w: torch.Tensor) -> tuple:
    """PR #1855's order of operations before the factorization, in float32 (its codes, tools/parity/parity_quant.py):
    inputs that never fire (diag(h) = 0) get diagonal 1 and zero weights, the damping (1% of the mean diagonal) is
    added before the act-order sort. h [C, C] float32 Hessian, w [R, C] float32 -> (damped Hessian in act order
    [C, C], the order o [C], h, w with the dead inputs fixed)."""
    dead, h = h.diagonal() == 0, h.clone()
    h[dead, dead], w = 1.0, w.masked_fill(dead, 0.0)
    g = h + 0.01 * h.diagonal().mean() * torch.eye(h.size(0), dtype=h.dtype, device=h.device)
    o = torch.argsort(g.diagonal(), descending=True)
    return g[o][:, o], o, h, w
