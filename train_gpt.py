"""Parameter Golf trainer: a wallclock-budgeted GPT run that ends in a scored, size-checked artifact.

`main()` is the table of contents: settings from the environment -> input checks -> model ->
Muon + AdamW -> timed training loop (warmdown, late QAT, EMA) -> pre-quant eval -> `quant` export
-> re-read the artifact from disk -> roundtrip eval -> sliding-window eval -> `result.json`.
Each step lives in the `trainer/` package (README "Layout" lists its modules).

Runs unchanged on one H100 (`python train_gpt.py`), on N GPUs
(`torchrun --standalone --nproc_per_node=N train_gpt.py`) and on CPU (`PRESET=smoke`). Every setting
is an environment variable with the official name (see trainer/settings.py).
"""

import dataclasses
import functools
import platform
import sys

import torch
import torch.distributed as dist

from eval.bpb import build_sentencepiece_luts
from quant.estimate import estimate_artifact_bytes
from quant.fit import fit_policy
from quant.policy import QuantPolicy
from trainer.attention import resolve_attention_backend
from trainer.checks import check_inputs
from trainer.context import RunContext, describe_device, log_run_header, measure_code_bytes, setup_distributed
from trainer.evaluate import evaluate_roundtrip, plan_eval_stride
from trainer.files import atomic_write_json
from trainer.finish import after_training_error, finish_run, write_result
from trainer.loader import DistributedTokenLoader
from trainer.loop import NonFiniteLossError, train
from trainer.model import GPT, build_model_config, count_train_flops_per_token
from trainer.settings import Hyperparameters
from trainer.shards import load_validation_tokens


def build_model(ctx: RunContext, hp: Hyperparameters, code_bytes: int) -> tuple:
    """(model, config, quant policy, attention backend, train FLOPs per token): the initialized GPT with its
    late-QAT bit widths from the export policy fitted to BYTE_BUDGET before training; logs the
    parameter count, the attention backend and the projected artifact bytes."""
    config = build_model_config(hp)
    model = GPT(**config).to(ctx.device)
    model.init_weights(hp.tied_embed_init_std)
    attn_backend = resolve_attention_backend(hp.attn_backend, ctx.device, ctx.log)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    scale = hp.quant_estimate_scale  # bits before QAT, on the estimate scaled as the preset measured
    policy = fit_policy(QuantPolicy.from_env(log=ctx.log), shapes, hp.byte_budget - code_bytes, log=ctx.log,
                        estimate_scale=scale)
    model.configure_qat(policy)
    projected = estimate_artifact_bytes(shapes, policy, scale)
    flops_per_token = count_train_flops_per_token(config, hp.train_seq_len)
    ctx.log(f"model_params:{sum(p.numel() for p in model.parameters())} attention:{attn_backend} "
            f"train_flops_per_token:{flops_per_token:.4g} code_bytes:{code_bytes}")
    ctx.log(f"projected_total_bytes:{projected + code_bytes} byte_budget:{hp.byte_budget}"
            + (" WARNING: over budget" * (projected + code_bytes > hp.byte_budget)))
    return model, config, policy, attn_backend, flops_per_token


def run_summary(ctx: RunContext, hp: Hyperparameters, *, model: GPT, policy: QuantPolicy, code_bytes: int,
                attn_backend: str) -> dict:
    """The result.json entries known before training starts."""
    return dict(run_id=hp.run_id, preset=hp.preset, seed=hp.seed, world_size=ctx.world_size, status="ok",
                device=describe_device(ctx.device), hyperparameters=dataclasses.asdict(hp),
                quant_policy=policy.to_dict(), max_wallclock_seconds=hp.max_wallclock_seconds,
                bytes_code=code_bytes, byte_budget=hp.byte_budget, torch_version=torch.__version__,
                python_version=platform.python_version(), model_params=sum(p.numel() for p in model.parameters()),
                attention_backend=attn_backend, artifact_path=str(ctx.run_dir / "final_model.ptz"))


