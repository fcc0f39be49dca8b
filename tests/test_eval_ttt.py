"""Score-first TTT (eval/ttt.py): chunks, equivalence with the sliding eval, legality (and an illegal
variant the check catches), the time guard, the planner, 2 ranks against 1, and the CLI."""

import dataclasses
import functools

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import eval.ttt as ttt
from eval.sliding import EvalTimeError, eval_sliding
from eval.ttt import plan_chunk_sequences, plan_ttt, select_ttt_params, split_ttt_chunks
from eval.ttt_modes import TTT_MODES, run_mode
from eval.walk import check_ttt_legality
from test_eval_support import ClockedForward, TinyCausalLM, mixed_stream

run_ttt = functools.partial(run_mode, "chunked")
QUIET = dict(device="cpu", log=lambda msg: None)


class TTTLM(ClockedForward, TinyCausalLM):
    """TinyCausalLM with the trainer model's `forward(x, y)` -> mean cross-entropy; optionally
    advances a fake clock per scoring forward and per training forward."""

    def forward(self, input_ids, target_ids):
        return F.cross_entropy(self.forward_logits(input_ids).flatten(0, 1), target_ids.flatten())


@pytest.fixture(scope="module")
def stream(sp):
    return mixed_stream(sp, 3000)  # documents of <= 121 tokens, every other one the same text


def test_chunks_hold_whole_documents(stream):
    for chunk_tokens in (1, 100, 500, 5000):
        bounds = split_ttt_chunks(stream, chunk_tokens)
        assert bounds[0] == 0 and bounds[-1] == len(stream) - 1 and bounds == sorted(set(bounds))
        for lo in bounds[1:-1]:
            assert stream[lo + 1] == 1  # a chunk starts with the prediction of a BOS
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        assert all(s >= chunk_tokens for s in sizes[:-1])
    assert split_ttt_chunks(torch.tensor([1, 5, 6, 1, 7]), 2) == [0, 2, 4]
    assert split_ttt_chunks(torch.tensor([5, 6, 7]), 2) == [0, 2]  # no BOS: one chunk


def test_chunk_sequences_stay_inside_the_chunk():
    for lo, hi, seq_len, multiple in [(0, 100, 32, 1), (50, 383, 32, 4), (10, 42, 32, 2), (7, 20, 32, 1), (0, 1000, 32, 8)]:
        starts = plan_chunk_sequences(lo, hi, seq_len, multiple)
        if hi - lo < seq_len:
            assert starts == []
            continue
        assert len(starts) % multiple == 0 and abs(len(starts) - (hi - lo) / seq_len) <= multiple / 2 + 1e-9
        assert starts == sorted(starts) and min(starts) == lo and max(starts) + seq_len <= hi  # none outside
        assert len(starts) == 1 or max(starts) + seq_len == hi
    assert plan_chunk_sequences(0, 100, 32, 4) == [0, 22, 45, 68]  # 3.1 sequences -> one batch of 4


@pytest.mark.parametrize("seq_len,stride,chunk_tokens,eval_batch_seqs",
                         [(32, 8, 200, 4), (64, 64, 300, 3), (48, 20, 700, 5)])
