"""The trainer's evaluation passes (roundtrip, sliding window, score-first TTT) and the eval plan made
before training.

Autocast and compile as in training; the scoring itself lives in eval/ (exact byte LUT, the
challenge's sliding-window rule).
"""

import time

import torch

from eval.roundtrip import eval_roundtrip
from eval.plan import EvalPlan
from eval.sliding import count_sliding_windows, eval_sliding
from trainer.context import RunContext, eval_device_args
from trainer.timing import time_eval_forward
from trainer.ttt_eval import plan_final_ttt
from model.gpt import GPT
from primitives.settings import Hyperparameters


def evaluate_roundtrip(ctx: RunContext, hp: Hyperparameters, model: GPT, val_tokens: torch.Tensor, luts, /) -> dict:
    """{val_loss (nats/token), val_bpb} of `model` on val_tokens (int64 [N]), non-overlapping windows of
    TRAIN_SEQ_LEN in batches of VAL_BATCH_SIZE tokens (eval_sliding scores in eval mode and restores the model's)."""
    loss, bpb = eval_roundtrip(model, val_tokens, luts, seq_len=hp.train_seq_len,
                               batch_seqs=max(1, hp.val_batch_size // hp.train_seq_len), **eval_device_args(ctx))
    return dict(val_loss=loss, val_bpb=bpb)


def evaluate_sliding(ctx: RunContext, hp: Hyperparameters, model: GPT, val_tokens: torch.Tensor, luts, stride: int,
                     started: float, /) -> dict:
    """The sliding-window score (eval.sliding.eval_sliding's dict: val_loss, val_bpb, stride, eval_seconds,
    num_scored_tokens, num_bytes). Its time guard gets what is left of EVAL_MAX_SECONDS since `started`
    (time.perf_counter(); loading and the roundtrip count against the same 600 s). Raises EvalTimeError
    when even the largest stride cannot fit."""
    left = hp.eval_max_seconds - (time.perf_counter() - started)
    return eval_sliding(model, val_tokens, luts, seq_len=hp.train_seq_len, stride=stride, batch_seqs=hp.eval_batch_seqs,
                        max_seconds=max(left, 1e-9), auto_stride=hp.eval_auto_stride, log=ctx.log, **eval_device_args(ctx))


def plan_final_eval(ctx: RunContext, model_config: dict, hp: Hyperparameters, num_val_tokens: int, /) -> EvalPlan:
    """The final eval's plan before training (eval.plan.EvalPlan; epochs 0: the sliding pass).

    Without TTT: EVAL_STRIDE, or with EVAL_AUTO_STRIDE the smallest stride that fits (plan_eval_stride).
    With TTT_ENABLED, trainer.ttt_eval.plan_final_ttt: the eval forward and what the mode's row times (an SGD step, or a
    LoRA scoring forward and batched step with the val stream's document schedule) are timed on a fresh model, and
    eval.ttt_plan.plan_ttt_eval picks the stride (>= EVAL_STRIDE when EVAL_AUTO_STRIDE, else EVAL_STRIDE), the most
    epochs <= TTT_EPOCHS (then phases) that fit 90% of EVAL_MAX_SECONDS with the roundtrip, or skips TTT; logs
    `ttt_plan:` with the numbers and the reason. The eval's own guards still check the real speed.
    """
    if not (hp.ttt_enabled and hp.ttt_epochs) or hp.skip_final_eval:
        stride = plan_eval_stride(ctx, model_config, hp, num_val_tokens) if (
            hp.eval_auto_stride and not hp.skip_final_eval) else hp.eval_stride
        return EvalPlan(stride=stride)
    return plan_final_ttt(ctx, model_config, hp, num_val_tokens)


def plan_eval_stride(ctx: RunContext, model_config: dict, hp: Hyperparameters, num_val_tokens: int, /) -> int:
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
    ctx.log(f"eval_plan: {1000 * per_batch:.1f}ms per batch of {b} x {seq_len}, {n} val targets: projected "
            f"{project(hp.eval_stride):.0f}s at EVAL_STRIDE={hp.eval_stride}, {project(stride):.0f}s at stride {stride} "
            f"(EVAL_MAX_SECONDS={hp.eval_max_seconds:g})")
    return stride
