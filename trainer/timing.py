"""Timing before training: mean seconds of a synchronized call (seconds_per_call) and of the eval's scoring
forward (time_eval_forward), which the eval plan (trainer/evaluate.py) and the TTT plan (trainer/ttt_eval.py)
project the final eval from."""

import time

import torch

from eval.sliding import scoring_forward
from model.gpt import GPT
from primitives.progress import Progress
from primitives.settings import Hyperparameters
from trainer.context import RunContext


def seconds_per_call(ctx: RunContext, call, /, repeats: int = 3, label: str = "timing") -> float:
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


def scored_context(hp: Hyperparameters, /) -> int:
    """The positions before the ones a window after the first scores: TRAIN_SEQ_LEN - EVAL_STRIDE."""
    return hp.train_seq_len - min(hp.eval_stride, hp.train_seq_len)


def time_eval_forward(ctx: RunContext, model: GPT, hp: Hyperparameters, /) -> float:
    """Seconds of one forward of [EVAL_BATCH_SEQS, TRAIN_SEQ_LEN] synthetic tokens (no val token is
    read), compiled and autocast as the eval runs it: the head on the last EVAL_STRIDE positions only."""
    score = scoring_forward(model, ctx.compile)
    x = torch.zeros(hp.eval_batch_seqs, hp.train_seq_len, dtype=torch.int64, device=ctx.device)

    def call():
        with torch.inference_mode(), ctx.autocast():
            score(x, scored_context(hp))

    return seconds_per_call(ctx, call, label="eval plan: timing the eval forward")
