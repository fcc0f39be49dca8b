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
untrained adapter is the identity, exactly. It is a forward hook (the model class is unchanged) and
is removed when the eval ends; the model's parameters are never trained (only A and B are).

Order, per document (a document starts at a target that is a BOS, as eval/ttt.py split_ttt_chunks):
the adapter is reset (A to its seeded draw, B to 0, fresh Adam); the document is cut into chunks of
chunk_tokens targets; each chunk is scored with eval/sliding.py's window set restricted to its
targets (context from earlier tokens of the stream, already scored, may cross the document start: the
sliding eval's rule, so that with epochs=0 the score is eval_sliding's), then, unless it is the
document's last chunk, `epochs` Adam steps train the adapter on that chunk's targets
(lora_train_span) with up to seq_len tokens of the same document as context. The ledger (eval/ttt.py
records, one per chunk) and check_ttt_legality prove every target was scored once, by an adapter none
of whose updates trained on it.
"""

import math
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eval.sliding import EvalTimeError
from eval.ttt import (check_ttt_legality, mark_update, score_and_record, split_ttt_chunks, ttt_records, ttt_totals,
                      ttt_window_ranges)
from primitives.progress import Progress

LORA_TARGETS = r"\.(attn\.c_q|attn\.c_v|mlp\.proj)$"
LORA_SEED = 1234


class LoRAAdapters:
    """Rank-`rank` adapters on the nn.Linear modules of `model` whose names match `targets`, as forward
    hooks. reset(): A to its seeded draw, B to zero. remove(): the hooks go; the model is as before.
    ValueError if no module matches."""

    def __init__(self, model, rank: int, targets: str = LORA_TARGETS, seed: int = LORA_SEED, scale: float = 1.0):
        self.modules = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and re.search(targets, n)]
        if not self.modules:
            raise ValueError(f"LoRA TTT: no linear of the model matches {targets!r}")
        gen = torch.Generator().manual_seed(seed)
        self.a0, self.params, self.hooks, self.scale = [], [], [], scale
        for _, m in self.modules:
            w = m.weight
            a0 = (torch.rand(rank, m.in_features, generator=gen, dtype=torch.float32) * 2 - 1) / math.sqrt(m.in_features)
            a = torch.nn.Parameter(a0.to(w.device, copy=True))  # never a view of the draw
            b = torch.nn.Parameter(torch.zeros(m.out_features, rank, device=w.device))
            self.a0.append(a0.to(w.device))
            self.params += [a, b]
            self.hooks.append(m.register_forward_hook(self._hook(a, b)))

    def _hook(self, a, b):
        def add_lora(module, inputs, output):
            x = inputs[0]
            return output + self.scale * F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype)).to(output.dtype)
        return add_lora

    @torch.no_grad()
    def reset(self) -> None:
        for a0, a, b in zip(self.a0, self.params[0::2], self.params[1::2]):
            a.copy_(a0)
            b.zero_()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


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


def lora_batch_windows(chunk_tokens: int, stride: int, world_size: int = 1, eval_batch_seqs: int = 1 << 30) -> int:
    """Windows per scoring batch on each rank: a chunk's windows (at most ceil(chunk / stride) + 1) shared by
    the ranks, capped at EVAL_BATCH_SEQS: one batch per chunk, not a full batch of mostly padding."""
    return min(eval_batch_seqs, -(-(-(-chunk_tokens // stride) + 1) // world_size))


def lora_train_span(bounds: list, c: int) -> tuple:
    """The targets the updates after scoring chunk c train on: chunk c's, [bounds[c], bounds[c + 1])."""
    return bounds[c], bounds[c + 1]


