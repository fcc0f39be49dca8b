"""The document-by-document LoRA TTT the kit ran before the adapters were batched, kept as the tests'
oracle for eval/lora_ttt.py: one adapter (F.linear hooks), torch.optim.Adam made fresh per document, chunks
scored in val order with eval/ttt.py's scoring (score_unit_windows). No time guard, one rank."""

import math

import torch
import torch.nn.functional as F

from eval.lora_batch import LORA_SEED, LORA_TARGETS
from eval.lora_ttt import split_lora_chunks
from eval.sliding import score_unit_windows
from eval.walk import TTTRun, mark_update, ttt_records, ttt_totals


class LoRAAdapter:
    """One rank-`rank` adapter per target linear, A from the same seeded draw as eval/lora_batch.py's."""

    def __init__(self, model, rank: int):
        import re
        gen = torch.Generator().manual_seed(LORA_SEED)
        self.a0, self.params, self.hooks = [], [], []
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and re.search(LORA_TARGETS, name):
                a0 = (torch.rand(rank, m.in_features, generator=gen, dtype=torch.float32) * 2 - 1) / math.sqrt(m.in_features)
                a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(torch.zeros(m.out_features, rank))
                self.a0.append(a0)
                self.params += [a, b]
                self.hooks.append(m.register_forward_hook(
                    lambda mod, inp, out, a=a, b=b: out + F.linear(F.linear(inp[0], a), b)))

    @torch.no_grad()
    def reset(self):
        for a0, a, b in zip(self.a0, self.params[0::2], self.params[1::2]):
            a.copy_(a0)
            b.zero_()

    def remove(self):
        for h in self.hooks:
            h.remove()


def sequential_lora_ttt(model, tokens, luts, *, seq_len, stride, chunk_tokens, epochs, lr, lora_rank,
                        eval_batch_seqs=32) -> dict:
    """val_loss, val_bpb and the per-chunk records (val order) of document-by-document LoRA TTT."""
    bounds, doc_starts = split_lora_chunks(tokens, chunk_tokens)
    records = ttt_records(bounds)
    batch = min(eval_batch_seqs, -(-chunk_tokens // stride) + 1)
    run = TTTRun(tokens, luts, seq_len, stride, epochs, batch, 0, 1, None, False)
    totals, step, lora = torch.zeros(3, dtype=torch.float64), 0, LoRAAdapter(model, lora_rank)
    saved = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for c in range(len(bounds) - 1):
            if bounds[c] == doc_starts[c]:
                lora.reset()
                optimizer = torch.optim.Adam(lora.params, lr=lr, betas=(0.9, 0.95))
            logits = lambda ids, start: model.forward_logits(ids)[:, start:]  # eval.sliding.scoring_forward's contract
            sums = score_unit_windows(logits, run, bounds[c], bounds[c + 1])
            nll, num_scored, num_bytes = sums.tolist()
            assert num_scored == bounds[c + 1] - bounds[c], f"reference chunk {c}: a bug of the window plan"
            totals += sums
            records[c].update(scored_at_step=step, val_loss=nll / num_scored,
                              val_bpb=nll / math.log(2) / max(num_bytes, 1))
            if c == len(bounds) - 2 or doc_starts[c + 1] != doc_starts[c]:
                continue  # the document's last chunk
            b = bounds[c + 1]
            a, start = max(bounds[c], b - seq_len), max(doc_starts[c], b - seq_len)
            for _ in range(epochs):
                with torch.enable_grad():
                    logits = model.forward_logits(tokens[None, start:b])[0, -(b - a):]
                    F.cross_entropy(logits.float(), tokens[a + 1:b + 1]).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                mark_update(records, bounds, a, b, step)
    finally:
        lora.remove()
        for p, flag in saved:
            p.requires_grad_(flag)
    val_loss, val_bpb, _, num_bytes = ttt_totals(records, totals, len(tokens) - 1, "reference")
    return dict(val_loss=val_loss, val_bpb=val_bpb, num_bytes=num_bytes, num_updates=step, chunks=records)
