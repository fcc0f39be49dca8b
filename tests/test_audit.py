"""tools/audit.py: record folders that fail exactly one check each, one that passes, packed scripts
read without running them, the canonical byte table, and make_record's own audit.

The official-style folders are synthetic: written here in the line formats of the
openai/parameter-golf records (final_int8_zlib_roundtrip_exact, `Total submission size int8+zlib`,
`stopping_early: wallclock_cap`, lzma+base85 exec stubs), with the sp1024 numbers of that repo's
val split (62,021,632 val tokens, 0.4105208 tokens per byte).
"""

import base64
import json
import lzma
import math
import statistics
import zlib
from pathlib import Path

import pytest

from test_make_record import DATE, cli, fabricate_run, fake_src  # noqa: F401 (fake_src is a fixture)
from kit import bundle
from tools.auditor import audit
from tools.auditor.audit_bytes import CANONICAL_TOKENS_PER_BYTE, candidates, measure_tokens_per_byte
from tools.auditor.audit_code import imported_modules, unpack_script
from tools.auditor.audit_logs import parse_log

SP1024_TPB = 0.4105208
SCRIPT_SOURCE = ('import os\nimport numpy as np\nimport sentencepiece as spm\nimport torch\n\n'
                 'def main():\n    print("train", os.environ.get("SEED"))\n'
                 '    print(f"step:{0}/{1} val_loss:{2.0:.4f} val_bpb:{1.2:.4f}")\n'
                 '    print(f"final_int8_zlib_roundtrip_exact val_loss:{2.0:.8f} val_bpb:{1.2:.8f}")\n'
                 '    for label in ("legal_ttt_exact", "quantized_ttt_phased", "final_ttt_exact"):\n'
                 '        print(f"{label} val_loss:{2.0:.8f} val_bpb:{1.2:.8f}")\n'
                 '\nif __name__ == "__main__":\n    main()\n')  # prints the result lines the tests log (log_from_code)
SEEDS = (1337, 42, 2025)


def lzma_b85_stub(source: str) -> bytes:
    """The stub style of the 2026-04 SP8192 records: raw LZMA2 + base85, one exec line."""
    payload = lzma.compress(source.encode(), format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}])
    return (b'import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("' + base64.b85encode(payload)
            + b'"),format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]))\n')


def official_log(seed: int, *, code_bytes: int, model_bytes: int, val_loss: float, tpb: float = SP1024_TPB,
                 train_ms: int = 599_950) -> str:
    bpb = val_loss / math.log(2) * tpb
    lines = [
        "val_bpb:enabled tokenizer_kind=sentencepiece tokenizer_path=./data/tokenizers/fineweb_1024_bpe.model",
        "train_loader:dataset:fineweb10B_sp1024 train_shards:80",
        "val_loader:shards pattern=./data/datasets/fineweb10B_sp1024/fineweb_val_*.bin tokens:62021632",
        "model_params:17059912", "world_size:8 grad_accum_steps:1",
        "train_batch_tokens:524288 train_seq_len:1024 iterations:20000 warmup_steps:20 max_wallclock_seconds:600.000",
        f"seed:{seed}",
        "step:0/20000 val_loss:6.9357 val_bpb:4.1077 train_time:0ms step_avg:0.01ms",
        "step:1/20000 train_loss:6.9370 train_time:43ms step_avg:43.11ms",
        f"step:13000/20000 train_loss:2.0800 train_time:{train_ms - 34_000}ms step_avg:43.54ms",
        f"step:13780/20000 val_loss:{val_loss + 0.01:.4f} val_bpb:{bpb + 0.006:.4f} train_time:{train_ms}ms "
        f"step_avg:43.54ms",
        f"stopping_early: wallclock_cap train_time:{train_ms}ms step:13780/20000",
        "peak memory allocated: 10184 MiB reserved: 10200 MiB",
        "Serialized model: 67224983 bytes", f"Code size: {code_bytes} bytes",
        f"Total submission size: {67224983 + code_bytes} bytes",
        f"Serialized model int8+zlib: {model_bytes} bytes (payload:17178912 raw_torch:17224025 payload_ratio:3.91x)",
        f"Total submission size int8+zlib: {model_bytes + code_bytes} bytes",
        f"final_int8_zlib_roundtrip val_loss:{val_loss:.4f} val_bpb:{bpb:.4f} eval_time:1401ms",
        f"final_int8_zlib_roundtrip_exact val_loss:{val_loss:.8f} val_bpb:{bpb:.8f}",
    ]
    return "\n".join(lines) + "\n"