def main() -> int:
    """train -> evaluate pre-quant -> export -> re-read from disk -> roundtrip -> sliding -> result.json.

    A run whose training finished always writes result.json, whatever fails after (status, every
    number measured so far, the artifact path), and says what to run next. Returns the exit code.
    """
    hp = Hyperparameters.from_env()
    ctx = setup_distributed(hp)
    if ctx.is_main:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        ctx.log_file = open(ctx.run_dir / "train.log", "a" if hp.resume else "w", encoding="utf-8")
    code_bytes = measure_code_bytes()
    log_run_header(ctx, hp)
    sp, manifest, num_val_tokens = check_inputs(hp, ctx)
    torch.manual_seed(hp.seed)

    model, config, policy, attn_backend, flops_per_token = build_model(ctx, hp, code_bytes)
    loader = DistributedTokenLoader(hp.data_path, hp.vocab_size, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
    luts = build_sentencepiece_luts(sp, hp.vocab_size)
    eval_on = not hp.skip_final_eval
    eval_stride = plan_eval_stride(ctx, config, hp, num_val_tokens) if eval_on and hp.eval_auto_stride else hp.eval_stride

    @functools.cache
    def val_tokens():  # loaded only for evaluation: the training loop never sees val tokens
        tokens = load_validation_tokens(hp.data_path, vocab_size=hp.vocab_size)
        return tokens[:hp.val_max_tokens + 1] if hp.val_max_tokens else tokens

    summary = run_summary(ctx, hp, model=model, policy=policy, code_bytes=code_bytes, attn_backend=attn_backend)
    result = None
    try:
        result = train(ctx, hp, model, loader, flops_per_token=flops_per_token,
                       val_eval=lambda m: evaluate_roundtrip(ctx, hp, m, val_tokens(), luts))
    except NonFiniteLossError as e:
        ctx.log(f"ERROR: {e}; no artifact written")
        summary["status"] = "nonfinite_loss"
    except torch.OutOfMemoryError:
        accum = hp.resolve_grad_accum(ctx.world_size, ctx.device.type == "cuda")
        ctx.log(f"ERROR: CUDA out of memory in training: raise GRAD_ACCUM_STEPS (now {accum}: micro-batches of "
                f"{hp.train_batch_tokens // (ctx.world_size * accum * hp.train_seq_len)} sequences) or lower TRAIN_BATCH_TOKENS")
        summary["status"] = "oom"
    if result is not None:
        summary.update(steps=result.steps, train_seconds=result.train_seconds, train_losses=result.train_losses,
                       ms_per_step=1000 * result.train_seconds / max(1, result.steps))
    summary["train_shards"] = sorted(p.name for p in loader.opened)
    if result is None or result.stop_signal:
        if ctx.is_main:
            status = "stopped_by_signal" if result is not None else summary["status"]
            atomic_write_json(ctx.run_dir / "result.json", {**summary, "status": status})
        return 128 + result.stop_signal if result is not None else 1

    rc = 0
    try:
        for measured in finish_run(ctx, hp, model=model, config=config, policy=policy, code_bytes=code_bytes,
                                   artifact_path=ctx.run_dir / "final_model.ptz", val_tokens=val_tokens, luts=luts,
                                   eval_stride=eval_stride):
            summary.update(measured)
    except Exception as err:  # training finished: keep every number measured so far
        summary["status"] = after_training_error(ctx, hp, err, ctx.run_dir / "final_model.ptz")
        summary["error"] = f"{type(err).__name__}: {err}"
        rc = 1
        if not isinstance(err, (ValueError, torch.OutOfMemoryError)):
            write_result(ctx, summary, data_path=hp.data_path, manifest=manifest, train_files=loader.opened)
            raise
    write_result(ctx, summary, data_path=hp.data_path, manifest=manifest, train_files=loader.opened)
    if ctx.world_size > 1:
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:  # a user mistake: say what and where, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
