"""The run folder: one writer (an OS lock), RESUME=1 bound to the interrupted run's settings and
inputs, a finished result never overwritten.

Interrupted runs are fabricated where the refusal comes before any weights are read (the settings
file, a stand-in trained.safetensors); the two-trainers test runs real trainers at once.
"""

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import train_gpt
from tests.test_inputs import ctx, hp_for
from tests.test_train import REPO, read_result, trainer_env
from trainer.checks import run_inputs
from trainer.runfolder import (LOCK_FILE, RUN_ONLY_SETTINGS, SETTINGS_FILE, check_resume_binding, lock_run_folder,
                               run_binding)
from primitives.settings import Hyperparameters


def folder_digest(run_dir: Path) -> dict:
    """name -> sha256 of every file in the run folder (the lock file's holder line aside)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run_dir.iterdir()) if p.name != LOCK_FILE}


def changed_value(name: str, value):
    """A different valid-looking value of the same type for setting `name`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return value + "_other"


def test_resume_refuses_a_change_to_any_setting_that_decides_the_weights_or_the_score(tiny_dataset, sp1024_model,
                                                                                       tmp_path):
    """Derived from the settings class: every field but the run-only allow-list is bound."""
    hp = hp_for(tiny_dataset, sp1024_model, RUN_ID="r")
    inputs = run_inputs(hp)
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(run_binding(hp, inputs, environ={"QUANT_COMPRESSOR": "zstd"})))
    bound = [f.name for f in dataclasses.fields(Hyperparameters) if f.name not in RUN_ONLY_SETTINGS]
    assert {"seed", "data_path", "iterations", "matrix_lr", "tokenizer_path", "val_max_tokens", "eval_stride",
            "ttt_epochs", "max_wallclock_seconds"} <= set(bound)
    for name in bound:
        old = getattr(hp, name)
        new = dataclasses.replace(hp, **{name: changed_value(name, old)})
        with pytest.raises(ValueError) as err:
            check_resume_binding(tmp_path, run_binding(new, inputs, environ={"QUANT_COMPRESSOR": "zstd"}))
        assert str(err.value).startswith(f"RESUME=1: {name.upper()} is {getattr(new, name)!r}; the interrupted run in "
                                         f"{tmp_path} had {old!r}; expected the same value"), name
    for name in RUN_ONLY_SETTINGS:  # threads, log cadence, ...: how it runs, not what it computes
        value = getattr(hp, name)
        check_resume_binding(tmp_path, run_binding(dataclasses.replace(hp, **{name: changed_value(name, value)}), inputs,
                                                   environ={"QUANT_COMPRESSOR": "zstd"}))
    with pytest.raises(ValueError, match=r"RESUME=1: QUANT_COMPRESSOR is 'brotli'; the interrupted run .* had 'zstd'"):
        check_resume_binding(tmp_path, run_binding(hp, inputs, environ={"QUANT_COMPRESSOR": "brotli"}))
    with pytest.raises(ValueError, match=r"RESUME=1: QUANT_COMPRESSOR is 'unset'; the interrupted run .* had 'zstd'"):
        check_resume_binding(tmp_path, run_binding(hp, inputs, environ={}))
    other = dict(inputs, tokenizer_sha256="0" * 64)
    with pytest.raises(ValueError, match=r"RESUME=1: TOKENIZER_PATH \(its sha256\) is '0{64}'; the interrupted run"):
        check_resume_binding(tmp_path, run_binding(hp, other, environ={"QUANT_COMPRESSOR": "zstd"}))


def interrupted_folder(tiny_dataset, sp1024_model, out: Path, monkeypatch, **settings) -> Path:
    """A run folder as a signal after training leaves it (result.json status interrupted, trained
    weights, the binding), written for the trainer environment `settings`; the environment is set."""
    env = trainer_env(tiny_dataset, sp1024_model, out, RUN_ID="cut", **settings)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    hp = Hyperparameters.from_env(log=lambda *_: None)
    run_dir = out / "cut"
    run_dir.mkdir(parents=True)
    (run_dir / SETTINGS_FILE).write_text(json.dumps(run_binding(hp, run_inputs(hp))))
    (run_dir / "result.json").write_text(json.dumps(dict(status="interrupted", val_bpb_roundtrip=2.7040,
                                                         hyperparameters=dataclasses.asdict(hp))))
    (run_dir / "trained.safetensors").write_bytes(b"weights of the interrupted run")
    (run_dir / "final_model.ptz").write_bytes(b"the interrupted run's artifact")
    (run_dir / "train.log").write_text("the interrupted run's log\n")
    return run_dir


