"""The walk over the val stream in legal order: the one driver of every scoring pass. The sliding pass
(eval/sliding.py `eval_sliding`, and the roundtrip through it) is the walk whose updater trains nothing; a
score-first TTT mode (eval/ttt_modes.py) is the walk with its row's schedule, scope and updater. So with no
update a mode scores what the sliding pass scores, by construction.

The rule (openai/parameter-golf README FAQ; PR #461/#549 chunked, PR #1610/#1626 phased, PR #77/#1530
per-document LoRA; issue #1017's conditions): every target is scored exactly once, by a model none of whose
updates trained on it, in one left-to-right pass. Legal: score a unit, then train on it; illegal: an update
whose batch reaches into targets not yet scored, or re-scoring after adapting (PR #991, #1735).

What exists once, here: the ledger (per unit the update counter that scored it and the first/last update whose
batch held one of its targets, derived from the token ranges actually trained on) with its legality check after
every scored unit and over the whole run; the parameter freeze (every parameter frozen but the updater's,
restored after); the time guard (after each round past the first and before the last: the rest is projected
from the measured seconds per unit of scoring work and per update step, max over ranks; updates stop when
scoring plus the planned steps would exceed max_seconds, EvalTimeError when scoring alone would, with the
scored records as `.partial` and, for a schedule that can be re-cut at another stride, the smallest stride
that fits). The ledger, its legality check and the every-target-once check run in the package: a record's packed
train_gpt.py (docs/bundle.md) scores as the package run with the same settings did, and keeps the time guard.
"""

import bisect
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from primitives.env import BUNDLE_KIND
from primitives.progress import Progress


class EvalTimeError(ValueError):
    """The projected eval time exceeds EVAL_MAX_SECONDS; `fit_stride` is the smallest stride whose
    projection fits (0: none <= seq_len does, or the schedule cannot say), for the message that says what
    to run next."""

    def __init__(self, message: str, fit_stride: int, /):
        super().__init__(message)
        self.fit_stride = fit_stride


@dataclass
class TTTRun:
    """What every schedule and updater read: the stream tokens int64 [N] and byte LUTs on their device, the
    window rule (seq_len, stride, eval_batch_seqs windows per scoring forward), ranks, autocast, compile, the
    epochs, the BOS id and a mode's own settings (`cfg`: its row's fields)."""
    tokens: torch.Tensor
    luts: list
    seq_len: int
    stride: int
    epochs: int
    eval_batch_seqs: int
    rank: int
    world_size: int
    autocast_dtype: object
    compile_model: bool
    bos_id: int = 1
    cfg: dict = field(default_factory=dict)


@dataclass
class Schedule:
    """A cut of the stream: unit c = targets [bounds[c], bounds[c + 1]); rounds, each a list of (slot, unit,
    last) scored together (last: never trained on after); score_work[r], the scoring work of round r (targets,
    forwards or, for the sliding pass, window batches); ledger: extra per-unit record columns; doc_starts: the first
    target of each unit's document (None when units are not cut inside documents); result: entries the run's
    dict adds (result.json's ttt_<key>, num_ dropped, trainer/finish.py); refit: stride -> the score work of the
    whole pass at that stride (a pass the guard may send back to a coarser stride, which then says its projection;
    None: not one); note: the guard's text before the rate (e.g. the number of windows)."""
    bounds: list
    rounds: list
    score_work: list
    ledger: dict = field(default_factory=dict)
    doc_starts: list | None = None
    result: dict = field(default_factory=dict)
    refit: object = None
    note: str = ""


def ttt_records(bounds: list, /, **per_chunk) -> list:
    """The ledger's empty records, one per unit of `bounds` ([0, b_1, ..., N - 1]); per_chunk: name -> list
    of a value per unit (e.g. document)."""
    return [dict(chunk=c, **{k: v[c] for k, v in per_chunk.items()}, first_target=bounds[c],
                 num_targets=bounds[c + 1] - bounds[c], scored_at_step=None, first_update_step=None,
                 last_update_step=None) for c in range(len(bounds) - 1)]


def mark_update(records: list, bounds: list, lo: int, hi: int, step: int, /) -> None:
    """The ledger: update `step` trained on targets [lo, hi): every unit holding one of them records it."""
    for k in range(bisect.bisect_right(bounds, lo) - 1, bisect.bisect_left(bounds, hi)):
        records[k]["first_update_step"] = records[k]["first_update_step"] or step
        records[k]["last_update_step"] = step


