"""Phased score-first TTT: score the val stream left to right in phases; after each phase, global SGD
on ALL the documents scored so far (the prefix), then the next phase is scored by the updated model.

Sources (facts only; the code is the kit's): openai/parameter-golf PR #1610 (one pause after 2000
scored documents, global SGD on that scored prefix, then the queue resumes with the updated base
model), PR #1626 (multi-phase: 3 phases of score -> SGD on the scored prefix -> score the next; 3
phases -0.0008 bpb over one), PR #1700/#1727 (3-4 phases, SGD lr 0.015 momentum 0.9 in PR #1802),
PR #1736. Their per-document LoRA (PR #1530) is not built here: this is the full-parameter variant
(TTT_PARAMS picks the parameters). The legality argument is eval/ttt.py's: every target is scored
exactly once, by a model none of whose updates trained on it; an update trains only on targets of
phases already scored. The ledger records it per phase (the same records as run_ttt) and
check_ttt_legality refuses a run that broke it.

Here: phase boundaries are the document starts (BOS targets) nearest above p / P of the targets;
phase p's targets are scored with eval/sliding.py's window set restricted to them (context from
earlier tokens allowed); then, unless it is the last phase, `epochs` passes of SGD over the
sequences of seq_len that cover targets [0, end of phase p) (plan_chunk_sequences), lr cosine-decayed
over the phases. With phases=1 or epochs=0 nothing is trained and the score equals eval_sliding's.
"""

import bisect
import math
import time

import torch
import torch.distributed as dist

from eval.sliding import EvalTimeError, count_sliding_windows, scoring_forward
from eval.ttt import (check_ttt_legality, mark_update, pick_ttt_plan, plan_chunk_sequences, score_and_record, select_ttt_params,
                      sgd_step, ttt_records, ttt_step_seqs, ttt_totals, ttt_window_ranges)
from primitives.progress import Progress


