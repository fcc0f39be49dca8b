"""Legal score-first test-time training (TTT): adapt the model to the val stream while scoring it,
never scoring a token with a model that has been updated on it. This module holds what every mode shares: the
registry TTT_MODES (TTTMode rows keyed by TTT_MODE; each mode's module adds its own row when imported, so the packed
train_gpt.py holds only its run's mode: eval/sgd_modes.py chunked and phased, eval/lora_mode.py lora,
eval/phased_lora.py phased_lora; eval/ttt_modes.py imports them all and runs a row), and the library of the SGD
modes (chunks, the SGD step, the chunked plan). The one driver, with the ledger and its legality check, is
eval/walk.py.

The rule (sources):
  - openai/parameter-golf README, FAQ on evaluation: "you are only allowed to test-time train on
    validation set tokens you've already evaluated your model on"; training on val before scoring
    it is cheating on the test loss. Evaluation must fit 10 minutes, on top of training.
  - The merged records with legal TTT (the framework of PR #461, merged precedent PR #549, record
    2026-03-23 LeakyReLU_LegalTTT_ParallelMuon; PR #1413, #1477, #1493 on sp8192): val tokens cut
    into 32K-token chunks; each chunk is scored with the sliding window under inference mode, then
    SGD (momentum 0.9, lr 0.002-0.005 with cosine decay over the chunks, 3 epochs, grad clip 1.0,
    all blocks) trains on that chunk only; the last chunk is never trained on; -0.002 to -0.0025
    bpb on 8xH100, ~370-410 s of the eval budget.
  - Issue #1017's conditions as the review threads quote them (PR #1698, #1735): causal, a full
    normalized distribution, score before update, one left-to-right pass.
Illegal variants this module refuses by construction and by its self-check: training on val
tokens before scoring them ("pre-quant TTT" on val, PR #1735; any update whose batch reaches into
a chunk not yet scored), and re-scoring tokens after adapting on them and reporting that second
score (PR #991 was closed for it; PR #1001/#1004 report only the first pass).

The chunked mode (eval/sgd_modes.py): the val stream is cut into chunks of whole documents (a document starts at a BOS token;
a chunk holds at least `chunk_tokens` targets, except the last). For each chunk in order: score
its targets with the exact sliding-window set of eval/sliding.py (windows that straddle a chunk
boundary run once per chunk, each time scoring only that chunk's targets; context from earlier,
already scored tokens is allowed), then (except for the last chunk) train on its targets only.
With epochs=0 the result equals eval_sliding's. A ledger records, per chunk, the update counter
of the model that scored it and the first/last update whose batch contained any of its targets
(derived from the token ranges actually trained on, not from the loop order); eval/walk.py's
`check_ttt_legality` raises ValueError naming the chunk if an update saw a chunk before it was scored.
"""

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eval.bpb import count_scored_bytes
from eval.sliding import count_sliding_windows

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"

SGD_FIELDS = ("lr", "momentum", "params", "batch_seqs", "grad_clip")
SGD_EXPECTED = " batch seqs a multiple of the world size, others >= 0"


@dataclass(frozen=True)
class TTTMode:
    """One row of TTT_MODES. fields: the mode's settings, each the Hyperparameters field ttt_<name> (its defaults, its
    env name in messages; run.cfg keys by cfg_key); valid(run) -> bool, with `expected` saying what in the refusal;
    schedule(run) -> Schedule; scope(sched, unit) -> (lo, hi) targets; updater(model, run, sched) -> Scorer; label, unit,
    count_from: the names and round numbering its messages use (entry: run_<label>); plan(hp, timings, strides,
    roundtrip_seconds, num_val_tokens, world_size) -> the mode's plan dict (eval/plan.py makes the EvalPlan) with
    wanted_seconds (None: the mode is not planned, it runs TTT_EPOCHS at EVAL_STRIDE); timing: what the trainer
    times for the plan, trainer.ttt_eval.plan_timings and tools/bench/gpu_check.py's TTT_TIMED ("sgd": one
    SGD step, "lora": a scoring forward and a batched adapter step); recorded: the artifact's run["ttt"] names the
    mode (False for one row: artifacts that name none, written before modes, are read as it, and it stays so)."""
    label: str
    unit: str
    count_from: int
    fields: tuple
    valid: object
    expected: str
    schedule: object
    scope: object
    updater: object
    plan: object = None
    timing: str = "sgd"
    recorded: bool = True

    @property
    def entry(self, /) -> str:
        return "run_" + self.label.replace(" ", "_")


