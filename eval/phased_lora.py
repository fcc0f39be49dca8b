"""PR #1855's phased score-first TTT, the `phased_lora` row of the TTT registry (eval/ttt.py; run by eval/walk.py):
per-document LoRA adapters (eval/record_lora.py) score and train each document chunk by chunk, batches of
documents side by side; after the batches that complete a phase of the scored prefix, global SGD on the base
model over the documents scored so far.

Sources (facts only; the code is the kit's): openai/parameter-golf PR #1855 (eval_val_ttt_phased and
train_val_ttt_global_sgd_distributed, with the values its train_seed42.log prints: 3 phases over the first 2,500
documents, rank-80 adapters on K/MLP/O (and Q, V, head), chunks of 48 targets, AdamW lr 1e-4 betas (0, 0.99)
eps 1e-10 weight decay 0.5, 64 documents per batch; global SGD lr 0.001 momentum 0.9 cosine over chunks of
32,768 tokens, 32 sequences per step, clip 1.0, 1 epoch), PR #1610/#1626 (phases of score, then SGD on the
scored prefix), PR #1767 (warm A).

Order (the record's, at one rank): documents run from a BOS to the next (the next BOS is their last target);
sorted by length (stable), cut into batches of TTT_LORA_BATCH_DOCS, and the batches run longest first. A batch:
its adapters are the phase's (B zeroed, A kept from the batch before, fresh AdamW state) or, for a batch of
another size, a fresh draw. Round k scores chunk k (TTT_LORA_CHUNK_TOKENS targets) of every document that has
one, each in a window of the document's own tokens ending at the chunk's end (at most TRAIN_SEQ_LEN long), then
takes TTT_EPOCHS AdamW steps on the sum over those documents of their chunk's mean loss, except a document's
last chunk. After a batch, if the documents scored so far reach the next phase boundary (TTT_PREFIX_DOCS x p /
TTT_PHASES), the first boundary-many of them in batch order (the record's sort: batch index, then slot) are
concatenated (each with its next BOS) and the model takes TTT_GLOBAL_EPOCHS of SGD over that stream: chunks of
TTT_CHUNK_TOKENS, the last never trained, sequences of TRAIN_SEQ_LEN, TTT_BATCH_SEQS per step in one row with
attention inside documents, lr TTT_LR cosine over the chunks, TTT_MOMENTUM, clip TTT_GRAD_CLIP; then the
phase's adapters are drawn anew. Every update trains only on targets already scored; the engine's ledger
records each chunk's document and checks it.
"""

import math
from dataclasses import dataclass, field

import torch

from eval.record_lora import RECORD_LORA_KINDS, RECORD_LORA_SEED, RecordLoRA, record_lora_nll
from eval.ttt import (SGD_EXPECTED, SGD_FIELDS, TTT_MODES, TTTMode, reduce_clip_step, row_sums, select_ttt_params,
                      sgd_valid, ttt_autocast, unit_scope)
from eval.sliding import Scorer
from eval.walk import Schedule

# the packed train_gpt.py holds this module only for runs with the record's phased LoRA TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED and TTT_MODE == 'phased_lora'"


@dataclass
class PhasedLoRASchedule(Schedule):
    """Schedule plus: docs [(first target, end target)] in stream order; batches [(doc indices by slot, first
    round)] in run order; windows[c] = (first input token, scored offset) of chunk c; pauses {round: doc indices
    the global SGD after that round trains on}; global_steps {round: its SGD steps}."""
    docs: list = field(default_factory=list)
    batches: list = field(default_factory=list)
    windows: dict = field(default_factory=dict)
    pauses: dict = field(default_factory=dict)
    global_steps: dict = field(default_factory=dict)


def record_documents(tokens: torch.Tensor, bos_id: int, /) -> list:
    """[(lo, hi)] target ranges of the documents of tokens int64 [N]: a document starts at a BOS token
    (target lo = its position) and ends before the next BOS's position (that BOS is its last target);
    targets before the first BOS form a document of their own."""
    starts = (tokens[:-1] == bos_id).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return list(zip(starts, starts[1:] + [len(tokens) - 1]))


