"""Nothing lost (issue 23): a signal at any phase after training leaves the trained weights, result.json
with status/phase/numbers and the command that finishes the job; RESUME=1 then gives the same artifact
bytes and scores as a run never interrupted. Also: failures inside training write result.json.

Each signal test runs train_gpt.py as a subprocess (as a user would), reads its log, and signals it
when the log reaches the phase.
"""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_after_training import run_main_in_process
from tests.test_train import REPO, one_thread, read_result, run_trainer, trainer_env  # noqa: F401 (fixture)

# one intra-op thread: on a loaded 2-core machine two spinning threads made tiny steps many times slower
SIGNAL_ENV = dict(NUM_THREADS=1)
SCORES = ("val_bpb_prequant", "val_bpb_roundtrip", "val_bpb_sliding", "val_loss_sliding", "bytes_model", "steps",
          "train_losses")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def uninterrupted(tiny_dataset, sp1024_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    run_trainer(trainer_env(tiny_dataset, sp1024_model, out, RUN_ID="whole", **SIGNAL_ENV))
    return read_result(out, "whole"), sha256(out / "whole" / "final_model.ptz")


def signal_at(env: dict, pattern: str, signals=(signal.SIGTERM,), timeout: float = 180, gap_seconds: float = 0) -> tuple:
    """Run the trainer; when a log line matches `pattern`, send `signals`, `gap_seconds` apart;
    returns (exit code, the whole stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.search(pattern, line):
            for i, sig in enumerate(signals):
                time.sleep(gap_seconds * bool(i))
                proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, "".join(seen) + out, err


def settings_free_env(env: dict) -> dict:
    """The caller's environment without a single trainer setting: next_command must carry them all."""
    from primitives.settings import Hyperparameters

    names = {n.upper() for n in Hyperparameters.__dataclass_fields__} | {"PRESET"}
    return {k: v for k, v in env.items() if k not in names and not k.startswith("QUANT_")}


def no_temp_files(run_dir: Path) -> None:
    assert not [p.name for p in run_dir.iterdir() if ".tmp" in p.name], "a temp file was left behind"


# (log line that triggers the signal, signal, phases the run can be in by then, artifact on disk afterwards)
MATRIX = [
    ("^training done", signal.SIGTERM, {"trained", "prequant_eval"}, False),
    ("^final_prequant_exact", signal.SIGINT, {"export"}, False),  # + a SIGTERM at once: torchrun's forward of Ctrl-C
    ("^final_roundtrip_exact", signal.SIGHUP, {"sliding"}, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("pattern,sig,phases,artifact", MATRIX, ids=[m[1].name for m in MATRIX])
def test_a_signal_after_training_saves_the_weights_and_resume_matches_an_uninterrupted_run(
        uninterrupted, tiny_dataset, sp1024_model, tmp_path, pattern, sig, phases, artifact):
    whole, whole_sha = uninterrupted
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="cut", **SIGNAL_ENV)
    rc, out, err = signal_at(env, pattern, (sig, signal.SIGTERM) if sig == signal.SIGINT else (sig,))
    run_dir = tmp_path / "cut"
    assert rc == 128 + sig, err[-2000:]
    assert "Traceback" not in err, err
    result = read_result(tmp_path, "cut")
    assert result["status"] == "interrupted" and result["signal"] == sig.name and result["phase"] in phases, result
    assert f"interrupted by {sig.name} in phase {result['phase']}" in (run_dir / "train.log").read_text()
    assert (run_dir / "trained.safetensors").is_file() and result["trained_path"] == str(run_dir / "trained.safetensors")
    assert result["steps"] == whole["steps"] and result["train_losses"] == whole["train_losses"]
    assert (run_dir / "final_model.ptz").is_file() == artifact
    if artifact:  # the export had finished: its numbers are kept, and the artifact can be scored as it is
        assert result["bytes_model"] == whole["bytes_model"] and result["val_bpb_roundtrip"] == whole["val_bpb_roundtrip"]
        assert set(result["phase_seconds"]) == {"prequant_eval", "export", "load", "roundtrip"}
        assert result["score_command"].startswith("python -m eval score --artifact ")
        assert sha256(run_dir / "final_model.ptz") == whole_sha
    no_temp_files(run_dir)

    # the exact command in result.json finishes the job: the environment holds no setting of the run
    command = result["next_command"]
    assert "RESUME=1" in command and "RUN_ID=cut" in command
    proc = subprocess.run(["bash", "-c", command], env=settings_free_env(env), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed after training from" in proc.stdout
    resumed = read_result(tmp_path, "cut")
    assert resumed["status"] == "ok" and resumed["phase"] == "done" and resumed["resumed_after_training"] is True
    assert {k: resumed[k] for k in SCORES} == {k: whole[k] for k in SCORES}
    assert sha256(run_dir / "final_model.ptz") == whole_sha
    assert resumed["compliance"] == whole["compliance"] and resumed["train_shards"] == whole["train_shards"]
    assert set(resumed["phase_seconds"]) == {"prequant_eval", "export", "load", "roundtrip", "sliding"}
    assert resumed["export_seconds"] == resumed["phase_seconds"]["export"] or resumed["export_seconds"] > 0


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_leaves_nothing_half_written(tiny_dataset, sp1024_model, tmp_path):
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="twice", **SIGNAL_ENV)
    from trainer.interrupt import SECOND_SIGNAL_AFTER_SECONDS

    rc, out, err = signal_at(env, "^final_prequant_exact", (signal.SIGTERM, signal.SIGTERM),
                             gap_seconds=SECOND_SIGNAL_AFTER_SECONDS + 0.5)
    assert rc == 128 + signal.SIGTERM and "Traceback" not in err, out[-1500:] + err[-2000:]
    run_dir = tmp_path / "twice"
    # whatever made it to disk is whole: files appear by rename only
    for name in ("result.json", "trained.safetensors", "final_model.ptz"):
        path = run_dir / name
        if name == "result.json" and path.exists():
            assert json.loads(path.read_text())["status"] == "interrupted"
        if name == "trained.safetensors" and path.exists():
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                assert "tok_emb.weight" in f.keys()
        if name == "final_model.ptz" and path.exists():
            from quant.artifact import load_artifact

            load_artifact(path)


@pytest.mark.slow
def test_a_finished_run_folder_is_refused_and_resume_needs_something_to_resume(uninterrupted, tiny_dataset,
                                                                                       sp1024_model, tmp_path):
    run_dir = tmp_path / "done"
    run_trainer(trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="done", SKIP_FINAL_EVAL=1, ITERATIONS=2))
    log = (run_dir / "train.log").read_text()
    proc = run_trainer(trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="done", DATA_PATH=tmp_path / "none"),
                       check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: RUN_ID='done': {run_dir} holds a finished run (result.json, final_model.ptz); expected a new RUN_ID "
        "(or RESUME=1 to finish an interrupted run)"], proc.stderr
    assert (run_dir / "train.log").read_text() == log
    proc = run_trainer(trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="done", RESUME=1), check=False)
    assert proc.returncode == 2 and f"{run_dir} holds a run that finished (result.json status ok)" in proc.stderr
    assert (run_dir / "train.log").read_text() == log
    (run_dir / "result.json").unlink()  # no result: RESUME=1 needs something to resume
    proc = run_trainer(trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="done", RESUME=1), check=False)
    assert proc.returncode == 2 and "has no trained.safetensors or checkpoint.pt" in proc.stderr
    assert (run_dir / "train.log").read_text() == log