# TTT_MODE -> its TTTMode row: each mode's module adds its own when imported (eval/ttt_modes.py imports them all)
TTT_MODES = {}


def unit_scope(sched, c: int, /) -> tuple:
    """The updates after unit c train on its own targets, [bounds[c], bounds[c + 1])."""
    return sched.bounds[c], sched.bounds[c + 1]


def sgd_valid(run, unit: str, /) -> bool:
    """A SGD row's settings check (TTTMode.valid) with its unit setting (chunk_tokens >= seq_len, phases >= 1)."""
    cfg = run.cfg
    return (cfg["lr"] >= 0 and cfg["batch_seqs"] > 0 and cfg["batch_seqs"] % run.world_size == 0
            and cfg[unit] >= (run.seq_len if unit == "chunk_tokens" else 1))


def ttt_autocast(device: torch.device, dtype, /):
    """torch.autocast on `device` in dtype (e.g. torch.bfloat16); off when dtype is None."""
    return torch.autocast(device.type, dtype, enabled=dtype is not None)


def row_sums(nll: torch.Tensor, scored: torch.Tensor, tokens: torch.Tensor, index: torch.Tensor, luts, /) -> torch.Tensor:
    """float64 [R, 3] per row (nll nats, targets, bytes) of the scored positions (bool [R, T]) of per-token nll
    float [R, T] whose targets are tokens[index + 1] (index int64 [R, T]; bytes by the LUTs, eval/bpb.py)."""
    return torch.stack([nll.detach().double().where(scored, 0).sum(1), scored.sum(1).double(),
                        count_scored_bytes(tokens, index, luts).where(scored, 0).sum(1).double()], 1)


def split_ttt_chunks(tokens: torch.Tensor, chunk_tokens: int, bos_id: int = 1, /) -> list:
    """Chunk boundaries over the targets of the stream tokens int64 [N] (target t is token t + 1).

    A chunk ends right before a target that is a BOS token (so it holds whole documents, each with
    the prediction of its BOS) once it holds >= chunk_tokens targets; the rest is the last chunk.
    Returns [0, b_1, ..., N - 1] (chunk c = targets [b_c, b_c+1)).
    """
    num_targets = len(tokens) - 1
    bounds = [0]
    for cut in (tokens[1:] == bos_id).nonzero().flatten().tolist() + [num_targets]:
        if cut - bounds[-1] >= chunk_tokens:
            bounds.append(cut)
    return bounds + [num_targets] * (bounds[-1] < num_targets)


