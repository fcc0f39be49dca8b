"""Run a grid of configurations x seeds (resumable) and collect the results in one table and plot.

    python tools/sweep.py --name lr --seeds 1337 42 \\
        --set PRESET=smoke ITERATIONS=150 MAX_WALLCLOCK_SECONDS=0 \\
        --config base --config low_lr MATRIX_LR=0.02 --grid WARMDOWN_FRAC=0.5,1.0
    python tools/sweep.py --file sweep.yaml          # the same, from a YAML or JSON file

A sweep file (YAML or JSON; command-line options add to it):

    name: ablation
    seeds: [1337, 42]
    env: {PRESET: smoke, ITERATIONS: 150, MAX_WALLCLOCK_SECONDS: 0}   # every run
    configs:                       # name -> its own env vars ({} or null: the shared env alone)
      baseline: {MLP_MULT: 2, XSA_LAST_N: 0}
      smoke: {}
    grid: {MATRIX_LR: [0.03, 0.04]}  # optional, crossed with every config
    metric: sliding                  # which final val_bpb ranks the table (sliding|roundtrip|prequant|ttt|final;
                                     # final: each run's headline, TTT when its plan kept TTT)
    baseline: baseline               # optional: the table's "vs" column is the difference to this config

Layout: `runs/<name>/<config>/seed<S>/` is each run's folder (the trainer's OUT_DIR/RUN_ID, with
train.log and result.json), plus `sweep_run.json` (the exact settings, so a changed config is not
mistaken for a finished one) and `console.txt` (stdout and stderr). `runs/<name>/results.csv` (one
row per run), `results.md` (per config: mean, std, n, steps, ms per step; sorted by val_bpb) and
`loss_curves.png` (every run's train loss) are rewritten after each run.

Scheduling: with CUDA GPUs, one run per GPU at a time (`CUDA_VISIBLE_DEVICES`; 8 seeds at once on
an 8-GPU node), or `--gpus-per-run K` for torchrun runs on groups of K GPUs; on CPU, one run after
another. A run whose result.json exists with status ok or nonfinite_<phase> (a loss, eval or TTT that
came out NaN: the configuration's outcome, which a rerun of the same settings repeats) is finished and
skipped, and the table counts it as a run without a score; a crashed or interrupted run is run again.

Compare two configurations of a sweep with the significance tool, which reads a config folder as
its group of seeds: `python tools/significance.py --runs runs/<name>/<A> --baseline-runs runs/<name>/<B>`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from primitives.cli_errors import USER_ERRORS, ArgumentParser, report_user_error  # noqa: E402
from tools.sweeps.sweep_report import collect, fmt, metric_bpb, read_result, recorded_env, run_status  # noqa: E402
from tools.sweeps.sweep_spec import (SWEEP_METRICS, SweepError, SweepRun, build_runs, check_trainer_settings,  # noqa: E402
                              spec_from_args)
from primitives.files import atomic_write_bytes, lock_holder  # noqa: E402

RUN_FOLDER_BUSY = 75  # launch_run's code for a run folder another process's trainer holds (EX_TEMPFAIL)
_LIVE_TRAINERS = set()  # subprocess.Popen of the trainers running now: a stopped sweep stops them too


# -----------------------------------------------------------------------------------------------
# running
# -----------------------------------------------------------------------------------------------


def finished_status(status: str) -> bool:
    """A result.json status that rerunning the same settings would not change: ok, and every
    nonfinite_<phase> (trainer/finish.py): a diverged run is a result of its configuration, kept as
    such (delete its folder to try again); a crash, a signal or a missing result.json are not."""
    return status == "ok" or status.startswith("nonfinite_")


def is_finished(run: SweepRun) -> bool:
    """Finished = a result.json whose status rerunning would not change, written with these settings.
    A finished run with other settings is a SweepError (rename the config or delete its folder)."""
    if not finished_status(run_status(read_result(run))):
        return False
    before = recorded_env(run)
    if before is not None and before != run.env:
        changed = sorted(k for k in set(before) | set(run.env) if before.get(k) != run.env.get(k))
        raise SweepError(f"config {run.config!r} seed {run.seed}: {run.run_dir} finished with other settings "
                         f"({', '.join(changed)} differ); give the config a new name or delete that folder")
    return True


def detect_gpus(environ=None) -> list:
    """The CUDA device ids a run may be given: CUDA_VISIBLE_DEVICES's entries, else 0..count-1; [] on CPU."""
    environ = os.environ if environ is None else environ
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        count = 0
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return (visible or [str(i) for i in range(count)])[:count]


