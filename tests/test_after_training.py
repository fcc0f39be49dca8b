"""A run whose training finished always leaves result.json (issue 9, defect 3), CUDA out-of-memory
stops with the knob that lowers memory, and the eval stride is planned before training."""

import re
import subprocess
import sys

import pytest
import torch

import train_gpt
import trainer.evaluate as trainer_evaluate
import trainer.finish as trainer_finish
import shards.loader as trainer_loader
import model.gpt as trainer_model
from tests.test_train import REPO, TINY_ENV, one_thread, read_result, run_trainer, trainer_env  # noqa: F401 (fixture)
from trainer.context import RunContext
from trainer.evaluate import plan_eval_stride
from model.gpt import build_model_config
from primitives.settings import Hyperparameters


@pytest.mark.slow
def test_eval_overrun_after_training_leaves_result_json_and_the_next_command(tiny_dataset, sp1024_model, tmp_path):
    """Defect 3: the sliding eval's time guard trips after training; before the fix main() exited 2
    with no result.json. The suggested command then scores the artifact."""
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="overrun", EVAL_MAX_SECONDS="0.05")
    proc = run_trainer(env, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = read_result(tmp_path, "overrun")
    assert result["status"] == "eval_over_time"
    assert re.fullmatch(r"EvalTimeError: eval_sliding: projected [\d.]+s at stride 32 \(127 windows, .*\), 0.0s left of "
                        r"EVAL_MAX_SECONDS: raise EVAL_STRIDE or set EVAL_AUTO_STRIDE=1", result["error"]), result["error"]
    assert result["steps"] == 8 and len(result["train_losses"]) == 8
    for key in ("val_bpb_prequant", "val_bpb_roundtrip", "bytes_total", "bytes_model"):
        assert key in result, key
    assert "val_bpb_sliding" not in result and result["compliance"]["eval_time_ok"] is False
    artifact = tmp_path / "overrun" / "final_model.ptz"
    assert result["artifact_path"] == str(artifact) and artifact.stat().st_size == result["bytes_model"]
    command = re.search(r"^next: (python -m eval score .*)$", proc.stdout, re.M).group(1)
    assert f"--artifact {artifact}" in command and "--stride 32" in command and "--seq-len 64" in command
    args = command.split()[1:]  # drop "python"
    score = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**env, "EVAL_MAX_SECONDS": "600"})
    assert score.returncode == 0, score.stderr[-2000:]
    m = re.search(r"final_roundtrip_exact val_loss:\S+ val_bpb:(\S+)", score.stdout)
    assert float(m.group(1)) == pytest.approx(result["val_bpb_roundtrip"], abs=1e-7)
    assert "final_sliding_window_exact" in score.stdout and "stride:32" in score.stdout


def run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, out_dir, run_id, **extra):
    for key, value in trainer_env(tiny_dataset, sp1024_model, out_dir, RUN_ID=run_id, ITERATIONS=4, **extra).items():
        if key in TINY_ENV or key in ("DATA_PATH", "TOKENIZER_PATH", "OUT_DIR", "RUN_ID", "ITERATIONS", *extra):
            monkeypatch.setenv(key, value)
    return train_gpt.main()


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.slow
def test_out_of_memory_in_the_final_eval_names_the_knob_and_keeps_result_json(
        monkeypatch, tiny_dataset, sp1024_model, tmp_path, capsys):
    monkeypatch.setattr(trainer_evaluate, "eval_sliding", out_of_memory)
    assert run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, tmp_path, "oom_eval") == 1
    out = capsys.readouterr().out
    assert "ERROR: CUDA out of memory after training: lower EVAL_BATCH_SEQS=16 (sliding) or VAL_BATCH_SIZE=4096" in out
    assert "next: python -m eval score" in out
    result = read_result(tmp_path, "oom_eval")
    assert result["status"] == "oom" and result["steps"] == 4 and "val_bpb_roundtrip" in result


@pytest.mark.slow
def test_out_of_memory_in_training_names_grad_accum_steps(monkeypatch, tiny_dataset, sp1024_model, tmp_path, capsys):
    calls = []

    def next_batch(self, local_tokens, seq_len):
        calls.append(1)
        if len(calls) == 3:
            out_of_memory()
        return original(self, local_tokens, seq_len)

    original = trainer_loader.DistributedTokenLoader.next_batch
    monkeypatch.setattr(trainer_loader.DistributedTokenLoader, "next_batch", next_batch)
    assert run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, tmp_path, "oom_train") == 1
    out = capsys.readouterr().out
    assert ("ERROR: CUDA out of memory in training: raise GRAD_ACCUM_STEPS (now 1: micro-batches of 16 sequences)"
            in out)
    assert read_result(tmp_path, "oom_train")["status"] == "oom"