def plan_chunk_sequences(lo: int, hi: int, seq_len: int, multiple: int, /) -> list:
    """Start target indices of the training sequences of chunk targets [lo, hi): evenly spaced over
    [lo, hi - seq_len], (hi - lo) / seq_len of them rounded to the nearest multiple (>= 1) of
    `multiple` (full batches: one static shape; a little overlap or a few untrained targets, never a
    batch mostly made of repeats); sequence s trains on targets [s, s + seq_len), i.e. inputs
    tokens[s : s + seq_len]. [] if the chunk is shorter than seq_len.
    """
    if hi - lo < seq_len:
        return []
    n = max(1, round((hi - lo) / seq_len / multiple)) * multiple
    return [lo + (hi - seq_len - lo) * i // max(1, n - 1) for i in range(n)]


def ttt_step_seqs(batch_seqs: int, chunk_tokens: int, seq_len: int, world_size: int = 1, /) -> int:
    """Sequences per TTT update, all ranks together: TTT_BATCH_SEQS capped at a chunk's sequences
    rounded up to a multiple of the world size."""
    return min(batch_seqs, -(-(chunk_tokens // seq_len) // world_size) * world_size)


def select_ttt_params(model, which: str, /) -> list:
    """Parameters that TTT adapts: `all`; `scalars` (vectors and matrices with a side <= 8: gains,
    scales, mixes, skip weights); or a regular expression searched in the parameter names (e.g.
    `blocks\\.[23]\\.` or `mlp|scale`). Raises ValueError naming TTT_PARAMS if none matches."""
    chosen = [p for n, p in model.named_parameters() if which == "all" or (
        min(p.shape, default=1) <= 8 or p.ndim < 2 if which == "scalars" else re.search(which, n))]
    if not chosen:
        raise ValueError(f"TTT_PARAMS={which!r} matches no parameter")
    return chosen


def sgd_step(train_fwd, optimizer, chosen, run, batch: list, lr: float, /) -> None:
    """One update on the sequences of run.seq_len starting at `batch` (global; this rank takes every world_size-th) of
    run.tokens, gradients all-reduced so every rank takes the same step (reduce_clip_step at lr, run.cfg's grad clip)."""
    device = run.tokens.device
    mine = torch.tensor(batch[run.rank::run.world_size], device=device)[:, None] + torch.arange(run.seq_len + 1,
                                                                                                   device=device)
    with ttt_autocast(device, run.autocast_dtype):
        loss = train_fwd(run.tokens[mine[:, :-1]], run.tokens[mine[:, 1:]])
    (loss * (len(mine) / len(batch))).backward()
    reduce_clip_step(optimizer, chosen, lr, run.cfg["grad_clip"])


def reduce_clip_step(optimizer, chosen, lr: float, grad_clip: float, /) -> None:
    """The SGD step after a backward: the ranks' gradients of `chosen` summed in one all-reduce when distributed (each
    rank scales its loss to its share), grad-norm clip (0: none), the step at lr, gradients cleared."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in chosen]
    if dist.is_initialized():
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        grads = list(flat.split([g.numel() for g in grads]))
    for p, g in zip(chosen, grads):
        p.grad = g.view_as(p)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(chosen, grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def ttt_result_line(result: dict, /) -> str:
    """The greppable final line: `final_ttt_exact val_loss:... val_bpb:... eval_time:...ms`, then the stride, the
    units (phases:P for a mode with phases, else chunks:C) and the updates."""
    units = f"phases:{result['phases']}" if "phases" in result else f"chunks:{result['num_chunks']}"
    return (f"final_ttt_exact val_loss:{result['val_loss']:.8f} val_bpb:{result['val_bpb']:.8f} "
            f"eval_time:{1000 * result['eval_seconds']:.0f}ms stride:{result['stride']} {units} "
            f"updates:{result['num_updates']}")


def zero_updates_warning(result: dict, mode: str, /) -> str:
    """The line a TTT score that made no update gets (a unit's last chunk is never trained on)."""
    return f"WARNING: TTT_MODE={mode} made 0 updates in {result['num_chunks']} chunk(s): the score is the sliding one"


def project_ttt_seconds(*, forward_seconds, train_seconds, num_val_tokens, seq_len, stride, epochs, chunk_tokens,
                        eval_batch_seqs, batch_seqs, world_size=1) -> float:
    """Projected seconds of the chunked mode (eval/sgd_modes.py): forward batches (each chunk's windows, plus its
    boundary window, rounded up to full batches per rank) x forward_seconds + update steps (epochs x full batches
    of each chunk but the last, batch as SGDUpdater takes it) x train_seconds (one step's fwd+bwd+optimizer of
    [batch / world_size, seq_len]). Chunks are taken as chunk_tokens long (whole documents make them a little
    longer and fewer)."""
    ceil = lambda a, b: -(-a // b)
    num_chunks = max(1, ceil(num_val_tokens - 1, chunk_tokens))
    chunk = min(chunk_tokens, num_val_tokens - 1)
    forward_batches = num_chunks * ceil(count_sliding_windows(chunk, seq_len, stride) + 1, eval_batch_seqs * world_size)
    batch_seqs = ttt_step_seqs(batch_seqs, chunk_tokens, seq_len, world_size)
    steps = epochs * (num_chunks - 1) * max(1, round(chunk / seq_len / batch_seqs))
    return forward_batches * forward_seconds + steps * train_seconds


def pick_ttt_plan(project, candidates: list, strides: list, budget: float, score_only, /) -> tuple:
    """The TTT plans' one rule (plan_ttt, eval.phased_ttt.plan_phased_ttt, eval.lora_ttt.plan_lora): the
    first of `candidates` (the TTT settings, preferred first: more epochs, then more phases) that fits
    `budget` seconds at any of `strides` (tried in order) -> (stride, candidate, project(stride, candidate));
    when none fits, (the first stride whose score-only pass fits, else the last, None, score_only(stride))."""
    for cand in candidates:
        for s in strides:
            if (seconds := project(s, cand)) <= budget:
                return s, cand, seconds
    s = next((s for s in strides if score_only(s) <= budget), strides[-1])
    return s, None, score_only(s)


def plan_ttt(*, forward_seconds, train_seconds, num_val_tokens, seq_len, strides, epochs, chunk_tokens,
             eval_batch_seqs, batch_seqs, max_seconds, roundtrip_seconds=0.0, world_size=1, margin=0.9) -> dict:
    """Pick (stride, ttt epochs) that fit margin x max_seconds (EVAL_MAX_SECONDS) with the roundtrip.

    forward_seconds: one compiled forward of [eval_batch_seqs, seq_len] (measured before training,
    as train_gpt.plan_eval_stride does); train_seconds: one TTT step (see project_ttt_seconds).
    strides: candidates, preferred first (e.g. EVAL_STRIDE, 2x, ..., seq_len); epochs: the wanted
    TTT_EPOCHS. More epochs beat a smaller stride: tried epochs, epochs - 1, ..., 1, each at every
    stride; none when the val targets fit one chunk (the last chunk is never trained on). Returns
    dict(stride, epochs (0: TTT skipped), projected_seconds, reason (None, or why TTT is skipped /
    fewer epochs)); when TTT is skipped the stride is the first whose score-only
    pass fits (the last one if none does; the eval's own guard then decides).
    """
    budget = margin * max_seconds - roundtrip_seconds
    common = dict(forward_seconds=forward_seconds, train_seconds=train_seconds, num_val_tokens=num_val_tokens,
                  seq_len=seq_len, chunk_tokens=chunk_tokens, eval_batch_seqs=eval_batch_seqs, batch_seqs=batch_seqs,
                  world_size=world_size)
    # one chunk: it is the last one, which score-first TTT never trains on; no epoch would update anything
    one_chunk = num_val_tokens - 1 <= chunk_tokens
    project = lambda s, e: project_ttt_seconds(stride=s, epochs=e, **common)
    s, e, seconds = pick_ttt_plan(project, range(0 if one_chunk else epochs, 0, -1), strides, budget,
                                  lambda s: project(s, 0))
    if e:
        return dict(stride=s, epochs=e, projected_seconds=roundtrip_seconds + seconds,
                    reason=None if e == epochs else f"TTT_EPOCHS={epochs} does not fit: {e}")
    wanted = project_ttt_seconds(stride=strides[-1], epochs=1, **common)
    reason = (f"TTT skipped: the {num_val_tokens - 1} val targets are one chunk of TTT_CHUNK_TOKENS={chunk_tokens}, "
              f"the last one, which score-first TTT never trains on: 0 updates (the score is the sliding one)"
              if one_chunk else f"TTT skipped: 1 epoch at stride {strides[-1]} projects {roundtrip_seconds + wanted:.0f}s > "
              f"{margin:g} x EVAL_MAX_SECONDS={max_seconds:g}")
    return dict(stride=s, epochs=0, projected_seconds=roundtrip_seconds + seconds, reason=reason if epochs else None)
