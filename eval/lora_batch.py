"""Batched per-document LoRA: `slots` independent adapters applied in one batched forward, the schedule
that deals the val documents to them, and what one round costs (the plan's and the time guard's count).

Sources (facts only; the code is the kit's): openai/parameter-golf PR #77 (per-batch-element LoRA
weights, 64 documents at a time), PR #1530 (the same batching in the phased-TTT records).

Adapter slot s on a target linear W [out, in]: A [slots, rank, in], B [slots, out, rank]; row r of a
batch belongs to slot rows[r] and its output gains (x_r @ A[s]^T) @ B[s]^T, a batched matmul.
Rows never mix: slot s's loss reaches only A[s] and B[s]. Adam is written out on the batched tensors
with a step counter per slot (torch.optim.Adam's formulas: exp_avg.lerp_, exp_avg_sq, bias corrections
1 - beta^t of the slot's own t), so a slot's update is the one a lone adapter with its own torch Adam
would take. reset_slot(s): A[s] to the seeded draw (the same draw for every slot), B[s] to 0, its Adam
state and step counter to 0: an untrained slot is the identity, exactly.

Schedule (plan_lora_rounds): documents in val order take the free slots (lowest slot first) at the
start of a round; every active slot then scores the next chunk of its document; a slot whose document
had its last chunk scored is free at the next round.
"""

import math
import re

import torch
import torch.nn.functional as F

from eval.sliding import first_sliding_window, plan_sliding_windows
from eval.ttt import row_sums, ttt_autocast

# the packed train_gpt.py holds this module only for runs with LoRA TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED and TTT_MODE == 'lora'"

LORA_TARGETS = r"\.(attn\.c_q|attn\.c_v|mlp\.proj)$"
LORA_SEED = 1234
ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-8


class BatchedLoRA:
    """Rank-`rank` adapters in `slots` slots on the nn.Linear modules of `model` whose names match `targets`,
    as forward hooks; set `rows` (int64 [R], a slot per batch row) before each forward. reset_slot(s),
    adam_step(slots, lr), remove() (the hooks go; the model is as before). ValueError if no module matches."""

    def __init__(self, model, rank: int, slots: int, targets: str = LORA_TARGETS, /):
        self.modules = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and re.search(targets, n)]
        if not self.modules:
            raise ValueError(f"LoRA TTT: no linear of the model matches {targets!r}")
        gen = torch.Generator().manual_seed(LORA_SEED)
        self.a0, self.params, self.hooks, self.slots = [], [], [], slots
        device = self.modules[0][1].weight.device
        for _, m in self.modules:
            a0 = ((torch.rand(rank, m.in_features, generator=gen, dtype=torch.float32) * 2 - 1)
                  / math.sqrt(m.in_features)).to(device)
            a = a0.expand(slots, -1, -1).clone().requires_grad_(True)
            b = torch.zeros(slots, m.out_features, rank, device=device, requires_grad=True)
            self.a0.append(a0)
            self.params += [a, b]
            self.hooks.append(m.register_forward_hook(self._hook(a, b)))
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = [0] * slots
        self.rows = torch.zeros(0, dtype=torch.int64, device=device)

    def _hook(self, a, b, /):
        def add_lora(module, inputs, output, /):
            x = inputs[0]
            ar, br = a[self.rows].to(x.dtype), b[self.rows].to(x.dtype)
            return output + torch.matmul(torch.matmul(x, ar.transpose(1, 2)), br.transpose(1, 2)).to(output.dtype)
        return add_lora

    def set_rows(self, rows, /) -> None:
        """The slot of each row of the next forward's batch (a list or int64 tensor [R])."""
        self.rows = torch.as_tensor(rows, dtype=torch.int64).to(self.rows.device)

    @torch.no_grad()
    def reset_slot(self, s: int, /) -> None:
        for k, (p, m, v) in enumerate(zip(self.params, self.exp_avg, self.exp_avg_sq)):
            p[s] = self.a0[k // 2] if k % 2 == 0 else 0
            m[s], v[s] = 0, 0
        self.steps[s] = 0

    @torch.no_grad()
    def adam_step(self, slots: list, lr: float, /) -> None:
        """One Adam step (betas ADAM_BETAS, eps ADAM_EPS, no weight decay) of the given slots on the gradients
        of the last backward; the other slots and their state stay as they were. Gradients are cleared."""
        (b1, b2), idx = ADAM_BETAS, torch.tensor(slots, dtype=torch.int64, device=self.rows.device)
        for s in slots:
            self.steps[s] += 1
        steps = [self.steps[s] for s in slots]
        step_size = torch.tensor([lr / (1 - b1 ** t) for t in steps], device=idx.device).view(-1, 1, 1)
        bias2_sqrt = torch.tensor([math.sqrt(1 - b2 ** t) for t in steps], device=idx.device).view(-1, 1, 1)
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq):
            g = p.grad[idx] if p.grad is not None else torch.zeros_like(p[idx])
            mi, vi = m[idx].lerp_(g, 1 - b1), v[idx].mul_(b2).addcmul_(g, g, value=1 - b2)
            m[idx], v[idx] = mi, vi
            p[idx] = p[idx] - step_size * (mi / (vi.sqrt() / bias2_sqrt).add_(ADAM_EPS))
            p.grad = None

    def remove(self, /) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def plan_lora_rounds(doc_chunks: list, /, slots: int) -> list:
    """The schedule of documents with doc_chunks[d] chunks each over `slots` slots: a list of rounds, each a
    list of (slot, document, k) (the document's k-th chunk is scored in that round by that slot)."""
    rounds, active, next_doc = [], [None] * slots, 0
    while True:
        for s in range(slots):
            if active[s] is None and next_doc < len(doc_chunks):
                active[s], next_doc = (next_doc, 0), next_doc + 1
        now = [(s, *active[s]) for s in range(slots) if active[s] is not None]
        if not now:
            return rounds
        rounds.append(now)
        for s, d, k in now:
            active[s] = (d, k + 1) if k + 1 < doc_chunks[d] else None


