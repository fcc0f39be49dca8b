"""After training: pre-quant eval -> export -> re-read the artifact from disk -> roundtrip + sliding
eval, each measured number handed back as soon as it exists; result.json with the compliance flags."""

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from eval.bpb import nonfinite_scores
from eval.sliding import EvalTimeError
from eval.plan import EvalPlan
from quant.artifact import export_artifact, load_artifact
from quant.policy import QuantPolicy
from trainer.checks import check_compliance
from trainer.context import BUNDLE_KIND, RunContext
from trainer.evaluate import evaluate_roundtrip, evaluate_sliding
from trainer.ttt_eval import evaluate_ttt, mode_own_settings, recorded_mode, ttt_entries
from primitives.files import atomic_write_json, sha256_file
from model.gpt import GPT
from primitives.settings import Hyperparameters


def finish_run(ctx: RunContext, hp: Hyperparameters, model: GPT, code_bytes: int, config: dict, artifact_path: Path,
               policy: QuantPolicy, val_tokens, luts, plan: EvalPlan):  # one caller (train_gpt.py), positional
    """pre-quant eval -> export -> re-read from disk -> roundtrip + sliding eval at the plan's stride (with
    plan.epochs > 0: score-first TTT of TTT_MODE in its place, eval/ttt_modes.py, with the plan's epochs and phases).

    A generator: yields a dict of result.json entries as soon as each group is measured, so that the
    caller keeps every number measured before a later step fails or a signal stops it: `phase`
    (prequant_eval, export, load, roundtrip, sliding or ttt) when a step starts, its numbers and
    `phase_seconds` (wall seconds of each step so far) when it ends, then (the package's) rescore_entries.
    `val_tokens` is a callable that returns the val stream (int64 [N]; loaded only now). Raises what the failing
    step raised.
    """
    eval_on = not hp.skip_final_eval
    eval_stride, ttt_epochs = plan.stride, plan.epochs
    yield dict(eval_plan=dataclasses.asdict(plan))
    seconds, started = {}, [time.perf_counter()]

    def lap(name: str, **entries) -> dict:  # the step `name` ended: its numbers and the wall time of each step
        now = time.perf_counter()
        seconds[name], started[0] = now - started[0], now
        return dict(entries, phase_seconds=dict(seconds))

    if eval_on:
        yield dict(phase="prequant_eval")
        pre = evaluate_roundtrip(ctx, hp, model, val_tokens(), luts)
        # each number is handed back before its log line: what a log shows, an interrupted result.json has
        yield lap("prequant_eval", val_loss_prequant=pre["val_loss"], val_bpb_prequant=pre["val_bpb"], phase="export")
        ctx.log(f"final_prequant_exact val_loss:{pre['val_loss']:.8f} val_bpb:{pre['val_bpb']:.8f}")
    yield dict(phase="export")
    if ctx.is_main:
        state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        if BUNDLE_KIND == "package":  # (a record's file refuses SAVE_PREQUANT before the clock, trainer/checks.py)
            if hp.save_prequant:  # for tools/bench_quant.py
                from kit.checkpoint import save_prequant

                save_prequant(ctx.run_dir / "prequant.safetensors", state, config)
        # the artifact carries what scoring it needs besides the data and the tokenizer (python -m eval score)
        run = dict(train_seq_len=hp.train_seq_len, vocab_size=hp.vocab_size, eval_stride=eval_stride,
                   tokenizer_sha256=sha256_file(hp.tokenizer_path),
                   ttt=ttt_artifact_settings(hp, plan))
        if len(luts) == 1:  # scored on a CaseOps byte sidecar (eval/bpb.py val_byte_luts); absent: the byte LUT
            run["val_byte_count"] = "sidecar"
        report = export_artifact(state, config, artifact_path, code_bytes=code_bytes, byte_budget=hp.byte_budget,
                                 policy=policy, hessians=model.gptq_hessians, log=ctx.log, run=run)
        yield {k: report[k] for k in ("bytes_model", "bytes_total", "compressor", "packing", "shuffle", "fit_steps",
                                      "quant_estimate_scale_measured")}
        ctx.log(f"Total submission size: {report['bytes_total']} bytes")
    if ctx.world_size > 1:
        dist.barrier()
    yield lap("export", export_seconds=time.perf_counter() - started[0])
    if not eval_on:
        return
    yield dict(phase="load")
    eval_start = started[0] = time.perf_counter()
    state, loaded_config, _ = load_artifact(artifact_path)
    eval_model = GPT(**loaded_config).to(ctx.device)
    eval_model.load_state_dict(state)
    eval_model.eval()
    yield lap("load", phase="roundtrip")
    rt = evaluate_roundtrip(ctx, hp, eval_model, val_tokens(), luts)
    yield lap("roundtrip", val_loss_roundtrip=rt["val_loss"], val_bpb_roundtrip=rt["val_bpb"],
              phase="ttt" if ttt_epochs else "sliding")
    ctx.log(f"final_roundtrip_exact val_loss:{rt['val_loss']:.8f} val_bpb:{rt['val_bpb']:.8f}")
    if ttt_epochs:
        scores = evaluate_ttt(ctx, hp, eval_model, val_tokens(), luts, plan=plan, started=eval_start)
        entries = ttt_entries(ctx, hp, plan, scores)
    else:
        scores = evaluate_sliding(ctx, hp, eval_model, val_tokens(), luts, eval_stride, eval_start)
        entries = dict(val_loss_sliding=scores["val_loss"], val_bpb_sliding=scores["val_bpb"], eval_stride=scores["stride"],
                       **(dict(ttt_epochs=0, ttt_updates=0) if hp.ttt_enabled else {}))  # TTT on, but the plan skipped it
    yield lap("ttt" if ttt_epochs else "sliding", **entries, eval_seconds=time.perf_counter() - eval_start,
              val_tokens=val_tokens().numel(), tokens_per_byte=scores["num_scored_tokens"] / scores["num_bytes"])
    if BUNDLE_KIND == "package":  # the kit's re-scoring command, which may not reproduce a TTT score (a record's file has no kit)
        yield rescore_entries(hp, artifact_path, plan if ttt_epochs else EvalPlan(stride=scores["stride"]), scores)
        if ttt_score_command_caveat(scores):
            ctx.log(f"WARNING: {ttt_score_command_caveat(scores)}")
    if not ttt_epochs:
        ctx.log(f"final_sliding_window_exact val_loss:{scores['val_loss']:.8f} val_bpb:{scores['val_bpb']:.8f} "
                f"stride:{scores['stride']} eval_time:{1000 * scores['eval_seconds']:.0f}ms")


