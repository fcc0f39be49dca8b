"""The one score-first TTT driver: walks the val stream in legal order and is parameterised by a mode
(eval/ttt_modes.py): its schedule (which targets each round scores), its scope (which scored targets
an update may train on after a unit is scored: the chunk, the scored prefix, ...) and its updater (SGD
on chosen parameters, per-document LoRA slots, ... or none: the sliding pass).

The rule and its sources are eval/ttt.py's (openai/parameter-golf README FAQ; PR #461/#549 chunked,
PR #1610/#1626 phased, PR #77/#1530 per-document LoRA; issue #1017's conditions): every target is
scored exactly once, by a model none of whose updates trained on it, in one left-to-right pass.

What exists once, here: the ledger (eval/ttt.py records: per unit the update counter that scored it
and the first/last update whose batch held one of its targets) with its legality check after every
scored unit and over the whole run; the parameter freeze (every parameter frozen but the updater's,
restored after); the time guard (after each round past the first and before the last, the rest is
projected from the measured seconds per unit of scoring work (targets or forwards, the schedule's) and
per update step, max over ranks: updates stop when scoring plus the planned steps would exceed
max_seconds, EvalTimeError with `.partial` when scoring alone would).
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from eval.sliding import EvalTimeError, scoring_forward
from eval.ttt import (check_ttt_legality, mark_update, score_unit_windows, ttt_records, ttt_totals,
                      ttt_window_ranges)
from primitives.progress import Progress

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"


@dataclass
class TTTRun:
    """What every mode's schedule and updater read: the stream tokens int64 [N] and byte LUTs on `device`,
    the window rule (seq_len, stride, eval_batch_seqs windows per scoring forward), ranks, autocast,
    compile, the BOS id, the epochs and the mode's own settings (`cfg`: its row's fields)."""
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
    bos_id: int
    cfg: dict


@dataclass
class Schedule:
    """A mode's cut of the stream: unit c = targets [bounds[c], bounds[c + 1]); rounds, each a list of
    (slot, unit, last) scored together (last: never trained on after); score_work[r], the scoring work of
    round r in the guard's unit (targets or forwards); ledger: extra per-unit record columns; doc_starts:
    the first target of each unit's document (None when units are not cut inside documents); result:
    entries the run's dict adds (result.json's ttt_<key>, num_ dropped, trainer/finish.py); step_cap_tokens:
    the targets an SGD step's batch is capped by (ttt_step_seqs)."""
    bounds: list
    rounds: list
    score_work: list
    ledger: dict = field(default_factory=dict)
    doc_starts: list | None = None
    result: dict = field(default_factory=dict)
    step_cap_tokens: int = 0


class Scorer:
    """The updater that updates nothing: scores a round's units with eval/sliding.py's exact window set
    restricted to each unit's targets (context from earlier tokens allowed), eval_batch_seqs windows per
    forward, a share of each unit's window batches per rank (sums all-reduced). Subclasses add training:
    trainable() (the model parameters left unfrozen), steps() (run the updates after a round, yielding per
    step the target ranges it trained on), count_steps() (the steps steps() would take), close(). progress():
    (total, unit) of the progress bar (`self.bar`) that score() updates."""

    def __init__(self, model, run: TTTRun):
        self.model, self.run = model, run
        self.score_fwd = scoring_forward(model, run.compile_model)

    def start(self, sched: Schedule) -> None:
        r = self.run
        self.windows = ttt_window_ranges(sched.bounds, seq_len=r.seq_len, stride=r.stride, rank=r.rank,
                                         world_size=r.world_size, eval_batch_seqs=r.eval_batch_seqs)

    def progress(self, sched: Schedule) -> tuple:
        return sum(map(len, self.windows)), "window batches"

    def trainable(self) -> list:
        return []

    def begin_round(self, sched: Schedule, now: list) -> None:
        pass

    def score(self, sched: Schedule, now: list) -> torch.Tensor:
        """float64 [len(now), 3] (nll nats, targets, bytes) per unit of the round, summed over ranks."""
        r = self.run
        return torch.stack([score_unit_windows(self.score_fwd, r.tokens, r.luts, self.windows[c], sched.bounds[c],
                                               sched.bounds[c + 1], eval_batch_seqs=r.eval_batch_seqs, seq_len=r.seq_len,
                                               stride=r.stride, autocast_dtype=r.autocast_dtype, bar=self.bar)
                            for _, c, _ in now])

    def steps(self, sched: Schedule, spans: list, num_units: int):
        return iter(())

    def count_steps(self, sched: Schedule, spans: list, num_units: int) -> int:
        return 0

    def close(self) -> None:
        pass