def make_official_folder(root: Path, *, source=SCRIPT_SOURCE, model_bytes=15_800_000, train_ms=599_950,
                         tpb_of=None, claim_shift=0.0, drop=(), script: bytes | None = None) -> Path:
    """records/track_10min_16mb/<date>_Synth with 3 seed logs; every number consistent unless changed."""
    folder = root / "records" / "track_10min_16mb" / "2026-03-30_Synth"
    folder.mkdir(parents=True)
    script = script if script is not None else lzma_b85_stub(source)
    (folder / "train_gpt.py").write_bytes(script)
    results = {}
    for i, seed in enumerate(SEEDS):
        loss = 2.0 + 0.001 * i
        tpb = (tpb_of or {}).get(seed, SP1024_TPB)
        text = official_log(seed, code_bytes=len(script), model_bytes=model_bytes + i, val_loss=loss, tpb=tpb,
                            train_ms=train_ms if i == 1 else 599_950)
        (folder / f"train_seed{seed}.log").write_text(text)
        results[str(seed)] = {"val_loss": round(loss, 8), "val_bpb": round(loss / math.log(2) * tpb, 8),
                              "artifact_bytes": model_bytes + i + len(script)}
    sub = {"author": "Synthetic", "github_id": "synth", "name": "Synth", "blurb": "A synthetic record.",
           "date": "2026-03-30T00:00:00Z", "track": "10min_16mb",
           "val_loss": round(statistics.fmean(r["val_loss"] for r in results.values()), 8),
           "val_bpb": round(statistics.fmean(r["val_bpb"] for r in results.values()) + claim_shift, 8),
           "bytes_total": max(r["artifact_bytes"] for r in results.values()), "bytes_code": len(script),
           "seeds": list(SEEDS), "seed_results": results}
    (folder / "submission.json").write_text(json.dumps(sub, indent=2))
    (folder / "README.md").write_text("# Synth\n\nA synthetic record folder.\n")
    for name in drop:
        (folder / name).unlink()
    return folder


def statuses(folder, **kwargs) -> dict:
    return {c.name: c.status for c in audit.audit_folder(folder, **kwargs).checks}


def failed(folder, **kwargs) -> list:
    return audit.audit_folder(folder, **kwargs).failed


# -----------------------------------------------------------------------------------------------
# one folder per failure, each failing exactly its check
# -----------------------------------------------------------------------------------------------


def test_a_consistent_official_style_folder_passes_every_check(tmp_path, capsys):
    folder = make_official_folder(tmp_path)
    got = statuses(folder)
    assert got == {**{n: "pass" for n in audit.AUDIT_CHECKS}, "significance": "n/a"}
    assert audit.main([str(folder), "--no-run"]) == 0
    out = capsys.readouterr().out
    assert "result: PASS" in out and "packed: base64.b85decode -> lzma.decompress(raw)" in out
    assert "train_seed42.log:12 train_time 599.950 s" in out  # evidence: file, line, value
    assert "run probe skipped (--no-run)" in out and "run_causal" not in out.split("result:")[0].split("check")[-1]


FAILURES = {
    "artifact_under_16mb": dict(model_bytes=16_000_000 - 50),  # + the code (> 50 bytes) is over
    "train_under_600s": dict(train_ms=601_000),
    "byte_accounting": dict(tpb_of={42: SP1024_TPB * 1.04}),  # one log counts 4% fewer bytes
    "code_parses": dict(source="def main(:\n    pass\n"),
    "claims_match_logs": dict(claim_shift=0.01),  # no logged line or mean gives the claim: contradicted
    # the logs' final lines name zlib and roundtrip, which this code never prints (closed PR #945's shape)
    "log_from_code": dict(source=SCRIPT_SOURCE.replace("final_int8_zlib_roundtrip_exact", "final_int8_exact")),
}
# stricter than the organizers' practice (merged folders show it): a warning, exit 0
WARNINGS = {
    "files": dict(drop=("README.md",)),
}


