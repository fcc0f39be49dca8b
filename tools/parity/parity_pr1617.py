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
from primitives.rowquant import dequantize_per_row
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


def compare_row_quant(module, shapes: tuple = ((64, 256), (256, 64)), bits: tuple = (6, 8), seed: int = 0,
                      std: float = 0.05) -> list:
    """[{"shape", "bits", "codes", "max_abs"}]: PR #1617's quantize_float_tensor (per-row clip at the |w| quantile
    0.9999984, scale clip / qmax floored at 1 / qmax, rounding with the float32 scale, stored as float16) against
    the kit's quantize_per_row(w, bits, 0.9999984) (no floor, rounding with the float16 scale it stores) on the same
    w (N(0, std^2) with a few 20x outliers): the differing integer codes and max |diff| of the dequantized tensors."""
    from primitives.rowquant import quantize_per_row

    gen, out = torch.Generator().manual_seed(seed), []
    for shape in shapes:
        w = torch.randn(*shape, generator=gen) * std
        w.view(-1)[torch.randint(0, w.numel(), (8,), generator=gen)] *= 20
        for b in bits:
            q_rec, s_rec = module.quantize_float_tensor(w, bits=b)
            q_kit, s_kit = quantize_per_row(w, b, module.INT8_CLIP_Q)
            out.append({"shape": shape, "bits": b, "codes": int((q_rec.to(torch.int8) != q_kit).sum()),
                        "max_abs": (q_rec.float() * s_rec.float()[:, None] - dequantize_per_row(q_kit, s_kit))
                        .abs().max().item()})
    return out


def compare_state_quant(module, state_dict: dict, policy) -> dict:
    """{name: (record kind, kit kind, max |diff|)} of the dequantized tensors: PR #1617's quantize_state_dict_int8 +
    dequantize_state_dict_int8 against the kit's quant.artifact.quantize_state_dict under `policy` (1xh100-sp4096's:
    QUANT_BASELINE_CLIP) on the same float32 state dict. Kinds: "int6" / "int8" (per row, or per tensor for the
    record's vectors), "float16" (the kit's passthrough)."""
    from quant.artifact import quantize_state_dict

    obj, _ = module.quantize_state_dict_int8(state_dict)
    record = module.dequantize_state_dict_int8(obj)
    entries, _ = quantize_state_dict(state_dict, policy)
    out = {}
    for name, (shape, bits, t, s, _clip) in entries.items():
        mine = dequantize_per_row(t, s).reshape(shape) if bits else t.float()
        kind = f"int{obj['qmeta'][name]['bits']}" + (" per tensor" if obj["qmeta"][name]["scheme"] == "per_tensor" else "")
        out[name] = kind, f"int{bits}" if bits else str(t.dtype)[6:], (record[name].float() - mine).abs().max().item()
    return out
