"""Schedules (LR warmdown, Muon momentum, late QAT, EMA decay) as fractions of the run, and the EMA.

`progress` in [0, 1] is the fraction of the run done: of MAX_WALLCLOCK_SECONDS (or of ITERATIONS,
whichever ends the run first). A knob's step form, when set, is converted with the run length in
steps: ITERATIONS, or for a wallclock run step / progress (the official script's WARMDOWN_ITERS
does the same with its measured step time).
"""

from primitives.settings import Hyperparameters
from trainer.ema import EMA  # noqa: F401 (trainer.schedule's API: the loop, the tools and the tests import it here)
from trainer.wd_taper import wd_taper_multiplier


def run_progress(elapsed_ms: float, cap_ms: float, step: int, iterations: int, /) -> float:
    """Fraction of the run done, in [0, 1]: of the wallclock cap (cap_ms > 0) or of ITERATIONS,
    whichever is further along (the one that will end the run first)."""
    return min(1.0, max(elapsed_ms / cap_ms if cap_ms > 0 else 0.0, step / max(1, iterations)))


def run_steps_estimate(step: int, progress: float, hp: Hyperparameters, /) -> float:
    """The run's length in steps: ITERATIONS without a wallclock cap, else step / progress once the
    clock has run (EXPECTED_STEPS, at most ITERATIONS, before the first step)."""
    if hp.max_wallclock_seconds <= 0:
        return float(hp.iterations)
    return step / progress if step and progress > 0 else float(min(hp.expected_steps, hp.iterations))


def warmdown_frac_at(step: int, progress: float, hp: Hyperparameters, /) -> float:
    """WARMDOWN_FRAC, or WARMDOWN_ITERS as a fraction of the run."""
    return hp.warmdown_iters / run_steps_estimate(step, progress, hp) if hp.warmdown_iters else hp.warmdown_frac


def lr_multiplier(progress: float, warmdown_frac: float, min_lr: float = 0.0, /) -> float:
    """1.0, then linear decay to 0 over the last `warmdown_frac` of progress (time or steps), floored at min_lr
    (MIN_LR, a fraction of the peak LR; PR #1787: max((1 - progress) / warmdown_frac, 0.10) in the warmdown)."""
    return max(1.0 if warmdown_frac <= 0 else max(0.0, min(1.0, (1.0 - progress) / warmdown_frac)), min_lr)


def qat_active(progress: float, qat_start_frac: float, /) -> bool:
    """Late QAT is on for the last `qat_start_frac` of progress."""
    return qat_start_frac > 0 and progress >= 1.0 - qat_start_frac