def make_slots(gpus: list, gpus_per_run: int) -> list:
    """Groups of `gpus_per_run` GPU ids, one run at a time in each; [None] (one CPU slot) without GPUs."""
    if not gpus:
        return [None]
    if gpus_per_run < 1 or len(gpus) < gpus_per_run:
        raise SweepError(f"--gpus-per-run {gpus_per_run}: expected 1..{len(gpus)} (the GPUs available)")
    return [",".join(gpus[i:i + gpus_per_run]) for i in range(0, len(gpus) - gpus_per_run + 1, gpus_per_run)]


def launch_run(run: SweepRun, slot, script: Path, gpus_per_run: int = 1, environ=None) -> int:
    """Run the trainer for one SweepRun from the current directory; returns its exit code.

    The env is the caller's environment + the run's settings (+ CUDA_VISIBLE_DEVICES=slot, and
    torchrun for gpus_per_run > 1); stdout and stderr go to console.txt in the run folder. A run
    with CHECKPOINT_EVERY that was stopped with these settings continues from its checkpoint.pt, and
    one interrupted after training from its trained.safetensors (RESUME=1). Otherwise the result.json
    and artifact of an earlier, unfinished attempt are renamed to `*.superseded` first: the trainer
    refuses a folder that holds them (trainer/runfolder.py)."""
    holder = lock_holder(run.run_dir / "run.lock")
    if holder:  # another sweep's trainer writes this folder: its console.txt and files are left as they are
        print(f"{run.run_dir}: being written by another run ({holder}); not started here", flush=True)
        return RUN_FOLDER_BUSY
    run.run_dir.mkdir(parents=True, exist_ok=True)
    same = recorded_env(run) == run.env
    resume = same and ((run.run_dir / "trained.safetensors").is_file() or (
        run.env.get("CHECKPOINT_EVERY", "0") not in ("", "0") and (run.run_dir / "checkpoint.pt").is_file()))
    for name in ("result.json", "final_model.ptz") * (not resume):
        if (run.run_dir / name).exists():
            (run.run_dir / name).replace(run.run_dir / f"{name}.superseded")
    atomic_write_bytes(run.run_dir / "sweep_run.json", (json.dumps(
        {"config": run.config, "seed": run.seed, "settings": run.settings, "env": run.env}, indent=2) + "\n").encode())
    env = {**(os.environ if environ is None else environ), **run.env}
    env.setdefault("PYTHONPATH", str(REPO_ROOT))
    if resume:
        env["RESUME"] = "1"
    cmd = [sys.executable, str(script)]
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot
        if gpus_per_run > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={gpus_per_run}", str(script)]
    with open(run.run_dir / "console.txt", "ab" if resume else "wb") as console:
        proc = subprocess.Popen(cmd, env=env, stdout=console, stderr=subprocess.STDOUT)
        _LIVE_TRAINERS.add(proc)
        returncode = proc.wait()  # an interrupt here leaves proc in _LIVE_TRAINERS for stop_trainers
        _LIVE_TRAINERS.discard(proc)
        return returncode


