"""Smoke-run a record folder's packed train_gpt.py from inside the folder (tools/make_record.py).

Nothing else on sys.path: 2 CPU steps, the export and the final evals on the first
SMOKE_VAL_MAX_TOKENS val tokens. A check that the shipped file runs and evaluates, never a score.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.bundle import BUNDLE_PACKED_NAME
from tools.record_checks import resolve_run_path
from tools.runs import RecordError, Run, parse_train_log

SMOKE_RUN_ID = "record_smoke"
SMOKE_VAL_MAX_TOKENS = 4096  # the smoke run evaluates on this many val tokens: proves the eval runs, scores nothing
SMOKE_TIMEOUT_SECONDS = 600


def smoke_run(folder: Path, run: Run, log=print) -> dict:
    """Run the packed train_gpt.py from inside `folder`, with no PYTHONPATH (only the file itself can
    provide the code): 2 CPU-sized steps (PRESET=smoke), the export, then the final evals on the first
    SMOKE_VAL_MAX_TOKENS val tokens (a smoke check that the shipped file evaluates, not a score).
    Checks that it exits 0, logs its own size as code_bytes, the 2 steps and every final line (the
    sliding pass: no TTT_* or QUANT_* variable of the shell reaches it, nor any of the run's settings).
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
                   VOCAB_SIZE=str(hp.get("vocab_size", 1024)), SEED=str(run.seed))
        env.setdefault("OMP_NUM_THREADS", "2")
        cmd = [sys.executable, BUNDLE_PACKED_NAME]
        log(f"smoke: cd {folder} && PRESET=smoke ITERATIONS=2 VAL_MAX_TOKENS={SMOKE_VAL_MAX_TOKENS} ... "
            f"python {BUNDLE_PACKED_NAME}")
        try:
            proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=SMOKE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired as e:
            raise RecordError(f"smoke run of {BUNDLE_PACKED_NAME} timed out after {SMOKE_TIMEOUT_SECONDS} s") from e
        tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-2500:]).strip()
        if proc.returncode != 0:
            raise RecordError(f"smoke run of {BUNDLE_PACKED_NAME} from inside the record folder failed "
                              f"(exit {proc.returncode}); use --skip-smoke only if the data is not on this "
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
    return {"code_bytes": parsed["code_bytes"], "train": parsed["train"], "final": parsed["final"]}

