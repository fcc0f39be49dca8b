"""tools/prepare_data.py: jsonl/txt -> shards, tokenizer training, offline sample, fineweb download logic."""

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from shards.format import write_data_shard
from shards.format import check_data_manifest, list_shards, load_data_shard, load_validation_tokens, read_shard_header
from tools.data.data_fineweb import (
    HubUnreachableError,
    check_repo_id,
    dataset_dir_for_variant,
    download_fineweb,
    hub_manifest_local_path,
    local_path_for_remote,
)
from tools.data.data_sample import build_sample, sample_documents
from tools.data.data_shards import prepare_jsonl_dataset
from tools.data.data_text import iter_documents
from tools.data.data_tokenizer import check_tokenizer
from tools.data.prepare_data import build_parser, main

REPO_ROOT = Path(__file__).resolve().parents[1]
QUIET = dict(progress=False, log=lambda msg: None)


def file_sha256(path) -> str:
    """The sha256 a manifest records for a shard (shard_sha256), computed here on its own."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _write_jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return path


def _split_stream(data_path, split) -> np.ndarray:
    return np.concatenate([load_data_shard(p).numpy().astype(np.int64) for p in list_shards(data_path, split)])


def _expected_stream(sp, docs) -> np.ndarray:
    return np.concatenate([np.array([1] + sp.encode(d), dtype=np.int64) for d in docs])


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------- jsonl


def test_jsonl_to_shards_on_real_text(tmp_path, real_text_docs, sp1024_model):
    docs = real_text_docs[:60]
    src = _write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "ds"
    manifest = prepare_jsonl_dataset([src], sp1024_model, out, num_val_docs=10, shard_tokens=4096, **QUIET)
    sp = spm.SentencePieceProcessor(model_file=str(sp1024_model))

    val, train = _split_stream(out, "val"), _split_stream(out, "train")
    assert np.array_equal(val, _expected_stream(sp, docs[:10]))  # val = first N docs, [BOS] + encode, no EOS
    assert np.array_equal(train, _expected_stream(sp, docs[10:]))
    lengths = [len(sp.encode(d)) + 1 for d in docs]
    assert val.size == sum(lengths[:10]) and train.size == sum(lengths[10:])
    # Every document starts with BOS and BOS appears nowhere else.
    assert np.array_equal(np.flatnonzero(val == 1), np.cumsum([0] + lengths[:9]))
    assert np.array_equal(np.flatnonzero(train == 1), np.cumsum([0] + lengths[10:-1]))
    assert not np.any(train == 2)  # no EOS

    train_shards = list_shards(out, "train")
    sizes = [read_shard_header(p) for p in train_shards]
    assert len(sizes) == -(-train.size // 4096) and all(s == 4096 for s in sizes[:-1]) and 0 < sizes[-1] <= 4096
    assert [p.name for p in train_shards] == [f"fineweb_train_{i:06d}.bin" for i in range(len(sizes))]

    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["format"] == "parameter-golf-shards" and manifest["format_version"] == 1
    assert manifest["tokenizer"] == sp1024_model.name
    assert manifest["tokenizer_sha256"] == hashlib.sha256(sp1024_model.read_bytes()).hexdigest()
    assert (manifest["vocab_size"], manifest["bos_id"]) == (1024, 1)
    assert manifest["splits"]["val"] == {"num_docs": 10, "num_tokens": int(val.size),
                                         "shards": [p.name for p in list_shards(out, "val")],
                                         "shard_sha256": [file_sha256(p) for p in list_shards(out, "val")],
                                         "doc_hashes_file": "doc_hashes_val.txt"}
    assert manifest["splits"]["train"]["shard_sha256"] == [file_sha256(p) for p in list_shards(out, "train")]
    assert manifest["splits"]["train"]["num_docs"] == 50 and manifest["splits"]["train"]["num_tokens"] == train.size
    assert manifest["splits"]["train"]["shards"] == [p.name for p in train_shards]
    assert manifest["splits"]["train"]["num_dropped_overlap_docs"] == 0
    assert (out / "doc_hashes_val.txt").read_text().split() == [_sha(d) for d in docs[:10]]
    assert (out / "doc_hashes_train.txt").read_text().split() == [_sha(d) for d in docs[10:]]
    assert check_data_manifest(out, vocab_size=1024, log=lambda m: None) == json.loads((out / "manifest.json").read_text())
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]  # `name.tmp` and the writer's `.{name}.tmp{pid}`


def test_train_docs_equal_to_val_docs_are_dropped(tmp_path, real_text_docs, sp1024_model):
    docs = real_text_docs[:12]
    docs = docs[:4] + [docs[1]] + docs[4:] + [docs[0], docs[0]]  # 3 train copies of val docs
    out = tmp_path / "ds"
    logs = []
    manifest = prepare_jsonl_dataset([_write_jsonl(tmp_path / "d.jsonl", docs)], sp1024_model, out,
                                     num_val_docs=4, shard_tokens=1 << 20, progress=False, log=logs.append)
    assert manifest["splits"]["train"]["num_dropped_overlap_docs"] == 3
    assert manifest["splits"]["train"]["num_docs"] == len(docs) - 4 - 3 == 8
    assert any("dropped 3 train documents" in m for m in logs)
    sp = spm.SentencePieceProcessor(model_file=str(sp1024_model))
    assert np.array_equal(_split_stream(out, "train"), _expected_stream(sp, real_text_docs[4:12]))
    assert check_data_manifest(out, log=lambda m: None) is not None  # hashes compared, disjoint


def test_txt_input_blank_line_separated_and_max_docs(tmp_path, sp1024_model):
    txt = tmp_path / "notes.txt"
    txt.write_text("First document, line one.\nLine two.\n\n\n   \nSecond document.\n\nThird\n  indented line\n", encoding="utf-8")
    assert list(iter_documents([txt])) == ["First document, line one.\nLine two.", "Second document.", "Third\n  indented line"]
    jsonl = _write_jsonl(tmp_path / "more.jsonl", [f"Extra document number {i}." for i in range(5)])
    with open(jsonl, "a") as f:
        f.write("\n")  # a trailing blank line is not a document
    out = tmp_path / "ds"
    manifest = prepare_jsonl_dataset([txt, jsonl], sp1024_model, out, num_val_docs=2, max_docs=6, **QUIET)
    assert manifest["splits"]["val"]["num_docs"] == 2 and manifest["splits"]["train"]["num_docs"] == 4
    assert manifest["source"]["max_docs"] == 6 and manifest["source"]["num_input_docs"] == 6
    sp = spm.SentencePieceProcessor(model_file=str(sp1024_model))
    expected_train = ["Third\n  indented line"] + [f"Extra document number {i}." for i in range(3)]
    assert np.array_equal(_split_stream(out, "train"), _expected_stream(sp, expected_train))


def test_gzip_jsonl_input(tmp_path, sp1024_model):
    import gzip

    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": f"doc {i} über"}) + "\n" for i in range(4)))
    assert list(iter_documents([path])) == [f"doc {i} über" for i in range(4)]


def test_jsonl_errors_come_before_any_output(tmp_path, real_text_docs, sp1024_model):
    out = tmp_path / "ds"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        prepare_jsonl_dataset([tmp_path / "missing.jsonl"], sp1024_model, out, num_val_docs=1, **QUIET)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no documents"):
        prepare_jsonl_dataset([empty], sp1024_model, out, num_val_docs=1, **QUIET)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": broken\n{"text": "never read"}\n')
    with pytest.raises(ValueError, match=f"{bad}:3: invalid JSON"):
        prepare_jsonl_dataset([bad], sp1024_model, out, num_val_docs=1, **QUIET)
    notext = tmp_path / "notext.jsonl"
    notext.write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(ValueError, match=f'{notext}:2: expected a JSON object with a string "text"'):
        prepare_jsonl_dataset([notext], sp1024_model, out, num_val_docs=1, **QUIET)
    five = _write_jsonl(tmp_path / "five.jsonl", real_text_docs[:5])
    with pytest.raises(ValueError, match=r"--val-docs 5 must be smaller than the number of documents \(5\)"):
        prepare_jsonl_dataset([five], sp1024_model, out, num_val_docs=5, **QUIET)
    csv = tmp_path / "x.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        prepare_jsonl_dataset([csv], sp1024_model, out, num_val_docs=1, **QUIET)
    not_model = tmp_path / "tok.model"
    not_model.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        prepare_jsonl_dataset([five], not_model, out, num_val_docs=1, **QUIET)
    with pytest.raises(ValueError, match="--shard-tokens must be positive"):
        prepare_jsonl_dataset([five], sp1024_model, out, num_val_docs=1, shard_tokens=0, **QUIET)
    assert not out.exists()


def test_tokenizer_vocab_over_uint16_is_rejected():
    class HugeVocab:  # a real 65,537-piece model takes minutes to train; the check only reads these
        def vocab_size(self):
            return 65537

        def bos_id(self):
            return 1

    with pytest.raises(ValueError, match="vocab_size 65537 > 65536"):
        check_tokenizer(HugeVocab(), "huge.model")


def test_jsonl_cli(tmp_path, real_text_docs, sp1024_model, capsys):
    src = _write_jsonl(tmp_path / "docs.jsonl", real_text_docs[:20])
    out = tmp_path / "ds"
    rc = main(["jsonl", "--input", str(src), "--tokenizer", str(sp1024_model), "--out", str(out),
               "--val-docs", "5", "--shard-tokens", "2048"])
    captured = capsys.readouterr()
    assert rc == 0
    assert f"DATA_PATH={out}" in captured.out and f"TOKENIZER_PATH={sp1024_model}" in captured.out
    assert "VOCAB_SIZE=1024" in captured.out
    assert json.loads((out / "manifest.json").read_text())["splits"]["val"]["num_docs"] == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    assert main(["jsonl", "--input", str(bad), "--tokenizer", str(sp1024_model), "--out", str(tmp_path / "x"), "--val-docs", "1"]) == 2
    assert f"{bad}:1: invalid JSON" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tokenizer


def _proto_fields(buf: bytes) -> dict:
    """Minimal protobuf wire-format reader: {field_number: [values]} (varint -> int, len -> bytes, fixed32 -> bytes)."""
    fields, i = {}, 0

    def varint():
        nonlocal i
        value = shift = 0
        while True:
            b = buf[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value

    while i < len(buf):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
        elif wire == 2:
            n = varint()
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        fields.setdefault(field, []).append(value)
    return fields


def _sp_specs(model_path: Path):
    """(trainer_spec, normalizer_spec) of a .model file, field numbers from sentencepiece_model.proto."""
    model = _proto_fields(Path(model_path).read_bytes())
    trainer, normalizer = _proto_fields(model[2][0]), _proto_fields(model[3][0])
    signed = lambda v: v - (1 << 64) if v >= 1 << 63 else v  # noqa: E731  int32 -1 is a 10-byte varint
    spec = {
        "model_type": trainer[3][0],  # UNIGRAM=1, BPE=2
        "vocab_size": trainer[4][0],
        "character_coverage": struct.unpack("<f", trainer[10][0])[0],
        "split_digits": bool(trainer.get(25, [0])[0]),
        "byte_fallback": bool(trainer.get(35, [0])[0]),
        "hard_vocab_limit": bool(trainer.get(33, [1])[0]),
        "ids": tuple(signed(trainer.get(f, [d])[0]) for f, d in ((43, -1), (41, 1), (42, 2), (40, 0))),  # pad bos eos unk
    }
    norm = {"name": normalizer[1][0].decode(), "add_dummy_prefix": bool(normalizer.get(3, [1])[0])}
    return spec, norm


def test_proto_reader_matches_the_published_tokenizer(shared_dir):
    if shared_dir is None or not (shared_dir / "data/tokenizers/fineweb_1024_bpe.model").is_file():
        pytest.skip("needs ../shared/data/tokenizers/fineweb_1024_bpe.model")
    spec, norm = _sp_specs(shared_dir / "data/tokenizers/fineweb_1024_bpe.model")
    assert spec["model_type"] == 2 and spec["vocab_size"] == 1024 and spec["split_digits"]
    assert spec["character_coverage"] == pytest.approx(0.999) and spec["ids"] == (0, 1, 2, 3)
    assert not spec["byte_fallback"]  # the published sp1024 has no byte fallback (see ../shared/data/README.md)
    assert norm == {"name": "nmt_nfkc", "add_dummy_prefix": False}


def test_tokenizer_subcommand_official_settings(tmp_path, real_text_docs, capsys):
    src = _write_jsonl(tmp_path / "docs.jsonl", real_text_docs[:150])
    prefix = tmp_path / "tok" / "mini_512_bpe"
    assert main(["tokenizer", "--input", str(src), "--vocab-size", "512", "--out", str(prefix),
                 "--max-sentence-length", "100000"]) == 0
    model = prefix.with_name("mini_512_bpe.model")
    assert capsys.readouterr().out.strip() == str(model)
    spec, norm = _sp_specs(model)
    assert spec == {"model_type": 2, "vocab_size": 512, "character_coverage": pytest.approx(0.999), "split_digits": True,
                    "byte_fallback": True, "hard_vocab_limit": False, "ids": (0, 1, 2, 3)}
    assert norm == {"name": "nmt_nfkc", "add_dummy_prefix": False}

    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert sp.vocab_size() == 512
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert sp.id_to_piece(4) == "<0x00>" and sp.id_to_piece(259) == "<0xFF>"  # byte fallback pieces
    assert [p.strip("▁") for p in sp.encode("2024", out_type=str)] == ["2", "0", "2", "4"]  # split digits
    assert not sp.encode("Hello", out_type=str)[0].startswith("▁")  # no dummy prefix
    assert sp.decode(sp.encode("ﬁne")) == "fine"  # NFKC folds the ligature
    assert 3 not in sp.encode("日本")  # unseen characters become bytes, not <unk>
    vocab_lines = prefix.with_name("mini_512_bpe.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 512 and vocab_lines[1] == "<s>\t0" and vocab_lines[4] == "<0x00>\t0"

    # Deterministic and path independent: the same text gives the same bytes.
    assert main(["tokenizer", "--input", str(src), "--vocab-size", "512", "--out", str(tmp_path / "again"),
                 "--max-sentence-length", "100000"]) == 0
    assert (tmp_path / "again.model").read_bytes() == model.read_bytes()
    assert main(["tokenizer", "--input", str(src), "--vocab-size", "512", "--out", str(tmp_path / "nbf"),
                 "--no-byte-fallback", "--max-sentence-length", "100000"]) == 0
    assert not _sp_specs(tmp_path / "nbf.model")[0]["byte_fallback"]


# ----------------------------------------------------------------------------- sample


def test_sample_documents_are_real_text_and_deterministic():
    docs = sample_documents()
    assert len(docs) >= 300 and len(set(docs)) == len(docs)
    assert docs == sample_documents()
    assert sum(len(d) for d in docs) > 400_000
    assert any("The following identifiers" in d or "identifiers" in d for d in docs)


def test_sample_command_end_to_end(tmp_path):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "prepare_data.py"), "sample", "--out", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    paths = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    data_path, tokenizer_path = Path(paths["DATA_PATH"]), Path(paths["TOKENIZER_PATH"])
    assert data_path == tmp_path / "data" / "datasets" / "pydoc_sample_sp1024"
    assert tokenizer_path == tmp_path / "data" / "tokenizers" / "pydoc_sample_1024_bpe.model"
    assert paths["VOCAB_SIZE"] == "1024" and seconds < 60

    manifest = check_data_manifest(data_path, vocab_size=1024, log=lambda m: None)
    assert manifest is not None  # hashes compared, disjoint
    val_info, train_info = manifest["splits"]["val"], manifest["splits"]["train"]
    assert val_info["num_docs"] >= 30 and train_info["num_docs"] >= 270
    assert val_info["num_tokens"] >= 10_000  # > 39 windows of 256 tokens
    assert train_info["num_tokens"] >= 100_000 and train_info["num_dropped_overlap_docs"] == 0
    val = load_validation_tokens(data_path, vocab_size=1024)
    assert val.numel() == val_info["num_tokens"] and val[0].item() == 1
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    assert sp.vocab_size() == 1024 and sp.bos_id() == 1
    assert manifest["tokenizer_sha256"] == hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    docs = [json.loads(line)["text"] for line in (tmp_path / "data/text/pydoc_sample.jsonl").read_text().splitlines()]
    assert docs == sample_documents()
    assert np.array_equal(val.numpy(), _expected_stream(sp, docs[:val_info["num_docs"]]))

    # Deterministic: an in-process rebuild elsewhere gives byte-identical tokenizer and shards.
    again = build_sample(tmp_path / "again", **QUIET)
    assert again["tokenizer_path"].read_bytes() == tokenizer_path.read_bytes()
    for name in val_info["shards"] + train_info["shards"]:
        assert (again["data_path"] / name).read_bytes() == (data_path / name).read_bytes()


# ----------------------------------------------------------------------------- fineweb


class FakeHub:
    """Stands in for hf_hub_download: serves files of a local dir laid out like the HF dataset repo."""

    def __init__(self, root: Path):
        self.root, self.calls = root, []

    def __call__(self, repo_id, remote_path):
        self.calls.append((repo_id, remote_path))
        path = self.root / remote_path
        if not path.is_file():
            raise FileNotFoundError(f"404 {remote_path}")
        return path


def _make_fake_hub(root: Path, sp_model: Path, files_train=3, *, vocab_size=1024, files_val=1, seed=0) -> tuple:
    """Official layout: datasets/manifest.json, datasets/datasets/fineweb10B_sp<V>/*.bin, datasets/tokenizers/*.

    Val shard i holds 7 + i documents, train shard i 11 + i; tokens in [4, vocab_size)."""
    base = root / "datasets"
    dataset = f"fineweb10B_sp{vocab_size}"
    ds = base / "datasets" / dataset
    ds.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    shards = {}

    def shard(num_docs):
        return np.concatenate([np.r_[1, rng.integers(4, vocab_size, size=rng.integers(5, 40))] for _ in range(num_docs)])

    for i in range(files_val):
        shards[f"fineweb_val_{i:06d}.bin"] = shard(7 + i)
    for i in range(files_train):
        shards[f"fineweb_train_{i:06d}.bin"] = shard(11 + i)
    for name, toks in shards.items():
        write_data_shard(ds / name, toks)
    (base / "tokenizers").mkdir()
    tok = f"fineweb_{vocab_size}_bpe"
    shutil.copyfile(sp_model, base / "tokenizers" / f"{tok}.model")
    shutil.copyfile(sp_model.with_suffix(".vocab"), base / "tokenizers" / f"{tok}.vocab")
    docs_val = sum(7 + i for i in range(files_val))
    stats = {"docs_total": docs_val + sum(11 + i for i in range(files_train)), "docs_val": docs_val, "files_val": files_val,
             "files_train": files_train, "files_total": files_val + files_train,
             "tokens_val": sum(int(shards[f"fineweb_val_{i:06d}.bin"].size) for i in range(files_val))}
    manifest = {
        "version": "10B", "num_val_docs": docs_val, "shard_size": 100_000_000, "append_eos": False,
        "tokenizers": [{"name": f"sp_bpe_{vocab_size}", "kind": "sentencepiece_bpe", "vocab_size": vocab_size, "bos_id": 1,
                        "eos_id": 2, "model_path": f"tokenizers/{tok}.model", "vocab_path": f"tokenizers/{tok}.vocab"}],
        "datasets": [{"name": dataset, "tokenizer_name": f"sp_bpe_{vocab_size}", "tokenizer_kind": "sentencepiece_bpe",
                      "path": f"datasets/{dataset}", "vocab_size": vocab_size, "bos_id": 1, "eos_id": 2, "stats": stats}],
    }
    (base / "manifest.json").write_text(json.dumps(manifest))
    return shards, manifest


@pytest.fixture(scope="session")
def sp8192_model(shared_dir) -> Path:
    """The published fineweb_8192_bpe.model from ../shared (training an 8192-piece model takes too long)."""
    path = None if shared_dir is None else shared_dir / "data/tokenizers/fineweb_8192_bpe.model"
    if path is None or not path.is_file() or not path.with_suffix(".vocab").is_file():
        pytest.skip("needs ../shared/data/tokenizers/fineweb_8192_bpe.{model,vocab}")
    return path


def _local_files(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_fineweb_manifest_driven_download_offline(tmp_path, sp1024_model):
    shards, _ = _make_fake_hub(tmp_path / "hub", sp1024_model)
    hub = FakeHub(tmp_path / "hub")
    out = tmp_path / "data"
    logs = []
    result = download_fineweb("sp1024", 2, out, downloader=hub, progress=False, log=logs.append)
    prefix = "datasets/datasets/fineweb10B_sp1024/"
    assert hub.calls == [("willdepueoai/parameter-golf", p) for p in [
        "datasets/manifest.json", prefix + "fineweb_val_000000.bin", prefix + "fineweb_train_000000.bin",
        prefix + "fineweb_train_000001.bin", "datasets/tokenizers/fineweb_1024_bpe.model",
        "datasets/tokenizers/fineweb_1024_bpe.vocab"]]
    data_path = out / "datasets" / "fineweb10B_sp1024"
    assert result["data_path"] == data_path and result["vocab_size"] == 1024
    assert result["tokenizer_path"] == out / "tokenizers" / "fineweb_1024_bpe.model"
    hub_manifest = out / "hub_manifests" / "willdepueoai" / "parameter-golf" / "datasets" / "manifest.json"
    assert hub_manifest_local_path(out, "willdepueoai/parameter-golf") == hub_manifest
    assert hub_manifest.read_bytes() == (tmp_path / "hub/datasets/manifest.json").read_bytes()
    assert not (out / "manifest.json").exists() and (out / "tokenizers" / "fineweb_1024_bpe.vocab").is_file()
    assert sorted(p.name for p in data_path.glob("*.bin")) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    assert np.array_equal(load_validation_tokens(data_path, 1024).numpy(), shards["fineweb_val_000000.bin"])

    manifest = json.loads((data_path / "manifest.json").read_text())
    assert manifest["format"] == "parameter-golf-shards" and manifest["bos_id"] == 1 and manifest["vocab_size"] == 1024
    assert manifest["tokenizer"] == "fineweb_1024_bpe.model"
    assert manifest["tokenizer_sha256"] == hashlib.sha256(sp1024_model.read_bytes()).hexdigest()
    assert manifest["splits"]["val"] == {"num_docs": 7, "num_tokens": int(shards["fineweb_val_000000.bin"].size),
                                         "shards": ["fineweb_val_000000.bin"],
                                         "shard_sha256": [file_sha256(data_path / "fineweb_val_000000.bin")]}
    assert manifest["splits"]["train"]["num_docs"] == 11 + 12
    assert manifest["splits"]["train"]["num_tokens"] == sum(shards[f"fineweb_train_{i:06d}.bin"].size for i in range(2))
    assert manifest["source"]["num_train_shards_available"] == 3
    assert manifest["source"]["repo_id"] == "willdepueoai/parameter-golf"
    # No doc hashes in the official download: the overlap can not be checked (None, warned).
    assert check_data_manifest(data_path, vocab_size=1024, log=logs.append) is None
    assert "train/val overlap not checked" in logs[-1]

    # Re-run: only the (small) hub manifest is fetched again, the rest is local; asking for one more
    # shard fetches only that one.
    hub.calls.clear()
    download_fineweb("sp1024", 2, out, downloader=hub, **QUIET)
    assert hub.calls == [("willdepueoai/parameter-golf", "datasets/manifest.json")]
    hub.calls.clear()
    download_fineweb("sp1024", 3, out, downloader=hub, **QUIET)
    assert hub.calls == [("willdepueoai/parameter-golf", p) for p in ["datasets/manifest.json", prefix + "fineweb_train_000002.bin"]]
    # A damaged local shard is fetched again.
    hub.calls.clear()
    (data_path / "fineweb_train_000001.bin").unlink()  # a hard link to the cache blob: never write it in place
    (data_path / "fineweb_train_000001.bin").write_bytes(b"\x00" * 10)
    download_fineweb("sp1024", 2, out, downloader=hub, **QUIET)
    assert hub.calls == [("willdepueoai/parameter-golf", p) for p in ["datasets/manifest.json", prefix + "fineweb_train_000001.bin"]]
    assert json.loads((data_path / "manifest.json").read_text())["splits"]["train"]["shards"] == [
        f"fineweb_train_{i:06d}.bin" for i in range(3)]


def test_fineweb_manifest_errors(tmp_path, sp1024_model):
    _make_fake_hub(tmp_path / "hub", sp1024_model)
    hub = FakeHub(tmp_path / "hub")
    with pytest.raises(ValueError, match="--train-shards 4: sp1024 has only 3 train shards"):
        download_fineweb("sp1024", 4, tmp_path / "d1", downloader=hub, **QUIET)
    with pytest.raises(ValueError, match=r"fineweb10B_sp4096 .* available: \['fineweb10B_sp1024'\]; "
                                         r"the sp4096 export is in --repo-id kevclark/parameter-golf"):
        download_fineweb("sp4096", 1, tmp_path / "d2", downloader=hub, **QUIET)
    with pytest.raises(ValueError, match="expected sp<VOCAB_SIZE>"):
        download_fineweb("gpt2", 1, tmp_path / "d3", downloader=hub, **QUIET)
    with pytest.raises(ValueError, match="--train-shards must be >= 0"):
        download_fineweb("sp1024", -1, tmp_path / "d4", downloader=hub, **QUIET)
    (tmp_path / "hub/datasets/datasets/fineweb10B_sp1024/fineweb_train_000001.bin").unlink()
    with pytest.raises(ValueError, match="cannot download datasets/datasets/fineweb10B_sp1024/fineweb_train_000001.bin "
                                         "from dataset repo willdepueoai/parameter-golf: FileNotFoundError"):
        download_fineweb("sp1024", 2, tmp_path / "d5", downloader=hub, **QUIET)
    assert dataset_dir_for_variant("sp8192") == "fineweb10B_sp8192" and dataset_dir_for_variant("byte260") == "fineweb10B_byte260"
    assert local_path_for_remote("datasets/tokenizers/a.model", "datasets", tmp_path) == tmp_path / "tokenizers" / "a.model"
    assert local_path_for_remote("datasets/manifest.json", "datasets", tmp_path) == tmp_path / "manifest.json"
    with pytest.raises(ValueError, match="refusing remote path"):
        local_path_for_remote("datasets/../../etc/passwd", "datasets", tmp_path)


def test_fineweb_sp8192_from_kevclark_repo(tmp_path, sp8192_model):
    shards, hub_manifest = _make_fake_hub(tmp_path / "hub", sp8192_model, files_train=3, files_val=2, vocab_size=8192)
    hub = FakeHub(tmp_path / "hub")
    out = tmp_path / "data"
    result = download_fineweb("sp8192", 1, out, repo_id="kevclark/parameter-golf", downloader=hub, **QUIET)
    prefix = "datasets/datasets/fineweb10B_sp8192/"
    assert hub.calls == [("kevclark/parameter-golf", p) for p in [
        "datasets/manifest.json", prefix + "fineweb_val_000000.bin", prefix + "fineweb_val_000001.bin",
        prefix + "fineweb_train_000000.bin", "datasets/tokenizers/fineweb_8192_bpe.model",
        "datasets/tokenizers/fineweb_8192_bpe.vocab"]]
    assert _local_files(out) == [
        "datasets/fineweb10B_sp8192/fineweb_train_000000.bin", "datasets/fineweb10B_sp8192/fineweb_val_000000.bin",
        "datasets/fineweb10B_sp8192/fineweb_val_000001.bin", "datasets/fineweb10B_sp8192/manifest.json",
        "hub_manifests/kevclark/parameter-golf/datasets/manifest.json",
        "tokenizers/fineweb_8192_bpe.model", "tokenizers/fineweb_8192_bpe.vocab"]
    for remote in [p for _, p in hub.calls if p != "datasets/manifest.json"]:
        local = out / remote.removeprefix("datasets/")
        assert local.read_bytes() == (tmp_path / "hub" / remote).read_bytes(), remote

    data_path = out / "datasets" / "fineweb10B_sp8192"
    assert result["data_path"] == data_path and result["vocab_size"] == 8192
    assert result["tokenizer_path"] == out / "tokenizers" / "fineweb_8192_bpe.model"
    val = np.concatenate([shards["fineweb_val_000000.bin"], shards["fineweb_val_000001.bin"]])
    assert np.array_equal(load_validation_tokens(data_path, 8192).numpy(), val)
    manifest = json.loads((data_path / "manifest.json").read_text())
    assert manifest == result["manifest"]
    assert (manifest["vocab_size"], manifest["bos_id"], manifest["tokenizer"]) == (8192, 1, "fineweb_8192_bpe.model")
    assert manifest["tokenizer_sha256"] == hashlib.sha256(sp8192_model.read_bytes()).hexdigest()
    assert manifest["splits"]["val"] == {"num_docs": 7 + 8, "num_tokens": int(val.size),
                                         "shards": ["fineweb_val_000000.bin", "fineweb_val_000001.bin"],
                                         "shard_sha256": [file_sha256(data_path / n) for n in ("fineweb_val_000000.bin",
                                                                                               "fineweb_val_000001.bin")]}
    assert manifest["splits"]["train"] == {"num_docs": 11, "num_tokens": int(shards["fineweb_train_000000.bin"].size),
                                           "shards": ["fineweb_train_000000.bin"],
                                           "shard_sha256": [file_sha256(data_path / "fineweb_train_000000.bin")]}
    assert manifest["source"]["repo_id"] == "kevclark/parameter-golf"
    assert (manifest["source"]["variant"], manifest["source"]["dataset"]) == ("sp8192", "fineweb10B_sp8192")
    assert manifest["source"]["num_train_shards_available"] == 3 and manifest["source"]["hub_stats"] == hub_manifest["datasets"][0]["stats"]


def test_fineweb_two_repos_into_one_out_dir(tmp_path, sp1024_model, sp8192_model):
    """Regression: the hub manifest was kept as out_root/manifest.json and never fetched again, so an
    sp8192 download from kevclark after an sp1024 one from willdepueoai read the stale manifest and
    failed with "dataset fineweb10B_sp8192 not in ..."."""
    _, official_manifest = _make_fake_hub(tmp_path / "official", sp1024_model, files_train=2)
    _, kevclark_manifest = _make_fake_hub(tmp_path / "kevclark", sp8192_model, files_train=2, vocab_size=8192, seed=1)
    hubs = {"willdepueoai/parameter-golf": FakeHub(tmp_path / "official"), "kevclark/parameter-golf": FakeHub(tmp_path / "kevclark")}

    def downloader(repo_id, remote_path):
        return hubs[repo_id](repo_id, remote_path)

    out = tmp_path / "data"
    out.mkdir()
    # What the old code left behind: the official manifest at out_root/manifest.json. It is ignored now.
    shutil.copyfile(tmp_path / "official/datasets/manifest.json", out / "manifest.json")
    first = download_fineweb("sp1024", 1, out, downloader=downloader, **QUIET)
    second = download_fineweb("sp8192", 1, out, repo_id="kevclark/parameter-golf", downloader=downloader, **QUIET)
    assert (first["vocab_size"], second["vocab_size"]) == (1024, 8192)
    official_kept = out / "hub_manifests/willdepueoai/parameter-golf/datasets/manifest.json"
    kevclark_kept = out / "hub_manifests/kevclark/parameter-golf/datasets/manifest.json"
    assert json.loads(official_kept.read_text()) == official_manifest
    assert json.loads(kevclark_kept.read_text()) == kevclark_manifest
    for result, repo_id, tokenizer in ((first, "willdepueoai/parameter-golf", sp1024_model),
                                       (second, "kevclark/parameter-golf", sp8192_model)):
        manifest = json.loads((result["data_path"] / "manifest.json").read_text())
        assert manifest["source"]["repo_id"] == repo_id
        assert manifest["tokenizer_sha256"] == hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    assert sorted(p.name for p in (out / "datasets").iterdir()) == ["fineweb10B_sp1024", "fineweb10B_sp8192"]
    assert sorted(p.name for p in (out / "tokenizers").iterdir()) == [
        "fineweb_1024_bpe.model", "fineweb_1024_bpe.vocab", "fineweb_8192_bpe.model", "fineweb_8192_bpe.vocab"]
    # And back again: sp1024 from the default repo still works, asking only for its own manifest.
    hubs["willdepueoai/parameter-golf"].calls.clear()
    download_fineweb("sp1024", 1, out, downloader=downloader, **QUIET)
    assert hubs["willdepueoai/parameter-golf"].calls == [("willdepueoai/parameter-golf", "datasets/manifest.json")]


def test_fineweb_hub_manifest_is_fresh_and_kept_copy_serves_offline(tmp_path, sp1024_model):
    _, manifest = _make_fake_hub(tmp_path / "hub", sp1024_model, files_train=2)
    hub = FakeHub(tmp_path / "hub")
    out = tmp_path / "data"
    download_fineweb("sp1024", 1, out, downloader=hub, **QUIET)
    kept = hub_manifest_local_path(out, "willdepueoai/parameter-golf")
    # The hub's manifest changes (files are replaced, never rewritten in place: the kept copy may be a hard link).
    manifest["datasets"][0]["stats"]["files_train"] = 1
    (tmp_path / "hub/datasets/manifest.json").unlink()
    (tmp_path / "hub/datasets/manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="--train-shards 2: sp1024 has only 1 train shards"):
        download_fineweb("sp1024", 2, out, downloader=hub, **QUIET)
    assert json.loads(kept.read_text()) == manifest

    def no_network(repo_id, remote_path):
        raise ConnectionError("cannot connect")

    logs = []
    result = download_fineweb("sp1024", 1, out, downloader=no_network, progress=False, log=logs.append)
    assert result["vocab_size"] == 1024 and result["manifest"]["splits"]["train"]["shards"] == ["fineweb_train_000000.bin"]
    assert logs[0].startswith("warning: cannot reach the Hugging Face Hub for dataset repo willdepueoai/parameter-golf")
    assert f"using the copy kept in {kept} (may be stale)" in logs[0]
    # Without a kept copy for that repo: unreachable as before.
    with pytest.raises(HubUnreachableError, match="kevclark/parameter-golf"):
        download_fineweb("sp8192", 1, out, repo_id="kevclark/parameter-golf", downloader=no_network, **QUIET)


@pytest.mark.parametrize("repo_id", ["parameter-golf", "kevclark/parameter-golf/extra", "../parameter-golf", "kevclark/..",
                                     "kevclark/", "/parameter-golf", "kevclark/parameter golf", "kevclark/a--b",
                                     "kevclark\\parameter-golf", "-x/parameter-golf", ""])
def test_fineweb_bad_repo_id_refused_before_any_download(tmp_path, repo_id, capsys):
    hub = FakeHub(tmp_path / "hub")
    with pytest.raises(ValueError, match="--repo-id .*expected a Hugging Face dataset repo id 'owner/name'"):
        download_fineweb("sp8192", 1, tmp_path / "data", repo_id=repo_id, downloader=hub, **QUIET)
    assert hub.calls == [] and not (tmp_path / "data").exists()
    assert main(["fineweb", "--variant", "sp8192", "--train-shards", "1", f"--repo-id={repo_id}",
                 "--out-root", str(tmp_path / "data")]) == 2  # the real client: refused before it is called
    assert f"--repo-id {repo_id!r}" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_repo_id_check_and_fineweb_help():
    assert check_repo_id("willdepueoai/parameter-golf") == ("willdepueoai", "parameter-golf")
    assert check_repo_id("kevclark/parameter-golf") == ("kevclark", "parameter-golf")
    assert check_repo_id("A.b_c/x-1.0") == ("A.b_c", "x-1.0")
    fineweb = next(a for a in build_parser()._subparsers._group_actions[0].choices["fineweb"]._actions if a.dest == "repo_id")
    assert "sp1024" in fineweb.help and "--repo-id kevclark/parameter-golf" in fineweb.help
    import tools.data.prepare_data as prepare_data

    for variant in ("sp4096", "sp8192"):
        assert f"fineweb --variant {variant} --train-shards 14 --repo-id kevclark/parameter-golf" in prepare_data.__doc__
    assert "fineweb --variant sp1024 --train-shards 14\n" in prepare_data.__doc__


def test_fineweb_hub_unreachable_names_offline_modes(tmp_path):
    def no_network(repo_id, remote_path):
        try:
            raise OSError("[Errno -2] Name or service not known")
        except OSError as exc:
            raise ConnectionError("cannot connect") from exc

    with pytest.raises(HubUnreachableError) as info:
        download_fineweb("sp1024", 1, tmp_path / "data", downloader=no_network, **QUIET)
    message = str(info.value)
    assert "willdepueoai/parameter-golf" in message and "sample --out data" in message and "jsonl --input" in message
    assert not (tmp_path / "data" / "datasets").exists()


def test_fineweb_cli_offline_with_real_hf_client(tmp_path):
    """The real huggingface_hub code path, kept off the network by HF_HUB_OFFLINE=1."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    proc = subprocess.run([sys.executable, "-m", "tools.data.prepare_data", "fineweb", "--variant", "sp1024",
                           "--train-shards", "1", "--out-root", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 3, proc.stderr
    assert "cannot reach the Hugging Face Hub" in proc.stderr
    assert "prepare_data.py sample" in proc.stderr and "prepare_data.py jsonl" in proc.stderr
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- whole-dataset writes


def _tree(root: Path) -> dict:
    """relative path -> bytes of every file under root (names of temporaries included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _disk_full_after(calls_ok: int, real):
    """A writer that works `calls_ok` times, then writes half a file at its target and raises ENOSPC
    as write() does (an OSError without a file name)."""
    import errno

    calls = []

    def writer(path, *args, **kwargs):
        calls.append(path)
        if len(calls) > calls_ok:
            Path(path).write_bytes(b"\x00" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)
    return writer


def _one_error_line(capsys) -> str:
    """The one error line on stderr (progress lines aside), last, with no traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert sum("error" in line for line in lines) == 1 and lines[-1].startswith("error: "), err
    assert "Traceback" not in err, err
    return lines[-1]


@pytest.mark.parametrize("existing", [True, False], ids=["over an existing dataset", "new folder"])
def test_jsonl_disk_full_keeps_the_old_dataset_or_leaves_nothing(tmp_path, real_text_docs, sp1024_model, monkeypatch,
                                                                  capsys, existing):
    import tools.data.data_shards as data_shards

    docs = _write_jsonl(tmp_path / "docs.jsonl", real_text_docs[:60])
    root = tmp_path / "root"
    out = root / "ds"
    argv = ["jsonl", "--input", str(docs), "--tokenizer", str(sp1024_model), "--out", str(out), "--val-docs", "10",
            "--shard-tokens", "4000"]
    if existing:
        assert main(argv) == 0
        (out / "notes.txt").write_text("the user's own notes\n")
        assert len(list(out.glob("fineweb_train_*.bin"))) >= 2
    else:
        root.mkdir()
    before = _tree(root)
    capsys.readouterr()
    monkeypatch.setattr(data_shards, "write_data_shard", _disk_full_after(2, data_shards.write_data_shard))
    assert main(argv[:-2] + ["--shard-tokens", "3000"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {out}: No space left on device;"), line
    assert ("previous files there are unchanged" if existing else "nothing was written") in line
    assert _tree(root) == before  # the old dataset byte for byte (or nothing), no temporary files
    assert sorted(p.name for p in root.iterdir()) == (["ds"] if existing else [])

    monkeypatch.undo()
    assert main(argv[:-2] + ["--shard-tokens", "3000"]) == 0  # and it works once there is room
    assert json.loads((out / "manifest.json").read_text())["shard_tokens"] == 3000
    assert (out / "notes.txt").exists() == existing  # files the tool does not write are carried over
    assert sorted(p.name for p in root.iterdir()) == ["ds"]


def test_jsonl_interrupt_keeps_the_old_dataset(tmp_path, real_text_docs, sp1024_model, monkeypatch, capsys):
    import tools.data.data_shards as data_shards

    docs = _write_jsonl(tmp_path / "docs.jsonl", real_text_docs[:40])
    out = tmp_path / "ds"
    argv = ["jsonl", "--input", str(docs), "--tokenizer", str(sp1024_model), "--out", str(out), "--val-docs", "5",
            "--shard-tokens", "4000"]
    assert main(argv) == 0
    before = _tree(tmp_path)
    capsys.readouterr()

    def interrupted(path, tokens):
        raise KeyboardInterrupt

    monkeypatch.setattr(data_shards, "write_data_shard", interrupted)
    assert main(argv[:-1] + ["5000"]) == 130
    assert _one_error_line(capsys) == (f"error: interrupted while writing {out}; the previous files there are "
                                       "unchanged, temporary files removed")
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("existing", [True, False], ids=["over an existing sample", "new folder"])
def test_sample_disk_full_keeps_text_tokenizer_and_dataset(tmp_path, monkeypatch, capsys, existing):
    import tools.data.data_shards as data_shards

    root = tmp_path / "data"
    if existing:
        build_sample(root, **QUIET)
    before = _tree(tmp_path)
    monkeypatch.setattr(data_shards, "write_data_shard", _disk_full_after(1, data_shards.write_data_shard))
    # --val-docs 50: another tokenizer (trained on other documents) and other shards, were it written
    assert main(["sample", "--out", str(root), "--val-docs", "50", "--shard-tokens", "20000"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {root / 'datasets' / 'pydoc_sample_sp1024'}: No space left on device;"), line
    assert _tree(tmp_path) == before
    assert root.exists() == existing  # a new --out root is not left behind, empty or not


def test_fineweb_disk_full_mid_download_keeps_the_old_dataset(tmp_path, sp1024_model, monkeypatch, capsys):
    import errno

    import tools.data.data_fineweb as data_fineweb

    _make_fake_hub(tmp_path / "hub", sp1024_model, files_train=3)
    hub = FakeHub(tmp_path / "hub")
    out = tmp_path / "data"
    download_fineweb("sp1024", 1, out, downloader=hub, **QUIET)
    data_path = out / "datasets" / "fineweb10B_sp1024"
    before = _tree(out)
    real, calls = data_fineweb.link_or_copy, []

    def disk_full(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the second new shard
            Path(dst).write_bytes(b"\x00" * 10)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(data_fineweb, "link_or_copy", disk_full)
    with pytest.raises(OSError) as info:
        download_fineweb("sp1024", 3, out, downloader=hub, **QUIET)
    assert info.value.filename == str(data_path) and "previous files there are unchanged" in info.value.strerror
    assert _tree(out) == before
    # a new dataset folder: nothing is left of it, nor of the tokenizer files it would have fetched
    shutil.rmtree(out / "tokenizers")
    shutil.rmtree(out / "datasets")
    calls.clear()
    with pytest.raises(OSError, match="nothing was written"):
        download_fineweb("sp1024", 3, out, downloader=hub, **QUIET)
    assert sorted(p.name for p in out.iterdir()) == ["hub_manifests"]
    assert not (out / "datasets").exists()


def test_leftovers_of_a_killed_write_are_cleaned_or_restored(tmp_path):
    from tools.data.data_stage import recover_leftovers

    final = tmp_path / "ds"
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / f".ds.tmp-{dead_pid}").mkdir()
    (tmp_path / f".ds.tmp-{dead_pid}" / "fineweb_val_000000.bin").write_bytes(b"half")
    (tmp_path / f".ds.old-{dead_pid}").mkdir()  # killed between the two renames: ds is missing
    (tmp_path / f".ds.old-{dead_pid}" / "manifest.json").write_text("{}")
    (tmp_path / f".ds.tmp-{os.getppid()}").mkdir()  # a live writer's folder is left alone
    logs = []
    recover_leftovers(final, logs.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".ds.tmp-{os.getppid()}", "ds"]
    assert (final / "manifest.json").read_text() == "{}" and "restored" in logs[0]
