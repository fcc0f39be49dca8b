"""Signals from the first training step to the last byte written, and resuming after training.

SIGINT, SIGTERM and SIGHUP (a preempted pod, Ctrl-C, a closed shell) never lose what a run has:
during the training loop the first signal stops it after its step (a checkpoint with
CHECKPOINT_EVERY, as before); after training the first signal interrupts whatever runs (an eval, the
export), the run saves the trained weights (`trained.safetensors`, resumable) and writes result.json
with `status: interrupted`, the phase, every number measured so far and the command that finishes
the job, then exits 128 + signal. A second signal exits at once: every file of the kit is written by
rename (primitives/files.py), so nothing written is ever half-written.

`RESUME=1` on a folder with `trained.safetensors` runs only the export and the final eval, from
the saved weights, GPTQ Hessians and eval stride: the same artifact bytes and scores as the
uninterrupted run (tests/test_interrupt.py).
"""

import contextlib
import errno
import hashlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

from primitives.files import atomic_write_bytes
from primitives.env import BUNDLE_KIND
from primitives.settings import Hyperparameters

if BUNDLE_KIND == "package":  # (a record's file installs no handler)
    STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
TRAINED_FILE = "trained.safetensors"
HESSIAN_PREFIX = "gptq_hessian."
# A repeat within this many seconds is the same stop, not a second one: Ctrl-C reaches every process of
# the terminal's group and torchrun (or tools/sweep.py) then forwards a SIGTERM of its own at once.
SECOND_SIGNAL_AFTER_SECONDS = 2.0
# a write that failed for want of room: a full disk, a quota, a file-size limit (ulimit -f)
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


class RunInterrupted(BaseException):
    """A stop signal after training (a BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """The run's handler of STOP_SIGNALS, from before the first training step to the exit.

    `flag[0]` is the first signal's number (0: none); the training loop reads it to stop after its
    step. After `arm()` the first signal raises RunInterrupted in the main thread wherever it is
    (a pending one at once); after `hold()` it is only recorded (while an error is written). A second
    signal exits at once with 128 + its number; a repeat within SECOND_SIGNAL_AFTER_SECONDS of the
    first is the same stop and is ignored. Handlers are restored on exit.
    """

    def __init__(self):
        self.flag, self.raising, self.previous, self.first_at = [0], False, {}, 0.0

    def __enter__(self) -> "SignalGuard":
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame) -> None:
        if self.flag[0]:  # a second signal: at once (files are renamed into place, never half-written)
            if time.monotonic() - self.first_at > SECOND_SIGNAL_AFTER_SECONDS:
                os._exit(128 + signum)
            return
        self.flag[0], self.first_at = signum, time.monotonic()
        if self.raising:
            raise RunInterrupted(signum)

    def arm(self) -> None:
        self.raising = True
        if self.flag[0]:
            raise RunInterrupted(self.flag[0])

    def hold(self) -> None:
        self.raising = False


def resume_command(hp: Hyperparameters, world_size: int, environ=None) -> str:
    """The shell command that finishes this run: RESUME=1, every setting of this run's environment
    (the trainer's and QUANT_* names; RUN_ID and OUT_DIR always) and the same entry point."""
    environ = os.environ if environ is None else environ
    names = {n.upper() for n in Hyperparameters.__dataclass_fields__} | {"PRESET"}
    env = {k: v for k, v in environ.items() if (k in names or k.startswith("QUANT_")) and k != "RESUME"}
    env.update(RUN_ID=hp.run_id, OUT_DIR=hp.out_dir, RESUME="1")
    launch = [sys.executable] if world_size == 1 else ["torchrun", "--standalone", f"--nproc_per_node={world_size}"]
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())), *map(shlex.quote, launch),
                     shlex.quote(sys.argv[0])])


def save_trained(path: Path, model, *, config: dict, trained: dict) -> None:
    """The trained weights (exact dtypes), the GPTQ Hessians and `trained` (steps, losses, eval
    stride, ...: JSON in the metadata) as one safetensors file, written atomically."""
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    for name, h in (model.gptq_hessians or {}).items():
        tensors[HESSIAN_PREFIX + name] = h.detach().cpu().contiguous().clone()
    meta = {"model_config": json.dumps(config), "trained": json.dumps(trained), "gptq": str(model.gptq_hessians is not None)}
    atomic_write_bytes(path, safetensors.torch.save(tensors, metadata=meta))


