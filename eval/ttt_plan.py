"""The TTT planner: the eval plan (eval.plan.EvalPlan) of TTT_MODE from measured timings: the strides a plan
may choose (EVAL_STRIDE, with EVAL_AUTO_STRIDE every coarser one), the roundtrip's seconds, then the mode's own
rule from its row (eval/ttt.py TTT_MODES) (its `plan`: chunked eval.ttt.plan_ttt, phased
eval.phased_ttt.plan_phased_ttt, lora eval.lora_ttt.plan_lora; one rule, eval.ttt.pick_ttt_plan: more epochs (then
more phases) beat a smaller stride; 90% of EVAL_MAX_SECONDS with the roundtrip). Used by the trainer's plan
(trainer/ttt_eval.py) and tools/bench/gpu_check.py.
"""

import functools

from eval.lora_ttt import estimate_lora_work, lora_batch_windows, lora_work_counter
from eval.plan import EvalPlan
from eval.sliding import count_sliding_windows
from eval.ttt_modes import TTT_MODES
from primitives.env import BUNDLE_KIND
from primitives.settings import Hyperparameters

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"


def plan_ttt_eval(hp: Hyperparameters, timings: dict, num_val_tokens: int, world_size: int = 1, /) -> EvalPlan:
    """The TTT plan of TTT_MODE from measured timings: forward_seconds (one eval forward of [EVAL_BATCH_SEQS,
    TRAIN_SEQ_LEN]; the roundtrip's windows of TRAIN_SEQ_LEN at the same speed are counted in) plus what the
    mode's row times (`step_seconds` for SGD rows; `lora` = (scoring forward, batched step) and `work_at` for
    LoRA)."""
    b, seq_len, n = hp.eval_batch_seqs, hp.train_seq_len, num_val_tokens - 1
    roundtrip = timings["forward_seconds"] * count_sliding_windows(n, seq_len, seq_len) / (b * world_size)
    if TTT_MODES[hp.ttt_mode].plan is None:
        return EvalPlan(stride=hp.eval_stride, epochs=hp.ttt_epochs, mode=hp.ttt_mode, roundtrip_seconds=roundtrip,
                        reason=f"TTT_MODE={hp.ttt_mode} has no plan: TTT_EPOCHS at EVAL_STRIDE")
    # the strides the plan may choose, preferred first: EVAL_STRIDE, then with EVAL_AUTO_STRIDE every coarser one
    strides = list(range(hp.eval_stride, hp.train_seq_len + 1)) if hp.eval_auto_stride else [hp.eval_stride]
    plan = TTT_MODES[hp.ttt_mode].plan(hp, timings, strides, roundtrip, num_val_tokens, world_size)
    return EvalPlan(**dict(plan, mode=hp.ttt_mode, roundtrip_seconds=roundtrip,
                           wanted_seconds=roundtrip + plan["wanted_seconds"]))


def lora_work_at(hp: Hyperparameters, num_val_tokens: int, world_size: int, tokens=None, assumed_docs: int = 0, /):
    """stride -> the work of TTT_MODE=lora at that stride (memoized): eval.lora_ttt.count_lora_work on the first
    num_val_tokens of tokens (int64, the val stream the eval scores; its schedule built once), else
    estimate_lora_work for assumed_docs documents; the dict adds windows (scoring windows per forward,
    eval.lora_ttt.lora_batch_windows) and counted (which of the two)."""
    common = dict(chunk_tokens=hp.ttt_lora_chunk_tokens, batch_docs=hp.ttt_lora_batch_docs, world_size=world_size)
    counter = lora_work_counter(tokens[:num_val_tokens], seq_len=hp.train_seq_len, **common) if tokens is not None else None

    @functools.cache
    def work_at(stride: int, /) -> dict:
        windows = lora_batch_windows(hp.ttt_lora_chunk_tokens, stride, world_size, hp.eval_batch_seqs, hp.ttt_lora_batch_docs)
        if BUNDLE_KIND == "package":
            if counter is None:  # gpu_check's estimate (the trainer counts the val stream)
                return dict(estimate_lora_work(num_val_tokens=num_val_tokens, num_docs=assumed_docs, stride=stride,
                                               batch_windows=windows, **common), windows=windows, counted=False)
        return dict(counter(stride, windows), windows=windows, counted=True)

    return work_at
