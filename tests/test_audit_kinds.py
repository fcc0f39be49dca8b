"""tools/audit.py on folders built from scratch, one per kind of rejection the organizers made: each
fails for its reason and no other check fails; the accepted shape of each passes.

Kinds: training on val written inline (a loop in main, epochs rescoring, a score after TTT), a local
build of the data, seeds of different configurations, no submission.json / no train log, eval timers
nested in a pass, code only a newer Python parses, the 16,000,000-byte cap in the non-record track,
byte accounting of a tokenizer outside the table; plus make_record's --skip-smoke mark and skipped files.
"""

import json
import math
import shutil

from test_audit import SCRIPT_SOURCE, SEEDS, SP1024_TPB, make_official_folder
from tools.auditor import audit
from tools.auditor.audit_parse import neutralize_fstrings, parse_any


def metric(name, val_loss, tail=""):
    """A final line whose val_bpb is consistent with the sp1024 val split's bytes."""
    return f"{name} val_loss:{val_loss:.8f} val_bpb:{val_loss / math.log(2) * SP1024_TPB:.8f}{tail}"


def audited(folder):
    result = audit.audit_folder(folder)
    return result, {c.name: c for c in result.checks}


def edit_logs(folder, old, new, seeds=SEEDS):
    for seed in seeds:
        log = folder / f"train_seed{seed}.log"
        text = log.read_text()
        assert old in text, old
        log.write_text(text.replace(old, new))


# -----------------------------------------------------------------------------------------------
# 1. training on val tokens, not inside a function handed val data
# -----------------------------------------------------------------------------------------------

INLINE_TTT = '''import torch


def eval_val(model, val_tokens):
    with torch.no_grad():
        return float(model(val_tokens[:-1], val_tokens[1:]))


def main(model, val_tokens, opt):
    for start in range(0, val_tokens.numel() - 1, 2048):
        x = val_tokens[start:start + 2049]
        loss = model(x[:-1], x[1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(eval_val(model, val_tokens))
'''

EPOCH_RESCORE = '''import torch


def eval_val_ttt(model, val_tokens, opt, epochs):
    total = 0.0
    for epoch in range(epochs):
        for start in range(0, val_tokens.numel() - 1, 2048):
            x = val_tokens[start:start + 2049]
            with torch.no_grad():
                total += float(model(x[:-1], x[1:]))
            loss = model(x[:-1], x[1:])
            loss.backward()
            opt.step()
    return total
'''

SCORE_FIRST = EPOCH_RESCORE.replace("    for epoch in range(epochs):\n", "    if epochs:\n")

DERIVED = '''import torch


def make_chunks(tokens):
    return tokens.split(2048)


def adapt(model, val_tokens, opt):
    chunks = make_chunks(val_tokens)
    for c in chunks:
        loss = model(c[:-1], c[1:])
        loss.backward()
        opt.step()
'''


def test_an_inline_ttt_loop_in_main_fails_val_not_trained(tmp_path):
    result, checks = audited(make_official_folder(tmp_path, source=INLINE_TTT))
    assert result.failed == ["val_not_trained"]
    ev = checks["val_not_trained"].evidence
    assert "main() lines 10-15" in ev and "scores val after it (line 16)" in ev


def test_epochs_that_rescore_trained_chunks_fail_and_score_first_passes(tmp_path):
    result, checks = audited(make_official_folder(tmp_path / "a", source=EPOCH_RESCORE))
    assert result.failed == ["val_not_trained"] and "every later epoch scores" in checks["val_not_trained"].evidence
    result, checks = audited(make_official_folder(tmp_path / "b", source=SCORE_FIRST))
    assert not result.failed and checks["val_not_trained"].status == "pass"


def test_val_data_the_reading_cannot_follow_is_not_checkable_never_pass(tmp_path):
    result, checks = audited(make_official_folder(tmp_path, source=DERIVED))
    assert not result.failed
    c = checks["val_not_trained"]
    assert c.status == "n/a" and "adapt() lines 10-13" in c.evidence and "cannot be read statically" in c.evidence


def test_a_claimed_score_printed_after_ttt_is_a_rescore_and_fails(tmp_path):
    folder = make_official_folder(tmp_path)
    edit_logs(folder, "final_int8_zlib_roundtrip val_loss",
              metric("legal_ttt_exact", 2.1, " eval_time:400000ms") + "\nfinal_int8_zlib_roundtrip val_loss")
    result, checks = audited(folder)
    assert result.failed == ["val_not_trained"]
    assert "is a pass after legal_ttt_exact" in checks["val_not_trained"].evidence


# -----------------------------------------------------------------------------------------------
# 2-4. data, seeds, files
# -----------------------------------------------------------------------------------------------


def test_a_local_build_of_the_data_fails_data_disjoint(tmp_path):
    folder = make_official_folder(tmp_path / "a")
    assert audited(folder)[1]["data_disjoint"].status == "pass"  # the canonical counts, read from the logs
    edit_logs(folder, "train_shards:80", "train_shards:1499")
    result, checks = audited(folder)
    assert result.failed == ["data_disjoint"] and "1,499 train shards" in checks["data_disjoint"].evidence
    folder = make_official_folder(tmp_path / "b")
    edit_logs(folder, "tokens:62021632", "tokens:12404326")  # a 10,000-doc val split
    result, checks = audited(folder)
    assert "data_disjoint" in result.failed and "12,404,326 val tokens" in checks["data_disjoint"].evidence


