"""The one window-scoring engine: sliding-window eval with the exact window set, batched,
distributed and time-guarded (the roundtrip eval, eval/roundtrip.py, is one window set of it).

Window set (the challenge's exact set; fixes the seed PR's formula, which re-scored the tail): with
context = seq_len - stride, windows start at 0, stride, 2*stride, ... while start + context <
num_targets (= N - 1); the first window is always present and scores all its positions, every
later window scores only its last `stride` positions. A window covers up to min(seq_len,
num_targets - start) positions, so the last ones reach exactly the last target. Every target is
scored exactly once, each with at least min(its position, context) tokens of context.
Window w has inputs tokens[s : s+n] and targets tokens[s+1 : s+n+1] (s = w * stride,
n = min(seq_len, num_targets - s)); target t (0-based) is token t+1 and its previous token is t.

Per batch of windows the engine turns logits into three float64 sums (NLL in nats, scored tokens,
scored bytes from the official byte LUTs, eval/bpb.py), all-reduced over ranks; then
val_loss = NLL / tokens and val_bpb = NLL / ln 2 / bytes.

The time guard exists because the reference single-H100 PR spent 657 s on a stride-128 sliding
eval, over the 600 s evaluation limit: after the first batches we project the total time and fail
fast (or, with EVAL_AUTO_STRIDE=1, restart at the smallest stride that fits).
"""

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eval.bpb import count_scored_bytes
from primitives.progress import Progress


class EvalTimeError(ValueError):
    """The projected eval time exceeds EVAL_MAX_SECONDS; `fit_stride` is the smallest stride whose
    projection fits (0: none <= seq_len does), for the message that says what to run next."""

    def __init__(self, message: str, fit_stride: int):
        super().__init__(message)
        self.fit_stride = fit_stride


