"""shards/format.py: the official shard layout (reader, writer, constants), validation errors, val
loading, manifest checks."""

import ast
import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from shards.format import SHARD_HEADER_INTS, SHARD_MAGIC, SHARD_TOKENS_PER_FILE, SHARD_VERSION, write_data_shard
from shards.format import check_data_manifest, list_shards, load_data_shard, load_validation_tokens, read_shard_header


def test_constants_are_the_official_ones():
    assert (SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS, SHARD_TOKENS_PER_FILE) == (20240520, 1, 256, 100_000_000)


def test_header_bytes_are_the_official_layout(tmp_path):
    tokens = np.array([1, 0, 65535, 1023, 258, 7], dtype=np.int64)
    path = tmp_path / "fineweb_val_000000.bin"
    write_data_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == 1024 + 2 * 6
    assert raw[:12] == struct.pack("<iii", 20240520, 1, 6)
    assert raw[:4] == bytes([0x88, 0xD8, 0x34, 0x01])  # 20240520 = 0x0134D888, little-endian
    assert raw[12:1024] == b"\x00" * 1012
    assert raw[1024:] == struct.pack("<6H", 1, 0, 65535, 1023, 258, 7)
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]  # the writer's `.{name}.tmp{pid}`


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1024, size=5000).astype(np.uint16)
    path = tmp_path / "fineweb_train_000000.bin"
    write_data_shard(path, tokens)
    assert read_shard_header(path) == 5000
    loaded = load_data_shard(path)
    assert loaded.dtype == torch.uint16 and loaded.shape == (5000,)
    assert np.array_equal(loaded.numpy(), tokens)
    write_data_shard(path, np.array([], dtype=np.uint16))  # overwrite; empty shard is valid
    assert read_shard_header(path) == 0 and load_data_shard(path).numel() == 0


@pytest.mark.parametrize("bad", [np.array([0, 65536]), np.array([-1, 3]), np.array([1.5, 2.0]), np.zeros((2, 2), dtype=np.int32)])
def test_write_rejects_tokens_that_do_not_fit(tmp_path, bad):
    path = tmp_path / "fineweb_val_000000.bin"
    with pytest.raises(ValueError, match="fineweb_val_000000.bin"):
        write_data_shard(path, bad)
    assert not path.exists() and not list(tmp_path.iterdir())


def _write_raw(path: Path, magic=SHARD_MAGIC, version=SHARD_VERSION, count=4, num_payload_tokens=4):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    payload = np.arange(max(num_payload_tokens, 0), dtype="<u2").tobytes()
    path.write_bytes((header.tobytes() + payload)[: 1024 + 2 * num_payload_tokens])  # < 0: a cut header
    return path


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(magic=20240521), r"magic, version, n \[20240521, 1, 4\], 1032 bytes"),
        (dict(version=2), r"magic, version, n \[20240520, 2, 4\], 1032 bytes"),
        (dict(count=5), r"magic, version, n \[20240520, 1, 5\], 1032 bytes"),  # truncated payload
        (dict(count=3), r"magic, version, n \[20240520, 1, 3\], 1032 bytes"),  # trailing bytes
        (dict(count=-1), r"magic, version, n \[20240520, 1, -1\], 1032 bytes"),
        (dict(count=-1, num_payload_tokens=-1), r"magic, version, n \[20240520, 1, -1\], 1022 bytes"),  # size fits -1
    ],
)
def test_read_header_errors_name_the_file(tmp_path, kwargs, message):
    path = _write_raw(tmp_path / "fineweb_val_000007.bin", **kwargs)
    with pytest.raises(ValueError, match=message) as info:
        read_shard_header(path)
    assert str(info.value).endswith("; expected [20240520, 1, n], 1024 + 2n bytes")
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="fineweb_val_000007.bin"):
        load_data_shard(path)


def test_truncated_header_and_missing_file(tmp_path):
    path = tmp_path / "fineweb_train_000000.bin"
    path.write_bytes(struct.pack("<iii", SHARD_MAGIC, SHARD_VERSION, 0))
    with pytest.raises(ValueError, match=r"magic, version, n \[20240520, 1, 0\], 12 bytes") as info:
        read_shard_header(path)
    assert str(path) in str(info.value)
    path.write_bytes(b"\x88\xd8")  # shorter than one int32
    with pytest.raises(ValueError, match=r"magic, version, n \[-1, -1, -1\], 2 bytes"):
        read_shard_header(path)
    with pytest.raises(FileNotFoundError):
        read_shard_header(tmp_path / "nope.bin")


