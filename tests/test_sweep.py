"""tools/sweep.py: a grid of configurations x seeds, resumable, collected into a CSV, a table and a plot."""

import csv
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tools.sweeps import sweep, sweep_report, sweep_spec
from tests.test_train import TINY_ENV

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A stand-in trainer: writes the result.json a run would, from its env, after a short sleep, and
# records when it ran and on which CUDA_VISIBLE_DEVICES.
FAKE_TRAINER = r'''
import json, os, sys, time
from pathlib import Path
t0 = time.time()
run_dir = Path(os.environ["OUT_DIR"]) / os.environ["RUN_ID"]
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "pid").write_text(str(os.getpid()))
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
if os.environ.get("FAKE_CRASH") == os.environ["SEED"]:
    sys.exit(3)
seed, lr = int(os.environ["SEED"]), float(os.environ.get("MATRIX_LR", "0.04"))
result = {"status": "ok", "seed": seed, "val_bpb_sliding": lr * 10 + seed / 1000, "val_bpb_roundtrip": 2.0,
          "steps": 10, "ms_per_step": 100.0 + seed, "bytes_total": 1000, "train_losses": [5.0 - 0.1 * i for i in range(10)],
          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "resume": os.environ.get("RESUME"),
          "t0": t0, "t1": time.time()}
(run_dir / "result.json").write_text(json.dumps(result))
'''