@pytest.mark.parametrize("check", sorted(FAILURES))
def test_each_broken_folder_fails_exactly_its_check(tmp_path, check):
    folder = make_official_folder(tmp_path, **FAILURES[check])
    assert failed(folder) == [check]
    assert audit.main([str(folder), "--no-run"]) == 1


@pytest.mark.parametrize("check", sorted(WARNINGS))
def test_a_deviation_the_organizers_merged_warns_and_exits_0(tmp_path, check):
    folder = make_official_folder(tmp_path, **WARNINGS[check])
    result = audit.audit_folder(folder)
    assert result.failed == [] and result.warned == [check]
    assert audit.main([str(folder), "--no-run"]) == 0


def test_the_failures_name_file_line_and_value(tmp_path):
    folder = make_official_folder(tmp_path / "a", train_ms=601_000)
    ev = {c.name: c.evidence for c in audit.audit_folder(folder).checks}
    assert "train_seed42.log:12 train_time 601.000 s" in ev["train_under_600s"]
    folder = make_official_folder(tmp_path / "b", tpb_of={42: SP1024_TPB * 1.04})
    ev = {c.name: c.evidence for c in audit.audit_folder(folder).checks}["byte_accounting"]
    assert "train_seed42.log:" in ev and "+4.000% from sp1024 0.4105208" in ev


def test_one_step_over_the_cap_passes_but_two_steps_do_not(tmp_path):
    """The official loop stops at the first step past the cap: 600.038 s with 43.54 ms steps passes
    (the naive baseline record), 600.2 s warns (the organizers accepted PR #1120 at 600.365 s), 600.6 s
    fails (PR #1945 had to re-run a 602.048 s seed)."""
    assert statuses(make_official_folder(tmp_path / "a", train_ms=600_038))["train_under_600s"] == "pass"
    assert statuses(make_official_folder(tmp_path / "b", train_ms=600_200))["train_under_600s"] == "warn"
    assert statuses(make_official_folder(tmp_path / "c", train_ms=600_600))["train_under_600s"] == "fail"


def test_gptq_calibration_after_the_clock_warns_as_the_merged_records_show(tmp_path):
    """2026-04-09_A2_Muon097_3Seed (588.0 + 12.7 s) and 2026-04-27_SP8192_LQER (599.6 + 4.7 s) were
    merged: calibration after the logged clock is a warning (issue #1017 reading), never a fail."""
    folder = make_official_folder(tmp_path)
    log = folder / "train_seed42.log"
    text = log.read_text().replace("peak memory", "GPTQ:collected 67 Hessians in 3.5s\npeak memory")
    log.write_text(text)
    result = audit.audit_folder(folder)
    assert result.failed == [] and result.warned == ["train_under_600s"]
    assert "GPTQ calibration on training data after the train clock 3.5 s" in next(
        c.evidence for c in result.checks if c.name == "train_under_600s")


def test_a_stub_whose_file_does_not_parse_fails_code_parses(tmp_path):
    folder = make_official_folder(tmp_path, script=b'import lzma as L\nexec(L.decompress(b"\\xfd7zXZ"\n')
    assert failed(folder) == ["code_parses"]


def test_the_non_record_track_allows_long_runs_and_one_seed(tmp_path):
    folder = make_official_folder(tmp_path, train_ms=7_200_000)
    moved = folder.parents[1] / "track_non_record_16mb" / folder.name
    moved.parent.mkdir()
    folder.rename(moved)
    got = statuses(moved)
    assert got["train_under_600s"] == "n/a" and got["three_seeds"] == "n/a" and not audit.audit_folder(moved).failed