def test_list_shards_sorted_and_split_specific(tmp_path):
    for name in ["fineweb_train_000002.bin", "fineweb_train_000000.bin", "fineweb_val_000000.bin", "fineweb_train_000001.bin"]:
        write_data_shard(tmp_path / name, np.array([1, 2]))
    (tmp_path / "fineweb_train_000003.bin.tmp").write_bytes(b"partial")
    assert [p.name for p in list_shards(tmp_path, "train")] == [f"fineweb_train_00000{i}.bin" for i in range(3)]
    assert [p.name for p in list_shards(tmp_path, "val")] == ["fineweb_val_000000.bin"]
    with pytest.raises(ValueError, match=r"fineweb_val_\*\.bin") as info:  # a user's input error: exit 2, one line
        list_shards(tmp_path / "empty", "val")
    assert f"DATA_PATH={tmp_path / 'empty'}" in str(info.value)


def test_load_validation_tokens_concatenates_sorted_shards(tmp_path):
    write_data_shard(tmp_path / "fineweb_val_000001.bin", np.array([1, 9, 8]))
    write_data_shard(tmp_path / "fineweb_val_000000.bin", np.array([1, 5, 6, 7]))
    write_data_shard(tmp_path / "fineweb_train_000000.bin", np.array([1, 1000]))
    tokens = load_validation_tokens(tmp_path, vocab_size=10)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == [1, 5, 6, 7, 1, 9, 8]
    assert load_validation_tokens(tmp_path).tolist() == tokens.tolist()


def test_load_validation_tokens_rejects_ids_outside_vocab_and_empty(tmp_path):
    write_data_shard(tmp_path / "fineweb_val_000000.bin", np.array([1, 2, 3]))
    write_data_shard(tmp_path / "fineweb_val_000001.bin", np.array([1, 1024]))
    with pytest.raises(ValueError, match=r"max id 1024; expected tokens, ids < VOCAB_SIZE=1024") as info:
        load_validation_tokens(tmp_path, vocab_size=1024)
    assert f"DATA_PATH={tmp_path}" in str(info.value)
    assert load_validation_tokens(tmp_path, vocab_size=1025).numel() == 5
    empty = tmp_path / "empty"
    empty.mkdir()
    write_data_shard(empty / "fineweb_val_000000.bin", np.array([], dtype=np.uint16))
    with pytest.raises(ValueError, match="max id -1; expected tokens"):
        load_validation_tokens(empty)
    with pytest.raises(ValueError, match="max id -1; expected tokens"):
        load_validation_tokens(empty, vocab_size=1024)