def run_cli(args, cwd=REPO, timeout=900):
    return subprocess.run([sys.executable, str(REPO / "tools" / "sweep.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def fake_trainer(tmp_path):
    path = tmp_path / "fake_trainer.py"
    path.write_text(FAKE_TRAINER)
    return path


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_cpu_sweep_end_to_end_and_a_rerun_skips_finished_runs(tiny_dataset, sp1024_model, tmp_path):
    env = {**TINY_ENV, "ITERATIONS": "4", "VAL_MAX_TOKENS": "2048", "DATA_PATH": str(tiny_dataset),
           "TOKENIZER_PATH": str(sp1024_model)}
    env.pop("SEED")
    args = ["--name", "tiny", "--out", str(tmp_path / "runs"), "--seeds", "1", "2", "--gpus", "",
            "--set", *(f"{k}={v}" for k, v in env.items()), "--config", "base", "--config", "low_lr", "MATRIX_LR=0.01"]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep_dir = tmp_path / "runs" / "tiny"
    for i, (config, seed) in enumerate([("base", 1), ("base", 2), ("low_lr", 1), ("low_lr", 2)]):
        assert f"[{i + 1}/4] {config} seed {seed}: ok val_bpb " in proc.stdout
    results = {(c, s): json.loads((sweep_dir / c / f"seed{s}" / "result.json").read_text())
               for c in ("base", "low_lr") for s in (1, 2)}
    assert results[("low_lr", 1)]["hyperparameters"]["matrix_lr"] == 0.01
    assert results[("base", 2)]["hyperparameters"]["seed"] == 2 and results[("base", 2)]["steps"] == 4
    rows = read_csv(sweep_dir / "results.csv")
    assert [(r["config"], r["seed"], r["status"]) for r in rows] == [
        ("base", "1", "ok"), ("base", "2", "ok"), ("low_lr", "1", "ok"), ("low_lr", "2", "ok")]
    for r in rows:
        assert float(r["val_bpb"]) == results[(r["config"], int(r["seed"]))]["val_bpb_sliding"]
    table = (sweep_dir / "results.md").read_text()
    means = {c: statistics.fmean(results[(c, s)]["val_bpb_sliding"] for s in (1, 2)) for c in ("base", "low_lr")}
    stds = {c: statistics.stdev([results[(c, s)]["val_bpb_sliding"] for s in (1, 2)]) for c in ("base", "low_lr")}
    order = sorted(means, key=means.get)
    lines = [line for line in table.splitlines() if line.startswith(("| base ", "| low_lr "))]
    assert [line.split(" | ")[0][2:] for line in lines] == order  # sorted by mean val_bpb
    for c in ("base", "low_lr"):
        assert f"| {c} | {means[c]:.5f} | {stds[c]:.5f} | 2/2 |" in table
    png = (sweep_dir / "loss_curves.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000

    stamps = {k: (sweep_dir / k[0] / f"seed{k[1]}" / "result.json").stat().st_mtime_ns for k in results}
    again = run_cli(args)
    assert again.returncode == 0, again.stderr
    assert "4 finished, 0 to run" in again.stdout and again.stdout.count("skipped (finished)") == 4
    assert stamps == {k: (sweep_dir / k[0] / f"seed{k[1]}" / "result.json").stat().st_mtime_ns for k in results}
    assert read_csv(sweep_dir / "results.csv") == rows


def test_gpu_slots_run_one_run_per_gpu_at_a_time(fake_trainer, tmp_path):
    """`--gpus 0,1`: two runs at once, each with its own CUDA_VISIBLE_DEVICES, never two on one GPU."""
    args = ["--name", "gpu", "--out", str(tmp_path), "--seeds", "1", "2", "3", "--gpus", "0,1", "--script",
            str(fake_trainer), "--set", "FAKE_SLEEP=0.5", "--config", "a", "--config", "b", "MATRIX_LR=0.02"]
    proc = run_cli(args, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "GPUs 0 | 1, one run per slot" in proc.stdout
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("gpu/*/seed*/result.json"))]
    assert len(results) == 6
    by_gpu = {}
    for r in results:
        by_gpu.setdefault(r["cuda_visible_devices"], []).append((r["t0"], r["t1"]))
    assert set(by_gpu) == {"0", "1"}
    for spans in by_gpu.values():  # runs on one GPU never overlap
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    first = [min(spans) for spans in by_gpu.values()]  # the two GPUs' first runs ran at the same time
    assert max(a[0] for a in first) < min(a[1] for a in first)
    table = (tmp_path / "gpu" / "results.md").read_text()
    assert table.index("| b | 0.20200 |") < table.index("| a | 0.40200 |")  # sorted by val_bpb
    assert "| b | 0.20200 | 0.00100 | 3/3 | 0.20100 | 0.20300 | 10 | 102 | 1,000 | `MATRIX_LR=0.02` |" in table


def test_torchrun_slots_group_the_gpus():
    assert sweep.make_slots([str(i) for i in range(8)], 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert sweep.make_slots(["3", "5", "7"], 2) == ["3,5"]
    assert sweep.make_slots([], 1) == [None]
    with pytest.raises(sweep_spec.SweepError, match="--gpus-per-run 4: expected 1..2"):
        sweep.make_slots(["0", "1"], 4)


def test_execute_never_runs_two_runs_in_one_slot():
    runs = [sweep_spec.SweepRun("c", s, {}, {}, Path("/nonexistent")) for s in range(9)]
    busy, seen, lock, done = {}, [], threading.Lock(), []

    def launch(run, slot):
        with lock:
            assert not busy.get(slot), f"slot {slot} already busy"
            busy[slot] = True
            seen.append(run.seed)
        time.sleep(0.02)
        with lock:
            busy[slot] = False
        return 0

    sweep.execute(runs, ["0", "1", "2"], launch, lambda run, rc, s: done.append(run.seed))
    assert sorted(seen) == list(range(9)) and sorted(done) == list(range(9))


def test_a_crashed_run_is_reported_and_rerun_next_time(fake_trainer, tmp_path):
    args = ["--name", "crash", "--out", str(tmp_path), "--seeds", "1", "2", "--gpus", "", "--script",
            str(fake_trainer), "--config", "a"]
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "sweep.py"), *args], capture_output=True, text=True,
                          env={**os.environ, "FAKE_CRASH": "2"}, timeout=120)
    assert proc.returncode == 1
    assert "[2/2] a seed 2: FAILED (exit 3; see" in proc.stdout and "[1/2] a seed 1: ok val_bpb 0.40100" in proc.stdout
    rows = read_csv(tmp_path / "crash" / "results.csv")
    assert [(r["seed"], r["status"]) for r in rows] == [("1", "ok"), ("2", "missing")]
    again = run_cli(args, timeout=120)
    assert again.returncode == 0 and "1 finished, 1 to run" in again.stdout
    assert "[2/2] a seed 2: ok" in again.stdout


def test_a_stopped_sweep_stops_its_trainer_and_continues_later(fake_trainer, tmp_path):
    args = [sys.executable, str(REPO / "tools" / "sweep.py"), "--name", "stop", "--out", str(tmp_path), "--gpus", "",
            "--script", str(fake_trainer), "--seeds", "1", "2", "--config", "a"]
    proc = subprocess.Popen([*args, "--set", "FAKE_SLEEP=60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file = tmp_path / "stop" / "a" / "seed1" / "pid"
    deadline = time.monotonic() + 60
    while not pid_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    trainer_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "sweep interrupted: run the same command again" in err
    with pytest.raises(ProcessLookupError):
        os.kill(trainer_pid, 0)  # the trainer was stopped and reaped, not orphaned
    assert not (tmp_path / "stop" / "a" / "seed2").exists()  # nothing new started after the stop
    again = subprocess.run([*args, "--set", "FAKE_SLEEP=0"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 finished, 2 to run" in again.stdout, again.stderr
    assert "[1/2] a seed 1: ok" in again.stdout and "[2/2] a seed 2: ok" in again.stdout


def test_a_stopped_multi_gpu_sweep_stops_every_trainer_before_it_collects(fake_trainer, tmp_path):
    """Two slots: the stop ends both runs in flight, their workers finish before the sweep's last
    collect (no two writers of results.csv), and nothing new starts."""
    args = [sys.executable, str(REPO / "tools" / "sweep.py"), "--name", "stop2", "--out", str(tmp_path), "--gpus",
            "0,1", "--script", str(fake_trainer), "--seeds", "1", "2", "3", "--config", "a", "--set", "FAKE_SLEEP=60"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_files = [tmp_path / "stop2" / "a" / f"seed{s}" / "pid" for s in (1, 2)]
    deadline = time.monotonic() + 60
    while not all(p.is_file() and p.read_text() for p in pid_files) and time.monotonic() < deadline:
        time.sleep(0.1)
    trainer_pids = [int(p.read_text()) for p in pid_files]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "sweep interrupted: run the same command again" in err, err
    assert "Traceback" not in err
    for pid in trainer_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (tmp_path / "stop2" / "a" / "seed3").exists()
    rows = read_csv(tmp_path / "stop2" / "results.csv")
    assert [(r["seed"], r["status"]) for r in rows] == [("1", "missing"), ("2", "missing"), ("3", "missing")]
    assert not list((tmp_path / "stop2").glob(".*.tmp*"))  # no temp file left by a racing writer


def test_only_runs_the_named_configs_in_that_order_and_the_table_lists_all(fake_trainer, tmp_path):
    base = ["--name", "o", "--out", str(tmp_path), "--gpus", "", "--script", str(fake_trainer), "--seeds", "1",
            "--config", "a", "--config", "b", "MATRIX_LR=0.02", "--config", "c", "MATRIX_LR=0.03"]
    proc = run_cli([*base, "--only", "c", "a"], timeout=120)
    assert proc.returncode == 0 and "0 finished, 2 to run (--only c a)" in proc.stdout, proc.stderr
    ran = [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("[") and ": running" not in line]
    started = [line.split(":")[0] for line in proc.stdout.splitlines() if ": running (output: " in line]
    assert started == ["[3/3] c seed 1", "[1/3] a seed 1"]  # each run says it started, and where its output goes
    assert ran == ["[3/3] c seed 1", "[1/3] a seed 1"]
    rows = read_csv(tmp_path / "o" / "results.csv")
    assert [(r["config"], r["status"]) for r in rows] == [("a", "ok"), ("b", "missing"), ("c", "ok")]
    again = run_cli([*base, "--dry-run"], timeout=120)
    assert "2 finished, 1 to run;" in again.stdout and "to run    b seed 1" in again.stdout


def test_a_stopped_run_with_a_checkpoint_resumes_with_the_same_settings_only(fake_trainer, tmp_path, capsys):
    base = ["--name", "r", "--out", str(tmp_path), "--gpus", "", "--script", str(fake_trainer), "--seeds", "1", "2",
            "--set", "CHECKPOINT_EVERY=5", "--config", "a"]
    runs = sweep_spec.build_runs(sweep_spec.spec_from_args(sweep.build_parser().parse_args(base)), tmp_path)
    for run, env in zip(runs, (runs[0].env, {**runs[1].env, "MATRIX_LR": "0.01"})):  # seed 2: other settings
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "sweep_run.json").write_text(json.dumps({"env": env}))
        (run.run_dir / "checkpoint.pt").write_bytes(b"state")
        (run.run_dir / "console.txt").write_text("before the stop\n")
    assert run_cli(base, timeout=120).returncode == 0
    assert [json.loads((r.run_dir / "result.json").read_text())["resume"] for r in runs] == ["1", None]
    assert (runs[0].run_dir / "console.txt").read_text().startswith("before the stop")
    assert json.loads((runs[0].run_dir / "sweep_run.json").read_text())["env"] == runs[0].env  # no RESUME in it
    assert sweep.main([*base, "--set", "RESUME=1"]) == 2  # the sweep decides
    assert "['RESUME'] are set by the sweep for each run" in capsys.readouterr().err


def test_a_finished_run_with_other_settings_is_refused(fake_trainer, tmp_path):
    base = ["--name", "s", "--out", str(tmp_path), "--gpus", "", "--script", str(fake_trainer)]
    assert run_cli([*base, "--config", "a", "MATRIX_LR=0.02"], timeout=120).returncode == 0
    proc = run_cli([*base, "--config", "a", "MATRIX_LR=0.03"], timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: config 'a' seed 1337: {tmp_path / 's' / 'a' / 'seed1337'} finished with other settings "
        "(MATRIX_LR differ); give the config a new name or delete that folder"]


def test_spec_file_grid_and_names(tmp_path):
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text("name: g\nseeds: [1, 2]\nenv: {PRESET: smoke, ITERATIONS: 150}\n"
                         "configs:\n  base: {}\n  mlp2: {MLP_MULT: 2}\ngrid: {MATRIX_LR: [0.03, 0.04]}\n")
    runs = sweep_spec.build_runs(sweep_spec.load_spec_file(spec_path), tmp_path / "runs")
    assert [(r.config, r.seed) for r in runs][:4] == [("base,MATRIX_LR=0.03", 1), ("base,MATRIX_LR=0.03", 2),
                                                      ("base,MATRIX_LR=0.04", 1), ("base,MATRIX_LR=0.04", 2)]
    assert len(runs) == 8 and runs[-1].config == "mlp2,MATRIX_LR=0.04"
    last = runs[-1]
    assert last.env == {"PRESET": "smoke", "ITERATIONS": "150", "MLP_MULT": "2", "MATRIX_LR": "0.04", "SEED": "2",
                        "RUN_ID": "seed2", "OUT_DIR": str(tmp_path / "runs" / "g" / "mlp2,MATRIX_LR=0.04")}
    assert last.run_dir == tmp_path / "runs" / "g" / "mlp2,MATRIX_LR=0.04" / "seed2"
    grid_only = sweep_spec.build_runs({"name": "x", "grid": {"MATRIX_LR": [0.03, 0.04]}}, tmp_path)
    assert [r.config for r in grid_only] == ["MATRIX_LR=0.03", "MATRIX_LR=0.04"]
    json_path = tmp_path / "s.json"
    json_path.write_text(json.dumps({"name": "j", "configs": {"a": {"TIE_EMBEDDINGS": True}}}))
    assert sweep_spec.build_runs(sweep_spec.load_spec_file(json_path), tmp_path)[0].settings == {"TIE_EMBEDDINGS": "1"}


@pytest.mark.parametrize("args,message", [
    (["--name", "x", "--config", "a", "MATRIX_LR"], "--config a: 'MATRIX_LR': expected NAME=VALUE"),
    (["--name", "x", "--config", "a", "--config", "a"], "--config a: defined twice"),
    (["--name", "x", "--set", "SEED=3"], "config 'base': ['SEED'] are set by the sweep for each run"),
    (["--name", "a/b"], "name 'a/b': expected letters, digits"),
    (["--config", "a"], "--name: a sweep needs a name"),
    (["--name", "x", "--config", "a", "MATRIX_LRR=0.1"], "config 'a': ['MATRIX_LRR'] are not settings of train_gpt.py"),
    (["--name", "x", "--config", "a", "NUM_LAYERS=two"], "config 'a': NUM_LAYERS='two': expected a whole number"),
    (["--name", "x", "--baseline", "zzz"], "baseline 'zzz': not a config of this sweep"),
    (["--name", "x", "--seeds", "1", "1"], "seeds [1, 1]: a seed is listed twice"),
    (["--name", "x", "--config", "a", "--only", "a", "b"], "--only b: not a config of this sweep"),
    (["--file", "/nonexistent/s.yaml"], "--file /nonexistent/s.yaml: No such file or directory"),
])
def test_bad_sweep_definitions_exit_2_with_one_line(args, message, tmp_path, capsys):
    assert sweep.main([*args, "--out", str(tmp_path), "--gpus", ""]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], captured.err
    assert captured.out == "" and not any(tmp_path.iterdir())  # nothing ran


def test_bad_spec_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(sweep_spec.SweepError, match="not valid YAML"):
        sweep_spec.load_spec_file(bad)
    bad.write_text("name: x\nconfig: {}\n")
    with pytest.raises(sweep_spec.SweepError, match=r"unknown keys \['config'\]"):
        sweep_spec.load_spec_file(bad)
    with pytest.raises(sweep_spec.SweepError, match="configs.a: 'lr' is not an upper-case env var name"):
        sweep_spec.build_runs({"name": "x", "configs": {"a": {"lr": 1}}}, tmp_path)


def test_summary_sorts_by_mean_and_marks_configs_without_results():
    rows = [{"config": c, "seed": s, "val_bpb": v, "steps": 150, "ms_per_step": ms, "bytes_total": 10, "settings": ""}
            for c, s, v, ms in (("a", 1, 2.30, 1600), ("a", 2, 2.32, 1700), ("b", 1, 2.20, 1500), ("b", 2, 2.26, 1500),
                                ("c", 1, None, None))]
    summary = sweep_report.summarize(rows, baseline="a")
    assert [s["config"] for s in summary] == ["b", "a", "c"]
    b = summary[0]
    assert b["mean"] == pytest.approx(2.23) and b["std"] == pytest.approx(math.sqrt(0.0018))
    assert b["vs"] == pytest.approx(-0.08) and summary[1]["ms_per_step"] == 1650
    table = sweep_report.format_table(summary, metric="sliding", baseline="a", title="t")
    assert "| b | 2.23000 | 0.04243 | 2/2 | 2.20000 | 2.26000 | -0.08000 | 150 | 1500 | 10 |  |" in table
    # a config with no finished run shows no steps, ms/step or bytes (its run's steps are not a result)
    assert "| c | - | - | 0/1 | - | - | - | - | - | - |  |" in table
    rows[0]["val_bpb"] = None  # a's first run did not finish: a's steps and ms/step are its finished run's
    a = next(s for s in sweep_report.summarize(rows) if s["config"] == "a")
    assert (a["n"], a["runs"], a["ms_per_step"]) == (1, 2, 1700)


def test_result_rows_read_a_status_less_result_json_as_ok_like_the_resume_check(tmp_path):
    """One reading of result.json: a run without "status" is "ok" for the table as for is_finished
    (and make_record, significance); a run without result.json is "missing"."""
    runs = sweep_spec.build_runs({"name": "rows", "seeds": [1, 2, 3], "configs": {"a": {"MATRIX_LR": 0.02}}}, tmp_path)
    runs[0].run_dir.mkdir(parents=True)
    (runs[0].run_dir / "result.json").write_text(json.dumps({"val_bpb_sliding": 2.5, "steps": 7, "bytes_total": 9}))
    runs[1].run_dir.mkdir(parents=True)
    (runs[1].run_dir / "result.json").write_text(json.dumps({"status": "stopped_by_signal", "steps": 3}))
    rows = sweep_report.result_rows(runs, "sliding")
    assert [(r["status"], r["val_bpb"], r["steps"]) for r in rows] == [
        ("ok", 2.5, 7), ("stopped_by_signal", None, 3), ("missing", None, None)]
    assert rows[0]["bytes_total"] == 9 and rows[0]["settings"] == "MATRIX_LR=0.02" and rows[0]["seed"] == 1
    assert [sweep.is_finished(r) for r in runs] == [True, False, False]


def test_a_nonfinite_result_is_final_not_rerun_and_has_no_score_in_the_table(tmp_path):
    """A run that came out NaN (status nonfinite_<phase>, exit 1) is its configuration's outcome: a rerun of
    the same settings repeats it, so a resumed sweep keeps it (it used to rerun every phase but the loss's)
    and the table counts it as a run without a score."""
    runs = sweep_spec.build_runs({"name": "nan", "seeds": [1, 2, 3, 4], "configs": {"a": {"TTT_LR": 1e30}}}, tmp_path)
    results = ({"status": "nonfinite_ttt", "val_bpb_ttt": math.nan, "val_bpb_sliding": 2.5, "steps": 9},
               {"status": "nonfinite_loss", "steps": 4}, {"status": "failed_in_training", "steps": 2},
               {"status": "ok", "val_bpb_ttt": 2.4, "steps": 9})
    for run, result in zip(runs, results):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "result.json").write_text(json.dumps(result))  # NaN as Python's json writes it
    assert [sweep.is_finished(r) for r in runs] == [True, True, False, True]
    assert [sweep.finished_status(s) for s in ("ok", "nonfinite_roundtrip", "interrupted", "missing")] == [
        True, True, False, False]
    (summary,) = sweep_report.summarize(sweep_report.result_rows(runs, "final"))
    assert (summary["n"], summary["runs"], summary["mean"], summary["steps"]) == (1, 4, 2.4, 9)


def test_metric_final_ranks_each_run_by_its_headline_ttt_or_sliding(tmp_path):
    runs = sweep_spec.build_runs({"name": "m", "seeds": [1, 2], "configs": {"a": {}}}, tmp_path)
    for run, result in zip(runs, ({"val_bpb_ttt": 2.4, "val_bpb_roundtrip": 2.6}, {"val_bpb_sliding": 2.5})):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "result.json").write_text(json.dumps(result))
    assert [r["val_bpb"] for r in sweep_report.result_rows(runs, "final")] == [2.4, 2.5]
    assert [r["val_bpb"] for r in sweep_report.result_rows(runs, "ttt")] == [2.4, None]
    assert [r["val_bpb"] for r in sweep_report.result_rows(runs, "sliding")] == [None, 2.5]
    assert [r["val_bpb_ttt"] for r in sweep_report.result_rows(runs, "sliding")] == [2.4, None]
    assert "val_bpb = final headline (TTT or sliding) val_bpb" in sweep_report.format_table([], metric="final", baseline=None,
                                                                                    title="t")


@pytest.mark.parametrize("seeds,message", [
    ("[]", "seeds []: expected a non-empty list of integer seeds"),
    ("0", "seeds 0: expected a non-empty list of integer seeds"),
    ("", "seeds None: expected a non-empty list of integer seeds"),
    ("[1.5]", "seeds [1.5]: expected a list of integers in [0, 2**64) (1.5 is not one)"),
    ("[true, 2]", "seeds [True, 2]: expected a list of integers in [0, 2**64) (True is not one)"),
    ("[-1]", "seeds [-1]: expected a list of integers in [0, 2**64) (-1 is not one)"),
    ("[18446744073709551616]", "(18446744073709551616 is not one)"),
    ("[7, 3, 7]", "seeds [7, 3, 7]: a seed is listed twice; expected each seed once"),
])
def test_sweep_file_seeds_empty_zero_or_not_integers_are_refused(seeds, message, tmp_path, capsys):
    """`seeds: []` and `seeds: 0` ran the default seed 1337 as if nothing was wrong."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: x\nseeds: {seeds}\n")
    assert sweep.main(["--file", str(spec), "--out", str(tmp_path / "runs"), "--gpus", ""]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --file {spec}: seeds") and message in lines[0], captured.err
    assert not (tmp_path / "runs").exists()
    with pytest.raises(sweep_spec.SweepError, match=r"^seeds \[\]: expected a non-empty list"):
        sweep_spec.build_runs({"name": "x", "seeds": []}, tmp_path)
    assert [r.seed for r in sweep_spec.build_runs({"name": "x"}, tmp_path)] == [1337]  # no key: the default


def test_h100_switch_ablation_file_builds_valid_runs_for_every_switch(tmp_path):
    """The one-command H100 ablation: every configuration is settings the trainer accepts, each switch
    of the 1xh100-frontier preset has its own configuration, and `frontier` is that preset."""
    from primitives.presets import PRESETS

    spec = sweep_spec.load_spec_file(REPO / "tools/sweeps/h100_switch_ablation.yaml")
    runs = sweep_spec.build_runs(spec, tmp_path)
    sweep_spec.check_trainer_settings(runs, environ={})
    configs = {r.config: r.env for r in runs}
    assert len(runs) == 2 * len(configs) and spec["baseline"] == "base" and spec["metric"] == "final"
    assert configs["frontier"]["PRESET"] == "1xh100-frontier"
    alone = {k: v for name, env in configs.items() if name not in ("base", "frontier") for k, v in env.items()}
    for key, value in PRESETS["1xh100-frontier"].items():
        assert str(alone[key.upper()]).lower() in (str(value).lower(), str(int(value)) if isinstance(value, bool) else "")


def test_proxy_switches_file_gives_each_configuration_the_steps_of_equal_training_flops(tmp_path):
    """ITERATIONS x FLOPs per token (the run's mean, from the loop start) equals the base's 100 steps' to the
    nearest step, so a costlier step gets fewer steps; every setting is one the trainer accepts."""
    from model.gpt import build_model_config, count_train_flops_per_token
    from primitives.settings import Hyperparameters

    spec = sweep_spec.load_spec_file(REPO / "tools/sweeps/proxy_switches.yaml")
    runs = sweep_spec.build_runs(spec, tmp_path)
    sweep_spec.check_trainer_settings(runs, environ={})
    flops, steps = {}, {}
    for run in runs:
        hp = Hyperparameters.from_env(run.env, log=lambda msg: None)
        flops[run.config] = count_train_flops_per_token(build_model_config(hp), hp.train_seq_len, hp.enable_looping_at)
        steps[run.config] = hp.iterations
    assert steps["base"] == 100 and steps["depth_recurrence"] < 100
    for name in flops:
        assert steps[name] == round(100 * flops["base"] / flops[name]), name
