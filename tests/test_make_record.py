"""tools/make_record.py: run folders -> records/<track>/<date>_<name>/.

Fast tests fabricate run folders (result.json + train.log) whose code is a small fake package
(tests/test_bundle.py's tree); the slow test makes two real CPU runs and a record from them,
including the smoke run of the packed train_gpt.py from inside the new folder.
"""

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from test_bundle import FAKE_TREE, TINY_ENV, clean_env, write_tree
from kit import bundle
from tools.record import make_record, record_smoke
from tools.record.make_record import check_record
from tools.record.record_checks import RECORD_TRACKS
from tools.record.runs import RecordError, load_run, parse_train_log

REPO = Path(__file__).resolve().parents[1]
DATE = "2026-01-02"
APPROACH = "Two tiny fabricated seeds of the smoke preset: the approach section's test text."


@pytest.fixture(scope="module")
def fake_src(tmp_path_factory):
    root = write_tree(tmp_path_factory.mktemp("src"))
    return root, bundle.build_human_source(root), bundle.build_packed_bytes(root, "ascii")  # the default


@pytest.fixture(scope="module")
def fake_src_latin1(fake_src):
    return fake_src[0], fake_src[1], bundle.build_packed_bytes(fake_src[0], "latin1")  # the opt-in


def own_flags(res: dict, hyper: dict) -> dict:
    """The run's own compliance flags, computed from its fabricated evidence (never hard-coded True)."""
    def num(key):
        value = res.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else float("inf")

    shards = res.get("train_shards") or []
    seen = any("val" in Path(str(s)).name for s in shards)
    return {"train_time_ok": num("train_seconds") <= 600, "eval_time_ok": num("eval_seconds") <= 600,
            "bytes_ok": num("bytes_total") <= 16_000_000,
            "full_val_split": not hyper.get("val_max_tokens") and num("val_tokens") >= 62_021_632,
            "val_not_seen_in_training": not seen, "splits_disjoint": False if seen else None}


def fabricate_run(base: Path, run_id: str, seed: int, src, *, result=None, hp=None, log_edit=None,
                  code=None, world_size=1, device="cpu (x86_64, 2 cores)") -> Path:
    root, human, packed = src
    code_bytes = len(packed)
    hyper = {"preset": "smoke", "data_path": "data/tiny", "tokenizer_path": "data/tok.model", "vocab_size": 1024,
             "run_id": run_id, "out_dir": "runs", "seed": seed, "iterations": 50, "num_layers": 2, "model_dim": 64,
             "num_heads": 2, "num_kv_heads": 1, "mlp_mult": 3.0, "train_batch_tokens": 1024, "train_seq_len": 64,
             "max_wallclock_seconds": 0.0, "matrix_lr": 0.032, "val_max_tokens": 0, "tie_embeddings": True}
    hyper.update(hp or {})
    bpb = {"prequant": 1.3 + seed * 1e-3, "roundtrip": 1.31 + seed * 1e-3, "sliding": 1.29 + seed * 1e-3}
    tpb = 0.41
    loss = {k: v * 0.6931471805599453 / tpb for k, v in bpb.items()}
    res = {"run_id": run_id, "preset": "smoke", "seed": seed, "world_size": world_size, "device": device,
           "status": "ok", "hyperparameters": hyper, "max_wallclock_seconds": 0.0, "bytes_code": code_bytes,
           "byte_budget": 16_000_000, "torch_version": "2.13.0+cpu", "python_version": "3.11.7",
           "model_params": 139_844, "steps": 50, "train_seconds": 10.0 + seed % 7, "ms_per_step": 200.0 + seed % 7,
           "eval_seconds": 20.0, "bytes_model": 120_000 + seed, "bytes_total": 120_000 + seed + code_bytes,
           "eval_stride": 32, "tokens_per_byte": tpb,
           "val_tokens": 62_021_846, "train_shards": ["fineweb_train_000000.bin"]}
    for k in ("prequant", "roundtrip", "sliding"):
        res[f"val_bpb_{k}"], res[f"val_loss_{k}"] = bpb[k], loss[k]
    for key, value in (result or {}).items():  # plain keys first: the flags below follow from them
        if not key.startswith("compliance") and value is None:
            res.pop(key, None)
        elif not key.startswith("compliance"):
            res[key] = value
    res["compliance"] = own_flags(res, hyper)  # what the trainer would compute; make_record must not trust it
    for key, value in (result or {}).items():  # "compliance.FLAG" keys edit one flag; None deletes
        if key.startswith("compliance.") and value is None:
            del res["compliance"][key.split(".", 1)[1]]
        elif key.startswith("compliance."):
            res["compliance"][key.split(".", 1)[1]] = value
        elif key == "compliance":
            res["compliance"] = value
    lines = [code if code is not None else human.rstrip("\n"), "=" * 100,
             "python:3.11.7 torch:2.13.0+cpu numpy:2.4.6 sentencepiece:0.2.3",
             f"device:{device} world_size:{world_size}"]
    lines += [f"{k.upper()}:{v}" for k, v in hyper.items()]
    lines.append(f"model_params:139844 attention:sdpa train_flops_per_token:9.3e+05 code_bytes:{res['bytes_code']}")
    for step in (1, 10, 20, 30, 40, 50):
        lines.append(f"step:{step}/50 train_loss:{7.0 - step * 0.02 - seed * 0.01:.4f} train_time:{step * 200}ms "
                     f"step_avg:200.00ms tok_s:5000")
    lines.append(f"step:50/50 val_loss:{loss['prequant']:.4f} val_bpb:{bpb['prequant']:.4f} train_time:10000ms "
                 f"step_avg:200.00ms")
    lines.append(f"final_prequant_exact val_loss:{loss['prequant']:.8f} val_bpb:{bpb['prequant']:.8f}")
    lines.append(f"final_roundtrip_exact val_loss:{loss['roundtrip']:.8f} val_bpb:{bpb['roundtrip']:.8f}")
    lines.append(f"final_sliding_window_exact val_loss:{loss['sliding']:.8f} val_bpb:{bpb['sliding']:.8f} "
                 f"stride:32 eval_time:15000ms")
    lines.append(f"Total submission size: {res['bytes_total']} bytes")
    text = "\n".join(lines) + "\n"
    if log_edit:
        text = log_edit(text)
    run_dir = base / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps(res, indent=2))
    (run_dir / "train.log").write_text(text)
    return run_dir


