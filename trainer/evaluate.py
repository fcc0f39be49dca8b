"""The trainer's evaluation passes (roundtrip, sliding window, score-first TTT) and the eval plan made
before training.

Autocast and compile as in training; the scoring itself lives in eval/ (exact byte LUT, the
challenge's sliding-window rule).
"""

import functools
import time

import torch

from eval.roundtrip import eval_roundtrip
from eval.lora_ttt import (BatchedLoRA, estimate_lora_work, lora_batch_windows, lora_train_batch, lora_work_counter,
                           plan_lora_ttt, run_lora_ttt)
from eval.phased_ttt import plan_phased_ttt, run_phased_ttt
from eval.sliding import count_sliding_windows, eval_sliding, scoring_forward
from eval.ttt import plan_ttt, run_ttt, select_ttt_params, ttt_step_seqs
from trainer.context import RunContext
from model.gpt import GPT
from primitives.progress import Progress
from primitives.settings import Hyperparameters
from shards.format import load_validation_tokens


def eval_device_args(ctx: RunContext) -> dict:
    """The keyword arguments every eval/ pass takes from the run context."""
    return dict(device=ctx.device, rank=ctx.rank, world_size=ctx.world_size, compile_model=ctx.compile,
                autocast_dtype=ctx.autocast_dtype)


def evaluate_roundtrip(ctx: RunContext, hp: Hyperparameters, model: GPT, val_tokens: torch.Tensor, luts) -> dict:
    """{val_loss (nats/token), val_bpb} of `model` on val_tokens (int64 [N]), non-overlapping windows of
    TRAIN_SEQ_LEN in batches of VAL_BATCH_SIZE tokens; the model's train/eval mode is restored."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss, bpb = eval_roundtrip(model, val_tokens, luts, seq_len=hp.train_seq_len,
                                   batch_seqs=max(1, hp.val_batch_size // hp.train_seq_len), **eval_device_args(ctx))
    model.train(was_training)
    return dict(val_loss=loss, val_bpb=bpb)


def evaluate_sliding(ctx: RunContext, hp: Hyperparameters, model: GPT, val_tokens: torch.Tensor, luts, *,
                     stride: int, started: float) -> dict:
    """The sliding-window score (eval.sliding.eval_sliding's dict: val_loss, val_bpb, stride, eval_seconds,
    num_scored_tokens, num_bytes). Its time guard gets what is left of EVAL_MAX_SECONDS since `started`
    (time.perf_counter(); loading and the roundtrip count against the same 600 s). Raises EvalTimeError
    when even the largest stride cannot fit."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        left = hp.eval_max_seconds - (time.perf_counter() - started)
        out = eval_sliding(model, val_tokens, luts, seq_len=hp.train_seq_len, stride=stride,
                           batch_seqs=hp.eval_batch_seqs, max_seconds=max(left, 1e-9),
                           auto_stride=hp.eval_auto_stride, log=ctx.log, **eval_device_args(ctx))
    model.train(was_training)
    return out


def evaluate_ttt(ctx: RunContext, hp: Hyperparameters, model: GPT, val_tokens: torch.Tensor, luts, *, stride: int,
                 epochs: int, started: float, phases: int = 0) -> dict:
    """Legal score-first TTT in place of the sliding pass (eval.ttt.run_ttt's dict: val_loss, val_bpb,
    eval_seconds, num_scored_tokens, num_bytes, num_chunks, num_updates, updates_stopped_at_chunk, ...)
    with the TTT_* settings and `epochs` (the plan's); adapts `model` in place. Its time guard gets what
    is left of EVAL_MAX_SECONDS since `started`. Raises EvalTimeError when scoring alone cannot fit.
    TTT_MODE=phased: eval.phased_ttt.run_phased_ttt with `phases` (the plan's) instead; TTT_MODE=lora:
    eval.lora_ttt.run_lora_ttt (TTT_LORA_*; the model's weights are left as they were)."""
    left = hp.eval_max_seconds - (time.perf_counter() - started)
    if hp.ttt_mode == "lora":
        return run_lora_ttt(model, val_tokens, luts, seq_len=hp.train_seq_len, stride=stride,
                            chunk_tokens=hp.ttt_lora_chunk_tokens, epochs=epochs, lr=hp.ttt_lora_lr,
                            lora_rank=hp.ttt_lora_rank, batch_docs=hp.ttt_lora_batch_docs, eval_batch_seqs=hp.eval_batch_seqs,
                            max_seconds=max(left, 1e-9), log=ctx.log, **eval_device_args(ctx))
    if hp.ttt_mode == "phased":
        return run_phased_ttt(model, val_tokens, luts, seq_len=hp.train_seq_len, stride=stride,
                              phases=phases or hp.ttt_phases,
                              epochs=epochs, lr=hp.ttt_lr, momentum=hp.ttt_momentum, params=hp.ttt_params,
                              batch_seqs=hp.ttt_batch_seqs, eval_batch_seqs=hp.eval_batch_seqs,
                              grad_clip=hp.ttt_grad_clip, max_seconds=max(left, 1e-9), log=ctx.log,
                              **eval_device_args(ctx))
    return run_ttt(model, val_tokens, luts, seq_len=hp.train_seq_len, stride=stride, chunk_tokens=hp.ttt_chunk_tokens,
                   epochs=epochs, lr=hp.ttt_lr, momentum=hp.ttt_momentum, params=hp.ttt_params,
                   batch_seqs=hp.ttt_batch_seqs, eval_batch_seqs=hp.eval_batch_seqs, grad_clip=hp.ttt_grad_clip,
                   max_seconds=max(left, 1e-9), log=ctx.log, **eval_device_args(ctx))


