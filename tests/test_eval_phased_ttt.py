"""Phased score-first TTT (eval/phased_ttt.py): phase boundaries, equivalence with the sliding eval,
legality (and illegal variants the check refuses), the planner, and the CLI flags."""

import dataclasses
import functools

import pytest
import torch

from eval.phased_ttt import plan_phased_ttt, project_phased_seconds
from eval.sgd_modes import split_phases
from eval.ttt_modes import TTT_MODES, run_mode
from eval.sliding import eval_sliding
from eval.walk import check_ttt_legality
from test_eval_support import load_sp, mixed_stream
from test_eval_ttt import QUIET, TTTLM, run_ttt

run_phased_ttt = functools.partial(run_mode, "phased", epochs=1)


@pytest.fixture(scope="module")
def stream():
    return mixed_stream(load_sp(1024), 3000)  # documents of <= 121 tokens, every other one the same text


def test_phases_hold_whole_documents(stream):
    n = len(stream) - 1
    for phases in (1, 2, 3, 7):
        bounds = split_phases(stream, phases)
        assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(set(bounds)) and len(bounds) == phases + 1
        for p, lo in enumerate(bounds[1:-1], 1):
            assert stream[lo + 1] == 1 and lo >= p * n / phases and lo - p * n / phases < 122  # the next document start
    assert split_phases(torch.tensor([1, 5, 6, 1, 7, 8, 9, 1, 4]), 2) == [0, 6, 8]
    assert split_phases(torch.tensor([5, 6, 7]), 3) == [0, 2]  # no document start: one phase


@pytest.mark.parametrize("seq_len,stride,phases,eval_batch_seqs", [(32, 8, 3, 4), (64, 64, 4, 3), (48, 20, 1, 5)])
def test_without_updates_it_is_the_sliding_eval(stream, luts, seq_len, stride, phases, eval_batch_seqs):
    tokens = stream[:1500]
    ref = eval_sliding(TTTLM(seed=1), tokens, luts, seq_len=seq_len, stride=stride, batch_seqs=eval_batch_seqs, **QUIET)
    for kwargs in (dict(epochs=0), dict(lr=0.0)) + (dict(epochs=2),) * (phases == 1):
        res = run_phased_ttt(TTTLM(seed=1), tokens, luts, seq_len=seq_len, stride=stride, phases=phases,
                             eval_batch_seqs=eval_batch_seqs, batch_seqs=2, **kwargs, **QUIET)
        assert res["num_updates"] == 0 and res["phases"] == phases
        assert (res["num_scored_tokens"], res["num_bytes"]) == (ref["num_scored_tokens"], ref["num_bytes"])
        assert res["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-12)
        assert res["val_bpb"] == pytest.approx(ref["val_bpb"], rel=1e-12)


def test_phased_ttt_trains_on_the_scored_prefix_and_learns(stream, luts):
    tokens = stream[:2500]
    ref = eval_sliding(TTTLM(seed=2), tokens, luts, seq_len=32, stride=16, batch_seqs=8, **QUIET)
    model = TTTLM(seed=2)
    res = run_phased_ttt(model, tokens, luts, seq_len=32, stride=16, phases=3, epochs=2, lr=0.5, batch_seqs=4,
                         eval_batch_seqs=8, **QUIET)
    ph = res["chunks"]
    assert len(ph) == 3 and res["num_updates"] > 0 and res["updates_stopped_at_chunk"] is None
    assert ph[0]["scored_at_step"] == 0 and ph[-1]["first_update_step"] is None  # the last phase: never trained on
    # the update round after phase 1 trains on phase 0 again (the whole scored prefix), not on phase 1 alone
    assert ph[0]["first_update_step"] == 1 and ph[0]["last_update_step"] > ph[1]["scored_at_step"]
    assert ph[1]["last_update_step"] == res["num_updates"]
    assert ph[1]["first_update_step"] > ph[1]["scored_at_step"] and ph[2]["scored_at_step"] == res["num_updates"]
    check_ttt_legality(ph)
    assert res["val_bpb"] < ref["val_bpb"] - 0.05 and res["num_bytes"] == ref["num_bytes"]
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())
    # the prefix rounds make more updates than chunked TTT's over the same phases
    chunked = run_ttt(TTTLM(seed=2), tokens, luts, seq_len=32, stride=16, chunk_tokens=ph[1]["first_target"],
                      epochs=2, lr=0.5, batch_seqs=4, eval_batch_seqs=8, **QUIET)
    assert res["num_updates"] > chunked["num_updates"] > 0


def test_training_on_a_phase_before_scoring_it_is_refused(stream, luts, monkeypatch):
    """The illegal variant: the round after phase p trains on phase p + 1 too (update before score)."""
    two_phases = lambda sched, p: (0, sched.bounds[min(p + 2, len(sched.bounds) - 1)])
    monkeypatch.setitem(TTT_MODES, "phased", dataclasses.replace(TTT_MODES["phased"], scope=two_phases))
    with pytest.raises(ValueError, match=r"TTT illegal: chunk 1 \(targets \d+\.\.\d+\) was scored after 17 updates, "
                                         r"but update 10 had already trained on it"):
        run_phased_ttt(TTTLM(seed=3), stream[:1500], luts, seq_len=32, stride=16, phases=3, epochs=1, lr=0.1,
                       batch_seqs=2, eval_batch_seqs=8, **QUIET)