def count_sliding_windows(num_targets: int, seq_len: int, stride: int) -> int:
    """Number of windows of the exact set: max(1, ceil((num_targets - (seq_len - stride)) / stride))."""
    return max(1, -(-(num_targets - seq_len + stride) // stride))


def plan_sliding_windows(num_targets: int, seq_len: int, stride: int, windows: torch.Tensor) -> tuple:
    """Target indices and score mask of the windows with indices `windows` (int64 [B], any device).

    Returns (index int64 [B, T], score bool [B, T]) with T = min(seq_len, num_targets): position p of
    window w holds target index w * stride + p (input token index; the target token is the next
    one) and counts iff it is a real target (< num_targets) not already scored by window w - 1
    (p >= seq_len - stride for w > 0). Index values >= num_targets are padding, to be clamped.
    """
    positions = torch.arange(min(seq_len, num_targets), device=windows.device)
    index = windows[:, None] * stride + positions
    return index, (positions >= (seq_len - stride) * (windows[:, None] > 0)) & (index < num_targets)


def first_sliding_window(target: int, seq_len: int, stride: int) -> int:
    """Index of the window of the exact set that scores target index `target` (0-based):
    max(0, (target - context) // stride), context = seq_len - stride (window w > 0 scores
    [w * stride + context, w * stride + seq_len))."""
    return max(0, (target - seq_len + stride) // stride)


def scoring_forward(model, compile_model: bool = False):
    """The eval's forward: score(input_ids int64 [B, T], start) -> logits [B, T - start, V] (any float dtype) of
    positions start .. T - 1. Where the model has `forward_hidden` and `head_logits`, the trunk runs on every
    position (compiled with torch.compile(dynamic=False) when asked: one graph for every batch) and the head,
    eager, only on the positions asked for (apply_head): after window 0 a window scores its last `stride`
    positions alone, at stride 64 of 2048 1/32 of the [B, T, V] logits. Else `forward_logits`, sliced."""
    if hasattr(model, "forward_hidden") and hasattr(model, "head_logits"):
        trunk, head = model.forward_hidden, model.head_logits
        trunk = torch.compile(trunk, dynamic=False) if compile_model else trunk
        return lambda input_ids, start=0: apply_head(head, trunk(input_ids)[:, start:])
    forward = torch.compile(model.forward_logits, dynamic=False) if compile_model else model.forward_logits
    return lambda input_ids, start=0: forward(input_ids)[:, start:]


def apply_head(head, hidden: torch.Tensor, max_positions: int = 65536) -> torch.Tensor:
    """head(hidden) for hidden [B, T, D], in slices of whole windows of at most max_positions positions, so the
    eager head's float32 softcap temporaries stay one slice big (window 0's batch runs it on every position)."""
    rows = max(1, max_positions // max(1, hidden.size(1)))
    if rows >= hidden.size(0):
        return head(hidden)
    return torch.cat([head(part) for part in hidden.split(rows)])


def score_window_batch(forward, tokens, luts, first: int, batch_seqs: int, *, seq_len: int, stride: int,
                       autocast_dtype=None, target_lo: int = 0, target_hi: int = -1) -> torch.Tensor:
    """Sums of one batch of windows first .. first + batch_seqs - 1 of the exact set over the stream
    tokens int64 [N] (windows past the last one are padding and score nothing).

    forward: scoring_forward's (input_ids int64 [B, T], start) -> logits [B, T - start, V] (any float dtype,
    upcast to float32 for a full normalized log-softmax), T = min(seq_len, N - 1). Only targets with index in
    [target_lo, target_hi) count (target_hi -1: to the end): the chunks of score-first TTT (eval/ttt.py).
    Returns float64 [3] on the device of `tokens`: (NLL in nats, scored targets, their bytes by the
    official LUT rule, eval/bpb.py). Call under torch.inference_mode / no_grad.
    """
    num_targets = len(tokens) - 1
    windows = torch.arange(first, first + batch_seqs, device=tokens.device)
    index, score = plan_sliding_windows(num_targets, seq_len, stride, windows)
    index = index.clamp(max=num_targets - 1)  # padding positions read the last real token
    # Positions before `context` score nothing after window 0: skip their log-softmax.
    context = (seq_len - stride) * (first > 0)
    with torch.autocast(tokens.device.type, autocast_dtype, enabled=autocast_dtype is not None):
        logits = forward(tokens[index], context)
    index, score = index[:, context:], score[:, context:]
    if target_lo or target_hi >= 0:
        score = score & (index >= target_lo) & (index < (num_targets if target_hi < 0 else target_hi))
    y = tokens[index + 1]
    nll = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view_as(y)
    return torch.stack([nll.double().where(score, 0).sum(), score.sum(),
                        count_scored_bytes(tokens, index, luts).where(score, 0).sum()])


@torch.inference_mode()
def eval_sliding(model, val_tokens, luts, *, seq_len, stride, batch_seqs, device, rank=0, world_size=1,
                 autocast_dtype=None, max_seconds=600.0, auto_stride=False, log=print, compile_model=False,
                 clock=time.perf_counter) -> dict:
    """Sliding-window val eval of the model's logits (scoring_forward) over the whole stream val_tokens int64 [N].

    Windows (see module docstring) go batch_seqs per forward ([batch_seqs, min(seq_len, N-1)] int64
    inputs; logits [B, T, V] of any float dtype are upcast to float32 for a full normalized
    log-softmax); batches are dealt round-robin to the ranks and the float64 sums are all-reduced
    when torch.distributed is initialized (call it on every rank with the unwrapped model, in eval
    mode; the engine runs under torch.inference_mode). Every batch has the same shape: the last one
    is padded with masked windows past the last, and a window shorter than seq_len only occurs
    when the stream is (causal attention: padding at a window's end never changes a real
    position), so one static graph serves every batch. compile_model: torch.compile(dynamic=False)
    the forward (the trainer asks for it on CUDA; on CPU, tests compile it with Inductor to prove
    there is no recompile across batches).
    autocast_dtype: e.g. torch.bfloat16 on CUDA, None for none.
    Time guard: after batch 3 (batch 0, which pays for compilation, is timed apart; earlier when a
    rank has fewer batches) the total time is projected as elapsed + seconds_per_batch * remaining
    batches (max over ranks)
    and logged on rank 0. If it exceeds max_seconds (EVAL_MAX_SECONDS) ValueError is raised with the
    numbers (EvalTimeError, a ValueError carrying the smallest stride that fits), or with auto_stride
    (EVAL_AUTO_STRIDE=1) the eval restarts at the smallest stride whose
    projection fits (ValueError if none <= seq_len does). A progress line goes to stderr on a TTY.
    clock: seconds, injectable for tests.
    Returns dict(val_loss nats/token, val_bpb, stride (the one used), eval_seconds (wall, this call),
    num_scored_tokens (== N-1), num_bytes). Raises ValueError naming the input for a non-1-D or
    float val_tokens or fewer than 2 tokens, EVAL_STRIDE outside [1, seq_len], EVAL_BATCH_SEQS < 1
    or EVAL_MAX_SECONDS <= 0; RuntimeError (a bug, not an input) if the windows did not score every
    target exactly once.
    """
    if val_tokens.dim() != 1 or len(val_tokens) < 2 or val_tokens.is_floating_point() or not (
            0 < stride <= seq_len and batch_seqs > 0 and max_seconds > 0):
        raise ValueError(f"eval_sliding: val_tokens {val_tokens.dtype} {list(val_tokens.shape)}, EVAL_STRIDE={stride}, "
                         f"TRAIN_SEQ_LEN={seq_len}, EVAL_BATCH_SEQS={batch_seqs}, EVAL_MAX_SECONDS={max_seconds}; "
                         "expected int [N >= 2], 0 < stride <= seq_len, others > 0")
    device = torch.device(device)
    tokens = val_tokens.to(device, torch.int64)
    luts = [t.to(device) for t in luts]
    num_targets = len(tokens) - 1
    forward = scoring_forward(model, compile_model)
    # Batches of the busiest rank when the windows of `stride` are split over all ranks.
    num_batches = lambda s: -(-count_sliding_windows(num_targets, seq_len, s) // (world_size * batch_seqs))
    t_start = clock()
    while True:
        num_windows = count_sliding_windows(num_targets, seq_len, stride)
        # The time guard probes after batch 3 (batch 0 pays for torch.compile and is timed apart),
        # earlier if some rank has fewer batches: every rank must reach it (stats are all-reduced).
        probe = min(3, -(-num_windows // batch_seqs) // world_size - 1)
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        bar = Progress(f"eval_sliding stride {stride}", num_batches(stride), "batches")
        # Batch k holds windows k*B .. k*B+B-1 and goes to rank k % world_size. Only the last batch
        # runs past the last window; the plan masks such windows, so every batch has one shape.
        for batch_index, first in enumerate(range(rank * batch_seqs, num_windows, world_size * batch_seqs)):
            sums += score_window_batch(forward, tokens, luts, first, batch_seqs, seq_len=seq_len, stride=stride,
                                       autocast_dtype=autocast_dtype)
            bar.update()
            if batch_index == 0:
                float(sums[0])  # host sync: the clock then sees the finished device work
                t_warm = clock()
            if batch_index == probe > 0:
                float(sums[0])
                stats = torch.tensor([(now := clock()) - t_start, (now - t_warm) / probe], dtype=torch.float64,
                                     device=device)
                if dist.is_initialized():
                    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                elapsed_seconds, seconds_per_batch = stats.tolist()
                projected_seconds = elapsed_seconds + seconds_per_batch * (num_batches(stride) - probe - 1)
                what = (f"eval_sliding: projected {projected_seconds:.1f}s at stride {stride} ({num_windows} windows, "
                        f"{seconds_per_batch * 1000:.1f}ms/batch, {elapsed_seconds:.1f}s elapsed), {max_seconds:.1f}s left "
                        "of EVAL_MAX_SECONDS")
                if rank == 0:
                    log(what)
                if projected_seconds > max_seconds:
                    new_stride = next((s for s in range(stride + 1, seq_len + 1)
                                       if elapsed_seconds + seconds_per_batch * num_batches(s) <= max_seconds), 0)
                    if not (auto_stride and new_stride):
                        raise EvalTimeError(what + (": no stride fits" if auto_stride else ": raise EVAL_STRIDE or set "
                                                    "EVAL_AUTO_STRIDE=1"), new_stride)
                    if rank == 0:
                        log(f"eval_sliding: stride {stride} -> {new_stride}")
                    stride = new_stride
                    break
        else:
            bar.close()
            break  # every batch done without a restart
    if dist.is_initialized():
        dist.all_reduce(sums)
    nll_sum, num_scored, num_bytes = sums.tolist()
    if num_scored != num_targets:  # the contract of val_bpb; a real check, which `python -O` keeps
        raise RuntimeError(f"eval_sliding: scored {num_scored:.0f} targets, expected every one of the {num_targets} "
                           f"exactly once (stride {stride}, seq_len {seq_len}): a bug of the window plan")
    return dict(val_loss=nll_sum / num_scored, val_bpb=nll_sum / math.log(2) / num_bytes, stride=stride,
                eval_seconds=clock() - t_start, num_scored_tokens=int(num_scored), num_bytes=int(num_bytes))
