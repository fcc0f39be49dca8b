"""PR #1617's sliding-window eval (its `eval_val_sliding`) against the kit's (eval/sliding.py eval_sliding).

Both scorers run on both models (PR #1617's GPT and the kit's with the same weights, parity_models.pr1617_model):
the record's function only needs the model's `forward_logits`, so it scores the kit's model too. The model
comparison is then the record's rule on both models; the rule comparison is both rules on the kit's model.

The rules differ at the stream's end: the record takes a window at every stride start below the last target,
and a window shorter than the sequence scores its last `stride` targets, which the previous windows scored
already; the kit scores every target exactly once (`tail_rescored_targets` counts the record's extra scores).
"""

import types

import torch

from eval.sliding import eval_sliding
from tools.parity.standins import cpu_standins


def tail_rescored_targets(num_targets: int, seq_len: int, stride: int) -> int:
    """Targets the record's sliding rule scores more than once: over its windows (starts 0, stride, ... below
    num_targets; a window scores all its targets when it starts at 0, else its last min(stride, length))."""
    scored = sum((min(start + seq_len, num_targets) - start) if start == 0 else
                 min(stride, min(start + seq_len, num_targets) - start) for start in range(0, num_targets, stride))
    return scored - num_targets


def compare_sliding(module, kit, record, tokens: torch.Tensor, luts: tuple, seq_len: int, stride: int,
                    batch_seqs: int) -> dict:
    """{"record_on_record", "record_on_kit", "kit_on_kit": (val_loss nats/token, val_bpb)} of the record's and the
    kit's sliding rules on tokens int64 [N] with luts (base bytes int16 [V], leading space bool [V], boundary bool
    [V]), plus "rescored": tail_rescored_targets. Both models in eval mode, float32, on the CPU."""
    args = types.SimpleNamespace(train_seq_len=seq_len)
    cpu = torch.device("cpu")
    kit.eval(), record.eval()
    with cpu_standins():
        out = {name: module.eval_val_sliding(args, model, 0, 1, cpu, tokens, *luts, stride, batch_seqs)
               for name, model in (("record_on_record", record), ("record_on_kit", kit))}
        mine = eval_sliding(kit, tokens, luts, seq_len=seq_len, stride=stride, batch_seqs=batch_seqs, device=cpu,
                            log=lambda *_: None)
    out["kit_on_kit"] = (mine["val_loss"], mine["val_bpb"])
    out["rescored"] = tail_rescored_targets(len(tokens) - 1, seq_len, stride)
    return out