def test_seeds_of_another_configuration_fail_same_config(tmp_path):
    folder = make_official_folder(tmp_path)
    edit_logs(folder, "iterations:20000", "iterations:9000", seeds=SEEDS[2:])
    result, checks = audited(folder)
    assert result.failed == ["same_config"]
    assert "iterations=9000" in checks["same_config"].evidence and "iterations=20000" in checks["same_config"].evidence


def test_a_study_in_the_non_record_track_is_not_a_mixed_config_record(tmp_path):
    folder = make_official_folder(tmp_path)
    edit_logs(folder, "iterations:20000", "iterations:9000", seeds=SEEDS[2:])
    track = folder.parents[1] / "track_non_record_16mb"
    track.mkdir()
    moved = track / folder.name
    shutil.move(str(folder), moved)
    result, checks = audited(moved)
    assert checks["same_config"].status == "pass" and "a study" in checks["same_config"].evidence


def test_the_val_split_cut_to_a_multiple_of_the_eval_length_is_canonical(tmp_path):
    folder = make_official_folder(tmp_path)
    edit_logs(folder, "tokens:62021632", f"tokens:{62021632 // 65536 * 65536}")  # 38,912 fewer: one TTT chunk
    assert audited(folder)[1]["data_disjoint"].status == "pass"
    edit_logs(folder, f"tokens:{62021632 // 65536 * 65536}", f"tokens:{62021632 // 65536 * 65536 - 65536}")
    assert audited(folder)[1]["data_disjoint"].status == "fail"  # a chunk more is another split


def test_no_submission_json_or_no_train_log_fails_files(tmp_path):
    for i, drop in enumerate((("submission.json",), tuple(f"train_seed{s}.log" for s in SEEDS))):
        folder = make_official_folder(tmp_path / str(i), drop=drop)
        result, checks = audited(folder)
        assert checks["files"].status == "warn"  # dated 2026-03-30: the merged folders of March lack some
        folder = folder.rename(folder.with_name("2026-04-30_Synth"))
        result, checks = audited(folder)
        assert "files" in result.failed and "not leaderboard-ready" in checks["files"].evidence


# -----------------------------------------------------------------------------------------------
# 5-8. nested timers, newer syntax, the cap in every track, byte accounting
# -----------------------------------------------------------------------------------------------


def _with_eval_lines(tmp_path, lines):
    folder = make_official_folder(tmp_path)
    for seed in SEEDS:
        log = folder / f"train_seed{seed}.log"
        log.write_text(log.read_text() + "\n".join(lines) + "\n")
    return folder


def test_timers_nested_in_a_pass_are_read_once(tmp_path):
    inside = ["beginning TTT eval timer", "ngram_tilt:precompute_done elapsed=196.79s",
              metric("quantized_ttt_phased", 2.4, " eval_time:567066ms")]
    result, checks = audited(_with_eval_lines(tmp_path / "a", inside))
    ev = checks["eval_under_600s"].evidence
    assert checks["eval_under_600s"].status == "pass" and "inside quantized_ttt_phased" in ev, ev
    result, checks = audited(_with_eval_lines(tmp_path / "b", inside[1:]))  # no marker: a separate operation
    assert result.failed == ["eval_under_600s"]
    phases = ["ttt_short:done elapsed=300.0s", "ttt_long:done elapsed=290.0s",
              metric("final_ttt_exact", 2.4, " eval_time:598000ms")]
    result, checks = audited(_with_eval_lines(tmp_path / "c", phases))
    assert checks["eval_under_600s"].status == "pass", checks["eval_under_600s"].evidence


NEWER_SYNTAX = '''import urllib.request


def main(cfg):
    print(f"{cfg["name"]}: {cfg["lr"]:.{cfg["digits"]}f}")
    urllib.request.urlopen("https://example.com/weights.bin")
'''


def test_code_only_a_newer_python_parses_is_read_and_checked(tmp_path):
    tree, note = parse_any(NEWER_SYNTAX)
    assert note and neutralize_fstrings(NEWER_SYNTAX).count("\n") == NEWER_SYNTAX.count("\n")
    result, checks = audited(make_official_folder(tmp_path, source=NEWER_SYNTAX))
    assert checks["code_parses"].status == "pass" and note in checks["code_parses"].evidence
    assert result.failed == ["no_network"] and "line 6: urlopen" in checks["no_network"].evidence


def test_the_byte_cap_fails_in_the_non_record_track(tmp_path):
    folder = make_official_folder(tmp_path, model_bytes=16_000_000)
    track = folder.parents[1] / "track_non_record_16mb"
    track.mkdir()
    moved = track / folder.name
    shutil.move(str(folder), moved)
    result, checks = audited(moved)
    assert result.failed == ["artifact_under_16mb"] and "DGAttention" in checks["artifact_under_16mb"].evidence