def split_phases(tokens: torch.Tensor, phases: int, bos_id: int = 1) -> list:
    """Phase boundaries over the targets of the stream tokens int64 [N]: [0, b_1, ..., N - 1], b_p the
    first document start (a target that is a BOS) at or after p * (N - 1) / phases; phases that would
    be empty (no document start there) merge with the next. Fewer than `phases` phases then."""
    num_targets = len(tokens) - 1
    starts = (tokens[1:] == bos_id).nonzero().flatten().tolist()
    bounds = [0]
    for p in range(1, phases):
        k = bisect.bisect_left(starts, -(-p * num_targets // phases))
        if k < len(starts) and bounds[-1] < starts[k] < num_targets:
            bounds.append(starts[k])
    return bounds + [num_targets]


def phase_train_span(bounds: list, p: int) -> tuple:
    """The targets the updates after phase p train on: every scored one, [0, end of phase p)."""
    return 0, bounds[p + 1]


def run_phased_ttt(model, val_tokens, luts, *, seq_len, stride, phases=3, epochs=1, lr=0.002, momentum=0.9,
                   params="all", batch_seqs=32, eval_batch_seqs=32, grad_clip=1.0, device="cpu", rank=0,
                   world_size=1, autocast_dtype=None, compile_model=False, max_seconds=600.0, bos_id=1, log=print,
                   clock=time.perf_counter) -> dict:
    """Phased score-first TTT over val_tokens int [N]; adapts `model` IN PLACE. Arguments as eval.ttt.run_ttt
    (model contract, scoring, SGD step, multi-rank, autocast, compile) but phases (TTT_PHASES, >= 1) in
    place of chunk_tokens, and each update round trains on the whole scored prefix.
    Time guard: after each phase past the first, the rest is projected from the measured seconds per
    scored target and per trained target (max over ranks); if scoring with the remaining update rounds
    would exceed max_seconds the updates stop (logged; the rest is scored by the adapted model), if
    scoring alone would, EvalTimeError.
    Returns run_ttt's dict (num_chunks = phases actually used, chunks = per-phase ledger records) plus
    phases. Raises ValueError naming the setting for bad inputs before anything runs, and
    (check_ttt_legality) if a phase was scored after an update on it.
    """
    if val_tokens.dim() != 1 or len(val_tokens) < 2 or val_tokens.is_floating_point() or not (
            0 < stride <= seq_len and phases >= 1 and epochs >= 0 and lr >= 0 and eval_batch_seqs > 0
            and batch_seqs > 0 and batch_seqs % world_size == 0 and max_seconds > 0):
        raise ValueError(f"run_phased_ttt: val_tokens {val_tokens.dtype} {list(val_tokens.shape)}, EVAL_STRIDE={stride}, "
                         f"TRAIN_SEQ_LEN={seq_len}, TTT_PHASES={phases}, TTT_EPOCHS={epochs}, TTT_LR={lr}, "
                         f"TTT_BATCH_SEQS={batch_seqs} (world size {world_size}), EVAL_BATCH_SEQS={eval_batch_seqs}, "
                         f"EVAL_MAX_SECONDS={max_seconds}; expected int [N >= 2], 0 < stride <= seq_len, phases >= 1, "
                         "batch seqs a multiple of the world size, others >= 0")
    t_start = clock()
    device = torch.device(device)
    tokens = val_tokens.to(device, torch.int64)
    luts = [t.to(device) for t in luts]
    chosen = select_ttt_params(model, params)
    saved_flags = [(p, p.requires_grad) for p in model.parameters()]
    bounds = split_phases(tokens, phases, bos_id)
    num_phases = len(bounds) - 1
    batch_seqs = ttt_step_seqs(batch_seqs, bounds[-1], seq_len, world_size)
    score_fwd = scoring_forward(model, compile_model)
    train_fwd = torch.compile(model, dynamic=False) if compile_model else model
    optimizer = torch.optim.SGD(chosen, lr=lr, momentum=momentum)
    distributed = dist.is_initialized()
    records = ttt_records(bounds)
    step, stopped, trained_targets = 0, None, 0
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    seconds = [0.0, 0.0]  # scoring, updating (phases past the first)
    window_ranges = ttt_window_ranges(bounds, seq_len=seq_len, stride=stride, rank=rank, world_size=world_size,
                                      eval_batch_seqs=eval_batch_seqs)
    bar = Progress(f"phased ttt eval stride {stride}", sum(map(len, window_ranges)), "window batches")
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in chosen:
            p.requires_grad_(True)
        for c in range(num_phases):
            hi = bounds[c + 1]
            t0 = clock()
            score_and_record(score_fwd, tokens, luts, window_ranges[c], bounds, records, c, totals, step,
                             eval_batch_seqs=eval_batch_seqs, seq_len=seq_len, stride=stride,
                             autocast_dtype=autocast_dtype, bar=bar, what=f"run_phased_ttt: phase {c}")
            check_ttt_legality(records[:c + 1])
            t1 = clock()
            phase_lr = lr * 0.5 * (1 + math.cos(math.pi * c / max(1, num_phases - 1)))
            span = phase_train_span(bounds, c)
            starts = plan_chunk_sequences(*span, seq_len, batch_seqs) if c < num_phases - 1 and stopped is None else []
            for _ in range(epochs if phase_lr > 0 else 0):
                for b in range(0, len(starts), batch_seqs):
                    batch = starts[b:b + batch_seqs]
                    sgd_step(train_fwd, optimizer, chosen, tokens, batch, seq_len=seq_len, rank=rank,
                             world_size=world_size, lr=phase_lr, grad_clip=grad_clip, autocast_dtype=autocast_dtype,
                             distributed=distributed)
                    step += 1
                    trained_targets += len(batch) * seq_len
                    mark_update(records, bounds, min(batch), max(batch) + seq_len, step)  # all ranks' sequences
            t2 = clock()
            if c == 0:
                trained_targets = 0
                continue  # phase 0 pays for compilation: not a rate
            seconds[0] += t1 - t0
            seconds[1] += t2 - t1
            rates = torch.tensor([seconds[0] / (hi - bounds[1]), seconds[1] / max(1, trained_targets)],
                                 dtype=torch.float64, device=device)
            if distributed:
                dist.all_reduce(rates, op=dist.ReduceOp.MAX)
            score_rate, update_rate = rates.tolist()
            elapsed, left_targets = clock() - t_start, bounds[-1] - hi
            left_trained = epochs * sum(bounds[q + 1] for q in range(c + 1, num_phases - 1))
            if elapsed + score_rate * left_targets > max_seconds:
                err = EvalTimeError(f"run_phased_ttt: projected {elapsed + score_rate * left_targets:.1f}s for scoring "
                                    f"alone after phase {c}/{num_phases} ({elapsed:.1f}s elapsed) > EVAL_MAX_SECONDS "
                                    f"{max_seconds:.1f}s: raise EVAL_STRIDE", 0)
                err.partial = records[:c + 1]
                raise err
            projected = elapsed + score_rate * left_targets + update_rate * left_trained
            if stopped is None and epochs and left_trained and projected > max_seconds:
                stopped = c + 1
                if rank == 0:
                    log(f"phased ttt: projected {projected:.1f}s > EVAL_MAX_SECONDS {max_seconds:.1f}s: updates stop "
                        f"after phase {c}/{num_phases}, the rest is scored only")
    finally:
        optimizer.zero_grad(set_to_none=True)
        for p, flag in saved_flags:
            p.requires_grad_(flag)
    bar.close()
    val_loss, val_bpb, num_scored, num_bytes = ttt_totals(records, totals, len(tokens) - 1, "run_phased_ttt")
    return dict(val_loss=val_loss, val_bpb=val_bpb, stride=stride, epochs=epochs,
                phases=num_phases, eval_seconds=clock() - t_start, num_scored_tokens=num_scored,
                num_bytes=num_bytes, num_chunks=num_phases, num_updates=step, updates_stopped_at_chunk=stopped,
                chunks=records)


def project_phased_seconds(*, forward_seconds, train_seconds, num_val_tokens, seq_len, stride, epochs, phases,
                           eval_batch_seqs, batch_seqs, world_size=1) -> float:
    """Projected seconds of run_phased_ttt: forward batches (the sliding windows plus one boundary window
    per phase, rounded up to full batches per rank per phase) x forward_seconds + update steps (epochs x
    the batches of each scored prefix p / phases of the targets, p = 1 .. phases - 1) x train_seconds
    (one step of [batch / world_size, seq_len]). Phases are taken as equal (whole documents move the
    boundaries a little)."""
    ceil = lambda a, b: -(-a // b)
    n = num_val_tokens - 1
    forward_batches = phases * ceil(ceil(count_sliding_windows(n, seq_len, stride), phases) + 1,
                                    eval_batch_seqs * world_size)
    batch_seqs = ttt_step_seqs(batch_seqs, n, seq_len, world_size)
    steps = epochs * sum(max(1, round(p * n / phases / seq_len / batch_seqs)) for p in range(1, phases)
                         if p * n // phases >= seq_len)
    return forward_batches * forward_seconds + steps * train_seconds


def plan_phased_ttt(*, forward_seconds, train_seconds, num_val_tokens, seq_len, strides, epochs, phases,
                    eval_batch_seqs, batch_seqs, max_seconds, roundtrip_seconds=0.0, world_size=1, margin=0.9) -> dict:
    """Pick (stride, epochs, phases) that fit margin x max_seconds (EVAL_MAX_SECONDS) with the roundtrip,
    as eval.ttt.plan_ttt: the wanted TTT_EPOCHS first, then fewer; at each, TTT_PHASES, then fewer (down
    to 2: one update round); at each, the strides in order. Returns dict(stride, epochs (0: TTT skipped),
    phases, projected_seconds, reason (None, or what was cut / why TTT is skipped))."""
    budget = margin * max_seconds - roundtrip_seconds
    common = dict(forward_seconds=forward_seconds, train_seconds=train_seconds, num_val_tokens=num_val_tokens,
                  seq_len=seq_len, eval_batch_seqs=eval_batch_seqs, batch_seqs=batch_seqs, world_size=world_size)
    candidates = [(e, ph) for e in range(epochs if phases > 1 else 0, 0, -1) for ph in range(phases, 1, -1)]
    score_only = lambda s: project_phased_seconds(stride=s, epochs=0, phases=1, **common)
    s, cand, seconds = pick_ttt_plan(lambda s, c: project_phased_seconds(stride=s, epochs=c[0], phases=c[1], **common),
                                     candidates, strides, budget, score_only)
    if cand:
        e, ph = cand
        cut = [f"TTT_EPOCHS={epochs} -> {e}"] * (e != epochs) + [f"TTT_PHASES={phases} -> {ph}"] * (ph != phases)
        return dict(stride=s, epochs=e, phases=ph, projected_seconds=roundtrip_seconds + seconds,
                    reason=f"does not fit: {', '.join(cut)}" if cut else None)
    wanted = roundtrip_seconds + project_phased_seconds(stride=strides[-1], epochs=1, phases=2, **common)
    reason = ("TTT skipped: TTT_PHASES=1 scores the whole stream before any update (the score is the sliding one)"
              if phases <= 1 else f"TTT skipped: 1 epoch of 2 phases at stride {strides[-1]} projects {wanted:.0f}s > "
              f"{margin:g} x EVAL_MAX_SECONDS={max_seconds:g}")
    return dict(stride=s, epochs=0, phases=phases, projected_seconds=roundtrip_seconds + seconds,
                reason=reason if epochs else None)