def check_ttt_legality(records: list, /) -> None:
    """Raise ValueError naming the first unit that was scored by a model already updated on it.

    records: dicts with chunk, scored_at_step (updates applied before the unit was scored) and
    first_update_step (1-based counter of the first update whose batch held any of its targets,
    None if none). Consecutive records must tile the targets (each starts where the previous ended), in
    scoring order (scored_at_step never decreasing; with a `document` key, only within a document: the
    per-document LoRA adapters score documents side by side): a target scored twice or skipped is refused too.
    """
    for a, b in zip(records, records[1:]):
        if b["first_target"] != a["first_target"] + a["num_targets"] or (
                None not in (a["scored_at_step"], b["scored_at_step"]) and b["scored_at_step"] < a["scored_at_step"]
                and a.get("document") == b.get("document")):
            raise ValueError(f"TTT illegal: chunk {b['chunk']} (targets from {b['first_target']}) does not follow chunk "
                             f"{a['chunk']} in scoring order: a target scored twice, skipped or out of order")
    for r in records:
        if None not in (r["first_update_step"], r["scored_at_step"]) and r["first_update_step"] <= r["scored_at_step"]:
            raise ValueError(f"TTT illegal: chunk {r['chunk']} (targets {r['first_target']}.."
                             f"{r['first_target'] + r['num_targets'] - 1}) was scored after {r['scored_at_step']} "
                             f"updates, but update {r['first_update_step']} had already trained on it")


def walk_scores(totals, /) -> tuple:
    """(val_loss, val_bpb, num_scored, num_bytes) of a walk's float64 [3] sums (nll nats, targets, bytes)."""
    nll, num_scored, num_bytes = totals.tolist()
    return nll / num_scored, nll / math.log(2) / num_bytes, int(num_scored), int(num_bytes)


def ttt_totals(records: list, totals, num_targets: int, what: str, short: str = "", /) -> tuple:
    """walk_scores(totals) of a finished walk after check_ttt_legality(records); RuntimeError (a bug of the window
    plan, `short` naming the first unit that scored another count) unless every one of num_targets was scored
    exactly once."""
    check_ttt_legality(records)
    scores = walk_scores(totals)
    if scores[2] != num_targets or short:
        raise RuntimeError(f"{what}: scored {scores[2]} targets, expected every one of the {num_targets} exactly "
                           f"once{short}: a bug of the window plan")
    return scores


def ledger_round(records: list, bounds: list, now: list, scored: list, r: int, step: int, short: str, /) -> str:
    """The ledger after round r scored the units `now` ([(slot, unit, last)]) with `step` updates applied: their
    records (scored_at_step, slot and round where the ledger has them, val_loss, val_bpb from `scored`, the round's
    [nll, targets, bytes] per unit) and check_ttt_legality of each with the one before; returns `short`, or the
    first unit that scored another count than its targets."""
    for (s, c, _), (nll, num_scored, num_bytes) in zip(now, scored):
        if num_scored != bounds[c + 1] - bounds[c]:
            short = short or f" (chunk {c} scored {num_scored:.0f} of its {bounds[c + 1] - bounds[c]})"
        where = {k: v for k, v in (("slot", s), ("round", r)) if k in records[c]}
        records[c].update(scored_at_step=step, **where, val_loss=nll / max(num_scored, 1),
                          val_bpb=nll / math.log(2) / max(num_bytes, 1))
        check_ttt_legality(records[max(0, c - 1):c + 1])
    return short


