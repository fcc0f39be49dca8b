"""`python -m eval`: score an artifact from disk, or count the bytes of the val split.

  python -m eval score --artifact FILE --data-path DIR --tokenizer MODEL [--stride S] [--seq-len L] [--batch-seqs B]
      Rebuilds the model from the artifact alone (quant.artifact.load_artifact + train_gpt.GPT),
      runs the roundtrip and sliding evals and prints the official-style lines
      `final_roundtrip_exact val_loss:... val_bpb:...` and
      `final_sliding_window_exact val_loss:... val_bpb:... stride:S eval_time:Nms`.
      The artifact (format 3) says how to score it: the sequence length (the run's TRAIN_SEQ_LEN),
      the stride (its EVAL_STRIDE) and the vocabulary come from it, flags override. A tokenizer
      whose sha256 differs from the one the run trained with is refused (exit 2, both named)
      unless --allow-tokenizer-mismatch. A format-2 artifact records none of these: it needs
      --seq-len, and its tokenizer cannot be checked.
      Works under `torchrun --nproc_per_node=K` (nccl on CUDA, gloo on CPU).
  python -m eval bytes --data-path DIR --tokenizer MODEL
      Prints `val_tokens:N val_bytes:M tokens_per_byte:R` where N is the number of scored
      targets (all val tokens but the first) and M their byte count (official LUT rule).

Attention, autocast and compile follow the trainer: on CUDA FA3 -> FA2 -> SDPA (ATTN_BACKEND /
--attn-backend), bf16 autocast, torch.compile of the forward; on CPU SDPA in float32, eager.
Environment defaults (flags override): EVAL_STRIDE (64; the artifact's stride wins over it), EVAL_BATCH_SEQS (32),
EVAL_MAX_SECONDS (600, for loading + roundtrip + sliding together), EVAL_AUTO_STRIDE (0),
EVAL_COMPILE (1, CUDA only), VAL_MAX_TOKENS (0 = whole split).
With --ttt 1 (TTT_ENABLED) the sliding pass is score-first TTT (eval/ttt.py), printed as
`final_ttt_exact val_loss:... val_bpb:... eval_time:Nms`; TTT_CHUNK_TOKENS (32768), TTT_EPOCHS (3),
TTT_LR (0.002), TTT_MOMENTUM (0.9), TTT_GRAD_CLIP (1.0), TTT_BATCH_SEQS (32), TTT_PARAMS (all).
This module is CLI-only and is not bundled into train_gpt.py.
"""

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import sentencepiece as spm
import torch
import torch.distributed as dist

from eval.offline import count_stream_bytes, load_sentencepiece_luts
from eval.roundtrip import eval_roundtrip
from eval.sliding import eval_sliding
from eval.ttt import run_ttt, ttt_log_line


