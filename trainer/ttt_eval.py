"""The trainer's score-first TTT (packed only for runs with TTT): its plan before training (the eval forward
and what the mode's row times, then eval/ttt_plan.py's planner), the TTT pass in place of the sliding pass
(eval/ttt_modes.py run_mode) and its result.json entries and log lines."""

import time

import torch

from eval.lora_batch import BatchedLoRA, lora_train_batch
from eval.lora_ttt import lora_batch_windows
from eval.plan import EvalPlan
from eval.sliding import scoring_forward
from eval.ttt import ttt_result_line, zero_updates_warning
from eval.ttt_modes import TTT_MODES, mode_settings, run_mode
from eval.ttt_plan import lora_work_at, plan_ttt_eval
from model.gpt import GPT
from primitives.settings import Hyperparameters
from shards.format import load_validation_tokens
from trainer.context import RunContext, eval_device_args
from trainer.sgd_timing import describe_sgd, sgd_timings
from trainer.timing import scored_context, seconds_per_call, time_eval_forward

# the packed train_gpt.py holds this module only for runs with score-first TTT (kit/bundle_when.py)
PACKED_WHEN = "TTT_ENABLED"


def evaluate_ttt(ctx: RunContext, hp: Hyperparameters, model: GPT, val_tokens: torch.Tensor, luts, /, *, plan: EvalPlan,
                 started: float) -> dict:
    """Legal score-first TTT of TTT_MODE in place of the sliding pass (eval.ttt_modes.run_mode's dict: val_loss,
    val_bpb, eval_seconds, num_scored_tokens, num_bytes, num_chunks, num_updates, updates_stopped_at_chunk, ...)
    with the mode's TTT_* settings and the plan's stride, epochs and (a mode with phases) phases; SGD modes adapt
    `model` in place. Its time guard gets what is left of EVAL_MAX_SECONDS since `started`. Raises EvalTimeError
    when scoring alone cannot fit."""
    left = hp.eval_max_seconds - (time.perf_counter() - started)
    settings = mode_settings(hp.ttt_mode, hp)
    if plan.phases and "phases" in settings:
        settings["phases"] = plan.phases
    return run_mode(hp.ttt_mode, model, val_tokens, luts, hp.train_seq_len, plan.stride, plan.epochs,
                    hp.eval_batch_seqs, max(left, 1e-9), ctx.log, **eval_device_args(ctx), **settings)


def ttt_entries(ctx: RunContext, hp: Hyperparameters, plan: EvalPlan, tt: dict, /) -> dict:
    """result.json's entries of the TTT pass `tt` (evaluate_ttt's dict) run with the plan's epochs; logs its
    final_ttt_exact line, and a warning when it made no update (its epochs are then not reported as TTT epochs)."""
    ctx.log(ttt_result_line(tt))
    if not tt["num_updates"]:
        ctx.log(zero_updates_warning(tt, hp.ttt_mode))
    return dict(val_loss_ttt=tt["val_loss"], val_bpb_ttt=tt["val_bpb"], eval_stride=plan.stride,
                ttt_epochs=plan.epochs * bool(tt["num_updates"]), ttt_epochs_planned=plan.epochs,
                ttt_updates=tt["num_updates"], ttt_chunks=tt["num_chunks"],
                ttt_updates_stopped_at_chunk=tt["updates_stopped_at_chunk"],
                **({"ttt_mode": hp.ttt_mode} if tt["mode_entries"] else {}),
                **{"ttt_" + k.removeprefix("num_"): tt[k] for k in tt["mode_entries"]})


def mode_own_settings(hp: Hyperparameters, plan: EvalPlan, shared: tuple, /) -> dict:
    """{field: value} of TTT_MODE's row fields beyond `shared` (the ones every artifact records; eval/ttt_modes.py;
    phases: the plan's)."""
    own = {f: getattr(hp, f"ttt_{f}") for f in TTT_MODES[hp.ttt_mode].fields if f not in shared}
    if plan.phases and "phases" in own:
        own["phases"] = plan.phases
    return own


def recorded_mode(hp: Hyperparameters, plan: EvalPlan, shared: tuple, /) -> dict:
    """The artifact's run["ttt"] entries of TTT_MODE (trainer.finish.ttt_artifact_settings): mode and its own
    fields (mode_own_settings) for a row that is `recorded` or has own fields; {} for chunked."""
    own = mode_own_settings(hp, plan, shared)
    return dict(mode=hp.ttt_mode, **own) if own or TTT_MODES[hp.ttt_mode].recorded else {}


