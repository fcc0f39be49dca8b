"""Every bad input a user can give the kit's CLIs: exit 2, ONE line on stderr naming the input, no traceback.

The rule (primitives/cli_errors.py): a user's mistake is `error: <input>: <what is wrong>; expected <what>`
on one line and exit 2; only a bug of the kit shows a traceback. Each row of CASES is run as a
subprocess, as a user would run it, in a fresh folder of its own (`{d}` in its command), and checked
for the exit code, the one line (a regex naming the input), no "Traceback", and, where it matters,
what is on disk afterwards (nothing already written lost, nothing half-written).

Add a row to extend it (the trainer's rows go in the same list). Most rows fail before torch is
imported (a fraction of a second each); all run in parallel once per session (`outcomes`).
The bad-input table of docs/reliability.md is rendered from these rows:

    python tests/test_bad_inputs.py --write     # re-run every case, rewrite the table in docs/reliability.md
"""

import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
PY = "python"  # shown in the table; the tests run sys.executable
TABLE_START, TABLE_END = "<!-- bad-inputs:start -->", "<!-- bad-inputs:end -->"
TABLE_PAGE = REPO / "docs" / "reliability.md"  # the page that holds the table
# settings of the caller's shell that would change what a case sees
# (and every trainer setting: the trainer's cases set what they need)
TRAINER_SETTINGS = {"PRESET", "RESUME", "RUN_ID", "OUT_DIR", "DATA_PATH", "TOKENIZER_PATH", "VOCAB_SIZE", "SEED",
                    "ITERATIONS", "MAX_WALLCLOCK_SECONDS", "TRAIN_BATCH_TOKENS", "TRAIN_SEQ_LEN", "NUM_THREADS",
                    "CHECKPOINT_EVERY"}
SCRUBBED_ENV_PREFIXES = ("EVAL_", "QUANT_", "TTT_", "VAL_MAX_TOKENS", "ATTN_BACKEND", "LOSS_KERNEL", "BYTE_BUDGET", "MATCHED_FINEWEB_")


@dataclasses.dataclass(frozen=True)
class BadInput:
    """One bad input. argv: the command after `python`, with {d} (the case's own folder), {tok} (a
    1024-piece SentencePiece model) and {data} (a small challenge dataset) filled in. message: a
    regex the single stderr line must match (re.search). setup(d): writes the case's input files.
    after(d): asserts what is on disk afterwards. file_limit_bytes: the largest file the command may
    write (`ulimit -f`), to run out of room mid-write."""

    cli: str
    what: str
    argv: tuple
    message: str
    env: dict = dataclasses.field(default_factory=dict)
    setup: Callable = None
    after: Callable = None
    exit_code: int = 2
    file_limit_bytes: int = None  # RLIMIT_FSIZE of the process (`ulimit -f`): a disk that fills up mid-write

    @property
    def id(self) -> str:
        return f"{self.cli}: {self.what}"


# ----------------------------------------------------------------------------- input files


def write(name: str, data) -> Callable:
    """setup: file `name` in the case folder with `data` (str or bytes)."""
    def setup(d: Path):
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
    return setup


def both(*setups) -> Callable:
    def setup(d: Path):
        for s in setups:
            s(d)
    return setup


def docs_jsonl(num_docs: int) -> str:
    return "".join(json.dumps({"text": f"document {i}: some words about the number {i}."}) + "\n" for i in range(num_docs))


