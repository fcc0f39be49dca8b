"""Messages that fit the situation: the offline sample's repetition is expected (a note, no download
advice), and `python -m eval score` ends with the bytes (model + code vs the 16,000,000 budget)."""

import json
import shutil

from eval.offline import SUBMISSION_BYTE_BUDGET, submission_bytes_line
from test_eval_cli import run_cli, tiny_artifact  # noqa: F401 (tiny_artifact is a fixture)
from test_inputs import hp_for
from trainer.checks import check_train_tokens
from shards.format import list_shards, read_shard_header


def _copy_with_source(dataset, dest, command):
    shutil.copytree(dataset, dest)
    manifest = dest / "manifest.json"
    data = json.loads(manifest.read_text()) if manifest.is_file() else {}
    data["source"] = dict(data.get("source") or {}, command=command)
    manifest.write_text(json.dumps(data, indent=2))
    return dest


def test_the_offline_sample_repeating_is_a_note_without_download_advice(tiny_dataset, sp1024_model, tmp_path):
    held = sum(read_shard_header(p) for p in list_shards(tiny_dataset, "train"))
    steps = held // 8192 + 1  # more than the shards hold
    sample = _copy_with_source(tiny_dataset, tmp_path / "sample", "sample")
    logs = []
    check_train_tokens(hp_for(sample, sp1024_model, EXPECTED_STEPS=steps), logs.append)
    assert logs == [f"note: DATA_PATH={sample} is the offline sample ({held:,} train tokens); this run reads about "
                    f"{steps * 8192:,} and repeats it, as expected: its scores only show that the pipeline works "
                    f"(real data: docs/data.md)"]
    other = _copy_with_source(tiny_dataset, tmp_path / "own", "jsonl")  # any other data: the warning, with advice
    logs.clear()
    check_train_tokens(hp_for(other, sp1024_model, EXPECTED_STEPS=steps), logs.append)
    assert len(logs) == 1 and logs[0].startswith("WARNING: the train shards") and "--train-shards" in logs[0]


def test_the_bytes_line_counts_model_and_code_against_the_budget(tmp_path):
    artifact = tmp_path / "run" / "final_model.ptz"
    artifact.parent.mkdir()
    artifact.write_bytes(b"x" * 1000)
    assert submission_bytes_line(artifact) == ("bytes: model 1,000 + code unknown = total unverified of 16,000,000 "
                                               "(--code train_gpt.py counts the shipped script)")
    (artifact.parent / "result.json").write_text(json.dumps({"bytes_code": 234}))
    assert submission_bytes_line(artifact) == (f"bytes: model 1,000 + code 234 ({artifact.parent}/result.json "
                                               f"bytes_code) = 1,234 of 16,000,000 (margin 15,998,766)")
    code = tmp_path / "train_gpt.py"
    code.write_bytes(b"y" * (SUBMISSION_BYTE_BUDGET - 999))
    assert submission_bytes_line(artifact, code) == (f"bytes: model 1,000 + code 15,999,001 ({code}) = 16,000,001 of "
                                                     f"16,000,000 (OVER by 1)")


def test_score_prints_the_bytes_line_last(tiny_artifact, tiny_dataset, sp1024_model, tmp_path):  # noqa: F811
    code = tmp_path / "train_gpt.py"
    code.write_text("print('the shipped script')\n")
    out = run_cli("score", "--artifact", tiny_artifact, "--data-path", tiny_dataset, "--tokenizer", sp1024_model,
                  "--seq-len", 64, "--stride", 0, "--val-max-tokens", 500, "--code", code).stdout
    size = tiny_artifact.stat().st_size
    assert out.splitlines()[-1] == (f"bytes: model {size:,} + code {code.stat().st_size} ({code}) = "
                                    f"{size + code.stat().st_size:,} of 16,000,000 "
                                    f"(margin {16_000_000 - size - code.stat().st_size:,})")