def load_trained(path: Path, model, config: dict) -> dict:
    """Load save_trained's file into `model` (weights and Hessians); returns its `trained` dict.

    Raises ValueError naming RESUME and the file when it does not hold a model of `config`."""
    try:
        with safetensors.safe_open(str(path), "pt") as f:
            meta, names = f.metadata(), list(f.keys())
            tensors = {n: f.get_tensor(n) for n in names}
        saved_config = json.loads(meta["model_config"])
    except Exception as err:
        raise ValueError(f"RESUME=1: {path}: not a trained-weights file ({err}); expected the {TRAINED_FILE} "
                         "of an interrupted run") from err
    if saved_config != config:
        raise ValueError(f"RESUME=1: {path} holds a model of {saved_config}; expected this run's {config} "
                         "(resume with the settings of the interrupted run: its result.json's next_command)")
    model.load_state_dict({n: t for n, t in tensors.items() if not n.startswith(HESSIAN_PREFIX)})
    device = next(model.parameters()).device
    hessians = {n[len(HESSIAN_PREFIX):]: t.to(device) for n, t in tensors.items() if n.startswith(HESSIAN_PREFIX)}
    model.gptq_hessians = hessians if meta["gptq"] == "True" else None
    return json.loads(meta["trained"])


def no_room(err: BaseException) -> bool:
    """True for an OSError of a write that found no room (NO_ROOM_ERRNOS)."""
    return isinstance(err, OSError) and err.errno in NO_ROOM_ERRNOS


def fallback_dir(run_dir: Path) -> Path:
    """Where a run keeps what does not fit in its folder: the system temp dir (TMPDIR), per run folder:
    `<RUN_ID>-<hash>`, the hash of the folder's real path, device and inode, so that two runs of one RUN_ID
    in two OUT_DIRs (or a folder removed and made again) never keep their weights in one place."""
    try:
        st = os.stat(run_dir)
        ident = f"{os.path.realpath(run_dir)}\0{st.st_dev}:{st.st_ino}"
    except OSError:  # the folder is gone: its path alone
        ident = os.path.realpath(run_dir)
    digest = hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "parameter-golf" / f"{Path(run_dir).name}-{digest}"


def keep_trained(ctx, hp: Hyperparameters, model, *, config: dict, trained: dict, resumed: bool = False):
    """Save the trained weights (save_trained) in the run folder, else in fallback_dir when the run
    folder has no room; returns the path written (a resumed run's own file when it has one), or the
    OSError of the last place tried."""
    path = ctx.run_dir / TRAINED_FILE
    if resumed and path.is_file():
        return path
    for place in (path, fallback_dir(ctx.run_dir) / TRAINED_FILE):
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            save_trained(place, model, config=config, trained=trained)
            return place
        except OSError as err:
            failed = err
    return failed


def finish_command(ctx, hp: Hyperparameters, kept: Path) -> str:
    """The RESUME=1 command, moving the kept weights into the run folder first when they are elsewhere."""
    command = resume_command(hp, ctx.world_size)
    home = ctx.run_dir / TRAINED_FILE
    return command if kept == home else f"mv {shlex.quote(str(kept))} {shlex.quote(str(home))} && {command}"


def record_somewhere(ctx, hp: Hyperparameters, summary: dict, record) -> Path:
    """result.json in the run folder, else (no room) beside the kept weights in fallback_dir; returns where."""
    try:
        record(summary)
        return ctx.run_dir / "result.json"
    except OSError as err:
        if not no_room(err):
            raise
    from primitives.files import atomic_write_json

    path = fallback_dir(ctx.run_dir) / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, summary)
    return path


