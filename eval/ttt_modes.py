"""Score-first TTT by mode: the registry TTT_MODES (eval/ttt.py; each mode's row in the module packed only for its
mode, all imported here), its settings (cfg_key, mode_settings) and run_mode, which checks them and walks the row
(eval/walk.py). A new mode is a module that adds its row to TTT_MODES (its schedule, scope, updater, the `ttt_*`
settings it reads, its planner, what the plan times) and declares PACKED_WHEN for its mode, imported here, and its
name in primitives/settings.py's TTT_MODE_NAMES (the TTT_MODE choices; tests/test_ttt_engine.py asserts the two
equal); the trainer, `python -m eval score` and the plan read everything mode-specific from its row.

Rows: chunked and phased (eval/sgd_modes.py), lora (eval/lora_mode.py), phased_lora (eval/phased_lora.py).
"""

import time

import torch

from eval.lora_mode import LoRAUpdater  # noqa: F401 (each mode's module adds its row to TTT_MODES)
from eval.phased_lora import PhasedLoRAUpdater  # noqa: F401
from eval.sgd_modes import SGDUpdater  # noqa: F401
from eval.ttt import TTT_MODES
from eval.walk import TTTRun, run_score_first
from primitives.env import BUNDLE_KIND
from primitives.settings import TTT_MODE_NAMES, Hyperparameters

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"

if BUNDLE_KIND == "package":  # the rows in TTT_MODE's order, whichever mode's module was imported first
    TTT_MODES.update({name: TTT_MODES.pop(name) for name in TTT_MODE_NAMES})


def cfg_key(name: str, fields: tuple = (), /) -> str:
    """run.cfg's key of a row field: lora_chunk_tokens -> chunk_tokens, lora_lr -> lr (the LoRA mode's own
    settings, TTT_LORA_*), others as they are; a field keeps its name where the short one is also one of the
    row's `fields` (phased_lora has both TTT_LR and TTT_LORA_LR)."""
    short = name[5:] if name in ("lora_chunk_tokens", "lora_lr", "lora_batch_docs") else name
    return name if short in fields and short != name else short


def mode_settings(mode: str, settings, /) -> dict:
    """The keyword settings of run_mode for `mode` from an object with Hyperparameters' ttt_* attributes (the
    trainer's settings or `python -m eval score`'s args)."""
    fields = TTT_MODES[mode].fields
    return {cfg_key(f, fields): getattr(settings, f"ttt_{f}") for f in fields}


def run_mode(mode: str, model, val_tokens, luts, seq_len, stride, epochs=None, eval_batch_seqs=32, max_seconds=600.0,
             log=print, device="cpu", rank=0, world_size=1, compile_model=False, autocast_dtype=None, bos_id=1,
             clock=time.perf_counter, **settings) -> dict:
    """Score-first TTT of TTT_MODES[mode] over val_tokens int [N] (eval/walk.py run_score_first's dict). model: an
    nn.Module with forward_logits(int64 [B, T]) -> logits [B, T, V] (or forward_hidden + head_logits,
    eval.sliding.scoring_forward) and, for SGD rows, forward(x, y) -> mean cross-entropy; kept in eval mode.
    settings: the row's fields (cfg keys, cfg_key) over the Hyperparameters defaults; epochs: TTT_EPOCHS (default
    Hyperparameters'): one default table, the trainer's.
    autocast_dtype: e.g. torch.bfloat16 on CUDA; compile_model: torch.compile the forwards (static shapes).
    Multi-rank: call on every rank. Raises ValueError naming every setting (env names) for bad inputs, and
    naming TTT_MODE for an unknown mode, before anything runs."""
    if mode not in TTT_MODES:
        raise ValueError(f"TTT_MODE={mode!r}: expected one of {', '.join(TTT_MODES)}")
    row, defaults = TTT_MODES[mode], Hyperparameters()
    cfg = {**mode_settings(mode, defaults), **settings}
    epochs = defaults.ttt_epochs if epochs is None else epochs
    device = torch.device(device)
    run = TTTRun(val_tokens, luts, seq_len, stride, epochs, eval_batch_seqs, rank, world_size, autocast_dtype,
                 compile_model, bos_id, cfg)
    bad = not (0 < stride <= seq_len and epochs >= 0 and eval_batch_seqs > 0 and max_seconds > 0 and row.valid(run))
    if BUNDLE_KIND == "package":  # a run's own loader gives a 1-D int stream of >= 2 tokens
        bad = bad or val_tokens.dim() != 1 or len(val_tokens) < 2 or val_tokens.is_floating_point()
    if bad:
        named = ", ".join(f"{('TTT_' + f).upper()}={cfg[cfg_key(f, row.fields)]}" for f in row.fields)
        raise ValueError(f"{row.entry}: val_tokens {val_tokens.dtype} {list(val_tokens.shape)}, EVAL_STRIDE={stride}, "
                         f"TRAIN_SEQ_LEN={seq_len}, {named}, TTT_EPOCHS={epochs} (world size {world_size}), "
                         f"EVAL_BATCH_SEQS={eval_batch_seqs}, EVAL_MAX_SECONDS={max_seconds}; expected int [N >= 2], "
                         f"0 < stride <= seq_len, {row.expected}")
    run.tokens, run.luts = val_tokens.to(device, torch.int64), [t.to(device) for t in luts]
    return run_score_first(model, run, row, max_seconds, log, clock)