def after_training_error(ctx: RunContext, hp: Hyperparameters, err: Exception, artifact_path: Path,
                         plan: EvalPlan = None) -> str:
    """The status for result.json of a run whose training finished but a later step failed; logs the
    one-line cause (for OOM: the knob that lowers memory) and what to run next (at the stride that would fit
    the sliding pass, else the plan's stride, else EVAL_STRIDE)."""
    if isinstance(err, torch.OutOfMemoryError):
        ctx.log(f"ERROR: CUDA out of memory after training: lower EVAL_BATCH_SEQS={hp.eval_batch_seqs} "
                f"(sliding) or VAL_BATCH_SIZE={hp.val_batch_size} (roundtrip)")
    else:
        ctx.log(f"ERROR: {type(err).__name__}: {err}")
    if artifact_path.is_file():
        plan = plan or EvalPlan(stride=hp.eval_stride)
        stride = getattr(err, 'fit_stride', 0) or plan.stride
        ctx.log(f"next: {score_command(hp, artifact_path, dataclasses.replace(plan, stride=stride))}")
    return {EvalTimeError: "eval_over_time", torch.OutOfMemoryError: "oom"}.get(type(err), "failed_after_training")


# the TTT settings every artifact records (the chunked mode's: older readers take an artifact without `mode` as it)
ARTIFACT_TTT_FIELDS = ("chunk_tokens", "lr", "momentum", "grad_clip", "batch_seqs", "params")


def ttt_artifact_settings(hp: Hyperparameters, plan: EvalPlan) -> dict:
    """The artifact header's run["ttt"]: the TTT settings the run scores with (`python -m eval score --ttt 1`
    uses them): enabled (TTT_ENABLED 0/1), epochs (the plan's: 0 when it skipped TTT or TTT is off),
    ARTIFACT_TTT_FIELDS (TTT_CHUNK_TOKENS, ...), eval_batch_seqs (the scoring batch); the stride is the run's
    eval_stride (the plan's); with TTT on, a mode whose row is `recorded` (every one but chunked) adds mode, and its row's
    own fields (eval/ttt_modes.py; phases: the plan's); chunked artifacts stay byte-identical to those written before modes."""
    return dict(enabled=int(hp.ttt_enabled), epochs=plan.epochs, **{f: getattr(hp, f"ttt_{f}") for f in ARTIFACT_TTT_FIELDS},
                eval_batch_seqs=hp.eval_batch_seqs, **(recorded_mode(hp, plan, ARTIFACT_TTT_FIELDS) if hp.ttt_enabled else {}))