def seconds_per_call(ctx: RunContext, call, repeats: int = 3, label: str = "timing") -> float:
    """Mean seconds of `call()` over `repeats` calls after one warm-up (compilation), synchronized."""
    bar = Progress(label, repeats + 1, "calls")
    call()
    ctx.sync()
    bar.update()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
        bar.update()
    ctx.sync()
    bar.close()
    return (time.perf_counter() - t0) / repeats


def scored_context(hp: Hyperparameters) -> int:
    """The positions before the ones a window after the first scores: TRAIN_SEQ_LEN - EVAL_STRIDE."""
    return hp.train_seq_len - min(hp.eval_stride, hp.train_seq_len)


def time_eval_forward(ctx: RunContext, model: GPT, hp: Hyperparameters) -> float:
    """Seconds of one forward of [EVAL_BATCH_SEQS, TRAIN_SEQ_LEN] synthetic tokens (no val token is
    read), compiled and autocast as the eval runs it: the head on the last EVAL_STRIDE positions only."""
    score = scoring_forward(model, ctx.compile)
    x = torch.zeros(hp.eval_batch_seqs, hp.train_seq_len, dtype=torch.int64, device=ctx.device)

    def call():
        with torch.inference_mode(), ctx.autocast():
            score(x, scored_context(hp))

    return seconds_per_call(ctx, call, label="eval plan: timing the eval forward")