def test_without_updates_it_is_the_sliding_eval(stream, luts, seq_len, stride, chunk_tokens, eval_batch_seqs):
    tokens = stream[:1500]
    ref = eval_sliding(TTTLM(seed=1), tokens, luts, seq_len=seq_len, stride=stride, batch_seqs=eval_batch_seqs, **QUIET)
    for kwargs in (dict(epochs=0), dict(lr=0.0)):
        res = run_ttt(TTTLM(seed=1), tokens, luts, seq_len=seq_len, stride=stride, chunk_tokens=chunk_tokens,
                      eval_batch_seqs=eval_batch_seqs, batch_seqs=2, **kwargs, **QUIET)
        assert res["num_updates"] == 0 and res["num_chunks"] > 1
        assert (res["num_scored_tokens"], res["num_bytes"]) == (ref["num_scored_tokens"], ref["num_bytes"])
        assert res["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-12)
        assert res["val_bpb"] == pytest.approx(ref["val_bpb"], rel=1e-12)
        assert sum(c["num_targets"] for c in res["chunks"]) == len(tokens) - 1


def test_score_first_ttt_is_legal_and_learns(stream, luts):
    tokens = stream[:2500]
    ref = eval_sliding(TTTLM(seed=2), tokens, luts, seq_len=32, stride=16, batch_seqs=8, **QUIET)
    model = TTTLM(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = run_ttt(model, tokens, luts, seq_len=32, stride=16, chunk_tokens=300, epochs=2, lr=0.5, batch_seqs=4,
                  eval_batch_seqs=8, **QUIET)
    chunks = res["chunks"]
    assert res["num_updates"] > 0 and res["updates_stopped_at_chunk"] is None
    assert chunks[0]["scored_at_step"] == 0 and chunks[-1]["first_update_step"] is None  # last chunk: never trained on
    for c in chunks[:-1]:
        assert c["scored_at_step"] < c["first_update_step"] <= c["last_update_step"]
    for a, b in zip(chunks, chunks[1:]):
        assert b["scored_at_step"] == a["last_update_step"]  # each chunk scored right after the previous one's updates
    check_ttt_legality(chunks)
    # The repeated document is learnt: later chunks gain, the first chunk is scored as the sliding eval would.
    assert res["val_bpb"] < ref["val_bpb"] - 0.05
    assert res["num_bytes"] == ref["num_bytes"]
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())


def test_an_update_before_its_score_is_refused(stream, luts, monkeypatch):
    """The illegal variant: each chunk's update trains on the NEXT chunk's tokens (update before
    score, the leak of training on val before evaluating it)."""
    tokens = stream[:1500]
    n = len(tokens) - 1
    next_chunk = lambda sched, c: (sched.bounds[c + 1], min(n, 2 * sched.bounds[c + 1] - sched.bounds[c]))
    monkeypatch.setitem(TTT_MODES, "chunked", dataclasses.replace(TTT_MODES["chunked"], scope=next_chunk))
    with pytest.raises(ValueError, match=r"TTT illegal: chunk 1 \(targets \d+\.\.\d+\) was scored after \d+ updates, "
                                         r"but update 1 had already trained on it"):
        run_ttt(TTTLM(seed=3), tokens, luts, seq_len=32, stride=16, chunk_tokens=300, epochs=1, lr=0.1, batch_seqs=2,
                eval_batch_seqs=8, **QUIET)


def test_legality_check_on_records():
    rec = dict(chunk=4, first_target=100, num_targets=50, scored_at_step=7, first_update_step=8, last_update_step=9)
    check_ttt_legality([rec, {**rec, "chunk": 5, "first_target": 150, "first_update_step": None},
                        {**rec, "chunk": 6, "first_target": 200, "scored_at_step": None}])
    with pytest.raises(ValueError, match=r"chunk 4 \(targets from 100\) does not follow chunk 4 .*scored twice"):
        check_ttt_legality([rec, rec])  # the same targets scored again (a rescore)
    with pytest.raises(ValueError, match=r"chunk 6 \(targets from 200\) does not follow chunk 4"):
        check_ttt_legality([rec, {**rec, "chunk": 6, "first_target": 200}])  # targets 150..199 never scored
    with pytest.raises(ValueError, match=r"chunk 4 \(targets 100\.\.149\) was scored after 7 updates, but update 7"):
        check_ttt_legality([{**rec, "first_update_step": 7}])


def test_parameter_subsets():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_scale, self.mix = nn.Parameter(torch.ones(64)), nn.Parameter(torch.ones(2, 64))
            self.fc = nn.Linear(64, 64, bias=False)

    model = nn.Module()
    model.blocks = nn.ModuleList([Block(), Block()])
    names = {id(p): n for n, p in model.named_parameters()}
    pick = lambda which: sorted(names[id(p)] for p in select_ttt_params(model, which))
    assert len(pick("all")) == 6
    assert pick("scalars") == ["blocks.0.attn_scale", "blocks.0.mix", "blocks.1.attn_scale", "blocks.1.mix"]
    assert pick(r"blocks\.1\.fc") == ["blocks.1.fc.weight"]
    with pytest.raises(ValueError, match="TTT_PARAMS='lora'"):
        select_ttt_params(model, "lora")


def test_bad_settings_are_refused_before_anything_runs(stream, luts):
    model = TTTLM()
    for kwargs, what in [(dict(chunk_tokens=16), "TTT_CHUNK_TOKENS=16"), (dict(stride=0), "EVAL_STRIDE=0"),
                         (dict(batch_seqs=3, world_size=2), "TTT_BATCH_SEQS=3"), (dict(epochs=-1), "TTT_EPOCHS=-1")]:
        with pytest.raises(ValueError, match=what):
            run_ttt(model, stream[:500], luts, **{**dict(seq_len=32, stride=16, chunk_tokens=100), **kwargs}, **QUIET)
    assert model.num_calls == 0


def test_time_guard_stops_updates_then_refuses(stream, luts):
    tokens = stream[:2500]
    common = dict(seq_len=32, stride=16, chunk_tokens=300, epochs=1, lr=0.1, batch_seqs=4, eval_batch_seqs=8)
    free = TTTLM(seed=5, score_seconds=1.0, train_seconds=1.0)
    full = run_ttt(free, tokens, luts, max_seconds=1e6, **common, clock=free.clock, **QUIET)
    assert full["updates_stopped_at_chunk"] is None and full["eval_seconds"] == pytest.approx(free.now)
    # A budget between "score only" and "score + update": updates stop, every target is still scored.
    model, logs = TTTLM(seed=5, score_seconds=1.0, train_seconds=1.0), []
    res = run_ttt(model, tokens, luts, max_seconds=0.75 * full["eval_seconds"], **common, device="cpu", log=logs.append,
                  clock=model.clock)
    stop = res["updates_stopped_at_chunk"]
    assert stop is not None and res["num_scored_tokens"] == len(tokens) - 1 and "updates stop" in logs[0]
    assert all(c["first_update_step"] is None for c in res["chunks"][stop:])
    assert res["num_updates"] < full["num_updates"]
    # Not even scoring fits: EvalTimeError with the chunks measured so far.
    slow = TTTLM(seed=5, score_seconds=10.0)
    with pytest.raises(EvalTimeError, match="for scoring alone") as err:
        run_ttt(slow, tokens, luts, max_seconds=50, **common, device="cpu", log=lambda m: None, clock=slow.clock)
    assert 1 < len(err.value.partial) < full["num_chunks"] and "val_bpb" in err.value.partial[-1]


def test_plan_ttt_fits_epochs_then_stride_then_skips():
    common = dict(num_val_tokens=40_500_000, seq_len=2048, strides=[64, 128, 256, 2048], chunk_tokens=32768,
                  eval_batch_seqs=32, batch_seqs=32, max_seconds=600, roundtrip_seconds=30)
    # The H100 numbers: 19.4 s for 2.57 M tokens at stride 64 (~40,100 windows = 1,254 batches of 32).
    fwd = 19.4 / 1254
    train = 32 * 2048 / 1.27e6
    plan = plan_ttt(forward_seconds=fwd, train_seconds=train, epochs=3, **common)
    assert plan["epochs"] == 3 and plan["reason"] is None and plan["projected_seconds"] <= 0.9 * 600
    assert plan["projected_seconds"] == pytest.approx(
        30 + ttt.project_ttt_seconds(forward_seconds=fwd, train_seconds=train, stride=plan["stride"], epochs=3,
                                     **{k: common[k] for k in ("num_val_tokens", "seq_len", "chunk_tokens",
                                                               "eval_batch_seqs", "batch_seqs")}))
    slower = plan_ttt(forward_seconds=3 * fwd, train_seconds=3 * train, epochs=3, **common)
    assert slower["epochs"] < 3 or slower["stride"] > plan["stride"]
    skip = plan_ttt(forward_seconds=fwd, train_seconds=100 * train, epochs=3, **common)
    assert skip["epochs"] == 0 and skip["reason"].startswith("TTT skipped") and skip["stride"] == 64
    none = plan_ttt(forward_seconds=fwd, train_seconds=train, epochs=0, **common)
    assert none == dict(stride=64, epochs=0, projected_seconds=none["projected_seconds"], reason=None)
    # More val tokens or ranks move the projection the expected way.
    p = dict(forward_seconds=fwd, train_seconds=train, num_val_tokens=10**7, seq_len=2048, stride=64, epochs=1,
             chunk_tokens=32768, eval_batch_seqs=32, batch_seqs=32)
    assert ttt.project_ttt_seconds(**p) < ttt.project_ttt_seconds(**{**p, "num_val_tokens": 2 * 10**7})
    assert ttt.project_ttt_seconds(**{**p, "world_size": 8}) < ttt.project_ttt_seconds(**p)


def _dist_worker(rank, world_size, init_file, tokens, luts, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = TTTLM(seed=6)
        res = run_ttt(model, tokens, luts, seq_len=32, stride=16, chunk_tokens=300, epochs=2, lr=0.3, batch_seqs=4,
                      eval_batch_seqs=3, rank=rank, world_size=world_size, **QUIET)
        out[rank] = (res["val_loss"], res["val_bpb"], res["num_bytes"], res["num_updates"],
                     [(c["scored_at_step"], c["first_update_step"]) for c in res["chunks"]], model.emb.detach().clone())
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one(stream, luts, tmp_path):
    tokens = stream[:1200]
    model = TTTLM(seed=6)
    res = run_ttt(model, tokens, luts, seq_len=32, stride=16, chunk_tokens=300, epochs=2, lr=0.3, batch_seqs=4,
                  eval_batch_seqs=3, **QUIET)
    out = mp.Manager().dict()
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), tokens, luts, out), nprocs=2, join=True)
    for rank in (0, 1):
        loss, bpb, num_bytes, num_updates, ledger, emb = out[rank]
        assert (num_bytes, num_updates) == (res["num_bytes"], res["num_updates"]) and num_updates > 0
        assert ledger == [(c["scored_at_step"], c["first_update_step"]) for c in res["chunks"]]
        assert (loss, bpb) == pytest.approx((res["val_loss"], res["val_bpb"]), rel=1e-5)
        torch.testing.assert_close(emb, model.emb.detach(), rtol=1e-4, atol=1e-5)