def fabricate_ttt_run(base: Path, run_id: str, seed: int, src, *, result=None, hp=None, log_edit=None, **kw) -> Path:
    """A run whose plan kept TTT (trainer/finish.py): val_*_ttt and `final_ttt_exact` in place of the
    sliding pass, whose keys and line it lacks; its TTT score is below fabricate_run's sliding one."""
    bpb = 1.27 + seed * 1e-3
    loss = bpb * math.log(2) / 0.41
    line = f"final_ttt_exact val_loss:{loss:.8f} val_bpb:{bpb:.8f} eval_time:15000ms stride:32 chunks:4 updates:9"

    def edit(text):
        text = re.sub(r"^final_sliding_window_exact .*$", line, text, flags=re.M)
        return log_edit(text) if log_edit else text

    result = {"val_bpb_sliding": None, "val_loss_sliding": None, "val_bpb_ttt": bpb, "val_loss_ttt": loss,
              "ttt_epochs": 3, "ttt_updates": 9, "ttt_updates_stopped_at_chunk": None, **(result or {})}
    return fabricate_run(base, run_id, seed, src, result=result, hp={"ttt_enabled": True, "ttt_epochs": 3, **(hp or {})},
                         log_edit=edit, **kw)


def cli(src, tmp_path, runs, *extra):
    return make_record.main(["--runs", *map(str, runs), "--name", "Tiny", "--author", "A. Person", "--github-id",
                             "aperson", "--records-dir", str(tmp_path / "records"), "--root", str(src[0]),
                             "--date", DATE, "--skip-smoke", "--approach", APPROACH, *extra])


def test_parse_train_log_ignores_the_format_strings_in_the_logged_code():
    code = 'ctx.log(f"final_sliding_window_exact val_loss:{a:.8f} val_bpb:{b:.8f} stride:{s}")\nstep:{x}'
    text = (code + "\n" + "=" * 100 + "\nSEED:7\npython:3.11.7 torch:2.13.0 numpy:2.4.6\n"
            "step:1/2 train_loss:6.5000 train_time:10ms step_avg:10.00ms tok_s:100\n"
            "final_sliding_window_exact val_loss:2.00000000 val_bpb:1.10000000 stride:64 eval_time:5ms\n"
            "Total submission size: 123 bytes\n")
    log = parse_train_log(text)
    assert log["code"] == code and log["seed"] == 7 and log["train"] == [(1, 6.5)]
    assert log["final"] == {"sliding": {"val_loss": 2.0, "val_bpb": 1.1, "stride": 64, "eval_ms": 5}}
    assert log["total_bytes"] == 123 and log["versions"]["numpy"] == "2.4.6"


