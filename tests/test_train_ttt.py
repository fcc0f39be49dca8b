"""Score-first TTT in the trainer's final eval (issue 24): planned before training, the same score as
`python -m eval score --ttt 1` on the saved artifact, skipped with a log line when it cannot fit, and
an overrun keeps the roundtrip score."""

import re
import subprocess
import sys

import pytest
import torch

import trainer.sgd_timing as sgd_timing
import trainer.ttt_eval as trainer_ttt
import model.gpt as trainer_model
from tests.test_after_training import run_main_in_process
from tests.test_train import REPO, one_thread, read_result, run_to_done, run_trainer, trainer_env  # noqa: F401 (fixture)
from eval.plan import EvalPlan
from trainer.context import RunContext
from trainer.evaluate import plan_final_eval
from trainer.finish import score_command
from model.gpt import build_model_config
from primitives.settings import Hyperparameters

# 4096 val targets in chunks of >= 1024 (whole documents): 16 sequences of 64 per chunk, batches of 8
TTT_ENV = dict(TTT_ENABLED=1, TTT_EPOCHS=2, TTT_CHUNK_TOKENS=1024, TTT_BATCH_SEQS=8, TTT_LR=0.01)


@pytest.mark.slow
def test_trainer_ttt_is_the_eval_cli_score_of_the_saved_artifact(tiny_dataset, sp1024_model, tmp_path):
    env, proc, result = run_to_done(tiny_dataset, sp1024_model, tmp_path, "ttt", **TTT_ENV)
    assert "val_bpb_sliding" not in result and "final_sliding_window_exact" not in proc.stdout
    assert result["ttt_epochs"] == 2 and result["eval_stride"] == 32 and result["val_tokens"] == 4097
    assert result["ttt_updates"] > 0 and result["ttt_updates_stopped_at_chunk"] is None
    assert set(result["phase_seconds"]) == {"prequant_eval", "export", "load", "roundtrip", "ttt"}
    assert re.search(r"^ttt_plan: [\d.]+ms per forward batch of 16x64, [\d.]+ms per TTT step, 4096 val targets: "
                     r"stride 32 epochs 2 projected \d+s with the roundtrip \(EVAL_MAX_SECONDS=600\)$", proc.stdout, re.M)
    m = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) eval_time:\d+ms stride:32 chunks:(\d+) updates:(\d+)$",
                  proc.stdout, re.M)
    assert m and float(m.group(2)) == pytest.approx(result["val_bpb_ttt"], abs=1e-8)
    assert int(m.group(4)) == result["ttt_updates"] and int(m.group(3)) >= 2
    # the same score from the eval CLI on the artifact, with the command the run gives for it
    hp = Hyperparameters.from_env(env, log=lambda *_: None)
    command = score_command(hp, tmp_path / "ttt" / "final_model.ptz", EvalPlan(stride=result["eval_stride"],
                                                                                   epochs=result["ttt_epochs"]))
    assert "--ttt 1 --ttt-epochs 2 --ttt-chunk-tokens 1024 --ttt-lr 0.01 " in command
    cli_env = {k: v for k, v in env.items() if not k.startswith("TTT_")}  # the flags alone say it
    score = subprocess.run([sys.executable, *command.split()[1:]], cwd=REPO, capture_output=True, text=True,
                           timeout=300, env=cli_env)
    assert score.returncode == 0, score.stderr[-2000:]
    cli = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) .* updates:(\d+)$", score.stdout, re.M)
    assert cli, score.stdout[-2000:]
    assert float(cli.group(2)) == pytest.approx(result["val_bpb_ttt"], abs=1e-7)
    assert float(cli.group(1)) == pytest.approx(result["val_loss_ttt"], abs=1e-7)
    assert int(cli.group(3)) == result["ttt_updates"]
    # the adaptation changed the score: with TTT_EPOCHS=0 the CLI gives the plain sliding score
    plain = subprocess.run([sys.executable, *command.replace("--ttt-epochs 2", "--ttt-epochs 0").split()[1:]], cwd=REPO,
                           capture_output=True, text=True, timeout=300, env=cli_env)
    sliding = float(re.search(r"^final_ttt_exact val_loss:\S+ val_bpb:(\S+)", plain.stdout, re.M).group(1))
    assert abs(sliding - result["val_bpb_ttt"]) > 1e-5


