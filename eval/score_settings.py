"""The settings of `python -m eval score` (eval/__main__.py), from the trainer's one source: each setting it
shares with train_gpt.py is a flag, else the trainer's environment variable, else primitives.settings.
Hyperparameters' default under PRESET (primitives/presets.py); no default table of the CLI's own. CLI-only
(not bundled); imports no torch (its inputs are checked before torch's import)."""

import dataclasses
import os

from primitives.cli_errors import env_choice, env_float, env_int, parse_number
from primitives.domains import domain_violations, field_domain
from primitives.env import parse_env_value
from primitives.presets import DEFAULT_PRESET, PRESETS
from primitives.settings import Hyperparameters, valid_ttt_params


def choices(name: str) -> tuple:
    """The choices Hyperparameters declares for setting `name` (its domain)."""
    return field_domain(next(f for f in dataclasses.fields(Hyperparameters) if f.name == name)).choices


ATTN_BACKENDS, LOSS_KERNELS, TTT_MODES = choices("attn_backend"), choices("loss_kernel"), choices("ttt_mode")


def settings_defaults(environ=None) -> Hyperparameters:
    """The trainer's settings before the environment: Hyperparameters' defaults under PRESET (its groups in
    primitives/presets.py), the one default table `python -m eval score` shares with train_gpt.py. ValueError
    naming PRESET for an unknown one."""
    preset = (os.environ if environ is None else environ).get("PRESET", DEFAULT_PRESET)
    if preset not in PRESETS:
        raise ValueError(f"PRESET={preset!r}: expected one of {', '.join(sorted(PRESETS))}")
    return Hyperparameters(**{**PRESETS[preset], "preset": preset})


# args attribute -> (the Hyperparameters field whose default and environment variable it shares, its check: int or
# float with parse_number's limits, or the choices); a flag wins over both
SHARED_SETTINGS = {
    "batch_seqs": ("eval_batch_seqs", int, dict(minimum=1)), "max_seconds": ("eval_max_seconds", float, dict(above=0)),
    "auto_stride": ("eval_auto_stride", ("0", "1"), {}), "val_max_tokens": ("val_max_tokens", int, dict(minimum=0)),
    "attn_backend": ("attn_backend", ATTN_BACKENDS, {}), "loss_kernel": ("loss_kernel", LOSS_KERNELS, {}),
    "ttt": ("ttt_enabled", int, dict(minimum=0)), "ttt_chunk_tokens": ("ttt_chunk_tokens", int, dict(minimum=1)),
    "ttt_epochs": ("ttt_epochs", int, dict(minimum=0)), "ttt_lr": ("ttt_lr", float, dict(minimum=0)),
    "ttt_momentum": ("ttt_momentum", float, dict(minimum=0)), "ttt_grad_clip": ("ttt_grad_clip", float, dict(minimum=0)),
    "ttt_batch_seqs": ("ttt_batch_seqs", int, dict(minimum=1)), "ttt_phases": ("ttt_phases", int, dict(minimum=1)),
    "ttt_lora_rank": ("ttt_lora_rank", int, dict(minimum=1)), "ttt_lora_lr": ("ttt_lora_lr", float, dict(minimum=0)),
    "ttt_lora_chunk_tokens": ("ttt_lora_chunk_tokens", int, dict(minimum=1)),
    "ttt_lora_batch_docs": ("ttt_lora_batch_docs", int, dict(minimum=1)), "ttt_mode": ("ttt_mode", TTT_MODES, {}),
    "ttt_params": ("ttt_params", str, {})}


def mode_only_settings() -> tuple:
    """The TTT_* fields of Hyperparameters that no flag shares (a mode's own, e.g. TTT_PREFIX_DOCS): the CLI
    reads them as the trainer does, so a row's fields reach `score` without an entry in SHARED_SETTINGS."""
    shared = {name for name, _, _ in SHARED_SETTINGS.values()}
    return tuple(f for f in dataclasses.fields(Hyperparameters) if f.name.startswith("ttt_") and f.name not in shared)


def resolve_mode_only_settings(args, defaults: Hyperparameters, environ) -> None:
    """Set args.<field> of each mode_only_settings() field from its flag, else its environment variable (parsed
    and checked against its declared domain as the trainer does), else the trainer's default; ValueError naming
    every malformed one (one line)."""
    values, errors = {}, []
    for f in mode_only_settings():
        flag, env = getattr(args, f.name, None), f.name.upper()
        try:
            if flag is not None:
                values[f.name] = parse_env_value(f"--{f.name.replace('_', '-')}", str(flag), f.type)
            else:
                values[f.name] = parse_env_value(env, environ[env], f.type) if env in environ else getattr(defaults, f.name)
        except ValueError as err:
            errors.append(str(err))
    found = {k: v for k, v in domain_violations(dataclasses.replace(defaults, **values)).items() if k in values}
    if errors or found:
        raise ValueError("; ".join([*errors, *found.values()]))
    for name, value in values.items():
        setattr(args, name, value)


def resolve_cli_settings(args, environ=None) -> None:
    """Fill the settings of `score` args that no flag gave: the environment variable (the trainer's name), else
    the trainer's default under PRESET (settings_defaults: no default table of the CLI's own); then check each
    (primitives/cli_errors.py: ValueError naming the flag or variable, one line, exit 2). Records in
    args.ttt_flags which TTT settings came from flags (they beat the artifact's; the environment does not)."""
    environ = os.environ if environ is None else environ
    defaults = settings_defaults(environ)
    args.ttt_flags = [a for a in [*SHARED_SETTINGS, *(f.name for f in mode_only_settings())]
                      if a.startswith("ttt_") and getattr(args, a, None) is not None] + [
        "ttt_eval_batch_seqs"] * (args.batch_seqs is not None)
    for attr, (name, kind, limits) in SHARED_SETTINGS.items():
        default, env = getattr(defaults, name), name.upper()
        default = int(default) if isinstance(default, bool) else default
        if isinstance(kind, tuple):  # choices
            value = getattr(args, attr, None)  # LOSS_KERNEL has no flag
            value = env_choice(env, str(default), kind, environ) if value is None else value
            setattr(args, attr, int(value) if kind == ("0", "1") else value)
        elif kind is str:
            setattr(args, attr, environ.get(env, default) if getattr(args, attr) is None else getattr(args, attr))
        elif getattr(args, attr) is None:
            setattr(args, attr, (env_int if kind is int else env_float)(env, default, environ, **limits))
        else:
            parse_number(f"--{attr.replace('_', '-')}", getattr(args, attr), kind, **limits)
    resolve_mode_only_settings(args, defaults, environ)
    if args.compile is None:  # the CLI's own: the trainer compiles whenever it runs on CUDA
        args.compile = int(env_choice("EVAL_COMPILE", "1", ("0", "1"), environ))
    if "EVAL_STRIDE" in environ:
        env_int("EVAL_STRIDE", defaults.eval_stride, environ, minimum=0)
    if args.val_max_tokens == 1:
        raise ValueError("--val-max-tokens 1 (VAL_MAX_TOKENS): expected 0 (the whole split) or >= 2 targets")
    if args.ttt not in (0, 1):
        raise ValueError(f"--ttt {args.ttt} (TTT_ENABLED): expected 0 or 1")
    if not valid_ttt_params(args.ttt_params):
        raise ValueError(f"--ttt-params {args.ttt_params!r} (TTT_PARAMS): expected all, scalars or a regular expression "
                         "of parameter names")
    args.ttt_eval_batch_seqs = args.batch_seqs
