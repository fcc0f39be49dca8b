"""The `lora` row of the TTT registry (eval/ttt.py TTT_MODES), packed only for its mode (PR #77/#1530): each
document cut into chunks of TTT_LORA_CHUNK_TOKENS, TTT_LORA_BATCH_DOCS documents side by side in adapter slots
(eval/lora_batch.py), scope the chunk (with up to seq_len tokens of its document as context), Adam on the slot's
adapter, reset per document; a document's last chunk is never trained on. The model's weights never move.
Its schedule, work count and plan: eval/lora_ttt.py; the walk: eval/walk.py.
"""

import torch

from eval.lora_batch import BatchedLoRA, lora_train_batch, round_windows, score_lora_batch
from eval.lora_ttt import lora_batch_windows, lora_rounds, plan_lora
from eval.sliding import Scorer
from eval.ttt import TTT_MODES, TTTMode, unit_scope
from eval.walk import Schedule, TTTRun

# the packed train_gpt.py holds this module only for runs with per-document LoRA TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED and TTT_MODE == 'lora'"


class LoRAUpdater(Scorer):
    """Batched per-document LoRA (eval/lora_batch.py): a slot taking a new document is reset; a round's chunks
    are scored together (lora_batch_windows windows per forward, the slot's adapter on each row); then
    `epochs` batched Adam steps (TTT_LORA_LR) of every slot whose chunk trains, on its scope with up to
    seq_len tokens of the same document as context. Every rank takes every step (the adapters stay equal)."""

    def __init__(self, model, run: TTTRun, sched: Schedule, /):
        super().__init__(model, run, sched)
        self.lora = BatchedLoRA(model, run.cfg["lora_rank"], run.cfg["batch_docs"])
        self.batch_windows = run_batch_windows(run)

    def progress(self, sched: Schedule, /) -> tuple:
        return len(sched.rounds), "rounds"

    def begin_round(self, sched, now, /) -> None:
        for s, c, _ in now:
            if sched.bounds[c] == sched.doc_starts[c]:  # the slot takes a new document: a fresh adapter
                self.lora.reset_slot(s)

    def score(self, sched, now, /) -> torch.Tensor:
        r, bw = self.run, self.batch_windows
        sums = torch.zeros(self.lora.slots, 3, dtype=torch.float64, device=r.tokens.device)
        windows = round_windows(sched.bounds, [c for _, c, _ in now], seq_len=r.seq_len, stride=r.stride)
        slot_of = {c: s for s, c, _ in now}
        with torch.inference_mode():
            for first in range(r.rank * bw, len(windows), r.world_size * bw):
                sums += score_lora_batch(self.score_fwd, self.lora, r, windows[first:first + bw], sched.bounds, slot_of, bw)
        self.bar.update()
        return sums[[s for s, _, _ in now]]

    def count_steps(self, sched, spans, /) -> int:
        return self.run.epochs * bool(spans and self.run.cfg["lr"] > 0)

    def steps(self, sched, spans, /):
        r = self.run
        rows = [(s, max(sched.doc_starts[c], b - r.seq_len), max(a, b - r.seq_len), b) for s, c, (a, b) in spans]
        for _ in range(self.count_steps(sched, spans)):
            lora_train_batch(self.model, self.lora, r.tokens, rows, r.autocast_dtype)
            self.lora.adam_step([s for s, *_ in rows], r.cfg["lr"])
            yield [(a, b) for _, _, a, b in rows]

    def close(self, /) -> None:
        self.lora.remove()


def run_batch_windows(run: TTTRun, /) -> int:
    """Windows per scoring forward of the run (eval.lora_ttt.lora_batch_windows)."""
    return lora_batch_windows(run.cfg["chunk_tokens"], run.stride, run.world_size, run.eval_batch_seqs,
                              run.cfg["batch_docs"])


def lora_schedule_of(run: TTTRun, /) -> Schedule:
    cfg = run.cfg
    bounds, doc_starts, rounds, doc_index, forwards = lora_rounds(run.tokens, cfg["chunk_tokens"], cfg["batch_docs"],
                                                                  run.seq_len, run.world_size, run.bos_id)
    none = [None] * len(doc_index)
    return Schedule(bounds, rounds, forwards(run.stride, run_batch_windows(run)),
                    ledger=dict(document=doc_index, slot=none, round=none), doc_starts=doc_starts,
                    result=dict(lora_rank=cfg["lora_rank"], lora_batch_docs=cfg["batch_docs"],
                                num_documents=doc_index[-1] + 1, num_rounds=len(rounds)))


# TTTMode(label, unit, count_from, fields, valid, expected, schedule, scope, updater, plan, timing)
TTT_MODES["lora"] = TTTMode(
    "lora ttt", "round", 1, ("lora_rank", "lora_lr", "lora_chunk_tokens", "lora_batch_docs"),
    lambda r: (0 < r.cfg["chunk_tokens"] <= r.seq_len and r.cfg["lr"] >= 0
               and r.cfg["lora_rank"] >= 1 and r.cfg["batch_docs"] >= 1),
    "0 < chunk tokens <= seq_len, rank and batch docs >= 1, others >= 0",
    lora_schedule_of, unit_scope, LoRAUpdater, plan_lora, "lora")
