"""`python -m eval`: score an artifact from disk, or count the bytes of the val split.

  python -m eval score --artifact FILE --data-path DIR --tokenizer MODEL [--stride S] [--seq-len L] [--batch-seqs B]
      Rebuilds the model from the artifact alone (quant.artifact.load_artifact + train_gpt.GPT),
      runs the roundtrip and sliding evals and prints the official-style lines
      `final_roundtrip_exact val_loss:... val_bpb:...` and
      `final_sliding_window_exact val_loss:... val_bpb:... stride:S eval_time:Nms`, then the bytes:
      model (the artifact) + code (--code, a train_gpt.py beside the artifact, or result.json's
      bytes_code) against the 16,000,000-byte budget.
      The artifact (format 3) says how to score it: the sequence length (the run's TRAIN_SEQ_LEN),
      the stride (its EVAL_STRIDE) and the vocabulary come from it, flags override. A tokenizer
      whose sha256 differs from the one the run trained with is refused (exit 2, both named)
      unless --allow-tokenizer-mismatch. A format-2 artifact records none of these: it needs
      --seq-len, and its tokenizer cannot be checked.
      Works under `torchrun --nproc_per_node=K` (nccl on CUDA, gloo on CPU).
  python -m eval bytes --data-path DIR --tokenizer MODEL
      Prints `val_tokens:N val_bytes:M tokens_per_byte:R` where N is the number of scored
      targets (all val tokens but the first) and M their byte count (official LUT rule).

Attention, autocast and compile follow the trainer: on CUDA FA3 -> FA4 -> FA2 -> SDPA (ATTN_BACKEND /
--attn-backend), bf16 autocast, torch.compile of the forward; on CPU SDPA in float32, eager.
Settings (flags override): the trainer's environment variables and defaults, one source: each setting it
shares with train_gpt.py (EVAL_BATCH_SEQS, EVAL_MAX_SECONDS for loading + roundtrip + sliding together,
EVAL_AUTO_STRIDE, VAL_MAX_TOKENS, ATTN_BACKEND, LOSS_KERNEL (TTT's training loss: Liger-Kernel's fused linear cross
entropy on CUDA when it imports), EVAL_STRIDE (the artifact's stride wins over it), TTT_*) is the environment's,
else primitives.settings.Hyperparameters' default under PRESET (primitives/presets.py), as the trainer resolves
it; EVAL_COMPILE (1, CUDA only) is the CLI's own.
Every input is checked before torch is imported: a bad one is one line on stderr and exit 2 (primitives/cli_errors.py).
A NaN or infinite score is never printed as a result: one line naming the pass, exit 1 (as the trainer's).
With --ttt 1 (TTT_ENABLED) the sliding pass is score-first TTT of --ttt-mode (TTT_MODE: a row of eval/ttt_modes.py,
run by eval/walk.py), printed as `final_ttt_exact val_loss:... val_bpb:... eval_time:Nms`, with the TTT
settings the run scored with (the artifact records its plan: the planned epochs and phases, its stride, the mode and
the mode's settings, and its scoring batch), flags override; one line says which came from where (and names a TTT_*
variable of the environment the artifact's value replaced). An artifact that records none, or one of a run without
TTT, uses the flags, else the environment, else the trainer's defaults, and the line says so. Modes: chunked
(TTT_CHUNK_TOKENS chunks, SGD on each scored chunk), phased (TTT_PHASES phases, SGD on every document scored so
far), lora (per-document adapters of TTT_LORA_RANK, reset per document, chunks of TTT_LORA_CHUNK_TOKENS, Adam at
TTT_LORA_LR, TTT_LORA_BATCH_DOCS documents side by side).
This module is CLI-only and is not bundled into train_gpt.py.
"""

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import sentencepiece as spm

from eval.offline import NonFiniteScoreError
from eval.score_settings import ATTN_BACKENDS, TTT_MODES, mode_only_settings, resolve_cli_settings, settings_defaults
from primitives.domains import field_domain
from primitives.cli_errors import (USER_ERRORS, ArgumentParser, check_dir, check_file, env_int, parse_number,
                                   protect_console, report_user_error)