def round_windows(bounds: list, chunks: list, /, *, seq_len: int, stride: int) -> list:
    """(window, chunk) for every window of the exact sliding set (eval/sliding.py) that scores a target of
    each of `chunks` (chunk c = targets [bounds[c], bounds[c + 1])), in order."""
    return [(w, c) for c in chunks for w in range(first_sliding_window(bounds[c], seq_len, stride),
                                                  first_sliding_window(bounds[c + 1] - 1, seq_len, stride) + 1)]


def count_round_forwards(num_windows: int, batch_windows: int, world_size: int, /) -> int:
    """Forward batches of the busiest rank for a round of num_windows windows: batches of batch_windows are
    dealt round-robin to the ranks."""
    batches = -(-num_windows // batch_windows)
    return -(-batches // world_size)


def score_lora_batch(score_fwd, lora: BatchedLoRA, run, rows: list, bounds: list, slot_of: dict,
                     batch_windows: int, /) -> torch.Tensor:
    """float64 [lora.slots, 3] sums (nll nats, targets, bytes) of one forward over run.tokens (eval/walk.py TTTRun:
    its luts, seq_len, stride, autocast): `rows` = (window, chunk) pairs (at most batch_windows; padded to it with
    masked rows), each row scoring only its chunk's targets, by the adapter of slot_of[chunk]; score_fwd:
    eval.sliding.scoring_forward's. Call under inference mode."""
    tokens, num_rows = run.tokens, len(rows)
    num_targets, device = len(tokens) - 1, tokens.device
    rows = rows + rows[:1] * (batch_windows - num_rows)  # padding: copies of the first row, scoring nothing
    windows = torch.tensor([w for w, _ in rows], device=device)
    lo, hi = torch.tensor([(bounds[c], bounds[c + 1]) for _, c in rows], device=device).T[:, :, None]
    slots = [slot_of[c] for _, c in rows]
    index, score = plan_sliding_windows(num_targets, run.seq_len, run.stride, windows)
    index = index.clamp(max=num_targets - 1)
    context = 0 if bool((windows == 0).any()) else run.seq_len - run.stride  # only window 0 scores its first positions
    lora.set_rows(slots)
    with ttt_autocast(device, run.autocast_dtype):
        logits = score_fwd(tokens[index], context)
    index, score = index[:, context:], score[:, context:]
    score = score & (index >= lo) & (index < hi) & (torch.arange(batch_windows, device=device) < num_rows)[:, None]
    y = tokens[index + 1]
    nll = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view_as(y)
    sums = torch.zeros(lora.slots, 3, dtype=torch.float64, device=device)
    return sums.index_add_(0, torch.tensor(slots, device=device), row_sums(nll, score, tokens, index, run.luts))


def lora_train_batch(model, lora: BatchedLoRA, tokens, spans: list, autocast_dtype, /) -> None:
    """Forward + backward of one batched adapter step: spans = (slot, start, a, b), slot s trains on targets
    [a, b) with inputs tokens[start:b] (context from `start`), each row left-aligned (the positions of a
    lone sequence) and padded at its end (causal: the padding changes no real position). The loss is the
    sum over the slots of each slot's mean cross-entropy, so no gradient mixes slots."""
    device, length = tokens.device, max(b - start for _, start, _, b in spans)
    pos = torch.arange(length, device=device)
    starts, firsts, ends = torch.tensor([span[1:] for span in spans], device=device).T[:, :, None]
    index = (starts + pos).clamp(max=len(tokens) - 2)
    trained = (starts + pos >= firsts) & (starts + pos < ends)
    lora.set_rows([s for s, *_ in spans])
    with torch.enable_grad(), ttt_autocast(device, autocast_dtype):
        logits = model.forward_logits(tokens[index])
        nll = F.cross_entropy(logits.float().flatten(0, 1), tokens[index + 1].flatten(), reduction="none").view_as(index)
        loss = (nll.where(trained, 0).sum(1) / (ends - firsts)[:, 0]).sum()
    loss.backward()