def test_bytes_of_a_tokenizer_outside_the_table_are_checked_against_the_val_split(tmp_path):
    folder = make_official_folder(tmp_path / "a", tpb_of={s: 0.3878932 for s in SEEDS})
    edit_logs(folder, "fineweb_1024_bpe.model", "candidate.model")
    edit_logs(folder, "tokens:62021632", "tokens:61020160")
    edit_logs(folder, "fineweb10B_sp1024 train_shards", "fineweb10B_tm0054 train_shards")
    result, checks = audited(folder)
    assert result.failed == ["byte_accounting"] and "151,073,604 bytes" in checks["byte_accounting"].evidence
    folder = make_official_folder(tmp_path / "b", tpb_of={s: 61020160 / 151_073_604 for s in SEEDS})
    edit_logs(folder, "fineweb_1024_bpe.model", "candidate.model")
    edit_logs(folder, "tokens:62021632", "tokens:61020160")
    edit_logs(folder, "fineweb10B_sp1024 train_shards", "fineweb10B_tm0054 train_shards")
    assert audited(folder)[1]["byte_accounting"].status == "pass"


# -----------------------------------------------------------------------------------------------
# make_record --skip-smoke and skipped files
# -----------------------------------------------------------------------------------------------


def test_a_skipped_smoke_run_warns(tmp_path):
    folder = make_official_folder(tmp_path)
    assert audited(folder)[1]["smoke_run"].status == "pass"
    sub = json.loads((folder / "submission.json").read_text())
    (folder / "submission.json").write_text(json.dumps({**sub, "smoke_run": "skipped"}))
    result, checks = audited(folder)
    assert not result.failed and checks["smoke_run"].status == "warn" and "never run" in checks["smoke_run"].evidence


def test_every_skipped_file_is_listed_with_its_reason(tmp_path, capsys):
    folder = make_official_folder(tmp_path)
    (folder / "notes.log").write_text("downloaded the data\n")
    shutil.copy(folder / "train_seed42.log", folder / "train.log")
    assert audit.main([str(folder), "--no-run"]) == 0
    out = capsys.readouterr().out
    assert "skipped notes.log: no training steps or final scores in it" in out
    assert "skipped train.log: an identical copy of train_seed42.log" in out


def test_the_official_style_script_still_passes(tmp_path):
    assert not audited(make_official_folder(tmp_path, source=SCRIPT_SOURCE))[0].failed


def test_a_shipped_byte_table_is_recomputed_from_the_shipped_tokenizer(tmp_path, real_text_docs):
    """A byte table counting byte-fallback ids as 3 bytes (the U+FFFD length) fails; the same table with
    1 byte per byte-fallback id passes."""
    import numpy as np
    import sentencepiece as spm

    from tools.auditor.audit_bytes import expected_base_bytes

    text = tmp_path / "text.txt"
    text.write_text("\n".join(real_text_docs[:200]))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "cand"), vocab_size=400,
                                   byte_fallback=True, model_type="bpe", minloglevel=2)
    want = expected_base_bytes(tmp_path / "cand.model")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "cand.model"))
    byte_ids = [i for i in range(sp.vocab_size()) if sp.is_byte(i)]
    assert len(byte_ids) == 256 and {want[i] for i in byte_ids} == {1}
    for name, fallback_bytes, status in (("good", 1, "pass"), ("bad", 3, "fail")):
        folder = make_official_folder(tmp_path / name)
        shutil.copy(tmp_path / "cand.model", folder / "cand.model")
        table = np.array([fallback_bytes if i in byte_ids else w for i, w in enumerate(want)], dtype=np.int16)
        np.savez(folder / "cand.meta.npz", base_bytes=table)
        result, checks = audited(folder)
        assert checks["byte_accounting"].status == status, checks["byte_accounting"].evidence
        if status == "fail":
            assert result.failed == ["byte_accounting"] and "256 of 400 ids" in checks["byte_accounting"].evidence


def test_logs_are_streamed_with_the_same_reading_and_an_oversized_one_is_listed(tmp_path, monkeypatch, capsys):
    from tools.auditor.audit_logs import read_log_bytes, read_log_file

    folder = make_official_folder(tmp_path)
    log = folder / "train_seed42.log"
    data = log.read_bytes().replace(b"peak memory", b"progress 10%\rprogress 90%\r\npeak \xff memory")
    log.write_bytes(data)
    whole, streamed = read_log_bytes(data), read_log_file(log)
    assert streamed.metrics and streamed.bad_bytes[0] == whole.bad_bytes[0]  # same byte offset
    assert streamed.bad_bytes[1] == 15  # numbered as the metric lines are (the \r splits a line)
    streamed.bad_bytes = whole.bad_bytes
    assert streamed == whole
    monkeypatch.setattr(audit, "LOG_MAX_BYTES", len(data) - 1)
    assert audit.main([str(folder), "--no-run"]) == 0
    assert f"skipped train_seed42.log: {len(data):,} bytes, over the {len(data) - 1:,}-byte reading limit" in \
        capsys.readouterr().out