def test_missing_submission_fields_and_too_few_seeds(tmp_path):
    folder = make_official_folder(tmp_path)
    sub = json.loads((folder / "submission.json").read_text())
    del sub["blurb"], sub["bytes_code"]
    sub["seeds"], sub["seed_results"] = [1337, 42], {k: v for k, v in sub["seed_results"].items() if k != "2025"}
    (folder / "train_seed2025.log").unlink()
    sub["val_bpb"] = round(statistics.fmean(v["val_bpb"] for v in sub["seed_results"].values()), 8)
    (folder / "submission.json").write_text(json.dumps(sub))
    result = audit.audit_folder(folder)
    assert result.failed == [] and result.warned == ["submission_fields", "three_seeds"]
    assert "missing blurb, bytes_code" in result.checks[1].evidence


def test_requirements_beyond_the_official_environment(tmp_path):
    folder = make_official_folder(tmp_path, source=SCRIPT_SOURCE + "import brotli\ntry:\n    import zstandard\n"
                                                                    "except ImportError:\n    zstandard = None\n")
    assert audit.audit_folder(folder).warned == ["requirements"]
    (folder / "requirements.txt").write_text("brotli>=1.1\n")
    assert audit.audit_folder(folder).warned == []


def test_significance_uses_tools_significance(tmp_path):
    folder = make_official_folder(tmp_path)
    mean = json.loads((folder / "submission.json").read_text())["val_bpb"]
    assert statuses(folder, baseline_bpb=mean + 0.05)["significance"] == "pass"
    assert statuses(folder, baseline_bpb=mean + 0.001)["significance"] == "fail"


def test_data_disjointness_from_log_patterns(tmp_path):
    folder = make_official_folder(tmp_path)
    log = folder / "train_seed42.log"
    log.write_text(log.read_text().replace(
        "train_loader:dataset:fineweb10B_sp1024 train_shards:80",
        "train_loader:shards pattern=./data/datasets/fineweb10B_sp1024/fineweb_val_*.bin"))
    result = audit.audit_folder(folder)
    ev = {c.name: c.evidence for c in result.checks}["data_disjoint"]
    assert result.failed == ["data_disjoint"] and "the train loader reads" in ev


def test_cli_refuses_unusable_input_with_one_line(tmp_path, capsys):
    assert audit.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not a folder" in err
    assert audit.main([str(tmp_path), "--tokenizer", "x.model"]) == 2


