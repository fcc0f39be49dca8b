"""The SGD rows of the TTT registry (eval/ttt.py TTT_MODES), packed only for their modes:
  chunked (PR #461/#549): chunks of >= TTT_CHUNK_TOKENS targets of whole documents, scope the chunk,
    SGD on TTT_PARAMS with lr cosine-decayed over the chunks; the last chunk is never trained on.
  phased (PR #1610/#1626/#1736): TTT_PHASES phases at document starts, scope the whole scored prefix,
    the same SGD (cosine over the phases).
Their library (chunks, the SGD step, the plans): eval/ttt.py, eval/phased_ttt.py; the walk: eval/walk.py.
"""

import bisect
import math

import torch

from eval.phased_ttt import plan_phased_ttt, project_phased_seconds
from eval.sliding import Scorer
from eval.ttt import (SGD_EXPECTED, SGD_FIELDS, TTT_MODES, TTTMode, plan_chunk_sequences, plan_ttt, project_ttt_seconds,
                      select_ttt_params, sgd_step, sgd_valid, split_ttt_chunks, ttt_step_seqs, unit_scope)
from eval.walk import Schedule, TTTRun

# the packed train_gpt.py holds this module only for runs with an SGD mode of score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED and TTT_MODE in ('chunked', 'phased')"


class SGDUpdater(Scorer):
    """SGD (momentum) on the TTT_PARAMS parameters: after unit c, `epochs` passes over the sequences of seq_len
    covering the scope (plan_chunk_sequences), min(batch_seqs, the schedule's cap) sequences per step
    (all ranks; each takes its share, gradients all-reduced), lr cosine-decayed over the units, grad clip."""

    def __init__(self, model, run: TTTRun, sched: Schedule, /):
        super().__init__(model, run, sched)
        cfg = run.cfg
        self.chosen = select_ttt_params(model, cfg["params"])
        self.train_fwd = torch.compile(model, dynamic=False) if run.compile_model else model
        self.optimizer = torch.optim.SGD(self.chosen, lr=cfg["lr"], momentum=cfg["momentum"])
        # a step is capped at a chunk's sequences (chunked); phases are not capped
        cap_tokens = cfg.get("chunk_tokens", len(run.tokens) - 1)
        self.batch_seqs = ttt_step_seqs(cfg["batch_seqs"], cap_tokens, run.seq_len, run.world_size)
        self.last_unit = max(1, len(sched.bounds) - 2)  # the cosine's end: the last unit

    def trainable(self, /) -> list:
        return self.chosen

    def _plan(self, span_c, /):
        _, c, span = span_c
        lr = self.run.cfg["lr"] * 0.5 * (1 + math.cos(math.pi * c / self.last_unit))
        return lr, plan_chunk_sequences(*span, self.run.seq_len, self.batch_seqs)

    def count_steps(self, sched, spans, /) -> int:
        plans = [self._plan(sc) for sc in spans]
        return sum(self.run.epochs * (lr > 0) * -(-len(starts) // self.batch_seqs) for lr, starts in plans)

    def steps(self, sched, spans, /):
        r, b = self.run, self.batch_seqs
        for lr, starts in (self._plan(sc) for sc in spans):
            for _ in range(r.epochs if lr > 0 else 0):
                for batch in (starts[k:k + b] for k in range(0, len(starts), b)):
                    sgd_step(self.train_fwd, self.optimizer, self.chosen, r, batch, lr)
                    yield [(min(batch), max(batch) + r.seq_len)]  # all ranks' sequences

    def close(self, /) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def chunked_schedule(run: TTTRun, /) -> Schedule:
    bounds = split_ttt_chunks(run.tokens, run.cfg["chunk_tokens"], run.bos_id)
    return one_unit_rounds(bounds)


def split_phases(tokens: torch.Tensor, phases: int, bos_id: int = 1, /) -> list:
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


def phased_schedule(run: TTTRun, /) -> Schedule:
    bounds = split_phases(run.tokens, run.cfg["phases"], run.bos_id)
    return one_unit_rounds(bounds, phases=len(bounds) - 1)


def one_unit_rounds(bounds: list, /, **result) -> Schedule:
    """One unit per round, in stream order; the last is never trained on; score work = targets."""
    n = len(bounds) - 1
    return Schedule(bounds, [[(0, c, c == n - 1)] for c in range(n)], [bounds[c + 1] - bounds[c] for c in range(n)],
                    result=result)


def prefix_scope(sched: Schedule, c: int, /) -> tuple:
    """The updates after unit c train on every scored target, [0, bounds[c + 1])."""
    return 0, sched.bounds[c + 1]


def plan_sgd(planner, project, unit: str, /):
    """A SGD row's plan: planner (eval.ttt.plan_ttt, eval.phased_ttt.plan_phased_ttt) with the row's unit setting
    (chunk_tokens, phases) from the measured eval forward and SGD step; wanted_seconds by project at EVAL_STRIDE."""
    def plan(hp, t: dict, strides, roundtrip_seconds, num_val_tokens, world_size, /) -> dict:
        common = dict(forward_seconds=t["forward_seconds"], train_seconds=t["step_seconds"], seq_len=hp.train_seq_len,
                      num_val_tokens=num_val_tokens, eval_batch_seqs=hp.eval_batch_seqs, batch_seqs=hp.ttt_batch_seqs,
                      world_size=world_size, epochs=hp.ttt_epochs, **{unit: getattr(hp, f"ttt_{unit}")})
        return dict(planner(strides=strides, max_seconds=hp.eval_max_seconds, roundtrip_seconds=roundtrip_seconds,
                            **common), wanted_seconds=project(stride=hp.eval_stride, **common))
    return plan


# TTTMode(label, unit, count_from, fields, valid, expected, schedule, scope, updater, plan, timing, recorded)
TTT_MODES.update(
    chunked=TTTMode(
        "ttt", "chunk", 0, ("chunk_tokens", *SGD_FIELDS), lambda r: sgd_valid(r, "chunk_tokens"),
        "seq_len <= chunk tokens," + SGD_EXPECTED, chunked_schedule, unit_scope, SGDUpdater,
        plan_sgd(plan_ttt, project_ttt_seconds, "chunk_tokens"), "sgd", False),
    phased=TTTMode(
        "phased ttt", "phase", 0, ("phases", *SGD_FIELDS), lambda r: sgd_valid(r, "phases"),
        "phases >= 1," + SGD_EXPECTED, phased_schedule, prefix_scope, SGDUpdater,
        plan_sgd(plan_phased_ttt, project_phased_seconds, "phases")))