def test_every_train_shard_is_checked_before_the_clock(tiny_dataset, sp1024_model, tmp_path):
    import shutil

    from tests.test_inputs import ctx, hp_for
    from trainer.checks import check_inputs

    data = Path(shutil.copytree(tiny_dataset, tmp_path / "data"))
    last = sorted(data.glob("fineweb_train_*.bin"))[-1]
    raw = bytearray(last.read_bytes())
    raw[-2:] = (5000).to_bytes(2, "little")  # the very last token of the last shard
    last.write_bytes(bytes(raw))
    # a dataset whose manifest lists this very shard (another tool made it): the token check, not the hash, refuses it
    manifest_path = data / "manifest.json"
    if manifest_path.is_file():
        import hashlib
        import json

        manifest = json.loads(manifest_path.read_text())
        split = manifest["splits"]["train"]
        if "shard_sha256" in split:
            split["shard_sha256"][split["shards"].index(last.name)] = hashlib.sha256(bytes(raw)).hexdigest()
            manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"DATA_PATH='{data}': train shard {last.name} holds token id 5000; expected "
                                         r"ids < VOCAB_SIZE=1024"):
        check_inputs(hp_for(data, sp1024_model), ctx(tmp_path))


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_an_error_inside_training_writes_result_json_then_shows_its_traceback(monkeypatch, tiny_dataset, sp1024_model,
                                                                              tmp_path):
    import shards.loader as trainer_loader

    real, calls = trainer_loader.DistributedTokenLoader.next_batch, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk went away")
        return real(self, *args)

    monkeypatch.setattr(trainer_loader.DistributedTokenLoader, "next_batch", failing)
    with pytest.raises(RuntimeError, match="disk went away"):
        run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, tmp_path, "boom")
    result = read_result(tmp_path, "boom")
    assert result["status"] == "failed_in_training" and result["phase"] == "train"
    assert result["error"] == "RuntimeError: disk went away" and result["train_shards"] == ["fineweb_train_000000.bin"]
    assert not (tmp_path / "boom" / "final_model.ptz").exists()


