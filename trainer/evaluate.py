"""The trainer's evaluation passes (roundtrip, sliding window, score-first TTT) and the eval plan made
before training.

Autocast and compile as in training; the scoring itself lives in eval/ (exact byte LUT, the
challenge's sliding-window rule).
"""

import time

import torch

from eval.roundtrip import eval_roundtrip
from eval.lora_batch import BatchedLoRA, lora_train_batch
from eval.lora_ttt import lora_batch_windows
from eval.plan import EvalPlan, lora_work_at, plan_ttt_eval
from eval.sliding import count_sliding_windows, eval_sliding, scoring_forward
from eval.ttt import select_ttt_params, ttt_step_seqs
from eval.ttt_modes import TTT_MODES, mode_settings, run_mode
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


def evaluate_ttt(ctx: RunContext, hp: Hyperparameters, model: GPT, val_tokens: torch.Tensor, luts, *, plan: EvalPlan,
                 started: float) -> dict:
    """Legal score-first TTT of TTT_MODE in place of the sliding pass (eval.ttt_modes.run_mode's dict: val_loss,
    val_bpb, eval_seconds, num_scored_tokens, num_bytes, num_chunks, num_updates, updates_stopped_at_chunk, ...)
    with the mode's TTT_* settings and the plan's stride, epochs and (a mode with phases) phases; SGD modes adapt
    `model` in place. Its time guard gets what is left of EVAL_MAX_SECONDS since `started`. Raises EvalTimeError
    when scoring alone cannot fit."""
    left = hp.eval_max_seconds - (time.perf_counter() - started)
    settings = mode_settings(hp.ttt_mode, hp)
    if plan.phases and "phases" in settings:
        settings["phases"] = plan.phases
    return run_mode(hp.ttt_mode, model, val_tokens, luts, seq_len=hp.train_seq_len, stride=plan.stride,
                    epochs=plan.epochs, eval_batch_seqs=hp.eval_batch_seqs, max_seconds=max(left, 1e-9), log=ctx.log,
                    **eval_device_args(ctx), **settings)


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
    # a mode whose units are chunks caps a step at a chunk's sequences; phases are not capped
    cap_tokens = hp.ttt_chunk_tokens if "chunk_tokens" in TTT_MODES[hp.ttt_mode].fields else hp.ttt_batch_seqs * hp.train_seq_len
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


def plan_final_eval(ctx: RunContext, model_config: dict, hp: Hyperparameters, num_val_tokens: int) -> EvalPlan:
    """The final eval's plan before training (eval.plan.EvalPlan; epochs 0: the sliding pass).

    Without TTT: EVAL_STRIDE, or with EVAL_AUTO_STRIDE the smallest stride that fits (plan_eval_stride).
    With TTT_ENABLED: the eval forward (time_eval_forward) and what the mode's row times (its `timing`, PLAN_TIMINGS: an SGD
    step, time_ttt_step; or a LoRA scoring forward and batched step, time_lora_ttt, with the val stream's
    document schedule, eval.plan.lora_work_at) are timed on a fresh model, and eval.plan.plan_ttt_eval picks the
    stride (>= EVAL_STRIDE when EVAL_AUTO_STRIDE, else EVAL_STRIDE), the most epochs <= TTT_EPOCHS (then phases)
    that fit 90% of EVAL_MAX_SECONDS with the roundtrip, or skips TTT; logs `ttt_plan:` with the numbers and the
    reason. The eval's own guards still check the real speed.
    """
    if not (hp.ttt_enabled and hp.ttt_epochs) or hp.skip_final_eval:
        stride = plan_eval_stride(ctx, model_config, hp, num_val_tokens) if (
            hp.eval_auto_stride and not hp.skip_final_eval) else hp.eval_stride
        return EvalPlan(stride=stride)
    model = GPT(**model_config).to(ctx.device).eval()
    measure, describe = PLAN_TIMINGS[TTT_MODES[hp.ttt_mode].timing]
    timings = dict(forward_seconds=time_eval_forward(ctx, model, hp), **measure(ctx, model, hp, num_val_tokens))
    plan = plan_ttt_eval(hp, timings, num_val_tokens, ctx.world_size)
    projected = "" if plan.projected_seconds is None else f" projected {plan.projected_seconds:.0f}s with the roundtrip"
    ctx.log(f"ttt_plan: {describe(hp, timings, plan, num_val_tokens)}: stride {plan.stride} epochs {plan.epochs}"
            + f" phases {plan.phases}" * bool(plan.phases) + projected + f" (EVAL_MAX_SECONDS={hp.eval_max_seconds:g})"
            + f"; {plan.reason}" * bool(plan.reason))
    return plan


def sgd_timings(ctx: RunContext, model: GPT, hp: Hyperparameters, num_val_tokens: int) -> dict:
    """An SGD row's plan timings (`timing` "sgd"): one TTT step, time_ttt_step."""
    return dict(step_seconds=time_ttt_step(ctx, model, hp))


def describe_sgd(hp: Hyperparameters, timings: dict, plan: EvalPlan, num_val_tokens: int) -> str:
    """The `ttt_plan:` line's measured part: what was timed and the val stream it is projected over."""
    return (f"{1000 * timings['forward_seconds']:.1f}ms per forward batch of {hp.eval_batch_seqs}x{hp.train_seq_len}, "
            f"{1000 * timings['step_seconds']:.1f}ms per TTT step, {num_val_tokens - 1} val targets")


def lora_timings(ctx: RunContext, model: GPT, hp: Hyperparameters, num_val_tokens: int) -> dict:
    """A LoRA row's plan timings (`timing` "lora"): time_lora_ttt and the val stream's schedule (lora_work_at)."""
    tokens = load_validation_tokens(hp.data_path, vocab_size=hp.vocab_size)
    return dict(lora=time_lora_ttt(ctx, model, hp), work_at=lora_work_at(hp, num_val_tokens, ctx.world_size, tokens))


def describe_lora(hp: Hyperparameters, timings: dict, plan: EvalPlan, num_val_tokens: int) -> str:
    (forward_seconds, step_seconds), work = timings["lora"], plan.work
    return (f"TTT_MODE={hp.ttt_mode} {1000 * forward_seconds:.1f}ms per scoring forward of "
            f"{timings['work_at'](hp.eval_stride)['windows']}x{hp.train_seq_len}, {1000 * step_seconds:.1f}ms per "
            f"batched adapter step of {hp.ttt_lora_batch_docs}x{hp.train_seq_len}, {num_val_tokens - 1} val targets in "
            f"{work['documents']} documents: {work['rounds']} rounds of TTT_LORA_BATCH_DOCS={hp.ttt_lora_batch_docs} "
            f"({work['forwards']} forwards, {work['update_rounds']} with steps)")


# what plan_final_eval times and logs for a row's `timing` (eval/ttt_modes.py TTTMode.timing): (measure, describe)
PLAN_TIMINGS = dict(sgd=(sgd_timings, describe_sgd), lora=(lora_timings, describe_lora))


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
