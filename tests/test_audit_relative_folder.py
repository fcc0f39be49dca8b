"""`python tools/audit.py records/...` as the README writes it: a folder given by a relative path is run by
the probe (its toy runs' cwd is their own work folder; the relative script path was not found there)."""

import os
from pathlib import Path

import pytest

from tools.auditor import audit_probe

SHARED = Path(__file__).resolve().parents[2] / "shared"


class Started(Exception):
    pass


@pytest.mark.skipif(not (SHARED / "data" / "tokenizers").is_dir(), reason="needs ../shared/data/tokenizers")
def test_the_run_probe_runs_a_folder_given_by_a_relative_path(tmp_path, monkeypatch):
    folder = tmp_path / "records" / "track_non_record_16mb" / "2026-11-28_CpuTry"
    folder.mkdir(parents=True)
    (folder / "train_gpt.py").write_text("import os\nvocab = int(os.environ['VOCAB_SIZE'])\n"
                                         "tokenizer = os.environ['TOKENIZER_PATH']\n")
    seen = []

    def start(script, run_folder, *args, **kwargs):
        seen.append((script, run_folder))
        raise Started

    monkeypatch.setattr(audit_probe, "_start", start)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Started):
        audit_probe.run_pair(Path("records/track_non_record_16mb/2026-11-28_CpuTry"), SHARED, keep=tmp_path / "work")
    script, run_folder = seen[0]
    os.chdir(tmp_path / "work")  # where the toy run starts: its script must still be there
    assert script.is_absolute() and script.is_file() and run_folder == folder.resolve(), seen


def test_a_probe_run_inherits_the_machine_not_the_shells_settings(monkeypatch):
    # the README's CPU record exports PRESET=smoke DATA_PATH=...: the probe ran the kit's packed file with them
    # and it refused the toy data (exit 2: DATA_PATH='./data/datasets/fineweb10B_sp1024': no such file or folder)
    for name, value in {"PRESET": "smoke", "DATA_PATH": "data/x", "ITERATIONS": "25", "RANK": "1", "PATH": "/bin",
                        "LC_ALL": "C.UTF-8"}.items():
        monkeypatch.setenv(name, value)
    env = audit_probe.probe_env("import os\nn = os.environ.get('ITERATIONS')\n", Path("d"), Path("t.model"), 1024)
    assert "PRESET" not in env and "DATA_PATH" not in env and "RANK" not in env
    assert env["ITERATIONS"] == "3" and env["PATH"] == "/bin" and env["LC_ALL"] == "C.UTF-8"  # the toy's, the machine's


def test_a_script_that_reads_its_settings_under_computed_names_gets_every_toy_variable():
    # this kit's packed train_gpt.py reads `f.name.upper()` of each field: the probe set none of the toy sizes and
    # the script refused the toy val split at its default TRAIN_SEQ_LEN=2048 (exit 2, not checkable)
    kit = "import dataclasses, os\nfor f in dataclasses.fields(H):\n    v = os.environ.get(f.name.upper())\n"
    env = audit_probe.probe_env(kit, Path("d"), Path("t.model"), 8192)
    assert (env["TRAIN_SEQ_LEN"], env["ITERATIONS"], env["DATA_PATH"], env["VOCAB_SIZE"]) == ("128", "3", "d", "8192")
    assert "TRAIN_SEQ_LEN" not in audit_probe.probe_env("import os\n", Path("d"), Path("t.model"), 8192)
