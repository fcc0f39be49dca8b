"""Every setting has a declared domain (primitives/domains.py), checked as a whole before anything is written."""

import dataclasses
import os

import pytest

from primitives.domains import Domain, field_domain, inert_settings
from primitives.presets import PRESETS
from primitives.settings import Hyperparameters

QUIET = dict(log=lambda *_: None)


def refusal(env: dict, **kw) -> str:
    with pytest.raises(ValueError) as err:
        Hyperparameters.from_env({"PRESET": "smoke", **env}, **QUIET, **kw)
    return str(err.value)


def test_every_field_declares_a_domain_that_holds_its_default_and_every_preset():
    for f in dataclasses.fields(Hyperparameters):
        assert isinstance(field_domain(f), Domain), f"{f.name}: declare it with setting(default, ...)"
    for preset in PRESETS:
        hp = Hyperparameters.from_env({"PRESET": preset}, **QUIET)
        assert hp.violations() == {}, preset


def test_a_field_without_a_domain_is_caught():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        x: int = 1

    with pytest.raises(KeyError):
        field_domain(dataclasses.fields(Bare)[0])


@pytest.mark.parametrize("env,expected", [
    ({"LOGIT_SOFTCAP": "0"}, "LOGIT_SOFTCAP=0.0: expected a finite number > 0"),  # every logit 0: val_loss ln(V)
    ({"BETA2": "1"}, "BETA2=1.0: expected a finite number in [0, 1)"),  # torch's error inside training before
    ({"BETA1": "-0.1"}, "BETA1=-0.1: expected a finite number in [0, 1)"),
    ({"MUON_MOMENTUM": "1"}, "MUON_MOMENTUM=1.0: expected a finite number in [0, 1)"),
    ({"OUT_DIR": ""}, "OUT_DIR='': expected a non-empty path"),  # the run in the current folder before
    ({"DATA_PATH": " "}, "DATA_PATH='': expected a non-empty path"),  # the text is stripped
    ({"ROPE_BASE": "0"}, "ROPE_BASE=0.0: expected a finite number > 0"),
    ({"MLP_MULT": "0.001"}, "MLP_MULT=0.001: expected MLP_MULT x MODEL_DIM >= 1 (the MLP's width)"),
    ({"NUM_LOOPS": "1", "LOOP_START": "1", "LOOP_END": "2", "ENABLE_LOOPING_AT": "1"},
     "ENABLE_LOOPING_AT=1.0: expected a start inside the run: < 1 (NUM_LOOPS=1)"),
    # step-bounded: the last step trained is ITERATIONS-1, so a start at 0.95 of 10 steps never loops
    ({"NUM_LOOPS": "1", "LOOP_START": "1", "LOOP_END": "2", "ENABLE_LOOPING_AT": "0.95", "MAX_WALLCLOCK_SECONDS": "0",
      "ITERATIONS": "10"}, "ENABLE_LOOPING_AT=0.95: expected a start inside the run: < 1 and <= (ITERATIONS-1)/ITERATIONS = 0.9 (NUM_LOOPS=1)"),
    ({"WD_TAPER_FINAL_MULT": "0.5", "WD_TAPER_START_FRAC": "1"},
     "WD_TAPER_START_FRAC=1.0: expected < 1, a taper that starts inside the run (WD_TAPER_FINAL_MULT=0.5)"),
    ({"TRAIN_BATCH_TOKENS": "8000"}, "TRAIN_BATCH_TOKENS=8000: expected a multiple of TRAIN_SEQ_LEN=256 (whole sequences)"),
])
def test_a_value_outside_its_domain_is_refused_by_name(env, expected):
    assert refusal(env) == expected


def test_byte_budget_at_or_below_the_code_bytes_is_refused():
    hp = Hyperparameters.from_env({"PRESET": "smoke", "BYTE_BUDGET": "50000"}, **QUIET)
    hp.validate(code_bytes=49_999)
    with pytest.raises(ValueError, match=r"^BYTE_BUDGET=50000: expected more than the shipped train_gpt.py's 50000 bytes"):
        hp.validate(code_bytes=50_000)


def test_every_violation_is_listed_in_one_message_in_field_order_then_the_unparsed():
    message = refusal({"LOGIT_SOFTCAP": "0", "BETA2": "1", "OUT_DIR": "", "MATRIX_LR": "x", "WARMUP_STEPS": "-1"})
    assert message.split("; ") == [
        "OUT_DIR='': expected a non-empty path", "WARMUP_STEPS=-1: expected a whole number >= 0 (steps)",
        "LOGIT_SOFTCAP=0.0: expected a finite number > 0", "BETA2=1.0: expected a finite number in [0, 1)",
        "MATRIX_LR='x': expected a number"]
    assert "\n" not in message


