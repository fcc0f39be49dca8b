"""Phased TTT (TTT_MODE=phased) in the trainer's final eval: planned before training with its phases,
recorded in the artifact, and the same score as `python -m eval score --ttt 1` on the saved artifact."""

import re

import pytest

from eval.plan import EvalPlan
from quant.artifact import load_artifact
from tests.test_train import REPO, one_thread, run_to_done, trainer_env  # noqa: F401 (fixture)
from tests.test_train_ttt import plan_with
from trainer.finish import score_command
from primitives.settings import Hyperparameters
from test_eval_support import assert_cli_scores_as_the_trainer

# 4096 val targets in 3 phases of whole documents; each update round trains on the scored prefix
PHASED_ENV = dict(TTT_ENABLED=1, TTT_MODE="phased", TTT_PHASES=3, TTT_EPOCHS=1, TTT_BATCH_SEQS=8, TTT_LR=0.01)


@pytest.mark.slow
def test_trainer_phased_ttt_is_the_eval_cli_score_of_the_saved_artifact(tiny_dataset, sp1024_model, tmp_path):
    env, proc, result = run_to_done(tiny_dataset, sp1024_model, tmp_path, "phased", **PHASED_ENV)
    assert result["ttt_mode"] == "phased" and result["ttt_phases"] == 3 and result["ttt_epochs"] == 1
    assert result["ttt_updates"] > 0 and result["ttt_updates_stopped_at_chunk"] is None
    assert re.search(r"^ttt_plan: .* 4096 val targets: stride 32 epochs 1 phases 3 projected \d+s with the roundtrip "
                     r"\(EVAL_MAX_SECONDS=600\)$", proc.stdout, re.M)
    m = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) eval_time:\d+ms stride:32 phases:3 updates:(\d+)$",
                  proc.stdout, re.M)
    assert m and float(m.group(2)) == pytest.approx(result["val_bpb_ttt"], abs=1e-8)
    artifact = tmp_path / "phased" / "final_model.ptz"
    recorded = load_artifact(artifact)[2]["run"]["ttt"]
    assert (recorded["mode"], recorded["phases"], recorded["epochs"]) == ("phased", 3, 1)
    # `python -m eval score --ttt 1`: every TTT setting from the artifact, none from flags or the environment
    hp = Hyperparameters.from_env(env, log=lambda *_: None)
    command = score_command(hp, artifact, EvalPlan(stride=result["eval_stride"], epochs=result["ttt_epochs"],
                                               phases=result["ttt_phases"]))
    assert command.endswith(" --ttt-mode phased --ttt-phases 3")
    assert_cli_scores_as_the_trainer(
        command, env, result,
        r"^ttt settings: from the artifact .*TTT_MODE=phased TTT_PHASES=3; from flags (none|EVAL_BATCH_SEQS=\d+)$",
        r"phases:3 updates:(\d+)")


def test_the_phased_plan_keeps_cuts_or_skips_and_says_so(monkeypatch, tmp_path):
    """1,000,000 targets, stride 16, batches of 4 (as test_train_ttt's plan test); phased rounds train on
    the prefix: p / P of 15,625 sequences in batches of 32 after phase p."""
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, ttt_mode="phased", ttt_phases=3, ttt_epochs=1)
    assert plan == dict(stride=16, ttt_epochs=1, ttt_phases=3)  # 163 + 326 steps x 0.1 s = 49 s
    assert re.search(r"stride 16 epochs 1 phases 3 projected \d+s with the roundtrip \(EVAL_MAX_SECONDS=600\)$", lines[-1])
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, ttt_mode="phased", ttt_phases=12, ttt_epochs=3)
    assert plan["ttt_epochs"] == 3 and plan["ttt_phases"] < 12 and "does not fit: TTT_PHASES=12 -> " in lines[-1]
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 5.0, ttt_mode="phased", ttt_phases=3, ttt_epochs=1)
    assert plan == dict(stride=16, ttt_epochs=0, ttt_phases=3) and "TTT skipped: 1 epoch of 2 phases" in lines[-1]
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, ttt_mode="phased", ttt_phases=1, ttt_epochs=1)
    assert plan["ttt_epochs"] == 0 and "TTT_PHASES=1 scores the whole stream before any update" in lines[-1]


# PR #1855's form (TTT_MODE=phased_lora) at toy sizes: its own settings (TTT_PREFIX_DOCS, TTT_LORA_ALPHA, ...) reach
# the artifact and come back from it in `python -m eval score --ttt 1`, which has flags for them
PHASED_LORA_ENV = dict(TTT_ENABLED=1, TTT_MODE="phased_lora", TTT_PHASES=2, TTT_EPOCHS=1, TTT_BATCH_SEQS=8, TTT_LR=0.01,
                       TTT_PREFIX_DOCS=4, TTT_LORA_RANK=4, TTT_LORA_BATCH_DOCS=4, TTT_LORA_CHUNK_TOKENS=64,
                       TTT_LORA_ALPHA=8, TTT_LORA_MLP=0)


@pytest.mark.slow
def test_trainer_phased_lora_ttt_is_the_eval_cli_score_of_the_saved_artifact(tiny_dataset, sp1024_model, tmp_path):
    env, proc, result = run_to_done(tiny_dataset, sp1024_model, tmp_path, "plora", **PHASED_LORA_ENV)
    assert result["ttt_mode"] == "phased_lora" and result["ttt_updates"] > 0, proc.stdout[-3000:]
    recorded = load_artifact(tmp_path / "plora" / "final_model.ptz")[2]["run"]["ttt"]
    assert (recorded["mode"], recorded["prefix_docs"], recorded["lora_alpha"], recorded["lora_mlp"]) == (
        "phased_lora", 4, 8.0, False)
    hp = Hyperparameters.from_env(env, log=lambda *_: None)
    command = score_command(hp, tmp_path / "plora" / "final_model.ptz",
                            EvalPlan(stride=result["eval_stride"], epochs=result["ttt_epochs"], phases=result["ttt_phases"]))
    assert " --ttt-prefix-docs 4 " in command and " --ttt-lora-mlp False" in command
    assert_cli_scores_as_the_trainer(
        command, env, result, r"^ttt settings: from the artifact .*TTT_PREFIX_DOCS=4 .*TTT_LORA_MLP=False.*; from flags ",
        r"updates:(\d+)")