def ttt_score_command_caveat(tt: dict):
    """Why score_command may not reproduce a TTT score (None: it does): the time guard stopped the
    updates at a chunk that depended on this machine's speed at that moment."""
    stopped = tt.get("updates_stopped_at_chunk")
    if stopped is None:
        return None
    unit, of = ("round", tt["num_rounds"]) if "num_rounds" in tt else ("chunk", tt["num_chunks"])  # lora: rounds
    return (f"the eval time guard stopped TTT updates at {unit} {stopped} of {of}: the score is legal, "
            f"but score_command reproduces it only if its own run stops at the same {unit} (unverified)")


def rescore_entries(hp: Hyperparameters, artifact_path: Path, plan: EvalPlan, tt: dict = None) -> dict:
    """result.json's `score_command` (the kit's `python -m eval score`, which scores the written artifact again) and,
    for a TTT score it may not reproduce, `score_command_unverified` (finish_run yields them in the package only: a
    record's packed file has no kit)."""
    why = ttt_score_command_caveat(tt) if tt else None
    return dict(score_command=score_command(hp, artifact_path, plan), **({"score_command_unverified": why} if why else {}))


def score_command(hp: Hyperparameters, artifact_path: Path, plan: EvalPlan) -> str:
    """The command that scores a written artifact as the run did (eval/__main__.py): the plan's stride and the
    run's scoring batch, and its TTT settings (the mode's fields, the plan's epochs and phases) when the plan
    kept TTT (plan.epochs > 0)."""
    import shlex  # (the kit's: a record's file has no score command)

    own = mode_own_settings(hp, plan, ARTIFACT_TTT_FIELDS)
    flags = {f: getattr(hp, f"ttt_{f}") for f in ARTIFACT_TTT_FIELDS}
    ttt = (f" --ttt 1 --ttt-epochs {plan.epochs}" + "".join(f" --ttt-{f.replace('_', '-')} {shlex.quote(str(v))}"
                                                           for f, v in flags.items())
           + f" --ttt-mode {hp.ttt_mode}" + "".join(f" --ttt-{f.replace('_', '-')} {v}" for f, v in own.items()))
    return (f"python -m eval score --artifact {shlex.quote(str(artifact_path))} --data-path "
            f"{shlex.quote(hp.data_path)} --tokenizer {shlex.quote(hp.tokenizer_path)} --seq-len {hp.train_seq_len} "
            f"--stride {plan.stride} --batch-seqs {hp.eval_batch_seqs}"
            + f" --val-max-tokens {hp.val_max_tokens}" + (ttt if plan.epochs else " --ttt 0"))


def write_result(ctx: RunContext, summary: dict, *, data_path: str, manifest, train_files) -> str:
    """result.json (rank 0): `summary` plus the compliance flags (check_compliance), the unmet ones logged.
    A non-finite number never goes out with status ok: the status becomes `nonfinite_<phase>` (the pass
    that produced it: prequant_eval, roundtrip, sliding, ttt), with the keys in `nonfinite`. Returns the status."""
    bad = nonfinite_scores(summary)
    if bad and summary.get("status") == "ok":
        phase = next(iter(bad.values()))
        summary.update(status=f"nonfinite_{phase}", nonfinite=sorted(bad))
        ctx.log(f"ERROR: {', '.join(f'{k}:{summary[k]}' for k in sorted(bad))} (the {phase} pass): status "
                f"nonfinite_{phase}, no score is reported")
    if not ctx.is_main:
        return summary.get("status")
    try:
        flags = check_compliance(summary, data_path, manifest, train_files)
        if BUNDLE_KIND == "package":  # (result.json holds them; make_record writes them into the record's README)
            shown = {k: "unverified" if v is None and "unverified" in flags else v for k, v in flags.items()}
            ctx.log(f"compliance: {' '.join(f'{k}:{v}' for k, v in shown.items() if k != 'unverified')}")
            if "unverified" in flags:
                ctx.log(f"compliance unverified: {flags['unverified']}")
    except OSError as err:  # the data changed under the run: no flags, and make_record refuses it
        flags = {"error": str(err)}
    atomic_write_json(ctx.run_dir / "result.json", {**summary, "compliance": flags})
    if BUNDLE_KIND == "package":
        ctx.log(f"result:{ctx.run_dir / 'result.json'}")
    return summary.get("status")
