"""Parameter Golf trainer: a wallclock-budgeted GPT run that ends in a scored, size-checked artifact.

`main()` is the table of contents: settings from the environment -> input checks -> model ->
Muon + AdamW -> timed training loop (warmdown, late QAT, EMA) -> pre-quant eval -> `quant` export
-> re-read the artifact from disk -> roundtrip eval -> sliding-window eval (or legal score-first TTT)
-> `result.json`.
Each step lives in the `trainer/` package (docs/layout.md lists its modules).

Runs unchanged on one H100 (`python train_gpt.py`), on N GPUs
(`torchrun --standalone --nproc_per_node=N train_gpt.py`) and on CPU (`PRESET=smoke`). Every setting
is an environment variable with the official name (see primitives/settings.py).
"""

import dataclasses
import functools
import os
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from eval.bpb import val_byte_luts
from quant.estimate import estimate_artifact_bytes
from quant.fit import fit_policy
from eval.plan import EvalPlan
from quant.policy import QuantPolicy
from model.attention import resolve_attention_backend
from model.fused_loss import resolve_loss_kernel
from model.softcap_loss import fused_loss_active, use_plain_loss
from trainer.checks import check_inputs
from trainer.context import BUNDLE_KIND, RunContext, check_packed_for, describe_device, measure_code_bytes, setup_distributed
from trainer.evaluate import evaluate_roundtrip, plan_final_eval
from trainer.finish import after_training_error, finish_run, score_command, write_result
from shards.loader import DistributedTokenLoader
from trainer.loop import TrainResult, train
from model.gpt import GPT, build_model_config, count_train_flops_per_token
from trainer.runfolder import open_run_log
from primitives.progress import protect_console
from primitives.settings import Hyperparameters
from shards.format import load_validation_tokens

if BUNDLE_KIND == "package":  # the kit's signals, resume and recovery, the run folder's lock (not in a record's file)
    from trainer.interrupt import (NO_ROOM_ERRNOS, TRAINED_FILE, RunInterrupted, SignalGuard, interrupted_after_training,
                                   load_trained, no_room, no_room_after_training, stopped_in_training, training_failed)
    from trainer.runfolder import check_run_folder, release_run_folders


