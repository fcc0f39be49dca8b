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
another. A run whose result.json exists with status ok (or nonfinite_loss: a deterministic
outcome) is finished and skipped; a crashed or interrupted run is run again.

Compare two configurations of a sweep with the significance tool, which reads a config folder as
its group of seeds: `python tools/significance.py --runs runs/<name>/<A> --baseline-runs runs/<name>/<B>`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import itertools
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.cli_errors import USER_ERRORS, ArgumentParser, report_user_error  # noqa: E402
from tools.runs import final_score_key  # noqa: E402
from trainer.files import atomic_write_bytes  # noqa: E402

SWEEP_METRICS = ("sliding", "roundtrip", "prequant", "ttt", "final")  # final: final_score_key, per run
SWEEP_FINISHED = ("ok", "nonfinite_loss")  # result.json statuses that rerunning would not change
SWEEP_RESERVED = ("SEED", "RUN_ID", "OUT_DIR", "CUDA_VISIBLE_DEVICES", "RESUME")  # set by the sweep per run
_LIVE_TRAINERS = set()  # subprocess.Popen of the trainers running now: a stopped sweep stops them too
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.,=+-]*$")
_ENV_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
CSV_FIELDS = ("config", "seed", "status", "val_bpb", "val_bpb_sliding", "val_bpb_ttt", "val_bpb_roundtrip", "val_bpb_prequant",
              "val_loss_sliding", "steps", "ms_per_step", "train_seconds", "eval_seconds", "bytes_total",
              "settings", "run_dir")


class SweepError(ValueError):
    """A bad sweep definition; the message names the option or file entry."""


@dataclasses.dataclass(frozen=True)
class SweepRun:
    config: str
    seed: int
    settings: dict  # the config's own env vars (without the shared env)
    env: dict  # everything the sweep sets for this run (shared env + config + SEED/RUN_ID/OUT_DIR)
    run_dir: Path


# -----------------------------------------------------------------------------------------------
# the sweep definition
# -----------------------------------------------------------------------------------------------


def parse_assignments(items, where: str) -> dict:
    """["K=V", ...] -> {K: V}; SweepError naming `where` for anything else."""
    out = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        if not sep or not _ENV_RE.match(key):
            raise SweepError(f"{where}: {item!r}: expected NAME=VALUE with an upper-case env var name")
        out[key] = value
    return out


def _env_dict(obj, where: str) -> dict:
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise SweepError(f"{where}: expected a mapping of env vars, got {type(obj).__name__}")
    out = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not _ENV_RE.match(key):
            raise SweepError(f"{where}: {key!r} is not an upper-case env var name")
        if isinstance(value, (dict, list)) or value is None:
            raise SweepError(f"{where}: {key}={value!r}: expected a number or a string")
        out[key] = str(int(value)) if isinstance(value, bool) else str(value)
    return out


def load_spec_file(path) -> dict:
    """A sweep file (.yaml/.yml or .json) as a dict; SweepError naming the file when it is unreadable."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SweepError(f"--file {path}: {e.strerror or e}") from None
    try:
        spec = _load_yaml_unique(text, path) if path.suffix in (".yaml", ".yml") else json.loads(
            text, object_pairs_hook=lambda pairs: _unique_pairs(pairs, path))
    except SweepError:
        raise
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError: say where
        mark = getattr(e, "problem_mark", None)
        detail = f"{e.problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else e
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise SweepError(f"--file {path}: not valid {kind} ({detail})") from None
    if not isinstance(spec, dict):
        raise SweepError(f"--file {path}: expected a mapping at the top level")
    unknown = set(spec) - {"name", "seeds", "env", "configs", "grid", "metric", "baseline"}
    if unknown:
        raise SweepError(f"--file {path}: unknown keys {sorted(unknown)} (expected name, seeds, env, configs, grid, "
                         "metric, baseline)")
    return spec


def _unique_pairs(pairs, path, lines=None) -> dict:
    """dict(pairs), or SweepError naming a key that occurs twice (and its lines, when known): YAML and
    JSON loaders keep the last one silently, which would drop a config of the sweep."""
    seen = {}
    for i, (key, _) in enumerate(pairs):
        try:
            hash(key)
        except TypeError:
            raise SweepError(f"--file {path}: key {key!r} is not a name; expected a string key") from None
        if key in seen:
            where = f" (lines {lines[seen[key]]} and {lines[i]})" if lines else ""
            raise SweepError(f"--file {path}: {key!r} is defined twice{where}; expected each name once")
        seen[key] = i
    return dict(pairs)


def _load_yaml_unique(text: str, path):
    """yaml.safe_load that refuses a mapping with a duplicate key (SweepError with both lines)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            own = [(k, v) for k, v in node.value if k.tag != "tag:yaml.org,2002:merge"]
            keys = [(loader.construct_object(k, deep=True), None) for k, _ in own]
            _unique_pairs(keys, path, [k.start_mark.line + 1 for k, _ in own])
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return yaml.load(text, Loader=UniqueKeyLoader)