def _hash(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _make_dataset(root: Path, val_docs, train_docs, with_hashes=True, vocab_size=1024):
    root.mkdir(parents=True, exist_ok=True)
    write_data_shard(root / "fineweb_val_000000.bin", np.array([1, 5, 6]))
    write_data_shard(root / "fineweb_train_000000.bin", np.array([1, 7, 8]))
    splits = {}
    for split, docs in (("val", val_docs), ("train", train_docs)):
        splits[split] = {"num_docs": len(docs), "num_tokens": 3, "shards": [f"fineweb_{split}_000000.bin"]}
        if with_hashes:
            (root / f"doc_hashes_{split}.txt").write_text("".join(_hash(d) + "\n" for d in docs))
            splits[split]["doc_hashes_file"] = f"doc_hashes_{split}.txt"
    manifest = {"format": "parameter-golf-shards", "format_version": 1, "tokenizer": "t.model",
                "tokenizer_sha256": "0" * 64, "vocab_size": vocab_size, "bos_id": 1, "splits": splits, "source": {}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_check_manifest_disjoint_and_overlap(tmp_path):
    logs = []
    _make_dataset(tmp_path / "ok", ["a", "b"], ["c", "d", "e"])
    result = check_data_manifest(tmp_path / "ok", vocab_size=1024, log=logs.append)
    assert result["splits"]["val"]["num_docs"] == 2 and logs == []

    _make_dataset(tmp_path / "overlap", ["a", "b", "shared doc"], ["c", "shared doc", "d"])
    with pytest.raises(ValueError, match=r"1 documents in both train and val, e.g. hash " + _hash("shared doc") + "$"):
        check_data_manifest(tmp_path / "overlap")


def test_check_manifest_errors_and_skips(tmp_path):
    logs = []
    assert check_data_manifest(tmp_path, log=logs.append) is None
    assert logs[-1].startswith("warning: no ") and str(tmp_path / "manifest.json") in logs[-1]

    _make_dataset(tmp_path / "v", ["a"], ["b"], vocab_size=2048)
    with pytest.raises(ValueError, match=r"got \(format, vocab_size\) \('parameter-golf-shards', 2048\); .*VOCAB_SIZE=1024"):
        check_data_manifest(tmp_path / "v", vocab_size=1024)

    _make_dataset(tmp_path / "nohash", ["a"], ["a"], with_hashes=False)
    # Without hash files (the official HF download) the overlap can not be checked: None, logged.
    assert check_data_manifest(tmp_path / "nohash", vocab_size=1024, log=logs.append) is None
    manifest = tmp_path / "nohash" / "manifest.json"
    assert logs[-1] == f"warning: no doc hashes of both splits in {manifest}: train/val overlap not checked"

    _make_dataset(tmp_path / "missing", ["a"], ["b"])
    (tmp_path / "missing" / "fineweb_train_000000.bin").unlink()
    with pytest.raises(ValueError, match="No such file.*fineweb_train_000000.bin"):
        check_data_manifest(tmp_path / "missing")
    _make_dataset(tmp_path / "nohashfile", ["a"], ["b"])
    (tmp_path / "nohashfile" / "doc_hashes_val.txt").unlink()
    with pytest.raises(ValueError, match="No such file.*doc_hashes_val.txt"):
        check_data_manifest(tmp_path / "nohashfile")
    _make_dataset(tmp_path / "badhash", ["a"], ["b"])
    (tmp_path / "badhash" / "doc_hashes_val.txt").write_text("xyz\n")
    with pytest.raises(ValueError, match="lines of 16 hex chars"):
        check_data_manifest(tmp_path / "badhash")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json: Expecting property name"):
        check_data_manifest(tmp_path / "bad")
    (tmp_path / "bad" / "manifest.json").write_text('{"datasets": []}')  # the official HF manifest is not ours
    with pytest.raises(ValueError, match="manifest.json: 'format'; expected format parameter-golf-shards"):
        check_data_manifest(tmp_path / "bad")


def test_tiny_dataset_fixture_is_valid(tiny_dataset, sp1024_model):
    import sentencepiece as spm

    manifest = check_data_manifest(tiny_dataset, vocab_size=1024, log=lambda msg: None)
    assert manifest is not None
    val = load_validation_tokens(tiny_dataset, vocab_size=1024)
    assert val.numel() == manifest["splits"]["val"]["num_tokens"] > 5000
    assert val[0].item() == 1 and int((val == 1).sum()) == manifest["splits"]["val"]["num_docs"] == 50
    sp = spm.SentencePieceProcessor(model_file=str(sp1024_model))
    first_doc_end = int(torch.nonzero(val[1:] == 1)[0]) + 1
    assert sp.decode(val[1:first_doc_end].tolist())  # decodes to real text
    train = list_shards(tiny_dataset, "train")
    assert [p.name for p in train] == manifest["splits"]["train"]["shards"] and len(train) >= 2
    assert sum(read_shard_header(p) for p in train) == manifest["splits"]["train"]["num_tokens"]


def test_module_is_bundle_friendly():
    """shards/format.py is concatenated into train_gpt.py: only stdlib/numpy/torch imports and the
    atomic writer, no main guard; the format's numbers are named once (no literal magic in the code)."""
    source = (Path(__file__).resolve().parents[1] / "shards" / "format.py").read_text()
    tree = ast.parse(source)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"filecmp", "json", "os", "pathlib", "numpy", "torch", "primitives"}
    numbers = [n.value for f in tree.body if isinstance(f, ast.FunctionDef) for n in ast.walk(f) if isinstance(n, ast.Constant)]
    assert not {SHARD_MAGIC, SHARD_HEADER_INTS * 4, SHARD_TOKENS_PER_FILE} & {v for v in numbers if type(v) is int}
    assert "__main__" not in source
    assert len(source.splitlines()) < 250  # 180 before verify_dataset (the data binding every consumer calls)