def truncated_gz(d: Path):
    full = gzip.compress(docs_jsonl(3000).encode())
    (d / "docs.jsonl.gz").write_bytes(full[: len(full) // 2])


def absent(name: str) -> Callable:
    def after(d: Path):
        assert not (d / name).exists(), f"{name} was written"
    return after


def only(files: dict) -> Callable:
    """after: the case folder holds exactly these files (relative path -> text, or None for any content):
    nothing lost, nothing half-written, no temporary files."""
    def after(d: Path):
        found = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}
        assert found == set(files), f"files after the case: {sorted(found)}"
        for name, text in files.items():
            assert text is None or (d / name).read_text() == text, f"{name} was changed"
    return after


def unchanged(name: str, data: str) -> Callable:
    def after(d: Path):
        assert (d / name).read_text() == data, f"{name} was changed"
    return after


KEEP = "a dataset already there\n"
GARBAGE_PTZ = b"PK\x03\x04 this is a zip file, not an artifact" * 4
BYTES = ("-m", "eval", "bytes", "--data-path", "{d}/data", "--tokenizer", "{tok}")
SCORE = ("-m", "eval", "score", "--artifact", "{d}/final_model.ptz", "--data-path", "{data}", "--tokenizer", "{tok}")
WITH_PTZ = write("final_model.ptz", GARBAGE_PTZ)  # torch-free checks stop before the artifact is read
JSONL = ("tools/prepare_data.py", "jsonl", "--input", "{d}/docs.jsonl", "--tokenizer", "{tok}", "--out", "{d}/out",
         "--val-docs", "1")
SWEEP = ("tools/sweep.py", "--file", "{d}/sweep.yaml", "--dry-run")


def sweep_file(text: str, name: str = "sweep.yaml") -> Callable:
    return write(name, text)


def eval_rows() -> list:
    e = "eval"
    return [
        BadInput(e, "--artifact is a run folder", ("-m", "eval", "score", "--artifact", "{d}/run", "--data-path", "{data}",
                 "--tokenizer", "{tok}"), r"--artifact \S+/run: is a folder; expected an artifact file \(did you mean "
                 r"\S+/run/final_model.ptz\?\)", setup=write("run/final_model.ptz", GARBAGE_PTZ)),
        BadInput(e, "--artifact is an empty folder", ("-m", "eval", "score", "--artifact", "{d}", "--data-path", "{data}",
                 "--tokenizer", "{tok}"), r"--artifact \S+: is a folder; expected an artifact file \(\.ptz\)"),
        BadInput(e, "--artifact missing", SCORE, r"--artifact \S+/final_model.ptz: no such file; expected an artifact"),
        BadInput(e, "--artifact empty file", SCORE, r"--artifact \S+/final_model.ptz: is empty \(0 bytes\)",
                 setup=write("final_model.ptz", b"")),
        BadInput(e, "--artifact not an artifact (zip bytes)", SCORE, r"\S+/final_model.ptz: starts b'PK", setup=WITH_PTZ),
        BadInput(e, "--data-path missing", SCORE[:6] + ("{d}/nodata",) + SCORE[7:],
                 r"--data-path \S+/nodata: no such folder; expected a dataset folder", setup=WITH_PTZ),
        BadInput(e, "--data-path is a file", SCORE[:6] + ("{d}/final_model.ptz",) + SCORE[7:],
                 r"--data-path \S+: is a file, not a folder", setup=WITH_PTZ),
        BadInput(e, "--data-path without val shards", SCORE[:6] + ("{d}",) + SCORE[7:],
                 r"--data-path \S+: no fineweb_val_\*\.bin; expected a dataset folder", setup=WITH_PTZ),
        BadInput(e, "--tokenizer missing", SCORE[:8] + ("{d}/none.model",),
                 r"--tokenizer \S+/none.model: no such file; expected a SentencePiece \.model", setup=WITH_PTZ),
        BadInput(e, "--tokenizer not a SentencePiece model", SCORE[:8] + ("{d}/final_model.ptz",),
                 r"--tokenizer \S+: not a SentencePiece model \(.*\); expected a SentencePiece \.model", setup=WITH_PTZ),
        BadInput(e, "--tokenizer is a folder", SCORE[:8] + ("{d}",), r"--tokenizer \S+: is a folder", setup=WITH_PTZ),
        BadInput(e, "--stride -5", SCORE + ("--stride", "-5"), r"--stride=-5: expected 0 \(no sliding eval\) or a stride",
                 setup=WITH_PTZ),
        BadInput(e, "--stride abc", SCORE + ("--stride", "abc"), r"argument --stride: invalid int value: 'abc'"),
        BadInput(e, "--seq-len -1", SCORE + ("--seq-len", "-1"), r"--seq-len=-1: expected an integer >= 1", setup=WITH_PTZ),
        BadInput(e, "--batch-seqs 0", SCORE + ("--batch-seqs", "0"), r"--batch-seqs=0: expected an integer >= 1",
                 setup=WITH_PTZ),
        BadInput(e, "--code missing", SCORE + ("--code", "{d}/train_gpt.py"),
                 r"--code \S+/train_gpt.py: no such file; expected the shipped train_gpt.py", setup=WITH_PTZ),
        BadInput(e, "--max-seconds 0", SCORE + ("--max-seconds", "0"), r"--max-seconds=0.0: expected a finite number > 0",
                 setup=WITH_PTZ),
        BadInput(e, "--val-max-tokens 1", SCORE + ("--val-max-tokens", "1"), r"--val-max-tokens 1 \(VAL_MAX_TOKENS\): "
                 r"expected 0", setup=WITH_PTZ),
        BadInput(e, "EVAL_BATCH_SEQS=abc", SCORE, r"EVAL_BATCH_SEQS='abc': expected an integer >= 1",
                 env={"EVAL_BATCH_SEQS": "abc"}, setup=WITH_PTZ),
        BadInput(e, "EVAL_BATCH_SEQS=0", SCORE, r"EVAL_BATCH_SEQS='0': expected an integer >= 1",
                 env={"EVAL_BATCH_SEQS": "0"}, setup=WITH_PTZ),
        BadInput(e, "EVAL_MAX_SECONDS=ten", SCORE, r"EVAL_MAX_SECONDS='ten': expected a finite number > 0",
                 env={"EVAL_MAX_SECONDS": "ten"}, setup=WITH_PTZ),
        BadInput(e, "EVAL_MAX_SECONDS=inf", SCORE, r"EVAL_MAX_SECONDS='inf': expected a finite number > 0",
                 env={"EVAL_MAX_SECONDS": "inf"}, setup=WITH_PTZ),
        BadInput(e, "EVAL_MAX_SECONDS=-1", SCORE, r"EVAL_MAX_SECONDS='-1': expected a finite number > 0",
                 env={"EVAL_MAX_SECONDS": "-1"}, setup=WITH_PTZ),
        BadInput(e, "EVAL_AUTO_STRIDE=2", SCORE, r"EVAL_AUTO_STRIDE='2': expected one of 0, 1",
                 env={"EVAL_AUTO_STRIDE": "2"}, setup=WITH_PTZ),
        BadInput(e, "EVAL_COMPILE=yes", SCORE, r"EVAL_COMPILE='yes': expected one of 0, 1",
                 env={"EVAL_COMPILE": "yes"}, setup=WITH_PTZ),
        BadInput(e, "EVAL_STRIDE=abc", SCORE, r"EVAL_STRIDE='abc': expected an integer >= 0",
                 env={"EVAL_STRIDE": "abc"}, setup=WITH_PTZ),
        BadInput(e, "VAL_MAX_TOKENS=-3", SCORE, r"VAL_MAX_TOKENS='-3': expected an integer >= 0",
                 env={"VAL_MAX_TOKENS": "-3"}, setup=WITH_PTZ),
        BadInput(e, "ATTN_BACKEND=flash", SCORE, r"ATTN_BACKEND='flash': expected one of auto, fa3, fa4, fa2, sdpa",
                 env={"ATTN_BACKEND": "flash"}, setup=WITH_PTZ),
        BadInput(e, "LOSS_KERNEL=fused", SCORE, r"LOSS_KERNEL='fused': expected one of auto, liger, torch$",
                 env={"LOSS_KERNEL": "fused"}, setup=WITH_PTZ),
        BadInput(e, "score without --artifact", ("-m", "eval", "score", "--data-path", "{data}", "--tokenizer", "{tok}"),
                 r"the following arguments are required: --artifact"),
        BadInput(e, "unknown command", ("-m", "eval", "scroe"), r"argument command: invalid choice: 'scroe'"),
        BadInput(e, "bytes: --tokenizer not a SentencePiece model", ("-m", "eval", "bytes", "--data-path", "{data}",
                 "--tokenizer", "{d}/t.model"), r"--tokenizer \S+/t.model: not a SentencePiece model",
                 setup=write("t.model", "not a model")),
        BadInput(e, "bytes: val token id >= the vocab", ("-m", "eval", "bytes", "--data-path", "{d}", "--tokenizer",
                 "{tok}"), r"val shards in DATA_PATH=\S+: max id 5000; expected tokens, ids < VOCAB_SIZE=1024",
                 setup=lambda d: shard_with_id(d, 5000)),
        BadInput(e, "bytes: --tokenizer not the tokenizer of the data's manifest", BYTES, r"TOKENIZER_PATH='\S+': sha256 "
                 r"[0-9a-f]{16}\.\.\. is not the tokenizer_sha256 0{16}\.\.\. of \S+/data/manifest.json",
                 setup=both(small_dataset(), small_manifest("0" * 64, hashed=True))),
        BadInput(e, "bytes: a val shard the manifest does not list", BYTES, r"DATA_PATH=\S+/data: fineweb_val_000001.bin "
                 r"is not a val shard of \S+/data/manifest.json \(1 unlisted\); expected only the shards the manifest lists",
                 setup=both(small_dataset(), small_manifest(hashed=True), extra_val_shard)),
        BadInput(e, "bytes: a val shard whose bytes are not the manifest's sha256", BYTES, r"DATA_PATH=\S+/data: val shard "
                 r"fineweb_val_000000.bin has sha256 [0-9a-f]{16}\.\.\., not the [0-9a-f]{16}\.\.\. manifest.json records",
                 setup=both(small_dataset(), small_manifest(hashed=True), changed_shard("fineweb_val_000000.bin"))),
        BadInput(e, "--ttt-params not a regular expression", SCORE + ("--ttt", "1", "--ttt-params", "blocks.("),
                 r"--ttt-params 'blocks\.\(' \(TTT_PARAMS\): expected all, scalars or a regular expression",
                 setup=WITH_PTZ),
        BadInput(e, "TTT_PARAMS=[ (not a regular expression)", SCORE + ("--ttt", "1"),
                 r"--ttt-params '\[' \(TTT_PARAMS\): expected all, scalars or a regular expression",
                 env={"TTT_PARAMS": "["}, setup=WITH_PTZ),
        BadInput(e, "artifact with malformed TTT settings", SCORE + ("--ttt", "1", "--allow-tokenizer-mismatch"),
                 r"artifact \S+/final_model.ptz: malformed TTT settings \{.*'epochs': 'three'",
                 setup=lambda d: artifact_with_ttt(d, dict(enabled=1, epochs="three"))),
        BadInput(e, "--ttt-phases 0", SCORE + ("--ttt", "1", "--ttt-mode", "phased", "--ttt-phases", "0"),
                 r"--ttt-phases=0: expected an integer >= 1", setup=WITH_PTZ),
        BadInput(e, "TTT_MODE=adapter (not a TTT mode)", SCORE + ("--ttt", "1"),
                 r"TTT_MODE='adapter': expected one of chunked, phased, lora", env={"TTT_MODE": "adapter"}, setup=WITH_PTZ),
        BadInput(e, "--ttt-lora-rank 0", SCORE + ("--ttt", "1", "--ttt-mode", "lora", "--ttt-lora-rank", "0"),
                 r"--ttt-lora-rank=0: expected an integer >= 1", setup=WITH_PTZ),
        BadInput(e, "--ttt-lora-batch-docs 0", SCORE + ("--ttt", "1", "--ttt-mode", "lora", "--ttt-lora-batch-docs", "0"),
                 r"--ttt-lora-batch-docs=0: expected an integer >= 1", setup=WITH_PTZ),
        BadInput(e, "--ttt-lora-alpha 0 (a mode's own setting)",
                 SCORE + ("--ttt", "1", "--ttt-mode", "phased_lora", "--ttt-lora-alpha", "0"),
                 r"TTT_LORA_ALPHA=0.0: expected a finite number > 0", setup=WITH_PTZ),
    ]


def artifact_with_ttt(d: Path, ttt: dict) -> None:
    """A tiny model's artifact (vocab 1024) whose run metadata holds `ttt` as its TTT settings."""
    import torch

    from quant.artifact import export_artifact
    from model.gpt import GPT, build_model_config
    from primitives.settings import Hyperparameters

    config = build_model_config(Hyperparameters(vocab_size=1024, num_layers=1, model_dim=32, num_heads=2, num_kv_heads=1,
                                                rope_dims=8, xsa_last_n=0))
    torch.manual_seed(0)
    state = GPT(**config).state_dict()
    run = dict(train_seq_len=64, vocab_size=1024, eval_stride=32, tokenizer_sha256="0" * 64, ttt=ttt)
    export_artifact(state, config, d / "final_model.ptz", code_bytes=0, log=lambda msg: None, run=run)


def shard_with_id(d: Path, token_id: int) -> None:
    from shards.format import write_data_shard

    write_data_shard(d / "fineweb_val_000000.bin", [1, 5, token_id, 7])


def quant_rows() -> list:
    q, est = "quant", ("-m", "quant", "estimate", "--shapes", "{d}/shapes.json", "--code-bytes", "1000")
    shapes = write("shapes.json", json.dumps({"w": [64, 64]}))
    return [
        BadInput(q, "inspect a folder", ("-m", "quant", "inspect", "{d}"), r"inspect FILE \S+: is a folder; expected an "
                 r"artifact file"),
        BadInput(q, "inspect a missing file", ("-m", "quant", "inspect", "{d}/x.ptz"),
                 r"inspect FILE \S+/x.ptz: no such file"),
        BadInput(q, "inspect an empty file", ("-m", "quant", "inspect", "{d}/x.ptz"), r"inspect FILE \S+/x.ptz: is empty",
                 setup=write("x.ptz", b"")),
        BadInput(q, "inspect a damaged artifact", ("-m", "quant", "inspect", "{d}/x.ptz"), r"\S+/x.ptz: starts b'PK",
                 setup=write("x.ptz", GARBAGE_PTZ)),
        BadInput(q, "inspect without FILE", ("-m", "quant", "inspect"), r"the following arguments are required: file"),
        BadInput(q, "--shapes missing", est, r"--shapes \S+/shapes.json: no such file"),
        BadInput(q, "--shapes not JSON", est, r"--shapes \S+/shapes.json: not JSON \(Expecting value",
                 setup=write("shapes.json", "w: [64, 64]")),
        BadInput(q, "--shapes a JSON list", est, r"--shapes \S+/shapes.json: a JSON list; expected an object",
                 setup=write("shapes.json", "[[64, 64]]")),
        BadInput(q, "--code-bytes -3", est[:-1] + ("-3",), r"--code-bytes=-3: expected an integer >= 0", setup=shapes),
        BadInput(q, "--byte-budget 0", est + ("--byte-budget", "0"), r"--byte-budget=0: expected an integer >= 1",
                 setup=shapes),
        BadInput(q, "QUANT_ATTN_BITS=abc", est, r"QUANT_ATTN_BITS='abc': expected a whole number", env={"QUANT_ATTN_BITS": "abc"},
                 setup=shapes),
        BadInput(q, "QUANT_MLP_BITS=12", est, r"QUANT_MLP_BITS='12': ", env={"QUANT_MLP_BITS": "12"}, setup=shapes),
        BadInput(q, "QUANT_FIT=2", est, r"QUANT_FIT='2': expected 0/1/true/false", env={"QUANT_FIT": "2"}, setup=shapes),
        BadInput(q, "QUANT_COMPRESSOR=gzip", est, r"QUANT_COMPRESSOR='gzip': ", env={"QUANT_COMPRESSOR": "gzip"},
                 setup=shapes),
        BadInput(q, "QUANT_SDCLIP_K_MLP=-1", est, r"QUANT_SDCLIP_K_MLP='-1': sdclip_k_mlp=-1.0: expected a number in "
                 r"\[0, 1000\] \(0: the clip search\)", env={"QUANT_SDCLIP_K_MLP": "-1"}, setup=shapes),
        BadInput(q, "QUANT_LQER_RANK=0", est, r"QUANT_LQER_RANK='0': lqer_rank=0 / lqer_top_n=3: expected 1\.\.64",
                 env={"QUANT_LQER_RANK": "0"}, setup=shapes),
    ]


def prepare_rows() -> list:
    p, jsonl = "prepare_data", write("docs.jsonl", docs_jsonl(5))
    keep = both(write("out/manifest.json", KEEP))
    return [
        BadInput(p, "jsonl --input missing", JSONL, r"--input \S+/docs.jsonl: no such file; expected a \.jsonl or \.txt"),
        BadInput(p, "jsonl --input is a folder", JSONL[:3] + ("{d}",) + JSONL[4:], r"--input \S+: is a folder"),
        BadInput(p, "jsonl --input .csv", JSONL[:3] + ("{d}/docs.csv",) + JSONL[4:], r"input \S+/docs.csv: unsupported "
                 r"file type '.csv'", setup=write("docs.csv", "text\nhello\n")),
        BadInput(p, "truncated .jsonl.gz", JSONL[:3] + ("{d}/docs.jsonl.gz",) + JSONL[4:], r"\S+/docs.jsonl.gz: damaged "
                 r"or truncated gzip file after line \d+ \(Compressed file ended", setup=truncated_gz, after=absent("out")),
        BadInput(p, "not UTF-8 on line 1", JSONL, r"\S+/docs.jsonl:1: not UTF-8 text \(invalid start byte at byte 0",
                 setup=write("docs.jsonl", b"\xff" + docs_jsonl(3).encode()), after=absent("out")),
        BadInput(p, "not UTF-8 on line 3", JSONL, r"\S+/docs.jsonl:3: not UTF-8 text",
                 setup=write("docs.jsonl", docs_jsonl(2).encode() + b'{"text": "caf\xe9"}\n' + docs_jsonl(2).encode())),
        BadInput(p, "invalid JSON on line 2", JSONL, r"\S+/docs.jsonl:2: invalid JSON",
                 setup=write("docs.jsonl", docs_jsonl(1) + "{text: 1}\n")),
        BadInput(p, 'a line without "text"', JSONL, r'\S+/docs.jsonl:1: expected a JSON object with a string "text"',
                 setup=write("docs.jsonl", '{"body": "x"}\n')),
        BadInput(p, "no documents", JSONL, r"input holds no documents", setup=write("docs.jsonl", "\n\n")),
        BadInput(p, "--tokenizer missing", JSONL[:5] + ("{d}/none.model",) + JSONL[6:], r"tokenizer model \S+/none.model "
                 r"does not exist", setup=jsonl),
        BadInput(p, "--tokenizer not a SentencePiece model", JSONL[:5] + ("{d}/docs.jsonl",) + JSONL[6:],
                 r"tokenizer \S+/docs.jsonl: not a SentencePiece model", setup=jsonl),
        BadInput(p, "--val-docs 0", JSONL[:-1] + ("0",), r"--val-docs must be positive, got 0", setup=jsonl),
        BadInput(p, "--val-docs >= documents", JSONL[:-1] + ("5",), r"--val-docs 5 must be smaller than the number of "
                 r"documents \(5\)", setup=jsonl, after=absent("out")),
        BadInput(p, "--val-docs abc", JSONL[:-1] + ("abc",), r"argument --val-docs: invalid int value: 'abc'"),
        BadInput(p, "--shard-tokens 0", JSONL + ("--shard-tokens", "0"), r"--shard-tokens must be positive, got 0",
                 setup=jsonl),
        BadInput(p, "--out is a file", JSONL[:7] + ("{d}/docs.jsonl",) + JSONL[8:], r"--out \S+/docs.jsonl: is a file; "
                 r"expected a dataset folder", setup=jsonl, after=unchanged("docs.jsonl", docs_jsonl(5))),
        BadInput(p, "bad input over an existing dataset", JSONL, r"\S+/docs.jsonl:2: invalid JSON",
                 setup=both(keep, write("docs.jsonl", docs_jsonl(1) + "{\n")), after=unchanged("out/manifest.json", KEEP)),
        BadInput(p, "disk full while replacing a dataset", JSONL[:-1] + ("2", "--shard-tokens", "600"),
                 r"\S+/out: File too large.*; the previous files there are unchanged, temporary files removed",
                 setup=both(keep, write("docs.jsonl", docs_jsonl(60))), file_limit_bytes=2048,
                 after=only({"docs.jsonl": None, "out/manifest.json": KEEP})),
        BadInput(p, "disk full while writing a new dataset", JSONL[:-1] + ("2", "--shard-tokens", "600"),
                 r"\S+/out: File too large.*; nothing was written, temporary files removed",
                 setup=write("docs.jsonl", docs_jsonl(60)), file_limit_bytes=2048, after=only({"docs.jsonl": None})),
        BadInput(p, "tokenizer --vocab-size 5", ("tools/prepare_data.py", "tokenizer", "--input", "{d}/docs.jsonl",
                 "--vocab-size", "5", "--out", "{d}/tok"), r"--vocab-size must be in \[8, 65536\], got 5", setup=jsonl,
                 after=absent("tok.model")),
        BadInput(p, "sample --vocab-size 70000", ("tools/prepare_data.py", "sample", "--out", "{d}/data", "--vocab-size",
                 "70000"), r"--vocab-size must be in \[8, 65536\], got 70000", after=absent("data")),
        BadInput(p, "sample --val-docs 0", ("tools/prepare_data.py", "sample", "--out", "{d}/data", "--val-docs", "0"),
                 r"--val-docs must be in \[1, \d+\] for the sample, got 0", after=absent("data")),
        BadInput(p, "fineweb --variant sp99x", ("tools/prepare_data.py", "fineweb", "--variant", "sp99x", "--out-root",
                 "{d}"), r"sp99x"),
        BadInput(p, "fineweb --repo-id without owner", ("tools/prepare_data.py", "fineweb", "--repo-id", "parameter-golf",
                 "--out-root", "{d}"), r"parameter-golf"),
        BadInput(p, "fineweb --train-shards -1", ("tools/prepare_data.py", "fineweb", "--train-shards", "-1", "--out-root",
                 "{d}"), r"--train-shards must be >= 0, got -1"),
        BadInput(p, "unknown command", ("tools/prepare_data.py", "download"),
                 r"argument command: invalid choice: 'download'"),
    ]


def sweep_rows() -> list:
    s = "sweep"
    return [
        BadInput(s, "config name defined twice (YAML)", SWEEP, r"--file \S+/sweep.yaml: 'base' is defined twice \(lines 3 "
                 r"and 5\); expected each name once", setup=sweep_file("name: ab\nconfigs:\n  base: {MLP_MULT: 2}\n  low: "
                                                                        "{MATRIX_LR: 0.02}\n  base: {MLP_MULT: 3}\n")),
        BadInput(s, "top-level key twice (YAML)", SWEEP, r"'seeds' is defined twice \(lines 2 and 3\)",
                 setup=sweep_file("name: ab\nseeds: [1]\nseeds: [2]\n")),
        BadInput(s, "env var twice in a config (YAML)", SWEEP, r"'MLP_MULT' is defined twice \(lines 3 and 3\)",
                 setup=sweep_file("name: ab\nconfigs:\n  base: {MLP_MULT: 2, MLP_MULT: 3}\n")),
        BadInput(s, "config name defined twice (JSON)", ("tools/sweep.py", "--file", "{d}/sweep.json", "--dry-run"),
                 r"--file \S+/sweep.json: 'a' is defined twice; expected each name once",
                 setup=sweep_file('{"name": "ab", "configs": {"a": {}, "a": {"MLP_MULT": 3}}}', "sweep.json")),
        BadInput(s, "broken YAML", SWEEP, r"--file \S+/sweep.yaml: not valid YAML \(expected ',' or '\]', but got ':' at "
                 r"line 2, column 4\)", setup=sweep_file("name: [a\n  b: c\n")),
        BadInput(s, "a list at the top level", SWEEP, r"expected a mapping at the top level",
                 setup=sweep_file("- a\n- b\n")),
        BadInput(s, "unknown key", SWEEP, r"unknown keys \['config'\]", setup=sweep_file("name: ab\nconfig: {}\n")),
        BadInput(s, "seeds not integers", SWEEP, r"seeds \['a'\]: expected a list of integers",
                 setup=sweep_file("name: ab\nseeds: [a]\n")),
        BadInput(s, "a seed twice", SWEEP, r"seeds \[1, 1\]: a seed is listed twice",
                 setup=sweep_file("name: ab\nseeds: [1, 1]\n")),
        BadInput(s, "an empty seed list", SWEEP, r"--file \S+/sweep.yaml: seeds \[\]: expected a non-empty list of "
                 r"integer seeds", setup=sweep_file("name: ab\nseeds: []\n")),
        BadInput(s, "seeds: 0", SWEEP, r"--file \S+/sweep.yaml: seeds 0: expected a non-empty list of integer seeds",
                 setup=sweep_file("name: ab\nseeds: 0\n")),
        BadInput(s, "lower-case env var", SWEEP, r"configs.a: 'mlp_mult' is not an upper-case env var name",
                 setup=sweep_file("name: ab\nconfigs:\n  a: {mlp_mult: 2}\n")),
        BadInput(s, "a reserved variable", SWEEP, r"config 'a': \['SEED'\] are set by the sweep",
                 setup=sweep_file("name: ab\nconfigs:\n  a: {SEED: 2}\n")),
        BadInput(s, "a bad metric", SWEEP, r"metric 'bpb': expected one of sliding, roundtrip, prequant",
                 setup=sweep_file("name: ab\nmetric: bpb\n")),
        BadInput(s, "a name with a slash", SWEEP, r"name 'a/b': expected letters, digits", setup=sweep_file("name: a/b\n")),
        BadInput(s, "baseline not a config", SWEEP, r"baseline 'c': not a config of this sweep",
                 setup=sweep_file("name: ab\nbaseline: c\n")),
        BadInput(s, "--file missing", SWEEP, r"--file \S+/sweep.yaml: No such file or directory"),
        BadInput(s, "--config defined twice", ("tools/sweep.py", "--name", "x", "--config", "a", "--config", "a",
                 "--dry-run"), r"--config a: defined twice"),
        BadInput(s, "--set without =", ("tools/sweep.py", "--name", "x", "--set", "MLP_MULT", "--dry-run"),
                 r"--set: 'MLP_MULT': expected NAME=VALUE"),
        BadInput(s, "--script missing", ("tools/sweep.py", "--name", "x", "--script", "{d}/t.py", "--dry-run"),
                 r"--script \S+/t.py: no such file"),
        BadInput(s, "no name", ("tools/sweep.py", "--dry-run"), r"--name: a sweep needs a name"),
    ]


TRAIN = ("train_gpt.py",)
RUN_LOG = "a finished run's log\n"


def train_env(**bad) -> dict:
    """The trainer's environment for a case: the smoke preset on the small dataset, runs under {d}/runs."""
    return {"PRESET": "smoke", "DATA_PATH": "{data}", "TOKENIZER_PATH": "{tok}", "OUT_DIR": "{d}/runs", "RUN_ID": "r",
            **{k: str(v) for k, v in bad.items()}}


def small_dataset(bad_train_id: int = None) -> Callable:
    """setup: a dataset folder {d}/data, one val shard and three train shards (the third holding
    `bad_train_id` as its last token when given); no manifest."""
    def setup(d: Path):
        from shards.format import write_data_shard

        (d / "data").mkdir()
        ids = np.arange(600, dtype=np.uint16) % 1000 + 1
        write_data_shard(d / "data" / "fineweb_val_000000.bin", ids)
        for i in range(3):
            last = [bad_train_id] if i == 2 and bad_train_id is not None else [1]
            write_data_shard(d / "data" / f"fineweb_train_{i:06d}.bin", np.concatenate([ids, last]))
    return setup


def finished_run(d: Path) -> None:
    write("runs/r/train.log", RUN_LOG)(d)
    write("runs/r/result.json", '{"status": "ok"}\n')(d)


HELD_LOCKS = []  # lock files held by this process while a case runs (a trainer of the same RUN_ID)


def running_run(d: Path) -> None:
    """setup: runs/r locked by a live process (this one), as a running trainer holds it."""
    import fcntl

    (d / "runs" / "r").mkdir(parents=True)
    lock = open(d / "runs" / "r" / "run.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock.write(f"pid {os.getpid()} on testhost since 2026-01-01T00:00:00Z\n")
    lock.flush()
    HELD_LOCKS.append(lock)


def replace_shard(name: str, how: str) -> Callable:
    """setup: in {d}/data, shard `name` replaced by a folder, a dangling symlink or a copy of the val shard."""
    def setup(d: Path):
        import shutil

        path = d / "data" / name
        path.unlink()
        if how == "folder":
            path.mkdir()
        elif how == "dangling":
            os.symlink("missing.bin", path)
        else:
            shutil.copyfile(d / "data" / "fineweb_val_000000.bin", path)
    return setup


def small_manifest(tokenizer_sha256: str = None, train_tokens: int = 1803, hashed: bool = False) -> Callable:
    """setup: a manifest.json for small_dataset (no document hashes), with these tokenizer sha256 and train
    count, and (hashed) the sha256 of each shard as tools/prepare_data.py records them."""
    def setup(d: Path):
        from primitives.files import sha256_file

        splits = dict(val=dict(shards=["fineweb_val_000000.bin"], num_tokens=600),
                      train=dict(shards=[f"fineweb_train_{i:06d}.bin" for i in range(3)], num_tokens=train_tokens))
        for info in splits.values() if hashed else ():
            info["shard_sha256"] = [sha256_file(d / "data" / name) for name in info["shards"]]
        manifest = dict(format="parameter-golf-shards", vocab_size=1024, tokenizer="other_1024.model", splits=splits)
        if tokenizer_sha256:
            manifest["tokenizer_sha256"] = tokenizer_sha256
        (d / "data" / "manifest.json").write_text(json.dumps(manifest))
    return setup


def extra_val_shard(d: Path) -> None:
    """setup: a second val shard in {d}/data that no manifest lists."""
    from shards.format import write_data_shard

    write_data_shard(d / "data" / "fineweb_val_000001.bin", np.arange(300, dtype=np.uint16) + 1)


def changed_shard(name: str) -> Callable:
    """setup: shard `name` of {d}/data rewritten with other tokens and the same header count (the
    val tokens of fineweb_val_000000.bin, reversed, as if val text were written into it)."""
    def setup(d: Path):
        from shards.format import load_data_shard, read_shard_header, write_data_shard

        count = read_shard_header(d / "data" / name)
        val = load_data_shard(d / "data" / "fineweb_val_000000.bin").numpy()[::-1]
        write_data_shard(d / "data" / name, np.resize(val, count))
    return setup


def no_tilde_folder(d: Path) -> None:
    assert not (REPO / "~nosuchuser_pg").exists() and not (d / "~nosuchuser_pg").exists(), "a literal ~ folder was made"


FSIZE_LIMITED = ("-c", "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
                 "sys.argv = ['train_gpt.py']; runpy.run_path('train_gpt.py', run_name='__main__')")


def train_rows() -> list:
    t, nothing = "train", absent("runs")
    return [
        BadInput(t, "RUN_ID of 300 characters", TRAIN, r"RUN_ID='r{300}': expected a folder name of at most 200 bytes",
                 env=train_env(RUN_ID="r" * 300), after=nothing),
        BadInput(t, "OUT_DIR is a symlink loop", TRAIN, r"OUT_DIR='\S+/loop': \S+/loop: Too many levels of symbolic links; "
                 r"expected a folder for the run folders", env=train_env(OUT_DIR="{d}/loop"),
                 setup=lambda d: os.symlink("loop", d / "loop")),
        BadInput(t, "OUT_DIR='~nosuchuser/runs' (~ that cannot be expanded)", TRAIN, r"OUT_DIR='~nosuchuser_pg/runs': '~' "
                 r"cannot be expanded here \(no such user, or HOME unset\); expected a path",
                 env=train_env(OUT_DIR="~nosuchuser_pg/runs"), after=no_tilde_folder),
        BadInput(t, "a folder named like a train shard", TRAIN, r"DATA_PATH=\S+/data: fineweb_train_000001.bin is a folder; "
                 r"expected a shard file", env=train_env(DATA_PATH="{d}/data"),
                 setup=both(small_dataset(), replace_shard("fineweb_train_000001.bin", "folder")), after=nothing),
        BadInput(t, "a dangling symlink as a train shard", TRAIN, r"DATA_PATH=\S+/data: fineweb_train_000001.bin is a "
                 r"dangling symlink \(to missing.bin\); expected a shard file", env=train_env(DATA_PATH="{d}/data"),
                 setup=both(small_dataset(), replace_shard("fineweb_train_000001.bin", "dangling")), after=nothing),
        BadInput(t, "a val shard copied over a train shard (no manifest)", TRAIN, r"DATA_PATH='\S+/data': train shard "
                 r"fineweb_train_000001.bin is the val shard fineweb_val_000000.bin \(same bytes\); expected train shards "
                 r"disjoint from the val split", env=train_env(DATA_PATH="{d}/data"),
                 setup=both(small_dataset(), replace_shard("fineweb_train_000001.bin", "copy")), after=nothing),
        BadInput(t, "a train shard whose count is not the manifest's", TRAIN, r"manifest \S+/data/manifest.json: the train "
                 r"shards hold 1,803 tokens; the manifest says 1,802: a shard was replaced or changed",
                 env=train_env(DATA_PATH="{d}/data"), setup=both(small_dataset(), small_manifest(train_tokens=1802)),
                 after=nothing),
        BadInput(t, "TOKENIZER_PATH not the tokenizer of the data's manifest", TRAIN, r"TOKENIZER_PATH='\S+': sha256 "
                 r"[0-9a-f]{16}\.\.\. is not the tokenizer_sha256 0{16}\.\.\. of \S+/data/manifest.json; expected the "
                 r"tokenizer the data was made with \(other_1024.model\)", env=train_env(DATA_PATH="{d}/data"),
                 setup=both(small_dataset(), small_manifest("0" * 64)), after=nothing),
        BadInput(t, "a val shard the data's manifest does not list", TRAIN, r"DATA_PATH=\S+/data: fineweb_val_000001.bin "
                 r"is not a val shard of \S+/data/manifest.json", env=train_env(DATA_PATH="{d}/data"),
                 setup=both(small_dataset(), small_manifest(hashed=True), extra_val_shard), after=nothing),
        BadInput(t, "val tokens written into a train shard, its header count kept", TRAIN, r"DATA_PATH=\S+/data: train "
                 r"shard fineweb_train_000001.bin has sha256 [0-9a-f]{16}\.\.\., not the [0-9a-f]{16}\.\.\. manifest.json "
                 r"records; expected the shard as the dataset was made", env=train_env(DATA_PATH="{d}/data"),
                 setup=both(small_dataset(), small_manifest(hashed=True), changed_shard("fineweb_train_000001.bin")),
                 after=nothing),
        BadInput(t, "RUN_ID of a trainer still running", TRAIN, r"RUN_ID='r': \S+/runs/r is being written by another run "
                 r"\(pid \d+ on testhost since 2026-01-01T00:00:00Z\); expected a RUN_ID no running process uses",
                 env=train_env(), setup=running_run, after=absent("runs/r/train.log")),
        BadInput(t, "RESUME=1 on a run that finished", TRAIN, r"RESUME=True: \S+/runs/r holds a run that finished "
                 r"\(result.json status ok\); nothing to resume", env=train_env(RESUME=1, MAX_WALLCLOCK_SECONDS=0),
                 setup=both(finished_run, write("runs/r/checkpoint.pt", b"ckpt")),
                 after=unchanged("runs/r/result.json", '{"status": "ok"}\n')),
        BadInput(t, "a file-size limit (ulimit -f) below the run's files", FSIZE_LIMITED, r"ulimit -f: files are limited "
                 r"to 20,000 bytes; this run's trained weights take [\d,]+ bytes \(kept as trained.safetensors",
                 env=train_env(), after=nothing),
        BadInput(t, "ITERATIONS=inf", TRAIN, r"ITERATIONS='inf': expected a whole number", env=train_env(ITERATIONS="inf"),
                 after=nothing),
        BadInput(t, "ITERATIONS=1e400", TRAIN, r"ITERATIONS='1e400': expected a whole number",
                 env=train_env(ITERATIONS="1e400"), after=nothing),
        BadInput(t, "MAX_WALLCLOCK_SECONDS=1e308", TRAIN, r"MAX_WALLCLOCK_SECONDS=1e\+308: expected a finite number in \[0, 1e\+07\] \(seconds, 0: no cap\)",
                 env=train_env(MAX_WALLCLOCK_SECONDS="1e308"), after=nothing),
        BadInput(t, "EVAL_MAX_SECONDS=1e308", TRAIN, r"EVAL_MAX_SECONDS=1e\+308: expected a finite number in \[0, 1e\+07\] \(seconds\)$",
                 env=train_env(EVAL_MAX_SECONDS="1e308"), after=nothing),
        BadInput(t, "VAL_MAX_TOKENS=10", TRAIN, r"VAL_MAX_TOKENS=10: expected 0 \(the whole val split\) or >= "
                 r"TRAIN_SEQ_LEN=256 \(one sequence\)", env=train_env(VAL_MAX_TOKENS=10), after=nothing),
        BadInput(t, "SEED=1e30", TRAIN, r"SEED=\d+: expected a whole number in \[0, 18446744073709551615\]", env=train_env(SEED="1e30"), after=nothing),
        BadInput(t, "NUM_THREADS=1e9", TRAIN, r"NUM_THREADS=1000000000: expected a whole number in \[0, 4096\]", env=train_env(NUM_THREADS="1e9")),
        BadInput(t, "ATTN_BACKEND=fa4 without CUDA", TRAIN, r"ATTN_BACKEND='fa4': flash-attn needs CUDA, this run is on cpu",
                 env=train_env(ATTN_BACKEND="fa4")),
        BadInput(t, "OUT_DIR is a file", TRAIN, r"OUT_DIR='\S+/runs': is a file; expected a folder for the run folders",
                 env=train_env(), setup=write("runs", "a file\n"), after=unchanged("runs", "a file\n")),
        BadInput(t, "OUT_DIR inside a file", TRAIN, r"OUT_DIR='\S+/f/runs': \S+/f is a file; expected a folder",
                 env=train_env(OUT_DIR="{d}/f/runs"), setup=write("f", "a file\n")),
        BadInput(t, "RUN_ID is a file", TRAIN, r"RUN_ID='r': \S+/runs/r is a file; expected a run folder", env=train_env(),
                 setup=write("runs/r", "x")),
        BadInput(t, "RUN_ID of a finished run (with a bad DATA_PATH)", TRAIN, r"RUN_ID='r': \S+/runs/r holds a finished "
                 r"run \(result.json\); expected a new RUN_ID \(or RESUME=1", env=train_env(DATA_PATH="{d}/none"),
                 setup=finished_run, after=unchanged("runs/r/train.log", RUN_LOG)),
        BadInput(t, "RESUME=1 with nothing to resume", TRAIN, r"RESUME=True: \S+/runs/r has no trained.safetensors or "
                 r"checkpoint.pt; expected the folder of an interrupted run", env=train_env(RESUME=1), after=nothing),
        BadInput(t, "RESUME=1 in training with a wallclock cap", TRAIN, r"RESUME=True: resuming inside training: expected "
                 r"MAX_WALLCLOCK_SECONDS=0", env=train_env(RESUME=1), setup=write("runs/r/checkpoint.pt", b"ckpt"),
                 after=absent("runs/r/train.log")),
        BadInput(t, "DATA_PATH missing", TRAIN, r"DATA_PATH='\S+/none': no such file or folder; expected a dataset folder",
                 env=train_env(DATA_PATH="{d}/none"), after=nothing),
        BadInput(t, "DATA_PATH is a file", TRAIN, r"DATA_PATH='\S+/f': is a file; expected a dataset folder",
                 env=train_env(DATA_PATH="{d}/f"), setup=write("f", "x"), after=nothing),
        BadInput(t, "DATA_PATH without train shards", TRAIN, r"DATA_PATH=\S+/data: no fineweb_train_\*\.bin",
                 env=train_env(DATA_PATH="{d}/data"), setup=lambda d: (small_dataset()(d), *map(Path.unlink, (
                     d / "data").glob("fineweb_train_*"))), after=nothing),
        BadInput(t, "token id >= VOCAB_SIZE in the third train shard", TRAIN, r"DATA_PATH='\S+/data': train shard "
                 r"fineweb_train_000002.bin holds token id 5000; expected ids < VOCAB_SIZE=1024",
                 env=train_env(DATA_PATH="{d}/data"), setup=small_dataset(5000), after=nothing),
        BadInput(t, "TOKENIZER_PATH not a SentencePiece model", TRAIN, r"TOKENIZER_PATH='\S+/tok.model': not a "
                 r"SentencePiece model \(.*\); expected a SentencePiece \.model file",
                 env=train_env(TOKENIZER_PATH="{d}/tok.model"), setup=write("tok.model", "not a model\n"), after=nothing),
        BadInput(t, "TOKENIZER_PATH is a folder", TRAIN, r"TOKENIZER_PATH='\S+': is a folder; expected a SentencePiece",
                 env=train_env(TOKENIZER_PATH="{d}"), after=nothing),
        BadInput(t, "VOCAB_SIZE=2048 with a 1024-id tokenizer", TRAIN, r"VOCAB_SIZE=2048: the tokenizer \S+ has 1024 ids",
                 env=train_env(VOCAB_SIZE=2048), after=nothing),
        BadInput(t, "TRAIN_BATCH_TOKENS=1000", TRAIN, r"TRAIN_BATCH_TOKENS=1000: expected a multiple of",
                 env=train_env(TRAIN_BATCH_TOKENS=1000), after=nothing),
        BadInput(t, "RUN_ID=a/b", TRAIN, r"RUN_ID='a/b': expected a folder name", env=train_env(RUN_ID="a/b"),
                 after=nothing),
        BadInput(t, "TTT_CHUNK_TOKENS=100", TRAIN, r"TTT_CHUNK_TOKENS=100: expected >= TRAIN_SEQ_LEN=256",
                 env=train_env(TTT_ENABLED=1, TTT_CHUNK_TOKENS=100), after=nothing),
        BadInput(t, "TTT_PARAMS not a regular expression", TRAIN, r"TTT_PARAMS='blocks\.\[': expected all, scalars or a "
                 r"regular expression", env=train_env(TTT_ENABLED=1, TTT_PARAMS="blocks.["), after=nothing),
        BadInput(t, "TTT_MODE=adapter (not a TTT mode)", TRAIN, r"TTT_MODE='adapter': expected one of chunked, phased, lora",
                 env=train_env(TTT_ENABLED=1, TTT_MODE="adapter"), after=nothing),
        BadInput(t, "TTT_LORA_CHUNK_TOKENS=512", TRAIN, r"TTT_LORA_CHUNK_TOKENS=512: expected <= TRAIN_SEQ_LEN=256 "
                 r"\(TTT_MODE=lora\)", env=train_env(TTT_ENABLED=1, TTT_MODE="lora", TTT_LORA_CHUNK_TOKENS=512),
                 after=nothing),
        BadInput(t, "TTT_LORA_BATCH_DOCS=0", TRAIN, r"TTT_LORA_BATCH_DOCS=0: expected a whole number >= 1",
                 env=train_env(TTT_ENABLED=1, TTT_MODE="lora", TTT_LORA_BATCH_DOCS=0), after=nothing),
        BadInput(t, "TTT_PHASES=0", TRAIN, r"TTT_PHASES=0: expected a whole number >= 1",
                 env=train_env(TTT_ENABLED=1, TTT_MODE="phased", TTT_PHASES=0), after=nothing),
        BadInput(t, "TTT_PARAMS matching no parameter", TRAIN, r"TTT_PARAMS='lora' matches no parameter",
                 env=train_env(TTT_ENABLED=1, TTT_PARAMS="lora"), after=nothing),
        BadInput(t, "MUON_NS_COEFFS=cubic", TRAIN, r"MUON_NS_COEFFS='cubic': expected one of jordan, polar_express",
                 env=train_env(MUON_NS_COEFFS="cubic"), after=nothing),
        BadInput(t, "MIN_LR=2", TRAIN, r"MIN_LR=2.0: expected a finite number in \[0, 1\] \(a fraction of the peak LR\)", env=train_env(MIN_LR=2),
                 after=nothing),
        BadInput(t, "NUM_LOOPS=1 LOOP_END=9 with 4 layers", TRAIN, r"LOOP_END=9: expected LOOP_START=3\.\.NUM_LAYERS-1=3 "
                 r"\(NUM_LOOPS=1\)", env=train_env(NUM_LOOPS=1, LOOP_END=9), after=nothing),
        BadInput(t, "LOGIT_SOFTCAP=0 (every logit 0)", TRAIN, r"LOGIT_SOFTCAP=0.0: expected a finite number > 0$",
                 env=train_env(LOGIT_SOFTCAP=0), after=nothing),
        BadInput(t, "BETA2=1 (Adam)", TRAIN, r"BETA2=1.0: expected a finite number in \[0, 1\)$", env=train_env(BETA2=1),
                 after=nothing),
        BadInput(t, "OUT_DIR= (empty)", TRAIN, r"OUT_DIR='': expected a non-empty path$", env=train_env(OUT_DIR="")),
        BadInput(t, "NUM_LOOPS=1 ENABLE_LOOPING_AT=1 (a loop that never trains)", TRAIN, r"ENABLE_LOOPING_AT=1.0: "
                 r"expected a start inside the run: < 1 \(NUM_LOOPS=1\)$",
                 env=train_env(NUM_LOOPS=1, LOOP_START=1, LOOP_END=2, ENABLE_LOOPING_AT=1), after=nothing),
        BadInput(t, "WD_TAPER_START_FRAC=1 with WD_TAPER_FINAL_MULT=0.5", TRAIN, r"WD_TAPER_START_FRAC=1.0: expected < 1, "
                 r"a taper that starts inside the run", env=train_env(WD_TAPER_FINAL_MULT=0.5, WD_TAPER_START_FRAC=1),
                 after=nothing),
        BadInput(t, "BYTE_BUDGET below the code's own bytes", TRAIN, r"BYTE_BUDGET=1000: expected more than the shipped "
                 r"train_gpt.py's \d+ bytes", env=train_env(BYTE_BUDGET=1000), after=nothing),
        BadInput(t, "three bad settings at once", TRAIN, r"^error: LOGIT_SOFTCAP=-1.0: expected a finite number > 0; "
                 r"BETA1=1.5: expected a finite number in \[0, 1\); MATRIX_LR='x': expected a number$",
                 env=train_env(LOGIT_SOFTCAP=-1, BETA1=1.5, MATRIX_LR="x"), after=nothing),
        BadInput(t, "PRESET=2xh100", TRAIN, r"PRESET='2xh100': expected one of", env=train_env(PRESET="2xh100"),
                 after=nothing),
        BadInput(t, "LOSS_KERNEL=fused", TRAIN, r"LOSS_KERNEL='fused': expected one of auto, liger, torch$",
                 env=train_env(LOSS_KERNEL="fused"), after=nothing),
        BadInput(t, "LOSS_KERNEL=liger without CUDA", TRAIN, r"LOSS_KERNEL='liger': Liger-Kernel needs CUDA, this run is "
                 r"on cpu; expected LOSS_KERNEL=auto or torch$", env=train_env(LOSS_KERNEL="liger"), after=nothing),
    ]


def seed_run(name: str, seed: int, bpb: float, **hyperparameters) -> Callable:
    """setup: a finished run folder `name` (result.json + train.log) with one sliding score."""
    loss = bpb * 0.6931471805599453 / 0.41  # tokens per byte 0.41
    hp = {"seed": seed, "run_id": name, "iterations": 20000, **hyperparameters}
    return both(write(f"{name}/train.log", f"code\n{'=' * 100}\nSEED:{seed}\nfinal_sliding_window_exact "
                                          f"val_loss:{loss:.8f} val_bpb:{bpb:.8f} stride:64 eval_time:1ms\n"),
                write(f"{name}/result.json", json.dumps({"seed": seed, "val_bpb_sliding": bpb, "val_loss_sliding": loss,
                                                         "tokens_per_byte": 0.41, "hyperparameters": hp})))


SEED_RUNS = both(seed_run("a", 1, 1.1000), seed_run("b", 2, 1.1020), seed_run("c", 3, 1.1010))
SIG = ("tools/significance.py", "--runs", "{d}/a", "{d}/b", "{d}/c", "--baseline-bpb")
GPU_CHECK = ("tools/gpu_check.py", "--cpu-twin")


def tool_rows() -> list:
    g, m, sig = "gpu_check", "make_record", "significance"
    return [
        BadInput(sig, "the same run three times", ("tools/significance.py", "--runs", "{d}/a", "{d}/a", "{d}/a",
                 "--baseline-bpb", "1.12"), r"--runs: run \S+/a is given twice; expected each run once", setup=SEED_RUNS),
        BadInput(sig, "a run in both groups", ("tools/significance.py", "--runs", "{d}/a", "{d}/b", "--baseline-runs",
                 "{d}/c", "{d}/a/result.json"), r"--baseline-runs: run \S+/a/result.json is given in both --runs and "
                 r"--baseline-runs", setup=SEED_RUNS),
        BadInput(sig, "a seed twice", SIG[:5] + ("{d}/d", "--baseline-bpb", "1.12"), r"--runs: seed 3 of \S+/d repeats "
                 r"\S+/c; expected one run per seed", setup=both(SEED_RUNS, seed_run("d", 3, 1.1005))),
        BadInput(sig, "seeds from runs with different settings", SIG[:5] + ("{d}/d", "--baseline-bpb", "1.12"),
                 r"--runs: run \S+/d: configuration differs from run \S+/a beyond the seed: hyperparameters "
                 r"ITERATIONS=5 vs 20000", setup=both(SEED_RUNS, seed_run("d", 4, 1.1005, iterations=5))),
        BadInput(sig, "--baseline-bpb -1.2", SIG + ("-1.2",), r"--baseline-bpb=-1.2: expected a finite number > 0",
                 setup=SEED_RUNS),
        BadInput(sig, "--baseline-bpb nan", SIG + ("nan",), r"--baseline-bpb=nan: expected a finite number > 0",
                 setup=SEED_RUNS),
        BadInput(m, "--date 2026-13-45", ("tools/make_record.py", "--runs", "{d}/a", "--name", "x", "--author", "A",
                 "--github-id", "a", "--date", "2026-13-45", "--records-dir", "{d}/records"), r"--date '2026-13-45': not a "
                 r"calendar date \(month must be in 1\.\.12\); expected YYYY-MM-DD", setup=seed_run("a", 1, 1.1),
                 after=absent("records")),
        BadInput(g, "--cpu-twin --preset-size beyond the machine's memory", GPU_CHECK + ("--preset-size",),
                 r"--cpu-twin --preset-size: PRESET=1xh100-sp8192's shape \(.*\) needs about [\d.]+ GiB, this machine "
                 r"has [\d.]+ GiB available; expected a shape that fits: `python tools/gpu_check.py --cpu-twin`"),
        BadInput(g, "--cpu-twin with a token id >= VOCAB_SIZE in a train shard", GPU_CHECK, r"DATA_PATH='\S+/data': "
                 r"train shard fineweb_train_000002.bin holds token id 5000; expected ids < VOCAB_SIZE=1024",
                 env=train_env(DATA_PATH="{d}/data"), setup=small_dataset(5000), after=absent("runs")),
    ]


CASES = eval_rows() + quant_rows() + prepare_rows() + sweep_rows() + train_rows() + tool_rows()


# ----------------------------------------------------------------------------- running


def command(case: BadInput, values: dict) -> list:
    return [a.format(**values) for a in case.argv]


def run_case(case: BadInput, case_dir: Path, values: dict) -> subprocess.CompletedProcess:
    case_dir.mkdir(parents=True, exist_ok=True)
    if case.setup:
        case.setup(case_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_ENV_PREFIXES) and k not in TRAINER_SETTINGS}
    values = dict(values, d=str(case_dir))
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **{k: v.format(**values) for k, v in case.env.items()})
    limit = None
    if case.file_limit_bytes is not None:
        import resource

        def limit():  # in the child: a write past the limit fails with EFBIG (Python ignores SIGXFSZ)
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.file_limit_bytes, case.file_limit_bytes))
    return subprocess.run([sys.executable, *command(case, values)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, preexec_fn=limit)


def run_all(root: Path, values: dict, workers: int = 3) -> dict:
    """id -> (CompletedProcess, case folder) for every case, `workers` at a time."""
    dirs = {case.id: root / f"case{i:03d}" for i, case in enumerate(CASES)}
    with ThreadPoolExecutor(workers) as pool:
        futures = {case.id: pool.submit(run_case, case, dirs[case.id], values) for case in CASES}
        return {k: (f.result(), dirs[k]) for k, f in futures.items()}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, sp1024_model, tiny_dataset):
    return run_all(tmp_path_factory.mktemp("bad_inputs"), {"tok": str(sp1024_model), "data": str(tiny_dataset)})