def build_runs(spec: dict, out_root) -> list:
    """Expand a sweep spec (the file's keys) into SweepRuns: configs x grid x seeds, in that order."""
    name = str(spec.get("name") or "")
    if not _NAME_RE.match(name):
        raise SweepError(f"name {name!r}: expected letters, digits and _.,=+- (it becomes a folder name)")
    seeds = spec.get("seeds") or [1337]
    if not isinstance(seeds, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise SweepError(f"seeds {seeds!r}: expected a list of integers")
    if len(set(seeds)) != len(seeds):
        raise SweepError(f"seeds {seeds!r}: a seed is listed twice")
    shared = _env_dict(spec.get("env"), "env")
    configs = spec.get("configs") or {"base": {}}
    if not isinstance(configs, dict):
        raise SweepError("configs: expected a mapping of config name -> env vars")
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise SweepError("grid: expected a mapping of env var -> non-empty list of values")
    grid_env = {k: [_env_dict({k: v}, "grid")[k] for v in values] for k, values in grid.items()}
    combos = [dict(zip(grid_env, values)) for values in itertools.product(*grid_env.values())]
    sweep_dir = Path(out_root) / name
    runs, names = [], set()
    for config, own in configs.items():
        own = _env_dict(own, f"configs.{config}")
        for combo in combos:
            label = ",".join([str(config)] * bool(not grid_env or len(configs) > 1 or own)
                             + [f"{k}={v}" for k, v in combo.items()])
            if not _NAME_RE.match(label):
                raise SweepError(f"config {label!r}: expected letters, digits and _.,=+- (it becomes a folder name)")
            if label in names:
                raise SweepError(f"config {label!r} is defined twice")
            names.add(label)
            settings = {**own, **combo}
            reserved = sorted(set(SWEEP_RESERVED) & (set(settings) | set(shared)))
            if reserved:
                raise SweepError(f"config {label!r}: {reserved} are set by the sweep for each run")
            for seed in seeds:
                env = {**shared, **settings, "SEED": str(seed), "RUN_ID": f"seed{seed}",
                       "OUT_DIR": str(sweep_dir / label)}
                runs.append(SweepRun(label, seed, settings, env, sweep_dir / label / f"seed{seed}"))
    return runs


def check_trainer_settings(runs: list, environ=None) -> None:
    """Build the kit's Hyperparameters once per config (its seeds differ only in SEED, an integer)
    before anything starts: a value the trainer would refuse, or a name that only looks like one of
    its settings (a typo), is a SweepError naming the config. Hours of sweep lost to MATRIX_LRR are
    worth one import of torch."""
    from trainer.settings import warn_unknown_settings
    from trainer.settings import Hyperparameters

    environ = dict(os.environ if environ is None else environ)
    for run in {run.config: run for run in runs}.values():
        own = {k: v for k, v in run.env.items() if k not in SWEEP_RESERVED}
        unknown = warn_unknown_settings(own, log=lambda msg: None)
        if unknown:
            raise SweepError(f"config {run.config!r}: {unknown} are not settings of train_gpt.py")
        try:
            Hyperparameters.from_env({**environ, **run.env}, log=lambda msg: None)
        except ValueError as e:
            raise SweepError(f"config {run.config!r}: {e}") from None


# -----------------------------------------------------------------------------------------------
# running
# -----------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def read_result(run: SweepRun) -> dict | None:
    """The run's result.json, or None when it has none (never ran, crashed, interrupted)."""
    return _read_json(run.run_dir / "result.json")


def run_status(result: dict | None) -> str:
    """A result.json's status ("ok" when it has none, as in make_record and significance); "missing"
    without a result.json."""
    return "missing" if result is None else result.get("status", "ok")


def recorded_env(run: SweepRun) -> dict | None:
    """The env the sweep last launched this run folder with (its sweep_run.json), or None."""
    return (_read_json(run.run_dir / "sweep_run.json") or {}).get("env")


def is_finished(run: SweepRun) -> bool:
    """Finished = a result.json whose status rerunning would not change, written with these settings.
    A finished run with other settings is a SweepError (rename the config or delete its folder)."""
    if run_status(read_result(run)) not in SWEEP_FINISHED:
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
# collecting
# -----------------------------------------------------------------------------------------------


def metric_bpb(result: dict, metric: str):
    """result.json's final val_bpb of `metric` (SWEEP_METRICS; "final": the run's headline, final_score_key); None if absent."""
    return result.get(f"val_bpb_{final_score_key(result) if metric == 'final' else metric}")


def result_rows(runs: list, metric: str) -> list:
    """One dict per run (CSV_FIELDS); runs without a result.json have status 'missing'."""
    rows = []
    for run in runs:
        result = read_result(run)
        r = result or {}
        rows.append({**{key: r.get(key) for key in CSV_FIELDS}, "config": run.config, "seed": run.seed,
                     "status": run_status(result), "val_bpb": metric_bpb(r, metric),
                     "settings": " ".join(f"{k}={v}" for k, v in run.settings.items()), "run_dir": str(run.run_dir)})
    return rows


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(rows: list, baseline: str | None = None) -> list:
    """Per config: n, mean, std, min, max of val_bpb, mean steps, ms per step and bytes; sorted by mean
    val_bpb (configs with no result last). `vs` = mean - the baseline config's mean."""
    groups = {}
    for row in rows:
        groups.setdefault(row["config"], []).append(row)
    out = []
    for config, group in groups.items():
        values = [r["val_bpb"] for r in group if r["val_bpb"] is not None]
        out.append({"config": config, "n": len(values), "runs": len(group),
                    "mean": statistics.fmean(values) if values else None,
                    "std": statistics.stdev(values) if len(values) > 1 else None,
                    "min": min(values, default=None), "max": max(values, default=None),
                    "steps": _mean([r["steps"] for r in group]), "ms_per_step": _mean([r["ms_per_step"] for r in group]),
                    "bytes_total": _mean([r["bytes_total"] for r in group]), "settings": group[0]["settings"]})
    base = next((s["mean"] for s in out if s["config"] == baseline), None)
    for s in out:
        s["vs"] = s["mean"] - base if s["mean"] is not None and base is not None else None
    return sorted(out, key=lambda s: (s["mean"] is None, s["mean"] if s["mean"] is not None else 0.0))


def _fmt(value, spec: str, empty: str = "") -> str:
    return empty if value is None else format(value, spec)


def format_table(summary: list, *, metric: str, baseline: str | None, title: str) -> str:
    """The Markdown table of `summarize`."""
    vs = f" | vs {baseline}" if baseline else ""
    which = "headline (TTT or sliding)" if metric == "final" else metric
    lines = [f"# {title}", "",
             f"val_bpb = final {which} val_bpb; mean and std over seeds (n finished of runs); steps and ms per "
             "step are means.", "",
             f"| config | val_bpb mean | std | n | min | max{vs} | steps | ms/step | bytes_total | settings |",
             "|---|---:|---:|---:|---:|---:" + "|---:" * bool(baseline) + "|---:|---:|---:|---|"]
    for s in summary:
        cells = [s["config"], _fmt(s["mean"], ".5f", "-"), _fmt(s["std"], ".5f", "-"), f"{s['n']}/{s['runs']}",
                 _fmt(s["min"], ".5f", "-"), _fmt(s["max"], ".5f", "-")]
        if baseline:
            cells.append(_fmt(s["vs"], "+.5f", "-"))
        cells += [_fmt(s["steps"], ".0f", "-"), _fmt(s["ms_per_step"], ".0f", "-"), _fmt(s["bytes_total"], ",.0f", "-"),
                  f"`{s['settings']}`" if s["settings"] else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _csv_bytes(rows: list) -> bytes:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in CSV_FIELDS})
    return buf.getvalue().encode()