def no_room_after_training(ctx, hp: Hyperparameters, err: OSError, summary: dict, record, *, model, config: dict,
                           trained: dict) -> int:
    """A write after training found no room (a full disk, a file-size limit): keep the trained weights
    where they fit (keep_trained), result.json with status `no_room`, the error, where the weights
    are and the command that finishes the run, on stderr too (train.log may be what filled up);
    returns 1. Raises OSError (one line at the entry) when nothing could be written anywhere."""
    kept = keep_trained(ctx, hp, model, config=config, trained=trained,
                        resumed=summary.get("resumed_after_training", False)) if ctx.is_main else ctx.run_dir / TRAINED_FILE
    summary.update(status="no_room", error=f"OSError: {err}")
    if isinstance(kept, OSError):
        summary["error"] += f"; the trained weights could not be kept either ({kept})"
    else:
        summary.update(trained_path=str(kept), next_command=finish_command(ctx, hp, kept))
    if not ctx.is_main:
        return 1
    kept_where = f"not kept ({kept})" if isinstance(kept, OSError) else f"kept in {kept}"
    try:
        result = record_somewhere(ctx, hp, summary, record)
    except OSError as again:
        result = f"not written ({again})"
    lines = [f"ERROR: no room to write after training ({err}); trained weights {kept_where}; result: {result}"]
    if "next_command" in summary:
        lines.append(f"free some space (or raise the file-size limit), then finish with: {summary['next_command']}")
    for line in lines:
        ctx.log(line, console=False)
        print(line, file=sys.stderr, flush=True)
    return 1


def stopped_in_training(ctx, hp: Hyperparameters, signum: int, summary: dict, record) -> int:
    """A signal stopped the training loop (checkpointed with CHECKPOINT_EVERY): result.json says so,
    with the RESUME=1 command when the checkpoint can continue it; returns 128 + signum."""
    summary.update(status="stopped_by_signal", phase="train", signal=signal.Signals(signum).name)
    if hp.checkpoint_every and not hp.max_wallclock_seconds and (ctx.run_dir / "checkpoint.pt").is_file():
        summary["next_command"] = resume_command(hp, ctx.world_size)
        ctx.log(f"next: {summary['next_command']}")
    record(summary)
    return 128 + signum


def interrupted_after_training(ctx, hp: Hyperparameters, signum: int, summary: dict, record, *, model, config: dict,
                               trained: dict, score: str) -> int:
    """A signal after training: save the trained weights (TRAINED_FILE, unless this run was resumed
    from it), then result.json with status interrupted, the phase, every number so far, the RESUME=1
    command and, when the artifact was written, the command that scores it; returns 128 + signum."""
    path = ctx.run_dir / TRAINED_FILE
    summary.update(status="interrupted", signal=signal.Signals(signum).name, trained_path=str(path),
                   next_command=resume_command(hp, ctx.world_size))
    if "bytes_model" in summary and Path(summary["artifact_path"]).is_file():
        summary["score_command"] = score
    if ctx.is_main:
        kept = keep_trained(ctx, hp, model, config=config, trained=trained,
                            resumed=summary.get("resumed_after_training", False))
        if isinstance(kept, OSError):
            summary.update(trained_path=None, error=f"the trained weights could not be kept ({kept})")
            summary.pop("next_command")
        elif kept != path:
            summary.update(trained_path=str(kept), next_command=finish_command(ctx, hp, kept))
        ctx.log(f"interrupted by {summary['signal']} in phase {summary['phase']}: trained weights in "
                f"{summary['trained_path']}; finish with: {summary.get('next_command')}")
    record_somewhere(ctx, hp, summary, record)
    return 128 + signum


def training_failed(ctx, hp: Hyperparameters, err: BaseException, summary: dict, record, *, train_shards: list) -> int:
    """Training raised: result.json with the status and the error, then the exit code (non-finite
    loss, out of memory: 1) or `err` re-raised (a ValueError is the user's: one line, exit 2)."""
    summary.update(train_shards=train_shards, error=f"{type(err).__name__}: {err}", status={
        "NonFiniteLossError": "nonfinite_loss", "OutOfMemoryError": "oom"}.get(type(err).__name__, "failed_in_training"))
    if isinstance(err, torch.OutOfMemoryError):
        accum = hp.resolve_grad_accum(ctx.world_size, ctx.device.type == "cuda")
        micro = hp.train_batch_tokens // (ctx.world_size * accum * hp.train_seq_len)
        ctx.log(f"ERROR: CUDA out of memory in training: raise GRAD_ACCUM_STEPS (now {accum}: micro-batches of "
                f"{micro} sequences) or lower TRAIN_BATCH_TOKENS")
    elif summary["status"] == "nonfinite_loss":
        ctx.log(f"ERROR: {err}; no artifact written")
    record(summary)
    if summary["status"] == "failed_in_training":
        raise err
    return 1
