"""Per-document LoRA TTT (TTT_MODE=lora) in the trainer's final eval: planned before training (timed, in
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
    assert re.search(r"^ttt_plan: TTT_MODE=lora \S+ms per chunk forward, \S+ms per adapter step, 4096 val targets in "
                     r"\d+ documents: stride 32 epochs 1 projected \d+s with the roundtrip \(EVAL_MAX_SECONDS=600\)$",
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


def test_the_lora_plan_keeps_cuts_or_skips_and_says_so(monkeypatch, tmp_path):
    """1,000,000 targets in 2,000 documents of 500 tokens, chunks of 64: 15,625 + 2,000 chunks (one forward
    each), 15,625 adapter steps per epoch; roundtrip 3.9 s at 1 ms per forward batch (plan_with's)."""
    import torch
    import trainer.evaluate as trainer_evaluate

    stream = torch.full((1_000_001,), 7)
    stream[:-1:500] = 1
    monkeypatch.setattr(trainer_evaluate, "load_validation_tokens", lambda *a, **k: stream)
    common = dict(ttt_mode="lora", ttt_lora_chunk_tokens=64, ttt_epochs=2)
    monkeypatch.setattr(trainer_evaluate, "time_lora_ttt", lambda *a: (0.002, 0.01))
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 100.0, **common)  # the SGD step's timing plays no part
    assert plan == dict(stride=16, ttt_epochs=2)  # 17,625 x 2 ms + 2 x 15,625 x 10 ms + 3.9 s = 351.7 s
    assert lines[-1] == ("ttt_plan: TTT_MODE=lora 2.0ms per chunk forward, 10.0ms per adapter step, 1000000 val "
                         "targets in 2000 documents: stride 16 epochs 2 projected 352s with the roundtrip "
                         "(EVAL_MAX_SECONDS=600)")
    monkeypatch.setattr(trainer_evaluate, "time_lora_ttt", lambda *a: (0.002, 0.02))
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, **common)  # 2 epochs: 664 s; 1 epoch: 352 s
    assert plan == dict(stride=16, ttt_epochs=1) and lines[-1].endswith("; TTT_EPOCHS=2 -> 1")
    monkeypatch.setattr(trainer_evaluate, "time_lora_ttt", lambda *a: (0.002, 0.04))
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, **common)
    assert plan == dict(stride=16, ttt_epochs=0)
    assert lines[-1].endswith("(EVAL_MAX_SECONDS=600); TTT skipped: 1 epoch of LoRA TTT projects 664s > 0.9 x "
                              "EVAL_MAX_SECONDS=600; the sliding pass scores")


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
