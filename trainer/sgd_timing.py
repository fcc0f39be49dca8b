"""The SGD step's timing for the TTT plan (trainer/ttt_eval.py plan_timings, a row's `timing` "sgd"): packed only
for the modes whose plan times it."""

import torch

from eval.plan import EvalPlan
from eval.ttt import select_ttt_params, ttt_step_seqs
from eval.ttt_modes import TTT_MODES
from model.gpt import GPT
from primitives.settings import Hyperparameters
from trainer.context import RunContext
from trainer.timing import seconds_per_call

# the packed train_gpt.py holds this module only for runs whose TTT mode times an SGD step (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED and TTT_MODE != 'lora'"


def time_ttt_step(ctx: RunContext, model: GPT, hp: Hyperparameters, /) -> float:
    """Seconds of one TTT update as eval/ttt.py runs it: forward + backward of this rank's share of a
    TTT batch ([ttt_step_seqs / ranks, TRAIN_SEQ_LEN] synthetic tokens) with only TTT_PARAMS requiring
    grad, then SGD; compiled and autocast as the eval runs it. Changes `model`'s weights (a fresh model)."""
    # a mode whose units are chunks caps a step at a chunk's sequences; phases are not capped
    cap_tokens = hp.ttt_chunk_tokens if "chunk_tokens" in TTT_MODES[hp.ttt_mode].fields else hp.ttt_batch_seqs * hp.train_seq_len
    batch = ttt_step_seqs(hp.ttt_batch_seqs, cap_tokens, hp.train_seq_len, ctx.world_size) // ctx.world_size
    chosen = select_ttt_params(model, hp.ttt_params)
    model.requires_grad_(False)
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
    model.requires_grad_(True)
    return seconds


def sgd_timings(ctx: RunContext, model: GPT, hp: Hyperparameters, num_val_tokens: int, /) -> dict:
    """An SGD row's plan timings (`timing` "sgd"): one TTT step, time_ttt_step."""
    return dict(step_seconds=time_ttt_step(ctx, model, hp))


def describe_sgd(hp: Hyperparameters, timings: dict, plan: EvalPlan, num_val_tokens: int, /) -> str:
    """The `ttt_plan:` line's measured part: what was timed and the val stream it is projected over."""
    return (f"{1000 * timings['forward_seconds']:.1f}ms per forward batch of {hp.eval_batch_seqs}x{hp.train_seq_len}, "
            f"{1000 * timings['step_seconds']:.1f}ms per TTT step, {num_val_tokens - 1} val targets")
