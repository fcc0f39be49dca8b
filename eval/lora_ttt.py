"""Per-document LoRA score-first TTT: each document gets a fresh low-rank adapter on a few linears,
trained on the document's own already-scored tokens while it is scored; the base weights never move.

Sources (facts only; the code is the kit's): openai/parameter-golf PR #77 (merged record: per-document
rank-8 LoRA on c_q, c_v and the LM head, reset between documents, chunks of 256 tokens, each chunk
scored then one Adam step (lr 0.01, betas 0.9/0.95) on that chunk's loss), PR #1530 (the adapter of the
phased-TTT records), PR #1610/#1626/#1736 (combined with phased global SGD: about -0.012 bpb post-quant
-> post-TTT in total on 8xH100), PR #1966 (chunks of 36-48 tokens). The kit's tied head is not a
module call, so the adapter sits on each block's attn.c_q, attn.c_v and mlp.proj (LORA_TARGETS).

Adapter: for a target linear W [out, in], the output gains scale * (x @ A^T) @ B^T with A [rank, in]
drawn uniform(+-1/sqrt(in)) from a fixed seed and B [rank, out]^T = 0, scale 1 (alpha = rank): an
untrained adapter is the identity, exactly. Adapters sit in TTT_LORA_BATCH_DOCS slots, one document
each, applied by forward hooks with batched matmuls (eval/lora_batch.py; the model class is unchanged,
the hooks are removed when the eval ends; the model's parameters are never trained, only A and B).

Order (a document starts at a target that is a BOS, as eval/ttt.py split_ttt_chunks; each is cut into
chunks of chunk_tokens targets): documents in val order take the free slots; a slot taking a document
is reset (A to its seeded draw, B to 0, its Adam state and step count to 0). Each round, every active
slot's next chunk is scored with eval/sliding.py's window set restricted to its targets (context from
earlier tokens of the stream may cross the document start: the sliding eval's rule, so that with
epochs=0 the score is eval_sliding's), then `epochs` batched Adam steps train each slot whose chunk is
not its document's last on that chunk's targets (lora_train_span) with up to seq_len tokens of the
same document as context. With one slot this is the document-by-document order; with more, every
document's scores are the same (the slots never mix), up to float rounding of batched matmuls. The
ledger (eval/ttt.py records, one per chunk, with its document and slot; the step counter counts
batched steps) and check_ttt_legality prove every target was scored once, by an adapter none of whose
updates trained on it.
"""

import math
import time

import torch
import torch.distributed as dist

from eval.lora_batch import (BatchedLoRA, count_round_forwards, lora_train_batch, plan_lora_rounds, round_windows,
                             score_lora_batch)
from eval.sliding import EvalTimeError, scoring_forward
from eval.ttt import check_ttt_legality, mark_update, pick_ttt_plan, split_ttt_chunks, ttt_records, ttt_totals
from primitives.progress import Progress


def split_lora_chunks(tokens: torch.Tensor, chunk_tokens: int, bos_id: int = 1) -> tuple:
    """(bounds, doc_starts): chunk boundaries over the targets of tokens int64 [N] (target t is token
    t + 1), each document (from a BOS target to the next) cut into chunks of chunk_tokens targets (its
    last one shorter); doc_starts[c] is the first target of chunk c's document."""
    docs = split_ttt_chunks(tokens, 1, bos_id)
    bounds, doc_starts = [0], []
    for lo, hi in zip(docs, docs[1:]):
        for s in range(lo, hi, chunk_tokens):
            bounds.append(min(s + chunk_tokens, hi))
            doc_starts.append(lo)
    return bounds, doc_starts