def plan_with(monkeypatch, tmp_path, forward_seconds, step_seconds, **settings):
    settings.setdefault("eval_auto_stride", False)
    hp = Hyperparameters(num_layers=1, model_dim=32, num_heads=2, num_kv_heads=1, rope_dims=8, xsa_last_n=0,
                         train_seq_len=64, eval_stride=16, eval_batch_seqs=4, vocab_size=128, ttt_enabled=True,
                         ttt_chunk_tokens=4096, ttt_batch_seqs=32, **settings)
    lines = []
    ctx = RunContext(0, 1, 0, torch.device("cpu"), tmp_path)
    ctx.log = lambda msg="", console=True: lines.append(msg)
    monkeypatch.setattr(trainer_ttt, "time_eval_forward", lambda *a: forward_seconds)
    monkeypatch.setattr(sgd_timing, "time_ttt_step", lambda *a: step_seconds)
    return plan_entries(plan_final_eval(ctx, build_model_config(hp), hp, 1_000_001)), lines


def plan_entries(plan) -> dict:
    """The plan's stride, TTT epochs and (a mode with phases) phases as the entries the tests compare."""
    return dict(stride=plan.stride, ttt_epochs=plan.epochs, **({"ttt_phases": plan.phases} if plan.phases else {}))


def test_the_plan_keeps_cuts_or_skips_ttt_and_says_so(monkeypatch, tmp_path):
    """1,000,000 targets, stride 16, batches of 4: 62,497 sliding + 15,625 roundtrip windows; 245 chunks of
    4096 (64 sequences, batches of 32: 2 steps per epoch), 244 of them trained on."""
    fwd = 1e-3  # roundtrip 3.9 s, scoring at stride 16: 245 x ceil(253 / 4) batches = 15,680 -> 15.7 s
    plan, lines = plan_with(monkeypatch, tmp_path, fwd, 0.1, ttt_epochs=3, eval_max_seconds=600)
    assert plan == dict(stride=16, ttt_epochs=3)  # 3 x 488 steps x 0.1 s = 146 s
    assert re.fullmatch(r"ttt_plan: 1.0ms per forward batch of 4x64, 100.0ms per TTT step, 1000000 val targets: "
                        r"stride 16 epochs 3 projected 166s with the roundtrip \(EVAL_MAX_SECONDS=600\)", lines[-1])
    plan, lines = plan_with(monkeypatch, tmp_path, fwd, 0.5, ttt_epochs=3, eval_max_seconds=600)
    assert plan == dict(stride=16, ttt_epochs=2)  # 3 epochs: 732 s; 2: 488 s + 19.6 s <= 540 s
    assert lines[-1].endswith("; TTT_EPOCHS=3 does not fit: 2")
    plan, lines = plan_with(monkeypatch, tmp_path, fwd, 2.0, ttt_epochs=3, eval_max_seconds=600)
    assert plan == dict(stride=16, ttt_epochs=0)  # 1 epoch: 976 s; the sliding pass alone fits
    assert "TTT skipped: 1 epoch at stride 16 projects" in lines[-1]
    # with EVAL_AUTO_STRIDE the plan may also coarsen the stride to keep the epochs
    plan, _ = plan_with(monkeypatch, tmp_path, 0.02, 0.25, ttt_epochs=2, eval_max_seconds=600, eval_auto_stride=True)
    # stride 16: 78 s roundtrip + 314 s scoring + 244 s updates > 540 s; stride 24: 245 x 43 batches x 0.02 s = 211 s
    assert plan == dict(stride=24, ttt_epochs=2)


def test_ttt_off_plans_the_stride_as_before(monkeypatch, tmp_path):
    plan, lines = plan_with(monkeypatch, tmp_path, 1e-3, 0.1, ttt_epochs=0, eval_auto_stride=False)
    assert plan == dict(stride=16, ttt_epochs=0) and lines == []