def plan_final_ttt(ctx: RunContext, model_config: dict, hp: Hyperparameters, num_val_tokens: int, /) -> EvalPlan:
    """The TTT plan of trainer.evaluate.plan_final_eval: the eval forward (time_eval_forward) and what the mode's
    row times (its `timing`, plan_timings) on a fresh model, then eval.ttt_plan.plan_ttt_eval; logs `ttt_plan:`
    with the numbers and the reason."""
    model = GPT(**model_config).to(ctx.device).eval()
    measure, describe = plan_timings(TTT_MODES[hp.ttt_mode].timing)
    timings = dict(forward_seconds=time_eval_forward(ctx, model, hp), **measure(ctx, model, hp, num_val_tokens))
    plan = plan_ttt_eval(hp, timings, num_val_tokens, ctx.world_size)
    projected = "" if plan.projected_seconds is None else f" projected {plan.projected_seconds:.0f}s with the roundtrip"
    ctx.log(f"ttt_plan: {describe(hp, timings, plan, num_val_tokens)}: stride {plan.stride} epochs {plan.epochs}"
            + f" phases {plan.phases}" * bool(plan.phases) + projected + f" (EVAL_MAX_SECONDS={hp.eval_max_seconds:g})"
            + f"; {plan.reason}" * bool(plan.reason))
    return plan


def lora_timings(ctx: RunContext, model: GPT, hp: Hyperparameters, num_val_tokens: int, /) -> dict:
    """A LoRA row's plan timings (`timing` "lora"): time_lora_ttt and the val stream's schedule (lora_work_at)."""
    tokens = load_validation_tokens(hp.data_path, vocab_size=hp.vocab_size)
    return dict(lora=time_lora_ttt(ctx, model, hp), work_at=lora_work_at(hp, num_val_tokens, ctx.world_size, tokens))


def describe_lora(hp: Hyperparameters, timings: dict, plan: EvalPlan, num_val_tokens: int, /) -> str:
    """The `ttt_plan:` line's measured part for LoRA: the two timings and the plan's work (eval/ttt_plan.py work_at:
    chunks, documents, rounds, update_rounds, forwards, windows per forward)."""
    (forward_seconds, step_seconds), work = timings["lora"], plan.work
    return (f"TTT_MODE={hp.ttt_mode} {1000 * forward_seconds:.1f}ms per scoring forward, {1000 * step_seconds:.1f}ms "
            f"per adapter step, {num_val_tokens - 1} val targets: "
            + ", ".join(f"{v} {k}" for k, v in work.items() if k != "counted"))


def plan_timings(timing: str, /) -> tuple:
    """What plan_final_ttt times and logs for a row's `timing` (eval/ttt.py TTTMode.timing): (measure, describe);
    the SGD step's in trainer/sgd_timing.py, packed only for the modes that time it."""
    return (lora_timings, describe_lora) if timing == "lora" else (sgd_timings, describe_sgd)


def time_lora_ttt(ctx: RunContext, model: GPT, hp: Hyperparameters, /) -> tuple:
    """(seconds of one scoring forward, seconds of one batched adapter step) as eval/lora_ttt.py runs them on
    this rank with TTT_LORA_BATCH_DOCS slots: a forward of [eval.lora_ttt.lora_batch_windows, TRAIN_SEQ_LEN]
    under inference mode, its rows spread over the slots, and fwd + bwd + Adam of every slot on [slots,
    TRAIN_SEQ_LEN] (the longest a step's rows get), rank-TTT_LORA_RANK adapters (removed after)."""
    slots = hp.ttt_lora_batch_docs
    windows = lora_batch_windows(hp.ttt_lora_chunk_tokens, hp.eval_stride, ctx.world_size, hp.eval_batch_seqs, slots)
    x = torch.zeros(windows, hp.train_seq_len, dtype=torch.int64, device=ctx.device)
    tokens = torch.zeros(hp.train_seq_len + 1, dtype=torch.int64, device=ctx.device)
    spans = [(s, 0, hp.train_seq_len - hp.ttt_lora_chunk_tokens, hp.train_seq_len) for s in range(slots)]
    saved = [(p, p.requires_grad) for p in model.parameters()]
    lora = BatchedLoRA(model, hp.ttt_lora_rank, slots)
    try:
        model.requires_grad_(False)
        forward = scoring_forward(model, ctx.compile)

        def score():
            lora.set_rows(torch.arange(windows) % slots)
            with torch.inference_mode(), ctx.autocast():
                forward(x, scored_context(hp))

        def step():
            lora_train_batch(model, lora, tokens, spans, ctx.autocast_dtype)
            lora.adam_step(list(range(slots)), 1e-9)

        return seconds_per_call(ctx, score, label="lora scoring forward"), seconds_per_call(ctx, step, label="lora step")
    finally:
        lora.remove()
        for p, flag in saved:
            p.requires_grad_(flag)