def run_score_first(model, run: TTTRun, row, *, max_seconds: float, log, clock) -> dict:
    """Score-first TTT of `row` (an eval.ttt_modes.TTTMode) over run.tokens; the model is adapted IN PLACE when the
    row's updater trains its parameters. Returns dict(val_loss nats/token, val_bpb, stride, epochs, eval_seconds,
    num_scored_tokens (== N - 1), num_bytes, num_chunks (units), num_updates (one per unit trained per step),
    updates_stopped_at_chunk (the round after which updates stopped, None: never), chunks (the ledger), mode_entries
    (the schedule's result keys), plus the schedule's result entries). Raises ValueError (check_ttt_legality) if a
    unit was scored after an update on it, EvalTimeError when scoring alone cannot fit max_seconds, RuntimeError (a
    bug) unless every target was scored exactly once."""
    t_start = clock()
    sched = row.schedule(run)
    updater = row.updater(model, run)
    updater.start(sched)
    bounds, rounds, num_units = sched.bounds, sched.rounds, len(sched.bounds) - 1
    records = ttt_records(bounds, **sched.ledger)
    spans = [[(s, c, row.scope(sched, c)) for s, c, last in now if not last] for now in rounds]
    planned = [updater.count_steps(sched, sp, num_units) for sp in spans]
    score_left, steps_left = sched.score_work + [0], planned + [0]  # suffix sums: the work after round r
    for r in range(len(rounds) - 1, -1, -1):
        score_left[r] += score_left[r + 1]
        steps_left[r] += steps_left[r + 1]
    saved_flags = [(p, p.requires_grad) for p in model.parameters()]
    step, num_updates, stopped = 0, 0, None
    totals = torch.zeros(3, dtype=torch.float64, device=run.tokens.device)
    seconds, done = [0.0, 0.0], [0, 0]  # scoring, updating; score work, steps (rounds past the first)
    bar = updater.bar = Progress(f"{row.label} eval stride {run.stride}", *updater.progress(sched))
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
            for (s, c, _), unit_sums in zip(now, sums):
                nll, num_scored, num_bytes = unit_sums.tolist()
                if num_scored != bounds[c + 1] - bounds[c]:
                    raise RuntimeError(f"{row.entry}: chunk {c} scored {num_scored:.0f} of its "
                                       f"{bounds[c + 1] - bounds[c]} targets: a bug of the window plan")
                totals += unit_sums
                where = {k: v for k, v in (("slot", s), ("round", r)) if k in records[c]}
                records[c].update(scored_at_step=step, **where, val_loss=nll / num_scored,
                                  val_bpb=nll / math.log(2) / max(num_bytes, 1))
                check_ttt_legality(records[max(0, c - 1):c + 1])
            t1 = clock()
            for ranges in updater.steps(sched, spans[r], num_units) if stopped is None else ():
                step, num_updates = step + 1, num_updates + len(ranges)
                for lo, hi in ranges:
                    mark_update(records, bounds, lo, hi, step)
                done[1] += r > 0
            if r == 0 or r == len(rounds) - 1:
                continue  # round 0 pays for compilation: not a rate; after the last nothing is left to project
            seconds[0] += t1 - t0
            seconds[1] += clock() - t1
            done[0] += sched.score_work[r]
            stopped = stopped or time_guard(row, records, seconds, done, r, len(rounds), max_seconds, log, run,
                                            elapsed=clock() - t_start, score_left=score_left[r + 1],
                                            steps_left=steps_left[r + 1] * (stopped is None))
    finally:
        updater.close()
        for p, flag in saved_flags:
            p.requires_grad_(flag)
    bar.close()
    val_loss, val_bpb, num_scored, num_bytes = ttt_totals(records, totals, len(run.tokens) - 1, row.entry)
    return dict(val_loss=val_loss, val_bpb=val_bpb, stride=run.stride, epochs=run.epochs,
                eval_seconds=clock() - t_start, num_scored_tokens=num_scored, num_bytes=num_bytes,
                num_chunks=num_units, num_updates=num_updates, updates_stopped_at_chunk=stopped, chunks=records,
                mode_entries=list(sched.result), **sched.result)


def time_guard(row, records, seconds, done, r, num_rounds, max_seconds, log, run, *, elapsed, score_left, steps_left):
    """After round r: EvalTimeError (with .partial, the scored records) if scoring what is left at the measured
    rate cannot fit max_seconds; r + 1 (updates stop after round r, logged) if scoring plus steps_left
    update steps would not; else None. Rates are seconds per unit of score work and per step, max over ranks."""
    rates = torch.tensor([seconds[0] / done[0], seconds[1] / max(done[1], 1)], dtype=torch.float64,
                         device=run.tokens.device)
    if dist.is_initialized():
        dist.all_reduce(rates, op=dist.ReduceOp.MAX)
    score_rate, step_rate = rates.tolist()
    scoring = elapsed + score_rate * score_left
    where = f"{row.unit} {r + row.count_from}/{num_rounds}"
    if scoring > max_seconds:
        err = EvalTimeError(f"{row.entry}: projected {scoring:.1f}s for scoring alone after {where} ({elapsed:.1f}s "
                            f"elapsed) > EVAL_MAX_SECONDS {max_seconds:.1f}s: raise EVAL_STRIDE", 0)
        err.partial = [rec for rec in records if rec["scored_at_step"] is not None]
        raise err
    projected = scoring + step_rate * steps_left
    if not (steps_left and done[1] and projected > max_seconds):
        return None
    if run.rank == 0:
        log(f"{row.label}: projected {projected:.1f}s > EVAL_MAX_SECONDS {max_seconds:.1f}s: updates stop after "
            f"{where}, the rest is scored only")
    return r + 1
