"""The wallclock-budgeted training loop: micro-batches, DDP, Muon + AdamW, schedules, late QAT, EMA,
GPTQ calibration inside the clock."""

import contextlib
import copy
import dataclasses
import math
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from quant.gptq import collect_gptq_hessians
from trainer.context import BUNDLE_KIND, RunContext
from shards.loader import DistributedTokenLoader
from model.gpt import GPT
from trainer.optim import build_optimizers, step_optimizers
from trainer.schedule import (
    EMA, describe_schedule, ema_decay_at, qat_active, run_progress, run_steps_estimate, schedule_warning,
    set_step_schedule, warmup_graph_states)
from primitives.settings import Hyperparameters


H100_BF16_PEAK_FLOPS = 989e12
# Inductor options of the compiled training step. At most 20 distinct input/output buffers per fused kernel: the
# backward otherwise fuses every layer's x0-gradient term and the U-Net skip terms into one mix-order reduction
# with 24 pointers and six column accumulators, whose least-spilling launch config spills 820 B per thread
# (tools/bench_step.py --cpu-twin, torch 2.11, default preset); capped, no kernel spills, for +0.2 GiB per
# micro-batch. Applied only where this torch has the option.
STEP_INDUCTOR_OPTIONS = {"max_fusion_unique_io_buffers": 20}


def step_compile_options() -> dict:
    """STEP_INDUCTOR_OPTIONS that this torch's Inductor knows (torch.compile raises on an unknown option)."""
    import torch._inductor.config as inductor_config

    return {k: v for k, v in STEP_INDUCTOR_OPTIONS.items() if hasattr(inductor_config, k)}


class NonFiniteLossError(RuntimeError):
    """The train loss became NaN or inf (the step is in the message); no artifact is written."""


