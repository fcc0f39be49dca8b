"""CaseOps data: the transform (shards/caseops.py), `tools/prepare_data.py caseops` (shards + val byte
sidecar, the leak refusal) and its byte-identity with the records' prepare_caseops_data.py (PR #1855)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shards.caseops import (CASEOPS_OPERATORS, CaseOpsError, decode_caseops, encode_caseops,
                            encode_with_original_bytes, piece_original_bytes)
from shards.format import SHARD_HEADER_BYTES, list_shards, read_shard_header
from tools.data.prepare_data import main as prepare_main

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
REFERENCE = SHARED / "reference/pr1855"
CASEOPS_MODEL = REFERENCE / "tokenizers/fineweb_8192_bpe_lossless_caps_caseops_v1_reserved.model"
TEXT_FILES = sorted((SHARED / "data/text").glob("*.jsonl")) if (SHARED / "data/text").is_dir() else []
needs_shared = pytest.mark.skipif(not (CASEOPS_MODEL.is_file() and TEXT_FILES), reason="needs ../shared (reference + text)")

# any Unicode text (every code point a UTF-8 document can hold: no lone surrogates), with the operators and ASCII
# letters made frequent
TEXTS = st.text(st.one_of(st.characters(exclude_categories=("Cs",)), st.sampled_from(CASEOPS_OPERATORS + tuple("aZbYQq \n"))),
                max_size=80)


def shared_docs():
    for path in TEXT_FILES:
        with open(path, encoding="utf-8") as f:
            yield from (json.loads(line)["text"] for line in f if line.strip())


@given(TEXTS)
@settings(max_examples=400, deadline=None)
def test_decode_inverts_encode_on_any_text(text):
    encoded = encode_caseops(text)
    assert decode_caseops(encoded) == text
    assert not any("A" <= c <= "Z" for c in encoded)
    # one piece per character: the original bytes of the pieces add up to the text's UTF-8 bytes
    assert sum(piece_original_bytes(list(encoded))) == len(text.encode("utf-8"))


def test_encode_rules_and_escapes():
    t, a, c, e = CASEOPS_OPERATORS
    cases = {"The NASA iPhone": f"{t}the {a}nasa i{c}phone", "A": f"{t}a", "McDonald's": f"{t}mc{c}donald's",
             "ABc": f"{t}a{c}bc", "x" + t: "x" + e + t, e: e + e, "ÉCOLE 3D": f"É{a}cole 3{t}d"}
    for text, want in cases.items():
        assert encode_caseops(text) == want
        assert decode_caseops(want) == text


@pytest.mark.parametrize("bad", ["Abc", "\ue004x", "\ue001", "\ue001 a", "ab\ue001c", "\ue003\ue003a", "\ue002\ue001a"])
def test_decode_refuses_what_encode_never_writes(bad):
    with pytest.raises(CaseOpsError, match="position"):
        decode_caseops(bad)


def reference_caps():
    """The records' lossless_caps.py (PR #1855), imported from its folder in ../shared."""
    sys.path.insert(0, str(REFERENCE))
    try:
        import lossless_caps
    finally:
        sys.path.remove(str(REFERENCE))
    return lossless_caps


@needs_shared
def test_round_trip_and_reference_transform_on_every_shared_document():
    ref = reference_caps()
    num_docs = 0
    for doc in shared_docs():
        encoded = encode_caseops(doc)
        assert encoded == ref.encode_lossless_caps_v2(doc)
        assert decode_caseops(encoded) == doc
        num_docs += 1
    assert num_docs == 30 + 3945 + 257 + 4961