def _env_int(name: str, default: int, environ=None) -> int:
    value = (os.environ if environ is None else environ).get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _load_model(artifact_path, device: torch.device, log, attn_backend="auto"):
    from quant.artifact import load_artifact  # written concurrently; CLI-only imports
    from train_gpt import GPT, resolve_attention_backend

    log(f"attention:{resolve_attention_backend(attn_backend, device, log)}")  # the trainer's FA3 -> FA2 -> SDPA choice

    state_dict, model_config, meta = load_artifact(artifact_path)
    model = GPT(**model_config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    param_names = {name for name, _ in model.named_parameters()}
    missing_params = [k for k in missing if k in param_names]
    if missing_params or unexpected:
        raise ValueError(f"artifact {artifact_path}: missing parameters {missing_params}, unexpected tensors {list(unexpected)}")
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
        stride = _env_int("EVAL_STRIDE", 64, environ)
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


def cmd_score(args) -> None:
    t_start = time.perf_counter()
    from eval.shards import check_data_manifest, load_validation_tokens

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
        model, model_config, meta = _load_model(args.artifact, device, log, args.attn_backend)
        vocab_size = int(model_config["vocab_size"])
        seq_len, stride = resolve_score_settings(args, model_config, meta, log=log)
        luts = load_sentencepiece_luts(args.tokenizer, vocab_size)
        check_data_manifest(args.data_path, vocab_size=vocab_size, log=log)
        val_tokens = load_validation_tokens(args.data_path, vocab_size=vocab_size)
        if args.val_max_tokens:  # same truncation as the trainer's VAL_MAX_TOKENS (not for records)
            val_tokens = val_tokens[: args.val_max_tokens + 1]
        autocast_dtype = torch.bfloat16 if device.type == "cuda" and args.autocast == "bf16" else None
        common = dict(batch_seqs=args.batch_seqs, device=device, rank=rank, world_size=world_size,
                      autocast_dtype=autocast_dtype, compile_model=bool(args.compile) and device.type == "cuda")
        val_loss, val_bpb = eval_roundtrip(model, val_tokens, luts, seq_len=seq_len, **common)
        log(f"final_roundtrip_exact val_loss:{val_loss:.8f} val_bpb:{val_bpb:.8f}")
        if stride > 0 and args.ttt:  # score-first TTT: its scoring pass is the sliding pass (eval/ttt.py)
            result = run_ttt(model, val_tokens, luts, seq_len=seq_len, stride=stride, chunk_tokens=args.ttt_chunk_tokens,
                             epochs=args.ttt_epochs, lr=args.ttt_lr, momentum=args.ttt_momentum, params=args.ttt_params,
                             batch_seqs=args.ttt_batch_seqs, eval_batch_seqs=args.batch_seqs, grad_clip=args.ttt_grad_clip,
                             max_seconds=max(args.max_seconds - (time.perf_counter() - t_start), 1e-9), log=log,
                             **{k: v for k, v in common.items() if k != "batch_seqs"})
            log(ttt_log_line(result) + f" stride:{stride} chunks:{result['num_chunks']} updates:{result['num_updates']}")
        elif stride > 0:
            # loading and the roundtrip count against the same EVAL_MAX_SECONDS; when they used it all,
            # the guard still projects and says so (a budget <= 0 would be refused as a bad input)
            budget_seconds = max(args.max_seconds - (time.perf_counter() - t_start), 1e-9)
            result = eval_sliding(model, val_tokens, luts, seq_len=seq_len, stride=stride, max_seconds=budget_seconds,
                                  auto_stride=bool(args.auto_stride), log=log, **common)
            log(
                f"final_sliding_window_exact val_loss:{result['val_loss']:.8f} val_bpb:{result['val_bpb']:.8f} "
                f"stride:{result['stride']} eval_time:{1000 * result['eval_seconds']:.0f}ms"
            )
        log(f"eval_total_time:{1000 * (time.perf_counter() - t_start):.0f}ms seq_len:{seq_len} val_tokens:{val_tokens.numel()}")
    finally:
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def cmd_bytes(args) -> None:
    from eval.shards import load_validation_tokens

    sp = spm.SentencePieceProcessor(model_file=str(args.tokenizer))
    vocab_size = int(sp.vocab_size())
    luts = load_sentencepiece_luts(args.tokenizer, vocab_size)
    tokens = load_validation_tokens(args.data_path, vocab_size=vocab_size)
    num_targets = tokens.numel() - 1
    num_bytes = count_stream_bytes(tokens, luts)
    print(f"val_tokens:{num_targets} val_bytes:{num_bytes} tokens_per_byte:{num_targets / max(num_bytes, 1):.8f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    score.add_argument("--batch-seqs", type=int, default=_env_int("EVAL_BATCH_SEQS", 32))
    score.add_argument("--max-seconds", type=float, default=float(os.environ.get("EVAL_MAX_SECONDS", "600")))
    score.add_argument("--auto-stride", type=int, choices=(0, 1), default=_env_int("EVAL_AUTO_STRIDE", 0))
    score.add_argument("--compile", type=int, choices=(0, 1), default=_env_int("EVAL_COMPILE", 1), help="torch.compile the forward (CUDA only)")
    score.add_argument("--val-max-tokens", type=int, default=_env_int("VAL_MAX_TOKENS", 0),
                       help="score only the first N+1 val tokens, as the trainer's VAL_MAX_TOKENS (0 = all; records need all)")
    score.add_argument("--autocast", choices=("bf16", "none"), default="bf16", help="autocast dtype on CUDA")
    score.add_argument("--attn-backend", choices=("auto", "fa3", "fa2", "sdpa"), default=os.environ.get("ATTN_BACKEND", "auto"),
                       help="attention kernel on CUDA, chosen as the trainer does (auto: FA3 -> FA2 -> SDPA)")
    env = os.environ.get
    score.add_argument("--ttt", type=int, choices=(0, 1), default=_env_int("TTT_ENABLED", 0),
                       help="legal score-first TTT in place of the sliding pass (eval/ttt.py)")
    score.add_argument("--ttt-chunk-tokens", type=int, default=_env_int("TTT_CHUNK_TOKENS", 32768))
    score.add_argument("--ttt-epochs", type=int, default=_env_int("TTT_EPOCHS", 3))
    score.add_argument("--ttt-lr", type=float, default=float(env("TTT_LR", "0.002")))
    score.add_argument("--ttt-momentum", type=float, default=float(env("TTT_MOMENTUM", "0.9")))
    score.add_argument("--ttt-grad-clip", type=float, default=float(env("TTT_GRAD_CLIP", "1.0")))
    score.add_argument("--ttt-batch-seqs", type=int, default=_env_int("TTT_BATCH_SEQS", 32))
    score.add_argument("--ttt-params", default=env("TTT_PARAMS", "all"), help="all | scalars | a regex of parameter names")
    score.set_defaults(func=cmd_score)
    count = sub.add_parser("bytes", help="count tokens and bytes of the val split")
    count.add_argument("--data-path", required=True)
    count.add_argument("--tokenizer", required=True)
    count.set_defaults(func=cmd_bytes)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        print(f"error: CUDA out of memory: lower --batch-seqs (EVAL_BATCH_SEQS, now {args.batch_seqs})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