def test_max_shard_id_reads_a_memory_map(tmp_path):
    from trainer.checks import max_shard_id
    from shards.format import read_shard_header, write_data_shard

    write_data_shard(tmp_path / "s.bin", np.array([1, 7, 65535, 3], dtype=np.uint16))
    assert max_shard_id(tmp_path / "s.bin", read_shard_header(tmp_path / "s.bin")) == 65535
    write_data_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.uint16))
    assert max_shard_id(tmp_path / "e.bin", 0) == -1
    assert os.path.getsize(tmp_path / "s.bin") == 1024 + 8


@pytest.mark.slow
def test_sighup_in_training_stops_after_the_step_and_says_so(tiny_dataset, sp1024_model, tmp_path):
    """No checkpoint (CHECKPOINT_EVERY=0): the loop stops, result.json says where, nothing claims to resume it."""
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="hup", ITERATIONS=200, **SIGNAL_ENV)
    rc, out, err = signal_at(env, r"^step:2/200 ", (signal.SIGHUP,))
    assert rc == 128 + signal.SIGHUP and "Traceback" not in err, err[-2000:]
    result = read_result(tmp_path, "hup")
    assert result["status"] == "stopped_by_signal" and result["phase"] == "train" and result["signal"] == "SIGHUP"
    assert 2 <= result["steps"] < 200 and "next_command" not in result
    assert sorted(p.name for p in (tmp_path / "hup").iterdir()) == ["result.json", "run.lock", "run_settings.json",
                                                                    "train.log"]


def no_room_in(folder: Path, real, names=("final_model.ptz", "trained.safetensors", "result.json")):
    """A stand-in for an atomic writer that fails with ENOSPC (disk full) for the files `names` under `folder`."""
    import errno

    def write(path, *args, **kwargs):
        if Path(path).resolve().is_relative_to(folder.resolve()) and Path(path).name in names:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)
    return write