def stop_trainers(signum: int = signal.SIGTERM, grace_seconds: float = 120.0) -> None:
    """Pass a stop to every running trainer (train_gpt.py finishes its step and writes result.json
    with status stopped_by_signal) and wait for it; kill one that is still running after the grace."""
    for proc in list(_LIVE_TRAINERS):
        proc.send_signal(signum)
    for proc in list(_LIVE_TRAINERS):
        try:
            proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _LIVE_TRAINERS.discard(proc)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def execute(runs: list, slots: list, launch, on_done, on_interrupt=None) -> None:
    """Run every SweepRun with at most one run per slot at a time (the calling thread works the first
    slot). `launch(run, slot)` -> exit code; `on_done(run, returncode, seconds)` is called
    (serialized) after each. On KeyboardInterrupt no run starts any more, `on_interrupt()` ends the
    runs in flight, and every worker has finished its last on_done before the interrupt is re-raised,
    so that the caller's own writes never race a worker's."""
    pending = queue.Queue()
    for run in runs:
        pending.put(run)
    lock = threading.Lock()
    errors = []
    stop = threading.Event()

    def worker(slot):
        while not errors and not stop.is_set():
            try:
                run = pending.get_nowait()
            except queue.Empty:
                return
            t0 = time.monotonic()
            try:
                rc = launch(run, slot)
            except Exception as e:  # an OS error starting the trainer: stop the sweep, say why
                errors.append(e)
                return
            with lock:
                on_done(run, rc, time.monotonic() - t0)

    threads = [threading.Thread(target=worker, args=(slot,), daemon=True) for slot in slots[1:]]
    for t in threads:
        t.start()
    try:
        worker(slots[0])
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        stop.set()
        if on_interrupt is not None:
            on_interrupt()
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0]


