"""Training steps of the kit at PRESET=1xh100-sp4096 against PR #1617's own optimizers and train-loop order (CPU).

PR #1617 builds its optimizers inside main(); here they are built as its main() builds them, from its own classes
and its log's arguments: the script's `Muon` on the block matrices that are not control tensors (its
CONTROL_TENSOR_NAME_PATTERNS), a fused `torch.optim.AdamW` for the tied embedding and one for the block control
tensors and skip weights, each group with its `base_lr`. Its loop order per step: the LR multiplier (its wallclock
warmdown over the last WARMDOWN_LAST_FRAC, driven here with the elapsed time = the run's fraction), backward, the
momentum warmup min(step / 500, 1) from 0.85 to 0.95, lr = base_lr x multiplier, clipping when GRAD_CLIP_NORM > 0,
every optimizer's step. No EMA. Its late QAT over the last 15 %: its CastedLinear class switch with its main()'s bits
(int6 for blocks 0-2's attention, int8 for the other attention and MLP weights), the kit's QAT from the preset's
quantizer (QUANT_BASELINE_CLIP: the same rounding).

The record's arguments are its script's class defaults with the values its seed42.log prints (`key:value` pairs of
the lines before training); `log_args_mismatches` checks the kit's resolved settings against them.
"""

import re
import types
from pathlib import Path

import torch

from primitives.settings import Hyperparameters
from tools.parity.parity_train import kit_step
from tools.parity.standins import cpu_standins
from trainer.optim import build_optimizers

# the log's printed key -> the record's Hyperparameters attribute where the names differ (tied embeddings: embed_lr
# prints the tied embedding's lr; late_qat_last_frac is its qat_last_frac)
LOG_TO_ARGS = {"embed_lr": "tied_embed_lr", "late_qat_last_frac": "qat_last_frac"}
# the record's optimizer and schedule arguments -> the kit's setting of the same meaning
ARGS_TO_KIT = {"matrix_lr": "matrix_lr", "scalar_lr": "scalar_lr", "tied_embed_lr": "tied_embed_lr",
               "adam_wd": "adam_wd", "muon_wd": "muon_wd", "beta1": "beta1", "beta2": "beta2", "adam_eps": "adam_eps",
               "muon_momentum": "muon_momentum", "muon_momentum_warmup_start": "muon_momentum_warmup_start",
               "muon_backend_steps": "muon_backend_steps", "grad_clip_norm": "grad_clip_norm",
               "warmdown_last_frac": "warmdown_frac", "qat_last_frac": "qat_start_frac",
               "train_seq_len": "train_seq_len", "train_batch_tokens": "train_batch_tokens",
               "xsa_last_n": "xsa_last_n", "mlp_mult": "mlp_mult", "rope_dims": "rope_dims",
               "tie_embeddings": "tie_embeddings", "num_heads": "num_heads", "num_kv_heads": "num_kv_heads"}


def read_log_args(path) -> dict:
    """{key: value} of the `key:value` pairs PR #1617's log prints before training (up to its first warmup_step line;
    numbers as float, True/False as bool). ValueError naming the file when it prints none."""
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("warmup_step:") or line.startswith("step:"):
            break
        for key, value in re.findall(r"(\w+):(\S+)", line):
            out[key] = value == "True" if value in ("True", "False") else float(value) if re.fullmatch(
                r"-?[\d.]+(e-?\d+)?", value) else value
    if "matrix_lr" not in out:
        raise ValueError(f"{path}: no 'matrix_lr:' before training (expected PR #1617's train log)")
    return out


def record_args(module, log_path, **overrides) -> types.SimpleNamespace:
    """The record's `args`: its Hyperparameters class defaults, the values its log prints (LOG_TO_ARGS names), then
    overrides (toy sizes, ITERATIONS)."""
    cls = module.Hyperparameters
    args = types.SimpleNamespace(**{k: getattr(cls, k) for k in dir(cls) if not k.startswith("__")})
    for key, value in read_log_args(log_path).items():
        name = LOG_TO_ARGS.get(key, key)
        if hasattr(args, name):
            setattr(args, name, type(getattr(args, name))(value))
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def log_args_mismatches(args, hp: Hyperparameters) -> list:
    """['name: record R, kit K'] for each ARGS_TO_KIT key whose values differ."""
    return [f"{k}: record {getattr(args, k)!r}, kit {getattr(hp, v)!r}" for k, v in ARGS_TO_KIT.items()
            if getattr(args, k) != getattr(hp, v)]


def record_optimizers(module, model, args) -> list:
    """PR #1617's optimizers as its main() builds them: [token AdamW, Muon, scalar AdamW] (fused AdamW, as there)."""
    named = list(model.blocks.named_parameters())
    control = module.CONTROL_TENSOR_NAME_PATTERNS
    matrix = [p for n, p in named if p.ndim == 2 and not any(c in n for c in control)]
    scalar = [p for n, p in named if p.ndim < 2 or any(c in n for c in control)] + [model.skip_weights]
    adam = dict(betas=(args.beta1, args.beta2), eps=args.adam_eps, weight_decay=args.adam_wd, fused=True)
    tok = torch.optim.AdamW([{"params": [model.tok_emb.weight], "lr": args.tied_embed_lr,
                              "base_lr": args.tied_embed_lr}], **adam)
    muon = module.Muon(matrix, lr=args.matrix_lr, momentum=args.muon_momentum, backend_steps=args.muon_backend_steps,
                       weight_decay=args.muon_wd)
    for group in muon.param_groups:
        group["base_lr"] = args.matrix_lr
    return [tok, muon, torch.optim.AdamW([{"params": scalar, "lr": args.scalar_lr, "base_lr": args.scalar_lr}], **adam)]


