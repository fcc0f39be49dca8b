"""PRESET=8xh100-pr1855 against the Hyperparameters block of PR #1855's train_seed42.log, key by key, through
tools/parity/parity_config.py's documented map. Skips without ../shared."""

from pathlib import Path

import pytest

from primitives.settings import Hyperparameters
from quant.policy import QuantPolicy
from tools.parity.parity_config import (NOT_APPLICABLE, PENDING, QUANT_RECORD_TO_KIT, RECORD_TO_KIT, log_mismatches,
                                        quant_log_mismatches, read_log_hyperparameters, record_hparams)
from tools.parity.parity_models import PR1855_SCRIPT

LOG = PR1855_SCRIPT.parent / "train_seed42.log"
pytestmark = pytest.mark.skipif(not LOG.is_file(), reason="needs ../shared/reference/pr1855")


def preset():
    return Hyperparameters.from_env({"PRESET": "8xh100-pr1855"}, log=lambda *_: None)


def test_every_key_of_the_log_is_the_presets_value_or_listed_with_its_reason():
    logged = read_log_hyperparameters(LOG)
    assert len(logged) == 124 and logged["num_layers"] == "11"
    assert log_mismatches(logged, preset()) == []
    assert quant_log_mismatches(logged, QuantPolicy.from_env({"PRESET": "8xh100-pr1855"}, log=lambda *_: None)) == []
    groups = (set(RECORD_TO_KIT), set(QUANT_RECORD_TO_KIT), set(NOT_APPLICABLE), set(PENDING))
    assert set(logged) == set.union(*groups) and sum(map(len, groups)) == len(logged)  # each key in one group


def test_the_preset_reads_the_records_caseops_data_where_its_log_has_it():
    """The log's datasets_dir and tokenizer_path (paths on its machine) end in the folder and model the preset names
    (tools/prepare_data.py caseops --out writes that folder)."""
    logged, hp = read_log_hyperparameters(LOG), preset()
    assert logged["caseops_enabled"] == "True"
    assert Path(hp.data_path).name == Path(logged["datasets_dir"]).name == "fineweb10B_sp8192_lossless_caps_caseops_v1_reserved"
    assert Path(hp.tokenizer_path).name == Path(logged["tokenizer_path"]).name
    assert Path(hp.tokenizer_path).parent.name == Path(logged["tokenizer_path"]).parent.name == "tokenizers"


def test_a_changed_setting_is_reported():
    hp = Hyperparameters.from_env({"PRESET": "8xh100-pr1855", "MUON_WD": "0.09", "LN_SCALE": "0"}, log=lambda *_: None)
    assert log_mismatches(read_log_hyperparameters(LOG), hp) == ["ln_scale: log 'True', kit False",
                                                                  "muon_wd: log '0.095', kit 0.09"]


def test_the_preset_sets_the_records_quantizer_and_the_environment_wins():
    """PRESET alone gives the record's quantizer (QUANT_* through primitives/presets.py PRESET_QUANT), with the two
    settings its log does not print: no fit to a budget, its GPTQ arithmetic; a QUANT_* variable overrides the
    preset's value and the map reports it; another preset keeps the class defaults."""
    logged = read_log_hyperparameters(LOG)
    policy = QuantPolicy.from_env({"PRESET": "8xh100-pr1855"}, log=lambda *_: None)
    assert (policy.fit, policy.gptq_records) == (False, True)
    changed = QuantPolicy.from_env({"PRESET": "8xh100-pr1855", "QUANT_LQER": "0", "QUANT_EMBED_BITS": "8"},
                                   log=lambda *_: None)
    assert quant_log_mismatches(logged, changed) == ["embed_bits: log '7', kit 8", "lqer_enabled: log 'True', kit False"]
    assert QuantPolicy.from_env({"PRESET": "1xh100"}, log=lambda *_: None) == QuantPolicy()  # sp4096: PR #1617's


def test_the_records_h_built_from_the_preset_prints_the_logged_values():
    """record_hparams (what the parity harness hands the record's GPT) carries every mapped value of the log."""
    from tools.parity.standins import import_script

    h = record_hparams(import_script(PR1855_SCRIPT), preset())
    logged = read_log_hyperparameters(LOG)
    assert [k for k in RECORD_TO_KIT if str(getattr(h, k)) != logged[k] and float(getattr(h, k)) != float(logged[k])] == []


def test_a_log_without_the_block_is_refused(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("step:1/2 train_loss:3.0\n")
    with pytest.raises(ValueError, match="no 'Hyperparameters:' line"):
        read_log_hyperparameters(path)


@pytest.mark.parametrize("env, message", [
    ({"PARALLEL_START_LAYER": "3", "PARALLEL_RESIDUAL_START": "2"}, "PARALLEL_START_LAYER=3: expected 0 \\(off\\)"),
    ({"PARALLEL_START_LAYER": "7"}, "PARALLEL_START_LAYER=7: expected 0 \\(off\\) or a layer index 1..6"),
    ({"PARALLEL_START_LAYER": "3", "PARALLEL_FINAL_LANE": "sum"}, "PARALLEL_FINAL_LANE='sum': expected"),
    ({"MUON_FORM": "jax"}, "MUON_FORM='jax': expected"),
    ({"EMBED_WD": "-0.5"}, "EMBED_WD=-0.5: expected"),
])
def test_the_records_settings_refuse_bad_values_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Hyperparameters.from_env({"RUN_ID": "x", **env}, log=lambda *_: None)