# -----------------------------------------------------------------------------------------------
# command line
# -----------------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python tools/sweep.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--file", help="sweep file (.yaml/.yml or .json); the options below add to it")
    p.add_argument("--name", help="sweep name: results go to OUT/NAME/")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default 1337)")
    p.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE", help="env vars of every run")
    p.add_argument("--config", nargs="+", action="append", default=[], metavar=("NAME", "NAME=VALUE"),
                   help="a configuration: its name, then its env vars (repeat for each)")
    p.add_argument("--grid", nargs="+", default=[], metavar="NAME=V1,V2", help="crossed with every configuration")
    p.add_argument("--metric", choices=SWEEP_METRICS, help="final val_bpb that ranks the table (default sliding)")
    p.add_argument("--baseline", help="config whose mean the table's 'vs' column subtracts")
    p.add_argument("--out", default="runs", help="root folder (default runs)")
    p.add_argument("--script", default=str(REPO_ROOT / "train_gpt.py"), help="trainer (default the kit's train_gpt.py)")
    p.add_argument("--gpus", help="comma-separated CUDA device ids (default: all visible; none on CPU)")
    p.add_argument("--gpus-per-run", type=int, default=1, help="GPUs per run, launched with torchrun (default 1)")
    p.add_argument("--only", nargs="+", default=[], metavar="CONFIG",
                   help="run only these configurations, in this order (the table still lists them all)")
    p.add_argument("--collect-only", action="store_true", help="only rewrite results.csv/md and the plot")
    p.add_argument("--dry-run", action="store_true", help="list the runs and whether they are finished, run nothing")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
        runs = build_runs(spec, args.out)
        metric, baseline = spec.get("metric", "sliding"), spec.get("baseline")
        if baseline is not None and baseline not in {r.config for r in runs}:
            raise SweepError(f"baseline {baseline!r}: not a config of this sweep")
        unknown = [c for c in args.only if c not in {r.config for r in runs}]
        if unknown:
            raise SweepError(f"--only {' '.join(unknown)}: not a config of this sweep")
        script = Path(args.script)
        if not script.is_file():
            raise SweepError(f"--script {script}: no such file")
        if script.resolve() == (REPO_ROOT / "train_gpt.py").resolve() and not args.collect_only:
            check_trainer_settings(runs)
        finished = [is_finished(r) for r in runs]
        for run in (r for r, done in zip(runs, finished) if not done):  # a second identical sweep: touch nothing
            if holder := lock_holder(run.run_dir / "run.lock"):
                raise SweepError(f"{run.run_dir}: being written by another run ({holder}); expected one sweep per "
                                 "run folder (wait for the other sweep, or use another --out)")
        gpus = [g for g in args.gpus.split(",") if g] if args.gpus is not None else detect_gpus()
        slots = make_slots(gpus, args.gpus_per_run)
    except USER_ERRORS as e:  # a bad sweep definition, flag or file: one line, exit 2
        return report_user_error(e)
    sweep_dir = Path(args.out) / spec["name"]
    title = f"sweep {spec['name']}"
    todo = [r for r, done in zip(runs, finished) if not done and (not args.only or r.config in args.only)]
    todo.sort(key=lambda r: args.only.index(r.config) if args.only else 0)
    where = "CPU, one run at a time" if slots == [None] else f"GPUs {' | '.join(slots)}, one run per slot"
    print(f"sweep {spec['name']}: {len(runs)} runs ({len({r.config for r in runs})} configs x "
          f"{len({r.seed for r in runs})} seeds), {sum(finished)} finished, {len(todo)} to run"
          f"{' (--only ' + ' '.join(args.only) + ')' if args.only else ''}; {where}",
          flush=True)
    if args.dry_run or args.collect_only:
        for run, done in zip(runs, finished):
            what = "finished" if done else "to run  " if not args.only or run.config in args.only else "not now "
            print(f"  {what}  {run.config} seed {run.seed}  {run.run_dir}")
        if args.collect_only:
            print(collect(runs, sweep_dir, metric=metric, baseline=baseline, title=title), end="")
        return 0
    for i, (run, done) in enumerate(zip(runs, finished)):
        if done:
            print(f"[{i + 1}/{len(runs)}] {run.config} seed {run.seed}: skipped (finished)", flush=True)
    state = {"done": 0, "seconds": 0.0, "failed": 0}
    index = {id(r): i for i, r in enumerate(runs)}

    def on_done(run, rc, seconds):
        state["done"] += 1
        state["seconds"] += seconds
        r = read_result(run)
        status = run_status(r)
        left = len(todo) - state["done"]
        eta = state["seconds"] / state["done"] * left / len(slots)
        head = f"[{index[id(run)] + 1}/{len(runs)}] {run.config} seed {run.seed}:"
        if rc == RUN_FOLDER_BUSY:
            state["failed"] += 1
            print(f"{head} not run: another sweep's trainer is writing {run.run_dir}; {left} left", flush=True)
        elif r is None or rc != 0 and not finished_status(status):
            state["failed"] += 1
            print(f"{head} FAILED (exit {rc}; see {run.run_dir / 'console.txt'}) in {_duration(seconds)}; "
                  f"{left} left", flush=True)
        else:
            bpb = metric_bpb(r, metric)
            print(f"{head} {status} val_bpb {fmt(bpb, '.5f', '-')} ({metric}) steps {r.get('steps')} "
                  f"{fmt(r.get('ms_per_step'), '.0f', '-')} ms/step in {_duration(seconds)}; {left} left"
                  + (f", ~{_duration(eta)} to go" if left else ""), flush=True)
        collect(runs, sweep_dir, metric=metric, baseline=baseline, title=title)

    def announce(run, slot):  # a run can take minutes: say which one is running, and where its output goes
        print(f"[{index[id(run)] + 1}/{len(runs)}] {run.config} seed {run.seed}: running"
              f"{'' if slot is None else ' on GPU ' + slot} (output: {run.run_dir / 'console.txt'})", flush=True)
        return run

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        execute(todo, slots, lambda run, slot: launch_run(announce(run, slot), slot, script, args.gpus_per_run),
                on_done, on_interrupt=stop_trainers)
    except OSError as e:
        print(f"error: could not start {script}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: execute stopped the trainers too; keep what finished
        collect(runs, sweep_dir, metric=metric, baseline=baseline, title=title)
        print("sweep interrupted: run the same command again to continue (finished runs are kept)",
              file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    table = collect(runs, sweep_dir, metric=metric, baseline=baseline, title=title)
    print(table, end="")
    print(f"wrote {sweep_dir / 'results.csv'}, {sweep_dir / 'results.md'}, {sweep_dir / 'loss_curves.png'}")
    return 1 if state["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