def warmup_graph_states(hp: Hyperparameters, /, has_qat: bool) -> list:
    """(looping, qat) for each of the WARMUP_STEPS compile-priming steps: the graph states the run passes
    through (depth recurrence from ENABLE_LOOPING_AT, late QAT for the last QAT_START_FRAC), in the run's
    order, each given an equal share of the steps, so every graph compiles before the clock (with fewer
    steps than states, the later states compile when the run reaches them)."""
    events = sorted([(hp.enable_looping_at, "loop")] * bool(hp.num_loops)
                    + [(1.0 - hp.qat_start_frac, "qat")] * bool(has_qat and hp.qat_start_frac > 0))
    states = [(False, False)]
    for _, what in events:
        looping, qat = states[-1]
        states.append((True, qat) if what == "loop" else (looping, True))
    n = hp.warmup_steps
    return [states[i * len(states) // n] for i in range(n)]


def horizon_decay(horizon_frac: float, run_steps: float, /) -> float:
    """The per-step decay whose time constant 1/(1-decay) is `horizon_frac` of a run of `run_steps`
    steps (0 for a horizon of at most one step)."""
    return max(0.0, 1 - 1 / (horizon_frac * run_steps)) if horizon_frac else 0.0


def muon_momentum_at(step: int, hp: Hyperparameters, progress: float = 0.0, /) -> float:
    """Linear warmup MUON_MOMENTUM_WARMUP_START -> MUON_MOMENTUM (or the momentum whose time constant
    1/(1-m) is MUON_MOMENTUM_HORIZON_FRAC of the run) over MUON_MOMENTUM_WARMUP_STEPS steps (records'
    form, exact), else over the first MUON_MOMENTUM_WARMUP_FRAC of the run. A target below the start
    is used from step 0."""
    if hp.muon_momentum_warmup_steps:
        frac = min(1.0, step / hp.muon_momentum_warmup_steps)
    else:
        frac = min(1.0, progress / hp.muon_momentum_warmup_frac) if hp.muon_momentum_warmup_frac else 1.0
    end = hp.muon_momentum or horizon_decay(hp.muon_momentum_horizon_frac, run_steps_estimate(step, progress, hp))
    return (1 - frac) * min(hp.muon_momentum_warmup_start, end) + frac * end


def muon_momentum_target(hp: Hyperparameters, run_steps: float) -> float:
    """MUON_MOMENTUM, or the momentum whose time constant is MUON_MOMENTUM_HORIZON_FRAC of the run."""
    return hp.muon_momentum or horizon_decay(hp.muon_momentum_horizon_frac, run_steps)


def ema_target(hp: Hyperparameters, run_steps: float) -> float:
    """EMA_DECAY, or the decay whose time constant is EMA_HORIZON_FRAC of the run (0 = EMA off)."""
    return hp.ema_decay or horizon_decay(hp.ema_horizon_frac, run_steps)


def ema_decay_at(step: int, progress: float, hp: Hyperparameters, /) -> float:
    """Per-step EMA decay: 0 (follow the weights) before EMA_START_FRAC of the run; then EMA_DECAY,
    or 1 - 1 / (EMA_HORIZON_FRAC x run length in steps)."""
    return 0.0 if progress < hp.ema_start_frac else hp.ema_decay or horizon_decay(
        hp.ema_horizon_frac, run_steps_estimate(step, progress, hp))


def describe_schedule(hp: Hyperparameters, run_steps: float) -> str:
    """One log line: the schedule resolved for a run of `run_steps` steps (ema_decay 0 = EMA off)."""
    n = max(1.0, run_steps)
    steps = dict(run_steps=n, expected_steps=hp.expected_steps,
                 muon_momentum_warmup_steps=hp.muon_momentum_warmup_steps or hp.muon_momentum_warmup_frac * n,
                 warmdown_steps=min(n, hp.warmdown_iters or hp.warmdown_frac * n), qat_steps=hp.qat_start_frac * n,
                 ema_start_step=hp.ema_start_frac * n)
    ema, momentum = ema_target(hp, n), muon_momentum_target(hp, n)
    return ("schedule: " + " ".join(f"{k}:{v:.0f}" for k, v in steps.items())
            + f" muon_momentum:{min(hp.muon_momentum_warmup_start, momentum):.4f}->{momentum:.4f} ema_decay:{ema:.5f}")


def schedule_warning(hp: Hyperparameters, run_steps: float) -> str | None:
    """One `WARNING:` line naming every schedule knob that degenerates in a run of `run_steps` steps (the
    start-of-run estimate: ITERATIONS, or EXPECTED_STEPS for a wallclock run), and what happens; None if none.

    Checked: Muon momentum 0 for the whole run (MUON_MOMENTUM_HORIZON_FRAC x steps <= 1), a momentum
    warmup of under one step or longer than the run, late QAT of 0 steps, a warmdown of under one step.
    The step counts are those of a step-bounded run (progress = step / run_steps), as the loop computes them.
    """
    n = max(1, int(run_steps))
    target, start, found = muon_momentum_target(hp, n), hp.muon_momentum_warmup_start, []
    if target <= 0:
        found.append(f"MUON_MOMENTUM_HORIZON_FRAC={hp.muon_momentum_horizon_frac:.4g} is a time constant of "
                     f"{hp.muon_momentum_horizon_frac * n:.2f} steps (<= 1): Muon momentum is 0.0 for the whole run, "
                     f"not MUON_MOMENTUM_WARMUP_START={start:g} rising (set MUON_MOMENTUM for a fixed target)")
    elif target > start:  # a warmup happens only toward a target above its start
        warmup = hp.muon_momentum_warmup_steps or hp.muon_momentum_warmup_frac * n
        name = ("MUON_MOMENTUM_WARMUP_STEPS" if hp.muon_momentum_warmup_steps else "MUON_MOMENTUM_WARMUP_FRAC")
        if warmup < 1:
            found.append(f"{name}: a momentum warmup of {warmup:.2f} steps: Muon momentum jumps from {start:g} to "
                         f"{target:.4f} after step 0")
        elif warmup > n:
            found.append(f"{name}: a momentum warmup of {warmup:.0f} steps, longer than the run: Muon momentum "
                         f"reaches {(1 - min(1.0, n / warmup)) * start + min(1.0, n / warmup) * target:.4f}, "
                         f"never {target:.4f}")
    if hp.qat_start_frac > 0 and not any(qat_active(s / n, hp.qat_start_frac) for s in range(n)):
        found.append(f"QAT_START_FRAC={hp.qat_start_frac:g}: late QAT of 0 steps (never on; the export is not trained for)")
    warmdown = warmdown_frac_at(0, 0.0, hp)
    if warmdown > 0 and (1.0 - (n - 1) / n) / warmdown >= 1:  # the last step's lr_multiplier is still 1
        name = "WARMDOWN_ITERS" if hp.warmdown_iters else "WARMDOWN_FRAC"
        found.append(f"{name}: a warmdown of {warmdown * n:.2f} steps (< 1): the learning rate never decays")
    basis = "ITERATIONS" if hp.max_wallclock_seconds <= 0 or hp.iterations <= hp.expected_steps else "EXPECTED_STEPS"
    return f"WARNING: schedule at {n} steps ({basis}): " + "; ".join(found) if found else None


def set_step_schedule(optimizers, step: int, progress: float, hp: Hyperparameters, /) -> None:
    """What the trainer sets before the step at `step`, `progress` of the run done: every param group's lr (its
    base_lr times the warmdown multiplier floored at MIN_LR), Muon's momentum (its warmup) and weight decay
    (MUON_WD times the taper of trainer/wd_taper.py). optimizers: trainer.optim.Optimizers (.all, .muon)."""
    for opt in optimizers.all:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * lr_multiplier(progress, warmdown_frac_at(step, progress, hp), hp.min_lr)
    for group in optimizers.muon.param_groups:
        group["momentum"] = muon_momentum_at(step, hp, progress)
        if hp.wd_taper_final_mult != 1:  # else MUON_WD, as built
            group["weight_decay"] = hp.muon_wd * wd_taper_multiplier(progress, hp.wd_taper_start_frac,
                                                                     hp.wd_taper_final_mult)