def global_sgd_plan(doc_lens: list, cfg: dict, seq_len: int, world_size: int, rank: int, epochs: int, /) -> list:
    """The global SGD's steps over the concatenation of documents of doc_lens tokens (each with its next BOS):
    [(chunk, lr, first token, end token)] of this rank's batches (the record's train_val_ttt_global_sgd)."""
    total = sum(doc_lens) - 1
    chunk, per_rank = cfg["chunk_tokens"], max(1, cfg["batch_seqs"] // world_size)
    num_chunks = -(-total // chunk)
    steps = []
    for ci in range(num_chunks - 1):  # the last chunk is never trained on
        lo, hi = ci * chunk, min((ci + 1) * chunk, total)
        seqs = (hi - lo) // seq_len
        lr = cfg["lr"] * 0.5 * (1 + math.cos(math.pi * ci / max(num_chunks - 1, 1)))
        first, last = seqs * rank // world_size, seqs * (rank + 1) // world_size
        for _ in range(epochs):
            for s in range(first, last, per_rank):
                steps.append((ci, lr, lo + s * seq_len, lo + min(s + per_rank, last) * seq_len + 1))
    return steps


def phased_lora_schedule(run, /) -> PhasedLoRASchedule:
    cfg, seq_len, c_tok = run.cfg, run.seq_len, run.cfg["lora_chunk_tokens"]
    docs = record_documents(run.tokens, run.bos_id)
    order = sorted(range(len(docs)), key=lambda d: docs[d][1] - docs[d][0])
    batches = [order[i:i + cfg["batch_docs"]] for i in range(0, len(order), cfg["batch_docs"])]
    queue = sorted(range(len(batches)), key=lambda q: -max(docs[d][1] - docs[d][0] for d in batches[q]))
    chunk_of, bounds, windows = {}, [0], {}
    for d, (lo, hi) in enumerate(docs):
        for k, s in enumerate(range(lo, hi, c_tok)):
            end = min(s + c_tok, hi)
            chunk_of[d, k], first = len(bounds) - 1, max(lo, end - seq_len)
            windows[len(bounds) - 1] = (first, s - first)
            bounds.append(end)
    prefix = min(len(docs), cfg["prefix_docs"])
    edges = [prefix * (p + 1) // cfg["phases"] for p in range(cfg["phases"])] if prefix else []
    rounds, work, done, scored, out_batches, pauses, global_steps = [], [], 0, [], [], {}, {}
    for q in queue:
        members = batches[q]
        out_batches.append((members, len(rounds)))
        counts = [-(-(docs[d][1] - docs[d][0]) // c_tok) for d in members]
        for k in range(max(counts)):
            now = [(b, chunk_of[d, k], k == counts[b] - 1) for b, d in enumerate(members) if k < counts[b]]
            rounds.append(now)
            work.append(sum(bounds[c + 1] - windows[c][0] for _, c, _ in now))
        if done < len(edges):
            scored += [(q, b, d) for b, d in enumerate(members)]
            if len(scored) >= edges[done]:
                chosen = [d for *_, d in sorted(scored)[:edges[done]]]
                pauses[len(rounds) - 1] = chosen
                lens = [docs[d][1] - docs[d][0] + 1 for d in chosen]
                global_steps[len(rounds) - 1] = len(global_sgd_plan(lens, cfg, seq_len, run.world_size, run.rank,
                                                                    cfg["global_epochs"]))
                done += 1
    doc_of = [None] * (len(bounds) - 1)
    for (d, _), c in chunk_of.items():
        doc_of[c] = d
    slot_of = [None] * len(doc_of)
    return PhasedLoRASchedule(bounds, rounds, work, ledger=dict(document=doc_of, slot=slot_of, round=slot_of),
                              result=dict(phases=done, lora_rank=cfg["lora_rank"], num_documents=len(docs),
                                          num_rounds=len(rounds)),
                              docs=docs, batches=out_batches, windows=windows, pauses=pauses, global_steps=global_steps)


class PhasedLoRAUpdater(Scorer):
    """The record's adapters per batch (RecordLoRA, AdamW) and its global SGD between phases (SGD on TTT_PARAMS).
    Rank r scores and trains the slots b with b % world_size == r (sums all-reduced by the engine); the global
    SGD splits each chunk's sequences over the ranks, gradients averaged. begin_round and count_steps are called
    once per round, in order (the engine's loop and its plan of steps)."""

    def __init__(self, model, run, sched, /):
        super().__init__(model, run, sched)
        self.starts = {first: members for members, first in sched.batches}
        cfg = run.cfg
        self.kinds = ("q", "v") + tuple(k for k in RECORD_LORA_KINDS[2:] if cfg[f"lora_{k}"])
        self.gen = torch.Generator().manual_seed(RECORD_LORA_SEED)
        self.chosen = select_ttt_params(model, cfg["params"])
        self.lora = self.phase_lora = self._draw(cfg["batch_docs"])
        self.round, self.counted, self.nll = -1, -1, None

    def _draw(self, slots: int, /) -> RecordLoRA:
        cfg = self.run.cfg
        return RecordLoRA(self.model, slots, cfg["lora_rank"], cfg["lora_alpha"], self.kinds, self.gen)

    def progress(self, sched, /) -> tuple:
        return len(sched.rounds), "rounds"

    def begin_round(self, sched, now, /) -> None:
        self.round += 1
        members = self.starts.get(self.round)
        if members is None:
            return
        cfg = self.run.cfg
        self.lora.remove()
        self.lora = self.phase_lora if len(members) == cfg["batch_docs"] else self._draw(len(members))
        self.lora.reset()
        self.lora.attach(self.model)
        self.opt = torch.optim.AdamW(self.lora.params(), lr=cfg["lora_lr"], betas=(cfg["lora_beta1"], cfg["lora_beta2"]),
                                     eps=1e-10, weight_decay=cfg["lora_wd"])

    def _batch(self, sched, rows, /):
        """(x, y, index, first) of rows [(slot, chunk)]: each row's window of its document, right-padded."""
        r, bounds = self.run, sched.bounds
        spans = [(sched.windows[c][0], bounds[c + 1]) for _, c in rows]
        length = max(hi - lo for lo, hi in spans)
        pos = torch.arange(length, device=r.tokens.device)
        lo, hi = torch.tensor(spans, device=r.tokens.device).T[:, :, None]
        index = (lo + pos).clamp(max=len(r.tokens) - 2)
        valid = lo + pos < hi
        x, y = r.tokens[index].where(valid, 0), r.tokens[index + 1].where(valid, 0)
        return x, y, index, valid

    def score(self, sched, now, /) -> torch.Tensor:
        r = self.run
        sums = torch.zeros(len(now), 3, dtype=torch.float64, device=r.tokens.device)
        mine = [(i, s, c, last) for i, (s, c, last) in enumerate(now) if s % r.world_size == r.rank]
        self.nll = None
        if mine:
            rows = [(s, c) for _, s, c, _ in mine]
            x, y, index, valid = self._batch(sched, rows)
            self.lora.set_rows([s for s, _ in rows])
            train = any(not last for *_, last in now) and r.epochs > 0
            nll = self._forward(x, y, train)
            offsets = torch.tensor([sched.windows[c][1] for _, c in rows], device=x.device)[:, None]
            pos = torch.arange(x.size(1), device=x.device)
            scored = valid & (pos >= offsets)
            sums[[i for i, *_ in mine]] = row_sums(nll, scored, r.tokens, index, r.luts)
            trains = torch.tensor([not last for *_, last in mine], device=x.device)
            self.nll, self.batch = nll, (x, y, scored, trains)
        self.bar.update()
        return sums

    def count_steps(self, sched, spans, /) -> int:
        self.counted += 1
        return self.run.epochs * bool(spans) + sched.global_steps.get(self.counted, 0)

    def steps(self, sched, spans, /):
        """After a round: TTT_EPOCHS AdamW steps when some document of it trains (every slot's tensors step, as the
        record's, so its weight decay reaches the warm A of every slot), then the global SGD after a pause."""
        r = self.run
        for step in range(r.epochs if spans else 0):
            self.opt.zero_grad(set_to_none=True)
            if self.nll is not None and self.nll.requires_grad:
                x, y, scored, trains = self.batch
                nll = self.nll if step == 0 else self._forward(x, y, True)
                per_doc = nll.where(scored, 0).sum(1) / scored.sum(1).clamp_min(1)
                per_doc.where(trains, 0).sum().backward()
            for p in self.lora.params():
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            self.opt.step()
            yield [scope for _, _, scope in spans]
        self.nll = None
        if self.round in sched.pauses:
            yield from self.global_sgd(sched, sched.pauses[self.round])
            self.phase_lora = self._draw(r.cfg["batch_docs"])

    def _forward(self, x, y, grad: bool, /):
        """record_lora_nll of rows x, y with the batch's adapters, autocast; with autograd when `grad`."""
        r = self.run
        with torch.enable_grad() if grad else torch.no_grad(), ttt_autocast(r.tokens.device, r.autocast_dtype):
            return record_lora_nll(self.model, self.lora, x, y)

    def global_sgd(self, sched, chosen_docs: list, /):
        """The record's global SGD over the concatenated documents (each with its next BOS): yields per step the
        target ranges of every document its chunk touches (the ledger's record of what it trained on)."""
        r, cfg = self.run, self.run.cfg
        self.lora.remove()
        pieces = [r.tokens[lo:hi + 1] for lo, hi in (sched.docs[d] for d in chosen_docs)]
        stream = torch.cat(pieces)
        ends = torch.tensor([len(p) for p in pieces]).cumsum(0).tolist()
        plan = global_sgd_plan([len(p) for p in pieces], cfg, r.seq_len, r.world_size, r.rank, cfg["global_epochs"])
        optimizer = torch.optim.SGD(self.chosen, lr=cfg["lr"], momentum=cfg["momentum"])
        for p in self.chosen:
            p.requires_grad_(True)
        try:
            for ci, lr, lo, hi in plan:
                with torch.enable_grad(), ttt_autocast(r.tokens.device, r.autocast_dtype):
                    loss = self.model(stream[lo:hi - 1][None], stream[lo + 1:hi][None])
                (loss / r.world_size).backward()  # the ranks' mean gradient after the all-reduce's sum
                reduce_clip_step(optimizer, self.chosen, lr, cfg["grad_clip"])
                first, last = ci * cfg["chunk_tokens"], min((ci + 1) * cfg["chunk_tokens"], len(stream) - 1) + 1
                yield [sched.docs[d] for d, end, size in zip(chosen_docs, ends, map(len, pieces))
                       if end > first and end - size < last]
        finally:
            optimizer.zero_grad(set_to_none=True)
            for p in self.chosen:
                p.requires_grad_(False)

    def close(self, /) -> None:
        self.lora.remove()


# PR #1855's phased TTT: per-document adapters in batches, global SGD between phases (the registry's row):
# TTTMode(label, unit, count_from, fields, valid, expected, schedule, scope, updater)
TTT_MODES["phased_lora"] = TTTMode(
    "phased lora ttt", "round", 1,
    ("phases", "prefix_docs", "global_epochs", "chunk_tokens", *SGD_FIELDS, "lora_rank", "lora_lr", "lora_chunk_tokens",
     "lora_batch_docs", "lora_alpha", "lora_wd", "lora_beta1", "lora_beta2", "lora_k", "lora_mlp", "lora_o"),
    lambda r: (sgd_valid(r, "chunk_tokens") and 0 < r.cfg["lora_chunk_tokens"] <= r.seq_len
               and min(r.cfg["phases"], r.cfg["lora_rank"], r.cfg["batch_docs"]) >= 1
               and min(r.cfg["prefix_docs"], r.cfg["global_epochs"], r.cfg["lora_lr"], r.cfg["lora_wd"]) >= 0
               and r.cfg["lora_alpha"] > 0 and 0 <= r.cfg["lora_beta1"] < 1 and 0 <= r.cfg["lora_beta2"] < 1),
    "seq_len <= chunk tokens, 0 < lora chunk tokens <= seq_len, phases, rank and batch docs >= 1, alpha > 0, "
    "betas in [0, 1)," + SGD_EXPECTED,
    phased_lora_schedule, unit_scope, PhasedLoRAUpdater)
