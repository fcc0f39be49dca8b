"""The run folder `OUT_DIR/RUN_ID`: checked before anything is written, then opened with the log.

A finished run's folder (result.json or final_model.ptz in it) is never written into unless
RESUME=1: a typo'd or reused RUN_ID would otherwise overwrite the train.log a record is built from.
One process writes a run folder: rank 0 holds an OS lock on its `run.lock` (released by the OS when
the process dies), and a second run with the same RUN_ID is refused, naming the holder. A run's
settings and inputs are bound to its folder (`run_settings.json`): RESUME=1 refuses any change to
a setting that decides the weights or the score, and a run that finished (status ok).
"""

import dataclasses
import json
import os
from pathlib import Path

from trainer.context import BUNDLE_KIND, RunContext, log_run_header
from primitives.files import atomic_write_json
from primitives.settings import Hyperparameters

if BUNDLE_KIND == "package":  # the run folder's lock and checks are the kit's: a record's file opens train.log only
    import datetime
    import errno
    import fcntl
    import socket

    from trainer.interrupt import TRAINED_FILE

FINISHED_MARKS = ("result.json", "final_model.ptz")
LOCK_FILE = "run.lock"
SETTINGS_FILE = "run_settings.json"
HELD_LOCKS = []  # the run folders' lock files this process holds open (lock_run_folder)
# settings that change only how a run runs, never its weights or its score: RESUME=1 may change them
RUN_ONLY_SETTINGS = ("run_id", "out_dir", "resume", "num_threads", "train_log_every", "val_loss_every",
                     "checkpoint_every", "save_prequant")


def check_out_dir(out_dir: str) -> None:
    """ValueError naming OUT_DIR unless it is (or can be made as) a writable folder."""
    path = Path(out_dir)
    for p in (path, *path.parents):  # the deepest part that exists: "." or "/" at the latest
        try:
            p.stat()
            existing = p
            break
        except (FileNotFoundError, NotADirectoryError):  # f/runs with f a file: look at f
            if p.is_symlink():
                raise ValueError(f"OUT_DIR={out_dir!r}: {p} is a dangling symlink (to {os.readlink(p)}); expected a "
                                 "folder for the run folders") from None
        except OSError as err:  # a symlink loop, a name too long, no permission to look
            raise ValueError(f"OUT_DIR={out_dir!r}: {p}: {err.strerror or err}; expected a folder for the run "
                             "folders") from None
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
        status = read_json(run_dir / "result.json").get("status", "ok")  # a failed run is kept too: say how it ended
        what = "a finished run" if status == "ok" else f"a run that ended with status {status!r}"
        raise ValueError(f"RUN_ID={hp.run_id!r}: {run_dir} holds {what} ({', '.join(finished)}); expected a new "
                         "RUN_ID (or RESUME=1 to finish an interrupted run)")
    if not hp.resume:
        return ""
    if read_json(run_dir / "result.json").get("status") == "ok":
        raise ValueError(f"RESUME={hp.resume!r}: {run_dir} holds a run that finished (result.json status ok); nothing "
                         "to resume, and its result is kept (expected the folder of an interrupted run)")
    if (run_dir / TRAINED_FILE).is_file():
        return "trained"
    if not (run_dir / "checkpoint.pt").is_file():
        raise ValueError(f"RESUME={hp.resume!r}: {run_dir} has no {TRAINED_FILE} or checkpoint.pt; expected the "
                         "folder of an interrupted run (its RUN_ID and OUT_DIR)")
    if hp.max_wallclock_seconds:
        raise ValueError(f"RESUME={hp.resume!r}: resuming inside training: expected MAX_WALLCLOCK_SECONDS=0 "
                         f"(got {hp.max_wallclock_seconds}; a timed run cannot be resumed)")
    return "checkpoint"


def read_json(path: Path) -> dict:
    """The JSON object in `path`; {} when absent or unreadable (an interrupted write never leaves one:
    files are renamed into place)."""
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def run_binding(hp: Hyperparameters, inputs: dict, environ=None) -> dict:
    """What decides a run's weights and score: every setting but RUN_ONLY_SETTINGS, the QUANT_*
    variables of `environ` (default os.environ) and `inputs` (tokenizer and manifest sha256)."""
    environ = os.environ if environ is None else environ
    settings = {k: v for k, v in dataclasses.asdict(hp).items() if k not in RUN_ONLY_SETTINGS}
    quant = {k: v for k, v in sorted(environ.items()) if k.startswith("QUANT_")}
    return json.loads(json.dumps(dict(settings=settings, quant_env=quant, inputs=inputs)))