@pytest.mark.slow
def test_a_ttt_overrun_keeps_the_roundtrip_and_names_the_ttt_command(
        monkeypatch, tiny_dataset, sp1024_model, tmp_path, capsys, one_thread):  # noqa: F811 (fixture)
    """The plan kept TTT (timings injected as tiny), then the real eval runs on a clock of 100 s per
    scoring batch: scoring alone cannot fit EVAL_MAX_SECONDS, the run stops with eval_over_time and
    keeps the roundtrip score; the next command scores the artifact with the run's TTT settings."""
    from test_eval_support import BatchClock

    clock = BatchClock(100.0)
    run_mode = trainer_ttt.run_mode
    monkeypatch.setattr(trainer_ttt, "time_eval_forward", lambda *a: 1e-6)
    monkeypatch.setattr(sgd_timing, "time_ttt_step", lambda *a: 1e-6)
    monkeypatch.setattr(trainer_ttt, "run_mode", lambda *a, **k: run_mode(*a, clock=clock, **k))
    monkeypatch.setattr(trainer_model.GPT, "head_logits", clock.wrap(trainer_model.GPT.head_logits))  # once per scoring batch
    assert run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, tmp_path, "over", EVAL_MAX_SECONDS=900,
                               **TTT_ENV) == 1
    out = capsys.readouterr().out
    result = read_result(tmp_path, "over")
    assert result["status"] == "eval_over_time" and result["phase"] == "ttt"
    assert "val_bpb_roundtrip" in result and "val_bpb_ttt" not in result and "val_bpb_sliding" not in result
    assert re.search(r"EvalTimeError: run_ttt: projected \d+\.\ds for scoring alone after chunk 1/\d", result["error"])
    assert re.search(r"^next: python -m eval score .* --stride 32 .*--ttt 1 --ttt-epochs 2 ", out, re.M), out


@pytest.mark.slow
def test_eval_score_ttt_with_no_flags_is_the_runs_score(tiny_dataset, sp1024_model, tmp_path):
    """The artifact records the TTT settings the run scored with: `python -m eval score --artifact A --ttt 1`
    with no other setting (no TTT_* flag or variable) gives the run's logged TTT score exactly, and says so.
    Before the settings were recorded it scored with the CLI defaults (chunks of 32,768: one chunk, 0
    updates) and printed another number."""
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="ttt", VAL_MAX_TOKENS=0, TTT_ENABLED=1,
                      TTT_CHUNK_TOKENS=2048, TTT_EPOCHS=1, TTT_LR=0.01)
    proc = run_trainer(env)
    result = read_result(tmp_path, "ttt")
    logged = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) .* updates:(\d+)$", proc.stdout, re.M)
    assert result["status"] == "ok" and result["ttt_epochs"] == 1 and result["ttt_updates"] > 0 and logged
    artifact = tmp_path / "ttt" / "final_model.ptz"
    cli_env = {k: v for k, v in env.items() if not k.startswith(("TTT_", "EVAL_", "VAL_"))}
    score = subprocess.run([sys.executable, "-m", "eval", "score", "--artifact", str(artifact), "--data-path",
                            str(tiny_dataset), "--tokenizer", str(sp1024_model), "--ttt", "1"], cwd=REPO,
                           capture_output=True, text=True, timeout=300, env=cli_env)
    assert score.returncode == 0, score.stderr[-2000:]
    assert ("ttt settings: from the artifact TTT_EPOCHS=1 TTT_CHUNK_TOKENS=2048 TTT_LR=0.01 TTT_MOMENTUM=0.9 "
            "TTT_GRAD_CLIP=1.0 TTT_BATCH_SEQS=32 TTT_PARAMS=all EVAL_BATCH_SEQS=16 TTT_MODE=chunked; from flags none\n") in score.stdout
    cli = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) .* updates:(\d+)$", score.stdout, re.M)
    assert cli and cli.groups() == logged.groups(), score.stdout[-2000:]  # the same 8-decimal strings
    # result.json's command is the exact one: the same numbers, whatever the environment says
    command = result["score_command"]
    assert command.startswith(f"python -m eval score --artifact {artifact} ") and " --ttt 1 --ttt-epochs 1 " in command
    noisy = dict(cli_env, TTT_EPOCHS="3", TTT_CHUNK_TOKENS="32768", EVAL_BATCH_SEQS="7", VAL_MAX_TOKENS="100")
    again = subprocess.run([sys.executable, *command.split()[1:]], cwd=REPO, capture_output=True, text=True,
                           timeout=300, env=noisy)
    assert again.returncode == 0, again.stderr[-2000:]
    assert re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) .* updates:(\d+)$", again.stdout,
                     re.M).groups() == logged.groups()
    # a flag overrides the artifact, and the line says which came from where
    flagged = subprocess.run([sys.executable, "-m", "eval", "score", "--artifact", str(artifact), "--data-path",
                              str(tiny_dataset), "--tokenizer", str(sp1024_model), "--ttt", "1", "--ttt-epochs", "0",
                              "--stride", "0"], cwd=REPO, capture_output=True, text=True, timeout=300, env=cli_env)
    assert "; from flags TTT_EPOCHS=0\n" in flagged.stdout and "TTT_CHUNK_TOKENS=2048" in flagged.stdout