def test_json_output(tmp_path, capsys):
    folder = make_official_folder(tmp_path, train_ms=601_000)
    assert audit.main([str(folder), "--json", "--no-run"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out[0]["failed"] == ["train_under_600s"] and len(out[0]["checks"]) == len(audit.AUDIT_CHECKS)


# -----------------------------------------------------------------------------------------------
# packed scripts, read without running them
# -----------------------------------------------------------------------------------------------


def test_stub_styles_unpack_to_their_source(tmp_path):
    zlib_b64 = (b"import zlib,base64\nexec(zlib.decompress(base64.b64decode('"
                + base64.b64encode(zlib.compress(SCRIPT_SOURCE.encode())) + b"')).decode())\n")
    (tmp_path / "train_gpt_decode.py").write_text(SCRIPT_SOURCE)
    sibling = b'exec(open(__file__.replace("train_gpt.py","train_gpt_decode.py")).read())\n'
    for data, layers in ((lzma_b85_stub(SCRIPT_SOURCE), "base64.b85decode -> lzma.decompress(raw)"),
                         (zlib_b64, "base64.b64decode -> zlib.decompress -> decode(utf-8)"),
                         (sibling, "open(train_gpt_decode.py)")):
        script = unpack_script(data, tmp_path)
        assert (script.kind, script.source, script.layers) == ("packed", SCRIPT_SOURCE, [layers])
    assert unpack_script(sibling, tmp_path).files == ["train_gpt_decode.py"]
    assert imported_modules(SCRIPT_SOURCE) == ({"os", "numpy", "sentencepiece", "torch"}, set())


def test_nothing_in_a_stub_runs(tmp_path):
    marker = tmp_path / "ran"
    evil = f'import os\nexec(os.system("touch {marker}") or "x=1")\n'.encode()
    script = unpack_script(evil, tmp_path)
    assert script.kind == "unreadable" and script.error.startswith("unsupported stub") and not marker.exists()
    opener = b'exec(open("/etc/hostname").read())\n'
    assert "not a file of the record folder" in unpack_script(opener, tmp_path).error
    # a lambda that is not bundle.py's base93 decoder (same shape as our stub) is never evaluated
    lookalike = (f'import os\nf=lambda s:os.system("touch {marker}")\nexec(f(\nb"x").to_bytes(1,"big"))\n').encode()
    script = unpack_script(lookalike, tmp_path)
    assert script.kind == "unreadable" and script.error.startswith("unsupported stub") and not marker.exists()
    huge = f'import lzma as L\n{bundle.BUNDLE_BASE93_DECODER}\nexec(L.decompress(f(\nb"!").to_bytes(1<<40,"big")))\n'
    assert unpack_script(huge.replace("1<<40", str(1 << 40)).encode()).kind == "unreadable"  # no 1 TB allocation


def test_a_decompression_bomb_is_refused():
    bomb = zlib.compress(b"#" * (80 << 20), 9)
    stub = b"import zlib\nexec(zlib.decompress(" + repr(bomb).encode() + b"))\n"
    script = unpack_script(stub)
    assert script.kind == "unreadable" and "bomb" in script.error


@pytest.mark.parametrize("encoding", ["base93", "base85", "latin1"])
def test_our_packed_files_unpack_without_exec(fake_src, encoding):  # noqa: F811
    human = fake_src[1]
    packed = bundle.pack_code(bundle.minify_source(bundle.set_bundle_kind(human, "packed")), encoding)[0]
    script = unpack_script(packed)
    assert script.kind == "packed" and script.source == bundle.unpack_packed(packed)


# -----------------------------------------------------------------------------------------------
# the canonical tokens-per-byte table and its measurement
# -----------------------------------------------------------------------------------------------


def test_canonical_table_is_consistent_with_one_val_split():
    """val tokens / tokens-per-byte is the byte count of the val documents: the same for every
    sentencepiece tokenizer of the current export (151.07-151.09 M bytes)."""
    for c in CANONICAL_TOKENS_PER_BYTE:
        if c.val_tokens and c.key not in ("sp1024-early", "byte260"):
            assert 151.07e6 < c.val_tokens / c.tokens_per_byte < 151.09e6, c.key
        assert c.spread[0] <= c.tokens_per_byte <= c.spread[1] and c.source
    assert [c.key for c in candidates(tokenizer_name="fineweb_1024_bpe.model", val_tokens=62_021_632)] == ["sp1024"]
    assert [c.key for c in candidates(tokenizer_name="fineweb_1024_bpe.model", val_tokens=63_779_840)] == [
        "sp1024-early"]
    assert candidates(sha256="0" * 64) == []


def test_log_parser_reads_the_official_formats():
    text = official_log(7, code_bytes=47_642, model_bytes=15_815_847, val_loss=2.07269931)
    f = parse_log(text)
    assert f.counted_total[:2] == ("int8+zlib", 15_863_489) and f.counted_model[1] == 15_815_847
    assert f.train_ms == (599_950.0, 12) and f.stop[0] == "wallclock_cap" and f.seed[0] == 7
    assert f.val_tokens[0] == 62_021_632 and f.seq_len[0] == 1024
    assert [m.name for m in f.metrics] == ["final_int8_zlib_roundtrip", "final_int8_zlib_roundtrip_exact"]
    assert f.metrics[1].tokens_per_byte == pytest.approx(SP1024_TPB, rel=1e-7)


def test_measured_ratio_matches_eval_bytes_and_a_plain_reference(tiny_dataset, sp1024_model, capsys):
    import numpy as np
    import sentencepiece as spm

    from eval.__main__ import main as eval_main

    got = measure_tokens_per_byte(sp1024_model, tiny_dataset)
    assert eval_main(["bytes", "--data-path", str(tiny_dataset), "--tokenizer", str(sp1024_model)]) in (0, None)
    printed = dict(kv.split(":") for kv in capsys.readouterr().out.split())
    assert got["tokens_per_byte"] == pytest.approx(float(printed["tokens_per_byte"]), abs=1e-8)
    sp = spm.SentencePieceProcessor(model_file=str(sp1024_model))
    tokens = np.concatenate([np.fromfile(p, "<u2", offset=1024) for p in sorted(tiny_dataset.glob("fineweb_val_*.bin"))])
    boundary = [sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) for i in range(sp.vocab_size())]
    total = 0
    for prev, tok in zip(tokens[:-1].tolist(), tokens[1:].tolist()):
        if boundary[tok]:
            continue
        if sp.is_byte(tok):
            total += 1
            continue
        piece = sp.id_to_piece(tok)
        total += len(piece.lstrip("\u2581").encode()) + (piece.startswith("\u2581") and not boundary[prev])
    assert got["val_bytes"] == total and got["val_tokens"] == len(tokens)


# -----------------------------------------------------------------------------------------------
# make_record audits what it writes
# -----------------------------------------------------------------------------------------------


def test_a_make_record_folder_passes_its_own_audit(fake_src, tmp_path, capsys):  # noqa: F811
    runs = [fabricate_run(tmp_path, "a", 1337, fake_src), fabricate_run(tmp_path, "b", 42, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    comp = json.loads((folder / "submission.json").read_text())["compliance"]
    assert comp["checked_by"] == "tools/audit.py"
    assert {k: comp[k] for k in ("train_under_600s", "eval_under_600s", "artifact_under_16mb", "code_parses",
                                 "claims_match_logs")} == dict.fromkeys(
        ("train_under_600s", "eval_under_600s", "artifact_under_16mb", "code_parses", "claims_match_logs"), True)
    assert comp["three_seeds"] is None  # non-record track
    layer = {"latin1": "str.encode(iso8859-1)", "base85": "base64.b85decode", "base93": "bundle.base93"}[
        bundle.packed_encoding((folder / "train_gpt.py").read_bytes())]
    assert f"packed: {layer} -> " in comp["evidence"]["code_parses"]  # the packed file was unpacked and read
    assert audit.main([str(folder), "--no-run"]) == 0


def test_make_record_refuses_runs_whose_byte_count_is_off(fake_src, tmp_path, capsys, tiny_dataset,  # noqa: F811
                                                          sp1024_model):
    """The runs claim 0.41 tokens/byte; their own tokenizer and val split measure otherwise."""
    measured = measure_tokens_per_byte(sp1024_model, tiny_dataset)["tokens_per_byte"]
    assert abs(measured / 0.41 - 1) > 0.02
    hp = {"data_path": str(tiny_dataset), "tokenizer_path": str(sp1024_model)}
    runs = [fabricate_run(tmp_path, "a", 1, fake_src, hp=hp)]
    assert cli(fake_src, tmp_path, runs) == 2
    err = capsys.readouterr().err
    assert "fails its audit" in err and "byte_accounting" in err
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["base93", "base85", "latin1"])
def test_the_real_packed_train_gpt_unpacks_without_exec(encoding):
    packed = bundle.build_packed_bytes(encoding=encoding)
    script = unpack_script(packed)
    assert script.kind == "packed" and script.source == bundle.unpack_packed(packed)
    # the smallest stream wins: brotli since the code imports brotli (the artifact's compressor), else lzma or bz2
    assert any(f"{m}.decompress" in script.layers[0] for m in ("lzma", "bz2", "brotli")), script.layers[0]
    required, _ = imported_modules(script.source)
    assert {"torch", "numpy", "sentencepiece"} <= required


# -----------------------------------------------------------------------------------------------
# ground truth: the organizers' decisions (tests/data/audit/truth.json, extracts written by hand)
# -----------------------------------------------------------------------------------------------

TRUTH_DIR = Path(__file__).parent / "data" / "audit"
TRUTH = json.loads((TRUTH_DIR / "truth.json").read_text())


def truth_folder(tmp_path, name: str) -> Path:
    """A copy of one ground-truth extract; `pad` grows train_gpt.py with comment lines to the shipped
    size (a human-readable file of that size, which compresses well)."""
    import shutil

    case = TRUTH[name]
    folder = tmp_path / case["folder"]
    shutil.copytree(TRUTH_DIR / case["folder"], folder)
    if case.get("pad"):
        script = folder / "train_gpt.py"
        text = script.read_text()
        filler = "# readable source kept beside the packed file\n"
        text += filler * ((case["pad"] - len(text)) // len(filler))
        script.write_text(text + "#" * (case["pad"] - len(text) - 1) + "\n")
        assert script.stat().st_size == case["pad"]
    return folder


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_the_auditor_agrees_with_the_organizers(tmp_path, name):
    """Merged folders and accepted leaderboard rows: no fail (warnings where our reading is stricter);
    rejected folders: a fail of the check named for the reason they were rejected, and no other.
    Each case names its source and the organizers' words in truth.json."""
    case = TRUTH[name]
    result = audit.audit_folder(truth_folder(tmp_path, name))
    got = {c.name: c.status for c in result.checks}
    assert sorted(result.failed) == sorted(case["expect"]["fail"]), (case["source"], result.checks)
    assert case["organizers"].startswith(("merged", "accepted")) == (not result.failed)
    for status in ("warn", "pass"):
        for check in case["expect"].get(status, []):
            assert got[check] == status, (check, [c for c in result.checks if c.name == check])


# -----------------------------------------------------------------------------------------------
# issue 22's false statements, each failing on the code before the fix
# -----------------------------------------------------------------------------------------------


def test_a_newer_interpreter_parses_what_this_one_cannot(monkeypatch):
    """The --python fallback ran tools/auditor/audit_code.py, whose `from tools...` import fails under `-I`:
    scripts that parse on Python 3.12 were reported as "f-string: expecting '}'"."""
    import sys

    from tools.auditor import audit_code

    def too_old(source):
        raise SyntaxError("f-string: expecting '}'")

    monkeypatch.setattr(audit_code, "imported_modules", too_old)
    monkeypatch.setattr(audit_code, "PYTHON_CANDIDATES", ())
    monkeypatch.setattr(audit_code.Path, "home", lambda: Path("/nonexistent"))
    required, _, version = audit_code.parse_imports("import numpy\n", pythons=[sys.executable])
    assert required == {"numpy"} and version.count(".") == 2


def test_a_readme_that_links_the_val_shard_as_the_train_shard_fails_data_disjoint(tmp_path):
    """PR #44 (closed: trained only on the validation shard) did it outside the script: its README's data
    setup links fineweb_val_000000.bin to the name fineweb_train_000000.bin; a link the other way is not it."""
    folder = make_official_folder(tmp_path)
    readme = folder / "README.md"
    before = {c.name: c.status for c in audit.audit_folder(folder).checks}["data_disjoint"]
    readme.write_text(readme.read_text() + "\n```bash\nln -s /d/sp1024/fineweb_train_000000.bin /d/x/fineweb_train_000000.bin\n"
                      "cp /d/sp1024/fineweb_val_000000.bin /d/x/fineweb_val_000000.bin\n```\n")
    assert {c.name: c.status for c in audit.audit_folder(folder).checks}["data_disjoint"] == before != "fail"
    readme.write_text(readme.read_text() + "ln -s /d/sp1024/fineweb_val_000000.bin /d/valonly/fineweb_train_000000.bin\n")
    got = {c.name: c for c in audit.audit_folder(folder).checks}["data_disjoint"]
    assert got.status == "fail" and "makes a val shard a train shard" in got.evidence, got


def test_a_log_holding_the_same_run_twice_counts_its_gptq_once(tmp_path):
    folder = make_official_folder(tmp_path)
    log = folder / "train_seed42.log"
    once = log.read_text().replace("peak memory", "GPTQ:collected 67 Hessians in 3.5s\npeak memory")
    log.write_text(once + once)
    ev = {c.name: c.evidence for c in audit.audit_folder(folder).checks}["train_under_600s"]
    assert "after the train clock 3.5 s" in ev and "7.0 s" not in ev


def test_a_claim_is_compared_at_its_printed_precision(tmp_path):
    """1.08000 printed is not 1.081: float("1.08000") == 1.08 lost the digits, and the old tolerance
    was one unit of the shortened number (0.01)."""
    folder = make_official_folder(tmp_path)
    path = folder / "submission.json"
    sub = json.loads(path.read_text())
    mean = statistics.fmean(v["val_bpb"] for v in sub["seed_results"].values())
    text = path.read_text().replace(json.dumps(sub["val_bpb"]), f"{round(mean, 2) - 0.001:.5f}", 1)
    path.write_text(text.replace(f'"val_bpb": {sub["val_bpb"]}', f'"val_bpb": {round(mean, 2) - 0.001:.5f}'))
    claims = next(c for c in audit.audit_folder(folder).checks if c.name == "claims_match_logs")
    assert claims.status == "fail" and "off by" in claims.evidence and "contradict" in claims.evidence


def test_a_claim_that_is_one_logged_seed_warns(tmp_path):
    """The claim is another logged figure (one seed's line, not the mean): the organizers merged that."""
    folder = make_official_folder(tmp_path)
    path = folder / "submission.json"
    sub = json.loads(path.read_text())
    one = min(v["val_bpb"] for v in sub["seed_results"].values())
    path.write_text(path.read_text().replace(f'"val_bpb": {sub["val_bpb"]}', f'"val_bpb": {one}', 1))
    claims = next(c for c in audit.audit_folder(folder).checks if c.name == "claims_match_logs")
    assert claims.status == "warn" and "another logged figure" in claims.evidence


def test_the_mean_uses_one_precision_per_run(tmp_path):
    """Per-seed values rounded to 4 decimals drew the rounded line from each log; the claim (the mean
    of the exact lines) then looked off. The rounded line beside an exact one is dropped."""
    folder = make_official_folder(tmp_path)
    path = folder / "submission.json"
    sub = json.loads(path.read_text())
    for v in sub["seed_results"].values():
        v["val_bpb"] = round(v["val_bpb"], 4)
    path.write_text(json.dumps(sub))
    claims = next(c for c in audit.audit_folder(folder).checks if c.name == "claims_match_logs")
    assert claims.status == "pass", claims.evidence
    assert "final_int8_zlib_roundtrip_exact" in claims.evidence


def test_a_symlink_out_of_the_folder_is_named_and_never_read(tmp_path):
    folder = make_official_folder(tmp_path / "rec")
    outside = tmp_path / "elsewhere.log"
    outside.write_text((folder / "train_seed42.log").read_text())
    (folder / "train_seed42.log").unlink()
    (folder / "train_seed42.log").symlink_to(outside)
    result = audit.audit_folder(folder)
    ev = {c.name: c.evidence for c in result.checks}
    assert "file_safety" in result.failed and "train_seed42.log is a symlink to" in ev["file_safety"]
    assert "train_seed42.log" not in ev["files"]


def test_undecodable_log_bytes_get_a_line(tmp_path):
    folder = make_official_folder(tmp_path)
    log = folder / "train_seed42.log"
    log.write_bytes(log.read_bytes().replace(b"peak memory", b"peak \xff memory"))
    result = audit.audit_folder(folder)
    ev = {c.name: c.evidence for c in result.checks}["file_safety"]
    assert result.warned == ["file_safety"] and "train_seed42.log:13 has bytes that are not UTF-8" in ev


def test_ttt_score_line_of_the_kit_counts_as_a_scored_eval_pass(tmp_path):
    """`final_ttt_exact val_loss:... val_bpb:... eval_time:Nms` (the kit's TTT line) is an eval pass."""
    folder = make_official_folder(tmp_path)
    bpb = 1.99 / math.log(2) * SP1024_TPB
    for log in folder.glob("*.log"):
        log.write_text(log.read_text() + f"final_ttt_exact val_loss:1.99000000 val_bpb:{bpb:.8f} eval_time:599000ms\n")
    result = audit.audit_folder(folder)
    ev = {c.name: c.evidence for c in result.checks}
    assert result.failed == ["eval_under_600s"] and "final_ttt_exact 599.0 s" in ev["eval_under_600s"]