def check_resume_binding(run_dir: Path, binding: dict) -> None:
    """ValueError naming the first setting (or input) whose value differs from the interrupted
    run's, with both values: resuming would mix two recipes in one result."""
    saved = read_json(run_dir / SETTINGS_FILE)
    if not saved:  # a folder written before run_settings.json existed: its result.json's settings
        saved = dict(settings=read_json(run_dir / "result.json").get("hyperparameters"))
        if not saved["settings"]:
            raise ValueError(f"RESUME=1: {run_dir} has no {SETTINGS_FILE} or result.json: the settings of the "
                             "interrupted run are unknown; expected the folder of an interrupted run")
        binding = dict(settings=binding["settings"])
    for group in ("settings", "quant_env", "inputs"):
        old, new = saved.get(group) or {}, binding.get(group) or {}
        for key in sorted(set(old) | set(new)):
            if group == "settings" and key in RUN_ONLY_SETTINGS:
                continue
            if old.get(key, "unset") != new.get(key, "unset"):
                name = key if group == "quant_env" else key.upper() if group == "settings" else {
                    "tokenizer_sha256": "TOKENIZER_PATH (its sha256)",
                    "manifest_sha256": "DATA_PATH (its manifest.json's sha256)"}.get(key, key)
                raise ValueError(f"RESUME=1: {name} is {new.get(key, 'unset')!r}; the interrupted run in {run_dir} "
                                 f"had {old.get(key, 'unset')!r}; expected the same value (the weights were trained "
                                 "with it: its result.json's next_command has every setting)")


def release_run_folders() -> None:
    """Close the lock files this process holds (the OS releases them at exit anyway): for a caller
    that runs main() in-process and then another run of the same RUN_ID."""
    while HELD_LOCKS:
        HELD_LOCKS.pop().close()


def open_lock_file(run_dir: Path, hp: Hyperparameters):
    """The run folder made and its `run.lock` opened for reading and writing (a regular file, never followed
    through a symlink); ValueError naming RUN_ID and the path when either cannot be (a read-only folder, a
    folder or a dangling link named run.lock), before anything in the folder is written."""
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        what = ("is a symlink" if path.is_symlink() else "is a folder" if path.is_dir() else
                err.strerror or str(err))
        raise ValueError(f"RUN_ID={hp.run_id!r}: {err.filename or path}: {what}; expected a run folder this process can "
                         f"write, with no {LOCK_FILE} but the file a run makes (remove it if no run is writing here)") from None
    return os.fdopen(fd, "r+", encoding="utf-8")


def lock_run_folder(ctx: RunContext, hp: Hyperparameters):
    """Make the run folder and take its lock (rank 0): an exclusive flock on `run.lock`, held by the
    open file until the process ends. ValueError naming RUN_ID and the holder (pid, host, start)
    when another process holds it, or the lock file when it cannot be opened (open_lock_file); the
    folder is then checked again under the lock."""
    handle = open_lock_file(ctx.run_dir, hp)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        if err.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
            raise ValueError(f"RUN_ID={hp.run_id!r}: {ctx.run_dir / LOCK_FILE}: cannot lock ({err.strerror}); "
                             "expected a run folder on a file system with locks") from None
        raise ValueError(f"RUN_ID={hp.run_id!r}: {ctx.run_dir} is being written by another run ({holder}); expected "
                         "a RUN_ID no running process uses") from None
    HELD_LOCKS.append(handle)
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
    handle.flush()
    return handle


def open_run_log(ctx: RunContext, hp: Hyperparameters, inputs: dict = None) -> None:
    """Lock the run folder (lock_run_folder), check it again under the lock, bind the run to its
    settings and inputs (run_settings.json; RESUME=1: check_resume_binding), then open train.log
    (appended to when resuming): the header first, then the lines logged by the input checks before
    it existed. ValueError naming train.log when it cannot be written (a full disk, `ulimit -f`).
    A record's packed file makes the folder and opens train.log only: the lock, the folder's checks
    and the binding are the kit's (kit/bundle_fold.py)."""
    if not ctx.is_main:
        return
    if BUNDLE_KIND == "package":
        ctx.lock = lock_run_folder(ctx, hp)
        check_run_folder(hp)  # another run may have finished in this folder since the first check
        binding = run_binding(hp, inputs or {})
        if hp.resume:
            check_resume_binding(ctx.run_dir, binding)
    pending, ctx.pending = ctx.pending, []
    if BUNDLE_KIND == "package":  # the kit's one line for a run folder that cannot be written
        try:
            if not hp.resume:
                atomic_write_json(ctx.run_dir / SETTINGS_FILE, binding)
            write_log_start(ctx, hp, pending)
            if ctx.log_error:
                raise ctx.log_error
            ctx.log_opened = True
        except OSError as err:
            ctx.log_file = None
            where = err.filename or ctx.run_dir / "train.log"
            raise ValueError(f"RUN_ID={hp.run_id!r}: cannot write {where} ({err.strerror or err}); expected a writable "
                             "run folder with space (a full disk? a file-size limit, ulimit -f?)") from None
    else:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        write_log_start(ctx, hp, pending)


def write_log_start(ctx: RunContext, hp: Hyperparameters, pending: list) -> None:
    """Open train.log (appended to with RESUME=1) and write its header, then the `pending` lines."""
    # "w", or "a" with RESUME=1 (indexed: a one-letter literal would keep the packed file from shortening `w` parameters)
    ctx.log_file = open(ctx.run_dir / "train.log", "wa"[hp.resume], encoding="utf-8")
    log_run_header(ctx, hp)
    for line in pending:
        ctx.log(line, console=False)
