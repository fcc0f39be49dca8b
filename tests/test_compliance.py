"""result.json["compliance"]: one flag per challenge rule, computed from evidence, each able to be False.

Unit tests drive `check_compliance` with the real training loader on copies of the tiny dataset
(shards linked to val shards, shards missing from the manifest); one in-process trainer run on a
leaky dataset shows the flag reaching result.json and the log.
"""

import json
import os
import shutil

import pytest

import train_gpt
from trainer.shards import check_data_manifest, list_shards, read_shard_header
from trainer.checks import check_compliance
from trainer.loader import DistributedTokenLoader

QUIET = dict(log=lambda *_: None)


def copy_dataset(src, dst, manifest=True):
    shutil.copytree(src, dst)
    if not manifest:
        (dst / "manifest.json").unlink()
    return dst


def num_val_tokens(data):
    return sum(read_shard_header(p) for p in list_shards(data, "val"))


def good_summary(data):
    """What a clean run measured: every number within the challenge's limits."""
    return dict(train_seconds=599.9, eval_seconds=599.9, bytes_total=16_000_000, val_tokens=num_val_tokens(data))


def opened_by_the_loader(data, shard_index=0):
    """The shard files the real training loader opened after seeking to `shard_index` and taking a batch."""
    loader = DistributedTokenLoader(str(data), 1024)
    loader.seek(shard_index, 0)
    loader.next_batch(1024, 64)
    return loader.opened


@pytest.fixture
def data(tiny_dataset, tmp_path):
    return copy_dataset(tiny_dataset, tmp_path / "data")


def test_a_clean_run_meets_every_rule(data):
    manifest = check_data_manifest(data, vocab_size=1024, **QUIET)
    opened = opened_by_the_loader(data)
    assert [p.name for p in opened] == ["fineweb_train_000000.bin"]
    flags = check_compliance(good_summary(data), str(data), manifest, opened)
    assert flags == dict(train_time_ok=True, eval_time_ok=True, bytes_ok=True, full_val_split=True,
                         val_not_seen_in_training=True, splits_disjoint=True)


@pytest.mark.parametrize("flag, change", [
    ("train_time_ok", {"train_seconds": 600.01}),  # the challenge's 600 s, not MAX_WALLCLOCK_SECONDS
    ("eval_time_ok", {"eval_seconds": 600.01}),
    ("eval_time_ok", {"eval_seconds": None}),  # the eval did not finish
    ("bytes_ok", {"bytes_total": 16_000_001}),  # the challenge's 16,000,000, not BYTE_BUDGET
    ("bytes_ok", {"bytes_total": None}),  # no artifact
    ("full_val_split", {"val_tokens": "minus one"}),  # VAL_MAX_TOKENS: the score covers part of the split
    ("full_val_split", {"val_tokens": None}),  # nothing scored
])
def test_each_measured_limit_can_fail(data, flag, change):
    manifest = check_data_manifest(data, vocab_size=1024, **QUIET)
    summary = good_summary(data)
    for key, value in change.items():
        if value is None:
            del summary[key]
        else:
            summary[key] = summary[key] - 1 if value == "minus one" else value
    flags = check_compliance(summary, str(data), manifest, opened_by_the_loader(data))
    assert flags[flag] is False
    assert all(v is True for k, v in flags.items() if k != flag), flags


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_train_shard_that_is_a_val_shard_fails_val_not_seen_in_training(data, link):
    """The official export has no manifest: the evidence is the file the loader opened."""
    (data / "manifest.json").unlink()
    train0, val0 = data / "fineweb_train_000000.bin", list_shards(data, "val")[0]
    train0.unlink()
    os.symlink(val0, train0) if link == "symlink" else os.link(val0, train0)
    opened = opened_by_the_loader(data)
    flags = check_compliance(good_summary(data), str(data), None, opened)
    assert flags["val_not_seen_in_training"] is False and flags["splits_disjoint"] is None
    # the evidence is the opened files: without the linked one the flag holds
    others = {p for p in opened_by_the_loader(data, 1) if p != train0}
    assert others and check_compliance(good_summary(data), str(data), None, others)["val_not_seen_in_training"] is True


def test_a_shard_the_manifest_lists_as_val_fails_val_not_seen_in_training(data):
    manifest = check_data_manifest(data, vocab_size=1024, **QUIET)
    opened = opened_by_the_loader(data)
    manifest["splits"]["val"]["shards"].append("fineweb_train_000000.bin")  # e.g. a re-split dataset
    flags = check_compliance(good_summary(data), str(data), manifest, opened)
    assert flags["val_not_seen_in_training"] is False and flags["splits_disjoint"] is False


def test_a_train_shard_outside_the_manifest_fails_splits_disjoint(data):
    """The manifest's document hashes prove disjointness only for the shards it lists."""
    manifest = check_data_manifest(data, vocab_size=1024, **QUIET)
    extra = data / "fineweb_train_999999.bin"
    shutil.copyfile(data / "fineweb_train_000000.bin", extra)  # e.g. shards added from another source
    loader = DistributedTokenLoader(str(data), 1024)
    loader.seek(len(loader.files) - 1, 0)
    assert loader.files[-1] == extra
    flags = check_compliance(good_summary(data), str(data), manifest, loader.opened)
    assert flags["splits_disjoint"] is False and flags["val_not_seen_in_training"] is True
    assert check_compliance(good_summary(data), str(data), None, loader.opened)["splits_disjoint"] is None


def test_no_shard_opened_is_no_evidence(data):
    assert check_compliance(good_summary(data), str(data), None, set())["val_not_seen_in_training"] is False


@pytest.mark.slow
def test_a_run_on_a_leaky_dataset_reports_it_in_result_json(tiny_dataset, sp1024_model, tmp_path, monkeypatch, capsys):
    """Before: val_not_seen_in_training was the constant True."""
    from test_train import trainer_env

    data = copy_dataset(tiny_dataset, tmp_path / "data", manifest=False)
    train0 = data / "fineweb_train_000000.bin"
    train0.unlink()
    os.symlink(list_shards(data, "val")[0], train0)
    env = trainer_env(data, sp1024_model, tmp_path / "runs", RUN_ID="leaky", ITERATIONS=2, SKIP_FINAL_EVAL=1)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert train_gpt.main() == 0
    result = json.loads((tmp_path / "runs" / "leaky" / "result.json").read_text())
    assert result["train_shards"] == ["fineweb_train_000000.bin"]
    assert result["compliance"] == dict(train_time_ok=True, eval_time_ok=False, bytes_ok=True, full_val_split=False,
                                        val_not_seen_in_training=False, splits_disjoint=None)
    assert ("compliance: train_time_ok:True eval_time_ok:False bytes_ok:True full_val_split:False "
            "val_not_seen_in_training:False splits_disjoint:None") in capsys.readouterr().out