def record_lr_mul(args, frac: float) -> float:
    """Its lr_mul on the wallclock path, the elapsed time being `frac` of MAX_WALLCLOCK_SECONDS."""
    start = 1.0 - args.warmdown_last_frac
    return 1.0 if frac < start else max((1.0 - frac) / max(1.0 - start, 1e-9), 0.0)


def record_qat_bits(module, model) -> None:
    """Its main()'s late-QAT bits on every CastedLinear: 6 where INT6_NAME_PATTERNS match the weight's name, 8 where
    INT8_QAT_NAME_PATTERNS do, else 0."""
    for name, lin in model.named_modules():
        if isinstance(lin, module.CastedLinear):
            w = f"{name}.weight"
            lin._qat_bits = (6 if any(p in w for p in module.INT6_NAME_PATTERNS) else
                             8 if any(p in w for p in module.INT8_QAT_NAME_PATTERNS) else 0)


def record_train_step(module, model, optimizers: list, args, step: int, backward) -> None:
    """One step of its train loop at `step` (one micro-batch): late QAT on from the last QAT_LAST_FRAC of the run
    (its class switch CastedLinear._qat_enabled), the LR multiplier, backward() (makes the gradients), ..."""
    frac = step / args.iterations
    if args.qat_last_frac > 0 and frac >= 1.0 - args.qat_last_frac:
        module.CastedLinear._qat_enabled = True
    scale = record_lr_mul(args, frac)
    backward()
    frac = min(step / args.muon_momentum_warmup_steps, 1.0) if args.muon_momentum_warmup_steps > 0 else 1.0
    for group in optimizers[1].param_groups:
        group["momentum"] = (1 - frac) * args.muon_momentum_warmup_start + frac * args.muon_momentum
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * scale
    if args.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip_norm)
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)


def batch_backwards(kit, record, batches: list) -> list:
    """[(kit backward, record backward)] of each model's training loss on each (x, y) of batches."""
    return [((lambda x=x, y=y: kit(x, y).backward()), (lambda x=x, y=y: record(x, y).backward())) for x, y in batches]


def gradient_backwards(kit, record, grads: list) -> list:
    """[(kit backward, record backward)] that set the same gradients {name: tensor} on both (the same names)."""
    def setter(model, named):
        def backward():
            for n, p in model.named_parameters():
                p.grad = named[n].clone()
        return backward
    return [(setter(kit, g), setter(record, g)) for g in grads]


def compare_pr1617_steps(module, kit, record, hp: Hyperparameters, args, backwards: list, first_step: int) -> list:
    """Both models (equal weights, the same names) take one step per (kit backward, record backward) pair at steps
    first_step, ...; returns per step {"step", "params": max over parameters of max |kit - record| / max |record|,
    "worst", "lr_mul", "momentum" (the record's), "qat" / "record_qat" (each side's late QAT)}."""
    from quant.policy import QuantPolicy
    from trainer.schedule import qat_active, run_progress

    out = []
    kit.configure_qat(QuantPolicy.from_env({"PRESET": "1xh100-sp4096"}))
    record_qat_bits(module, record)
    module.CastedLinear._qat_enabled = False
    with cpu_standins():
        optimizers = build_optimizers(kit, hp, is_cuda=False)
        for group in optimizers.adamw.param_groups:  # fused, as on CUDA and as the record's
            group["fused"] = True
        record_opts = record_optimizers(module, record, args)
        kit.train(), record.train()
        for i, (kit_backward, record_backward) in enumerate(backwards):
            step = first_step + i
            qat = qat_active(run_progress(0.0, 0.0, step, hp.iterations), hp.qat_start_frac)
            kit.set_qat(qat)  # trainer/loop.py: on from the step where progress reaches it
            kit_step(kit, optimizers, None, hp, step, kit_backward)
            record_train_step(module, record, record_opts, args, step, record_backward)
            mine = dict(record.named_parameters())
            diffs = {n: ((p - mine[n]).abs().max() / mine[n].abs().max().clamp_min(1e-30)).item()
                     for n, p in kit.named_parameters()}
            worst = max(diffs, key=diffs.get)
            out.append({"step": step, "params": diffs[worst], "worst": worst,
                        "lr_mul": record_opts[0].param_groups[0]["lr"] / args.tied_embed_lr,
                        "momentum": record_opts[1].param_groups[0]["momentum"],
                        "qat": qat, "record_qat": module.CastedLinear._qat_enabled})
    module.CastedLinear._qat_enabled = False
    kit.set_qat(False)
    return out