@needs_shared
def test_original_bytes_are_the_reference_counts():
    import sentencepiece as spm

    ref = reference_caps()
    sp = spm.SentencePieceProcessor(model_file=str(CASEOPS_MODEL))
    docs = [d for d, _ in zip(shared_docs(), range(300))] + ["  \ue001Lead \ue004 x\u200b😀 É  ", "NASA\ue002"]
    transformed = [encode_caseops(d) for d in docs]
    for text, (ids, counts) in zip(transformed, encode_with_original_bytes(sp, transformed)):
        assert ids == sp.encode(text)
        enc = sp.encode(text, out_type="offset_mapping")
        surfaces = [text[b:e] for b, e in enc["offsets"]]
        assert counts == ref.surface_piece_original_byte_counts(surfaces, text_transform_name=ref.LOSSLESS_CAPS_CASEOPS_V1)


# -----------------------------------------------------------------------------------------------
# tools/prepare_data.py caseops
# -----------------------------------------------------------------------------------------------


def _shard(path):
    return np.fromfile(path, "<u2", offset=SHARD_HEADER_BYTES)


@needs_shared
def test_leaking_val_split_is_refused_before_anything_is_written(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Doc {i} Text"}) + "\n" for i in range(60)), encoding="utf-8")
    out = tmp_path / "out"
    rc = prepare_main(["caseops", "--docs", str(docs), "--tokenizer", str(CASEOPS_MODEL), "--out", str(out),
                       "--val-docs", "10", "--canonical-val-docs", "50"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists() and not list(tmp_path.glob(".out*"))
    assert err.count("\n") == 1 and "would put 40 documents of the canonical val split" in err
    # the default canonical split (50,000) against a stream of 60 documents: all 50 past --val-docs leak
    rc = prepare_main(["caseops", "--docs", str(docs), "--tokenizer", str(CASEOPS_MODEL), "--out", str(out),
                       "--val-docs", "10"])
    assert rc == 2 and "would put 50 documents" in capsys.readouterr().err and not out.exists()


@needs_shared
def test_non_caseops_tokenizer_is_refused(tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "A b"}) + "\n" + json.dumps({"text": "C d"}) + "\n", encoding="utf-8")
    rc = prepare_main(["caseops", "--docs", str(docs), "--tokenizer", str(SHARED / "data/tokenizers/fineweb_8192_bpe.model"),
                       "--out", str(tmp_path / "out"), "--val-docs", "1", "--canonical-val-docs", "0"])
    assert rc == 2 and "does not reserve the CaseOps operators" in capsys.readouterr().err


@needs_shared
def test_sidecar_holds_the_original_bytes_and_the_manifest_both_splits(tmp_path):
    import sentencepiece as spm

    src = [p for p in TEXT_FILES if p.name.startswith("c4_")] + [p for p in TEXT_FILES if "textfixer" in p.name]
    out = tmp_path / "ds"
    assert prepare_main(["caseops", "--docs", *map(str, src), "--tokenizer", str(CASEOPS_MODEL), "--out", str(out),
                         "--val-docs", "120", "--canonical-val-docs", "0", "--shard-tokens", "40000"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["text_transform"] == "lossless_caps_caseops_v1"
    val, sidecar = list_shards(out, "val"), sorted(out.glob("fineweb_val_bytes_*.bin"))
    assert len(val) == len(sidecar) > 1 and [read_shard_header(p) for p in val] == [read_shard_header(p) for p in sidecar]
    tokens = np.concatenate([_shard(p) for p in val]).astype(np.int64)
    counts = np.concatenate([_shard(p) for p in sidecar]).astype(np.int64)
    docs = [d for p in src for d in (json.loads(x)["text"] for x in p.open(encoding="utf-8") if x.strip())]
    sp = spm.SentencePieceProcessor(model_file=str(CASEOPS_MODEL))
    assert (counts[tokens == 1] == 0).all() and (counts[(tokens >= 4) & (tokens <= 7)] == 0).all()  # BOS, operators
    # per document: the sidecar adds up to the original's UTF-8 bytes, less the whitespace the
    # tokenizer's normalizer drops at the ends of a text (no piece covers it, as in the records' script)
    starts = list(np.flatnonzero(tokens == 1)) + [len(tokens)]
    assert len(starts) - 1 == 120 == manifest["splits"]["val"]["num_docs"]
    for i, doc in enumerate(docs[:120]):
        enc = sp.encode(encode_caseops(doc), out_type="offset_mapping")
        lead, tail = enc["offsets"][0][0], len(encode_caseops(doc)) - enc["offsets"][-1][1]
        kept = doc[lead:len(doc) - tail] if lead or tail else doc
        assert doc.strip() == kept.strip() and counts[starts[i]:starts[i + 1]].sum() == len(kept.encode())
    assert manifest["val_bytes"]["num_bytes"] == counts.sum()
    hashes = {s: (out / f"doc_hashes_{s}.txt").read_text().split() for s in ("val", "train")}
    assert len(hashes["val"]) == 120 and len(hashes["train"]) == len(docs) - 120 and not set(hashes["val"]) & set(hashes["train"])


# The reference calls sentencepiece's encode_as_immutable_proto (0.2.0; dropped in 0.2.3). This stand-in
# supplies it from the installed version's offset mapping (the same ids and surfaces: checked against
# 0.2.0 itself on every shared document); CASEOPS_REFERENCE_PYTHON=an interpreter with sentencepiece 0.2.0
# runs the reference untouched.
STAND_IN = """
import runpy, sys, types
import sentencepiece as spm
if not hasattr(spm.SentencePieceProcessor, "encode_as_immutable_proto"):
    def encode_as_immutable_proto(self, text):
        enc = self.encode(text, out_type="offset_mapping")
        return types.SimpleNamespace(pieces=[types.SimpleNamespace(id=i, surface=text[b:e])
                                             for i, (b, e) in zip(enc["ids"], enc["offsets"])])
    spm.SentencePieceProcessor.encode_as_immutable_proto = encode_as_immutable_proto
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@needs_shared
def test_shards_and_sidecar_are_byte_identical_to_the_reference_script(tmp_path):
    docs = tmp_path / "docs_selected.jsonl"  # all four files as one stream, as the reference reads one file
    docs.write_bytes(b"".join(p.read_bytes() for p in TEXT_FILES))
    val_docs = "300"  # 11.25M tokens in all: the train split spans two 10M-token shards
    python = os.environ.get("CASEOPS_REFERENCE_PYTHON", sys.executable)
    subprocess.run([python, "-c", STAND_IN, str(REFERENCE / "prepare_caseops_data.py"), "--docs", str(docs),
                    "--out", str(tmp_path / "ref"), "--sp", str(CASEOPS_MODEL), "--val-docs", val_docs],
                   check=True, capture_output=True, timeout=900)
    ref = tmp_path / "ref/datasets/fineweb10B_sp8192_lossless_caps_caseops_v1_reserved"
    ours = tmp_path / "ours"
    assert prepare_main(["caseops", "--docs", str(docs), "--tokenizer", str(CASEOPS_MODEL), "--out", str(ours),
                         "--val-docs", val_docs, "--canonical-val-docs", "0"]) == 0
    ref_files = sorted(p.name for p in ref.glob("*.bin"))
    assert ref_files == sorted(p.name for p in ours.glob("*.bin"))
    assert {"fineweb_val_000000.bin", "fineweb_val_bytes_000000.bin", "fineweb_train_000001.bin"} <= set(ref_files)
    for name in ref_files:
        assert (ref / name).read_bytes() == (ours / name).read_bytes(), name


@needs_shared
def test_other_text_sources_gzipped_txt(tmp_path):
    import gzip

    src = tmp_path / "docs.txt.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("First Doc Here\nsecond LINE\n\nNASA doc two\n\n\nThird one\n")
    out = tmp_path / "ds"
    assert prepare_main(["caseops", "--docs", str(src), "--tokenizer", str(CASEOPS_MODEL), "--out", str(out),
                         "--val-docs", "1", "--canonical-val-docs", "0"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["val"]["num_docs"] == 1 and manifest["splits"]["train"]["num_docs"] == 2
    assert manifest["val_bytes"]["num_bytes"] == len("First Doc Here\nsecond LINE".encode())
