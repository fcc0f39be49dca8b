"""Sliding-window evaluation with the exact window set, batched, distributed, and time-guarded.

Window set (design §4; fixes the seed PR's formula, which re-scored the tail): with
context = seq_len - stride, windows start at 0, stride, 2*stride, ... while start + context <
num_targets (= N - 1); the first window is always present and scores all its positions, every
later window scores only its last `stride` positions. A window covers up to min(seq_len,
num_targets - start) positions, so the last ones reach exactly the last target. Every target is
scored exactly once, each with at least min(its position, context) tokens of context.

The time guard exists because the reference single-H100 PR spent 657 s on a stride-128 sliding
eval, over the 600 s evaluation limit: after the first batches we project the total time and fail
fast (or, with EVAL_AUTO_STRIDE=1, restart at the smallest stride that fits).
"""

import sys
import time

import torch
import torch.distributed as dist

from eval.bpb import eval_all_reduce_sums, eval_metrics_from_sums
from eval.roundtrip import eval_check_tokens, eval_score_windows


class EvalStrideRestart(Exception):
    """Raised inside the sliding loop to restart it at a larger stride (EVAL_AUTO_STRIDE=1)."""

    def __init__(self, stride: int):
        super().__init__(stride)
        self.stride = stride


def count_sliding_windows(num_targets: int, seq_len: int, stride: int) -> int:
    """Number of windows of the exact set: max(1, ceil((num_targets - (seq_len - stride)) / stride))."""
    return max(1, -(-(num_targets - (seq_len - stride)) // stride))


def plan_sliding_windows(num_targets: int, seq_len: int, stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact sliding window set as int64 CPU tensors (starts, lengths, score_offsets), each [W].

    Window w has inputs tokens[starts[w] : starts[w] + lengths[w]] and scores its positions
    score_offsets[w] .. lengths[w]-1, i.e. targets (0-based, target t = token t+1)
    starts[w] + score_offsets[w] .. starts[w] + lengths[w] - 1.
    Raises ValueError for num_targets < 1, seq_len < 1 or stride outside [1, seq_len] (EVAL_STRIDE).
    """
    if int(num_targets) < 1 or int(seq_len) < 1:
        raise ValueError(f"need num_targets >= 1 and TRAIN_SEQ_LEN >= 1, got {num_targets} and {seq_len}")
    if not 1 <= int(stride) <= int(seq_len):
        raise ValueError(f"EVAL_STRIDE must be in [1, TRAIN_SEQ_LEN={seq_len}], got {stride}")
    num_windows = count_sliding_windows(num_targets, seq_len, stride)
    starts = torch.arange(num_windows, dtype=torch.int64) * stride
    lengths = (num_targets - starts).clamp(max=seq_len)
    score_offsets = torch.full_like(starts, seq_len - stride)
    score_offsets[0] = 0
    return starts, lengths, score_offsets


def eval_sync_device(device: torch.device) -> None:
    """Wait for queued CUDA work so that a wall clock read measures it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eval_sliding(
    model,
    val_tokens: torch.Tensor,
    luts,
    *,
    seq_len: int,
    stride: int,
    batch_seqs: int,
    device,
    rank: int = 0,
    world_size: int = 1,
    autocast_dtype=None,
    max_seconds: float = 600.0,
    auto_stride: bool = False,
    log=print,
    compile_model: bool = False,
    clock=time.perf_counter,
    probe_batches: int = 3,
) -> dict:
    """Sliding-window val eval of `model.forward_logits` over the whole stream val_tokens int64 [N].

    Windows (see module docstring) are split into contiguous per-rank ranges, batch_seqs windows per
    forward; float64 sums are all-reduced when torch.distributed is initialized (call it on every
    rank with the unwrapped model). compile_model: torch.compile the forward on CUDA.
    Time guard: after batch `probe_batches` (batch 0, which pays for compilation, is timed apart)
    the total time is projected as elapsed + seconds_per_batch * remaining batches (max over ranks).
    If it exceeds max_seconds (EVAL_MAX_SECONDS) the numbers are logged and ValueError is raised, or
    with auto_stride (EVAL_AUTO_STRIDE=1) the eval restarts at the smallest stride whose projection
    fits (ValueError if none <= seq_len does). clock: seconds, injectable for tests.
    Returns dict(val_loss nats/token, val_bpb, stride (the one used), eval_seconds (wall, this call),
    num_scored_tokens (== N-1), num_bytes, num_windows, seq_len).
    """
    tokens = eval_check_tokens(val_tokens, seq_len, batch_seqs)
    if not 1 <= int(stride) <= int(seq_len):
        raise ValueError(f"EVAL_STRIDE must be in [1, TRAIN_SEQ_LEN={seq_len}], got {stride}")
    if not max_seconds > 0:
        raise ValueError(f"EVAL_MAX_SECONDS must be > 0, got {max_seconds}")
    device = torch.device(device)
    num_targets = tokens.numel() - 1
    t_start = clock()

    def rank_batches(num_windows: int, which) -> int:
        # Batches of the largest (which=max) or smallest (which=min) rank's contiguous share.
        return which(-(-(num_windows * (r + 1) // world_size - num_windows * r // world_size) // batch_seqs) for r in range(world_size))

    while True:
        starts, lengths, score_offsets = plan_sliding_windows(num_targets, seq_len, stride)
        num_windows = starts.numel()
        max_batches = rank_batches(num_windows, max)
        probe_index = min(int(probe_batches), rank_batches(num_windows, min) - 1)
        warm = {}

        def guard(batch_index: int, num_batches: int) -> None:
            if batch_index == 0:
                eval_sync_device(device)
                warm["t"] = clock()
            if batch_index != probe_index or probe_index < 1:
                return
            eval_sync_device(device)
            now = clock()
            stats = torch.tensor([now - t_start, (now - warm["t"]) / probe_index], dtype=torch.float64, device=device)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            elapsed_seconds, seconds_per_batch = stats.tolist()
            projected_seconds = elapsed_seconds + seconds_per_batch * (max_batches - probe_index - 1)
            what = (
                f"eval_sliding: projected {projected_seconds:.1f}s at stride {stride} ({num_windows} windows of {seq_len} tokens, "
                f"{max_batches} batches of {batch_seqs}/rank x {world_size} ranks, {seconds_per_batch * 1000:.1f}ms/batch, "
                f"{elapsed_seconds:.1f}s elapsed), EVAL_MAX_SECONDS={max_seconds:g}"
            )
            if rank == 0:
                log(what)
            if projected_seconds <= max_seconds:
                return
            if not auto_stride:
                raise ValueError(what + ": over the limit; raise EVAL_STRIDE or set EVAL_AUTO_STRIDE=1")
            for new_stride in range(stride + 1, seq_len + 1):
                new_batches = rank_batches(count_sliding_windows(num_targets, seq_len, new_stride), max)
                new_projected_seconds = elapsed_seconds + seconds_per_batch * new_batches
                if new_projected_seconds <= max_seconds:
                    if rank == 0:
                        log(f"eval_sliding: EVAL_AUTO_STRIDE=1: stride {stride} -> {new_stride} (projected {new_projected_seconds:.1f}s, restarting)")
                    raise EvalStrideRestart(new_stride)
            raise ValueError(what + f": no stride up to TRAIN_SEQ_LEN={seq_len} fits in the time left")

        lo, hi = num_windows * rank // world_size, num_windows * (rank + 1) // world_size
        try:
            sums = eval_score_windows(
                model, tokens, starts[lo:hi], lengths[lo:hi], score_offsets[lo:hi], luts,
                batch_seqs=batch_seqs, device=device, autocast_dtype=autocast_dtype, compile_model=compile_model,
                show_progress=rank == 0 and sys.stderr.isatty(), on_batch=guard,
            )
            break
        except EvalStrideRestart as restart:
            stride = restart.stride
    val_loss, val_bpb = eval_metrics_from_sums(eval_all_reduce_sums(sums))
    _, num_scored, num_bytes = sums.tolist()
    assert num_scored == num_targets, (num_scored, num_targets)
    eval_sync_device(device)
    return dict(
        val_loss=val_loss, val_bpb=val_bpb, stride=int(stride), eval_seconds=clock() - t_start,
        num_scored_tokens=int(num_scored), num_bytes=int(num_bytes), num_windows=int(num_windows), seq_len=int(seq_len),
    )
