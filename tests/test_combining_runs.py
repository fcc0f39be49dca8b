"""Tools that combine runs check what they combine: significance refuses runs of other tokenizers or data
and never calls a val subset SIGNIFICANT; sweep --config NAME=VALUE runs at VALUE."""

import json
import math
from pathlib import Path

from tools.record import significance

LN2 = math.log(2)
TPB = 0.41
NEW = [1.100, 1.101, 1.0995]


def write_run(folder: Path, seed: int, bpb: float, tokenizer="a" * 64, manifest="b" * 64, val_max_tokens=0):
    folder.mkdir(parents=True)
    loss = bpb * LN2 / TPB
    (folder / "result.json").write_text(json.dumps({
        "seed": seed, "status": "ok", "val_bpb_sliding": bpb, "val_loss_sliding": loss, "tokens_per_byte": TPB,
        "hyperparameters": {"val_max_tokens": val_max_tokens}, "inputs": {"tokenizer_sha256": tokenizer,
                                                                         "manifest_sha256": manifest},
        "compliance": {"full_val_split": not val_max_tokens}}))
    return str(folder)


def test_significance_refuses_runs_of_another_tokenizer_or_dataset_in_either_group(tmp_path, capsys):
    runs = [write_run(tmp_path / f"r{i}", i, bpb) for i, bpb in enumerate(NEW)]
    other_tok = write_run(tmp_path / "t", 9, 1.1, tokenizer="c" * 64)
    assert significance.main(["--runs", *runs[:2], other_tok, "--baseline-bpb", "1.12"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --runs: run {other_tok} was scored with another tokenizer than run {runs[0]} (sha256 "
                   "cccccccccccc vs aaaaaaaaaaaa); expected runs of one tokenizer and one val split")
    base = [write_run(tmp_path / f"b{i}", i, 1.12 + i / 1000, manifest="d" * 64) for i in range(2)]
    assert significance.main(["--runs", *runs, "--baseline-runs", *base]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --baseline-runs: run {base[0]} was scored with another dataset (manifest.json)"), err
    assert significance.main(["--runs", *runs, "--baseline-bpb", "1.12"]) == 0
    assert "verdict: SIGNIFICANT" in capsys.readouterr().out


def test_significance_never_calls_a_val_subset_significant(tmp_path, capsys):
    runs = [write_run(tmp_path / f"r{i}", i, bpb, val_max_tokens=65536) for i, bpb in enumerate(NEW)]
    assert significance.main(["--runs", *runs, "--baseline-bpb", "1.12"]) == 0
    out = capsys.readouterr().out
    assert "verdict: UNVERIFIED" in out and "SIGNIFICANT at" not in out  # before: SIGNIFICANT
    assert "note: 3 run(s) scored part of the val split" in out
    assert significance.main(["--runs", *runs, "--baseline-bpb", "1.12", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["verdict"] == "UNVERIFIED" and res["significant"] is False


def sweep_runs(*argv):
    from tools.sweeps.sweep import build_parser
    from tools.sweeps.sweep_spec import build_runs, spec_from_args

    return build_runs(spec_from_args(build_parser().parse_args(["--name", "s", *argv])), "runs")


def test_sweep_config_named_by_a_setting_runs_at_that_setting():
    (run,) = sweep_runs("--config", "MATRIX_LR=0.02")
    assert run.config == "MATRIX_LR=0.02" and run.env["MATRIX_LR"] == "0.02"  # before: a config of that name at 0.04
    (run,) = sweep_runs("--config", "MATRIX_LR=0.02", "SCALAR_LR=0.03")
    assert (run.env["MATRIX_LR"], run.env["SCALAR_LR"]) == ("0.02", "0.03")
    (run,) = sweep_runs("--config", "lr02", "MATRIX_LR=0.02")
    assert run.config == "lr02" and run.env["MATRIX_LR"] == "0.02"


def test_sweep_refuses_a_name_that_contradicts_its_settings_and_a_grid_over_a_configs_own_value():
    import pytest

    from tools.sweeps.sweep_spec import SweepError

    with pytest.raises(SweepError, match=r"^--config MATRIX_LR=0.02: sets MATRIX_LR=0.03; expected the value its name says"):
        sweep_runs("--config", "MATRIX_LR=0.02", "MATRIX_LR=0.03")
    with pytest.raises(SweepError, match=r"^config 'a': sets MATRIX_LR=0.03, which the grid varies; expected each variable "
                                         r"in the config or in the grid, not both"):
        sweep_runs("--config", "a", "MATRIX_LR=0.03", "--grid", "MATRIX_LR=0.02,0.04")
    assert len(sweep_runs("--config", "a", "SCALAR_LR=0.03", "--grid", "MATRIX_LR=0.02,0.04")) == 2


def test_make_record_refuses_a_seed_below_the_step_floor_unless_overridden(tmp_path):
    import pytest

    from tools.record.record_checks import RECORD_MIN_STEPS, check_steps
    from tools.record.runs import RecordError, Run

    run = Run(tmp_path / "r", {"steps": 1, "seed": 1}, None, "", {"final": {}})
    with pytest.raises(RecordError, match=rf"trained 1 step\(s\), fewer than --min-steps {RECORD_MIN_STEPS}; expected a "
                                          r"longer run .*--min-steps 0 to make the record anyway"):
        check_steps(run, RECORD_MIN_STEPS)
    check_steps(run, 0)
    check_steps(Run(tmp_path / "r", {"steps": RECORD_MIN_STEPS}, None, "", {"final": {}}), RECORD_MIN_STEPS)


def test_the_gptq_reserve_a_seed_chose_is_run_dependent_not_its_configuration(tmp_path):
    from tools.auditor.audit_evidence import config_of, read_evidence

    configs = []
    for seed, reserve in ((1, 10.0), (2, 12.5)):  # a slow calibration raised seed 2's reserve
        log = tmp_path / f"train_seed{seed}.log"
        log.write_text(f"SEED:{seed}\nMATRIX_LR:0.025\nGPTQ_RESERVE_SECONDS:10.0\n"
                       f"gptq_reserve_seconds:{reserve} training cap:{600_000 - 1000 * reserve:.0f}ms\n"
                       "step:0/100 train_loss:6.9\n")
        configs.append(config_of(read_evidence(log)))
    assert configs[0] == configs[1] and configs[0]["matrix_lr"][0] == "0.025"  # before: gptq_reserve_seconds, cap differed


def test_the_folder_audit_passes_seeds_whose_gptq_reserve_differs_and_says_why(tmp_path):
    # a slow calibration raised one seed's GPTQ reserve: the folder audit called the seeds "different
    # configurations" with no hint why; now same_config passes and names the values it did not compare
    from tests.test_audit import make_official_folder
    from tools.auditor import audit

    folder = make_official_folder(tmp_path)
    for log, reserve in zip(sorted(folder.glob("train_seed*.log")), (10.0, 12.5, 10.0)):
        text = log.read_text().replace("step:0/", f"gptq_reserve_seconds:{reserve} training cap:"
                                                 f"{600_000 - 1000 * reserve:.0f}ms\nstep:0/", 1)
        log.write_text(text)
    check = next(c for c in audit.audit_folder(folder).checks if c.name == "same_config")
    assert check.status == "pass", check
    assert check.evidence.endswith("; not compared: cap 590000ms vs 587500ms, gptq_reserve_seconds 10.0 vs 12.5 "
                                   "(each seed's GPTQ reserve, raised by the trainer when its calibration was slow, "
                                   "and the training cap it leaves are run-dependent, not its configuration)"), check.evidence
