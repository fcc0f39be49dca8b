"""Per-document LoRA TTT (TTT_MODE=lora) in the trainer's final eval: planned before training (timed, in
the log), recorded in the artifact, and the same score as `python -m eval score --ttt 1` on the saved
artifact; the settings' checks."""

import re
import subprocess
import sys

import pytest

from eval.plan import EvalPlan
from quant.artifact import load_artifact
from tests.test_train import REPO, one_thread, read_result, run_to_done, trainer_env  # noqa: F401 (fixture)
from tests.test_train_ttt import plan_with
from trainer.finish import score_command
from primitives.settings import Hyperparameters
from test_eval_support import assert_cli_scores_as_the_trainer

LORA_ENV = dict(TTT_ENABLED=1, TTT_MODE="lora", TTT_EPOCHS=1, TTT_LORA_RANK=4, TTT_LORA_LR=0.02,
                TTT_LORA_CHUNK_TOKENS=32, TTT_LORA_BATCH_DOCS=4)


@pytest.mark.slow
def test_trainer_lora_ttt_is_the_eval_cli_score_of_the_saved_artifact(tiny_dataset, sp1024_model, tmp_path):
    env, proc, result = run_to_done(tiny_dataset, sp1024_model, tmp_path, "lora", **LORA_ENV)
    assert result["ttt_mode"] == "lora" and result["ttt_lora_rank"] == 4 and result["ttt_epochs"] == 1
    assert result["ttt_lora_batch_docs"] == 4 and 0 < result["ttt_rounds"] < result["ttt_chunks"]
    assert result["ttt_updates"] > 0 and result["ttt_updates_stopped_at_chunk"] is None
    assert result["ttt_updates"] == result["ttt_chunks"] - result["ttt_documents"]  # all but each document's last
    assert re.search(r"^ttt_plan: TTT_MODE=lora \S+ms per scoring forward, \S+ms per adapter step, 4096 val targets: "
                     r"\d+ chunks, \d+ documents, \d+ rounds, \d+ update_rounds, \d+ forwards, \d+ windows: stride 32 "
                     r"epochs 1 projected \d+s with the roundtrip \(EVAL_MAX_SECONDS=600\)$", proc.stdout, re.M)
    m = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) eval_time:\d+ms stride:32 chunks:(\d+) updates:(\d+)$",
                  proc.stdout, re.M)
    assert m and float(m.group(2)) == pytest.approx(result["val_bpb_ttt"], abs=1e-8)
    artifact = tmp_path / "lora" / "final_model.ptz"
    recorded = load_artifact(artifact)[2]["run"]["ttt"]
    assert {k: recorded[k] for k in ("mode", "epochs", "lora_rank", "lora_lr", "lora_chunk_tokens", "lora_batch_docs")} == dict(
        mode="lora", epochs=1, lora_rank=4, lora_lr=0.02, lora_chunk_tokens=32, lora_batch_docs=4)
    # `python -m eval score --ttt 1`: every TTT setting from the artifact, none from flags or the environment
    hp = Hyperparameters.from_env(env, log=lambda *_: None)
    command = score_command(hp, artifact, EvalPlan(stride=result["eval_stride"], epochs=result["ttt_epochs"]))
    assert command.endswith(" --ttt-mode lora --ttt-lora-rank 4 --ttt-lora-lr 0.02 --ttt-lora-chunk-tokens 32 "
                            "--ttt-lora-batch-docs 4")
    assert_cli_scores_as_the_trainer(
        command, env, result, r"^ttt settings: from the artifact TTT_EPOCHS=1 .*TTT_MODE=lora TTT_LORA_RANK=4 "
        r"TTT_LORA_LR=0.02 TTT_LORA_CHUNK_TOKENS=32 TTT_LORA_BATCH_DOCS=4; from flags (none|EVAL_BATCH_SEQS=\d+)$",
        r"chunks:(\d+) updates:(\d+)")