@pytest.mark.parametrize("name,value", [("SEED", "8"), ("ITERATIONS", "9"), ("MATRIX_LR", "0.05"),
                                        ("VAL_MAX_TOKENS", "8192"), ("QUANT_COMPRESSOR", "brotli")])
def test_resume_with_a_changed_setting_is_refused_and_nothing_is_overwritten(tiny_dataset, sp1024_model, tmp_path,
                                                                              monkeypatch, name, value):
    """Before: accepted silently; result.json and final_model.ptz were overwritten by a mixed recipe."""
    run_dir = interrupted_folder(tiny_dataset, sp1024_model, tmp_path, monkeypatch)
    before = folder_digest(run_dir)
    monkeypatch.setenv("RESUME", "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^RESUME=1: {name} is '?{re.escape(value)}'?; the interrupted run in "
                                         rf"{run_dir} had .*; expected the same value"):
        train_gpt.main()
    assert folder_digest(run_dir) == before


def test_resume_with_the_same_settings_gets_past_the_binding(tiny_dataset, sp1024_model, tmp_path, monkeypatch):
    """The control: the same settings (and another thread count) reach the saved weights (a stand-in here)."""
    interrupted_folder(tiny_dataset, sp1024_model, tmp_path, monkeypatch)
    monkeypatch.setenv("RESUME", "1")
    monkeypatch.setenv("NUM_THREADS", "1")
    with pytest.raises(ValueError, match=r"RESUME=1: \S+/trained.safetensors: not a trained-weights file"):
        train_gpt.main()


def test_resume_of_a_run_that_finished_is_refused(tiny_dataset, sp1024_model, tmp_path, monkeypatch):
    """Before: RESUME=1 on a finished run with a checkpoint.pt retrained it and overwrote its result."""
    run_dir = interrupted_folder(tiny_dataset, sp1024_model, tmp_path, monkeypatch, MAX_WALLCLOCK_SECONDS=0)
    (run_dir / "trained.safetensors").unlink()
    (run_dir / "checkpoint.pt").write_bytes(b"a checkpoint")
    (run_dir / "result.json").write_text(json.dumps(dict(status="ok", val_bpb_sliding=2.7040)))
    before = folder_digest(run_dir)
    monkeypatch.setenv("RESUME", "1")
    with pytest.raises(ValueError, match=rf"^RESUME=True: {run_dir} holds a run that finished \(result.json status ok\); "
                                         "nothing to resume, and its result is kept"):
        train_gpt.main()
    assert folder_digest(run_dir) == before


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    hp = Hyperparameters.from_env({"PRESET": "smoke", "RUN_ID": "r", "OUT_DIR": str(tmp_path)}, log=lambda *_: None)
    run = ctx(tmp_path / "r")
    held = lock_run_folder(run, hp)
    assert re.fullmatch(rf"pid {os.getpid()} on \S+ since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ\n",
                        (tmp_path / "r" / LOCK_FILE).read_text())
    with pytest.raises(ValueError, match=rf"^RUN_ID='r': {tmp_path}/r is being written by another run \(pid "
                                         rf"{os.getpid()} on \S+ since .*\); expected a RUN_ID no running process uses"):
        lock_run_folder(run, hp)
    held.close()
    lock_run_folder(run, hp).close()
    # a holder that is killed releases it: the OS drops the lock with the process
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', "
            "flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "r" / LOCK_FILE)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    with pytest.raises(ValueError, match="is being written by another run"):
        lock_run_folder(run, hp)
    proc.kill()
    proc.wait()
    lock_run_folder(run, hp).close()


