"""Per-document LoRA TTT (TTT_MODE=lora) in the trainer's final eval: not timed before training (said in
the log), recorded in the artifact, and the same score as `python -m eval score --ttt 1` on the saved
artifact; the settings' checks."""

import re
import subprocess
import sys

import pytest

from quant.artifact import load_artifact
from tests.test_train import REPO, one_thread, read_result, run_trainer, trainer_env  # noqa: F401 (fixture)
from tests.test_train_ttt import plan_with
from trainer.finish import score_command
from primitives.settings import Hyperparameters

LORA_ENV = dict(TTT_ENABLED=1, TTT_MODE="lora", TTT_EPOCHS=1, TTT_LORA_RANK=4, TTT_LORA_LR=0.02,
                TTT_LORA_CHUNK_TOKENS=32)


@pytest.mark.slow
def test_trainer_lora_ttt_is_the_eval_cli_score_of_the_saved_artifact(tiny_dataset, sp1024_model, tmp_path):
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="lora", **LORA_ENV)
    proc = run_trainer(env)
    result = read_result(tmp_path, "lora")
    assert result["status"] == "ok" and result["phase"] == "done", proc.stdout[-3000:]
    assert result["ttt_mode"] == "lora" and result["ttt_lora_rank"] == 4 and result["ttt_epochs"] == 1
    assert result["ttt_updates"] > 0 and result["ttt_updates_stopped_at_chunk"] is None
    assert result["ttt_updates"] == result["ttt_chunks"] - result["ttt_documents"]  # all but each document's last
    assert re.search(r"^ttt_plan: TTT_MODE=lora is not timed before training: stride 32 epochs 1; its time guard",
                     proc.stdout, re.M)
    m = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) eval_time:\d+ms stride:32 chunks:(\d+) updates:(\d+)$",
                  proc.stdout, re.M)
    assert m and float(m.group(2)) == pytest.approx(result["val_bpb_ttt"], abs=1e-8)
    artifact = tmp_path / "lora" / "final_model.ptz"
    recorded = load_artifact(artifact)[2]["run"]["ttt"]
    assert {k: recorded[k] for k in ("mode", "epochs", "lora_rank", "lora_lr", "lora_chunk_tokens")} == dict(
        mode="lora", epochs=1, lora_rank=4, lora_lr=0.02, lora_chunk_tokens=32)
    # `python -m eval score --ttt 1`: every TTT setting from the artifact, none from flags or the environment
    hp = Hyperparameters.from_env(env, log=lambda *_: None)
    command = score_command(hp, artifact, result["eval_stride"], result["ttt_epochs"])
    assert command.endswith(" --ttt-mode lora --ttt-lora-rank 4 --ttt-lora-lr 0.02 --ttt-lora-chunk-tokens 32")
    bare = command[:command.index(" --ttt 1 ")] + " --ttt 1"
    cli_env = {k: v for k, v in env.items() if not k.startswith("TTT_")}
    score = subprocess.run([sys.executable, *bare.split()[1:]], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=cli_env)
    assert score.returncode == 0, score.stderr[-2000:]
    assert re.search(r"^ttt settings: from the artifact TTT_EPOCHS=1 .*TTT_MODE=lora TTT_LORA_RANK=4 TTT_LORA_LR=0.02 "
                     r"TTT_LORA_CHUNK_TOKENS=32; from flags (none|EVAL_BATCH_SEQS=\d+)$", score.stdout, re.M)
    cli = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) .* chunks:(\d+) updates:(\d+)$", score.stdout, re.M)
    assert cli, score.stdout[-2000:]
    assert float(cli.group(2)) == pytest.approx(result["val_bpb_ttt"], abs=1e-7)
    assert float(cli.group(1)) == pytest.approx(result["val_loss_ttt"], abs=1e-7)
    assert int(cli.group(4)) == result["ttt_updates"]
    # the adapters changed the score: --ttt-epochs 0 gives the plain sliding score
    plain = subprocess.run([sys.executable, *bare.split()[1:], "--ttt-epochs", "0"], cwd=REPO, capture_output=True,
                           text=True, timeout=300, env=cli_env)
    sliding = float(re.search(r"^final_ttt_exact val_loss:\S+ val_bpb:(\S+)", plain.stdout, re.M).group(1))
    assert abs(sliding - result["val_bpb_ttt"]) > 1e-5


def test_lora_is_not_planned_and_says_so(monkeypatch, tmp_path):
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 100.0, ttt_mode="lora", ttt_epochs=2)
    assert plan == dict(stride=16, ttt_epochs=2)  # a step of 100 s would skip chunked TTT: lora is not timed
    assert lines[-1].startswith("ttt_plan: TTT_MODE=lora is not timed before training: stride 16 epochs 2; its time "
                                "guard stops the LoRA updates when the projected eval exceeds EVAL_MAX_SECONDS=600")


def test_lora_settings_are_checked():
    base = {"RUN_ID": "x", "TTT_ENABLED": "1", "TTT_MODE": "lora", "TRAIN_SEQ_LEN": "64"}
    hp = Hyperparameters.from_env(dict(base, TTT_LORA_CHUNK_TOKENS="64"), log=lambda *_: None)
    assert (hp.ttt_mode, hp.ttt_lora_rank, hp.ttt_lora_lr, hp.ttt_lora_chunk_tokens) == ("lora", 8, 0.01, 64)
    for bad, message in ((dict(TTT_LORA_CHUNK_TOKENS="65"), "TTT_LORA_CHUNK_TOKENS=65: expected > 0 and <= TRAIN_SEQ_LEN=64"),
                         (dict(TTT_LORA_RANK="0"), "TTT_LORA_RANK=0: expected >= 1"),
                         (dict(TTT_LORA_LR="-1"), "TTT_LORA_LR=-1.0: expected a finite value >= 0"),
                         (dict(TTT_MODE="adapter"), "TTT_MODE='adapter': expected chunked, phased or lora")):
        with pytest.raises(ValueError, match=re.escape(message)):
            Hyperparameters.from_env(dict(base, **bad), log=lambda *_: None)
    # the LoRA chunk only matters with TTT_MODE=lora: the default 256 does not refuse a short TRAIN_SEQ_LEN otherwise
    Hyperparameters.from_env(dict(base, TTT_MODE="chunked", TTT_CHUNK_TOKENS="64"), log=lambda *_: None)
