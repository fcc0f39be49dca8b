"""make_record: the author's Approach, the reproduce command with the official data command, the
smoke run's limit (a flag, by default from the runs' own times), its live output and its timeout
message, and what a --skip-smoke folder says about itself."""

import json
import time

import pytest

from test_bundle import FAKE_TREE, write_tree
from test_make_record import APPROACH, DATE, cli, fabricate_run, fake_src  # noqa: F401 (fake_src is a fixture)
from kit import bundle
from tools.record import make_record, record_readme, record_smoke
from tools.record.runs import load_run


def _argv(tmp_path, runs, src_root, *extra):
    return ["--runs", *map(str, runs), "--name", "Tiny", "--author", "A", "--github-id", "a",
            "--records-dir", str(tmp_path / "records"), "--root", str(src_root), "--date", DATE, *extra]


@pytest.mark.parametrize("extra, message", [
    ((), r"^error: no --approach or --approach-file; expected the record's approach"),
    (("--approach", "  "), r"^error: --approach: is empty; expected"),
    (("--approach-file", "{d}/empty.md"), r"^error: --approach-file \S+/empty.md: is empty; expected"),
    (("--approach-file", "{d}/none.md"), r"^error: --approach-file \S+/none.md: cannot read it as UTF-8 text"),
    (("--approach", "x", "--approach-file", "{d}/a.md"), r"^error: --approach and --approach-file: give one"),
])
def test_a_record_without_an_approach_is_refused_in_one_line_before_any_work(tmp_path, capsys, extra, message):
    """The refusal comes before the runs are even read (the run folder here does not exist)."""
    (tmp_path / "empty.md").write_text("\n \n")
    (tmp_path / "a.md").write_text("text")
    extra = [e.format(d=tmp_path) for e in extra]
    assert make_record.main(_argv(tmp_path, [tmp_path / "no_such_run"], tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "records").exists()


def test_the_approach_file_is_the_readme_approach_section(fake_src, tmp_path):  # noqa: F811
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    (tmp_path / "approach.md").write_text("We tied the **embeddings** and\nraised the LR.\n", encoding="utf-8")
    assert make_record.main(_argv(tmp_path, runs, fake_src[0], "--skip-smoke", "--approach-file",
                                  str(tmp_path / "approach.md"))) == 0
    readme = (tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny" / "README.md").read_text()
    section = readme.split("## Approach\n\n")[1].split("\n## ")[0]
    assert section.strip() == "We tied the **embeddings** and\nraised the LR."
    assert readme.index("## Approach") < readme.index("## What this is") < readme.index("## Reproduce")


def test_skip_smoke_is_written_into_submission_json_and_the_readme(fake_src, tmp_path):  # noqa: F811
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0  # cli passes --skip-smoke
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    assert json.loads((folder / "submission.json").read_text())["smoke_run"] == "skipped"
    assert "**Not run from this folder:** built with `make_record --skip-smoke`" in (folder / "README.md").read_text()
    assert make_record.main(["--check", str(folder)]) == 0


def _smoke_with(tmp_path, trainer: str, *extra) -> int:
    """make_record with a real smoke run whose packed file is replaced by `trainer` (text; `{n}`: the
    packed file's size, which the smoke run expects the log to report)."""
    root = write_tree(tmp_path / "src", {"train_gpt.py": FAKE_TREE["train_gpt.py"]})
    src = root, bundle.build_human_source(root), bundle.build_packed_bytes(root)
    runs = [fabricate_run(tmp_path, "a", 1, src)]
    orig_run_live = record_smoke._run_live

    def run_live(cmd, *, cwd, **kw):
        n = (cwd / "train_gpt.py").stat().st_size
        (cwd / "train_gpt.py").write_text(trainer.replace("{n}", str(n)))
        return orig_run_live(cmd, cwd=cwd, **kw)

    record_smoke._run_live = run_live
    try:
        return make_record.main(_argv(tmp_path, runs, root, "--approach", APPROACH, *extra))
    finally:
        record_smoke._run_live = orig_run_live


GOOD_TRAINER = """import os
n = {n}
lines = [f"code_bytes:{n}", "step:1/2 train_loss:5.0 train_time:10ms step_avg:10.0ms",
         "step:2/2 train_loss:4.9 train_time:20ms step_avg:10.0ms", "final_prequant_exact val_loss:4.0 val_bpb:2.0",
         "final_roundtrip_exact val_loss:4.0 val_bpb:2.0",
         "final_sliding_window_exact val_loss:4.0 val_bpb:2.0 stride:64 eval_time:5ms",
         f"Total submission size: {n + 1000} bytes"]
folder = os.path.join(os.environ["OUT_DIR"], os.environ["RUN_ID"])
os.makedirs(folder)
with open(os.path.join(folder, "train.log"), "w") as f:
    f.write("\\n".join(lines) + "\\n")
for line in lines:
    print(line, flush=True)
"""
SLOW_TRAINER = "import time\nprint('step:1/2 started', flush=True)\ntime.sleep(60)\n"


def test_a_smoke_run_folder_has_no_skip_marker_and_its_output_is_shown_live(tmp_path, capsys):
    assert _smoke_with(tmp_path, GOOD_TRAINER) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    assert "smoke_run" not in json.loads((folder / "submission.json").read_text())
    assert "Not run from this folder" not in (folder / "README.md").read_text()
    assert "  smoke| final_sliding_window_exact val_loss:4.0 val_bpb:2.0" in err and "smoke: ok, packed file ran" in out
    assert "(limit 600 s, --smoke-timeout-seconds; its output follows)" in out


def test_a_smoke_run_over_its_limit_says_what_to_do_and_writes_nothing(tmp_path, capsys):
    started = time.monotonic()
    assert _smoke_with(tmp_path, SLOW_TRAINER, "--smoke-timeout-seconds", "4") == 2
    assert time.monotonic() - started < 50
    err = capsys.readouterr().err
    assert "  smoke| step:1/2 started" in err  # shown live, before the limit
    refusal = err[err.index("error: "):]
    assert "did not finish within --smoke-timeout-seconds=4; the runs' own train + export + eval took up to" in refusal
    assert "--smoke-timeout-seconds 8" in refusal and "--skip-smoke" in refusal
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


def test_the_default_smoke_limit_follows_the_runs_own_times(fake_src, tmp_path):  # noqa: F811
    slow = load_run(fabricate_run(tmp_path, "a", 1, fake_src, result={"train_seconds": 60.0, "export_seconds": 342.0,
                                                                       "eval_seconds": 418.0}))
    fast = load_run(fabricate_run(tmp_path, "b", 2, fake_src, result={"train_seconds": 5.0, "eval_seconds": 3.0}))
    assert record_smoke.runs_measured_seconds([fast, slow]) == pytest.approx(820.0)
    assert record_smoke.default_smoke_timeout_seconds([fast, slow]) == 1640
    assert record_smoke.default_smoke_timeout_seconds([fast]) == record_smoke.SMOKE_MIN_TIMEOUT_SECONDS


def test_the_reproduce_command_downloads_official_data_with_the_official_script(fake_src, tmp_path):  # noqa: F811
    data = tmp_path / "data" / "datasets" / "fineweb10B_sp8192"
    data.mkdir(parents=True)
    for i in range(3):
        (data / f"fineweb_train_{i:06d}.bin").write_bytes(b"")
    tok = tmp_path / "data" / "tokenizers" / "fineweb_8192_bpe.model"
    runs = [fabricate_run(tmp_path, "a", 1, fake_src, hp={"data_path": str(data), "tokenizer_path": str(tok),
                                                          "vocab_size": 8192})]
    run = load_run(runs[0])
    record_dir = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    reproduce = record_readme.reproduce_command([run], record_dir, "Tiny", fake_src[0])
    assert record_readme.official_data(run)["command"] == ("MATCHED_FINEWEB_REPO_ID=kevclark/parameter-golf python3 "
                                                           "data/cached_challenge_fineweb.py --variant sp8192 "
                                                           "--train-shards 3")
    assert "DATA_PATH=../../../data/datasets/fineweb10B_sp8192" in reproduce
    assert "TOKENIZER_PATH=../../../data/tokenizers/fineweb_8192_bpe.model" in reproduce
    assert str(tmp_path) not in reproduce  # no path of the author's machine

    (data / "manifest.json").write_text(json.dumps({"source": {"command": "fineweb", "variant": "sp8192",
                                                               "repo_id": "kevclark/parameter-golf"}}))
    assert record_readme.official_data(run)["command"].startswith("MATCHED_FINEWEB_REPO_ID=kevclark/parameter-golf ")
    # data made from other text with the official tokenizer is not the official export
    (data / "manifest.json").write_text(json.dumps({"source": {"command": "jsonl"}}))
    assert record_readme.official_data(run) is None


def test_sp1024_uses_the_official_default_repo_and_other_tokenizers_are_not_official(fake_src, tmp_path):  # noqa: F811
    run = load_run(fabricate_run(tmp_path, "a", 1, fake_src, hp={"data_path": str(tmp_path / "d"),
                                                                 "tokenizer_path": "t/fineweb_1024_bpe.model"}))
    assert record_readme.official_data(run)["command"] == ("python3 data/cached_challenge_fineweb.py --variant sp1024 "
                                                           "--train-shards 1")  # the shards the run opened
    runs = [fabricate_run(tmp_path, "b", 2, fake_src)]  # data/tok.model: the author's own tokenizer
    assert record_readme.official_data(load_run(runs[0])) is None
    assert cli(fake_src, tmp_path, runs) == 0
    readme = (tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny" / "README.md").read_text()
    assert "cached_challenge_fineweb" not in readme and "`tok.model` and its data are not an official" in readme