def plot_losses(runs: list, path: Path, title: str) -> bool:
    """Every run's per-step train loss (result.json train_losses, moving average over ~2 % of the
    steps) on one PNG, one colour per config, one line style per seed. False when no run has losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(run.config for run in runs))
    seeds = list(dict.fromkeys(run.seed for run in runs))
    cmap = plt.get_cmap("tab10" if len(configs) <= 10 else "tab20")
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    drawn, labelled = False, set()
    for run in runs:
        losses = (read_result(run) or {}).get("train_losses") or []
        if not losses:
            continue
        window = max(1, len(losses) // 50)
        smooth = [statistics.fmean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]
        i = configs.index(run.config)
        ax.plot(range(1, len(smooth) + 1), smooth, styles[seeds.index(run.seed) % len(styles)],
                color=cmap(i % cmap.N), lw=1.1, label=None if run.config in labelled else run.config)
        labelled.add(run.config)
        drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats/token, moving average)")
        ax.set_title(title + (f" ({len(seeds)} seeds: " + ", ".join(f"{s} {styles[k % 4]!r}" for k, s in enumerate(seeds)) + ")"
                              if len(seeds) > 1 else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})
        atomic_write_bytes(path, buf.getvalue())
    plt.close(fig)
    return drawn


def collect(runs: list, sweep_dir: Path, *, metric: str, baseline: str | None, title: str) -> str:
    """Write results.csv, results.md and loss_curves.png of the sweep; returns the Markdown table."""
    rows = result_rows(runs, metric)
    table = format_table(summarize(rows, baseline), metric=metric, baseline=baseline, title=title)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(sweep_dir / "results.csv", _csv_bytes(rows))
    atomic_write_bytes(sweep_dir / "results.md", table.encode())
    plot_losses(runs, sweep_dir / "loss_curves.png", title)
    return table


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


def spec_from_args(args) -> dict:
    spec = load_spec_file(args.file) if args.file else {}
    spec = dict(spec)
    if args.name:
        spec["name"] = args.name
    if args.seeds:
        spec["seeds"] = args.seeds
    if args.set:
        spec["env"] = {**_env_dict(spec.get("env"), "env"), **parse_assignments(args.set, "--set")}
    if args.config:
        configs = dict(spec.get("configs") or {})
        for name, *items in args.config:
            if name in configs:
                raise SweepError(f"--config {name}: defined twice")
            configs[name] = parse_assignments(items, f"--config {name}")
        spec["configs"] = configs
    if args.grid:
        grid = dict(spec.get("grid") or {})
        for key, values in parse_assignments(args.grid, "--grid").items():
            grid[key] = values.split(",")
        spec["grid"] = grid
    for key in ("metric", "baseline"):
        if getattr(args, key):
            spec[key] = getattr(args, key)
    if not spec.get("name"):
        raise SweepError("--name: a sweep needs a name (or `name:` in --file)")
    if spec.get("metric", "sliding") not in SWEEP_METRICS:
        raise SweepError(f"metric {spec['metric']!r}: expected one of {', '.join(SWEEP_METRICS)}")
    return spec


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
        if r is None or rc != 0 and status not in SWEEP_FINISHED:
            state["failed"] += 1
            print(f"{head} FAILED (exit {rc}; see {run.run_dir / 'console.txt'}) in {_duration(seconds)}; "
                  f"{left} left", flush=True)
        else:
            bpb = metric_bpb(r, metric)
            print(f"{head} {status} val_bpb {_fmt(bpb, '.5f', '-')} ({metric}) steps {r.get('steps')} "
                  f"{_fmt(r.get('ms_per_step'), '.0f', '-')} ms/step in {_duration(seconds)}; {left} left"
                  + (f", ~{_duration(eta)} to go" if left else ""), flush=True)
        collect(runs, sweep_dir, metric=metric, baseline=baseline, title=title)

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        execute(todo, slots, lambda run, slot: launch_run(run, slot, script, args.gpus_per_run), on_done,
                on_interrupt=stop_trainers)
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