def finish_with(command: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=settings_free_env(env), cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_disk_full_in_the_export_keeps_the_weights_and_says_how_to_finish(monkeypatch, tiny_dataset, sp1024_model,
                                                                         tmp_path, capsys):
    """Before: exit 1 with a traceback, no next command in result.json, and the trained weights lost."""
    import quant.artifact
    from tests.test_after_training import run_main_in_process
    from primitives.files import atomic_write_bytes

    monkeypatch.setattr(sys, "argv", [str(REPO / "train_gpt.py")])  # next_command names the entry point it ran
    monkeypatch.setattr(quant.artifact, "atomic_write_bytes", no_room_in(tmp_path / "full", atomic_write_bytes))
    assert run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, tmp_path / "full", "full") == 1
    run_dir = tmp_path / "full" / "full"
    result = read_result(tmp_path / "full", "full")
    assert result["status"] == "no_room" and result["phase"] == "export" and "val_bpb_prequant" in result
    assert result["error"] == f"OSError: [Errno 28] No space left on device: '{run_dir / 'final_model.ptz'}'"
    assert result["trained_path"] == str(run_dir / "trained.safetensors") and not (run_dir / "final_model.ptz").exists()
    err = capsys.readouterr().err
    assert f"trained weights kept in {run_dir / 'trained.safetensors'}; result: {run_dir / 'result.json'}" in err
    assert f"then finish with: {result['next_command']}" in err and "Traceback" not in err
    no_temp_files(run_dir)
    monkeypatch.undo()
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path / "full", RUN_ID="full", ITERATIONS=4, **SIGNAL_ENV)
    proc = finish_with(result["next_command"], env)
    assert proc.returncode == 0 and "resumed after training from" in proc.stdout, proc.stderr[-3000:]
    done = read_result(tmp_path / "full", "full")
    assert done["status"] == "ok" and done["resumed_after_training"] and done["steps"] == result["steps"] == 4
    assert done["train_losses"] == result["train_losses"] and done["val_bpb_prequant"] == result["val_bpb_prequant"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_run_folder_with_no_room_keeps_the_weights_in_the_temp_dir(monkeypatch, tiny_dataset, sp1024_model, tmp_path,
                                                                     capsys):
    import tempfile

    import quant.artifact
    import primitives.files
    import trainer.interrupt
    from tests.test_after_training import run_main_in_process
    from primitives.files import atomic_write_bytes, atomic_write_json

    out, spare = tmp_path / "out", tmp_path / "tmp"
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    monkeypatch.setattr(sys, "argv", [str(REPO / "train_gpt.py")])
    full = no_room_in(out, atomic_write_bytes)
    monkeypatch.setattr(quant.artifact, "atomic_write_bytes", full)
    monkeypatch.setattr(trainer.interrupt, "atomic_write_bytes", full)  # trained.safetensors
    monkeypatch.setattr(primitives.files, "atomic_write_bytes", full)  # result.json (atomic_write_json)
    assert run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, out, "r") == 1
    kept = trainer.interrupt.fallback_dir(out / "r")  # keyed by the run folder: spare/parameter-golf/r-<hash>
    assert kept.parent == spare / "parameter-golf" and kept.name.startswith("r-")
    result = json.loads((kept / "result.json").read_text())
    assert not (out / "r" / "result.json").exists() and not (out / "r" / "trained.safetensors").exists()
    assert result["status"] == "no_room" and result["trained_path"] == str(kept / "trained.safetensors")
    assert result["next_command"].startswith(f"mv {kept / 'trained.safetensors'} {out / 'r' / 'trained.safetensors'} && ")
    err = capsys.readouterr().err
    assert f"trained weights kept in {kept / 'trained.safetensors'}; result: {kept / 'result.json'}" in err
    monkeypatch.undo()
    assert atomic_write_json is primitives.files.atomic_write_json
    env = trainer_env(tiny_dataset, sp1024_model, out, RUN_ID="r", ITERATIONS=4, **SIGNAL_ENV)
    proc = finish_with(result["next_command"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_result(out, "r")["status"] == "ok" and (out / "r" / "final_model.ptz").is_file()


def test_a_file_size_limit_below_the_weights_is_refused_before_anything_is_written(tiny_dataset, sp1024_model,
                                                                                     tmp_path):
    """A real `ulimit -f`: train.log would fit, the trained weights would not; refused before the run folder exists
    (before: the run trained, then lost everything with a traceback)."""
    import resource

    limit = 600_000  # train.log ~0.25 MB fits; the 256-wide model's float32 weights do not
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="big", MODEL_DIM=256, NUM_HEADS=4, NUM_KV_HEADS=2,
                      ITERATIONS=2, **SIGNAL_ENV)
    proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    m = re.fullmatch(rf"error: ulimit -f: files are limited to {limit:,} bytes; this run's trained weights take ([\d,]+) "
                     r"bytes \(kept as trained.safetensors so that a failed export can be finished\); expected a larger "
                     r"file-size limit \(ulimit -f unlimited\)", lines[0])
    assert m and int(m.group(1).replace(",", "")) > 2 * limit, lines
    assert not (tmp_path / "big").exists()
