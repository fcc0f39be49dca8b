"""The TTT modes: a registry keyed by TTT_MODE (as torchtitan keys its components by name), each row a
schedule (how the val stream is cut into scored units and rounds), a scope (which scored targets the
updates after a unit may train on) and an updater; eval/walk.py walks any row. A new mode is one
row here (plus its updater when none of these fits) and its name in primitives/settings.py's TTT_MODE_NAMES (the
TTT_MODE choices; tests/test_ttt_engine.py asserts the two equal); the trainer, `python -m eval score` and the plan
read everything mode-specific from its row.

Rows (sources in eval/ttt.py, eval/lora_ttt.py):
  chunked (PR #461/#549): chunks of >= TTT_CHUNK_TOKENS targets of whole documents, scope the chunk,
    SGD on TTT_PARAMS with lr cosine-decayed over the chunks; the last chunk is never trained on.
  phased (PR #1610/#1626/#1736): TTT_PHASES phases at document starts, scope the whole scored prefix,
    the same SGD (cosine over the phases).
  lora (PR #77/#1530): each document cut into chunks of TTT_LORA_CHUNK_TOKENS, TTT_LORA_BATCH_DOCS documents
    side by side in adapter slots (eval/lora_batch.py), scope the chunk (with up to seq_len tokens of its
    document as context), Adam on the slot's adapter, reset per document; a document's last chunk is never
    trained on. The model's weights never move.
"""

import bisect
import math
import time
from dataclasses import dataclass

import torch

from eval.lora_batch import BatchedLoRA, lora_train_batch, round_windows, score_lora_batch
from eval.lora_ttt import (lora_batch_windows, lora_schedule, plan_lora_ttt, project_lora_seconds, round_forwards,
                           split_lora_chunks)
from eval.phased_lora import PhasedLoRAUpdater, phased_lora_schedule
from eval.phased_ttt import plan_phased_ttt, project_phased_seconds
from eval.sliding import Scorer, count_sliding_windows
from eval.ttt import (plan_chunk_sequences, plan_ttt, project_ttt_seconds, select_ttt_params, sgd_step, split_ttt_chunks,
                      ttt_step_seqs)
from eval.walk import Schedule, TTTRun, run_score_first
from primitives.settings import Hyperparameters

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"

SGD_FIELDS = ("lr", "momentum", "params", "batch_seqs", "grad_clip")


