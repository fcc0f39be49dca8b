"""Progress of the long phases (primitives/progress.py): done/total and an ETA on stderr at a tiny size
(the line interval set to 0), nothing through the `log` callbacks that write the parsed train.log,
and nothing from a rank other than 0."""

import re

import pytest
import torch

import primitives.progress as progress
from eval.bpb import build_sentencepiece_luts
from eval.sliding import count_sliding_windows, eval_sliding
from quant.artifact import export_artifact
from quant.policy import QuantPolicy
from test_eval_support import TinyCausalLM, load_sp, mixed_stream
from test_eval_ttt import TTTLM, run_ttt
from test_quant_artifact import CONFIG, _state

LINE = r"{label}: (\d+)/(\d+) {unit} \((\d+)%\) \d+s elapsed, ETA (\d+|nan)s"


@pytest.fixture
def every_update(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_EVERY_SECONDS", 0.0)
    monkeypatch.delenv("RANK", raising=False)


def _lines(err: str, label: str, unit: str) -> list:
    return [tuple(int(g) for g in m.groups()[:3]) for m in re.finditer(LINE.format(label=re.escape(label), unit=unit), err)]


def test_a_terminal_is_rewritten_at_most_twice_a_second_and_closes_on_the_total(monkeypatch, capsys):
    """update() runs once per eval window batch: on a terminal it may not print (and flush) each time."""
    monkeypatch.delenv("RANK", raising=False)
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    bar = progress.Progress("phase", 1000, "batches")
    bar.tty = True
    for _ in range(1000):
        clock[0] += 0.001  # 1 ms a batch: 1 s in all
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    shown = _lines(err, "phase", "batches")
    assert len(shown) == 3 and shown[-1] == (1000, 1000, 100)  # at 0.5 s, 1.0 s and the close


@pytest.fixture(scope="module")
def sp_luts():
    sp = load_sp(1024)
    return mixed_stream(sp, 2000), build_sentencepiece_luts(sp, 1024)


def test_a_line_per_update_counts_to_the_total_with_an_eta(every_update, capsys):
    bar = progress.Progress("phase", 3, "things")
    for _ in range(3):
        bar.update()
    bar.close()
    err = capsys.readouterr().err
    assert _lines(err, "phase", "things") == [(1, 3, 33), (2, 3, 67), (3, 3, 100)]
    assert err.count("\n") == 3 and "\r" not in err  # not a terminal: whole lines, no bar


def test_quiet_between_intervals_but_the_final_count_is_shown(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(progress, "PROGRESS_EVERY_SECONDS", 3600.0)
    bar = progress.Progress("phase", 5, "things")
    for _ in range(5):
        bar.update()
    bar.close()
    assert capsys.readouterr().err == ""  # a phase shorter than the interval says nothing
    bar = progress.Progress("phase", 5, "things")
    bar.last -= 7200  # as if the interval had passed before the first update
    for _ in range(5):
        bar.update()
    bar.close()
    assert _lines(capsys.readouterr().err, "phase", "things") == [(1, 5, 20), (5, 5, 100)]


def test_other_ranks_say_nothing(every_update, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    bar = progress.Progress("phase", 2, "things")
    bar.update(2)
    bar.close()
    assert capsys.readouterr().err == ""


def test_export_reports_each_tensor_and_keeps_it_out_of_the_log(every_update, tmp_path, capsys):
    logged = []
    state = _state()
    export_artifact(state, CONFIG, tmp_path / "a.ptz", code_bytes=0, policy=QuantPolicy(compressor="zlib"),
                    log=logged.append)
    err = capsys.readouterr().err
    counts = _lines(err, "quant export", "tensors")
    assert [c[0] for c in counts] == list(range(1, len(state) + 1)) and {c[1] for c in counts} == {len(state)}
    compressing = _lines(err, "quant export: compressing", "candidates")
    assert compressing and compressing[-1][0] == compressing[-1][1] > 1  # every packing x compressor candidate
    assert logged and not [m for m in logged if "tensors" in m or "ETA" in m]


def test_sliding_eval_reports_each_window_batch(every_update, sp_luts, capsys):
    tokens, luts = sp_luts
    logged = []
    eval_sliding(TinyCausalLM(), tokens[:300], luts, seq_len=32, stride=8, batch_seqs=4, device="cpu",
                 log=logged.append)
    batches = -(-count_sliding_windows(299, 32, 8) // 4)
    assert _lines(capsys.readouterr().err, "eval_sliding stride 8", "window batches") == [
        (i, batches, round(100 * i / batches)) for i in range(1, batches + 1)]
    assert not [m for m in logged if "ETA" in m]


def test_ttt_eval_reports_each_window_batch(every_update, sp_luts, capsys):
    tokens, luts = sp_luts
    run_ttt(TTTLM(seed=2), tokens[:1200], luts, seq_len=32, stride=16, chunk_tokens=300, epochs=1, lr=0.1,
            batch_seqs=4, eval_batch_seqs=8, device="cpu", log=lambda msg: None)
    counts = _lines(capsys.readouterr().err, "ttt stride 16", "window batches")
    total = counts[-1][1]
    assert [c[0] for c in counts] == list(range(1, total + 1)) and total >= 3


def test_the_plan_timings_report_their_calls(every_update, capsys):
    from trainer.timing import seconds_per_call

    class Ctx:
        def sync(self):
            pass

    seconds_per_call(Ctx(), lambda: torch.zeros(1), repeats=2, label="ttt plan: timing a TTT step")
    assert _lines(capsys.readouterr().err, "ttt plan: timing a TTT step", "calls") == [(1, 3, 33), (2, 3, 67),
                                                                                       (3, 3, 100)]
