"""The EMA of the weights (EMA_DECAY or EMA_HORIZON_FRAC > 0; trainer/schedule.py gives its decay per step). The
loop makes one only with the EMA on, so a record's train_gpt.py packed without it carries none of this.
"""

import torch
import torch.nn as nn

# the packed train_gpt.py holds it only for runs with the EMA on (kit/bundle_when.py)
PACKED_WHEN = "EMA_DECAY > 0 or EMA_HORIZON_FRAC > 0"


class EMA:
    """Exponential moving average of the weights in float32: ema <- d * ema + (1 - d) * w.

    `update(decay)` uses d = min(decay, (1 + t) / (10 + t)) at update t (the usual EMA warmup), so
    short runs average their recent weights instead of staying near the initialization; long runs
    use `decay`. decay = 0 (before EMA_START_FRAC) copies the weights and restarts the warmup.
    warmup=False (EMA_WARMUP=0): d = decay from the first update, PR #1855's EMA in its arithmetic
    (ema * d + w * (1 - d) per tensor, its rounding; the warmup form lerps).
    """

    def __init__(self, model: nn.Module, warmup: bool = True):
        self.num_updates, self.warmup = 0, warmup
        self.params = [p for p in model.parameters()]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        d = min(decay, (1 + self.num_updates) / (10 + self.num_updates)) if self.warmup else decay
        self.num_updates = self.num_updates + 1 if decay > 0 else 0
        if not self.warmup:  # PR #1855's ema.mul_(d).add_(w, alpha=1 - d), tensor by tensor
            for s, p in zip(self.shadow, self.params):
                s.mul_(d).add_(p.detach().float(), alpha=1.0 - d)
            return
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1.0 - d)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for p, s in zip(self.params, self.shadow):
            p.copy_(s.to(p.dtype))