def test_a_rescore_is_refused(stream, luts):
    """The other illegal variant: a phase scored again after the updates (its records repeat)."""
    res = run_phased_ttt(TTTLM(seed=3), stream[:1500], luts, seq_len=32, stride=16, phases=3, epochs=1, lr=0.1,
                         batch_seqs=2, eval_batch_seqs=8, **QUIET)
    ph = res["chunks"]
    check_ttt_legality(ph)
    rescored = {**ph[0], "scored_at_step": res["num_updates"], "first_update_step": None}
    with pytest.raises(ValueError, match="TTT illegal: chunk 0 .* scored twice"):
        check_ttt_legality(ph + [rescored])


def test_bad_settings_are_refused_before_anything_runs(stream, luts):
    for bad in (dict(phases=0), dict(epochs=-1), dict(stride=0), dict(batch_seqs=3, world_size=2)):
        kwargs = dict(dict(seq_len=32, stride=16, phases=3, batch_seqs=2), **bad)
        with pytest.raises(ValueError, match="TTT_PHASES="):
            run_phased_ttt(TTTLM(), stream[:500], luts, **kwargs, **QUIET)


def test_time_guard_stops_updates(stream, luts):
    model = TTTLM(seed=4, score_seconds=0.01, train_seconds=1.0)
    logs = []
    res = run_phased_ttt(model, stream[:2500], luts, seq_len=32, stride=16, phases=4, epochs=1, lr=0.1, batch_seqs=2,
                         eval_batch_seqs=8, max_seconds=60, clock=model.clock, device="cpu", log=logs.append)
    assert res["updates_stopped_at_chunk"] == 2 and "updates stop after phase 1/4" in logs[0]
    assert res["chunks"][2]["first_update_step"] is None and res["num_scored_tokens"] == 2499


def test_plan_cuts_epochs_then_phases_then_skips():
    common = dict(num_val_tokens=40_500_000, seq_len=2048, strides=[64, 128, 2048], eval_batch_seqs=32, batch_seqs=32,
                  max_seconds=600, roundtrip_seconds=30)
    fwd, train = 19.4 / 1254, 32 * 2048 / 1.27e6  # H100-like rates, as test_eval_ttt's plan test
    plan = plan_phased_ttt(forward_seconds=fwd, train_seconds=train, epochs=1, phases=3, **common)
    assert (plan["epochs"], plan["phases"], plan["reason"]) == (1, 3, None)
    assert plan["projected_seconds"] == pytest.approx(30 + project_phased_seconds(
        forward_seconds=fwd, train_seconds=train, num_val_tokens=40_500_000, seq_len=2048, stride=plan["stride"],
        epochs=1, phases=3, eval_batch_seqs=32, batch_seqs=32))
    cut = plan_phased_ttt(forward_seconds=fwd, train_seconds=3 * train, epochs=3, phases=8, **common)
    assert (cut["epochs"], cut["phases"]) < (3, 8) and "does not fit" in cut["reason"]
    assert cut["projected_seconds"] <= 0.9 * 600
    skip = plan_phased_ttt(forward_seconds=fwd, train_seconds=100 * train, epochs=1, phases=3, **common)
    assert skip["epochs"] == 0 and skip["reason"].startswith("TTT skipped") and skip["stride"] == 64
    one = plan_phased_ttt(forward_seconds=fwd, train_seconds=train, epochs=1, phases=1, **common)
    assert one["epochs"] == 0 and "TTT_PHASES=1" in one["reason"]
    p = dict(forward_seconds=fwd, train_seconds=train, num_val_tokens=10**7, seq_len=2048, stride=64, epochs=1,
             phases=3, eval_batch_seqs=32, batch_seqs=32)
    assert project_phased_seconds(**p) < project_phased_seconds(**{**p, "phases": 4}) < project_phased_seconds(
        **{**p, "phases": 4, "epochs": 2})


def _dist_worker(rank, world_size, init_file, tokens, luts, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = TTTLM(seed=6)
        res = run_phased_ttt(model, tokens, luts, seq_len=32, stride=16, phases=3, epochs=2, lr=0.3, batch_seqs=4,
                             eval_batch_seqs=3, rank=rank, world_size=world_size, **QUIET)
        out[rank] = (res["val_loss"], res["val_bpb"], res["num_bytes"], res["num_updates"],
                     [(c["scored_at_step"], c["first_update_step"]) for c in res["chunks"]], model.emb.detach().clone())
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one(stream, luts, tmp_path):
    import torch.multiprocessing as mp

    tokens = stream[:1200]
    model = TTTLM(seed=6)
    res = run_phased_ttt(model, tokens, luts, seq_len=32, stride=16, phases=3, epochs=2, lr=0.3, batch_seqs=4,
                         eval_batch_seqs=3, **QUIET)
    out = mp.Manager().dict()
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), tokens, luts, out), nprocs=2, join=True)
    for rank in (0, 1):
        loss, bpb, num_bytes, num_updates, ledger, emb = out[rank]
        assert (num_bytes, num_updates) == (res["num_bytes"], res["num_updates"]) and num_updates > 0
        assert ledger == [(c["scored_at_step"], c["first_update_step"]) for c in res["chunks"]]
        assert (loss, bpb) == pytest.approx((res["val_loss"], res["val_bpb"]), rel=1e-5)
        torch.testing.assert_close(emb, model.emb.detach(), rtol=1e-4, atol=1e-5)