@pytest.mark.slow
def test_two_trainers_with_one_run_id_at_once_one_refuses_and_the_other_result_survives(tiny_dataset, sp1024_model,
                                                                                          tmp_path):
    """Before: both exited 0, and the first run's result, log and artifact were gone. The first run is paused
    (SIGSTOP) after its first step, holding the folder, until the second has ended: at once, whatever the load."""
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="same", NUM_THREADS=1)
    first = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    for line in first.stdout:  # the first run holds the folder from before its first step
        if line.startswith("step:1/"):
            break
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=dict(env, SEED="99"), cwd=REPO,
                                capture_output=True, text=True, timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=600)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert re.fullmatch(rf"error: RUN_ID='same': {tmp_path}/same is being written by another run \(pid {first.pid} on "
                        r"\S+ since \S+\); expected a RUN_ID no running process uses\n", second.stderr), second.stderr
    assert first.returncode == 0, err[-3000:]
    result = read_result(tmp_path, "same")
    assert result["status"] == "ok" and result["seed"] == 7 and result["steps"] == int(env["ITERATIONS"]) == 8
    log = (tmp_path / "same" / "train.log").read_text()
    assert log.count("SEED:7") == 1 and "SEED:99" not in log and "final_sliding_window_exact" in log
    assert result["bytes_model"] == (tmp_path / "same" / "final_model.ptz").stat().st_size


def test_a_train_log_that_cannot_be_written_is_one_line_before_the_clock(tmp_path, monkeypatch):
    """A full disk as train.log's header is written (before: a traceback)."""
    import errno

    import trainer.runfolder as runfolder

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    hp = Hyperparameters.from_env({"PRESET": "smoke", "RUN_ID": "r", "OUT_DIR": str(tmp_path)}, log=lambda *_: None)
    run = ctx(tmp_path / "r")
    run.log("a line logged by the input checks")
    real_open = open
    monkeypatch.setattr(runfolder, "open", lambda path, *args, **kwargs: FullDisk() if Path(path).name == "train.log"
                        else real_open(path, *args, **kwargs), raising=False)
    monkeypatch.setattr(runfolder, "log_run_header", lambda ctx, hp: ctx.log("the header"))
    with pytest.raises(ValueError, match=rf"^RUN_ID='r': cannot write {tmp_path}/r/train.log \(No space left on device\); "
                                         r"expected a writable run folder with space"):
        runfolder.open_run_log(run, hp, {})
    assert run.log_file is None and not run.log_opened


def test_a_train_log_that_stops_being_writable_mid_run_only_warns(tmp_path, capsys):
    import errno

    class FillsUp:
        def __init__(self):
            self.lines, self.closed = [], False

        def write(self, text):
            if len(self.lines) == 2:
                raise OSError(errno.EFBIG, "File too large")
            self.lines.append(text)

        def flush(self):
            pass

        def close(self):
            self.closed = True

    run, log = ctx(tmp_path), FillsUp()
    run.log_file, run.log_opened = log, True
    for i in range(4):
        run.log(f"step:{i}")
    out, err = capsys.readouterr()
    assert log.lines == ["step:0\n", "step:1\n"] and log.closed and run.log_file is None
    assert out.splitlines() == ["step:0", "step:1", "step:2", "step:3"]  # the console keeps every line
    assert err == "WARNING: train.log: cannot write (File too large): the rest of the log is on the console only\n"


@pytest.mark.parametrize("status, said", [("ok", "holds a finished run"),
                                          ("nonfinite_sliding", "holds a run that ended with status 'nonfinite_sliding'"),
                                          ("error", "holds a run that ended with status 'error'")])
def test_a_kept_run_folder_is_refused_naming_how_that_run_ended(tmp_path, status, said):
    """A RUN_ID whose folder holds a result is refused before anything is written; a failed run's folder is
    not called finished: the line names its status."""
    from trainer.runfolder import check_run_folder

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps({"status": status}))
    hp = Hyperparameters(out_dir=str(tmp_path), run_id="r")
    with pytest.raises(ValueError, match=re.escape(f"RUN_ID='r': {run_dir} {said} (result.json); expected a new RUN_ID")):
        check_run_folder(hp)
    assert sorted(p.name for p in run_dir.iterdir()) == ["result.json"]