class NonFiniteWatch:
    """The first step (0-based) whose train loss was NaN or inf, kept on the device in `flag` (int64, -1: none),
    and read without stalling a GPU. `poll(step)` every `every` steps reads the snapshot it copied `every`
    steps earlier (a non-blocking copy to pinned host memory, long finished: the GPU runs about one step
    behind the host) and starts the next; `check()` reads the flag itself, a sync: at log steps (which
    sync anyway) and at the end of training. On a CPU (no `asynchronous`) every poll is a check. Both raise
    NonFiniteLossError naming the first bad step, whenever it is seen."""

    def __init__(self, device: torch.device, every: int = 10, asynchronous: bool | None = None):
        self.asynchronous = device.type == "cuda" if asynchronous is None else asynchronous
        self.every, self.on_cuda = every, device.type == "cuda"
        self.flag = torch.full((), -1, dtype=torch.int64, device=device)
        self.host = torch.full((), -1, dtype=torch.int64, pin_memory=self.on_cuda)
        self.copied = None  # (the snapshot's event, or True on a CPU) while a snapshot waits to be read

    def record(self, loss: torch.Tensor, step: int) -> None:
        """On the device, no sync: remember `step` if `loss` is not finite and no earlier step was."""
        self.flag.copy_(torch.where(~torch.isfinite(loss) & (self.flag < 0), step, self.flag))

    def reset(self) -> None:
        self.flag.fill_(-1)
        self.copied = None

    def poll(self, step: int) -> None:
        if not self.asynchronous:
            return self.check()
        if step % self.every:
            return
        if self.copied is not None:
            if self.on_cuda:
                self.copied.synchronize()  # recorded `every` steps ago: done unless the GPU is that far behind
            self._raise_if(int(self.host))
        self.host.copy_(self.flag, non_blocking=self.on_cuda)
        self.copied = True
        if self.on_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def check(self) -> None:
        self._raise_if(int(self.flag))

    @staticmethod
    def _raise_if(first_bad: int) -> None:
        if first_bad >= 0:
            raise NonFiniteLossError(f"non-finite train loss at step {first_bad + 1}")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What train() measured: optimizer steps taken, training seconds on the run's clock (GPTQ
    calibration and the EMA swap included), the per-step train loss (mean over ranks, nats), and the
    signal number that stopped the run early (0: it ran to its cap or ITERATIONS)."""

    steps: int
    train_seconds: float
    train_losses: list
    stop_signal: int = 0


def time_calibration_batch(ctx: RunContext, model: GPT, hp: Hyperparameters, local_tokens: int) -> float:
    """Seconds of one GPTQ calibration batch ([local_tokens / TRAIN_SEQ_LEN, TRAIN_SEQ_LEN] synthetic tokens
    through collect_gptq_hessians: the forward with its hooks), before the clock; no train token is read."""
    x = torch.zeros(max(1, local_tokens // hp.train_seq_len), hp.train_seq_len, dtype=torch.int64, device=ctx.device)
    ctx.sync()
    c0 = time.perf_counter()
    collect_gptq_hessians(model, lambda: (x, x), 1, autocast=ctx.autocast)
    ctx.sync()
    return time.perf_counter() - c0


def train(ctx: RunContext, hp: Hyperparameters, model: GPT, loader: DistributedTokenLoader, flops_per_token: float,
          val_eval=None, stop=None) -> TrainResult:
    """The wallclock-budgeted loop; returns a TrainResult.

    The clock covers every step plus the EMA swap; validation passes (VAL_LOSS_EVERY) pause it, as
    in the official script. All ranks stop on the same step (a MAX all-reduce of the stop flag).
    `stop`: a one-element list a signal handler sets to the signal's number (the run's SignalGuard.flag;
    None: the call runs under its own SignalGuard, in the package). A signal seen when the loop stops makes the result's
    stop_signal; one that comes later (EMA swap, GPTQ calibration) is left to the caller.
    """
    if BUNDLE_KIND == "package":
        if stop is None:  # no caller's guard: the loop's own, for the signals (trainer/interrupt.py)
            from trainer.interrupt import SignalGuard

            with SignalGuard() as guard:
                return train(ctx, hp, model, loader, flops_per_token, val_eval, guard.flag)
    is_cuda = ctx.device.type == "cuda"
    accum = hp.resolve_grad_accum(ctx.world_size, is_cuda)
    local_tokens = hp.train_batch_tokens // (ctx.world_size * accum)
    use_compile = ctx.compile
    # broadcast_buffers=False (the official script's setting): the buffers (RoPE frequencies, QAT
    # gates) are equal on every rank, so DDP's per-forward buffer broadcast is wasted traffic.
    ddp = DistributedDataParallel(model, device_ids=[ctx.local_rank] if is_cuda else None,
                                  broadcast_buffers=False) if ctx.world_size > 1 else model
    fwd = (torch.compile(ddp, dynamic=False, fullgraph=ctx.world_size == 1, options=step_compile_options())
           if use_compile else ddp)
    optimizers = build_optimizers(model, hp, is_cuda=is_cuda, rank=ctx.rank, world_size=ctx.world_size, compile=use_compile)
    ema = EMA(model, hp.ema_warmup) if hp.ema_decay or hp.ema_horizon_frac else None
    timed = model.gptq_hessians is not None and hp.max_wallclock_seconds > 0  # only QUANT_GPTQ=1 reserves time
    gptq_reserve = hp.gptq_reserve_seconds * timed
    if gptq_reserve >= hp.max_wallclock_seconds > 0:  # (checked here: only QUANT_GPTQ=1 reserves time)
        raise ValueError(f"GPTQ_RESERVE_SECONDS={hp.gptq_reserve_seconds}: expected < MAX_WALLCLOCK_SECONDS="
                         f"{hp.max_wallclock_seconds} with QUANT_GPTQ=1")
    # the reserve holds at least two calibration batches, timed before the clock (a slow CPU or GPU
    # must not push calibration past the cap; it also stops at the cap, collect_gptq_hessians)
    calib_seconds = time_calibration_batch(ctx, model, hp, local_tokens) if timed else 0.0
    if 2 * calib_seconds > gptq_reserve:
        gptq_reserve = math.ceil(20 * calib_seconds) / 10
        if gptq_reserve >= hp.max_wallclock_seconds:
            raise ValueError(f"MAX_WALLCLOCK_SECONDS={hp.max_wallclock_seconds}: expected room for two GPTQ calibration "
                             f"batches of {calib_seconds:.1f}s, or QUANT_GPTQ=0")
        if BUNDLE_KIND == "package":  # (the next line logs the reserve)
            ctx.log(f"gptq_reserve: GPTQ_RESERVE_SECONDS={hp.gptq_reserve_seconds} raised to {gptq_reserve}s: one "
                    f"calibration batch takes {calib_seconds:.2f}s (timed before the clock), the reserve holds two")
    cap_ms = 1000.0 * (hp.max_wallclock_seconds - gptq_reserve)
    if gptq_reserve:
        ctx.log(f"gptq_reserve_seconds:{gptq_reserve} training cap:{cap_ms:.0f}ms")
    if BUNDLE_KIND == "package":  # checkpoints are the kit's: refused before the clock in the packed script
        ckpt_path, ckpt = ctx.run_dir / "checkpoint.pt", None
        if hp.checkpoint_every or hp.resume:
            from kit import checkpoint as ckpt
    if BUNDLE_KIND == "package":  # the kit's early stop on a NaN loss (a record's file reports it: status nonfinite_*)
        nonfinite = NonFiniteWatch(ctx.device)

    def one_step(step: int, progress: float) -> torch.Tensor:
        set_step_schedule(optimizers, step, progress, hp)
        total = torch.zeros((), device=ctx.device)
        for micro in range(accum):
            x, y = loader.next_batch(local_tokens, hp.train_seq_len)
            sync_ctx = ddp.no_sync() if ctx.world_size > 1 and micro < accum - 1 else contextlib.nullcontext()
            with sync_ctx, ctx.autocast():
                loss = fwd(x, y)
            (loss / accum).backward()
            total += loss.detach() / accum
        step_optimizers(model, optimizers, hp, ema, ema_decay_at(step, progress, hp) if ema else 0.0)
        if BUNDLE_KIND == "package":
            nonfinite.record(total, step)
        return total

    if hp.warmup_steps > 0:  # prime compile/allocator, then restore the initial state (official)
        initial = copy.deepcopy([model.state_dict(), [o.state_dict() for o in optimizers.all],
                                 (loader.shard_index, loader.offset)])
        # each graph the run will use (looped, QAT on) is compiled here, not on the clock
        for i, (looping, qat) in enumerate(warmup_graph_states(hp, model.has_qat)):
            model.looping_active = looping
            model.set_qat(qat)
            one_step(i, hp.enable_looping_at * looping)
        model.set_qat(False)
        model.load_state_dict(initial[0])
        for opt, sd in zip(optimizers.all, initial[1]):
            opt.load_state_dict(sd)
        loader.seek(*initial[2])
        ema = EMA(model, hp.ema_warmup) if ema else None
        if BUNDLE_KIND == "package":
            nonfinite.reset()
            ctx.log(f"warmup_steps:{hp.warmup_steps} done, state restored")

    step, train_ms, losses = 0, 0.0, []  # losses stay on the device: no sync per step

    def history(values) -> torch.Tensor:  # per-step train loss averaged over ranks, one collective
        return ctx.mean_over_ranks(torch.stack(values)) if values else torch.zeros(0, device=ctx.device)

    if BUNDLE_KIND == "package":  # CHECKPOINT_EVERY and RESUME=1 inside training (kit/checkpoint.py)
        def checkpoint(ms: float) -> None:
            hist = history(losses)
            if ctx.is_main:
                ckpt.save_checkpoint(ckpt_path, model, optimizers.all, ema, step, loader, ms / 1000, hist)

        if hp.resume:
            step, train_seconds, losses = ckpt.load_checkpoint(ckpt_path, model, optimizers.all, ema, loader)
            train_ms = 1000.0 * train_seconds
            ctx.log(f"resumed from {ckpt_path} at step:{step}")
    qat_on = model.looping_active = False
    if BUNDLE_KIND == "package":  # the kit's diagnostics and its advice on a schedule that degenerates at this length
        ctx.log(f"grad_accum_steps:{accum} micro_batch_seqs:{local_tokens // hp.train_seq_len}")  # per GPU count
        ctx.log(describe_schedule(hp, run_steps_estimate(0, 0.0, hp)))
        warning = schedule_warning(hp, run_steps_estimate(0, 0.0, hp))
        if warning and not hp.resume:
            ctx.log(warning)
    stop = [0] if stop is None else stop  # (a record's file installs no handler: it stays 0)
    ctx.sync()
    t0 = time.perf_counter()
    log_t, log_step = t0, step
    while True:
        elapsed_ms = train_ms + 1000.0 * (time.perf_counter() - t0)
        progress = run_progress(elapsed_ms, cap_ms, step, hp.iterations)
        step_avg = elapsed_ms / max(1, step) if step else 0.0
        signum = stop[0]  # read once: the loop stops for this signal or for none
        want_stop = step >= hp.iterations or bool(signum) or (cap_ms > 0 and elapsed_ms + step_avg >= cap_ms)
        last = want_stop if ctx.world_size == 1 else ctx.mean_over_ranks(  # any rank stops: all stop
            torch.tensor(float(want_stop), device=ctx.device)).item() > 0
        if BUNDLE_KIND == "package":
            if last:
                nonfinite.check()  # before the last validation, the EMA swap, GPTQ and the artifact
        if val_eval is not None and hp.val_loss_every and (last or (step and step % hp.val_loss_every == 0)):
            ctx.sync()
            train_ms += 1000.0 * (time.perf_counter() - t0)
            v = val_eval(model)
            ctx.log(f"step:{step}/{hp.iterations} val_loss:{v['val_loss']:.4f} val_bpb:{v['val_bpb']:.4f} "
                    f"train_time:{train_ms:.0f}ms step_avg:{train_ms / max(1, step):.2f}ms")
            t0 = log_t = time.perf_counter()
            log_step = step
        if last:
            break
        if qat_active(progress, hp.qat_start_frac) and not qat_on:
            model.set_qat(True)
            qat_on = True
            if BUNDLE_KIND == "package":  # (the kit's progress diagnostics, as the two below)
                ctx.log(f"late_qat:on step:{step} train_time:{elapsed_ms:.0f}ms progress:{progress:.3f}")
        if hp.num_loops and not model.looping_active and progress >= hp.enable_looping_at:
            model.looping_active = True
            if BUNDLE_KIND == "package":
                ctx.log(f"layer_loop:on step:{step} progress:{progress:.3f} order:{','.join(map(str, model.loop_order))}")
        loss = one_step(step, progress)
        losses.append(loss)
        step += 1
        if BUNDLE_KIND == "package":
            nonfinite.poll(step)  # on a GPU: no sync (a snapshot copied 10 steps before)
        if step % hp.train_log_every == 0 or step == 1:
            ctx.sync()
            if BUNDLE_KIND == "package":
                nonfinite.check()
            now = time.perf_counter()
            ms = train_ms + 1000.0 * (now - t0)
            tok_s = (step - log_step) * hp.train_batch_tokens / max(1e-9, now - log_t)
            line = (f"step:{step}/{hp.iterations} train_loss:{ctx.mean_over_ranks(loss).item():.4f} train_time:{ms:.0f}ms "
                    f"step_avg:{ms / step:.2f}ms tok_s:{tok_s:.0f}")
            if BUNDLE_KIND == "package":  # MFU: the kit's diagnostic (no FLOP count in a record's file)
                if is_cuda:
                    line += f" mfu:{100 * flops_per_token * tok_s / (H100_BF16_PEAK_FLOPS * ctx.world_size):.2f}%"
            ctx.log(line)
            log_t, log_step = now, step
        if BUNDLE_KIND == "package":
            if hp.checkpoint_every and step % hp.checkpoint_every == 0:
                checkpoint(train_ms + 1000 * (time.perf_counter() - t0))
    if ema and not signum:  # the swap counts as training time
        ema.copy_to_model()
    model.set_qat(False)
    model.looping_active = bool(hp.num_loops)  # the artifact is evaluated looped (GPT(**config))
    if model.gptq_hessians is not None and not signum:
        c0 = time.perf_counter()  # GPTQ calibration on train batches, inside the clock (PR #1763)
        # its clock waits for the GPU: CUDA runs batches behind the launches (an H200 run ended 0.13 s past the cap)
        deadline = t0 + (hp.max_wallclock_seconds or math.inf) - train_ms / 1000
        fits = torch.tensor(float(c0 + calib_seconds <= deadline), device=ctx.device)
        if ctx.mean_over_ranks(fits).item() == 1.0:  # every rank has time for one batch (each needs every H)
            hs, n = collect_gptq_hessians(model, lambda: loader.next_batch(local_tokens, hp.train_seq_len),
                                          hp.gptq_calib_batches, deadline=deadline, autocast=ctx.autocast,
                                          batch_seconds=calib_seconds, clock=lambda: ctx.sync() or time.perf_counter(),
                                          cross_docs=hp.gptq_calib_cross_docs)
            model.gptq_hessians = {k: ctx.mean_over_ranks(h) for k, h in hs.items()}  # each rank read its own batches
            ctx.sync()
            line = (f"gptq_calibration batches:{n} tokens:{n * local_tokens * ctx.world_size} "
                    f"time:{1000 * (time.perf_counter() - c0):.0f}ms reserve:{1000 * gptq_reserve:.0f}ms")
            if BUNDLE_KIND == "package":  # why it read fewer (the kit's diagnostic)
                line += (f" (of GPTQ_CALIB_BATCHES={hp.gptq_calib_batches}: stopped at MAX_WALLCLOCK_SECONDS="
                         f"{hp.max_wallclock_seconds:g})" * (n < hp.gptq_calib_batches))
            ctx.log(line)
        else:
            model.gptq_hessians = {}  # the export quantizes every matrix with GPTQ-lite
            line = "WARNING: gptq_calibration skipped"
            if BUNDLE_KIND == "package":  # why (the kit's diagnostic)
                line += (f": {max(0.0, deadline - c0):.1f}s left of MAX_WALLCLOCK_SECONDS={hp.max_wallclock_seconds:g}, "
                         f"one batch takes {calib_seconds:.1f}s: the export uses GPTQ-lite")
            ctx.log(line)
    ctx.sync()
    train_ms += 1000 * (time.perf_counter() - t0)
    if BUNDLE_KIND == "package":  # signals are the kit's (a record's file installs no handler: signum stays 0)
        if signum:
            import signal

            ctx.log(f"stopped by signal {signal.Signals(signum).name} at step:{step}")
            if hp.checkpoint_every:
                checkpoint(train_ms)
                ctx.log(f"checkpoint:{ckpt_path} (continue with RESUME=1)")
    if not signum:  # the auditor reads stopping_early (tools/auditor/audit_logs.py)
        ctx.log(f"stopping_early: wallclock_cap train_time:{train_ms:.0f}ms step:{step}/{hp.iterations}"
                if step < hp.iterations else f"training done step:{step}")
    if BUNDLE_KIND == "package":
        if hp.max_wallclock_seconds > 0:
            ctx.log(describe_schedule(hp, step))
    return TrainResult(step, train_ms / 1000.0, history(losses).tolist(), signum)
