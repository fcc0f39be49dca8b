"""Input checks before the clock starts, and the compliance flags of a finished run."""

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from eval.ttt import select_ttt_params
from trainer.context import BUNDLE_KIND, RunContext
from model.fused_loss import choose_loss_kernel
from model.gpt import GPT, build_model_config
from trainer.schedule import run_steps_estimate
from primitives.settings import Hyperparameters
from primitives.files import sha256_file
from shards.data_kind import caseops_signs
from shards.sidecar import require_val_bytes
from shards.format import (SHARD_HEADER_BYTES, list_shards, load_validation_tokens, read_shard_header, shards_unverified,
                           val_shard_copy, verify_dataset)


def max_shard_id(path, num_tokens: int) -> int:
    """The largest token id of a shard (-1 when empty): one vectorized max over a memory map, so a
    100M-token shard is read once, never held in memory (docs/reliability.md has its cost)."""
    return int(np.memmap(path, "<u2", "r", SHARD_HEADER_BYTES, (num_tokens,)).max()) if num_tokens else -1


def dataset_command(data_path) -> str | None:
    """The tools/prepare_data.py command that made the dataset (its manifest.json's source), if known."""
    try:
        return json.loads((Path(data_path) / "manifest.json").read_text(encoding="utf-8"))["source"]["command"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_train_tokens(hp: Hyperparameters, log=print) -> tuple:
    """(tokens in the train shards, tokens the run will read: EXPECTED_STEPS, or ITERATIONS without a
    wallclock cap, x TRAIN_BATCH_TOKENS; None in a record's packed file); logs a WARNING when the shards
    hold fewer, since the loader then repeats them (PR #1463: 1 shard 1.5070 vs 20 shards 1.2774 on the same
    budget); a note instead for the offline sample (tools/prepare_data.py sample), which is small by design. Raises
    ValueError naming DATA_PATH and the shard when any train shard holds an id >= VOCAB_SIZE or is a
    val shard (the same file, or a copy: same bytes): every shard is checked here, before the clock,
    not when the loader reaches it."""
    held = 0
    val_files = [p for p in list_shards(hp.data_path, "val") if read_shard_header(p)]
    for path in list_shards(hp.data_path, "train"):
        num_tokens = read_shard_header(path)
        same = val_shard_copy(path, val_files)
        if same:
            raise ValueError(f"DATA_PATH={hp.data_path!r}: train shard {path.name} is the val shard {same.name} (same "
                             "bytes); expected train shards disjoint from the val split")
        top_id = max_shard_id(path, num_tokens)
        if top_id >= hp.vocab_size:
            raise ValueError(f"DATA_PATH={hp.data_path!r}: train shard {path.name} holds token id {top_id}; expected ids "
                             f"< VOCAB_SIZE={hp.vocab_size}")
        held += num_tokens
    if BUNDLE_KIND == "package":  # the kit's advice on too few train tokens (a record's file does not carry it)
        return held, warn_repeated_data(hp, held, log)
    return held, None


def warn_repeated_data(hp: Hyperparameters, held: int, log=print) -> int:
    """check_train_tokens' advice when the train shards hold fewer than the `needed` tokens the run reads
    (returned); a note instead for the offline sample."""
    steps = run_steps_estimate(0, 0.0, hp)
    needed = int(steps * hp.train_batch_tokens)
    if held < needed and dataset_command(hp.data_path) == "sample":
        log(f"note: DATA_PATH={hp.data_path} is the offline sample ({held:,} train tokens); this run reads about "
            f"{needed:,} and repeats it, as expected: its scores only show that the pipeline works (real data: "
            f"docs/data.md)")
    elif held < needed:
        log(f"WARNING: the train shards of DATA_PATH={hp.data_path} hold {held:,} tokens; this run reads about "
            f"{needed:,} ({steps:.0f} steps x TRAIN_BATCH_TOKENS={hp.train_batch_tokens:,}) and will repeat data, "
            f"which costs bpb; `tools/prepare_data.py fineweb --train-shards {math.ceil(1.2 * needed / 1e8)}` "
            f"covers it with 20% margin (100M tokens per shard)")
    return needed


def check_inputs(hp: Hyperparameters, ctx: RunContext):
    """Everything that can be wrong with the input is checked here, before the clock starts."""
    import sentencepiece as spm

    if BUNDLE_KIND == "package":  # the kit's one lines for a wrong path or file (a record's file fails on them, a traceback)
        check_input_paths(hp)
        try:
            sp = spm.SentencePieceProcessor(model_file=hp.tokenizer_path)
        except (RuntimeError, OSError) as err:
            raise ValueError(f"TOKENIZER_PATH={hp.tokenizer_path!r}: not a SentencePiece model ({str(err).splitlines()[0]}); "
                             "expected a SentencePiece .model file") from None
    else:
        sp = spm.SentencePieceProcessor(model_file=hp.tokenizer_path)
    if sp.vocab_size() != hp.vocab_size:
        raise ValueError(f"VOCAB_SIZE={hp.vocab_size}: the tokenizer {hp.tokenizer_path} has {sp.vocab_size()} ids")
    inputs = run_inputs(hp)
    manifest = verify_dataset(hp.data_path, hp.tokenizer_path, hp.vocab_size, ctx.log)
    if hp.caseops_enabled:  # CaseOps data: scored on its byte sidecar (a resume keeps it), checked by shards/sidecar.py
        inputs["val_byte_count"] = require_val_bytes(hp.data_path, sp, hp.tokenizer_path,
                                                     inputs["tokenizer_sha256"])["val_byte_count"]
    elif why := caseops_signs(hp.data_path, sp, hp.tokenizer_path):  # scored on the tokenizer's bytes it would be wrong
        raise ValueError(f"DATA_PATH={hp.data_path!r}: CaseOps data ({why}); expected CASEOPS_ENABLED=1")
    if BUNDLE_KIND == "package":  # the kit's check before anything is written (a record's file: train() refuses it)
        hp.resolve_grad_accum(ctx.world_size, ctx.device.type == "cuda")
    if hp.loss_kernel == "liger":  # without CUDA or liger_kernel, or failing its check: refused here (auto is torch)
        choose_loss_kernel(hp.loss_kernel, ctx.device)
    if BUNDLE_KIND == "package":  # the kit's preflight: the TTT pass checks both itself (eval/ttt.py), after training
        if hp.ttt_enabled and hp.ttt_batch_seqs % ctx.world_size:
            raise ValueError(f"TTT_BATCH_SEQS={hp.ttt_batch_seqs}: expected a multiple of the world size {ctx.world_size} "
                             "(each rank trains on an equal share of a TTT batch)")
        if hp.ttt_enabled and hp.ttt_params not in ("all", "scalars"):
            with torch.device("meta"):  # the names only: nothing is allocated
                select_ttt_params(GPT(**build_model_config(hp)), hp.ttt_params)
    if BUNDLE_KIND == "package":  # room to keep the trained weights: the kit's recovery (trainer/interrupt.py)
        check_file_size_limit(hp)
    else:
        if hp.checkpoint_every or hp.resume or hp.save_prequant:  # kit/checkpoint.py's
            raise ValueError("CHECKPOINT_EVERY/RESUME/SAVE_PREQUANT: expected the kit's repo (not in this train_gpt.py)")
    check_train_tokens(hp, ctx.log)
    num_val = load_validation_tokens(hp.data_path, hp.vocab_size).numel()  # checks ids, then dropped
    if num_val <= hp.train_seq_len:
        raise ValueError(f"DATA_PATH={hp.data_path!r}: val split has {num_val} tokens, fewer than one "
                         f"sequence of TRAIN_SEQ_LEN={hp.train_seq_len} + 1")
    return sp, manifest, min(num_val, hp.val_max_tokens + 1) if hp.val_max_tokens else num_val, inputs


def check_input_paths(hp: Hyperparameters) -> None:
    """ValueError naming DATA_PATH or TOKENIZER_PATH when it is not a folder / a file."""
    for name, path, kind in (("DATA_PATH", hp.data_path, "a dataset folder (tools/prepare_data.py makes one)"),
                             ("TOKENIZER_PATH", hp.tokenizer_path, "a SentencePiece .model file")):
        exists = Path(path).is_dir() if name == "DATA_PATH" else Path(path).is_file()
        if not exists:
            what = "is a file" if name == "DATA_PATH" else "is a folder"
            what = what if Path(path).exists() else "no such file or folder"
            raise ValueError(f"{name}={path!r}: {what}; expected {kind}")


def check_file_size_limit(hp: Hyperparameters) -> None:
    """ValueError when the process's file-size limit (`ulimit -f`, RLIMIT_FSIZE) is below the bytes of
    the model's weights (float32 state dict, from the settings on the meta device: nothing
    allocated): the run could not keep its trained weights (trained.safetensors) when the export
    fails, so it would train for nothing."""
    import resource

    limit_bytes = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit_bytes == resource.RLIM_INFINITY:
        return
    with torch.device("meta"):
        weight_bytes = sum(4 * t.numel() for t in GPT(**build_model_config(hp)).state_dict().values())
    if limit_bytes < weight_bytes:
        raise ValueError(f"ulimit -f: files are limited to {limit_bytes:,} bytes; this run's trained weights take "
                         f"{weight_bytes:,} bytes (kept as trained.safetensors so that a failed export can be finished); "
                         "expected a larger file-size limit (ulimit -f unlimited)")


def run_inputs(hp: Hyperparameters) -> dict:
    """What the run's numbers are bound to besides its settings: the sha256 (hex) of TOKENIZER_PATH
    and of DATA_PATH/manifest.json (None without one)."""
    manifest = Path(hp.data_path) / "manifest.json"
    return dict(tokenizer_sha256=sha256_file(hp.tokenizer_path),
                manifest_sha256=sha256_file(manifest) if manifest.is_file() else None)


def check_compliance(summary: dict, data_path: str, manifest, train_files) -> dict:
    """One flag per rule of the challenge, computed from what the run measured (None: not checkable).

    train_time_ok: train_seconds <= 600 (the challenge's limit, whatever MAX_WALLCLOCK_SECONDS was);
    eval_time_ok: eval_seconds (artifact load + roundtrip + sliding) <= 600; bytes_ok: bytes_total
    (shipped code + artifact) <= 16,000,000 (the challenge's, whatever BYTE_BUDGET was; the export
    enforces BYTE_BUDGET itself); full_val_split: the score covered every token of the val shards
    (their headers' counts); val_not_seen_in_training: False when one of `train_files` (the shards
    the training loader opened) is a val shard: the same file (device and inode, so links count) as
    a fineweb_val_*.bin or, with a manifest, as a shard its val split lists; True only with a
    manifest whose document hashes prove the splits disjoint (`manifest` not None), else None:
    unverified (a val document inside a train shard cannot be seen without them), and the entry
    `unverified` says why; splits_disjoint: the manifest's train and val document hashes are
    disjoint (check_data_manifest), none of its train shards is a val shard and the loader opened
    only shards its train split lists (None without such a manifest). `unverified` also says when
    the manifest records no sha256 per shard (shards_unverified: their bytes were not checked).
    """
    ident = lambda p: os.stat(p)[1:3]  # (inode, device) of a path
    listed = lambda s: {ident(Path(data_path) / n) for n in manifest["splits"][s]["shards"]} if manifest else set()  # split s
    val_files, opened = list_shards(data_path, "val"), {ident(p) for p in train_files}
    val = {ident(p) for p in val_files} | listed("val")
    seen = not opened or bool(opened & val)
    flags = dict(
        train_time_ok=summary.get("train_seconds", math.inf) <= 600,
        eval_time_ok=summary.get("eval_seconds", math.inf) <= 600,
        bytes_ok=summary.get("bytes_total", math.inf) <= 16_000_000,
        full_val_split=summary.get("val_tokens") == sum(map(read_shard_header, val_files)),
        val_not_seen_in_training=False if seen else None if manifest is None else True,
        splits_disjoint=None if manifest is None else opened <= listed("train") and not listed("train") & val)
    if manifest is None and not seen:
        flags["unverified"] = (f"no manifest.json with the document hashes of both splits in DATA_PATH={data_path}: "
                               "val_not_seen_in_training and splits_disjoint not checked (no val shard file was read)")
    elif manifest is not None and (why := shards_unverified(data_path, manifest)):
        flags["unverified"] = why  # document hashes disjoint, but a shard changed after could not be seen
    return flags