def run_score_first(model, run: TTTRun, row, /, max_seconds: float, log, clock, t_start=None) -> dict:
    """The walk of `row` over run.tokens: row.schedule(run) -> Schedule, row.updater(model, run, sched) -> an
    eval.sliding.Scorer, row.scope(sched, unit) -> the targets the updates after a unit train on; row.entry,
    label, unit, count_from name it in messages. The model is adapted IN PLACE when the updater trains its
    parameters. t_start: the clock's start of the eval (a pass re-cut at another stride keeps it). Returns
    dict(val_loss nats/token, val_bpb, stride, epochs, eval_seconds, num_scored_tokens (== N - 1), num_bytes,
    num_chunks (units), num_updates (one per unit trained per step), updates_stopped_at_chunk (the round after
    which updates stopped, None: never), chunks (the ledger; [] in a packed file), mode_entries (the schedule's
    result keys), plus the schedule's result entries). Raises EvalTimeError when scoring alone cannot fit
    max_seconds; in the package also ValueError (check_ttt_legality) if a unit was scored after an update on it,
    RuntimeError (a bug) unless every target was scored exactly once.

    The time guard, after each round past the first (compilation) and before the last: the rest is projected at
    the measured seconds per unit of score work and per update step (the max over ranks, as is the elapsed
    time). Scoring alone over max_seconds: EvalTimeError with the scored records as `.partial` and, for a
    schedule with a refit (the sliding pass, which logs its projection), the smallest stride that fits; scoring
    plus the planned steps over it: the updates stop after this round (logged)."""
    t_start = clock() if t_start is None else t_start
    sched = row.schedule(run)
    updater = row.updater(model, run, sched)
    bounds, rounds, num_units = sched.bounds, sched.rounds, len(sched.bounds) - 1
    records = []  # the ledger: kept and checked in the package (a record's file scores as the package run did)
    if BUNDLE_KIND == "package":
        records = ttt_records(bounds, **sched.ledger)
    spans = [[(s, c, row.scope(sched, c)) for s, c, last in now if not last] for now in rounds]
    planned = [updater.count_steps(sched, sp) for sp in spans]
    saved_flags = [(p, p.requires_grad) for p in model.parameters()]
    step, num_updates, stopped, short = 0, 0, None, ""
    totals = torch.zeros(3, dtype=torch.float64, device=run.tokens.device)
    seconds, done = [0.0, 0.0], [0, 0]  # scoring, updating; score work, steps (rounds past the first)
    if BUNDLE_KIND == "package":  # the kit's progress line (a record's packed file shows none)
        bar = Progress(f"{row.label} stride {run.stride}", *updater.progress(sched))
    else:
        bar = Progress("", 0, "")
    updater.bar = bar
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in updater.trainable():
            p.requires_grad_(True)
        for r, now in enumerate(rounds):
            t0 = clock()
            updater.begin_round(sched, now)
            sums = updater.score(sched, now)
            if dist.is_initialized():
                dist.all_reduce(sums)
            scored = sums.tolist()  # one sync: the clock times finished work
            for unit_sums in sums:
                totals += unit_sums
            if BUNDLE_KIND == "package":
                short = ledger_round(records, bounds, now, scored, r, step, short)
            t1 = clock()
            for ranges in updater.steps(sched, spans[r]) if stopped is None else ():
                step, num_updates = step + 1, num_updates + len(ranges)
                if BUNDLE_KIND == "package":
                    for lo, hi in ranges:
                        mark_update(records, bounds, lo, hi, step)
                done[1] += r > 0
            if r == 0 or r == len(rounds) - 1:
                continue  # round 0 pays for compilation: not a rate; after the last nothing is left to project
            seconds[0] += t1 - t0
            seconds[1] += clock() - t1
            done[0] += sched.score_work[r]
            stats = torch.tensor([clock() - t_start, seconds[0] / done[0], seconds[1] / max(done[1], 1)],
                                 dtype=torch.float64, device=run.tokens.device)
            if dist.is_initialized():
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            elapsed, score_rate, step_rate = stats.tolist()
            scoring = elapsed + score_rate * sum(sched.score_work[r + 1:])
            projected = scoring + step_rate * sum(planned[r + 1:]) * (stopped is None)
            where = f"{row.unit} {r + row.count_from}/{len(rounds)}"
            what = (f"{row.entry}: projected {scoring:.1f}s for scoring alone after {where} ({elapsed:.1f}s "
                    f"elapsed) > EVAL_MAX_SECONDS {max_seconds:.1f}s")
            if sched.refit:
                what = (f"{row.entry}: projected {projected:.1f}s at stride {run.stride} ({sched.note}"
                        f"{1000 * score_rate:.1f}ms/batch, {elapsed:.1f}s elapsed), {max_seconds:.1f}s left of "
                        "EVAL_MAX_SECONDS")
                if run.rank == 0:
                    log(what)
            if scoring > max_seconds:
                err = EvalTimeError(what + ": raise EVAL_STRIDE", next((
                    s for s in range(run.stride + 1, run.seq_len + 1)
                    if elapsed + score_rate * sched.refit(s) <= max_seconds), 0) if sched.refit else 0)
                if BUNDLE_KIND == "package":
                    err.partial = [rec for rec in records if rec["scored_at_step"] is not None]
                raise err
            if projected > max_seconds and done[1] and stopped is None:
                stopped = r + 1
                if run.rank == 0:
                    log(f"{row.label}: projected {projected:.1f}s > EVAL_MAX_SECONDS {max_seconds:.1f}s: updates stop "
                        f"after {where}, the rest is scored only")
    finally:
        updater.close()
        for p, flag in saved_flags:
            p.requires_grad_(flag)
    bar.close()
    if BUNDLE_KIND == "package":
        ttt_totals(records, totals, len(run.tokens) - 1, row.entry, short)
    val_loss, val_bpb, num_scored, num_bytes = walk_scores(totals)
    return dict(val_loss=val_loss, val_bpb=val_bpb, stride=run.stride, epochs=run.epochs,
                eval_seconds=clock() - t_start, num_scored_tokens=num_scored, num_bytes=num_bytes,
                num_chunks=num_units, num_updates=num_updates, updates_stopped_at_chunk=stopped, chunks=records,
                mode_entries=list(sched.result), **sched.result)