@dataclass(frozen=True)
class TTTMode:
    """One row of TTT_MODES. fields: the mode's settings, each the Hyperparameters field ttt_<name> (its defaults, its
    env name in messages; run.cfg keys by cfg_key); valid(run) -> bool, with `expected` saying what in the refusal;
    schedule(run) -> Schedule; scope(sched, unit) -> (lo, hi) targets; updater(model, run) -> Scorer; label, unit,
    count_from: the names and round numbering its messages use (entry: run_<label>); plan(hp, timings, *, strides,
    roundtrip_seconds, num_val_tokens, world_size) -> the mode's plan dict (eval/plan.py makes the EvalPlan) with
    wanted_seconds (None: the mode is not planned, it runs TTT_EPOCHS at EVAL_STRIDE); timing: what the trainer
    times for the plan, a key of trainer.ttt_eval.PLAN_TIMINGS and tools/bench/gpu_check.py's TTT_TIMED ("sgd": one
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
    def entry(self) -> str:
        return "run_" + self.label.replace(" ", "_")

    @property
    def title(self) -> str:
        return self.label + " eval"


class SGDUpdater(Scorer):
    """SGD (momentum) on the TTT_PARAMS parameters: after unit c, `epochs` passes over the sequences of seq_len
    covering the scope (plan_chunk_sequences), min(batch_seqs, the schedule's cap) sequences per step
    (all ranks; each takes its share, gradients all-reduced), lr cosine-decayed over the units, grad clip."""

    def __init__(self, model, run: TTTRun):
        super().__init__(model, run)
        cfg = run.cfg
        self.chosen = select_ttt_params(model, cfg["params"])
        self.train_fwd = torch.compile(model, dynamic=False) if run.compile_model else model
        self.optimizer = torch.optim.SGD(self.chosen, lr=cfg["lr"], momentum=cfg["momentum"])

    def start(self, sched: Schedule) -> None:
        super().start(sched)
        self.batch_seqs = ttt_step_seqs(self.run.cfg["batch_seqs"], sched.step_cap_tokens, self.run.seq_len,
                                        self.run.world_size)

    def trainable(self) -> list:
        return self.chosen

    def _plan(self, span_c, num_units):
        _, c, span = span_c
        lr = self.run.cfg["lr"] * 0.5 * (1 + math.cos(math.pi * c / max(1, num_units - 1)))
        return lr, plan_chunk_sequences(*span, self.run.seq_len, self.batch_seqs)

    def count_steps(self, sched, spans, num_units) -> int:
        plans = [self._plan(sc, num_units) for sc in spans]
        return sum(self.run.epochs * (lr > 0) * -(-len(starts) // self.batch_seqs) for lr, starts in plans)

    def steps(self, sched, spans, num_units):
        r, b = self.run, self.batch_seqs
        for lr, starts in (self._plan(sc, num_units) for sc in spans):
            for _ in range(r.epochs if lr > 0 else 0):
                for batch in (starts[k:k + b] for k in range(0, len(starts), b)):
                    sgd_step(self.train_fwd, self.optimizer, self.chosen, r.tokens, batch, seq_len=r.seq_len,
                             rank=r.rank, world_size=r.world_size, lr=lr, grad_clip=r.cfg["grad_clip"],
                             autocast_dtype=r.autocast_dtype, distributed=torch.distributed.is_initialized())
                    yield [(min(batch), max(batch) + r.seq_len)]  # all ranks' sequences

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class LoRAUpdater(Scorer):
    """Batched per-document LoRA (eval/lora_batch.py): a slot taking a new document is reset; a round's chunks
    are scored together (lora_batch_windows windows per forward, the slot's adapter on each row); then
    `epochs` batched Adam steps (TTT_LORA_LR) of every slot whose chunk trains, on its scope with up to
    seq_len tokens of the same document as context. Every rank takes every step (the adapters stay equal)."""

    def __init__(self, model, run: TTTRun):
        super().__init__(model, run)
        self.lora = BatchedLoRA(model, run.cfg["lora_rank"], run.cfg["batch_docs"])
        self.batch_windows = lora_batch_windows(run.cfg["chunk_tokens"], run.stride, run.world_size,
                                                run.eval_batch_seqs, run.cfg["batch_docs"])

    def start(self, sched: Schedule) -> None:
        pass

    def progress(self, sched: Schedule) -> tuple:
        return len(sched.rounds), "rounds"

    def begin_round(self, sched, now) -> None:
        for s, c, _ in now:
            if sched.bounds[c] == sched.doc_starts[c]:  # the slot takes a new document: a fresh adapter
                self.lora.reset_slot(s)

    def score(self, sched, now) -> torch.Tensor:
        r, bw = self.run, self.batch_windows
        sums = torch.zeros(self.lora.slots, 3, dtype=torch.float64, device=r.tokens.device)
        windows = round_windows(sched.bounds, [c for _, c, _ in now], seq_len=r.seq_len, stride=r.stride)
        slot_of = {c: s for s, c, _ in now}
        with torch.inference_mode():
            for first in range(r.rank * bw, len(windows), r.world_size * bw):
                sums += score_lora_batch(self.score_fwd, self.lora, r.tokens, r.luts, windows[first:first + bw],
                                         sched.bounds, slot_of, bw, seq_len=r.seq_len, stride=r.stride,
                                         autocast_dtype=r.autocast_dtype)
        self.bar.update()
        return sums[[s for s, _, _ in now]]

    def count_steps(self, sched, spans, num_units) -> int:
        return self.run.epochs * bool(spans and self.run.cfg["lr"] > 0)

    def steps(self, sched, spans, num_units):
        r = self.run
        rows = [(s, max(sched.doc_starts[c], b - r.seq_len), max(a, b - r.seq_len), b) for s, c, (a, b) in spans]
        for _ in range(self.count_steps(sched, spans, num_units)):
            lora_train_batch(self.model, self.lora, r.tokens, rows, autocast_dtype=r.autocast_dtype)
            self.lora.adam_step([s for s, *_ in rows], r.cfg["lr"])
            yield [(a, b) for _, _, a, b in rows]

    def close(self) -> None:
        self.lora.remove()


def chunked_schedule(run: TTTRun) -> Schedule:
    bounds = split_ttt_chunks(run.tokens, run.cfg["chunk_tokens"], run.bos_id)
    return one_unit_rounds(bounds, run.cfg["chunk_tokens"])


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


def phased_schedule(run: TTTRun) -> Schedule:
    bounds = split_phases(run.tokens, run.cfg["phases"], run.bos_id)
    return one_unit_rounds(bounds, bounds[-1], phases=len(bounds) - 1)


def one_unit_rounds(bounds: list, step_cap_tokens: int, **result) -> Schedule:
    """One unit per round, in stream order; the last is never trained on; score work = targets."""
    n = len(bounds) - 1
    return Schedule(bounds, [[(0, c, c == n - 1)] for c in range(n)], [bounds[c + 1] - bounds[c] for c in range(n)],
                    result=result, step_cap_tokens=step_cap_tokens)


def lora_schedule_of(run: TTTRun) -> Schedule:
    cfg = run.cfg
    bounds, doc_starts = split_lora_chunks(run.tokens, cfg["chunk_tokens"], run.bos_id)
    rounds, doc_index, _ = lora_schedule(bounds, doc_starts, cfg["batch_docs"])
    windows = lora_batch_windows(cfg["chunk_tokens"], run.stride, run.world_size, run.eval_batch_seqs, cfg["batch_docs"])
    forwards = round_forwards(bounds, rounds, seq_len=run.seq_len, stride=run.stride, batch_windows=windows,
                              world_size=run.world_size)
    none, num_docs = [None] * len(doc_index), doc_index[-1] + 1
    return Schedule(bounds, rounds, forwards, ledger=dict(document=doc_index, slot=none, round=none),
                    doc_starts=doc_starts, result=dict(lora_rank=cfg["lora_rank"], lora_batch_docs=cfg["batch_docs"],
                                                       num_documents=num_docs, num_rounds=len(rounds)))


def unit_scope(sched: Schedule, c: int) -> tuple:
    """The updates after unit c train on its own targets, [bounds[c], bounds[c + 1])."""
    return sched.bounds[c], sched.bounds[c + 1]


def prefix_scope(sched: Schedule, c: int) -> tuple:
    """The updates after unit c train on every scored target, [0, bounds[c + 1])."""
    return 0, sched.bounds[c + 1]


def sgd_valid(run: TTTRun, unit: str) -> bool:
    cfg = run.cfg
    return (cfg["lr"] >= 0 and cfg["batch_seqs"] > 0 and cfg["batch_seqs"] % run.world_size == 0
            and cfg[unit] >= (run.seq_len if unit == "chunk_tokens" else 1))


def plan_sgd(planner, project, unit: str):
    """A SGD row's plan: planner (eval.ttt.plan_ttt, eval.phased_ttt.plan_phased_ttt) with the row's unit setting
    (chunk_tokens, phases) from the measured eval forward and SGD step; wanted_seconds by project at EVAL_STRIDE."""
    def plan(hp, t: dict, *, strides, roundtrip_seconds, num_val_tokens, world_size) -> dict:
        common = dict(forward_seconds=t["forward_seconds"], train_seconds=t["step_seconds"], seq_len=hp.train_seq_len,
                      num_val_tokens=num_val_tokens, eval_batch_seqs=hp.eval_batch_seqs, batch_seqs=hp.ttt_batch_seqs,
                      world_size=world_size, epochs=hp.ttt_epochs, **{unit: getattr(hp, f"ttt_{unit}")})
        return dict(planner(strides=strides, max_seconds=hp.eval_max_seconds, roundtrip_seconds=roundtrip_seconds,
                            **common), wanted_seconds=project(stride=hp.eval_stride, **common))
    return plan


def plan_lora(hp, t: dict, *, strides, roundtrip_seconds, num_val_tokens, world_size) -> dict:
    (forward_seconds, step_seconds), seq_len = t["lora"], hp.train_seq_len
    per_window = t["forward_seconds"] / (hp.eval_batch_seqs * world_size)  # the sliding pass, when TTT is skipped
    plan = plan_lora_ttt(forward_seconds=forward_seconds, step_seconds=step_seconds, work_at=t["work_at"],
                         strides=strides, epochs=hp.ttt_epochs, max_seconds=hp.eval_max_seconds,
                         sliding_seconds=lambda s: per_window * count_sliding_windows(num_val_tokens - 1, seq_len, s),
                         roundtrip_seconds=roundtrip_seconds)
    return dict(plan, wanted_seconds=project_lora_seconds(forward_seconds=forward_seconds, step_seconds=step_seconds,
                                                          work=t["work_at"](hp.eval_stride), epochs=hp.ttt_epochs))


def record_schedule(run: TTTRun) -> Schedule:
    return phased_lora_schedule(run)  # eval/phased_lora.py is packed only for its mode: called, not referenced


def record_updater(model, run: TTTRun) -> Scorer:
    return PhasedLoRAUpdater(model, run)


SGD = " batch seqs a multiple of the world size, others >= 0"
TTT_MODES = {
    "chunked": TTTMode(
        label="ttt", unit="chunk", count_from=0, fields=("chunk_tokens", *SGD_FIELDS),
        valid=lambda run: sgd_valid(run, "chunk_tokens"), expected="seq_len <= chunk tokens," + SGD,
        schedule=chunked_schedule, scope=unit_scope, updater=SGDUpdater,
        plan=plan_sgd(plan_ttt, project_ttt_seconds, "chunk_tokens"), recorded=False),
    "phased": TTTMode(
        label="phased ttt", unit="phase", count_from=0, fields=("phases", *SGD_FIELDS),
        valid=lambda run: sgd_valid(run, "phases"), expected="phases >= 1," + SGD,
        schedule=phased_schedule, scope=prefix_scope, updater=SGDUpdater,
        plan=plan_sgd(plan_phased_ttt, project_phased_seconds, "phases")),
    "lora": TTTMode(
        label="lora ttt", unit="round", count_from=1,
        fields=("lora_rank", "lora_lr", "lora_chunk_tokens", "lora_batch_docs"),
        valid=lambda run: (0 < run.cfg["chunk_tokens"] <= run.seq_len and run.cfg["lr"] >= 0
                           and run.cfg["lora_rank"] >= 1 and run.cfg["batch_docs"] >= 1),
        expected="0 < chunk tokens <= seq_len, rank and batch docs >= 1, others >= 0",
        schedule=lora_schedule_of, scope=unit_scope, updater=LoRAUpdater, plan=plan_lora, timing="lora"),
    # PR #1855's phased TTT (eval/phased_lora.py): per-document adapters in batches, global SGD between phases
    "phased_lora": TTTMode(
        label="phased lora ttt", unit="round", count_from=1,
        fields=("phases", "prefix_docs", "global_epochs", "chunk_tokens", *SGD_FIELDS, "lora_rank", "lora_lr",
                "lora_chunk_tokens", "lora_batch_docs", "lora_alpha", "lora_wd", "lora_beta1", "lora_beta2", "lora_k",
                "lora_mlp", "lora_o"),
        valid=lambda run: (sgd_valid(run, "chunk_tokens") and 0 < run.cfg["lora_chunk_tokens"] <= run.seq_len
                           and min(run.cfg["phases"], run.cfg["lora_rank"], run.cfg["batch_docs"]) >= 1
                           and min(run.cfg["prefix_docs"], run.cfg["global_epochs"], run.cfg["lora_lr"],
                                   run.cfg["lora_wd"]) >= 0 and run.cfg["lora_alpha"] > 0
                           and 0 <= run.cfg["lora_beta1"] < 1 and 0 <= run.cfg["lora_beta2"] < 1),
        expected="seq_len <= chunk tokens, 0 < lora chunk tokens <= seq_len, phases, rank and batch docs >= 1, "
                 "alpha > 0, betas in [0, 1)," + SGD,
        schedule=record_schedule, scope=unit_scope, updater=record_updater),
}


def cfg_key(name: str, fields: tuple = ()) -> str:
    """run.cfg's key of a row field: lora_chunk_tokens -> chunk_tokens, lora_lr -> lr (the LoRA mode's own
    settings, TTT_LORA_*), others as they are; a field keeps its name where the short one is also one of the
    row's `fields` (phased_lora has both TTT_LR and TTT_LORA_LR)."""
    short = {"lora_chunk_tokens": "chunk_tokens", "lora_lr": "lr", "lora_batch_docs": "batch_docs"}.get(name, name)
    return name if short in fields and short != name else short


def mode_settings(mode: str, settings) -> dict:
    """The keyword settings of run_mode for `mode` from an object with Hyperparameters' ttt_* attributes (the
    trainer's settings or `python -m eval score`'s args)."""
    fields = TTT_MODES[mode].fields
    return {cfg_key(f, fields): getattr(settings, f"ttt_{f}") for f in fields}


def run_mode(mode: str, model, val_tokens, luts, *, seq_len, stride, epochs=None, eval_batch_seqs=32, device="cpu",
             rank=0, world_size=1, autocast_dtype=None, compile_model=False, max_seconds=600.0, bos_id=1, log=print,
             clock=time.perf_counter, **settings) -> dict:
    """Score-first TTT of TTT_MODES[mode] over val_tokens int [N] (eval/walk.py run_score_first's dict). model: an
    nn.Module with forward_logits(int64 [B, T]) -> logits [B, T, V] (or forward_hidden + head_logits,
    eval.sliding.scoring_forward) and, for SGD rows, forward(x, y) -> mean cross-entropy; kept in eval mode.
    settings: the row's fields (cfg keys, cfg_key) over the Hyperparameters defaults; epochs: TTT_EPOCHS (default
    Hyperparameters'): one default table, the trainer's.
    autocast_dtype: e.g. torch.bfloat16 on CUDA; compile_model: torch.compile the forwards (static shapes).
    Multi-rank: call on every rank. Raises ValueError naming every setting (env names) for bad inputs, and
    naming TTT_MODE for an unknown mode, before anything runs."""
    if mode not in TTT_MODES:
        raise ValueError(f"TTT_MODE={mode!r}: expected one of {', '.join(TTT_MODES)}")
    row, defaults = TTT_MODES[mode], Hyperparameters()
    cfg = {**mode_settings(mode, defaults), **settings}
    epochs = defaults.ttt_epochs if epochs is None else epochs
    device = torch.device(device)
    run = TTTRun(tokens=val_tokens, luts=luts, seq_len=seq_len, stride=stride, epochs=epochs,
                 eval_batch_seqs=eval_batch_seqs, rank=rank, world_size=world_size, autocast_dtype=autocast_dtype,
                 compile_model=compile_model, bos_id=bos_id, cfg=cfg)
    if val_tokens.dim() != 1 or len(val_tokens) < 2 or val_tokens.is_floating_point() or not (
            0 < stride <= seq_len and epochs >= 0 and eval_batch_seqs > 0 and max_seconds > 0 and row.valid(run)):
        named = ", ".join(f"{('TTT_' + f).upper()}={cfg[cfg_key(f, row.fields)]}" for f in row.fields)
        raise ValueError(f"{row.entry}: val_tokens {val_tokens.dtype} {list(val_tokens.shape)}, EVAL_STRIDE={stride}, "
                         f"TRAIN_SEQ_LEN={seq_len}, {named}, TTT_EPOCHS={epochs} (world size {world_size}), "
                         f"EVAL_BATCH_SEQS={eval_batch_seqs}, EVAL_MAX_SECONDS={max_seconds}; expected int [N >= 2], "
                         f"0 < stride <= seq_len, {row.expected}")
    run.tokens, run.luts = val_tokens.to(device, torch.int64), [t.to(device) for t in luts]
    return run_score_first(model, run, row, max_seconds=max_seconds, log=log, clock=clock)
