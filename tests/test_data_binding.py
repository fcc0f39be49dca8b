"""shards/format.py verify_dataset: the one binding of a dataset to every consumer (the trainer,
python -m eval score|bytes through eval/offline.py load_val_byte_luts, the auditor's measurement).

Copies of the tiny dataset (tools/prepare_data.py jsonl: its manifest records each shard's sha256)
with one thing changed: another tokenizer of the same vocabulary, an unlisted val shard, val tokens
written into a train shard with its header count kept, a manifest made before the hashes existed.
"""

import json
import shutil

import numpy as np
import pytest

from eval.offline import load_val_byte_luts
from shards.format import (list_shards, load_data_shard, read_shard_header, shards_unverified, verify_dataset,
                           write_data_shard)
from trainer.checks import check_compliance


@pytest.fixture
def data(tiny_dataset, tmp_path):
    return shutil.copytree(tiny_dataset, tmp_path / "data")


def manifest_of(data) -> dict:
    return json.loads((data / "manifest.json").read_text())


def test_prepare_data_records_every_shard_sha256_and_it_verifies(data, sp1024_model):
    from primitives.files import sha256_file

    manifest = manifest_of(data)
    for split in ("train", "val"):
        info = manifest["splits"][split]
        assert info["shard_sha256"] == [sha256_file(data / n) for n in info["shards"]] and info["shards"]
    logged = []
    assert verify_dataset(data, sp1024_model, vocab_size=1024, log=logged.append) is not None
    assert logged == [] and shards_unverified(data) is None


def test_another_tokenizer_of_the_same_vocab_is_refused_by_the_scorer(data, sp1024_model):
    manifest = manifest_of(data)  # the data made with another tokenizer (its sha256 in the manifest)
    manifest["tokenizer_sha256"] = "f" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"TOKENIZER_PATH='\S+': sha256 [0-9a-f]{16}\.\.\. is not the tokenizer_sha256 f{16}"):
        load_val_byte_luts(sp1024_model, 1024, data)  # what `python -m eval score|bytes` and the auditor call


def test_an_unlisted_val_shard_is_refused_before_scoring(data, sp1024_model):
    write_data_shard(data / "fineweb_val_999999.bin", np.arange(1, 100, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"fineweb_val_999999.bin is not a val shard of \S+manifest.json \(1 unlisted\)"):
        load_val_byte_luts(sp1024_model, 1024, data)


def test_val_tokens_written_into_a_train_shard_are_refused(data, sp1024_model):
    train = list_shards(data, "train")[0]
    count = read_shard_header(train)
    write_data_shard(train, np.resize(load_data_shard(list_shards(data, "val")[0]).numpy(), count))
    assert read_shard_header(train) == count  # the header count kept: the count check cannot see it
    with pytest.raises(ValueError, match=rf"train shard {train.name} has sha256 [0-9a-f]{{16}}\.\.\., not the"):
        verify_dataset(data, sp1024_model, vocab_size=1024, log=lambda msg: None)
    # the scorer reads only the val split: it hashes those, and the listing of both
    load_val_byte_luts(sp1024_model, 1024, data, log=lambda msg: None)


def test_a_manifest_without_shard_hashes_warns_once_and_flags_say_unverified(data, sp1024_model):
    manifest = manifest_of(data)
    for info in manifest["splits"].values():
        del info["shard_sha256"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    logged = []
    verified = verify_dataset(data, sp1024_model, vocab_size=1024, log=logged.append)
    assert [line for line in logged if "sha256" in line] == [
        f"WARNING: {data / 'manifest.json'} records no sha256 per shard (train, val): the shards are unverified "
        "(tools/prepare_data.py records them in new datasets)"]
    summary = dict(train_seconds=1, eval_seconds=1, bytes_total=1,
                   val_tokens=sum(map(read_shard_header, list_shards(data, "val"))))
    flags = check_compliance(summary, str(data), verified, set(list_shards(data, "train")))
    assert flags["val_not_seen_in_training"] is True and "the shards are unverified" in flags["unverified"]
    without_doc_hashes = check_compliance(summary, str(data), None, set(list_shards(data, "train")))
    assert "document hashes" in without_doc_hashes["unverified"]


def test_shard_hashes_that_do_not_match_the_shard_list_are_refused(data, sp1024_model):
    manifest = manifest_of(data)
    manifest["splits"]["val"]["shard_sha256"].append("0" * 64)
    (data / "manifest.json").write_text(json.dumps(manifest))
    num = len(manifest["splits"]["val"]["shards"])
    with pytest.raises(ValueError, match=rf"{num + 1} shard_sha256 for {num} val shards; expected one each"):
        verify_dataset(data, sp1024_model, vocab_size=1024, log=lambda msg: None)


def test_the_audits_data_row_says_when_the_shards_are_unverified(data):
    from types import SimpleNamespace

    from tools.auditor.audit_checks import check_data

    rec = SimpleNamespace(folder=data.parent / "record", data_path=str(data), seed_logs=[])
    assert check_data(rec).status == "pass" and "unverified" not in check_data(rec).evidence
    manifest = manifest_of(data)
    del manifest["splits"]["val"]["shard_sha256"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    row = check_data(rec)
    assert row.status == "pass" and row.evidence.endswith("records no sha256 per shard (val): the shards are unverified")


def test_significance_notes_runs_whose_shards_are_unverified():
    from types import SimpleNamespace

    from tools.record.significance import check_same_data

    def run(label, unverified=None):
        result = dict(inputs=dict(tokenizer_sha256="a" * 64, manifest_sha256="b" * 64),
                      compliance=dict(full_val_split=True, **({"unverified": unverified} if unverified else {})))
        return SimpleNamespace(label=label, run=SimpleNamespace(result=result))

    assert check_same_data([("--runs", [run("r1"), run("r2")])]) == []
    notes = check_same_data([("--runs", [run("r1"), run("r2", "m.json records no sha256 per shard (train): the "
                                                                 "shards are unverified")])])
    assert notes == ["the shards of 1 run(s) are unverified (r2: its manifest.json records no sha256 per shard, so the "
                     "same manifest_sha256 does not prove the same shard bytes)"]