def time_ttt_step(ctx: RunContext, model: GPT, hp: Hyperparameters) -> float:
    """Seconds of one TTT update as eval/ttt.py runs it: forward + backward of this rank's share of a
    TTT batch ([ttt_step_seqs / ranks, TRAIN_SEQ_LEN] synthetic tokens) with only TTT_PARAMS requiring
    grad, then SGD; compiled and autocast as the eval runs it. Changes `model`'s weights (a fresh model)."""
    cap_tokens = hp.ttt_chunk_tokens if hp.ttt_mode == "chunked" else hp.ttt_batch_seqs * hp.train_seq_len  # phased: uncapped
    batch = ttt_step_seqs(hp.ttt_batch_seqs, cap_tokens, hp.train_seq_len, ctx.world_size) // ctx.world_size
    chosen = select_ttt_params(model, hp.ttt_params)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in chosen:
        p.requires_grad_(True)
    forward = torch.compile(model, dynamic=False) if ctx.compile else model
    optimizer = torch.optim.SGD(chosen, lr=1e-9, momentum=hp.ttt_momentum)
    x = torch.zeros(max(1, batch), hp.train_seq_len, dtype=torch.int64, device=ctx.device)

    def call():
        with ctx.autocast():
            forward(x, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = seconds_per_call(ctx, call, label="ttt plan: timing a TTT step")
    for p in model.parameters():
        p.requires_grad_(True)
    return seconds


def plan_strides(hp: Hyperparameters) -> list:
    """The strides a TTT plan may choose, preferred first: EVAL_STRIDE, then with EVAL_AUTO_STRIDE every
    coarser one up to TRAIN_SEQ_LEN."""
    return list(range(hp.eval_stride, hp.train_seq_len + 1)) if hp.eval_auto_stride else [hp.eval_stride]


def plan_ttt_from_timings(hp: Hyperparameters, *, forward_seconds: float, step_seconds: float, num_val_tokens: int,
                          world_size: int = 1) -> dict:
    """eval.ttt.plan_ttt for this run's settings from the measured seconds of one eval forward batch
    and one TTT step: strides >= EVAL_STRIDE with EVAL_AUTO_STRIDE, else EVAL_STRIDE; the roundtrip
    (windows of TRAIN_SEQ_LEN at the same speed) counted in. Returns plan_ttt's dict plus
    roundtrip_seconds. Used by the trainer's plan and by tools/gpu_check.py. TTT_MODE=phased:
    eval.phased_ttt.plan_phased_ttt (TTT_PHASES; the dict adds phases)."""
    b, seq_len, n = hp.eval_batch_seqs, hp.train_seq_len, num_val_tokens - 1
    roundtrip = forward_seconds * count_sliding_windows(n, seq_len, seq_len) / (b * world_size)
    strides = plan_strides(hp)
    if hp.ttt_mode == "phased":
        plan = plan_phased_ttt(forward_seconds=forward_seconds, train_seconds=step_seconds, num_val_tokens=num_val_tokens,
                               seq_len=seq_len, strides=strides, epochs=hp.ttt_epochs, phases=hp.ttt_phases,
                               eval_batch_seqs=b, batch_seqs=hp.ttt_batch_seqs, max_seconds=hp.eval_max_seconds,
                               roundtrip_seconds=roundtrip, world_size=world_size)
        return dict(plan, roundtrip_seconds=roundtrip)
    plan = plan_ttt(forward_seconds=forward_seconds, train_seconds=step_seconds, num_val_tokens=num_val_tokens,
                    seq_len=seq_len, strides=strides, epochs=hp.ttt_epochs, chunk_tokens=hp.ttt_chunk_tokens,
                    eval_batch_seqs=b, batch_seqs=hp.ttt_batch_seqs, max_seconds=hp.eval_max_seconds,
                    roundtrip_seconds=roundtrip, world_size=world_size)
    return dict(plan, roundtrip_seconds=roundtrip)


def plan_final_eval(ctx: RunContext, model_config: dict, hp: Hyperparameters, num_val_tokens: int) -> dict:
    """The final eval's plan before training: dict(stride, ttt_epochs) (ttt_epochs 0: the sliding pass), with
    ttt_phases too when TTT_MODE=phased plans TTT (eval.phased_ttt.plan_phased_ttt).

    Without TTT: EVAL_STRIDE, or with EVAL_AUTO_STRIDE the smallest stride that fits (plan_eval_stride).
    With TTT_ENABLED: the forward and the TTT step are timed on a fresh model (time_eval_forward,
    time_ttt_step) and eval.ttt.plan_ttt picks the stride (>= EVAL_STRIDE when EVAL_AUTO_STRIDE, else
    EVAL_STRIDE) and the most epochs <= TTT_EPOCHS that fit 90% of EVAL_MAX_SECONDS with the roundtrip,
    or skips TTT; logs `ttt_plan:` with the numbers and the reason. The eval's own guards still check
    the real speed. TTT_MODE=lora: plan_lora_eval.
    """
    if not (hp.ttt_enabled and hp.ttt_epochs) or hp.skip_final_eval:
        stride = plan_eval_stride(ctx, model_config, hp, num_val_tokens) if (
            hp.eval_auto_stride and not hp.skip_final_eval) else hp.eval_stride
        return dict(stride=stride, ttt_epochs=0)
    if hp.ttt_mode == "lora":
        return plan_lora_eval(ctx, model_config, hp, num_val_tokens)
    model = GPT(**model_config).to(ctx.device).eval()
    per_batch, step = time_eval_forward(ctx, model, hp), time_ttt_step(ctx, model, hp)
    plan = plan_ttt_from_timings(hp, forward_seconds=per_batch, step_seconds=step, num_val_tokens=num_val_tokens,
                                 world_size=ctx.world_size)
    phases = f" phases {plan['phases']}" if "phases" in plan else ""
    ctx.log(f"ttt_plan: {1000 * per_batch:.1f}ms per forward batch of {hp.eval_batch_seqs}x{hp.train_seq_len}, "
            f"{1000 * step:.1f}ms per TTT step, {num_val_tokens - 1} val targets: stride {plan['stride']} epochs "
            f"{plan['epochs']}{phases} projected {plan['projected_seconds']:.0f}s with the roundtrip "
            f"(EVAL_MAX_SECONDS={hp.eval_max_seconds:g})" + f"; {plan['reason']}" * bool(plan["reason"]))
    return dict(stride=plan["stride"], ttt_epochs=plan["epochs"], **({"ttt_phases": plan["phases"]} if phases else {}))


def plan_eval_stride(ctx: RunContext, model_config: dict, hp: Hyperparameters, num_val_tokens: int) -> int:
    """EVAL_AUTO_STRIDE before training: the smallest stride >= EVAL_STRIDE whose projected eval fits.

    Times 3 forward passes of [EVAL_BATCH_SEQS, TRAIN_SEQ_LEN] synthetic tokens on a fresh model
    (time_eval_forward), before the training clock.
    Projection (seconds) = seconds per batch x (roundtrip windows + sliding windows) / (batch x ranks),
    and must fit 90% of EVAL_MAX_SECONDS (the rest: loading, compilation, the pre-quant pass is not
    counted). The eval's own guard still checks the real speed (and restarts at a larger stride).
    Logs `eval_plan:` with the numbers; returns the stride (TRAIN_SEQ_LEN if none fits).
    """
    b, seq_len = hp.eval_batch_seqs, hp.train_seq_len
    per_batch = time_eval_forward(ctx, GPT(**model_config).to(ctx.device).eval(), hp)
    n = num_val_tokens - 1
    project = lambda s: per_batch * (count_sliding_windows(n, seq_len, seq_len)
                                     + count_sliding_windows(n, seq_len, s)) / (b * ctx.world_size)
    stride = next((s for s in range(hp.eval_stride, seq_len) if project(s) <= 0.9 * hp.eval_max_seconds), seq_len)
    ctx.log(f"eval_plan: {1000 * per_batch:.1f}ms per batch of {b}x{seq_len}, {n} val targets: projected "
            f"{project(hp.eval_stride):.0f}s at EVAL_STRIDE={hp.eval_stride}, {project(stride):.0f}s at stride {stride} "
            f"(EVAL_MAX_SECONDS={hp.eval_max_seconds:g})")
    return stride


def time_lora_ttt(ctx: RunContext, model: GPT, hp: Hyperparameters) -> tuple:
    """(seconds of one scoring forward, seconds of one batched adapter step) as eval/lora_ttt.py runs them on
    this rank with TTT_LORA_BATCH_DOCS slots: a forward of [eval.lora_ttt.lora_batch_windows, TRAIN_SEQ_LEN]
    under inference mode, its rows spread over the slots, and fwd + bwd + Adam of every slot on [slots,
    TRAIN_SEQ_LEN] (the longest a step's rows get), rank-TTT_LORA_RANK adapters (removed after)."""
    slots = hp.ttt_lora_batch_docs
    windows = lora_batch_windows(hp.ttt_lora_chunk_tokens, hp.eval_stride, ctx.world_size, hp.eval_batch_seqs, slots)
    x = torch.zeros(windows, hp.train_seq_len, dtype=torch.int64, device=ctx.device)
    tokens = torch.zeros(hp.train_seq_len + 1, dtype=torch.int64, device=ctx.device)
    spans = [(s, 0, hp.train_seq_len - hp.ttt_lora_chunk_tokens, hp.train_seq_len) for s in range(slots)]
    saved = [(p, p.requires_grad) for p in model.parameters()]
    lora = BatchedLoRA(model, hp.ttt_lora_rank, slots)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        forward = scoring_forward(model, ctx.compile)

        def score():
            lora.set_rows(torch.arange(windows) % slots)
            with torch.inference_mode(), ctx.autocast():
                forward(x, scored_context(hp))

        def step():
            lora_train_batch(model, lora, tokens, spans, autocast_dtype=ctx.autocast_dtype)
            lora.adam_step(list(range(slots)), 1e-9)

        return (seconds_per_call(ctx, score, label="lora plan: timing a scoring forward"),
                seconds_per_call(ctx, step, label="lora plan: timing a batched adapter step"))
    finally:
        lora.remove()
        for p, flag in saved:
            p.requires_grad_(flag)


def lora_work_at(hp: Hyperparameters, num_val_tokens: int, world_size: int, tokens=None, assumed_docs: int = 0):
    """stride -> the work of TTT_MODE=lora at that stride (memoized): eval.lora_ttt.count_lora_work on the first
    num_val_tokens of tokens (int64, the val stream the eval scores; its schedule built once), else
    estimate_lora_work for assumed_docs documents; the dict adds windows (scoring windows per forward,
    eval.lora_ttt.lora_batch_windows) and counted (which of the two)."""
    common = dict(chunk_tokens=hp.ttt_lora_chunk_tokens, batch_docs=hp.ttt_lora_batch_docs, world_size=world_size)
    counter = lora_work_counter(tokens[:num_val_tokens], seq_len=hp.train_seq_len, **common) if tokens is not None else None

    @functools.cache
    def work_at(stride: int) -> dict:
        windows = lora_batch_windows(hp.ttt_lora_chunk_tokens, stride, world_size, hp.eval_batch_seqs, hp.ttt_lora_batch_docs)
        if counter is not None:
            return dict(counter(stride, windows), windows=windows, counted=True)
        return dict(estimate_lora_work(num_val_tokens=num_val_tokens, num_docs=assumed_docs, stride=stride,
                                       batch_windows=windows, **common), windows=windows, counted=False)

    return work_at


def plan_lora_from_timings(hp: Hyperparameters, *, eval_forward_seconds: float, forward_seconds: float,
                           step_seconds: float, work_at, num_val_tokens: int, world_size: int = 1) -> dict:
    """eval.lora_ttt.plan_lora_ttt for this run's settings: the strides of plan_strides (as the chunked plan),
    forward_seconds and step_seconds from time_lora_ttt, work_at from lora_work_at; the roundtrip and the
    sliding pass (when TTT is skipped) from eval_forward_seconds, one forward of [EVAL_BATCH_SEQS,
    TRAIN_SEQ_LEN]. Returns plan_lora_ttt's dict plus roundtrip_seconds. Used by the trainer's plan and by
    tools/gpu_check.py."""
    per_window, seq_len, n = eval_forward_seconds / (hp.eval_batch_seqs * world_size), hp.train_seq_len, num_val_tokens - 1
    roundtrip = per_window * count_sliding_windows(n, seq_len, seq_len)
    plan = plan_lora_ttt(forward_seconds=forward_seconds, step_seconds=step_seconds, work_at=work_at,
                         strides=plan_strides(hp), epochs=hp.ttt_epochs, max_seconds=hp.eval_max_seconds,
                         sliding_seconds=lambda s: per_window * count_sliding_windows(n, seq_len, s),
                         roundtrip_seconds=roundtrip)
    return dict(plan, roundtrip_seconds=roundtrip)


def plan_lora_eval(ctx: RunContext, model_config: dict, hp: Hyperparameters, num_val_tokens: int) -> dict:
    """TTT_MODE=lora's plan before training: plan_lora_from_timings (the most epochs <= TTT_EPOCHS whose projection
    fits 90% of EVAL_MAX_SECONDS, at EVAL_STRIDE or with EVAL_AUTO_STRIDE the first stride from it up where they
    fit; else 0 epochs: the sliding pass) from the schedule of the val stream the eval scores
    (lora_work_at, counted at each stride tried) and the scoring forward and batched step timed on a fresh
    model by time_lora_ttt (the roundtrip from time_eval_forward). Logs `ttt_plan:`; returns dict(stride,
    ttt_epochs)."""
    tokens = load_validation_tokens(hp.data_path, vocab_size=hp.vocab_size)
    work_at = lora_work_at(hp, num_val_tokens, ctx.world_size, tokens)
    model = GPT(**model_config).to(ctx.device).eval()
    per_batch = time_eval_forward(ctx, model, hp)
    forward_seconds, step_seconds = time_lora_ttt(ctx, model, hp)
    plan = plan_lora_from_timings(hp, eval_forward_seconds=per_batch, forward_seconds=forward_seconds,
                                  step_seconds=step_seconds, work_at=work_at, num_val_tokens=num_val_tokens,
                                  world_size=ctx.world_size)
    work, timed = plan["work"], work_at(hp.eval_stride)["windows"]
    ctx.log(f"ttt_plan: TTT_MODE=lora {1000 * forward_seconds:.1f}ms per scoring forward of {timed}x{hp.train_seq_len}, "
            f"{1000 * step_seconds:.1f}ms per batched adapter step of {hp.ttt_lora_batch_docs}x{hp.train_seq_len}, "
            f"{num_val_tokens - 1} val targets in {work['documents']} documents: {work['rounds']} rounds of "
            f"TTT_LORA_BATCH_DOCS={hp.ttt_lora_batch_docs} ({work['forwards']} forwards, {work['update_rounds']} with "
            f"steps): stride {plan['stride']} epochs {plan['epochs']} projected {plan['projected_seconds']:.0f}s with the "
            f"roundtrip (EVAL_MAX_SECONDS={hp.eval_max_seconds:g})" + f"; {plan['reason']}" * bool(plan["reason"]))
    return dict(stride=plan["stride"], ttt_epochs=plan["epochs"])
