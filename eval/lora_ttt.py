"""Per-document LoRA score-first TTT (the `lora` row is eval/lora_mode.py; here its schedule, work count and
plan): each document gets a fresh low-rank adapter on a few linears, trained on the document's own
already-scored tokens while it is scored; the base weights never move.

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

import torch

from eval.lora_batch import count_round_forwards, plan_lora_rounds
from eval.sliding import count_sliding_windows
from eval.ttt import pick_ttt_plan, split_ttt_chunks

# the packed train_gpt.py holds this module only for runs with LoRA TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED and TTT_MODE == 'lora'"


def split_lora_chunks(tokens: torch.Tensor, chunk_tokens: int, bos_id: int = 1, /) -> tuple:
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
                       batch_docs: int = 1, /) -> int:
    """Windows per scoring forward on each rank: a round's windows (batch_docs chunks of at most
    ceil(chunk / stride) + 1 windows each) shared by the ranks, capped at EVAL_BATCH_SEQS."""
    return min(eval_batch_seqs, -(-batch_docs * (-(-chunk_tokens // stride) + 1) // world_size))


def lora_schedule(bounds: list, doc_starts: list, batch_docs: int, /) -> tuple:
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


def count_lora_work(tokens, /, *, chunk_tokens, batch_docs, seq_len, stride, batch_windows, world_size=1, bos_id=1) -> dict:
    """What run_lora_ttt will run on tokens int64 [N]: dict(chunks, documents, rounds, forwards (the busiest
    rank's scoring forwards, all rounds), update_rounds (rounds where some slot trains: each takes
    TTT_EPOCHS batched steps))."""
    return lora_work_counter(tokens, chunk_tokens=chunk_tokens, batch_docs=batch_docs, seq_len=seq_len,
                             world_size=world_size, bos_id=bos_id)(stride, batch_windows)


def lora_work_counter(tokens, *, chunk_tokens, batch_docs, seq_len, world_size=1, bos_id=1):
    """count_lora_work as a function of (stride, batch_windows): the schedule (documents, chunks, rounds: the
    stride plays no part in it) is built once, each call counts only the forwards (for the plan's strides)."""
    bounds, _, rounds, doc_index, forwards = lora_rounds(tokens, chunk_tokens, batch_docs, seq_len, world_size, bos_id)
    fixed = dict(chunks=len(bounds) - 1, documents=doc_index[-1] + 1, rounds=len(rounds),
                 update_rounds=sum(not all(last for *_, last in r) for r in rounds))
    return lambda stride, batch_windows: dict(fixed, forwards=sum(forwards(stride, batch_windows)))


def lora_rounds(tokens, chunk_tokens: int, batch_docs: int, seq_len: int, world_size: int, bos_id: int, /) -> tuple:
    """(bounds, doc_starts, rounds, doc_index, forwards) of tokens int64 [N]: split_lora_chunks, lora_schedule's
    rounds and doc_index, and forwards(stride, batch_windows) -> the scoring forwards of the busiest rank in each
    round: its chunks' windows of the exact sliding set (first_sliding_window of each chunk's first and last
    target) in forwards of batch_windows (count_round_forwards). The schedule is built once; forwards counts it
    at any stride (the plan's)."""
    bounds, doc_starts = split_lora_chunks(tokens, chunk_tokens, bos_id)
    rounds, doc_index, _ = lora_schedule(bounds, doc_starts, batch_docs)
    edges, chunks = torch.tensor(bounds), torch.tensor([c for r in rounds for _, c, _ in r])
    round_of = torch.tensor([i for i, r in enumerate(rounds) for _ in r])

    def forwards(stride: int, batch_windows: int, /) -> list:
        # eval.sliding.first_sliding_window of every chunk edge at once
        first = lambda t: torch.div(t - seq_len + stride, stride, rounding_mode="floor").clamp_min(0)
        per_chunk = first(edges[1:] - 1) - first(edges[:-1]) + 1
        windows = torch.zeros(len(rounds), dtype=torch.int64).index_add_(0, round_of, per_chunk[chunks])
        return [count_round_forwards(w, batch_windows, world_size) for w in windows.tolist()]

    return bounds, doc_starts, rounds, doc_index, forwards


def estimate_lora_work(*, num_val_tokens, num_docs, chunk_tokens, batch_docs, stride, batch_windows, world_size=1) -> dict:
    """count_lora_work without the tokens: chunks = ceil(targets / chunk) + documents (a document adds at most
    one short chunk), rounds = ceil(chunks / batch_docs) (every slot busy), each round's chunks of
    ceil(chunk / stride) + 1 windows, every round an update round."""
    chunks = -(-(num_val_tokens - 1) // chunk_tokens) + num_docs
    rounds = -(-chunks // batch_docs)
    forwards = rounds * count_round_forwards(batch_docs * (-(-chunk_tokens // stride) + 1), batch_windows, world_size)
    return dict(chunks=chunks, documents=num_docs, rounds=rounds, forwards=forwards, update_rounds=rounds)


def project_lora_seconds(forward_seconds, step_seconds, work, epochs) -> float:
    """Projected seconds of run_lora_ttt from `work` (count_lora_work / estimate_lora_work): its scoring
    forwards x forward_seconds (one forward of [lora_batch_windows, seq_len] with the adapters, on the busiest
    rank) + epochs x its update rounds x step_seconds (one batched step: forward + backward of
    [TTT_LORA_BATCH_DOCS, seq_len] and the slots' Adam; every rank takes each)."""
    return work["forwards"] * forward_seconds + epochs * work["update_rounds"] * step_seconds


def plan_lora(hp, t: dict, strides, roundtrip_seconds, num_val_tokens, world_size, /) -> dict:
    """The `lora` row's plan (eval/ttt.py TTTMode.plan): (stride, epochs) of the LoRA pass that fit 0.9 x
    EVAL_MAX_SECONDS with the roundtrip, by eval.ttt.plan_ttt's rule: strides are the candidates, preferred first
    (EVAL_STRIDE, then with EVAL_AUTO_STRIDE every coarser one up to TRAIN_SEQ_LEN); more epochs beat a smaller
    stride (TTT_EPOCHS, TTT_EPOCHS - 1, ..., 1, each tried at every stride). t: forward_seconds (one sliding
    forward of [EVAL_BATCH_SEQS, TRAIN_SEQ_LEN]), lora = (one scoring forward at strides[0], one batched step; a
    coarser stride's forwards have at most as many windows: an upper bound there) and work_at(stride) (the work
    at that stride: count_lora_work / estimate_lora_work), projected by project_lora_seconds. When no epoch fits,
    TTT is skipped and the stride is the first whose plain sliding pass fits (the last if none does; the eval's
    own guard then decides). Returns dict(stride, epochs (0: TTT skipped, the sliding pass scores),
    projected_seconds (with the roundtrip; of the sliding pass when skipped), reason (None, or what was cut / why
    TTT is skipped), work (work_at of the stride), wanted_seconds (TTT_EPOCHS at EVAL_STRIDE))."""
    (forward_seconds, step_seconds), work_at, epochs = t["lora"], t["work_at"], hp.ttt_epochs
    per_window = t["forward_seconds"] / (hp.eval_batch_seqs * world_size)  # the sliding pass, when TTT is skipped
    budget = 0.9 * hp.eval_max_seconds - roundtrip_seconds
    project = lambda s, e: project_lora_seconds(forward_seconds, step_seconds, work_at(s), e)
    fixed = work_at(strides[0])  # rounds and update rounds do not depend on the stride; every round has a forward
    # an epoch count that no stride can fit (one forward per round already over) is not counted stride by stride
    hopeless = lambda e: fixed["rounds"] * forward_seconds + e * fixed["update_rounds"] * step_seconds > budget
    s, e, seconds = pick_ttt_plan(lambda s, e: math.inf if hopeless(e) else project(s, e), range(epochs, 0, -1), strides,
                                  budget, lambda s: per_window * count_sliding_windows(num_val_tokens - 1, hp.train_seq_len, s))
    if e:
        reason = None if e == epochs else f"TTT_EPOCHS={epochs} -> {e}"
    else:
        at = f" at stride {strides[-1]}" * (len(strides) > 1)
        reason = epochs and (f"TTT skipped: 1 epoch of LoRA TTT{at} projects {roundtrip_seconds + project(strides[-1], 1):.0f}s"
                             f" > 0.9 x EVAL_MAX_SECONDS={hp.eval_max_seconds:g}; the sliding pass scores") or None
    return dict(stride=s, epochs=e or 0, projected_seconds=roundtrip_seconds + seconds, work=work_at(s), reason=reason,
                wanted_seconds=project(hp.eval_stride, epochs))