from primitives.settings import UNRECORDED_TTT_MODE, valid_ttt_params

# Imported by _import_evals() once the inputs are checked: a bad input fails before torch's import
# (seconds). Module names so that tests can patch them.
eval_roundtrip = eval_sliding = run_mode = mode_settings = ttt_result_line = zero_updates_warning = None


def _import_evals() -> None:
    global eval_roundtrip, eval_sliding, run_mode, mode_settings, ttt_result_line, zero_updates_warning
    from eval import roundtrip, sliding, ttt, ttt_modes  # the names below: unless a test patched them
    eval_roundtrip, eval_sliding = eval_roundtrip or roundtrip.eval_roundtrip, eval_sliding or sliding.eval_sliding
    run_mode, mode_settings = run_mode or ttt_modes.run_mode, mode_settings or ttt_modes.mode_settings
    ttt_result_line, zero_updates_warning = ttt_result_line or ttt.ttt_result_line, ttt.zero_updates_warning


def _load_model(artifact_path, device, log, attn_backend="auto", loss_kernel="auto"):
    from quant.artifact import load_artifact  # written concurrently; CLI-only imports
    from model.attention import resolve_attention_backend
    from model.fused_loss import resolve_loss_kernel
    from model.gpt import GPT

    log(f"attention:{resolve_attention_backend(attn_backend, device, log)}")  # the trainer's FA3 -> FA4 -> FA2 -> SDPA choice
    resolve_loss_kernel(loss_kernel, device, log)  # TTT's training steps: the trainer's loss kernel (logs loss:...)

    state_dict, model_config, meta = load_artifact(artifact_path)
    model = GPT(**model_config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    param_names = {name for name, _ in model.named_parameters()}
    missing_params = [k for k in missing if k in param_names]
    if missing_params or unexpected:
        raise ValueError(f"artifact {artifact_path}: missing parameters {missing_params}, unexpected tensors "
                         f"{list(unexpected)}")
    if missing:
        log(f"artifact {artifact_path}: buffers not stored, kept at their init values: {list(missing)}")
    return model.to(device).eval(), model_config, meta  # the evals expect eval mode


def resolve_score_settings(args, model_config: dict, meta: dict, environ=None, log=print) -> tuple:
    """(seq_len, stride) to score an artifact with: a flag, else the artifact's run metadata, else
    (stride only) env EVAL_STRIDE, else 64. Checks the tokenizer's sha256 against the one the run
    recorded (format 3) before anything long starts.

    Raises ValueError naming the artifact (and both sha256 and the tokenizer file on a mismatch,
    unless args.allow_tokenizer_mismatch) for: a format-2 artifact without --seq-len, malformed run
    metadata, a vocab size that disagrees with the model config, a different tokenizer.
    """
    environ = os.environ if environ is None else environ
    run = meta.get("run") or {}
    name = args.artifact
    if meta.get("format_version", 2) < 3:
        log(f"artifact {name} is format 2: it records no training sequence length, tokenizer sha256 or eval "
            f"stride (format 3 does); the tokenizer is not checked")
    elif run:
        ok = all(type(run.get(k)) is int and run[k] > 0 for k in ("train_seq_len", "vocab_size", "eval_stride"))
        sha = run.get("tokenizer_sha256")
        if not (ok and isinstance(sha, str) and len(sha) == 64):
            raise ValueError(f"artifact {name}: malformed run metadata {run}")
        if run["vocab_size"] != model_config.get("vocab_size"):
            raise ValueError(f"artifact {name}: run vocab_size {run['vocab_size']} but model config vocab_size "
                             f"{model_config.get('vocab_size')}")
    else:
        log(f"artifact {name}: no run metadata (written outside the trainer); the tokenizer is not checked")
    seq_len = args.seq_len or run.get("train_seq_len")
    if not seq_len:
        raise ValueError(f"artifact {name} does not record the training sequence length: pass --seq-len "
                         f"(the run's TRAIN_SEQ_LEN)")
    env_stride = environ.get("EVAL_STRIDE")
    if args.stride is not None:
        stride = args.stride
    elif "eval_stride" in run:
        stride = run["eval_stride"]
        if env_stride is not None and env_stride != str(stride):
            log(f"EVAL_STRIDE={env_stride} in the environment ignored: the artifact records stride {stride} "
                f"(pass --stride to override)")
    else:
        stride = env_int("EVAL_STRIDE", settings_defaults(environ).eval_stride, environ, minimum=0)
    if not 0 <= stride <= seq_len:
        raise ValueError(f"{'--stride' if args.stride is not None else 'stride'} {stride} (artifact {name}): expected 0 "
                         f"(no sliding eval) or a stride in [1, {seq_len}] (the sequence length)")
    if "tokenizer_sha256" in run:
        if not Path(args.tokenizer).is_file():
            raise FileNotFoundError(f"TOKENIZER_PATH={args.tokenizer} does not exist")
        sha = hashlib.sha256(Path(args.tokenizer).read_bytes()).hexdigest()
        if sha != run["tokenizer_sha256"]:
            what = (f"tokenizer {args.tokenizer} has sha256 {sha}, but the artifact {name} was trained with a "
                    f"tokenizer of sha256 {run['tokenizer_sha256']}")
            if not args.allow_tokenizer_mismatch:
                raise ValueError(what + ": wrong tokenizer for this model (pass --allow-tokenizer-mismatch to "
                                        "score anyway)")
            log(f"WARNING: {what}; scoring anyway (--allow-tokenizer-mismatch)")
    return int(seq_len), int(stride)


def check_score_inputs(args, environ=None) -> None:
    """Resolve the env defaults of `args` (flags win) and check every input of `score` / `bytes` before
    torch is imported: ValueError / FileNotFoundError naming the flag or env var, its value and what
    was expected (primitives/cli_errors.py: one line, exit 2)."""
    environ = os.environ if environ is None else environ
    if args.command == "score":
        if Path(args.artifact).is_dir():
            inside = Path(args.artifact) / "final_model.ptz"
            raise ValueError(f"--artifact {args.artifact}: is a folder; expected an artifact file"
                             + (f" (did you mean {inside}?)" if inside.is_file() else " (.ptz)"))
        check_file("--artifact", args.artifact, "an artifact file (.ptz)")
        if args.code is not None:
            check_file("--code", args.code, "the shipped train_gpt.py")
    check_dir("--data-path", args.data_path, "a dataset folder with fineweb_val_*.bin shards (tools/prepare_data.py)")
    if not any(Path(args.data_path).glob("fineweb_val_*.bin")):
        raise ValueError(f"--data-path {args.data_path}: no fineweb_val_*.bin; expected a dataset folder with the val "
                         "split (tools/prepare_data.py makes it)")
    check_sentencepiece("--tokenizer", args.tokenizer)
    if args.command != "score":
        return
    if args.stride is not None:
        parse_number("--stride", args.stride, minimum=0, expected="0 (no sliding eval) or a stride >= 1")
    parse_number("--seq-len", args.seq_len, minimum=0, expected="an integer >= 1 (0: the artifact's)")
    resolve_cli_settings(args, environ)


# args attribute -> (key of the artifact's run["ttt"], setting name, type, minimum)
TTT_SETTINGS = {"ttt_epochs": ("epochs", "TTT_EPOCHS", int, 0), "ttt_chunk_tokens": ("chunk_tokens", "TTT_CHUNK_TOKENS", int, 1),
                "ttt_lr": ("lr", "TTT_LR", float, 0), "ttt_momentum": ("momentum", "TTT_MOMENTUM", float, 0),
                "ttt_grad_clip": ("grad_clip", "TTT_GRAD_CLIP", float, 0),
                "ttt_batch_seqs": ("batch_seqs", "TTT_BATCH_SEQS", int, 1), "ttt_params": ("params", "TTT_PARAMS", str, None),
                "ttt_eval_batch_seqs": ("eval_batch_seqs", "EVAL_BATCH_SEQS", int, 1),
                "ttt_mode": ("mode", "TTT_MODE", str, None), "ttt_phases": ("phases", "TTT_PHASES", int, 1),
                "ttt_lora_rank": ("lora_rank", "TTT_LORA_RANK", int, 1), "ttt_lora_lr": ("lora_lr", "TTT_LORA_LR", float, 0),
                "ttt_lora_chunk_tokens": ("lora_chunk_tokens", "TTT_LORA_CHUNK_TOKENS", int, 1),
                "ttt_lora_batch_docs": ("lora_batch_docs", "TTT_LORA_BATCH_DOCS", int, 1),
                # a mode's own settings (e.g. phased_lora's TTT_PREFIX_DOCS): recorded only by that mode's artifacts
                **{f.name: (f.name[4:], f.name.upper(), f.type, field_domain(f).low) for f in mode_only_settings()}}
MODE_ONLY_KEYS = {f.name[4:] for f in mode_only_settings()}


def unused_ttt_settings(mode: str) -> set:
    """The TTT_SETTINGS a mode does not read (not described in its `ttt settings:` line): those outside its row's
    fields (eval/ttt_modes.py), besides the epochs, the scoring batch and the mode every mode has."""
    from eval.ttt_modes import TTT_MODES  # torch: imported once the inputs are checked

    return set(TTT_SETTINGS) - {f"ttt_{f}" for f in TTT_MODES[mode].fields} - {"ttt_epochs", "ttt_eval_batch_seqs",
                                                                              "ttt_mode"}


def resolve_ttt_settings(args, meta: dict, log=print, environ=None) -> None:
    """With --ttt 1: set args' TTT settings (TTT_SETTINGS) to the ones the run scored with, recorded in the
    artifact's run["ttt"] (trainer/finish.py), except those a flag gave; log one line saying which came from
    the artifact and which from flags, and naming a TTT variable of `environ` (default os.environ) the
    artifact's value replaced. An artifact that records none (written before they were recorded, or outside
    the trainer), or a run without TTT (TTT_ENABLED=0: its settings never ran, its epochs are 0), keeps the
    flags / environment / the trainer's defaults, and the line says so. Without --ttt, a run that scored with
    TTT gets a hint. ValueError naming the artifact for malformed settings."""
    ttt, name = (meta.get("run") or {}).get("ttt"), args.artifact
    if isinstance(ttt, dict):  # before the phased mode: chunked; lora keys only in lora's; before batching: 1 document
        ttt = {"mode": UNRECORDED_TTT_MODE, "phases": 1, "lora_rank": 8, "lora_lr": 0.01, "lora_chunk_tokens": 256,
               "lora_batch_docs": 1, **ttt}
    if ttt is not None:
        ok = isinstance(ttt, dict) and ttt.get("enabled") in (0, 1) and all(
            (isinstance(ttt.get(key), str) and (ttt[key] in TTT_MODES if key == "mode" else valid_ttt_params(ttt[key]))
             if kind is str else type(ttt.get(key)) in (int, kind)
             and (minimum is None or ttt[key] >= minimum) and ttt[key] == ttt[key] and ttt[key] != float("inf"))
            for key, _, kind, minimum in TTT_SETTINGS.values() if key in ttt or key not in MODE_ONLY_KEYS)
        if not ok:
            raise ValueError(f"artifact {name}: malformed TTT settings {ttt}")
    if not args.ttt:
        if ttt and ttt["enabled"] and ttt["epochs"]:
            log(f"artifact {name}: the run scored with TTT ({ttt['epochs']} epochs): this is the sliding score; "
                f"pass --ttt 1 for the run's score")
        return
    described = lambda attrs: " ".join(f"{TTT_SETTINGS[a][1]}={getattr(args, a)}" for a in attrs
                                       if a not in unused_ttt_settings(args.ttt_mode))
    flags = [a for a in TTT_SETTINGS if a in args.ttt_flags]
    if ttt is None or not ttt["enabled"]:  # a run without TTT: 0 epochs and 1 phase are not settings to score with
        why = ("records none (written before artifacts recorded them, or outside the trainer)" if ttt is None else
               "is from a run without TTT (TTT_ENABLED=0): its TTT settings never ran")
        log(f"ttt settings: artifact {name} {why}: the environment or CLI defaults "
            f"{described(a for a in TTT_SETTINGS if a not in flags)}" + f", flags {described(flags)}" * bool(flags)
            + ("; the score is the run's only if these match the run's TTT_* settings (its result.json's score_command)"
               if ttt is None else "; a TTT score of its weights, not the run's score (the sliding one)"))
        return
    taken = [a for a in TTT_SETTINGS if a not in flags and TTT_SETTINGS[a][0] in ttt]  # a mode's own: if recorded
    for attr in taken:
        setattr(args, attr, ttt[TTT_SETTINGS[attr][0]])
    environ = os.environ if environ is None else environ
    replaced = [f"{TTT_SETTINGS[a][1]}={environ[TTT_SETTINGS[a][1]]}" for a in taken if TTT_SETTINGS[a][1] in environ
                and not same_setting(environ[TTT_SETTINGS[a][1]], ttt[TTT_SETTINGS[a][0]])]
    log(f"ttt settings: from the artifact {described(taken) or 'none'}; from flags {described(flags) or 'none'}"
        + (" (the run's plan skipped TTT: its score is the sliding one)" if not ttt["epochs"] else "")
        + (f"; not used: the environment's {' '.join(replaced)} (the artifact records what the run scored with; "
           "a flag overrides it)" if replaced else ""))


def same_setting(raw: str, value) -> bool:
    """True when the environment's text `raw` is the recorded `value` (2e-3 is 0.002)."""
    try:
        return float(raw) == float(value)
    except (TypeError, ValueError):
        return str(raw) == str(value)


def check_sentencepiece(what: str, path) -> None:
    """FileNotFoundError / ValueError naming `what` unless `path` loads as a SentencePiece model."""
    check_file(what, path, "a SentencePiece .model file")
    try:
        spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as exc:
        raise ValueError(f"{what} {path}: not a SentencePiece model ({exc}); expected a SentencePiece .model file") from None


def cmd_score(args) -> None:
    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    from eval.offline import load_val_byte_luts, require_finite_scores, submission_bytes_line
    from shards.format import check_data_manifest, load_validation_tokens

    _import_evals()

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    try:
        model, model_config, meta = _load_model(args.artifact, device, log, args.attn_backend, args.loss_kernel)
        vocab_size = int(model_config["vocab_size"])
        seq_len, stride = resolve_score_settings(args, model_config, meta, log=log)
        resolve_ttt_settings(args, meta, log=log)
        check_data_manifest(args.data_path, vocab_size=vocab_size, log=log)
        luts, byte_count = load_val_byte_luts(args.tokenizer, vocab_size, args.data_path, meta.get("run"))
        log(f"val_byte_count:{byte_count}")  # sidecar: CaseOps data, its original bytes (shards/sidecar.py)
        val_tokens = load_validation_tokens(args.data_path, vocab_size=vocab_size)
        if args.val_max_tokens:  # same truncation as the trainer's VAL_MAX_TOKENS (not for records)
            val_tokens = val_tokens[: args.val_max_tokens + 1]
        autocast_dtype = torch.bfloat16 if device.type == "cuda" and args.autocast == "bf16" else None
        common = dict(batch_seqs=args.batch_seqs, device=device, rank=rank, world_size=world_size,
                      autocast_dtype=autocast_dtype, compile_model=bool(args.compile) and device.type == "cuda")
        val_loss, val_bpb = eval_roundtrip(model, val_tokens, luts, seq_len=seq_len, **common)
        require_finite_scores({"roundtrip": (val_loss, val_bpb)})  # checked before its line: nan is never printed
        log(f"final_roundtrip_exact val_loss:{val_loss:.8f} val_bpb:{val_bpb:.8f}")
        ttt = dict(epochs=args.ttt_epochs, eval_batch_seqs=args.ttt_eval_batch_seqs, log=log,
                   max_seconds=max(args.max_seconds - (time.perf_counter() - t_start), 1e-9),
                   **{k: v for k, v in common.items() if k != "batch_seqs"})
        if stride > 0 and args.ttt:  # score-first TTT of --ttt-mode (eval/ttt_modes.py): its scoring pass is the sliding pass
            result = run_mode(args.ttt_mode, model, val_tokens, luts, seq_len=seq_len, stride=stride, **ttt,
                              **mode_settings(args.ttt_mode, args))
            require_finite_scores({f"{args.ttt_mode} TTT": (result["val_loss"], result["val_bpb"])})
            log(ttt_result_line(result))
            if not result["num_updates"] and args.ttt_epochs:
                log(zero_updates_warning(result, args.ttt_mode))
        elif stride > 0:
            # loading and the roundtrip count against the same EVAL_MAX_SECONDS; when they used it all,
            # the guard still projects and says so (a budget <= 0 would be refused as a bad input)
            budget_seconds = max(args.max_seconds - (time.perf_counter() - t_start), 1e-9)
            result = eval_sliding(model, val_tokens, luts, seq_len=seq_len, stride=stride, max_seconds=budget_seconds,
                                  auto_stride=bool(args.auto_stride), log=log, **common)
            require_finite_scores({"sliding": (result["val_loss"], result["val_bpb"])})
            log(f"final_sliding_window_exact val_loss:{result['val_loss']:.8f} val_bpb:{result['val_bpb']:.8f} "
                f"stride:{result['stride']} eval_time:{1000 * result['eval_seconds']:.0f}ms")
        else:
            log("sliding eval skipped: stride 0")
        log(f"eval_total_time:{1000 * (time.perf_counter() - t_start):.0f}ms seq_len:{seq_len} "
            f"val_tokens:{val_tokens.numel()}")
        log(submission_bytes_line(args.artifact, args.code))
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def cmd_bytes(args) -> None:
    from eval.offline import count_stream_bytes, load_val_byte_luts
    from shards.format import load_validation_tokens

    sp = spm.SentencePieceProcessor(model_file=str(args.tokenizer))
    vocab_size = int(sp.vocab_size())
    luts, _ = load_val_byte_luts(args.tokenizer, vocab_size, args.data_path)  # a CaseOps split: its sidecar
    tokens = load_validation_tokens(args.data_path, vocab_size=vocab_size)
    num_targets = tokens.numel() - 1
    num_bytes = count_stream_bytes(tokens, luts)
    print(f"val_tokens:{num_targets} val_bytes:{num_bytes} tokens_per_byte:{num_targets / max(num_bytes, 1):.8f}")


def build_parser() -> ArgumentParser:
    """The `python -m eval` parser: every setting flag defaults to None (check_score_inputs resolves it)."""
    parser = ArgumentParser(prog="python -m eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="score an artifact (.ptz) on the val split")
    score.add_argument("--artifact", required=True)
    score.add_argument("--data-path", required=True)
    score.add_argument("--tokenizer", required=True)
    score.add_argument("--stride", type=int, default=None,
                       help="sliding stride; 0 skips the sliding eval (default: the artifact's, else EVAL_STRIDE or 64)")
    score.add_argument("--seq-len", type=int, default=0,
                       help="window length (default: the artifact's training sequence length; required for format 2)")
    score.add_argument("--allow-tokenizer-mismatch", action="store_true",
                       help="score with a tokenizer whose sha256 differs from the one the artifact records")
    # None: the env var (EVAL_BATCH_SEQS, ...) or its default, read and checked by check_score_inputs
    score.add_argument("--batch-seqs", type=int, default=None,
                       help="windows per forward (default EVAL_BATCH_SEQS or the PRESET's, as the trainer)")
    score.add_argument("--max-seconds", type=float, default=None, help="default EVAL_MAX_SECONDS or the PRESET's")
    score.add_argument("--auto-stride", type=int, choices=(0, 1), default=None,
                       help="default EVAL_AUTO_STRIDE or the PRESET's")
    score.add_argument("--compile", type=int, choices=(0, 1), default=None,
                       help="torch.compile the forward (CUDA only; default EVAL_COMPILE or 1)")
    score.add_argument("--val-max-tokens", type=int, default=None,
                       help="score only the first N+1 val tokens, as the trainer's VAL_MAX_TOKENS (0 = all; records "
                            "need all; default VAL_MAX_TOKENS or 0)")
    score.add_argument("--autocast", choices=("bf16", "none"), default="bf16", help="autocast dtype on CUDA")
    score.add_argument("--attn-backend", choices=ATTN_BACKENDS, default=None,
                       help="attention kernel on CUDA, chosen as the trainer does (auto: FA3 -> FA4 -> FA2 -> SDPA; "
                            "default ATTN_BACKEND or the PRESET's)")
    score.add_argument("--ttt", type=int, choices=(0, 1), default=None,
                       help="legal score-first TTT in place of the sliding pass (eval/ttt_modes.py;"
                            " default TTT_ENABLED or the PRESET's)")
    score.add_argument("--ttt-chunk-tokens", type=int, default=None, help="default TTT_CHUNK_TOKENS or the PRESET's")
    score.add_argument("--ttt-epochs", type=int, default=None, help="default TTT_EPOCHS or the PRESET's")
    score.add_argument("--ttt-lr", type=float, default=None, help="default TTT_LR or the PRESET's")
    score.add_argument("--ttt-momentum", type=float, default=None, help="default TTT_MOMENTUM or the PRESET's")
    score.add_argument("--ttt-grad-clip", type=float, default=None, help="default TTT_GRAD_CLIP or the PRESET's")
    score.add_argument("--ttt-batch-seqs", type=int, default=None, help="default TTT_BATCH_SEQS or the PRESET's")
    score.add_argument("--ttt-mode", choices=TTT_MODES, default=None,
                       help="chunked: train on each scored chunk; phased: train on every scored document between "
                            "phases; lora: per-document adapters (default TTT_MODE or the PRESET's)")
    score.add_argument("--ttt-phases", type=int, default=None, help="phases of --ttt-mode phased "
                       "(default TTT_PHASES or the PRESET's)")
    for flag, kind, what in (("rank", int, "adapter rank"), ("lr", float, "Adam lr"),
                             ("chunk-tokens", int, "targets scored per adapter step"),
                             ("batch-docs", int, "documents adapted side by side")):
        score.add_argument(f"--ttt-lora-{flag}", type=kind, default=None, help=f"--ttt-mode lora: {what} (default "
                           f"TTT_LORA_{flag.replace('-', '_').upper()} or the PRESET's)")
    score.add_argument("--ttt-params", default=None,
                       help="all | scalars | a regex of parameter names (default TTT_PARAMS or the PRESET's)")
    for f in mode_only_settings():  # a mode's own settings (e.g. phased_lora's): parsed with their domains
        score.add_argument("--" + f.name.replace("_", "-"), default=None,
                           help=f"default {f.name.upper()} or the PRESET's (read by its TTT mode only)")
    score.add_argument("--code", metavar="FILE", default=None,
                       help="the shipped train_gpt.py, for the bytes line (default: one beside the artifact, else "
                            "result.json's bytes_code)")
    score.set_defaults(func=cmd_score)
    count = sub.add_parser("bytes", help="count tokens and bytes of the val split")
    count.add_argument("--data-path", required=True)
    count.add_argument("--tokenizer", required=True)
    count.set_defaults(func=cmd_bytes)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_score_inputs(args)
        args.func(args)
    except NonFiniteScoreError as exc:  # the scoring ran and gave no number: exit 1, as the trainer's nonfinite_<phase>
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except USER_ERRORS as exc:
        return report_user_error(exc)
    except Exception as exc:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(exc, torch.OutOfMemoryError):
            raise
        print(f"error: CUDA out of memory: lower --batch-seqs (EVAL_BATCH_SEQS, now {args.batch_seqs})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(protect_console() or main())  # a closed or broken console ends the output, not the score
