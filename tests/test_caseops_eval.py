"""Scoring CaseOps data on its val byte sidecar (shards/sidecar.py, eval/bpb.py count_scored_bytes): the
refusals, the trainer and `python -m eval` on CaseOps shards made from ../shared's text, and the auditor's
byte-accounting check on a record folder made from that run."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from shards.caseops import encode_caseops
from shards.format import load_validation_tokens, write_data_shard
from shards.sidecar import check_val_bytes, load_val_bytes
from tools.data.prepare_data import main as prepare_main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_caseops_data import CASEOPS_MODEL, SHARED, TEXT_FILES, needs_shared  # noqa: E402

pytestmark = needs_shared
NUM_VAL_DOCS = 20
SP8192 = SHARED / "data/tokenizers/fineweb_8192_bpe.model"


@pytest.fixture(scope="module")
def caseops_docs():
    """Documents of the shared C4 and FineWeb files without whitespace at their ends (the tokenizer's
    normalizer drops that, so the sidecar holds every other byte of these documents)."""
    docs = []
    for path in [p for p in TEXT_FILES if p.name.startswith(("c4_", "fineweb_textfixer"))]:
        docs += [d for d in (json.loads(x)["text"] for x in path.open(encoding="utf-8") if x.strip()) if d == d.strip()]
    return docs[:90]


@pytest.fixture(scope="module")
def caseops_data(caseops_docs, tmp_path_factory):
    root = tmp_path_factory.mktemp("caseops")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in caseops_docs), encoding="utf-8")
    assert prepare_main(["caseops", "--docs", str(root / "docs.jsonl"), "--tokenizer", str(CASEOPS_MODEL),
                         "--out", str(root / "ds"), "--val-docs", str(NUM_VAL_DOCS), "--canonical-val-docs", "0"]) == 0
    return root / "ds"


def sp_of(path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path))


def copy_without_sidecar(data, tmp_path, keep_manifest=True):
    out = tmp_path / "nosidecar"
    shutil.copytree(data, out)
    for p in out.glob("fineweb_val_bytes_*.bin"):
        p.unlink()
    if not keep_manifest:
        (out / "manifest.json").unlink()
    return out


def test_sidecar_is_found_and_matches_the_val_shards(caseops_data):
    info = check_val_bytes(caseops_data, sp_of(CASEOPS_MODEL), CASEOPS_MODEL)
    tokens = load_validation_tokens(caseops_data)
    assert info["val_byte_count"] == "sidecar" and info["val_bytes_tokens"] == tokens.numel()
    assert load_val_bytes(caseops_data).shape == tokens.shape  # the sidecar is not read as a val shard


@pytest.mark.parametrize("keep_manifest", [True, False])
def test_a_caseops_split_without_its_sidecar_is_refused(caseops_data, tmp_path, keep_manifest):
    data = copy_without_sidecar(caseops_data, tmp_path, keep_manifest)
    why = "its manifest says text_transform lossless_caps_caseops_v1" if keep_manifest else "TOKENIZER_PATH=.* reserves the"
    with pytest.raises(ValueError, match=f"a CaseOps val split \\({why}.*without its byte sidecar"):
        check_val_bytes(data, sp_of(CASEOPS_MODEL), CASEOPS_MODEL)


def test_a_sidecar_whose_count_differs_from_its_shard_is_refused(caseops_data, tmp_path):
    data = tmp_path / "short"
    shutil.copytree(caseops_data, data)
    side = sorted(data.glob("fineweb_val_bytes_*.bin"))[-1]
    write_data_shard(side, load_val_bytes(data).numpy()[:-1].astype(np.uint16))
    with pytest.raises(ValueError, match=r"the byte sidecar holds [\d,]+ counts in 1 shard\(s\), the val split [\d,]+ tokens"):
        check_val_bytes(data, sp_of(CASEOPS_MODEL), CASEOPS_MODEL)


def test_a_tokenizer_that_is_not_the_datas_is_refused(caseops_data, tmp_path):
    with pytest.raises(ValueError, match="TOKENIZER_PATH=.*does not reserve the CaseOps operators"):
        check_val_bytes(caseops_data, sp_of(SP8192), SP8192)
    with pytest.raises(ValueError, match="not the manifest's"):  # a CaseOps model, but another file
        check_val_bytes(caseops_data, sp_of(CASEOPS_MODEL), CASEOPS_MODEL, "0" * 64)


def test_the_trainer_and_eval_cli_refuse_in_one_line(caseops_data, tmp_path, capsys):
    from eval.__main__ import main as eval_main
    from test_inputs import ctx, hp_for
    from trainer.checks import check_inputs

    data = copy_without_sidecar(caseops_data, tmp_path)
    with pytest.raises(ValueError, match="without its byte sidecar"):
        check_inputs(hp_for(data, CASEOPS_MODEL, VOCAB_SIZE=8192, CASEOPS_ENABLED=1), ctx(tmp_path))
    assert eval_main(["bytes", "--data-path", str(data), "--tokenizer", str(CASEOPS_MODEL)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without its byte sidecar" in err
    assert eval_main(["bytes", "--data-path", str(caseops_data), "--tokenizer", str(CASEOPS_MODEL)]) == 0
    out = capsys.readouterr().out
    assert f"val_bytes:{int(load_val_bytes(caseops_data)[1:].sum())} " in out


def test_the_run_says_caseops_and_the_data_must_agree(caseops_data, tiny_dataset, sp1024_model, tmp_path):
    """CASEOPS_ENABLED decides the byte count (and whether a record's file holds shards/sidecar.py): CaseOps data in a
    run without it is refused (the tokenizer's bytes would count the operators), so is plain data in a run with it."""
    from test_inputs import ctx, hp_for
    from trainer.checks import check_inputs

    for data, why in ((caseops_data, "a byte sidecar"), (copy_without_sidecar(caseops_data, tmp_path), "its manifest says")):
        with pytest.raises(ValueError, match=rf"^DATA_PATH='\S+': CaseOps data \({why}.*\); expected CASEOPS_ENABLED=1$"):
            check_inputs(hp_for(data, CASEOPS_MODEL, VOCAB_SIZE=8192), ctx(tmp_path))
    with pytest.raises(ValueError, match=r"^CASEOPS_ENABLED=True: DATA_PATH=\S+ has no byte sidecar fineweb_val_bytes_"):
        check_inputs(hp_for(tiny_dataset, sp1024_model, CASEOPS_ENABLED=1), ctx(tmp_path))
    assert check_inputs(hp_for(caseops_data, CASEOPS_MODEL, VOCAB_SIZE=8192, CASEOPS_ENABLED=1),
                        ctx(tmp_path))[3]["val_byte_count"] == "sidecar"


# -----------------------------------------------------------------------------------------------
# end to end: PRESET=smoke on CaseOps shards, python -m eval score, a record folder and its audit
# -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def caseops_run(caseops_data, tmp_path_factory):
    from test_train import run_to_done

    out = tmp_path_factory.mktemp("runs")
    env, proc, result = run_to_done(caseops_data, CASEOPS_MODEL, out, "caseops", VOCAB_SIZE=8192, ITERATIONS=6,
                                    VAL_MAX_TOKENS=0, CASEOPS_ENABLED=1)
    return out / "caseops", result, proc


@pytest.mark.slow
def test_smoke_run_scores_on_the_sidecar_and_says_so(caseops_run):
    from quant.artifact import load_artifact

    run_dir, result, proc = caseops_run
    assert result["val_byte_count"] == "sidecar" and result["inputs"]["val_byte_count"] == "sidecar"
    assert "val_byte_count:sidecar" in (run_dir / "train.log").read_text()
    assert load_artifact(run_dir / "final_model.ptz")[2]["run"]["val_byte_count"] == "sidecar"
    assert result["compliance"]["val_not_seen_in_training"] is True and result["compliance"]["splits_disjoint"] is True


@pytest.mark.slow
def test_sidecar_val_bpb_is_val_bpb_on_the_original_texts_bytes(caseops_run, caseops_data, caseops_docs):
    from eval.sliding import eval_sliding
    from model.gpt import GPT
    from quant.artifact import load_artifact

    run_dir, result, _ = caseops_run
    state, config, _ = load_artifact(run_dir / "final_model.ptz")
    model = GPT(**config)
    model.load_state_dict(state)
    model.eval()
    tokens = load_validation_tokens(caseops_data)
    out = eval_sliding(model, tokens, (load_val_bytes(caseops_data),), seq_len=64, stride=32, batch_seqs=16,
                       device="cpu")
    original_bytes = sum(len(d.encode("utf-8")) for d in caseops_docs[:NUM_VAL_DOCS])
    transformed_bytes = sum(len(encode_caseops(d).encode("utf-8")) for d in caseops_docs[:NUM_VAL_DOCS])
    assert out["num_bytes"] == original_bytes < transformed_bytes  # BOS and the operators: 0 bytes
    nll_bits = out["val_loss"] * out["num_scored_tokens"] / math.log(2)
    assert out["val_bpb"] == pytest.approx(nll_bits / original_bytes, rel=1e-12)
    # the run's own roundtrip score used the same bytes
    assert result["tokens_per_byte"] == pytest.approx((tokens.numel() - 1) / original_bytes, rel=1e-12)


@pytest.mark.slow
def test_eval_score_finds_the_sidecar(caseops_run, caseops_data, tmp_path, capsys):
    from eval.__main__ import main as eval_main

    run_dir, result, _ = caseops_run
    args = ["score", "--artifact", str(run_dir / "final_model.ptz"), "--data-path", str(caseops_data),
            "--tokenizer", str(CASEOPS_MODEL), "--batch-seqs", "16"]
    assert eval_main(args) == 0
    out = capsys.readouterr().out
    assert "val_byte_count:sidecar" in out
    assert f"val_bpb:{result['val_bpb_sliding']:.8f}" in out
    nosidecar = copy_without_sidecar(caseops_data, tmp_path, keep_manifest=False)
    args[args.index("--data-path") + 1] = str(nosidecar)
    assert eval_main(args) == 2 and "without its byte sidecar" in capsys.readouterr().err


@pytest.mark.slow
def test_record_from_the_run_passes_the_audit_and_transformed_bytes_fail(caseops_run, caseops_data, tmp_path, capsys,
                                                                         monkeypatch):
    from eval.offline import count_stream_bytes, load_sentencepiece_luts
    from tools.auditor.audit import main as audit_main
    from tools.record import make_record

    run_dir, result, _ = caseops_run
    # the byte accounting is under test here, not make_record's check that the tree still packs to the run's
    # bytes_code (tests/test_make_record.py), which any edit of the tree since the run module fixture trips
    monkeypatch.setattr(make_record, "check_code_is_current", lambda *args, **kwargs: None)
    assert make_record.main(["--runs", str(run_dir), "--name", "CaseOpsSmoke", "--author", "A", "--github-id", "a",
                             "--skip-smoke", "--min-steps", "0", "--records-dir", str(tmp_path / "records"), "--approach",
                             "PRESET=smoke on CaseOps shards of the shared text, scored on the val byte sidecar."]) == 0, \
        capsys.readouterr()
    folder = next((tmp_path / "records").glob("*/*_CaseOpsSmoke"))
    measure = ["--tokenizer", str(CASEOPS_MODEL), "--data-path", str(caseops_data)]
    capsys.readouterr()
    assert audit_main([str(folder), *measure]) == 0
    assert re.search(r"byte_accounting\s+pass", capsys.readouterr().out)
    # the same run scored on the transformed text's bytes (the byte LUT of the CaseOps pieces, operators 3 bytes)
    tokens = load_validation_tokens(caseops_data)
    sidecar_bytes = count_stream_bytes(tokens, (load_val_bytes(caseops_data),))
    lut_bytes = count_stream_bytes(tokens, load_sentencepiece_luts(CASEOPS_MODEL, 8192))
    assert lut_bytes > 1.05 * sidecar_bytes
    # both audited in the record track, where a byte miscount is a failure (the non-record track only warns)
    good, bad = (tmp_path / kind / "track_10min_16mb" / folder.name for kind in ("sidecar", "transformed"))
    shutil.copytree(folder, good)
    shutil.copytree(folder, bad)
    for log in bad.glob("train_seed*.log"):
        text = log.read_text(encoding="utf-8")
        text = re.sub(r"(final_\w+ val_loss:\S+ val_bpb:)(\d+\.\d+)",
                      lambda m: f"{m.group(1)}{float(m.group(2)) * sidecar_bytes / lut_bytes:.8f}", text)
        log.write_text(text, encoding="utf-8")
    rows = {}
    for copy in (good, bad):
        audit_main([str(copy), *measure, "--json"])
        rows[copy] = {c["name"]: c for c in json.loads(capsys.readouterr().out)[0]["checks"]}["byte_accounting"]
    assert rows[good]["status"] == "pass"
    assert rows[bad]["status"] == "fail" and re.search(r"train_seed\d+\.log:\d+ final_\w+ implies", rows[bad]["evidence"])
