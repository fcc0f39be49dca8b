"""Places two runs share: the no-room folder in TMPDIR is keyed by the run folder, not its RUN_ID; the lock
is taken before anything in the folder is written and its failures are one line; a second identical
sweep touches nothing of the running one's folder."""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primitives.files import lock_holder
from tests.test_sweep import FAKE_TRAINER, run_cli
from tests.test_train import REPO, trainer_env
from trainer.interrupt import fallback_dir


def test_the_no_room_folder_is_keyed_by_the_run_folder_not_its_run_id(tmp_path):
    a, b = tmp_path / "out_a" / "r", tmp_path / "out_b" / "r"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    assert fallback_dir(a) != fallback_dir(b)  # one RUN_ID in two OUT_DIRs: two places
    assert fallback_dir(a) == fallback_dir(a) and fallback_dir(a).name.startswith("r-")
    (tmp_path / "link").symlink_to(tmp_path / "out_a")
    assert fallback_dir(tmp_path / "link" / "r") == fallback_dir(a)  # the same folder through a link


def train(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def assert_one_line(proc, pattern_start: str):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith(pattern_start), lines[0]


@pytest.mark.parametrize("kind", ["folder", "dangling_link", "read_only"])
def test_a_run_lock_that_cannot_be_opened_is_one_line_and_nothing_is_written(tiny_dataset, sp1024_model, tmp_path, kind):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    lock = run_dir / "run.lock"
    if kind == "folder":
        lock.mkdir()
    elif kind == "dangling_link":
        lock.symlink_to(tmp_path / "elsewhere" / "lockfile")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        run_dir.chmod(0o555)
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path / "runs", RUN_ID="r")
    proc = train(env)
    run_dir.chmod(0o755)
    assert_one_line(proc, f"error: RUN_ID='r': {lock}: ")
    assert {p.name for p in run_dir.iterdir()} <= {"run.lock"}  # nothing else written
    assert not (tmp_path / "elsewhere").exists()  # a dangling link is never followed


def hold_lock(run_dir: Path, holder: str):
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / "run.lock", "a+", encoding="utf-8")
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.write(holder + "\n")
    handle.flush()
    return handle


def test_lock_holder_names_the_holder_and_only_while_it_holds(tmp_path):
    run_dir = tmp_path / "r"
    assert lock_holder(run_dir / "run.lock") is None  # no file
    handle = hold_lock(run_dir, "pid 1 on host since now")
    assert lock_holder(run_dir / "run.lock") == "pid 1 on host since now"
    handle.close()
    assert lock_holder(run_dir / "run.lock") is None


def test_a_second_identical_sweep_leaves_the_running_ones_folder_alone(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    args = ["--name", "twin", "--out", str(tmp_path), "--seeds", "1", "--gpus", "", "--script", str(script), "--config", "a"]
    run_dir = tmp_path / "twin" / "a" / "seed1"
    handle = hold_lock(run_dir, "pid 4242 on host since then")  # the first sweep's trainer, running
    (run_dir / "console.txt").write_text("the first sweep's output\n")
    (run_dir / "sweep_run.json").write_text("{}")
    proc = run_cli(args, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (f"error: {run_dir}: being written by another run (pid 4242 on host since then); expected one "
                        "sweep per run folder (wait for the other sweep, or use another --out)")
    assert (run_dir / "console.txt").read_text() == "the first sweep's output\n"  # before: truncated
    assert (run_dir / "sweep_run.json").read_text() == "{}"
    handle.close()
    assert run_cli(args, timeout=120).returncode == 0  # once it is done, the sweep runs it


def test_launch_run_touches_nothing_of_a_folder_another_trainer_holds(tmp_path):
    from tools.sweeps.sweep import RUN_FOLDER_BUSY, launch_run
    from tools.sweeps.sweep_spec import SweepRun

    run_dir = tmp_path / "a" / "seed1"
    handle = hold_lock(run_dir, "pid 7 on host since then")
    (run_dir / "console.txt").write_text("running\n")
    run = SweepRun("a", 1, {}, {"SEED": "1"}, run_dir)
    assert launch_run(run, None, Path(sys.executable)) == RUN_FOLDER_BUSY
    assert (run_dir / "console.txt").read_text() == "running\n" and not (run_dir / "sweep_run.json").exists()
    handle.close()