def run_lora_ttt(model, val_tokens, luts, *, seq_len, stride, chunk_tokens=256, epochs=1, lr=0.01, lora_rank=8,
                 eval_batch_seqs=32, device="cpu", rank=0, world_size=1, autocast_dtype=None, compile_model=False,
                 max_seconds=600.0, bos_id=1, log=print, clock=time.perf_counter) -> dict:
    """Per-document LoRA score-first TTT over val_tokens int [N]; the model's weights are left as they were.

    model: nn.Module with forward_logits(int64 [B, T]) -> logits [B, T, V] and nn.Linear modules matching
    LORA_TARGETS. chunk_tokens (TTT_LORA_CHUNK_TOKENS, <= seq_len): targets per scored chunk; epochs
    (TTT_EPOCHS): Adam steps (lr = TTT_LORA_LR, betas 0.9/0.95) after each chunk but a document's last;
    scoring batches of lora_batch_windows (one chunk's windows, at most eval_batch_seqs);
    lora_rank: TTT_LORA_RANK. Multi-rank: every rank scores a share of each chunk's windows (sums
    all-reduced) and takes the same full step (the adapters stay equal). compile_model: the scoring
    forward only. Time guard as eval.ttt.run_ttt (after each document past the first: updates stop when
    the projection exceeds max_seconds; EvalTimeError when scoring alone would).
    Returns run_ttt's dict (chunks = per-chunk ledger records, with `document`) plus lora_rank, num_documents.
    ValueError naming the setting for bad inputs before anything runs, and if the ledger is illegal.
    """
    if val_tokens.dim() != 1 or len(val_tokens) < 2 or val_tokens.is_floating_point() or not (
            0 < stride <= seq_len and 0 < chunk_tokens <= seq_len and epochs >= 0 and lr >= 0 and lora_rank >= 1
            and eval_batch_seqs > 0 and max_seconds > 0):
        raise ValueError(f"run_lora_ttt: val_tokens {val_tokens.dtype} {list(val_tokens.shape)}, EVAL_STRIDE={stride}, "
                         f"TRAIN_SEQ_LEN={seq_len}, TTT_LORA_CHUNK_TOKENS={chunk_tokens}, TTT_EPOCHS={epochs}, "
                         f"TTT_LORA_LR={lr}, TTT_LORA_RANK={lora_rank}, EVAL_BATCH_SEQS={eval_batch_seqs}, "
                         f"EVAL_MAX_SECONDS={max_seconds}; expected int [N >= 2], 0 < stride <= seq_len, "
                         "0 < chunk tokens <= seq_len, rank >= 1, others >= 0")
    t_start = clock()
    eval_batch_seqs = lora_batch_windows(chunk_tokens, stride, world_size, eval_batch_seqs)
    device = torch.device(device)
    tokens = val_tokens.to(device, torch.int64)
    luts = [t.to(device) for t in luts]
    bounds, doc_starts = split_lora_chunks(tokens, chunk_tokens, bos_id)
    num_chunks = len(bounds) - 1
    saved_flags = [(p, p.requires_grad) for p in model.parameters()]
    lora = LoRAAdapters(model, lora_rank)
    score_fwd = torch.compile(model.forward_logits, dynamic=False) if compile_model else model.forward_logits
    doc_index = [0] * num_chunks
    for c in range(1, num_chunks):
        doc_index[c] = doc_index[c - 1] + (doc_starts[c] != doc_starts[c - 1])
    records = ttt_records(bounds, document=doc_index)
    step, stopped, optimizer = 0, None, None
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    seconds, measured_from = [0.0, 0.0], None  # scoring, updating (documents past the first)
    window_ranges = ttt_window_ranges(bounds, seq_len=seq_len, stride=stride, rank=rank, world_size=world_size,
                                      eval_batch_seqs=eval_batch_seqs)
    bar = Progress(f"lora ttt eval stride {stride}", sum(map(len, window_ranges)), "window batches")
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for c in range(num_chunks):
            lo, hi, doc_lo = bounds[c], bounds[c + 1], doc_starts[c]
            last_of_doc = c == num_chunks - 1 or doc_starts[c + 1] != doc_lo
            if lo == doc_lo:  # a document starts: a fresh adapter
                lora.reset()
                optimizer = torch.optim.Adam(lora.params, lr=lr, betas=(0.9, 0.95))
                if c and records[c - 1]["document"] == 0:
                    measured_from = (clock(), lo)  # the first document paid for compilation: not a rate
            t0 = clock()
            score_and_record(score_fwd, tokens, luts, window_ranges[c], bounds, records, c, totals, step,
                             eval_batch_seqs=eval_batch_seqs, seq_len=seq_len, stride=stride,
                             autocast_dtype=autocast_dtype, bar=bar, what=f"run_lora_ttt: chunk {c}")
            check_ttt_legality(records[max(0, c - 1):c + 1])
            t1 = clock()
            if not last_of_doc and stopped is None and lr > 0:
                a, b = lora_train_span(bounds, c)
                a = max(a, b - seq_len)
                start = max(doc_lo, b - seq_len)
                for _ in range(epochs):
                    lora_step(model, optimizer, lora.params, tokens[start:b], tokens[start + 1:b + 1], b - a,
                              autocast_dtype=autocast_dtype)
                    step += 1
                    mark_update(records, bounds, a, b, step)
            if measured_from is not None:
                seconds[0] += t1 - t0
                seconds[1] += clock() - t1
            if not last_of_doc or measured_from is None or c == num_chunks - 1:
                continue
            done = hi - measured_from[1]
            rates = torch.tensor([seconds[0] / done, seconds[1] / done], dtype=torch.float64, device=device)
            if dist.is_initialized():
                dist.all_reduce(rates, op=dist.ReduceOp.MAX)
            score_rate, update_rate = rates.tolist()
            elapsed, left = clock() - t_start, bounds[-1] - hi
            if elapsed + score_rate * left > max_seconds:
                err = EvalTimeError(f"run_lora_ttt: projected {elapsed + score_rate * left:.1f}s for scoring alone "
                                    f"after document {records[c]['document']} ({elapsed:.1f}s elapsed) > "
                                    f"EVAL_MAX_SECONDS {max_seconds:.1f}s: raise EVAL_STRIDE", 0)
                err.partial = records[:c + 1]
                raise err
            projected = elapsed + (score_rate + update_rate) * left
            if stopped is None and epochs and lr > 0 and projected > max_seconds:
                stopped = c + 1
                if rank == 0:
                    log(f"lora ttt: projected {projected:.1f}s > EVAL_MAX_SECONDS {max_seconds:.1f}s: updates stop "
                        f"after document {records[c]['document']}, the rest is scored only")
    finally:
        lora.remove()
        for p, flag in saved_flags:
            p.requires_grad_(flag)
    bar.close()
    val_loss, val_bpb, num_scored, num_bytes = ttt_totals(records, totals, len(tokens) - 1, "run_lora_ttt")
    return dict(val_loss=val_loss, val_bpb=val_bpb, stride=stride, epochs=epochs,
                lora_rank=lora_rank, eval_seconds=clock() - t_start, num_scored_tokens=num_scored, num_bytes=num_bytes,
                num_chunks=num_chunks, num_documents=records[-1]["document"] + 1, num_updates=step,
                updates_stopped_at_chunk=stopped, chunks=records)


