"""A non-finite number is never reported with status ok: result.json names the phase, `eval score` refuses it."""

import json
import math
import subprocess
import sys

import pytest
import torch

from eval.bpb import nonfinite_scores
from eval.offline import NonFiniteScoreError, require_finite_scores
from tests.test_train import REPO, read_result, run_trainer, trainer_env
from trainer.context import RunContext
from trainer.finish import write_result


def test_nonfinite_scores_name_the_pass_that_produced_them():
    summary = dict(status="ok", phase="done", val_bpb_prequant=1.5, val_bpb_roundtrip=1.6, val_loss_ttt=math.nan,
                   val_bpb_ttt=math.inf, train_seconds=3.0, steps=8)
    assert nonfinite_scores(summary) == {"val_loss_ttt": "ttt", "val_bpb_ttt": "ttt"}
    assert nonfinite_scores(dict(phase="export", export_seconds=math.nan)) == {"export_seconds": "export"}
    assert nonfinite_scores(dict(val_bpb_sliding=1.2)) == {}
    with pytest.raises(NonFiniteScoreError, match=r"^the sliding pass produced val_loss:1.0 val_bpb:nan"):
        require_finite_scores({"roundtrip": (1.0, 1.2), "sliding": (1.0, math.nan)})
    require_finite_scores({"roundtrip": (1.0, 1.2), "sliding": (1.0, 1.2)})


def test_eval_score_exits_1_on_a_nonfinite_score_like_the_trainer_and_2_only_for_bad_input(monkeypatch, capsys):
    # exit 2 is a bad input found before any work (docs/reliability.md); a score that came out NaN is the
    # run's result, as the trainer's nonfinite_<phase> (exit 1): eval score used to exit 2 for it
    import eval.__main__ as cli

    def nan_score(args):
        require_finite_scores({"roundtrip": (1.0, 1.2), "chunked TTT": (math.nan, math.nan)})

    monkeypatch.setattr(cli, "check_score_inputs", lambda args: None)
    monkeypatch.setattr(cli, "cmd_score", nan_score)
    argv = ["score", "--artifact", "a.ptz", "--data-path", "d", "--tokenizer", "t.model"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: the chunked TTT pass produced val_loss:nan val_bpb:nan; expected finite scores (a diverged "
                   "TTT, or weights that are not finite): no score is reported"], err
    monkeypatch.setattr(cli, "cmd_score", lambda args: (_ for _ in ()).throw(ValueError("--stride=-5: expected ...")))
    assert cli.main(argv) == 2 and capsys.readouterr().err == "error: --stride=-5: expected ...\n"


@pytest.mark.parametrize("key,status", [("val_bpb_ttt", "nonfinite_ttt"), ("val_loss_prequant", "nonfinite_prequant_eval"),
                                        ("val_bpb_sliding", "nonfinite_sliding"), (None, "ok")])
def test_write_result_never_writes_status_ok_with_a_nonfinite_number(tiny_dataset, tmp_path, key, status):
    ctx = RunContext(0, 1, 0, torch.device("cpu"), tmp_path)
    summary = dict(status="ok", phase="done", val_bpb_roundtrip=1.5, **({key: math.nan} if key else {}))
    assert write_result(ctx, summary, data_path=str(tiny_dataset), manifest=None, train_files=()) == status
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == status and result.get("nonfinite", []) == ([key] if key else [])
    # a failed run keeps its own status: the non-finite number is not what failed it
    failed = dict(status="failed_in_training", phase="train", val_bpb_roundtrip=math.nan)
    assert write_result(ctx, failed, data_path=str(tiny_dataset), manifest=None, train_files=()) == "failed_in_training"


@pytest.mark.slow
def test_a_diverged_ttt_is_status_nonfinite_ttt_and_eval_score_refuses_it_in_one_line(tiny_dataset, sp1024_model, tmp_path):
    # TTT_LR=1e30: the first SGD update makes the weights inf, every later chunk scores NaN (issue measured: status ok
    # with val_bpb_ttt NaN, and `eval score` printed val_bpb:nan with exit 0)
    env = trainer_env(tiny_dataset, sp1024_model, tmp_path, RUN_ID="nan", TTT_ENABLED=1, TTT_LR="1e30",
                      TTT_CHUNK_TOKENS=1024, TTT_EPOCHS=1, EVAL_AUTO_STRIDE=0)
    proc = run_trainer(env, check=False)
    result = read_result(tmp_path, "nan")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert result["status"] == "nonfinite_ttt" and "val_bpb_ttt" in result["nonfinite"], result
    assert math.isfinite(result["val_bpb_roundtrip"])
    assert "ERROR: " in proc.stdout and "status nonfinite_ttt" in proc.stdout
    cmd = [sys.executable, "-m", "eval", "score", "--artifact", str(tmp_path / "nan" / "final_model.ptz"), "--data-path",
           str(tiny_dataset), "--tokenizer", str(sp1024_model), "--val-max-tokens", "4096", "--ttt", "1", "--ttt-lr",
           "1e30", "--ttt-chunk-tokens", "1024", "--ttt-epochs", "1"]
    score = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = score.stderr.strip().splitlines()
    assert score.returncode == 1 and len(lines) == 1, score.stderr  # the trainer's code for the same result
    assert lines[0].startswith("error: the chunked TTT pass produced val_loss:nan"), lines[0]
    assert "final_ttt_exact" not in score.stdout and "nan" not in score.stdout, score.stdout  # no score line at all