def test_cli_ttt_equals_the_direct_call(tiny_dataset, sp1024_model, tmp_path):
    """`python -m eval score --ttt 1` on a saved artifact prints the score run_ttt gives in process."""
    import re

    import train_gpt
    from eval.offline import load_sentencepiece_luts
    from shards.format import load_validation_tokens
    from quant.artifact import export_artifact, load_artifact
    from test_eval_cli import run_cli

    config = dict(vocab_size=1024, num_layers=2, model_dim=64, num_heads=2, num_kv_heads=1, mlp_mult=2, rope_dims=16)
    torch.manual_seed(0)
    model = train_gpt.GPT(**config)
    model.init_weights(0.05)
    path = tmp_path / "final_model.ptz"
    export_artifact({k: v.detach().float() for k, v in model.state_dict().items()}, config, path, code_bytes=0,
                    log=lambda m: None)
    settings = dict(chunk_tokens=1024, epochs=2, lr=0.05, batch_seqs=4, params="all")
    out = run_cli("score", "--artifact", path, "--data-path", tiny_dataset, "--tokenizer", sp1024_model, "--seq-len", 64,
                  "--stride", 32, "--batch-seqs", 8, "--val-max-tokens", 3000, "--ttt", 1, "--ttt-chunk-tokens", 1024,
                  "--ttt-epochs", 2, "--ttt-lr", 0.05, "--ttt-batch-seqs", 4, "--ttt-params", "all").stdout
    line = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) eval_time:(\d+)ms stride:32 "
                     r"chunks:(\d+) updates:(\d+)$", out, re.M)
    assert line and "final_sliding_window_exact" not in out, out
    state, loaded_config, _ = load_artifact(path)
    loaded = train_gpt.GPT(**loaded_config)
    loaded.load_state_dict(state)
    tokens = load_validation_tokens(tiny_dataset)[:3001]
    res = run_ttt(loaded.eval(), tokens, load_sentencepiece_luts(sp1024_model, 1024), seq_len=64, stride=32,
                  eval_batch_seqs=8, **settings, **QUIET)
    assert res["num_updates"] > 0 and (int(line[4]), int(line[5])) == (res["num_chunks"], res["num_updates"])
    assert float(line[1]) == pytest.approx(res["val_loss"], abs=1e-7)
    assert float(line[2]) == pytest.approx(res["val_bpb"], abs=1e-7)