@pytest.mark.slow
def test_a_coarser_lora_stride_is_the_one_the_artifact_scores_with(tiny_dataset, sp1024_model, tmp_path):
    """EVAL_AUTO_STRIDE with the plan's timings injected (the trainer run in a process that replaces the timing
    functions): scoring forwards slow enough that stride 16 cannot fit but 32 can. The chosen stride is in
    the ttt_plan line, the final_ttt line, result.json and the artifact, and `python -m eval score --ttt 1`
    without --stride scores the artifact at it to the same val_bpb."""
    from shards.format import load_validation_tokens
    from eval.ttt_plan import lora_work_at

    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="coarse", **LORA_ENV, EVAL_AUTO_STRIDE=1,
                      EVAL_STRIDE=16, EVAL_BATCH_SEQS=4)
    hp = Hyperparameters.from_env(env, log=lambda *_: None)
    val = load_validation_tokens(hp.data_path, vocab_size=hp.vocab_size)[:4097]
    work_at = lora_work_at(hp, len(val), 1, val)
    fine, coarse = work_at(16)["forwards"], work_at(32)["forwards"]
    assert coarse < fine
    forward_seconds = 540 / ((fine + coarse) / 2)  # 16 projects over 90% of 600 s, 32 under it
    patch = ("import runpy, sys, trainer.ttt_eval as e\n"
             "e.time_eval_forward = lambda *a: 1e-6\n"
             f"e.time_lora_ttt = lambda *a: ({forward_seconds!r}, 1e-6)\n"
             "sys.argv = ['train_gpt.py']\nrunpy.run_path('train_gpt.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", patch], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = read_result(tmp_path, "coarse")
    stride = result["eval_stride"]
    assert 16 < stride <= 32 and result["ttt_epochs"] == 1 and result["ttt_updates"] > 0
    assert re.search(rf"^ttt_plan: TTT_MODE=lora .*: stride {stride} epochs 1 projected \d+s with the roundtrip", proc.stdout, re.M)
    assert re.search(rf"^final_ttt_exact .* stride:{stride} chunks:", proc.stdout, re.M)
    artifact = tmp_path / "coarse" / "final_model.ptz"
    assert load_artifact(artifact)[2]["run"]["eval_stride"] == stride
    assert f" --stride {stride} " in result["score_command"]
    bare = result["score_command"].replace(f" --stride {stride} ", " ")
    bare = bare[:bare.index(" --ttt 1 ")] + " --ttt 1"
    cli_env = {k: v for k, v in env.items() if not k.startswith(("TTT_", "EVAL_"))}
    score = subprocess.run([sys.executable, *bare.split()[1:]], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=cli_env)
    assert score.returncode == 0, score.stderr[-2000:]
    cli = re.search(rf"^final_ttt_exact val_loss:\S+ val_bpb:(\S+) .* stride:{stride} chunks:", score.stdout, re.M)
    assert cli, score.stdout[-2000:]
    assert float(cli.group(1)) == pytest.approx(result["val_bpb_ttt"], abs=1e-7)


def test_the_lora_plan_keeps_cuts_or_skips_and_says_so(monkeypatch, tmp_path):
    """1,000,000 targets in 2,000 documents of 500 tokens, chunks of 64, 16 slots: 8 chunks per document, so 125
    waves of 16 documents, 8 rounds each (1,000 rounds; a wave's last round scores last chunks only: 875 with
    steps); a chunk spans 4 or 5 windows of stride 16 (its start mod 16), 19,624 forwards of 4 counted from the
    stream; roundtrip 3.9 s at 1 ms per forward batch (plan_with's)."""
    import torch
    import trainer.ttt_eval as trainer_ttt

    stream = torch.full((1_000_001,), 7)
    stream[:-1:500] = 1
    monkeypatch.setattr(trainer_ttt, "load_validation_tokens", lambda *a, **k: stream)
    common = dict(ttt_mode="lora", ttt_lora_chunk_tokens=64, ttt_epochs=2, ttt_lora_batch_docs=16)
    monkeypatch.setattr(trainer_ttt, "time_lora_ttt", lambda *a: (0.002, 0.01))
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 100.0, **common)  # the SGD step's timing plays no part
    assert plan == dict(stride=16, ttt_epochs=2)  # 19,624 x 2 ms + 2 x 875 x 10 ms + 3.9 s = 60.7 s
    assert lines[-1] == ("ttt_plan: TTT_MODE=lora 2.0ms per scoring forward, 10.0ms per adapter step, 1000000 val "
                         "targets: 16000 chunks, 2000 documents, 1000 rounds, 875 update_rounds, 19624 forwards, 4 "
                         "windows: stride 16 epochs 2 projected 61s with the roundtrip (EVAL_MAX_SECONDS=600)")
    monkeypatch.setattr(trainer_ttt, "time_lora_ttt", lambda *a: (0.002, 0.4))
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, **common)  # 2 epochs: 743 s; 1 epoch: 393 s
    assert plan == dict(stride=16, ttt_epochs=1) and lines[-1].endswith("; TTT_EPOCHS=2 -> 1")
    monkeypatch.setattr(trainer_ttt, "time_lora_ttt", lambda *a: (0.002, 0.8))
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, **common)
    assert plan == dict(stride=16, ttt_epochs=0)
    assert lines[-1].endswith("(EVAL_MAX_SECONDS=600); TTT skipped: 1 epoch of LoRA TTT projects 743s > 0.9 x "
                              "EVAL_MAX_SECONDS=600; the sliding pass scores")