def test_one_chunk_of_val_plans_no_ttt_epochs_and_says_why(monkeypatch, tmp_path):
    """4,096 targets in chunks of 4,096: one chunk, the last, never trained on. The plan said `epochs 3` and
    the run reported 3 epochs with 0 updates; now it plans 0 and says why."""
    from eval.ttt import plan_ttt

    hp = Hyperparameters(num_layers=1, model_dim=32, num_heads=2, num_kv_heads=1, rope_dims=8, xsa_last_n=0,
                         train_seq_len=64, eval_stride=16, eval_batch_seqs=4, vocab_size=128, ttt_enabled=True,
                         ttt_chunk_tokens=4096, ttt_batch_seqs=32, ttt_epochs=3, eval_auto_stride=False)
    lines = []
    ctx = RunContext(0, 1, 0, torch.device("cpu"), tmp_path)
    ctx.log = lambda msg="", console=True: lines.append(msg)
    monkeypatch.setattr(trainer_ttt, "time_eval_forward", lambda *a: 1e-4)
    monkeypatch.setattr(sgd_timing, "time_ttt_step", lambda *a: 1e-4)
    assert plan_entries(plan_final_eval(ctx, build_model_config(hp), hp, 4097)) == dict(stride=16, ttt_epochs=0)
    assert re.search(r" stride 16 epochs 0 projected \d+s with the roundtrip \(EVAL_MAX_SECONDS=600\); TTT skipped: the "
                     r"4096 val targets are one chunk of TTT_CHUNK_TOKENS=4096, the last one, which score-first TTT never "
                     r"trains on: 0 updates \(the score is the sliding one\)$", lines[-1]), lines[-1]
    # one target more: two chunks (if documents allow), and the epochs are kept
    assert plan_entries(plan_final_eval(ctx, build_model_config(hp), hp, 4098)) == dict(stride=16, ttt_epochs=3)
    common = dict(forward_seconds=1e-4, train_seconds=1e-4, seq_len=64, strides=[16], chunk_tokens=4096,
                  eval_batch_seqs=4, batch_seqs=32, max_seconds=600)
    assert plan_ttt(num_val_tokens=100, epochs=0, **common)["reason"] is None  # TTT off: no reason to give


@pytest.mark.slow
def test_a_one_chunk_ttt_run_reports_what_happened(tiny_dataset, sp1024_model, tmp_path):
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="one", TTT_ENABLED=1, TTT_CHUNK_TOKENS=4096)
    proc = run_trainer(env)  # VAL_MAX_TOKENS=4096: 4096 targets
    result = read_result(tmp_path, "one")
    assert re.search(r"^ttt_plan: .* epochs 0 .*; TTT skipped: the 4096 val targets are one chunk", proc.stdout, re.M)
    assert result["status"] == "ok" and result["ttt_epochs"] == 0 and result["ttt_updates"] == 0
    assert "val_bpb_sliding" in result and "val_bpb_ttt" not in result
    assert " --ttt 0" in result["score_command"]


def test_a_score_whose_updates_the_time_guard_stopped_is_not_claimed_reproducible():
    """The stop chunk depends on the machine's speed at that moment: result.json must not present
    score_command as reproducing that score."""
    from trainer.finish import ttt_score_command_caveat

    assert ttt_score_command_caveat({"updates_stopped_at_chunk": None, "num_chunks": 5}) is None
    why = ttt_score_command_caveat({"updates_stopped_at_chunk": 3, "num_chunks": 5})
    assert "chunk 3 of 5" in why and why.endswith("(unverified)")
