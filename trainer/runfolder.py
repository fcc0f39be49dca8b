"""The run folder `OUT_DIR/RUN_ID`: checked before anything is written, then opened with the log.

A finished run's folder (result.json or final_model.ptz in it) is never written into unless
RESUME=1: a typo'd or reused RUN_ID would otherwise overwrite the train.log a record is built from.
"""

import os
from pathlib import Path

from trainer.context import RunContext, log_run_header
from trainer.interrupt import TRAINED_FILE
from trainer.settings import Hyperparameters

FINISHED_MARKS = ("result.json", "final_model.ptz")


def check_out_dir(out_dir: str) -> None:
    """ValueError naming OUT_DIR unless it is (or can be made as) a writable folder."""
    path = Path(out_dir)
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        where = "is a file" if existing == path else f"{existing} is a file"
        raise ValueError(f"OUT_DIR={out_dir!r}: {where}; expected a folder for the run folders")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"OUT_DIR={out_dir!r}: {existing} is not writable; expected a writable folder")


def check_run_folder(hp: Hyperparameters) -> str:
    """What the run does with its folder: "" (a new run), "trained" (RESUME=1 after training: the
    export and the final eval from trained.safetensors) or "checkpoint" (RESUME=1 inside training).

    Raises ValueError naming the setting, before anything is written, for an unusable OUT_DIR, a
    finished run's folder without RESUME=1, or RESUME=1 with nothing to resume.
    """
    check_out_dir(hp.out_dir)
    run_dir = Path(hp.out_dir) / hp.run_id
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"RUN_ID={hp.run_id!r}: {run_dir} is a file; expected a run folder")
    finished = [n for n in FINISHED_MARKS if (run_dir / n).exists()]
    if finished and not hp.resume:
        raise ValueError(f"RUN_ID={hp.run_id!r}: {run_dir} holds a finished run ({', '.join(finished)}); expected a new "
                         "RUN_ID (or RESUME=1 to finish an interrupted run)")
    if not hp.resume:
        return ""
    if (run_dir / TRAINED_FILE).is_file():
        return "trained"
    if not (run_dir / "checkpoint.pt").is_file():
        raise ValueError(f"RESUME={hp.resume!r}: {run_dir} has no {TRAINED_FILE} or checkpoint.pt; expected the "
                         "folder of an interrupted run (its RUN_ID and OUT_DIR)")
    if hp.max_wallclock_seconds:
        raise ValueError(f"RESUME={hp.resume!r}: resuming inside training: expected MAX_WALLCLOCK_SECONDS=0 "
                         f"(got {hp.max_wallclock_seconds}; a timed run cannot be resumed)")
    return "checkpoint"


def open_run_log(ctx: RunContext, hp: Hyperparameters) -> None:
    """Make the run folder and open train.log (appended to when resuming): the header first, then
    the lines logged by the input checks before it existed."""
    if not ctx.is_main:
        return
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    pending, ctx.pending = ctx.pending, []
    ctx.log_file = open(ctx.run_dir / "train.log", "a" if hp.resume else "w", encoding="utf-8")
    log_run_header(ctx, hp)
    for line in pending:
        ctx.log_file.write(line + "\n")
    ctx.log_file.flush()
