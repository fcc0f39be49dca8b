"""Smoke-run a record folder's packed train_gpt.py from inside the folder (tools/make_record.py).

Nothing else on sys.path: 2 CPU steps, the export and the final evals on the first
SMOKE_VAL_MAX_TOKENS val tokens. A check that the shipped file runs and evaluates, never a score.
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kit.bundle import BUNDLE_PACKED_NAME
from tools.record.record_checks import resolve_run_path
from tools.record.runs import RecordError, Run, parse_train_log

SMOKE_RUN_ID = "record_smoke"
SMOKE_VAL_MAX_TOKENS = 4096  # the smoke run evaluates on this many val tokens: proves the eval runs, scores nothing
SMOKE_MIN_TIMEOUT_SECONDS = 600  # the default limit is never below this
SMOKE_TIMEOUT_MARGIN = 2.0  # x the runs' own measured train + export + eval seconds
SMOKE_OUTPUT_PREFIX = "  smoke| "


def runs_measured_seconds(runs: list) -> float:
    """The longest train + export + eval seconds any of the runs measured (result.json)."""
    longest = 0.0
    for run in runs:
        r = run.result
        total = sum(float(r.get(k) or 0.0) for k in ("train_seconds", "export_seconds", "eval_seconds"))
        longest = max(longest, total if math.isfinite(total) else 0.0)
    return longest


def default_smoke_timeout_seconds(runs: list) -> float:
    """The smoke run's default limit (seconds): SMOKE_TIMEOUT_MARGIN x runs_measured_seconds (the
    smoke run trains 2 steps of a smaller model, then exports and evaluates as the runs did, on the
    same machine), at least SMOKE_MIN_TIMEOUT_SECONDS."""
    return max(float(SMOKE_MIN_TIMEOUT_SECONDS), math.ceil(SMOKE_TIMEOUT_MARGIN * runs_measured_seconds(runs)))


def _run_live(cmd, *, cwd, env, timeout_seconds: float, echo) -> tuple:
    """Run `cmd`, passing each line of its stdout+stderr to `echo` as it comes; (returncode, last
    lines). Kills it after `timeout_seconds` and raises subprocess.TimeoutExpired with the last lines
    as its `output`."""
    tail = collections.deque(maxlen=80)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            echo(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
        raise subprocess.TimeoutExpired(cmd, timeout_seconds, output="\n".join(tail)) from None
    reader.join(timeout=5)
    return proc.returncode, "\n".join(tail)


def _echo(line: str) -> None:
    print(f"{SMOKE_OUTPUT_PREFIX}{line}", file=sys.stderr, flush=True)


def smoke_run(folder: Path, run: Run, log=print, timeout_seconds: float = SMOKE_MIN_TIMEOUT_SECONDS,
              echo=_echo, runs_seconds: float | None = None) -> dict:
    """Run the packed train_gpt.py from inside `folder`, with no PYTHONPATH (only the file itself can
    provide the code): 2 CPU-sized steps (PRESET=smoke), the export, then the final evals on the first
    SMOKE_VAL_MAX_TOKENS val tokens (a smoke check that the shipped file evaluates, not a score).
    Checks that it exits 0, logs its own size as code_bytes, the 2 steps and every final line (the
    sliding pass: no TTT_* or QUANT_* variable of the shell reaches it, nor any of the run's settings).
    Its output is shown live (`echo`, to stderr); after `timeout_seconds` it is stopped and the
    RecordError says what to do (`runs_seconds`: the runs' own measured seconds, for that message).
    Leaves the folder as it was; returns {"code_bytes", "train", "final"} from its log."""
    before = sorted(p.name for p in folder.iterdir())
    packed_bytes = (folder / BUNDLE_PACKED_NAME).stat().st_size
    hp = run.result["hyperparameters"]
    with tempfile.TemporaryDirectory(prefix="record_smoke_") as out_dir:
        env = {k: v for k, v in os.environ.items()
               if k != "PYTHONPATH" and not k.startswith(("QUANT_", "TTT_")) and k.lower() not in hp}
        env.update(PRESET="smoke", ITERATIONS="2", VAL_MAX_TOKENS=str(SMOKE_VAL_MAX_TOKENS), EVAL_AUTO_STRIDE="0",
                   MAX_WALLCLOCK_SECONDS="0", WARMUP_STEPS="0", TRAIN_LOG_EVERY="1", RUN_ID=SMOKE_RUN_ID, OUT_DIR=out_dir,
                   DATA_PATH=str(resolve_run_path(run, "data_path")),
                   TOKENIZER_PATH=str(resolve_run_path(run, "tokenizer_path")),
                   VOCAB_SIZE=str(hp.get("vocab_size", 1024)), SEED=str(run.seed),
                   CASEOPS_ENABLED=str(int(hp.get("caseops_enabled", False))))  # the runs' data: its byte count
        env.setdefault("OMP_NUM_THREADS", "2")
        cmd = [sys.executable, BUNDLE_PACKED_NAME]
        log(f"smoke: cd {folder} && PRESET=smoke ITERATIONS=2 VAL_MAX_TOKENS={SMOKE_VAL_MAX_TOKENS} ... "
            f"python {BUNDLE_PACKED_NAME} (limit {timeout_seconds:.0f} s, --smoke-timeout-seconds; its output follows)")
        started = time.monotonic()
        try:
            returncode, tail = _run_live(cmd, cwd=folder, env=env, timeout_seconds=timeout_seconds, echo=echo)
        except subprocess.TimeoutExpired as e:
            measured = (f"; the runs' own train + export + eval took up to {runs_seconds:.0f} s"
                        if runs_seconds else "")
            raise RecordError(
                f"smoke run of {BUNDLE_PACKED_NAME} did not finish within --smoke-timeout-seconds="
                f"{timeout_seconds:.0f}{measured} (its output so far is above); nothing was written. Rerun with a "
                f"larger limit, e.g. --smoke-timeout-seconds {2 * math.ceil(timeout_seconds)}, or with --skip-smoke "
                f"to build the folder without running its train_gpt.py (its README and submission.json then say "
                f"so)") from e
        tail = tail[-4000:]
        if returncode != 0:
            raise RecordError(f"smoke run of {BUNDLE_PACKED_NAME} from inside the record folder failed "
                              f"(exit {returncode}); use --skip-smoke only if the data is not on this "
                              f"machine:\n{tail}")
        log_path = Path(out_dir) / SMOKE_RUN_ID / "train.log"
        parsed = parse_train_log(log_path.read_text(encoding="utf-8")) if log_path.is_file() else None
        if parsed is None or parsed["code_bytes"] != packed_bytes:
            raise RecordError(f"smoke run: the log reports code_bytes={parsed and parsed['code_bytes']}, expected "
                              f"the packed file's {packed_bytes} bytes")
        if not parsed["train"] or parsed["train"][-1][0] != 2:
            raise RecordError(f"smoke run: the log has no `step:2/2 train_loss:` line:\n{tail}")
        missing = [f"final_{k}_exact" for k, key in (("prequant", "prequant"), ("roundtrip", "roundtrip"),
                                                    ("sliding_window", "sliding")) if key not in parsed["final"]]
        if missing or parsed["total_bytes"] is None:
            raise RecordError(f"smoke run: the log lacks {', '.join(missing) or 'Total submission size'}:\n{tail}")
    for p in folder.iterdir():  # nothing may be left behind (e.g. a runs/ folder from a bad OUT_DIR)
        if p.name not in before:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    sliding = parsed["final"]["sliding"]
    log(f"smoke: ok, packed file ran from the folder: code_bytes:{parsed['code_bytes']} steps:2 "
        f"final_sliding_window_exact val_bpb:{sliding['val_bpb']:.4f} stride:{sliding['stride']} "
        f"(smoke check on {SMOKE_VAL_MAX_TOKENS} val tokens, not a score)")
    log(f"smoke: took {time.monotonic() - started:.0f} s of its {timeout_seconds:.0f} s limit")
    return {"code_bytes": parsed["code_bytes"], "train": parsed["train"], "final": parsed["final"]}

