"""The window-scoring engine: sliding-window eval with the exact window set, batched, distributed and
time-guarded (the roundtrip eval, eval/roundtrip.py, is one window set of it); the pass itself is the walk of
eval/walk.py with the updater that trains nothing (Scorer, the base of every TTT mode's updater).

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

The time guard (the walk's) exists because the reference single-H100 PR spent 657 s on a stride-128 sliding
eval, over the 600 s evaluation limit: after the first batches we project the total time and fail
fast (or, with EVAL_AUTO_STRIDE=1, restart at the smallest stride that fits).
"""

import time

import torch
import torch.nn.functional as F

from eval.bpb import count_scored_bytes
from eval.walk import EvalTimeError, Schedule, TTTRun, run_score_first
from primitives.env import BUNDLE_KIND


def count_sliding_windows(num_targets: int, seq_len: int, stride: int, /) -> int:
    """Number of windows of the exact set: max(1, ceil((num_targets - (seq_len - stride)) / stride))."""
    return max(1, -(-(num_targets - seq_len + stride) // stride))


def plan_sliding_windows(num_targets: int, seq_len: int, stride: int, windows: torch.Tensor, /) -> tuple:
    """Target indices and score mask of the windows with indices `windows` (int64 [B], any device).

    Returns (index int64 [B, T], score bool [B, T]) with T = min(seq_len, num_targets): position p of
    window w holds target index w * stride + p (input token index; the target token is the next
    one) and counts iff it is a real target (< num_targets) not already scored by window w - 1
    (p >= seq_len - stride for w > 0). Index values >= num_targets are padding, to be clamped.
    """
    positions = torch.arange(min(seq_len, num_targets), device=windows.device)
    index = windows[:, None] * stride + positions
    return index, (positions >= (seq_len - stride) * (windows[:, None] > 0)) & (index < num_targets)


def first_sliding_window(target: int, seq_len: int, stride: int, /) -> int:
    """Index of the window of the exact set that scores target index `target` (0-based):
    max(0, (target - context) // stride), context = seq_len - stride (window w > 0 scores
    [w * stride + context, w * stride + seq_len))."""
    return max(0, (target - seq_len + stride) // stride)


def scoring_forward(model, compile_model: bool = False, /):
    """The eval's forward: score(input_ids int64 [B, T], start) -> logits [B, T - start, V] (any float dtype) of
    positions start .. T - 1. Where the model has `forward_hidden` and `head_logits`, the trunk runs on every
    position (compiled with torch.compile(dynamic=False) when asked: one graph for every batch) and the head,
    eager, only on the positions asked for (apply_head): after window 0 a window scores its last `stride`
    positions alone, at stride 64 of 2048 1/32 of the [B, T, V] logits. Else (in the package: the tests' models;
    model.gpt.GPT has both) `forward_logits`, sliced."""
    if BUNDLE_KIND == "package":
        if not (hasattr(model, "forward_hidden") and hasattr(model, "head_logits")):
            forward = torch.compile(model.forward_logits, dynamic=False) if compile_model else model.forward_logits
            return lambda input_ids, start=0: forward(input_ids)[:, start:]
    trunk, head = model.forward_hidden, model.head_logits
    trunk = torch.compile(trunk, dynamic=False) if compile_model else trunk
    return lambda input_ids, start=0: apply_head(head, trunk(input_ids)[:, start:])


def apply_head(head, hidden: torch.Tensor, /, max_positions: int = 65536) -> torch.Tensor:
    """head(hidden) for hidden [B, T, D], in slices of whole windows of at most max_positions positions, so the
    eager head's float32 softcap temporaries stay one slice big (window 0's batch runs it on every position)."""
    rows = max(1, max_positions // max(1, hidden.size(1)))
    if rows >= hidden.size(0):
        return head(hidden)
    return torch.cat([head(part) for part in hidden.split(rows)])


def unit_windows(run: TTTRun, lo: int, hi: int, /) -> range:
    """The first window indices of the batches run.rank scores for targets [lo, hi) of the exact window set
    restricted to them, in batches of run.eval_batch_seqs (batch k of the unit's windows goes to rank k % world_size)."""
    first = lambda t: first_sliding_window(t, run.seq_len, run.stride)
    return range(first(lo) + run.rank * run.eval_batch_seqs, first(hi - 1) + 1, run.world_size * run.eval_batch_seqs)


def score_unit_windows(score_fwd, run: TTTRun, lo: int, hi: int, bar=None, /) -> torch.Tensor:
    """float64 [3] (nll nats, targets, bytes) of this rank's share of targets [lo, hi) of run.tokens, scored over
    its batches of run.eval_batch_seqs windows (unit_windows; windows past the last one are padding and score
    nothing) under inference mode; bar: a primitives.progress.Progress updated per batch.

    score_fwd: scoring_forward's (input_ids int64 [B, T], start) -> logits [B, T - start, V] (any float dtype,
    upcast to float32 for a full normalized log-softmax), T = min(seq_len, N - 1); the targets' bytes follow the
    official LUT rule (eval/bpb.py)."""
    tokens, num_targets = run.tokens, len(run.tokens) - 1
    sums = torch.zeros(3, dtype=torch.float64, device=tokens.device)
    with torch.inference_mode():
        for first in unit_windows(run, lo, hi):
            batch = torch.arange(first, first + run.eval_batch_seqs, device=tokens.device)
            index, score = plan_sliding_windows(num_targets, run.seq_len, run.stride, batch)
            index = index.clamp(max=num_targets - 1)  # padding positions read the last real token
            # Positions before `context` score nothing after window 0: skip their log-softmax.
            context = (run.seq_len - run.stride) * (first > 0)
            with torch.autocast(tokens.device.type, run.autocast_dtype, enabled=run.autocast_dtype is not None):
                logits = score_fwd(tokens[index], context)
            index = index[:, context:]
            score = score[:, context:] & (index >= lo) & (index < hi)
            y = tokens[index + 1]
            nll = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view_as(y)
            sums += torch.stack([nll.double().where(score, 0).sum(), score.sum(),
                                 count_scored_bytes(tokens, index, run.luts).where(score, 0).sum()])
            if bar is not None:
                bar.update()
    return sums


class Scorer:
    """The walk's updater that updates nothing (eval/walk.py): scores a round's units with the exact window set
    restricted to each unit's targets (context from earlier tokens allowed), eval_batch_seqs windows per forward,
    a share of each unit's window batches per rank (sums all-reduced by the walk). Subclasses (the TTT modes'
    updaters: eval/sgd_modes.py, eval/lora_mode.py, eval/phased_lora.py; made with the walk's schedule) add
    training: trainable() (the model parameters left unfrozen), steps() (run the updates after a round, yielding per
    step the target ranges it trained on), count_steps() (the steps steps() would take), close(). progress():
    (total, unit) of the progress bar (`self.bar`) that score() updates."""

    def __init__(self, model, run: TTTRun, sched: Schedule, /):
        self.model, self.run = model, run
        self.score_fwd = scoring_forward(model, run.compile_model)

    def progress(self, sched: Schedule, /) -> tuple:
        b = sched.bounds
        return sum(len(unit_windows(self.run, b[c], b[c + 1])) for c in range(len(b) - 1)), "window batches"

    def trainable(self) -> list:
        return []

    def begin_round(self, sched: Schedule, now: list, /) -> None:
        pass

    def score(self, sched: Schedule, now: list, /) -> torch.Tensor:
        """float64 [len(now), 3] (nll nats, targets, bytes) per unit of the round, this rank's share."""
        b = sched.bounds
        return torch.stack([score_unit_windows(self.score_fwd, self.run, b[c], b[c + 1], self.bar) for _, c, _ in now])

    def steps(self, sched: Schedule, spans: list, /):
        return iter(())

    def count_steps(self, sched: Schedule, spans: list, /) -> int:
        return 0

    def close(self) -> None:
        pass


def sliding_schedule(run: TTTRun, /) -> Schedule:
    """The sliding pass's cut of the stream for the walk: a batch k of B = eval_batch_seqs windows goes to rank
    k % world_size, so a group of world_size batches spans W x B windows. Round 0 scores group 0 (it pays for
    compilation), round 1 groups 1..probe (probe = min(3, the fewest batches of a rank - 1)), round 2 the rest;
    the walk's guard runs once, after round 1, in batches of the busiest rank (refit: that count at any stride).
    One round (no guard) when a rank has at most one batch; two (no guard) when nothing is left after the probe."""
    num_targets, group = len(run.tokens) - 1, run.eval_batch_seqs * run.world_size
    context = run.seq_len - run.stride
    num_windows = count_sliding_windows(num_targets, run.seq_len, run.stride)
    batches = lambda s: -(-count_sliding_windows(num_targets, run.seq_len, s) // group)  # the busiest rank's
    probe = min(3, -(-num_windows // run.eval_batch_seqs) // run.world_size - 1)
    cuts = [k * group * run.stride + context for k in (1, probe + 1) if probe > 0 and k * group < num_windows]
    bounds = [0, *cuts, num_targets]
    work = [1, probe, batches(run.stride) - probe - 1][:len(bounds) - 1]
    return Schedule(bounds, [[(0, c, True)] for c in range(len(work))], work, refit=batches,
                    note=f"{num_windows} windows, ")


class SlidingPass:
    """The walk's row of the sliding pass (eval/walk.py run_score_first): sliding_schedule, no updater."""
    entry = label = "eval_sliding"
    unit, count_from, scope = "", 0, None
    schedule, updater = staticmethod(sliding_schedule), Scorer


@torch.inference_mode()
def eval_sliding(model, val_tokens, luts, /, *, seq_len, stride, batch_seqs, device, rank=0, world_size=1,
                 autocast_dtype=None, max_seconds=600.0, auto_stride=False, log=print, compile_model=False,
                 clock=time.perf_counter) -> dict:
    """Sliding-window val eval of the model's logits (scoring_forward) over the whole stream val_tokens int64 [N]:
    the walk of eval/walk.py with no updater (SlidingPass), so a TTT mode with no update scores the same.

    Windows (see module docstring) go batch_seqs per forward ([batch_seqs, min(seq_len, N-1)] int64
    inputs; logits [B, T, V] of any float dtype are upcast to float32 for a full normalized
    log-softmax); batches are dealt round-robin to the ranks and the float64 sums are all-reduced
    when torch.distributed is initialized (call it on every rank with the unwrapped model; it is scored in
    eval mode, its own mode restored after; the engine runs under torch.inference_mode). Every batch has
    the same shape: the last one is padded with masked windows past the last, and a window shorter than seq_len only occurs
    when the stream is (causal attention: padding at a window's end never changes a real
    position), so one static graph serves every batch. compile_model: torch.compile(dynamic=False)
    the forward (the trainer asks for it on CUDA; on CPU, tests compile it with Inductor to prove
    there is no recompile across batches).
    autocast_dtype: e.g. torch.bfloat16 on CUDA, None for none.
    Time guard (the walk's): after batch 3 (batch 0, which pays for compilation, is timed apart; earlier when a
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
    or EVAL_MAX_SECONDS <= 0; in the package (not a record's packed file, eval/walk.py) RuntimeError (a bug, not
    an input) if the windows did not score every target exactly once.
    """
    if BUNDLE_KIND == "package":  # the inputs a run's own loader and the settings' preflight rule out already
        if val_tokens.dim() != 1 or len(val_tokens) < 2 or val_tokens.is_floating_point() or not (
                0 < stride <= seq_len and batch_seqs > 0 and max_seconds > 0):
            raise ValueError(f"eval_sliding: val_tokens {val_tokens.dtype} {list(val_tokens.shape)}, EVAL_STRIDE={stride}, "
                             f"TRAIN_SEQ_LEN={seq_len}, EVAL_BATCH_SEQS={batch_seqs}, EVAL_MAX_SECONDS={max_seconds}; "
                             "expected int [N >= 2], 0 < stride <= seq_len, others > 0")
    if not 0 < stride <= seq_len:  # in every file: a stride past the window would skip targets, a wrong score
        raise ValueError(f"EVAL_STRIDE={stride}: expected 1..TRAIN_SEQ_LEN={seq_len}")
    device = torch.device(device)
    tokens, luts = val_tokens.to(device, torch.int64), [t.to(device) for t in luts]
    t_start, was_training = clock(), model.training
    model.eval()
    while True:
        run = TTTRun(tokens, luts, seq_len, stride, 0, batch_seqs, rank, world_size, autocast_dtype, compile_model)
        try:
            out = run_score_first(model, run, SlidingPass, max_seconds, log, clock, t_start)
        except EvalTimeError as err:
            if not (auto_stride and err.fit_stride):
                raise EvalTimeError(f"{err}{' (no stride fits)' if auto_stride else ' or set EVAL_AUTO_STRIDE=1'}",
                                    err.fit_stride) from None
            if rank == 0:
                log(f"eval_sliding: stride {stride} -> {err.fit_stride}")
            stride = err.fit_stride
            continue
        model.train(was_training)
        return {k: out[k] for k in ("val_loss", "val_bpb", "stride", "eval_seconds", "num_scored_tokens", "num_bytes")}
