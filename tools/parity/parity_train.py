"""Optimizer steps of the kit and of PR #1855's script from the same weights on the same batches (CPU, float32).

The record's side is its own `Optimizers` (Muon with its bank layout, Polar Express Newton-Schulz and row
normalization; the token and scalar AdamW) driven as its train loop drives them: momentum warmup, LR
multiplier, gradient clipping, the step, then its EMA (decay from step 0, no warmup) and the loop switch
at ENABLE_LOOPING_AT. The kit's side is trainer/optim.py's optimizers driven by trainer/schedule.py's
set_step_schedule in trainer/loop.py's order. Without a wallclock cap the run's fraction is step / ITERATIONS on
both sides.

Both Muons round the gradient to bfloat16 before their momentum and run Newton-Schulz in bfloat16, whose
first Polar Express steps multiply small singular directions by up to 8x each: a float32 gradient that
differs in its last bit flips bf16 roundings, and the flips move the update by whole percents. So the two
models' float32 gradients (equal to 2.7e-5, not bit for bit) cannot give parameters equal to 1e-4 after a
bf16 Muon step, and neither does the record against itself (record_self_spread). `bf16_lifted()` runs both
sides' bfloat16 casts at the models' own float32 (or float64) instead, without editing either side: every
other op (momentum, Nesterov, row normalization, Polar Express, WD, schedules, clipping, loop switch, EMA) as
it is, the comparison then free of the bf16 rounding (which the same-gradients comparison checks bit for bit).
"""

import contextlib

import torch

from primitives.settings import Hyperparameters
from tools.parity.parity_map import kit_to_record, record_to_kit
from tools.parity.parity_models import record_rows
from tools.parity.standins import cpu_standins
from trainer.optim import build_optimizers, step_optimizers
from trainer.schedule import EMA, ema_decay_at, run_progress, set_step_schedule


def kit_step(kit, optimizers, ema, hp: Hyperparameters, step: int, backward) -> None:
    """One training step of the kit at `step` (trainer/loop.py's one_step, one micro-batch); backward() makes
    the gradients."""
    progress = run_progress(0.0, 0.0, step, hp.iterations)
    if hp.num_loops and not kit.looping_active and progress >= hp.enable_looping_at:
        kit.looping_active = True
    set_step_schedule(optimizers, step, progress, hp)
    backward()
    step_optimizers(kit, optimizers, hp, ema, ema_decay_at(step, progress, hp) if ema else 0.0)


def record_step(record, optimizers, ema_state: dict, h, step: int, backward) -> None:
    """One training step of the record at `step` (its train_model loop and step_fn, one micro-batch); backward()
    makes the gradients."""
    frac = step / max(h.iterations, 1)
    scale = 1.0
    if h.warmdown_frac > 0 and frac >= 1.0 - h.warmdown_frac:
        scale = max((1.0 - frac) / h.warmdown_frac, h.min_lr)
    if h.num_loops > 0 and not record.looping_active and frac >= h.enable_looping_at:
        record.looping_active = True
    backward()
    w = min(step / h.muon_momentum_warmup_steps, 1.0) if h.muon_momentum_warmup_steps > 0 else 1.0
    for group in optimizers.optimizer_muon.param_groups:
        group["momentum"] = (1 - w) * h.muon_momentum_warmup_start + w * h.muon_momentum
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * scale
    if h.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_([p for p in record.parameters() if p.requires_grad], h.grad_clip_norm)
    optimizers.step(distributed=False)
    with torch.no_grad():
        for name, t in record.state_dict().items():
            ema_state[name].mul_(h.ema_decay).add_(t.detach().float(), alpha=1.0 - h.ema_decay)


@contextlib.contextmanager
def bf16_lifted():
    """Inside: Tensor.bfloat16() returns a float32 or float64 tensor unchanged (other dtypes as before), and
    torch.zeros(..., dtype=torch.bfloat16) makes float32 zeros, so the Muons run their bf16 casts at the models'
    float32 (or float64): PR #1855's Muon and the kit's MUON_FORM=records round only through .bfloat16(), PR #1617's
    also through the bf16 buffer it gathers its updates in. Restored on exit."""
    real, real_zeros = torch.Tensor.bfloat16, torch.zeros

    def lifted(self, *args, **kwargs):
        return self if self.dtype in (torch.float32, torch.float64) else real(self, *args, **kwargs)

    def zeros(*args, **kwargs):
        if kwargs.get("dtype") is torch.bfloat16:
            kwargs["dtype"] = torch.float32
        return real_zeros(*args, **kwargs)

    torch.Tensor.bfloat16, torch.zeros = lifted, zeros
    try:
        yield
    finally:
        torch.Tensor.bfloat16, torch.zeros = real, real_zeros