def lora_step(model, optimizer, params, inputs, targets, num_trained: int, *, autocast_dtype) -> None:
    """One Adam step of the adapter on the last num_trained targets of one sequence (inputs/targets
    int64 [T]; the earlier positions are context only)."""
    with torch.enable_grad(), torch.autocast(inputs.device.type, autocast_dtype, enabled=autocast_dtype is not None):
        logits = model.forward_logits(inputs[None])[0, -num_trained:]
        loss = F.cross_entropy(logits.float(), targets[-num_trained:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def project_lora_seconds(*, chunk_forward_seconds, step_seconds, num_val_tokens, num_docs, epochs, chunk_tokens) -> float:
    """Projected seconds of run_lora_ttt: every chunk one scoring batch (chunk_forward_seconds: a forward of
    one chunk's windows, ceil(chunk_tokens / stride) + 1 of them, on this rank) + epochs x (chunks - documents)
    Adam steps (step_seconds: forward + backward of [1, seq_len] and the step; every rank takes each).
    Chunks = ceil(targets / chunk_tokens) + num_docs (a document adds at most one short chunk)."""
    chunks = -(-(num_val_tokens - 1) // chunk_tokens) + num_docs
    return chunks * chunk_forward_seconds + epochs * max(0, chunks - num_docs) * step_seconds


def plan_lora_ttt(*, chunk_forward_seconds, step_seconds, num_val_tokens, num_docs, epochs, chunk_tokens, max_seconds,
                  roundtrip_seconds=0.0, margin=0.9) -> dict:
    """The most epochs <= TTT_EPOCHS whose projection (project_lora_seconds) fits margin x max_seconds
    (EVAL_MAX_SECONDS) with the roundtrip, at the run's stride. Returns dict(epochs (0: TTT skipped, the
    sliding pass scores), projected_seconds, reason (None, or what was cut / why TTT is skipped))."""
    common = dict(chunk_forward_seconds=chunk_forward_seconds, step_seconds=step_seconds, num_val_tokens=num_val_tokens,
                  num_docs=num_docs, chunk_tokens=chunk_tokens)
    for e in range(epochs, 0, -1):
        seconds = roundtrip_seconds + project_lora_seconds(epochs=e, **common)
        if seconds <= margin * max_seconds:
            return dict(epochs=e, projected_seconds=seconds, reason=None if e == epochs else f"TTT_EPOCHS={epochs} -> {e}")
    wanted = roundtrip_seconds + project_lora_seconds(epochs=1, **common)
    return dict(epochs=0, projected_seconds=None, reason=epochs and f"TTT skipped: 1 epoch of LoRA TTT projects "
                f"{wanted:.0f}s > {margin:g} x EVAL_MAX_SECONDS={max_seconds:g}; the sliding pass scores" or None)