def test_eval_stride_plan_picks_the_smallest_stride_that_fits(tmp_path):
    hp = Hyperparameters(num_layers=1, model_dim=32, num_heads=2, num_kv_heads=1, rope_dims=8, xsa_last_n=0,
                         train_seq_len=64, eval_stride=16, eval_batch_seqs=4, vocab_size=128)
    lines = []
    ctx = RunContext(0, 1, 0, torch.device("cpu"), tmp_path)
    ctx.log = lambda msg="", console=True: lines.append(msg)
    config = build_model_config(hp)
    plenty = Hyperparameters(**{**hp.__dict__, "eval_max_seconds": 1e9})
    assert plan_eval_stride(ctx, config, plenty, 10_000_001) == 16
    tight = Hyperparameters(**{**hp.__dict__, "eval_max_seconds": 1e-6})
    assert plan_eval_stride(ctx, config, tight, 10_000_001) == 64  # nothing fits: one window per sequence
    m = re.fullmatch(r"eval_plan: [\d.]+ms per batch of 4 x 64, 10000000 val targets: projected (\d+)s at "
                     r"EVAL_STRIDE=16, (\d+)s at stride 64 \(EVAL_MAX_SECONDS=1e-06\)", lines[-1])
    assert m, lines[-1]
    # projection = seconds per batch x windows / batch: roundtrip windows (156,250) + sliding windows
    # (stride 16: 624,997; stride 64: 156,250), so the two projections stand in the ratio of windows
    ratio = int(m.group(1)) / int(m.group(2))
    assert ratio == pytest.approx((156_250 + 624_997) / (2 * 156_250), rel=0.02)


@pytest.mark.slow
def test_eval_auto_stride_recovers_in_the_trainer_within_what_load_and_roundtrip_left(
        monkeypatch, tiny_dataset, sp1024_model, tmp_path, capsys, one_thread):  # noqa: F811 (fixture)
    """EVAL_AUTO_STRIDE=1 through main(): the final sliding eval trips at EVAL_STRIDE=8 and restarts
    at the smallest stride that fits what loading the artifact (+0.3 s injected) and the roundtrip
    (+0.2 s) left of EVAL_MAX_SECONDS; result.json is status ok with that stride. The sliding eval
    runs on a per-batch clock (100 s a batch), so the stride is exact on a loaded machine."""
    import time

    from test_eval_support import BatchClock, expected_auto_stride

    clock, budgets = BatchClock(100.0), []
    load, roundtrip, sliding = trainer_finish.load_artifact, trainer_evaluate.eval_roundtrip, trainer_evaluate.eval_sliding

    def slow_load(*args, **kwargs):
        time.sleep(0.3)
        return load(*args, **kwargs)

    def slow_roundtrip(*args, **kwargs):
        time.sleep(0.2)
        return roundtrip(*args, **kwargs)

    def spy(*args, **kwargs):
        budgets.append((kwargs["max_seconds"], time.perf_counter()))
        return sliding(*args, clock=clock, **kwargs)

    monkeypatch.setattr(trainer_finish, "load_artifact", slow_load)
    monkeypatch.setattr(trainer_evaluate, "eval_roundtrip", slow_roundtrip)
    monkeypatch.setattr(trainer_evaluate, "eval_sliding", spy)
    monkeypatch.setattr(trainer_model.GPT, "head_logits", clock.wrap(trainer_model.GPT.head_logits))  # once per scoring batch
    t0 = time.perf_counter()
    assert run_main_in_process(monkeypatch, tiny_dataset, sp1024_model, tmp_path, "auto", EVAL_AUTO_STRIDE=1,
                               EVAL_STRIDE=8, EVAL_MAX_SECONDS=1950) == 0
    out = capsys.readouterr().out
    result = read_result(tmp_path, "auto")
    # planned before training on the real speed: stride 8 fits 1950 s easily, so the eval starts at 8
    assert re.search(r"^eval_plan: .* at stride 8 \(EVAL_MAX_SECONDS=1950\)$", out, re.M), out
    (budget, started), = budgets
    assert 1950 - (started - t0) <= budget <= 1950 - 0.5  # load + roundtrip deducted, training not
    stride = expected_auto_stride(4096, 64, 8, 16, budget, 100.0)
    assert 8 < stride < 64
    assert f"eval_sliding: stride 8 -> {stride}" in out
    assert result["status"] == "ok" and result["eval_stride"] == stride and f"stride:{stride} " in out
    assert result["compliance"]["eval_time_ok"] is True and result["val_tokens"] == 4097


def test_the_next_command_after_a_ttt_overrun_scores_at_the_plans_stride(tmp_path):
    """A TTT eval that overruns after the plan coarsened the stride (EVAL_AUTO_STRIDE): `next:` names the plan's
    stride (what the artifact records), not EVAL_STRIDE, so the command repeats the run's eval."""
    from eval.plan import EvalPlan
    from eval.sliding import EvalTimeError

    hp = Hyperparameters(run_id="x", ttt_enabled=True, ttt_mode="lora", ttt_epochs=3)
    lines = []
    ctx = RunContext(0, 1, 0, torch.device("cpu"), tmp_path)
    ctx.log = lambda msg="", console=True: lines.append(msg)
    artifact = tmp_path / "final_model.ptz"
    artifact.write_bytes(b"x")
    status = trainer_finish.after_training_error(ctx, hp, EvalTimeError("over", 0), artifact,
                                                 EvalPlan(stride=256, epochs=1, mode="lora"))
    assert status == "eval_over_time"
    assert re.search(r"^next: python -m eval score .* --stride 256 .*--ttt 1 --ttt-epochs 1 .*--ttt-mode lora", lines[-1])
    trainer_finish.after_training_error(ctx, hp, EvalTimeError("over", 0), artifact, EvalPlan(stride=hp.eval_stride, epochs=1))
    assert " --stride 64 " in lines[-1]  # no plan stride given: EVAL_STRIDE, as before
