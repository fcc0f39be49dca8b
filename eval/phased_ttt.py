"""Phased score-first TTT's projection and plan (the mode itself is the `phased` row of eval/sgd_modes.py,
run by eval/walk.py): score the val stream left to right in phases; after each phase, global SGD
on ALL the documents scored so far (the prefix), then the next phase is scored by the updated model.

Sources (facts only; the code is the kit's): openai/parameter-golf PR #1610 (one pause after 2000
scored documents, global SGD on that scored prefix, then the queue resumes with the updated base
model), PR #1626 (multi-phase: 3 phases of score -> SGD on the scored prefix -> score the next; 3
phases -0.0008 bpb over one), PR #1700/#1727 (3-4 phases, SGD lr 0.015 momentum 0.9 in PR #1802),
PR #1736. Their per-document LoRA (PR #1530) is not built here: this is the full-parameter variant
(TTT_PARAMS picks the parameters). The legality argument is eval/ttt.py's: every target is scored
exactly once, by a model none of whose updates trained on it; an update trains only on targets of
phases already scored. The ledger records it per phase (the same records as run_ttt) and
check_ttt_legality refuses a run that broke it.

Here: phase boundaries are the document starts (BOS targets) nearest above p / P of the targets;
phase p's targets are scored with eval/sliding.py's window set restricted to them (context from
earlier tokens allowed); then, unless it is the last phase, `epochs` passes of SGD over the
sequences of seq_len that cover targets [0, end of phase p) (plan_chunk_sequences), lr cosine-decayed
over the phases. With phases=1 or epochs=0 nothing is trained and the score equals eval_sliding's.
"""

from eval.sliding import count_sliding_windows
from eval.ttt import pick_ttt_plan, ttt_step_seqs

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"


def project_phased_seconds(*, forward_seconds, train_seconds, num_val_tokens, seq_len, stride, epochs, phases,
                           eval_batch_seqs, batch_seqs, world_size=1) -> float:
    """Projected seconds of run_phased_ttt: forward batches (the sliding windows plus one boundary window
    per phase, rounded up to full batches per rank per phase) x forward_seconds + update steps (epochs x
    the batches of each scored prefix p / phases of the targets, p = 1 .. phases - 1) x train_seconds
    (one step of [batch / world_size, seq_len]). Phases are taken as equal (whole documents move the
    boundaries a little)."""
    ceil = lambda a, b: -(-a // b)
    n = num_val_tokens - 1
    forward_batches = phases * ceil(ceil(count_sliding_windows(n, seq_len, stride), phases) + 1,
                                    eval_batch_seqs * world_size)
    batch_seqs = ttt_step_seqs(batch_seqs, n, seq_len, world_size)
    steps = epochs * sum(max(1, round(p * n / phases / seq_len / batch_seqs)) for p in range(1, phases)
                         if p * n // phases >= seq_len)
    return forward_batches * forward_seconds + steps * train_seconds


def plan_phased_ttt(*, forward_seconds, train_seconds, num_val_tokens, seq_len, strides, epochs, phases,
                    eval_batch_seqs, batch_seqs, max_seconds, roundtrip_seconds=0.0, world_size=1, margin=0.9) -> dict:
    """Pick (stride, epochs, phases) that fit margin x max_seconds (EVAL_MAX_SECONDS) with the roundtrip,
    as eval.ttt.plan_ttt: the wanted TTT_EPOCHS first, then fewer; at each, TTT_PHASES, then fewer (down
    to 2: one update round); at each, the strides in order. Returns dict(stride, epochs (0: TTT skipped),
    phases, projected_seconds, reason (None, or what was cut / why TTT is skipped))."""
    budget = margin * max_seconds - roundtrip_seconds
    common = dict(forward_seconds=forward_seconds, train_seconds=train_seconds, num_val_tokens=num_val_tokens,
                  seq_len=seq_len, eval_batch_seqs=eval_batch_seqs, batch_seqs=batch_seqs, world_size=world_size)
    candidates = [(e, ph) for e in range(epochs if phases > 1 else 0, 0, -1) for ph in range(phases, 1, -1)]
    score_only = lambda s: project_phased_seconds(stride=s, epochs=0, phases=1, **common)
    s, cand, seconds = pick_ttt_plan(lambda s, c: project_phased_seconds(stride=s, epochs=c[0], phases=c[1], **common),
                                     candidates, strides, budget, score_only)
    if cand:
        e, ph = cand
        cut = [f"TTT_EPOCHS={epochs} -> {e}"] * (e != epochs) + [f"TTT_PHASES={phases} -> {ph}"] * (ph != phases)
        return dict(stride=s, epochs=e, phases=ph, projected_seconds=roundtrip_seconds + seconds,
                    reason=f"does not fit: {', '.join(cut)}" if cut else None)
    wanted = roundtrip_seconds + project_phased_seconds(stride=strides[-1], epochs=1, phases=2, **common)
    reason = ("TTT skipped: TTT_PHASES=1 scores the whole stream before any update (the score is the sliding one)"
              if phases <= 1 else f"TTT skipped: 1 epoch of 2 phases at stride {strides[-1]} projects {wanted:.0f}s > "
              f"{margin:g} x EVAL_MAX_SECONDS={max_seconds:g}")
    return dict(stride=s, epochs=0, phases=phases, projected_seconds=roundtrip_seconds + seconds,
                reason=reason if epochs else None)