def lora_batch_windows(chunk_tokens: int, stride: int, world_size: int = 1, eval_batch_seqs: int = 1 << 30,
                       batch_docs: int = 1) -> int:
    """Windows per scoring forward on each rank: a round's windows (batch_docs chunks of at most
    ceil(chunk / stride) + 1 windows each) shared by the ranks, capped at EVAL_BATCH_SEQS."""
    return min(eval_batch_seqs, -(-batch_docs * (-(-chunk_tokens // stride) + 1) // world_size))


def lora_train_span(bounds: list, c: int) -> tuple:
    """The targets the updates after scoring chunk c train on: chunk c's, [bounds[c], bounds[c + 1])."""
    return bounds[c], bounds[c + 1]


def lora_schedule(bounds: list, doc_starts: list, batch_docs: int) -> tuple:
    """(rounds, doc_index, first_chunk): plan_lora_rounds over the documents of split_lora_chunks' output,
    each round a list of (slot, chunk, last) (last: the chunk is its document's last, never trained on);
    doc_index[c] is chunk c's document, first_chunk[d] document d's first chunk."""
    doc_index, first_chunk = [], []
    for c, lo in enumerate(doc_starts):
        if c == 0 or lo != doc_starts[c - 1]:
            first_chunk.append(c)
        doc_index.append(len(first_chunk) - 1)
    counts = [b - a for a, b in zip(first_chunk, first_chunk[1:] + [len(doc_starts)])]
    rounds = [[(s, first_chunk[d] + k, k == counts[d] - 1) for s, d, k in r] for r in plan_lora_rounds(counts, batch_docs)]
    return rounds, doc_index, first_chunk


def count_lora_work(tokens, *, chunk_tokens, batch_docs, seq_len, stride, batch_windows, world_size=1, bos_id=1) -> dict:
    """What run_lora_ttt will run on tokens int64 [N]: dict(chunks, documents, rounds, forwards (the busiest
    rank's scoring forwards, all rounds), update_rounds (rounds where some slot trains: each takes
    TTT_EPOCHS batched steps))."""
    return lora_work_counter(tokens, chunk_tokens=chunk_tokens, batch_docs=batch_docs, seq_len=seq_len,
                             world_size=world_size, bos_id=bos_id)(stride, batch_windows)


def lora_work_counter(tokens, *, chunk_tokens, batch_docs, seq_len, world_size=1, bos_id=1):
    """count_lora_work as a function of (stride, batch_windows): the schedule (documents, chunks, rounds: the
    stride plays no part in it) is built once, each call counts only the forwards (for the plan's strides)."""
    bounds, doc_starts = split_lora_chunks(tokens, chunk_tokens, bos_id)
    rounds, doc_index, _ = lora_schedule(bounds, doc_starts, batch_docs)
    fixed = dict(chunks=len(bounds) - 1, documents=doc_index[-1] + 1, rounds=len(rounds),
                 update_rounds=sum(not all(last for *_, last in r) for r in rounds))
    index = round_index(rounds)

    def count(stride: int, batch_windows: int) -> dict:
        forwards = round_forwards(bounds, rounds, seq_len=seq_len, stride=stride, batch_windows=batch_windows,
                                  world_size=world_size, index=index)
        return dict(fixed, forwards=sum(forwards))

    return count


def round_index(rounds: list) -> tuple:
    """(chunk of each entry, round of each entry) of lora_schedule's rounds, int64 [entries] each."""
    return (torch.tensor([c for r in rounds for _, c, _ in r], dtype=torch.int64),
            torch.tensor([i for i, r in enumerate(rounds) for _ in r], dtype=torch.int64))


def round_forwards(bounds: list, rounds: list, *, seq_len, stride, batch_windows, world_size, index=None) -> list:
    """Scoring forwards of the busiest rank in each of lora_schedule's rounds: its chunks' windows of the exact
    sliding set (first_sliding_window of each chunk's first and last target) in forwards of batch_windows
    (count_round_forwards); index: round_index(rounds), when already built."""
    chunks, round_of = index or round_index(rounds)
    edges = torch.tensor(bounds, dtype=torch.int64)
    # eval.sliding.first_sliding_window of every chunk edge at once
    first = lambda t: torch.div(t - seq_len + stride, stride, rounding_mode="floor").clamp_min(0)
    per_chunk = first(edges[1:] - 1) - first(edges[:-1]) + 1
    windows = torch.zeros(len(rounds), dtype=torch.int64).index_add_(0, round_of, per_chunk[chunks])
    return [count_round_forwards(w, batch_windows, world_size) for w in windows.tolist()]


def estimate_lora_work(*, num_val_tokens, num_docs, chunk_tokens, batch_docs, stride, batch_windows, world_size=1) -> dict:
    """count_lora_work without the tokens: chunks = ceil(targets / chunk) + documents (a document adds at most
    one short chunk), rounds = ceil(chunks / batch_docs) (every slot busy), each round's chunks of
    ceil(chunk / stride) + 1 windows, every round an update round."""
    chunks = -(-(num_val_tokens - 1) // chunk_tokens) + num_docs
    rounds = -(-chunks // batch_docs)
    forwards = rounds * count_round_forwards(batch_docs * (-(-chunk_tokens // stride) + 1), batch_windows, world_size)
    return dict(chunks=chunks, documents=num_docs, rounds=rounds, forwards=forwards, update_rounds=rounds)


def run_lora_ttt(model, val_tokens, luts, *, seq_len, stride, chunk_tokens=256, epochs=1, lr=0.01, lora_rank=8,
                 batch_docs=64, eval_batch_seqs=32, device="cpu", rank=0, world_size=1, autocast_dtype=None,
                 compile_model=False, max_seconds=600.0, bos_id=1, log=print, clock=time.perf_counter) -> dict:
    """Per-document LoRA score-first TTT over val_tokens int [N]; the model's weights are left as they were.

    model: nn.Module with forward_logits(int64 [B, T]) -> logits [B, T, V] (scoring: forward_hidden + head_logits
    where it has them, eval.sliding.scoring_forward) and nn.Linear modules matching LORA_TARGETS.
    chunk_tokens (TTT_LORA_CHUNK_TOKENS, <= seq_len): targets per scored chunk; epochs
    (TTT_EPOCHS): Adam steps (lr = TTT_LORA_LR, betas 0.9/0.95) after each chunk but a document's last;
    lora_rank: TTT_LORA_RANK; batch_docs (TTT_LORA_BATCH_DOCS): adapter slots, documents in flight.
    Scoring forwards of lora_batch_windows windows (at most eval_batch_seqs). Multi-rank: every rank
    scores a share of each round's forwards (sums all-reduced) and takes every slot's full step (the
    adapters stay equal). compile_model: the scoring forward only. Time guard as eval.ttt.run_ttt, after
    each round past the first (from the measured seconds per scoring forward and per batched step and
    the schedule's remaining forwards and steps): updates stop when the projection exceeds max_seconds;
    EvalTimeError when scoring alone would.
    Returns run_ttt's dict (chunks = per-chunk ledger records, with `document`, `slot` and `round`; num_updates
    counts slot updates, one per trained chunk and epoch; updates_stopped_at_chunk is the round after
    which updates stopped) plus lora_rank, batch_docs, num_documents, num_rounds.
    ValueError naming the setting for bad inputs before anything runs, and if the ledger is illegal.
    """
    if val_tokens.dim() != 1 or len(val_tokens) < 2 or val_tokens.is_floating_point() or not (
            0 < stride <= seq_len and 0 < chunk_tokens <= seq_len and epochs >= 0 and lr >= 0 and lora_rank >= 1
            and batch_docs >= 1 and eval_batch_seqs > 0 and max_seconds > 0):
        raise ValueError(f"run_lora_ttt: val_tokens {val_tokens.dtype} {list(val_tokens.shape)}, EVAL_STRIDE={stride}, "
                         f"TRAIN_SEQ_LEN={seq_len}, TTT_LORA_CHUNK_TOKENS={chunk_tokens}, TTT_EPOCHS={epochs}, "
                         f"TTT_LORA_LR={lr}, TTT_LORA_RANK={lora_rank}, TTT_LORA_BATCH_DOCS={batch_docs}, "
                         f"EVAL_BATCH_SEQS={eval_batch_seqs}, EVAL_MAX_SECONDS={max_seconds}; expected int [N >= 2], "
                         "0 < stride <= seq_len, 0 < chunk tokens <= seq_len, rank and batch docs >= 1, others >= 0")
    t_start = clock()
    batch_windows = lora_batch_windows(chunk_tokens, stride, world_size, eval_batch_seqs, batch_docs)
    device = torch.device(device)
    tokens = val_tokens.to(device, torch.int64)
    luts = [t.to(device) for t in luts]
    bounds, doc_starts = split_lora_chunks(tokens, chunk_tokens, bos_id)
    rounds, doc_index, _ = lora_schedule(bounds, doc_starts, batch_docs)
    forwards = round_forwards(bounds, rounds, seq_len=seq_len, stride=stride, batch_windows=batch_windows,
                              world_size=world_size)
    trains = [not all(last for *_, last in r) for r in rounds]
    forwards_after, trains_after = forwards[:], trains[:]  # suffix sums: what is left after round r
    for r in range(len(rounds) - 2, -1, -1):
        forwards_after[r] += forwards_after[r + 1]
        trains_after[r] += trains_after[r + 1]
    saved_flags = [(p, p.requires_grad) for p in model.parameters()]
    lora = BatchedLoRA(model, lora_rank, batch_docs)
    score_fwd = scoring_forward(model, compile_model)
    records = ttt_records(bounds, document=doc_index, slot=[None] * len(doc_index), round=[None] * len(doc_index))
    step, num_updates, stopped = 0, 0, None
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    seconds, done = [0.0, 0.0], [0, 0]  # scoring, updating; forwards, batched steps (rounds past the first)
    bar = Progress(f"lora ttt eval stride {stride}", len(rounds), "rounds")
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for r, now in enumerate(rounds):
            t0 = clock()
            slot_of = {c: s for s, c, _ in now}
            for s, c, _ in now:
                if bounds[c] == doc_starts[c]:  # the slot takes a new document: a fresh adapter
                    lora.reset_slot(s)
            sums = torch.zeros(batch_docs, 3, dtype=torch.float64, device=device)
            windows = round_windows(bounds, [c for _, c, _ in now], seq_len=seq_len, stride=stride)
            with torch.inference_mode():
                for first in range(rank * batch_windows, len(windows), world_size * batch_windows):
                    sums += score_lora_batch(score_fwd, lora, tokens, luts, windows[first:first + batch_windows],
                                             bounds, slot_of, batch_windows, seq_len=seq_len, stride=stride,
                                             autocast_dtype=autocast_dtype)
            if dist.is_initialized():
                dist.all_reduce(sums)
            for s, c, _ in now:
                nll, num_scored, num_bytes = sums[s].tolist()
                if num_scored != bounds[c + 1] - bounds[c]:
                    raise RuntimeError(f"run_lora_ttt: chunk {c} scored {num_scored:.0f} of its {bounds[c + 1] - bounds[c]} "
                                       "targets: a bug of the window plan")
                totals += sums[s]
                records[c].update(scored_at_step=step, slot=s, round=r, val_loss=nll / num_scored,
                                  val_bpb=nll / math.log(2) / max(num_bytes, 1))
                check_ttt_legality(records[c - (bounds[c] > doc_starts[c]):c + 1])
            t1 = clock()
            spans = []
            for s, c, last in now:
                if not last:
                    a, b = lora_train_span(bounds, c)
                    spans.append((s, max(doc_starts[c], b - seq_len), max(a, b - seq_len), b))
            for _ in range(epochs if spans and stopped is None and lr > 0 else 0):
                lora_train_batch(model, lora, tokens, spans, autocast_dtype=autocast_dtype)
                lora.adam_step([s for s, *_ in spans], lr)
                step, num_updates = step + 1, num_updates + len(spans)
                for _, _, a, b in spans:
                    mark_update(records, bounds, a, b, step)
                done[1] += r > 0
            bar.update()
            if r == 0 or r == len(rounds) - 1:
                continue  # round 0 pays for compilation: not a rate
            seconds[0] += t1 - t0
            seconds[1] += clock() - t1
            done[0] += forwards[r]
            rates = torch.tensor([seconds[0] / done[0], seconds[1] / max(done[1], 1)], dtype=torch.float64, device=device)
            if dist.is_initialized():
                dist.all_reduce(rates, op=dist.ReduceOp.MAX)
            score_rate, step_rate = rates.tolist()
            elapsed = clock() - t_start
            scoring = elapsed + score_rate * forwards_after[r + 1]
            if scoring > max_seconds:
                err = EvalTimeError(f"run_lora_ttt: projected {scoring:.1f}s for scoring alone after round {r + 1}/"
                                    f"{len(rounds)} ({elapsed:.1f}s elapsed) > EVAL_MAX_SECONDS {max_seconds:.1f}s: "
                                    "raise EVAL_STRIDE", 0)
                err.partial = [rec for rec in records if rec["scored_at_step"] is not None]
                raise err
            projected = scoring + step_rate * epochs * trains_after[r + 1]
            if stopped is None and epochs and lr > 0 and done[1] and projected > max_seconds:
                stopped = r + 1
                if rank == 0:
                    log(f"lora ttt: projected {projected:.1f}s > EVAL_MAX_SECONDS {max_seconds:.1f}s: updates stop "
                        f"after round {r + 1}/{len(rounds)}, the rest is scored only")
    finally:
        lora.remove()
        for p, flag in saved_flags:
            p.requires_grad_(flag)
    bar.close()
    val_loss, val_bpb, num_scored, num_bytes = ttt_totals(records, totals, len(tokens) - 1, "run_lora_ttt")
    return dict(val_loss=val_loss, val_bpb=val_bpb, stride=stride, epochs=epochs, lora_rank=lora_rank,
                batch_docs=batch_docs, eval_seconds=clock() - t_start, num_scored_tokens=num_scored,
                num_bytes=num_bytes, num_chunks=len(bounds) - 1, num_documents=doc_index[-1] + 1,
                num_rounds=len(rounds), num_updates=num_updates, updates_stopped_at_chunk=stopped, chunks=records)


def project_lora_seconds(*, forward_seconds, step_seconds, work, epochs) -> float:
    """Projected seconds of run_lora_ttt from `work` (count_lora_work / estimate_lora_work): its scoring
    forwards x forward_seconds (one forward of [lora_batch_windows, seq_len] with the adapters, on the busiest
    rank) + epochs x its update rounds x step_seconds (one batched step: forward + backward of
    [TTT_LORA_BATCH_DOCS, seq_len] and the slots' Adam; every rank takes each)."""
    return work["forwards"] * forward_seconds + epochs * work["update_rounds"] * step_seconds


def plan_lora_ttt(*, forward_seconds, step_seconds, work_at, strides, epochs, max_seconds, sliding_seconds,
                  roundtrip_seconds=0.0, margin=0.9) -> dict:
    """Pick (stride, epochs) of run_lora_ttt that fit margin x max_seconds (EVAL_MAX_SECONDS) with the roundtrip,
    by eval.ttt.plan_ttt's rule: strides are the candidates, preferred first (EVAL_STRIDE, then with
    EVAL_AUTO_STRIDE every coarser one up to TRAIN_SEQ_LEN); more epochs beat a smaller stride (TTT_EPOCHS,
    TTT_EPOCHS - 1, ..., 1, each tried at every stride). work_at(stride): the work at that stride
    (count_lora_work / estimate_lora_work), projected by project_lora_seconds. forward_seconds: one scoring
    forward at strides[0] (a coarser stride's forwards have at most as many windows: an upper bound there).
    sliding_seconds(stride): the plain sliding pass; when no epoch fits, TTT is skipped and the stride is the
    first whose sliding pass fits (the last if none does; the eval's own guard then decides).
    Returns dict(stride, epochs (0: TTT skipped, the sliding pass scores), projected_seconds (with the
    roundtrip; of the sliding pass when skipped), reason (None, or what was cut / why TTT is skipped), work
    (work_at of the stride))."""
    budget = margin * max_seconds - roundtrip_seconds
    project = lambda s, e: project_lora_seconds(forward_seconds=forward_seconds, step_seconds=step_seconds,
                                                work=work_at(s), epochs=e)
    fixed = work_at(strides[0])  # rounds and update rounds do not depend on the stride; every round has a forward
    # an epoch count that no stride can fit (one forward per round already over) is not counted stride by stride
    hopeless = lambda e: fixed["rounds"] * forward_seconds + e * fixed["update_rounds"] * step_seconds > budget
    s, e, seconds = pick_ttt_plan(lambda s, e: math.inf if hopeless(e) else project(s, e), range(epochs, 0, -1), strides,
                                  budget, sliding_seconds)
    if e:
        return dict(stride=s, epochs=e, projected_seconds=roundtrip_seconds + seconds, work=work_at(s),
                    reason=None if e == epochs else f"TTT_EPOCHS={epochs} -> {e}")
    at = f" at stride {strides[-1]}" * (len(strides) > 1)
    reason = epochs and (f"TTT skipped: 1 epoch of LoRA TTT{at} projects {roundtrip_seconds + project(strides[-1], 1):.0f}s"
                         f" > {margin:g} x EVAL_MAX_SECONDS={max_seconds:g}; the sliding pass scores") or None
    return dict(stride=s, epochs=0, projected_seconds=roundtrip_seconds + seconds, work=work_at(s), reason=reason)