def build_model(ctx: RunContext, hp: Hyperparameters, code_bytes: int) -> tuple:
    """(model, config, quant policy, attention backend, train FLOPs per token): the initialized GPT with its
    late-QAT bit widths from the export policy fitted to BYTE_BUDGET before training; logs the
    parameter count, the attention backend and the projected artifact bytes."""
    config = build_model_config(hp)
    model = GPT(**config).to(ctx.device)
    model.init_weights(hp.tied_embed_init_std)
    attn_backend = resolve_attention_backend(hp.attn_backend, ctx.device, ctx.log, hp.model_dim // hp.num_heads)
    if hp.loss_kernel == "liger":  # model/fused_loss.py: a record's train_gpt.py holds it only for liger
        resolve_loss_kernel(hp.loss_kernel, ctx.device, ctx.log)  # logs loss:liger
    else:
        use_plain_loss(ctx.log)  # logs loss:torch
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    scale = hp.quant_estimate_scale  # bits before QAT, on the estimate scaled as the preset measured
    policy = fit_policy(QuantPolicy.from_env(log=ctx.log), shapes, hp.byte_budget - code_bytes, log=ctx.log,
                        estimate_scale=scale)
    model.configure_qat(policy)
    projected = estimate_artifact_bytes(shapes, policy, scale)
    flops_per_token, flops = 0.0, ""
    if BUNDLE_KIND == "package":  # the kit's MFU diagnostics (the step lines' mfu on CUDA)
        flops_per_token = count_train_flops_per_token(config, hp.train_seq_len, hp.enable_looping_at,  # the run's mean
                                                      by_time=hp.max_wallclock_seconds > 0)
        flops = f"train_flops_per_token:{flops_per_token:.4g} "
    ctx.log(f"model_params:{sum(p.numel() for p in model.parameters())} attention:{attn_backend} {flops}"
            f"code_bytes:{code_bytes}")
    ctx.log(f"projected_total_bytes:{projected + code_bytes} byte_budget:{hp.byte_budget}"
            + (" WARNING: over budget" * (projected + code_bytes > hp.byte_budget)))
    return model, config, policy, attn_backend, flops_per_token


def train_and_score() -> int:
    """train -> evaluate pre-quant -> export -> re-read from disk -> roundtrip -> sliding -> result.json.

    Every input is checked before anything is written. In the package (not in a record's packed file:
    the kit's), a run whose training finished always writes result.json, whatever fails or which
    signal comes after (status, phase, every number measured so far, what to run next); a signal after
    training also saves the trained weights for RESUME=1 (trainer/interrupt.py). Returns the exit code.
    """
    hp = Hyperparameters.from_env()
    check_packed_for(hp)  # a packed file refuses settings it was packed without, before anything runs
    ctx = setup_distributed(hp)
    if BUNDLE_KIND == "package":  # a finished run's folder is refused before anything is written; RESUME=1
        resume = check_run_folder(hp)
    sp, manifest, num_val_tokens, inputs = check_inputs(hp, ctx)
    code_bytes = measure_code_bytes(hp)  # in the package, after the input checks: its first build takes seconds
    if BUNDLE_KIND == "package":  # the kit's preflight (primitives/settings.py): BYTE_BUDGET above the code's bytes
        hp.validate(code_bytes)
    open_run_log(ctx, hp, inputs)  # one writer per folder (a lock); RESUME=1: the same settings and inputs
    torch.manual_seed(hp.seed)

    model, config, policy, attn_backend, flops_per_token = build_model(ctx, hp, code_bytes)
    loader = DistributedTokenLoader(hp.data_path, hp.vocab_size, ctx.rank, ctx.world_size, ctx.device)
    byte_count = inputs.get("val_byte_count", "tokenizer")  # CaseOps data: sidecar, its val bytes (shards/sidecar.py)
    luts = val_byte_luts(sp, hp.vocab_size, hp.data_path, byte_count == "sidecar")
    ctx.log(f"val_byte_count:{byte_count}")
    # the stride and the TTT epochs, timed before the clock (a resumed run keeps the interrupted one's)
    if BUNDLE_KIND == "package":
        saved = load_trained(ctx.run_dir / TRAINED_FILE, model, config) if resume == "trained" else None
        plan = EvalPlan.from_saved(saved, hp.ttt_mode) if saved else plan_final_eval(ctx, config, hp, num_val_tokens)
    else:
        plan = plan_final_eval(ctx, config, hp, num_val_tokens)

    @functools.cache
    def val_tokens():  # loaded only for evaluation: the training loop never sees val tokens
        tokens = load_validation_tokens(hp.data_path, hp.vocab_size)
        return tokens[:hp.val_max_tokens + 1] if hp.val_max_tokens else tokens

    artifact = ctx.run_dir / "final_model.ptz"
    summary = dict(run_id=hp.run_id, preset=hp.preset, seed=hp.seed, world_size=ctx.world_size, status="ok",  # result.json
                   device=describe_device(ctx.device), hyperparameters=dataclasses.asdict(hp),
                   quant_policy=policy.to_dict(), max_wallclock_seconds=hp.max_wallclock_seconds,
                   bytes_code=code_bytes, byte_budget=hp.byte_budget, torch_version=torch.__version__,
                   python_version=platform.python_version(), model_params=sum(p.numel() for p in model.parameters()),
                   attention_backend=attn_backend, artifact_path=str(artifact), phase="train", inputs=inputs,
                   val_byte_count=byte_count, loss_kernel="liger" if fused_loss_active(ctx.device) else "torch")
    # the three steps both flows take (called, never passed on: the packed file's names for their parameters are short)
    record = lambda s: write_result(ctx, s, data_path=hp.data_path, manifest=manifest, train_files=loader.opened)
    run_train = lambda stop=None: train(ctx, hp, model, loader, flops_per_token,
                                        lambda m: evaluate_roundtrip(ctx, hp, m, val_tokens(), luts), stop)
    finish = lambda: finish_run(ctx, hp, model, code_bytes, config, artifact, policy, val_tokens, luts, plan)
    if BUNDLE_KIND == "package":  # the kit's signals, resume and recovery after training (trainer/interrupt.py)
        return train_and_finish_guarded(Run(ctx, hp, summary, loader, model, config, artifact, plan, record, run_train,
                                            finish), saved)
    note_trained(summary, run_train(), loader)
    return end_run(ctx, finish_and_record(summary, finish, record))


# What the entry's two flows (the record's file, the kit's guarded one) share from the first training step on: a
# TrainResult's numbers into the summary, the export and final eval into it and result.json, the group's end.
def note_trained(summary: dict, outcome: TrainResult, loader: DistributedTokenLoader, resumed: bool = False) -> None:
    """The training's numbers into the summary (`resumed`: RESUME=1 after training, from saved weights)."""
    summary.update(steps=outcome.steps, train_seconds=outcome.train_seconds, train_losses=outcome.train_losses,
                   ms_per_step=1000 * outcome.train_seconds / max(1, outcome.steps), resumed_after_training=resumed,
                   train_shards=sorted(p.name for p in loader.opened), phase="trained")


def finish_and_record(summary: dict, finish, record) -> int:
    """Export and the final eval (`finish()`: finish_run's generator of result entries), every number into the
    summary, result.json (`record(summary)` -> its status); the exit code (a non-finite score: status
    nonfinite_<phase>, 1)."""
    for measured in finish():
        summary.update(measured)
    summary["phase"] = "done"
    return int(record(summary) != "ok")


def end_run(ctx: RunContext, rc: int) -> int:
    """`rc`, once a multi-process run's group is destroyed."""
    if ctx.world_size > 1:
        dist.destroy_process_group()
    return rc


if BUNDLE_KIND == "package":  # the kit's flow: a run from its first training step on, guarded
    @dataclasses.dataclass
    class Run:
        """A run from its first training step on, for the guarded flow. `train(stop=)` -> TrainResult;
        `finish()` -> finish_run's generator of result entries; `record(summary)` -> result.json's status."""

        ctx: RunContext
        hp: Hyperparameters
        summary: dict
        loader: DistributedTokenLoader
        model: GPT
        config: dict
        artifact_path: Path
        plan: EvalPlan
        record: object
        train: object
        finish: object

    def main() -> int:
        """train_and_score() in a process that then gives its run folder back (its lock), whatever it did."""
        try:
            return train_and_score()
        finally:
            release_run_folders()
else:
    main = train_and_score


def train_and_finish_guarded(run: "Run", saved: dict | None) -> int:
    """The package's flow from the first training step: a signal, an error or a full disk at any point
    still writes result.json (status, phase, every number so far, what to run next) and, after
    training, keeps the trained weights for RESUME=1 (trainer/interrupt.py); `saved`: the weights of
    an interrupted run (RESUME=1 after training). Returns the exit code."""
    ctx, hp, summary, record = run.ctx, run.hp, run.summary, run.record
    with SignalGuard() as guard:
        try:
            result = TrainResult(**saved["result"]) if saved else run.train(stop=guard.flag)
        except Exception as err:  # result.json says what failed (a non-finite loss, OOM, a bug)
            guard.hold()
            return training_failed(ctx, hp, err, summary, record, train_shards=sorted(p.name for p in run.loader.opened))
        if saved:
            run.loader.opened.update(Path(hp.data_path) / n for n in saved["train_shards"])
            ctx.log(f"resumed after training from {ctx.run_dir / TRAINED_FILE}: export and final eval only")
        note_trained(summary, result, run.loader, bool(saved))
        if result.stop_signal:
            return stopped_in_training(ctx, hp, result.stop_signal, summary, record)
        trained = dict(result=dataclasses.asdict(result), train_shards=summary["train_shards"], **run.plan.saved())
        try:
            guard.arm()  # from here a signal interrupts where the run is: it saves the weights and says how to finish
            rc = finish_and_record(summary, run.finish, record)
        except RunInterrupted as stop:
            return interrupted_after_training(ctx, hp, stop.signum, summary, record, model=run.model, config=run.config,
                                              trained=trained, score=score_command(hp, run.artifact_path, run.plan))
        except Exception as err:  # training finished: keep every number measured so far
            guard.hold()
            if no_room(err):  # a full disk or a file-size limit: the weights where they fit, and how to finish
                return no_room_after_training(ctx, hp, err, summary, record, model=run.model, config=run.config,
                                              trained=trained)
            summary["status"] = after_training_error(ctx, hp, err, run.artifact_path, run.plan)
            summary["error"] = f"{type(err).__name__}: {err}"
            rc = 1
            record(summary)
            if not isinstance(err, (ValueError, torch.OutOfMemoryError)):
                raise
    return end_run(ctx, rc)


def run_entry() -> None:
    """main()'s exit code as the process's; a ValueError (a user mistake) as one line, exit 2."""
    try:
        code = main()
        # stopped by a signal, all written: exit now, not after seconds of the interpreter's teardown (whose default
        # handlers would let a second signal kill it without its exit code); a multi-process run (torchrun's
        # WORLD_SIZE), all written and its group destroyed: a rank of a finished 2-process gloo run was seen to abort
        # in that teardown ("terminate called without an active exception", torch 2.13), failing the torchrun
        if code >= 128 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        sys.exit(code)
    except ValueError as err:  # a user mistake: say what and where, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    if BUNDLE_KIND == "package":  # the kit's console guard and its one line for a full disk or Ctrl-C
        protect_console()  # `| head`, `2>&-` or a full device end the console output, never the run
        try:
            run_entry()
        except OSError as err:
            if err.errno not in NO_ROOM_ERRNOS:
                raise
            print(f"error: no room to write {err.filename or 'a file'} ({err.strerror}); expected free space and no "
                  "file-size limit (ulimit -f) below the run's files", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:  # Ctrl-C before training: nothing to save (from the first step on, SignalGuard)
            print("interrupted before training: nothing written to keep", file=sys.stderr)
            sys.exit(128 + 2)
    else:
        run_entry()