def _score_args(**flags):
    """args of `python -m eval score --ttt 1` after check_score_inputs: CLI defaults, `flags` given as flags."""
    import argparse

    defaults = dict(ttt_epochs=3, ttt_chunk_tokens=32768, ttt_lr=0.002, ttt_momentum=0.9, ttt_grad_clip=1.0,
                    ttt_batch_seqs=32, ttt_params="all", ttt_eval_batch_seqs=32, ttt_mode="chunked", ttt_phases=3,
                    ttt_lora_rank=8, ttt_lora_lr=0.01, ttt_lora_chunk_tokens=256, ttt_lora_batch_docs=64)
    return argparse.Namespace(artifact="A.ptz", ttt=1, ttt_flags=list(flags), **{**defaults, **flags})


def test_score_takes_the_artifacts_ttt_settings_unless_a_flag_overrides():
    from eval.__main__ import resolve_ttt_settings

    recorded = dict(enabled=1, epochs=1, chunk_tokens=2048, lr=0.01, momentum=0.5, grad_clip=0.0, batch_seqs=8,
                    params="scalars", eval_batch_seqs=16)
    logs, args = [], _score_args(ttt_lr=0.02)
    resolve_ttt_settings(args, dict(run=dict(ttt=recorded)), log=logs.append)
    assert (args.ttt_epochs, args.ttt_chunk_tokens, args.ttt_lr, args.ttt_momentum, args.ttt_grad_clip,
            args.ttt_batch_seqs, args.ttt_params, args.ttt_eval_batch_seqs) == (1, 2048, 0.02, 0.5, 0.0, 8, "scalars", 16)
    assert logs == ["ttt settings: from the artifact TTT_EPOCHS=1 TTT_CHUNK_TOKENS=2048 TTT_MOMENTUM=0.5 "
                    "TTT_GRAD_CLIP=0.0 TTT_BATCH_SEQS=8 TTT_PARAMS=scalars EVAL_BATCH_SEQS=16 TTT_MODE=chunked; "
                    "from flags TTT_LR=0.02"]  # recorded before the phased mode: chunked
    # a phased run's artifact: its mode and phases, not TTT_CHUNK_TOKENS (unused by phased TTT)
    logs, args = [], _score_args()
    resolve_ttt_settings(args, dict(run=dict(ttt=dict(recorded, mode="phased", phases=4))), log=logs.append)
    assert (args.ttt_mode, args.ttt_phases) == ("phased", 4) and "TTT_CHUNK_TOKENS" not in logs[0]
    assert logs[0].endswith("EVAL_BATCH_SEQS=16 TTT_MODE=phased TTT_PHASES=4; from flags none")
    # a LoRA run's artifact: its rank, lr, chunk and slots, none of the SGD settings it does not use
    logs, args = [], _score_args(ttt_lora_lr=0.03)
    lora = dict(recorded, mode="lora", lora_rank=4, lora_lr=0.05, lora_chunk_tokens=64, lora_batch_docs=16)
    resolve_ttt_settings(args, dict(run=dict(ttt=lora)), log=logs.append)
    assert (args.ttt_mode, args.ttt_lora_rank, args.ttt_lora_lr, args.ttt_lora_chunk_tokens,
            args.ttt_lora_batch_docs) == ("lora", 4, 0.03, 64, 16)
    assert logs == ["ttt settings: from the artifact TTT_EPOCHS=1 EVAL_BATCH_SEQS=16 TTT_MODE=lora TTT_LORA_RANK=4 "
                    "TTT_LORA_CHUNK_TOKENS=64 TTT_LORA_BATCH_DOCS=16; from flags TTT_LORA_LR=0.03"]
    # a LoRA artifact written before the slots: one document at a time, as its run scored
    logs, args = [], _score_args()
    resolve_ttt_settings(args, dict(run=dict(ttt={k: v for k, v in lora.items() if k != "lora_batch_docs"})),
                         log=logs.append)
    assert args.ttt_lora_batch_docs == 1 and "TTT_LORA_BATCH_DOCS=1;" in logs[0]
    # an older artifact (no settings recorded) still scores, with the CLI's, and says the score may not be the run's
    logs, args = [], _score_args()
    resolve_ttt_settings(args, dict(run=dict(train_seq_len=64)), log=logs.append)
    assert args.ttt_chunk_tokens == 32768 and len(logs) == 1
    assert logs[0].startswith("ttt settings: artifact A.ptz records none (written before artifacts recorded them")
    assert "TTT_CHUNK_TOKENS=32768" in logs[0] and logs[0].endswith("the score is the run's only if these match the "
                                                                   "run's TTT_* settings (its result.json's score_command)")
    # a run whose plan skipped TTT, or that ran without it, says so; without --ttt a TTT run gets a hint
    logs = []
    resolve_ttt_settings(_score_args(), dict(run=dict(ttt=dict(recorded, epochs=0))), log=logs.append)
    assert logs[0].endswith("(the run's plan skipped TTT: its score is the sliding one)")
    # a run without TTT records epochs 0 (and phases 1): --ttt 1 used to take them "from the artifact" and make 0
    # updates; its TTT settings never ran, so the environment / the trainer's defaults score, and the line says so
    args = _score_args(ttt_mode="phased")
    resolve_ttt_settings(args, dict(run=dict(ttt=dict(recorded, enabled=0, epochs=0, phases=1))), log=logs.append)
    assert (args.ttt_epochs, args.ttt_phases, args.ttt_chunk_tokens) == (3, 3, 32768)
    assert logs[1].startswith("ttt settings: artifact A.ptz is from a run without TTT (TTT_ENABLED=0): its TTT "
                              "settings never ran: the environment or CLI defaults TTT_EPOCHS=3 "), logs[1]
    assert logs[1].endswith(", flags TTT_MODE=phased; a TTT score of its weights, not the run's score (the sliding one)")
    # a TTT variable of the environment that the artifact's value replaces is named, not dropped without a word
    args, env = _score_args(), {"TTT_MODE": "phased", "TTT_LR": "0.01", "TTT_EPOCHS": "1e0", "HOME": "/h"}
    resolve_ttt_settings(args, dict(run=dict(ttt=recorded)), log=logs.append, environ=env)
    assert args.ttt_mode == "chunked" and logs[-1].endswith(
        "; not used: the environment's TTT_MODE=phased (the artifact records what the run scored with; a flag "
        "overrides it)"), logs[-1]  # TTT_LR=0.01 and TTT_EPOCHS=1e0 are the artifact's own values: nothing replaced
    resolve_ttt_settings(dict_args := _score_args(), dict(run=dict(ttt=recorded)), log=logs.append)
    dict_args.ttt = 0
    resolve_ttt_settings(dict_args, dict(run=dict(ttt=recorded)), log=logs.append)
    assert logs[-1] == "artifact A.ptz: the run scored with TTT (1 epochs): this is the sliding score; pass --ttt 1 for the run's score"
    for bad in (dict(recorded, lr=-1.0), dict(recorded, epochs=True), dict(recorded, params="("), dict(recorded, lr=float("nan")),
                {k: v for k, v in recorded.items() if k != "chunk_tokens"}, [1, 2], dict(recorded, mode="sgd"),
                dict(recorded, mode="phased", phases=0), dict(recorded, mode="lora", lora_rank=0)):
        with pytest.raises(ValueError, match=r"^artifact A\.ptz: malformed TTT settings "):
            resolve_ttt_settings(_score_args(), dict(run=dict(ttt=bad)), log=logs.append)