def test_with_auto_stride_the_lora_plan_coarsens_the_stride_before_it_cuts_epochs(monkeypatch, tmp_path):
    """EVAL_AUTO_STRIDE as the chunked plan: strides 16, 17, ..., 64 recounted from the stream of the test above
    (forwards at 16, 19, 31, 32: 19,624, 17,624, 12,326, 11,875), the most epochs first, each at every stride.
    30 ms per forward: stride 16 scores alone in 589 s (skipped without auto stride); 2 epochs (175 s of steps)
    fit first at stride 32: 11,875 x 30 ms + 175 s + 3.9 s = 535 s. 20 ms: 1 epoch would fit at 16 (484 s), but
    2 epochs fit at 19 (352.5 + 175 + 3.9 = 531 s). No epoch fits (700 ms steps) with a slow eval forward (40 ms
    a batch: roundtrip 156 s): the sliding pass at the first stride whose pass fits, 27 (37,036 windows, 370 s; 26:
    38,461, 385 s)."""
    import torch
    import trainer.ttt_eval as trainer_ttt

    stream = torch.full((1_000_001,), 7)
    stream[:-1:500] = 1
    monkeypatch.setattr(trainer_ttt, "load_validation_tokens", lambda *a, **k: stream)
    common = dict(ttt_mode="lora", ttt_lora_chunk_tokens=64, ttt_epochs=2, ttt_lora_batch_docs=16)
    monkeypatch.setattr(trainer_ttt, "time_lora_ttt", lambda *a: (0.03, 0.1))
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, **common)
    assert plan == dict(stride=16, ttt_epochs=0)  # without EVAL_AUTO_STRIDE: as before
    assert lines[-1].endswith("; TTT skipped: 1 epoch of LoRA TTT projects 680s > 0.9 x EVAL_MAX_SECONDS=600; "
                              "the sliding pass scores")
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, eval_auto_stride=True, **common)
    assert plan == dict(stride=32, ttt_epochs=2)
    assert "2000 documents, 1000 rounds, 875 update_rounds, 11875 forwards, " in lines[-1]
    assert lines[-1].endswith(" windows: stride 32 epochs 2 projected 535s with the roundtrip (EVAL_MAX_SECONDS=600)")
    monkeypatch.setattr(trainer_ttt, "time_lora_ttt", lambda *a: (0.02, 0.1))
    plan, _ = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, **common)
    assert plan == dict(stride=16, ttt_epochs=1)
    plan, _ = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, eval_auto_stride=True, **common)
    assert plan == dict(stride=19, ttt_epochs=2)
    monkeypatch.setattr(trainer_ttt, "time_lora_ttt", lambda *a: (0.002, 0.7))
    plan, lines = plan_with(monkeypatch, tmp_path, 0.04, 0.1, eval_auto_stride=True, **common)
    assert plan == dict(stride=27, ttt_epochs=0)
    assert re.search(r" stride 27 epochs 0 projected 527s with the roundtrip \(EVAL_MAX_SECONDS=600\); TTT skipped: 1 "
                     r"epoch of LoRA TTT at stride 64 projects \d+s > 0.9 x EVAL_MAX_SECONDS=600; the sliding pass "
                     r"scores$", lines[-1])


def test_lora_settings_are_checked():
    base = {"RUN_ID": "x", "TTT_ENABLED": "1", "TTT_MODE": "lora", "TRAIN_SEQ_LEN": "64", "TTT_LORA_CHUNK_TOKENS": "64"}
    hp = Hyperparameters.from_env(base, log=lambda *_: None)
    assert (hp.ttt_mode, hp.ttt_lora_rank, hp.ttt_lora_lr, hp.ttt_lora_chunk_tokens, hp.ttt_lora_batch_docs) == (
        "lora", 8, 0.01, 64, 64)
    for bad, message in ((dict(TTT_LORA_CHUNK_TOKENS="65"), "TTT_LORA_CHUNK_TOKENS=65: expected <= TRAIN_SEQ_LEN=64"),
                         (dict(TTT_LORA_RANK="0"), "TTT_LORA_RANK=0: expected a whole number >= 1"),
                         (dict(TTT_LORA_BATCH_DOCS="0"), "TTT_LORA_BATCH_DOCS=0: expected a whole number >= 1"),
                         (dict(TTT_LORA_LR="-1"), "TTT_LORA_LR=-1.0: expected a finite number >= 0"),
                         (dict(TTT_MODE="adapter"), "TTT_MODE='adapter': expected one of chunked, phased, lora")):
        with pytest.raises(ValueError, match=re.escape(message)):
            Hyperparameters.from_env(dict(base, **bad), log=lambda *_: None)
    # the LoRA chunk only matters with TTT_MODE=lora: the default 256 does not refuse a short TRAIN_SEQ_LEN otherwise
    Hyperparameters.from_env(dict(base, TTT_MODE="chunked", TTT_CHUNK_TOKENS="64", TTT_LORA_CHUNK_TOKENS="256"),
                             log=lambda *_: None)


def test_a_stopped_lora_eval_names_the_round_in_its_caveat():
    from trainer.finish import ttt_score_command_caveat

    assert ttt_score_command_caveat(dict(updates_stopped_at_chunk=None, num_rounds=10, num_chunks=40)) is None
    assert ttt_score_command_caveat(dict(updates_stopped_at_chunk=3, num_rounds=10, num_chunks=40)) == (
        "the eval time guard stopped TTT updates at round 3 of 10: the score is legal, but score_command reproduces it "
        "only if its own run stops at the same round (unverified)")
    assert "at chunk 3 of 40:" in ttt_score_command_caveat(dict(updates_stopped_at_chunk=3, num_chunks=40))