def test_case_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)) and len(CASES) >= 45


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_bad_input_is_one_line_and_exit_2(case, outcomes):
    proc, case_dir = outcomes[case.id]
    where = f"{case.id}\nexit {proc.returncode}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, where
    assert proc.returncode == case.exit_code, where
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), where
    assert re.search(case.message, lines[0]), where
    if case.after:
        case.after(case_dir)


def test_docs_table_lists_every_case():
    """docs/reliability.md's table is rendered from CASES (`python tests/test_bad_inputs.py --write`);
    the README links to it and holds no copy."""
    text = TABLE_PAGE.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text
    table = text[text.index(TABLE_START):text.index(TABLE_END)]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| CLI")]
    assert len(rows) == len(CASES), "re-render: python tests/test_bad_inputs.py --write"
    assert [line.split(" | ")[1] for line in rows] == [case.what.replace("|", "/") for case in CASES]
    assert TABLE_START not in (REPO / "README.md").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- the docs table


def render_table(results: dict, values: dict) -> str:
    """Markdown table of CASES: CLI, input, command, exit code, message (paths shortened)."""
    def short(text: str, case_dir: Path) -> str:
        for path, name in ((str(case_dir), "DIR"), (values["tok"], "TOK.model"), (values["data"], "DATA")):
            text = text.replace(path, name)
        return text.replace("|", "\\|")

    lines = [TABLE_START, "", f"{len(CASES)} bad inputs, each run by tests/test_bad_inputs.py:", "",
             "| CLI | bad input | command | exit | message (stderr, one line) |", "|---|---|---|---|---|"]
    for case in CASES:
        proc, case_dir = results[case.id]
        env = " ".join(f"{k}={v.format(**dict(values, d=str(case_dir)))}" for k, v in case.env.items())
        ulimit = f"ulimit -f {case.file_limit_bytes // 1024};" if case.file_limit_bytes is not None else ""
        cmd = short(" ".join(filter(None, [ulimit, env, PY, *command(case, dict(values, d=str(case_dir)))])), case_dir)
        message = short(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "(none)", case_dir)
        lines.append(f"| {case.cli} | {case.what.replace('|', '/')} | `{cmd}` | {proc.returncode} | `{message}` |")
    return "\n".join(lines + ["", TABLE_END])


def write_table(page: Path) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        values = table_inputs(tmp)
        table = render_table(run_all(tmp / "cases", values), values)
    text = page.read_text(encoding="utf-8")
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    page.write_text(text[:start] + table + text[end:], encoding="utf-8")
    print(f"wrote {len(CASES)} rows into {page}")


def table_inputs(tmp: Path) -> dict:
    """The tokenizer and small dataset the cases use, built as the test fixtures build them."""
    sys.path.insert(0, str(REPO))
    from tools.data.data_sample import build_sample

    result = build_sample(tmp / "sample", progress=False, log=lambda msg: None)
    return {"tok": str(result["tokenizer_path"]), "data": str(result["data_path"])}


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"] or len(sys.argv) > 3:
        sys.exit("usage: python tests/test_bad_inputs.py --write [PAGE]   (default: docs/reliability.md)")
    write_table(Path(sys.argv[2]) if len(sys.argv) == 3 else TABLE_PAGE)
