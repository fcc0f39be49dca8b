"""The run's files and results never depend on the console: a closed or broken stdout/stderr ends the
console output, not the run (`| head`, `2>&-`, stdout on a full device)."""

import io
import json
import os
import subprocess
import sys

import pytest

from primitives.progress import ConsoleStream, Progress
from tests.test_train import REPO, trainer_env


def run_shell(command: str, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def assert_run_kept(out_dir, run_id: str) -> dict:
    run_dir = out_dir / run_id
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["phase"] == "done", result.get("error")
    assert (run_dir / "final_model.ptz").stat().st_size > 0
    log = (run_dir / "train.log").read_text()
    assert "final_sliding_window_exact" in log and "result:" in log  # train.log has every line the console lost
    return result


class Failing(io.StringIO):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def write(self, text):
        raise self.error

    def flush(self):
        raise self.error


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"), OSError(28, "No space left on device"),
                                   ValueError("I/O operation on closed file")])
def test_a_failing_console_stream_becomes_a_sink(error):
    stream = ConsoleStream(Failing(error))
    assert stream.write("line\n") == 5 and stream.stream is None  # the failure ends the output, silently
    stream.write("more\n")
    stream.flush()
    assert not stream.isatty()


def test_progress_with_no_stderr_is_silent(monkeypatch):
    monkeypatch.setattr(sys, "stderr", ConsoleStream(None))
    bar = Progress("x", 3, "steps")
    bar.update(3)
    bar.close()


@pytest.mark.slow
@pytest.mark.parametrize("how,redirect", [("head", "| head -n 1"), ("closed_stderr", "2>&-"),
                                          ("full_stdout", "> /dev/full"), ("closed_both", ">&- 2>&-")])
def test_the_run_survives_its_console(tiny_dataset, sp1024_model, tmp_path, how, redirect):
    if how == "full_stdout" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID=how)
    proc = run_shell(f"set -o pipefail; {sys.executable} train_gpt.py {redirect}", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "train.log" not in proc.stderr, proc.stderr  # never blamed on train.log
    assert_run_kept(tmp_path, how)
    if how == "head":
        assert len(proc.stdout.splitlines()) == 1
    # the eval CLI: the same rule; its score line is the last thing a `| head` would have dropped
    artifact = tmp_path / how / "final_model.ptz"
    score = run_shell(f"set -o pipefail; {sys.executable} -m eval score --artifact {artifact} --data-path {tiny_dataset} "
                      f"--tokenizer {sp1024_model} --val-max-tokens 4096 {redirect}", env)
    assert score.returncode == 0 and "Traceback" not in score.stderr, score.stderr[-3000:]