def test_two_runs_make_a_complete_folder_that_passes_its_checks(fake_src, tmp_path, capsys):
    runs = [fabricate_run(tmp_path, "a", 1337, fake_src), fabricate_run(tmp_path, "b", 42, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["README.md", "submission.json", "train_gpt.py", "train_gpt_human.py", "requirements.txt", "loss_curve.png",
         "train_seed1337.log", "train_seed42.log"])
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp dirs left
    sub = json.loads((folder / "submission.json").read_text())
    results = [json.loads((r / "result.json").read_text()) for r in runs]
    assert sub["seeds"] == [1337, 42] and sub["track"] == "track_non_record_16mb"
    assert sub["val_bpb"] == pytest.approx(statistics.fmean(r["val_bpb_sliding"] for r in results), abs=1e-8)
    assert sub["val_loss"] == pytest.approx(statistics.fmean(r["val_loss_sliding"] for r in results), abs=1e-8)
    assert sub["val_bpb_std"] == pytest.approx(statistics.stdev(r["val_bpb_sliding"] for r in results), abs=1e-8)
    assert sub["bytes_total"] == max(r["bytes_total"] for r in results)
    assert sub["bytes_code"] == (folder / "train_gpt.py").stat().st_size == len(fake_src[2])
    assert (sub["author"], sub["github_id"], sub["name"], sub["date"]) == ("A. Person", "aperson", "Tiny",
                                                                            f"{DATE}T00:00:00Z")
    assert sub["hardware"] == "1x cpu (x86_64, 2 cores)" and sub["pytorch_version"] == "2.13.0+cpu"
    assert [s["val_bpb_roundtrip"] for s in sub["seed_results"]] == [r["val_bpb_roundtrip"] for r in results]
    assert (folder / "train_gpt.py").read_bytes() == fake_src[2]
    assert (folder / "train_gpt_human.py").read_bytes() == fake_src[1].encode()
    assert (folder / "train_seed42.log").read_bytes() == (runs[1] / "train.log").read_bytes()
    assert (folder / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    req = (folder / "requirements.txt").read_text()
    assert "torch==2.13.0" in req and "numpy==2.4.6" in req and "sentencepiece==0.2.3" in req
    assert "zstandard==" in req and "brotli==" in req and "safetensors==" in req
    assert "# optional, CUDA only: liger-kernel" in req  # the packed file imports it: the audit warned it was not named
    assert sub["metric"] == "final_sliding_window_exact (mean over seeds)" and "val_bpb_ttt" not in sub["seed_results"][0]
    readme = (folder / "README.md").read_text()
    assert "| roundtrip val_bpb | sliding val_bpb |" in readme and "sliding window, stride 32" in readme
    for needle in ("| 1337 | 50 |", "| 42 | 50 |", "**mean**", "| std |", "loss_curve.png",
                   f"cd {folder}", "SEED=1337", "python train_gpt.py", "600 s", "margin",
                   "track_non_record_16mb", "not 8xH100"):
        assert needle in readme, needle
    assert check_record(folder)["val_bpb"] == sub["val_bpb"]
    assert make_record.main(["--check", str(folder)]) == 0


def test_an_8xh100_run_goes_to_the_record_track_with_torchrun(fake_src, tmp_path):
    dev = "NVIDIA H100 80GB HBM3 (79 GiB)"
    runs = [fabricate_run(tmp_path, f"r{s}", s, fake_src, world_size=8, device=dev) for s in (1, 2, 3)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_10min_16mb" / f"{DATE}_Tiny"
    assert json.loads((folder / "submission.json").read_text())["hardware"] == f"8x {dev}"
    assert "torchrun --standalone --nproc_per_node=8 train_gpt.py" in (folder / "README.md").read_text()


def _drop_sliding(text):
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith("final_sliding")) + "\n"


REFUSALS = {
    "over the byte budget": (dict(result={"bytes_model": 16_000_000, "bytes_total": 16_000_000 + 2000}), "bytes_total"),
    "val shard read by training": (dict(result={"train_shards": ["fineweb_train_000000.bin", "fineweb_val_000000.bin"]}),
                                   "val_not_seen_in_training not met"),
    "100 val tokens": (dict(result={"val_tokens": 100}), "full_val_split not met (scored on the full val split: "
                                                         "val_tokens=100, the official sp1024 val split has 62,021,632)"),
    "flags that contradict the evidence": (
        dict(result={"train_shards": ["fineweb_val_000000.bin"], "val_tokens": 100, "compliance.full_val_split": True,
                     "compliance.val_not_seen_in_training": True, "compliance.splits_disjoint": True}),
        "val_not_seen_in_training not met"),
    "train_seconds not a number": (dict(result={"train_seconds": "abc"}),
                                   "result.json train_seconds='abc': expected a finite number"),
    "bytes_total not an integer": (dict(result={"bytes_total": "12"}), "result.json bytes_total='12': expected an integer"),
    "log without final lines": (dict(log_edit=_drop_sliding), "final_sliding_window_exact"),
    "log disagrees with result": (dict(result={"val_bpb_sliding": 1.0}), "disagrees with result.json"),
    "configuration differs": (dict(hp={"matrix_lr": 0.05}), "MATRIX_LR=0.05"),
    "different code bytes": (dict(result={"bytes_code": 999}), "bytes_code"),
    "same seed twice": (dict(seed=1), "seed=1"),
    "did not finish": (dict(result={"status": "nonfinite_loss"}), "status='nonfinite_loss'"),
    "partial val split": (dict(hp={"val_max_tokens": 4096}), "VAL_MAX_TOKENS=4096"),
    "code changed since the run": (dict(code='"""train_gpt_human.py: an older version"""'), "logged at the top"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refuses_with_the_run_and_the_field(fake_src, tmp_path, capsys, case):
    spec, message = REFUSALS[case]
    spec = dict(spec)
    seed = spec.pop("seed", 2)
    if case == "different code bytes":  # the first run is consistent, the second used other code
        spec["result"] = {"bytes_code": 999, "bytes_total": 120_000 + seed + 999}
        spec["log_edit"] = lambda t: t.replace(f"Total submission size: {120_000 + seed + len(fake_src[2])}",
                                               f"Total submission size: {120_000 + seed + 999}")
    runs = [fabricate_run(tmp_path, "good", 1, fake_src), fabricate_run(tmp_path, "bad", seed, fake_src, **spec)]
    assert cli(fake_src, tmp_path, runs) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert str(runs[1]) in err, err
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


H100 = dict(world_size=8, device="NVIDIA H100 80GB HBM3 (79 GiB)")
FLAG_EVIDENCE = {  # flag: (the evidence that breaks it, what the refusal quotes)
    "train_time_ok": ({"train_seconds": 600.5}, "training <= 600 s: train_seconds=600.5"),
    "eval_time_ok": ({"eval_seconds": 700.0}, "evaluation <= 600 s: eval_seconds=700.0"),
    "full_val_split": ({"val_tokens": 61_000_000}, "val_tokens=61000000"),
    "val_not_seen_in_training": ({"train_shards": ["fineweb_val_000000.bin"]}, "train_shards=['fineweb_val_000000.bin']"),
}


@pytest.mark.parametrize("flag", sorted(FLAG_EVIDENCE))
def test_a_10min_record_with_any_rule_unmet_is_refused_naming_rule_and_run(fake_src, tmp_path, capsys, flag):
    """The rule is decided from the evidence; the run's own flag is left true and is not read."""
    runs = [fabricate_run(tmp_path, f"r{s}", s, fake_src, **H100) for s in (1, 2)]
    evidence, quoted = FLAG_EVIDENCE[flag]
    runs.append(fabricate_run(tmp_path, "r3", 3, fake_src, result={**evidence, f"compliance.{flag}": True}, **H100))
    assert cli(fake_src, tmp_path, runs) == 2
    err = capsys.readouterr().err
    assert f"run {runs[2]}: {flag} not met (" in err and quoted in err, err
    assert "track_10min_16mb needs every rule met" in err and str(runs[0]) not in err
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


@pytest.mark.parametrize("field, value", [("train_seconds", 600.5), ("eval_seconds", 700.0)])
def test_a_10min_record_over_a_time_limit_is_refused_whatever_its_flag_says(fake_src, tmp_path, capsys, field, value):
    runs = [fabricate_run(tmp_path, "r1", 1, fake_src, result={field: value}, **H100)]
    assert cli(fake_src, tmp_path, runs) == 2
    assert f"{field}={value}" in capsys.readouterr().err


def test_a_record_whose_data_is_elsewhere_is_accepted_with_the_split_flags_unverified(fake_src, tmp_path):
    runs = [fabricate_run(tmp_path, f"r{s}", s, fake_src, **H100) for s in (1, 2, 3)]  # data/tiny: not here
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_10min_16mb" / f"{DATE}_Tiny"
    readme = (folder / "README.md").read_text()
    why = "unverified: the run's data was not on the machine that built the record"
    assert f"| train/val documents disjoint (manifest doc hashes) | not checked | disjoint | {why} |" in readme
    assert f"| none (it opened train shards only) | none | {why} |" in readme
    sub = json.loads((folder / "submission.json").read_text())
    assert sub["rules_not_met"] == {}
    flags = sub["seed_results"][0]["compliance"]
    assert flags["val_not_seen_in_training"] is None and flags["splits_disjoint"] is None
    assert set(flags["unverified"]) == {"val_not_seen_in_training", "splits_disjoint"}


def data_run(tmp_path, src, data, seed, **kw):
    """A fabricated run whose DATA_PATH is `data` (on this machine) and whose val_tokens are its val split's."""
    from shards.format import list_shards, read_shard_header

    val_tokens = sum(read_shard_header(p) for p in list_shards(data, "val"))
    return fabricate_run(tmp_path, f"r{seed}", seed, src, hp={"data_path": str(data)},
                         result={"val_tokens": val_tokens, **kw.pop("result", {})}, **kw)


def test_split_rules_true_only_from_the_bytes_and_the_manifest(tiny_dataset, tmp_path):
    import shutil

    from tools.auditor.audit_run import split_rules

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    train = sorted(p.name for p in data.glob("fineweb_train_*.bin"))
    assert [ok for ok, _ in split_rules(train, data)] == [True, True]
    for shards in ([], None, [1]):  # nothing listed: nothing proves the run read no val
        assert [ok for ok, _ in split_rules(shards, data)] == [None, None]
    shutil.copyfile(data / train[0], data / "fineweb_train_999999.bin")  # a shard the manifest does not list
    seen, disjoint = split_rules([*train, "fineweb_train_999999.bin"], data)
    assert seen[0] is True and disjoint == (False, f"train shard fineweb_train_999999.bin is not listed in the train "
                                                   f"split of {data / 'manifest.json'}")
    from shards.format import load_data_shard, write_data_shard

    write_data_shard(data / train[0], load_data_shard(data / train[0]).numpy()[:-1])  # replaced: counts do not add up
    seen, disjoint = split_rules(train, data)
    assert seen[0] is False and "a shard was replaced or changed" in seen[1]


@pytest.mark.parametrize("how", ["copy", "symlink"])
@pytest.mark.parametrize("manifest", [True, False])
def test_a_val_shard_over_a_train_shard_is_refused_though_the_names_are_clean(fake_src, tiny_dataset, tmp_path,
                                                                             capsys, how, manifest):
    """Before: the rule looked at train_shards' names only, so a val shard copied (or linked) over
    fineweb_train_000000.bin passed as val_not_seen_in_training: True, with a manifest or without."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    if not manifest:
        (data / "manifest.json").unlink()
    train0, val0 = data / "fineweb_train_000000.bin", sorted(data.glob("fineweb_val_*.bin"))[0]
    train0.unlink()
    os.symlink(val0, train0) if how == "symlink" else shutil.copyfile(val0, train0)
    runs = [data_run(tmp_path, fake_src, data, s, **H100) for s in (1, 2)]
    assert cli(fake_src, tmp_path, runs) == 2
    err = capsys.readouterr().err
    same = "the same file" if how == "symlink" else "same bytes"
    assert (f"run {runs[0]}: val_not_seen_in_training not met (no val shard read by the training loader: train shard "
            f"{train0} is the val shard {val0.name} ({same}))") in err, err
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


@pytest.mark.parametrize("manifest", [True, False])
def test_the_split_flags_are_true_only_with_a_manifest_of_document_hashes(fake_src, tiny_dataset, tmp_path, manifest):
    """Before: without a manifest val_not_seen_in_training was True (from the names alone) and the
    README said "yes"; now null in submission.json with why, and "unverified" in the README."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    if not manifest:
        (data / "manifest.json").unlink()
    runs = [data_run(tmp_path, fake_src, data, s, **H100) for s in (1, 2)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_10min_16mb" / f"{DATE}_Tiny"
    sub = json.loads((folder / "submission.json").read_text())
    readme = (folder / "README.md").read_text()
    row = "| val shards read by the training loader | none (it opened train shards only) | none | "
    for flags in (s["compliance"] for s in sub["seed_results"]):
        assert flags["val_not_seen_in_training"] is (True if manifest else None)
        assert flags["splits_disjoint"] is (True if manifest else None)
        assert ("unverified" in flags) is not manifest
    if manifest:
        assert row + "yes |" in readme
        assert "| train/val documents disjoint (manifest doc hashes) | checked | disjoint | yes |" in readme
    else:
        assert set(sub["seed_results"][0]["compliance"]["unverified"]) == {"val_not_seen_in_training", "splits_disjoint"}
        assert "no manifest with document hashes in" in sub["seed_results"][0]["compliance"]["unverified"]["splits_disjoint"]
        assert row + "unverified: no manifest with document hashes |" in readme
        assert ("| train/val documents disjoint (manifest doc hashes) | not checked | disjoint | "
                "unverified: no manifest with document hashes |") in readme


def test_a_non_record_folder_states_the_rules_its_runs_do_not_meet(fake_src, tmp_path):
    """The non-record track accepts runs beyond the time limits: the README and submission.json say which."""
    runs = [fabricate_run(tmp_path, "a", 1, fake_src),
            fabricate_run(tmp_path, "b", 2, fake_src, result={"train_seconds": 700.0, "compliance.train_time_ok": False,
                                                             "eval_seconds": 650.5, "compliance.eval_time_ok": False})]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    sub = json.loads((folder / "submission.json").read_text())
    assert sub["rules_not_met"] == {"2": {"train_time_ok": "training <= 600 s: train_seconds=700.0",
                                          "eval_time_ok": "evaluation <= 600 s: eval_seconds=650.5"}}
    assert [s["compliance"]["train_time_ok"] for s in sub["seed_results"]] == [True, False]
    readme = (folder / "README.md").read_text()
    assert "| training time (max over seeds) | 700.0 s | 600 s | NO (seed 2) |" in readme
    assert "| evaluation time (max over seeds) | 650.5 s | 600 s | NO (seed 2) |" in readme
    assert "**Rules not met** (accepted in `track_non_record_16mb`" in readme
    assert "- seed 2: `train_time_ok`: training <= 600 s: train_seconds=700.0" in readme
    assert "- seed 2: `eval_time_ok`: evaluation <= 600 s: eval_seconds=650.5" in readme


@pytest.mark.parametrize("trainer, message", [
    ("raises", r"smoke run of train_gpt.py from inside the record folder failed \(exit 1\).*RuntimeError: eval failed"),
    ("writes no log", r"smoke run: the log reports code_bytes=None, expected the packed file's \d+ bytes"),
])
def test_a_packed_file_that_fails_its_smoke_run_is_refused(tmp_path, capsys, trainer, message):
    """The smoke run executes the packed file from inside the folder: a file that fails (or runs but
    does not train, export and evaluate) refuses the record and leaves nothing behind."""
    code = FAKE_TREE["train_gpt.py"]
    if trainer == "raises":
        code = code.replace("    print(json.dumps(out))\n    return 0\n", "    raise RuntimeError('eval failed')\n")
    root = write_tree(tmp_path / "src", {"train_gpt.py": code})
    src = root, bundle.build_human_source(root), bundle.build_packed_bytes(root)
    runs = [fabricate_run(tmp_path, "a", 1, src)]
    assert make_record.main(["--runs", str(runs[0]), "--name", "Tiny", "--author", "A", "--github-id", "a",
                             "--records-dir", str(tmp_path / "records"), "--root", str(root), "--date", DATE,
                             "--approach", APPROACH]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err, re.S), err
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


def test_refuses_when_the_current_source_is_not_the_code_of_the_runs(fake_src, tmp_path, capsys):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    changed = write_tree(tmp_path / "changed", {"quant/core.py": bundle_src_with_extra_function()})
    assert make_record.main(["--runs", str(runs[0]), "--name", "T", "--author", "x", "--github-id", "y",
                             "--records-dir", str(tmp_path / "records"), "--root", str(changed),
                             "--skip-smoke", "--approach", APPROACH]) == 2
    # its size or the code its log holds differs (the size check comes first where the sizes differ)
    assert "the code changed since the run" in capsys.readouterr().err


def bundle_src_with_extra_function():
    from test_bundle import FAKE_TREE

    return FAKE_TREE["quant/core.py"] + "\n\ndef quant_extra(x):\n    return [x, x * 2, x * 3, 'more code']\n"


def test_existing_folder_needs_force_and_force_replaces_it(fake_src, tmp_path, capsys):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    (folder / "stale.txt").write_text("old")
    assert cli(fake_src, tmp_path, runs) == 2
    assert "exists; pass --force" in capsys.readouterr().err and (folder / "stale.txt").exists()
    assert cli(fake_src, tmp_path, runs, "--force") == 0
    assert not (folder / "stale.txt").exists() and check_record(folder)["seeds"] == [1]
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


@pytest.mark.parametrize("track, message", [("track_10min_16mb", "needs 8xH100"),
                                            ("track_10min", "expected one of track_10min_16mb, track_non_record_16mb")])
def test_refuses_a_track_that_is_not_official_or_does_not_fit(fake_src, tmp_path, capsys, track, message):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    assert cli(fake_src, tmp_path, runs, "--track", track) == 2
    assert message in capsys.readouterr().err


def test_check_record_catches_a_tampered_folder(fake_src, tmp_path):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src), fabricate_run(tmp_path, "b", 2, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    with open(folder / "train_gpt.py", "ab") as f:
        f.write(b"\n")
    with pytest.raises(RecordError, match="bytes_code"):
        check_record(folder)


@pytest.mark.parametrize("damage", ["flip a payload byte", "re-saved as UTF-8"])
def test_check_record_catches_a_packed_file_that_does_not_unpack(fake_src, fake_src_latin1, tmp_path, damage,
                                                                 monkeypatch):
    src = fake_src
    if damage == "re-saved as UTF-8":  # only the latin-1 opt-in can be damaged that way
        monkeypatch.setenv("BUNDLE_ENCODING", "latin1")
        src = fake_src_latin1
    runs = [fabricate_run(tmp_path, "a", 1, src)]
    assert cli(src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    path = folder / "train_gpt.py"
    data = path.read_bytes()
    if damage == "flip a payload byte":  # same size: only the unpack check can see it
        data = bytearray(data)
        data[len(data) // 2] ^= 0x20
        path.write_bytes(bytes(data))
        message = "does not unpack"
    else:  # what an editor does to a latin-1 file: bigger, and it no longer decodes
        path.write_bytes(data.decode("latin-1").encode("utf-8"))
        sub_path = folder / "submission.json"
        sub = json.loads(sub_path.read_text())
        sub["bytes_code"] = path.stat().st_size
        sub_path.write_text(json.dumps(sub))
        message = "does not unpack.*latin1 file must be copied as bytes"
    with pytest.raises(RecordError, match=message):
        check_record(folder)


@pytest.mark.parametrize("encoding", ["ascii", "latin1"])
def test_a_packed_run_that_logged_its_bundle_source_is_accepted(fake_src, fake_src_latin1, tmp_path, encoding,
                                                                 monkeypatch):
    """Packed runs log BUNDLE_SOURCE (the minified code their wrapper execs), not the file itself."""
    src = fake_src if encoding == "ascii" else fake_src_latin1
    monkeypatch.delenv("BUNDLE_ENCODING", raising=False)
    if encoding == "latin1":
        monkeypatch.setenv("BUNDLE_ENCODING", "latin1")
    minified = bundle.unpack_packed(src[2])
    runs = [fabricate_run(tmp_path, "a", 1, src, code=minified),
            fabricate_run(tmp_path, "b", 2, src, code=src[1])]
    assert cli(src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    readme = (folder / "README.md").read_text()
    shipped = (folder / "train_gpt.py").read_bytes()
    assert shipped == src[2]
    if encoding == "ascii":  # the default: a file every reader can open
        assert shipped.isascii() and compile(open(folder / "train_gpt.py").read(), "t", "exec")
        assert "plain ASCII" in readme and "not UTF-8" not in readme
    else:
        assert bundle.packed_encoding(shipped) == "latin1"
        assert "not UTF-8" in readme and "GitHub shows it as binary" in readme


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", " "])
def test_a_name_that_is_not_a_folder_name_is_refused_before_anything_is_written(fake_src, tmp_path, capsys, name):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    argv = ["--runs", str(runs[0]), "--name", name, "--author", "x", "--github-id", "y",
            "--records-dir", str(tmp_path / "records"), "--root", str(fake_src[0]), "--date", DATE, "--skip-smoke",
            "--approach", APPROACH]
    assert make_record.main(argv) == 2
    assert f"--name {name!r}: expected letters, digits" in capsys.readouterr().err
    assert not (tmp_path / "records").exists() and not (tmp_path / "escaped").exists()
    with pytest.raises(RecordError, match="--name '': expected"):  # (the CLI already requires a value)
        make_record.make_record(runs, name="", author="x", github_id="y", approach=APPROACH,
                                records_dir=tmp_path / "records")


# -----------------------------------------------------------------------------------------------
# legal score-first TTT in place of the sliding pass
# -----------------------------------------------------------------------------------------------


def test_ttt_runs_make_a_record_scored_by_their_ttt_line_that_passes_the_audit(fake_src, tmp_path, capsys):
    from tools.auditor import audit

    runs = [fabricate_ttt_run(tmp_path, "a", 1, fake_src), fabricate_ttt_run(tmp_path, "b", 2, fake_src)]
    results = [json.loads((r / "result.json").read_text()) for r in runs]
    assert all("val_bpb_sliding" not in r for r in results)
    assert load_run(runs[0]).log["final"]["ttt"] == {"val_loss": pytest.approx(results[0]["val_loss_ttt"]),
                                                     "val_bpb": 1.271, "eval_ms": 15000, "stride": 32}
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    sub = json.loads((folder / "submission.json").read_text())
    assert sub["val_bpb"] == pytest.approx(statistics.fmean([1.271, 1.272]), abs=1e-8)
    assert sub["val_loss"] == pytest.approx(statistics.fmean(r["val_loss_ttt"] for r in results), abs=1e-8)
    assert sub["val_bpb_std"] == pytest.approx(statistics.stdev([1.271, 1.272]), abs=1e-8)
    assert sub["metric"] == "final_ttt_exact (mean over seeds)"
    per = sub["seed_results"]
    assert [(s["val_bpb"], s["val_bpb_ttt"], s["val_bpb_sliding"], s["ttt_epochs"]) for s in per] == [
        (1.271, 1.271, None, 3), (1.272, 1.272, None, 3)]
    readme = (folder / "README.md").read_text()
    assert "| roundtrip val_bpb | TTT val_bpb | artifact bytes |" in readme and "sliding val_bpb" not in readme
    assert "| 1 | 50 | 201.00 | 1.30100000 | 1.31100000 | 1.27100000 |" in readme
    assert f"**val_bpb {sub['val_bpb']:.8f}** (mean of 2 seeds, legal score-first TTT, stride 32," in readme
    assert "legal score-first TTT), artifact" in sub["blurb"]
    assert check_record(folder)["val_bpb"] == sub["val_bpb"]
    assert sub["compliance"]["claims_match_logs"] is True
    claims = next(c for c in audit.audit_folder(folder).checks if c.name == "claims_match_logs")
    assert claims.status == "pass" and "final_ttt_exact" in claims.evidence, claims.evidence
    capsys.readouterr()
    assert audit.main([str(folder)]) == 0, capsys.readouterr().out


def _ttt_line_off(text):
    return re.sub(r"^(final_ttt_exact val_loss:\S+ val_bpb:)\S+", r"\g<1>1.20000000", text, flags=re.M)


@pytest.mark.parametrize("case, spec, message", [
    ("log disagrees", dict(log_edit=_ttt_line_off), "train.log final_ttt_exact val_bpb:1.20000000 disagrees with "
                                                     "result.json val_bpb_ttt=1.272"),
    ("no ttt line", dict(log_edit=lambda t: t.replace("final_ttt_exact", "final_ttt")),
     "train.log has no `final_ttt_exact` line"),
    ("no ttt loss", dict(result={"val_loss_ttt": None}), "result.json lacks val_loss_ttt"),
])
def test_a_ttt_run_whose_log_and_result_disagree_is_refused(fake_src, tmp_path, capsys, case, spec, message):
    runs = [fabricate_ttt_run(tmp_path, "good", 1, fake_src), fabricate_ttt_run(tmp_path, "bad", 2, fake_src, **spec)]
    assert cli(fake_src, tmp_path, runs) == 2
    err = _one_line_refusal(capsys.readouterr().err)
    assert f"run {runs[1]}: " in err and message in err, err
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


@pytest.mark.parametrize("ttt_first", [True, False])
def test_runs_that_mix_ttt_and_sliding_scores_are_refused(fake_src, tmp_path, capsys, ttt_first):
    """TTT_ENABLED=1 on both, but one run's plan skipped TTT (its eval would not fit): same settings,
    different final evals."""
    ttt = fabricate_ttt_run(tmp_path, "ttt", 1, fake_src)
    sliding = fabricate_run(tmp_path, "skipped", 2, fake_src, hp={"ttt_enabled": True, "ttt_epochs": 3})
    runs = [ttt, sliding] if ttt_first else [sliding, ttt]
    assert cli(fake_src, tmp_path, runs) == 2
    err = _one_line_refusal(capsys.readouterr().err)
    first, second = ("final_ttt_exact (val_bpb_ttt)", "final_sliding_window_exact (val_bpb_sliding)")[::1 if ttt_first else -1]
    assert f"run {runs[1]}: scored by {second} but run {runs[0]} by {first}: a record's seeds share one final eval" in err
    assert not [p for p in (tmp_path / "records").rglob("*") if p.is_file()]


def test_the_smoke_run_env_gets_no_ttt_setting_from_the_run_or_the_shell(fake_src, tmp_path, monkeypatch):
    """The smoke run checks the plain sliding pass (PRESET=smoke): neither a TTT run's hyperparameters
    nor TTT_* variables of the shell (even ones the run did not record) reach it."""
    run = load_run(fabricate_ttt_run(tmp_path, "a", 1, fake_src))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train_gpt.py").write_text("pass\n")
    monkeypatch.setenv("TTT_ENABLED", "1")
    monkeypatch.setenv("TTT_LR", "0.5")  # not among the run's hyperparameters
    seen = {}

    def fake_run(cmd, *, env, **kwargs):
        seen.update(env)
        raise subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(record_smoke, "_run_live", fake_run)
    with pytest.raises(RecordError, match="did not finish within --smoke-timeout-seconds"):
        record_smoke.smoke_run(folder, run, log=lambda *a: None)
    assert seen["PRESET"] == "smoke" and seen["SEED"] == "1"
    assert not [k for k in seen if k.startswith("TTT_")], sorted(seen)


# -----------------------------------------------------------------------------------------------
# real runs
# -----------------------------------------------------------------------------------------------

@pytest.fixture
def smoke_threads(monkeypatch):
    """The smoke run with this process's NUM_THREADS (1 under `pytest -n 2`, tests/conftest.py): it drops every
    setting the runs recorded, NUM_THREADS too, and would spin one thread per core beside the other worker."""
    threads = os.environ.get("NUM_THREADS")
    if threads:
        real = record_smoke._run_live

        def run_live(cmd, *, env, **kwargs):
            return real(cmd, env=dict(env, NUM_THREADS=threads), **kwargs)

        monkeypatch.setattr(record_smoke, "_run_live", run_live)


@pytest.mark.slow
@pytest.mark.usefixtures("smoke_threads")
def test_record_from_two_real_cpu_runs_runs_from_inside_its_folder(tiny_dataset, sp1024_model, tmp_path, capsys):
    env_base = {k: v for k, v in TINY_ENV.items() if k not in ("VAL_MAX_TOKENS", "SEED")}  # records need the full val
    env_base.update(ITERATIONS="4", EVAL_STRIDE="64", TRAIN_SEQ_LEN="128", EVAL_BATCH_SEQS="32", VAL_BATCH_SIZE="8192")
    runs = []
    for seed in (1, 2):
        env = clean_env(**env_base, SEED=str(seed), RUN_ID=f"seed{seed}", DATA_PATH=str(tiny_dataset),
                        TOKENIZER_PATH=str(sp1024_model), OUT_DIR=str(tmp_path / "runs"), PYTHONPATH=str(REPO))
        proc = subprocess.run([sys.executable, str(REPO / "train_gpt.py")], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(tmp_path / "runs" / f"seed{seed}")
    folder = make_record.make_record(runs, name="RealTiny", author="A", github_id="a", records_dir=tmp_path / "records",
                                     date=DATE, log=print, approach=APPROACH, min_steps=4)  # ITERATIONS=4
    out = capsys.readouterr().out
    # the packed file ran from inside the folder (before it was renamed into place): trained, exported,
    # evaluated on a few val tokens (a smoke check), and reported its own size
    smoke = re.search(r"^smoke: ok, packed file ran from the folder: code_bytes:(\d+) steps:2 "
                      r"final_sliding_window_exact val_bpb:([\d.]+) stride:64 \(smoke check on 4096 val tokens, "
                      r"not a score\)$", out, re.M)
    assert smoke, out[-3000:]
    assert int(smoke.group(1)) == (folder / "train_gpt.py").stat().st_size and 0 < float(smoke.group(2)) < 20
    sub = check_record(folder)
    assert sub["rules_not_met"] == {} and all(all(s["compliance"].values()) for s in sub["seed_results"])
    comp = json.loads((folder / "submission.json").read_text())["compliance"]  # tools/audit.py on the folder
    assert comp["byte_accounting"] is True and "measured" in comp["evidence"]["byte_accounting"]
    assert comp["data_disjoint"] is True and comp["code_parses"] is True and comp["artifact_under_16mb"] is True
    results = [json.loads((r / "result.json").read_text()) for r in runs]
    assert sub["val_bpb"] == pytest.approx(statistics.fmean(r["val_bpb_sliding"] for r in results), abs=1e-8)
    assert sub["bytes_code"] == results[0]["bytes_code"] == (folder / "train_gpt.py").stat().st_size
    assert sorted(os.listdir(folder)) == sorted(["README.md", "submission.json", "train_gpt.py", "train_gpt_human.py",
                                                 "requirements.txt", "loss_curve.png", "train_seed1.log",
                                                 "train_seed2.log"])
    from tools.record import significance

    assert significance.main(["--runs", *map(str, runs), "--baseline-bpb", "99"]) == 0
    assert "verdict: SIGNIFICANT" in capsys.readouterr().out


def test_records_folder_documents_the_tracks_and_the_files_make_record_writes(fake_src, tmp_path):
    readme = (REPO / "records" / "README.md").read_text(encoding="utf-8")
    for track in RECORD_TRACKS:
        assert (REPO / "records" / track / "README.md").is_file() and f"`{track}/`" in readme
    assert "only adds one new folder" in readme and "make_record.py --check" in readme
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme.split("## Filling a folder")[1].split("## From")[0], re.M))
    runs = [fabricate_run(tmp_path, "a", 7, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0
    written = {p.name for p in (tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny").iterdir()}
    assert {n.replace("<S>", "7") for n in documented} == written


# -----------------------------------------------------------------------------------------------
# issue 23: every bad input gets one line (input, value, what was expected), exit 2, no traceback
# -----------------------------------------------------------------------------------------------


def _one_line_refusal(err: str) -> str:
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_an_unwritable_records_dir_is_refused_before_anything_is_written(fake_src, tmp_path, capsys):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    blocker = tmp_path / "records"
    blocker.write_text("a file where the records folder should be\n")
    assert cli(fake_src, tmp_path, runs) == 2
    err = _one_line_refusal(capsys.readouterr().err)
    assert f"--records-dir {blocker}: cannot write" in err and "expected a writable folder" in err
    assert blocker.read_text() == "a file where the records folder should be\n"


@pytest.mark.parametrize("text, message", [
    ("{not json", "submission.json is not valid JSON"),
    ("[]", "submission.json is a JSON list: expected an object"),
    ('{"val_bpb": "low"}', "submission.json lacks"),
])
def test_check_on_a_malformed_submission_json_says_so(fake_src, tmp_path, capsys, text, message):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    (folder / "submission.json").write_text(text)
    assert make_record.main(["--check", str(folder)]) == 2
    assert message in _one_line_refusal(capsys.readouterr().err)
    assert (folder / "submission.json").read_text() == text


def test_check_refuses_a_log_that_is_a_symlink_out_of_the_folder(fake_src, tmp_path, capsys):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]
    assert cli(fake_src, tmp_path, runs) == 0
    folder = tmp_path / "records" / "track_non_record_16mb" / f"{DATE}_Tiny"
    outside = tmp_path / "outside.log"
    outside.write_bytes((folder / "train_seed1.log").read_bytes())
    (folder / "train_seed1.log").unlink()
    (folder / "train_seed1.log").symlink_to(outside)
    assert make_record.main(["--check", str(folder)]) == 2
    err = _one_line_refusal(capsys.readouterr().err)
    assert f"train_seed1.log is a symlink to {outside}, outside the folder" in err


def test_a_result_json_that_is_not_an_object_is_malformed_not_unfinished(fake_src, tmp_path, capsys):
    run = fabricate_run(tmp_path, "a", 1, fake_src)
    (run / "result.json").write_text("[]")
    assert cli(fake_src, tmp_path, [run]) == 2
    err = _one_line_refusal(capsys.readouterr().err)
    assert "result.json is malformed: a JSON list ([]), expected an object" in err and "did not finish" not in err
    assert not (tmp_path / "records").exists() or not list((tmp_path / "records").rglob("*.json"))


def test_an_internal_error_still_shows_its_traceback(fake_src, tmp_path, monkeypatch):
    runs = [fabricate_run(tmp_path, "a", 1, fake_src)]

    def broken(*args, **kwargs):
        raise KeyError("a bug, not a bad input")

    monkeypatch.setattr(make_record, "build_submission", broken)
    with pytest.raises(KeyError, match="a bug"):
        cli(fake_src, tmp_path, runs)


@pytest.mark.parametrize("date,message", [
    ("2026-13-45", "--date '2026-13-45': not a calendar date (month must be in 1..12); expected YYYY-MM-DD"),
    ("2026-02-30", "--date '2026-02-30': not a calendar date (day is out of range for month); expected YYYY-MM-DD"),
    ("20260319", "--date '20260319': expected a date YYYY-MM-DD, e.g. 2026-03-19"),
    ("2026-3-9", "--date '2026-3-9': expected a date YYYY-MM-DD, e.g. 2026-03-19"),
])
def test_date_that_is_not_a_calendar_date_is_refused_before_any_run_is_read(date, message, tmp_path, capsys):
    """--date 2026-13-45 was accepted (the folder records/<track>/2026-13-45_<name>/ and the date in
    submission.json)."""
    code = make_record.main(["--runs", str(tmp_path / "no_such_run"), "--name", "x", "--author", "a", "--github-id",
                             "b", "--date", date, "--records-dir", str(tmp_path / "records")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: {message}"], err
    assert not (tmp_path / "records").exists()
    with pytest.raises(RecordError, match="--date"):
        make_record.make_record([str(tmp_path)], name="x", author="a", github_id="b", date=date)
    make_record.check_date("2028-02-29")  # a leap day is a date