def test_a_relation_on_a_field_out_of_its_domain_does_not_repeat_it():
    # NUM_HEADS=0 would make MODEL_DIM % NUM_HEADS and the head size fail too: only the cause is named
    assert refusal({"NUM_HEADS": "0"}) == "NUM_HEADS=0: expected a whole number >= 1"
    assert refusal({"NUM_LAYERS": "-1"}) == "NUM_LAYERS=-1: expected a whole number >= 1"


def test_a_field_of_the_wrong_type_built_by_hand_is_named_not_a_traceback():
    hp = dataclasses.replace(Hyperparameters.from_env({"PRESET": "smoke"}, **QUIET), num_heads="4", logit_softcap=float("nan"))
    with pytest.raises(ValueError) as err:
        hp.validate()
    assert str(err.value) == ("NUM_HEADS='4': expected a whole number >= 1; LOGIT_SOFTCAP=nan: expected a finite number > 0")


@pytest.mark.parametrize("env,warned", [
    ({"LOOP_START": "2"}, ["LOOP_START=2 has no effect in this run: it applies only when NUM_LOOPS > 0"]),
    ({"TTT_EPOCHS": "1", "TTT_LORA_RANK": "4"}, ["TTT_EPOCHS=1 has no effect in this run: it applies only when TTT_ENABLED=1",
                                                 "TTT_LORA_RANK=4 has no effect in this run: it applies only when "
                                                 "TTT_ENABLED=1 and TTT_MODE=lora or phased_lora"]),
    ({"WD_TAPER_START_FRAC": "0.5"}, ["WD_TAPER_START_FRAC=0.5 has no effect in this run: it applies only when "
                                      "WD_TAPER_FINAL_MULT != 1"]),
    ({"SPARSE_ATTN_GATE_SCALE": "0.5"}, ["SPARSE_ATTN_GATE_SCALE=0.5 has no effect in this run: it applies only when "
                                         "SPARSE_ATTN_GATE_ENABLED=1"]),
    ({"NUM_LOOPS": "1", "LOOP_START": "1", "LOOP_END": "2"}, []),  # applies: no warning
    ({"TTT_ENABLED": "1", "TTT_EPOCHS": "1"}, []),
    ({}, []),  # a preset's own values are never warned about
])
def test_a_setting_whose_effect_never_happens_is_one_warning_naming_it(env, warned):
    lines = []
    Hyperparameters.from_env({"PRESET": "smoke", **env}, log=lines.append)
    assert lines == [f"WARNING: {w}" for w in warned]


def test_inert_settings_reads_only_the_given_names():
    hp = Hyperparameters.from_env({"PRESET": "smoke"}, **QUIET)
    assert inert_settings(hp, set()) == []
    assert len(inert_settings(hp, {"loop_start", "loop_end", "ttt_lr"})) == 3


def test_the_settings_warnings_are_in_train_log_not_only_on_the_console(tmp_path, monkeypatch, capsys):
    # the organizers read train.log: an inert setting or a typo warned on the console only was lost with it
    from trainer import runfolder
    from trainer.context import setup_distributed

    env = {"PRESET": "smoke", "RUN_ID": "r", "OUT_DIR": str(tmp_path), "LOOP_START": "2", "MATRIX_LRR": "0.02"}
    for name in [n for n in os.environ if n.startswith(("TTT_", "LOOP_", "MATRIX_", "NUM_LOOPS"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    console = []
    hp = Hyperparameters.from_env(log=console.append)
    assert [line.split(":")[0] for line in console] == ["WARNING", "WARNING"], console
    run = setup_distributed(hp)
    run.log("a line of the input checks")
    monkeypatch.setattr(runfolder, "log_run_header", lambda ctx, hp: ctx.log("the header"))
    runfolder.open_run_log(run, hp, {})
    run.log_file.close()
    runfolder.release_run_folders()
    log = (tmp_path / "r" / "train.log").read_text().splitlines()
    assert log == ["the header", *console, "a line of the input checks"], log
    assert any("LOOP_START=2 has no effect" in line for line in log) and any("MATRIX_LRR" in line for line in log)
    assert capsys.readouterr().out.count("WARNING") == 0  # printed once, by from_env; train.log gets its copy only
