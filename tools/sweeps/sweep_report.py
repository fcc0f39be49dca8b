"""What a sweep's run folders hold, collected for tools/sweep.py: each run's result.json as one row
of results.csv, the per-config table of results.md (mean, std, n, steps, ms per step; sorted by
val_bpb, with a "vs baseline" column) and loss_curves.png (every run's train loss).
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from pathlib import Path

from tools.record.runs import final_score_key
from tools.sweeps.sweep_spec import SweepRun
from primitives.files import atomic_write_bytes

CSV_FIELDS = ("config", "seed", "status", "val_bpb", "val_bpb_sliding", "val_bpb_ttt", "val_bpb_roundtrip", "val_bpb_prequant",
              "val_loss_sliding", "steps", "ms_per_step", "train_seconds", "eval_seconds", "bytes_total",
              "settings", "run_dir")


# -----------------------------------------------------------------------------------------------
# a run folder
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
    """Per config: n, mean, std, min, max of val_bpb, mean steps, ms per step and bytes of the runs that
    finished (those with a finite val_bpb, as n counts them: a failed, diverged or unfinished run's steps are not a
    result); sorted by mean val_bpb (configs with no result last). `vs` = mean - the baseline config's mean."""
    groups = {}
    for row in rows:
        groups.setdefault(row["config"], []).append(row)
    out = []
    for config, group in groups.items():
        done = [r for r in group if r["val_bpb"] is not None and math.isfinite(r["val_bpb"])]  # nonfinite_*: no score
        values = [r["val_bpb"] for r in done]
        out.append({"config": config, "n": len(values), "runs": len(group),
                    "mean": statistics.fmean(values) if values else None,
                    "std": statistics.stdev(values) if len(values) > 1 else None,
                    "min": min(values, default=None), "max": max(values, default=None),
                    "steps": _mean([r["steps"] for r in done]), "ms_per_step": _mean([r["ms_per_step"] for r in done]),
                    "bytes_total": _mean([r["bytes_total"] for r in done]), "settings": group[0]["settings"]})
    base = next((s["mean"] for s in out if s["config"] == baseline), None)
    for s in out:
        s["vs"] = s["mean"] - base if s["mean"] is not None and base is not None else None
    return sorted(out, key=lambda s: (s["mean"] is None, s["mean"] if s["mean"] is not None else 0.0))


def fmt(value, spec: str, empty: str = "") -> str:
    return empty if value is None else format(value, spec)


def format_table(summary: list, *, metric: str, baseline: str | None, title: str) -> str:
    """The Markdown table of `summarize`."""
    vs = f" | vs {baseline}" if baseline else ""
    which = "headline (TTT or sliding)" if metric == "final" else metric
    lines = [f"# {title}", "",
             f"val_bpb = final {which} val_bpb; mean and std over seeds (n finished of runs); steps and ms per "
             "step are means over the finished runs.", "",
             f"| config | val_bpb mean | std | n | min | max{vs} | steps | ms/step | bytes_total | settings |",
             "|---|---:|---:|---:|---:|---:" + "|---:" * bool(baseline) + "|---:|---:|---:|---|"]
    for s in summary:
        cells = [s["config"], fmt(s["mean"], ".5f", "-"), fmt(s["std"], ".5f", "-"), f"{s['n']}/{s['runs']}",
                 fmt(s["min"], ".5f", "-"), fmt(s["max"], ".5f", "-")]
        if baseline:
            cells.append(fmt(s["vs"], "+.5f", "-"))
        cells += [fmt(s["steps"], ".0f", "-"), fmt(s["ms_per_step"], ".0f", "-"), fmt(s["bytes_total"], ",.0f", "-"),
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