def relative_diffs(kit_state: dict, record_state: dict, num_layers: int) -> dict:
    """{kit name: max |kit - record| / max |record|} of every tensor, the record's mapped to the kit's names."""
    mapped = record_to_kit(record_state, num_layers)
    return {n: ((t - mapped[n]).abs().max() / mapped[n].abs().max().clamp_min(1e-30)).item()
            for n, t in kit_state.items()}


def batch_backwards(module, kit, record, batches: list) -> list:
    """[(kit backward, record backward)] of the training loss on each (x, y) of batches (the record row by row
    with its cu_seqlens, as parity_models.compare_forward)."""
    def pair(x, y):
        def record_backward():
            rows = record_rows(module, x, lambda b, cu, n: record(x[b:b + 1], y[b:b + 1], cu_seqlens=cu, max_seqlen=n))
            (sum(rows) / len(rows)).backward()
        return (lambda: kit(x, y).backward()), record_backward
    return [pair(x, y) for x, y in batches]


def gradient_backwards(kit, record, grads: list) -> list:
    """[(kit backward, record backward)] that set the same gradients {kit name: tensor} on both (the record's
    through the name map): the optimizers compared on their own."""
    def setter(model, named):
        def backward():
            for n, p in model.named_parameters():
                p.grad = named[n].clone()
        return backward
    return [(setter(kit, g), setter(record, kit_to_record(g, len(kit.blocks)))) for g in grads]


def compare_steps(module, kit, record, hp: Hyperparameters, backwards: list) -> list:
    """Both sides take one step per (kit backward, record backward) pair from their current (equal) weights;
    returns per step {"params": max relative diff over parameters, "worst": its name, "looping": the kit's loop
    switch, "ema": max relative diff of the EMA weights}."""
    h = record.parity_h
    out = []
    with cpu_standins():
        optimizers = build_optimizers(kit, hp, is_cuda=False)
        for group in optimizers.adamw.param_groups:  # fused, as the kit's on CUDA and the record's (CPU kernels exist)
            group["fused"] = True
        record_opts = module.Optimizers(h, record)
        ema = EMA(kit, hp.ema_warmup) if hp.ema_decay else None
        ema_state = {n: t.detach().float().clone() for n, t in record.state_dict().items()}
        kit.train(), record.train()
        kit.looping_active = record.looping_active = False  # both switch it on at ENABLE_LOOPING_AT
        for step in range(len(backwards)):
            kit_step(kit, optimizers, ema, hp, step, backwards[step][0])
            record_step(record, record_opts, ema_state, h, step, backwards[step][1])
            params = relative_diffs({n: p.detach() for n, p in kit.named_parameters()},
                                    {n: p.detach() for n, p in record.named_parameters()}, hp.num_layers)
            worst = max(params, key=params.get)
            row = {"step": step + 1, "params": params[worst], "worst": worst, "looping": kit.looping_active,
                   "record_looping": record.looping_active}
            if ema:
                shadow = dict(zip((n for n, _ in kit.named_parameters()), ema.shadow))
                row["ema"] = max(relative_diffs(shadow, ema_state, hp.num_layers).values())
            out.append(row)
    return out


def record_self_spread(module, kit, hp: Hyperparameters, batches: list, rel_noise: float, seed: int = 0) -> list:
    """The record against itself: two copies of its model with kit's weights take one step per (x, y) of batches,
    the second's gradients times (1 + rel_noise N(0, 1)) before its clipping and step (rel_noise 1.2e-7: a float32
    ulp's order); returns per step {"params": max relative diff over parameters, "worst": its name (the record's)}."""
    from tools.parity.parity_models import record_model

    gen = torch.Generator().manual_seed(seed)
    first, second = record_model(module, kit, hp), record_model(module, kit, hp)
    pairs = [(batch_backwards(module, kit, first, [b])[0][1], batch_backwards(module, kit, second, [b])[0][1])
             for b in batches]

    def perturbed(backward):
        def run():
            backward()
            for p in second.parameters():
                p.grad.mul_(1 + rel_noise * torch.randn(p.shape, generator=gen, dtype=p.grad.dtype))
        return run

    h, out = first.parity_h, []
    with cpu_standins():
        opts = [module.Optimizers(h, m) for m in (first, second)]
        emas = [{n: t.detach().float().clone() for n, t in m.state_dict().items()} for m in (first, second)]
        for m in (first, second):
            m.train()
            m.looping_active = False
        for step, (one, two) in enumerate(pairs):
            record_step(first, opts[0], emas[0], h, step, one)
            record_step(second, opts[1], emas[1], h, step, perturbed(two))
            diffs = {n: ((p - q).abs().max() / q.abs().max().clamp_min(1e-30)).item()
                     for (n, p), (_, q) in zip(first.named_parameters(), second.named_parameters())}
            worst = max(diffs, key=diffs.get)
            out.append({"step": step + 1, "params": diffs[worst], "worst": worst})
    return out
