"""Per-document LoRA score-first TTT (eval/lora_ttt.py, eval/lora_batch.py): chunks per document, equivalence
with the sliding eval and with the document-by-document oracle (tests/lora_reference.py) at any slot count,
the batched adapter (identity at reset, slots independent, removed after), per-document reset, legality
(and an illegal variant the check refuses), learning on repeated text, the time guard, the projection."""

import dataclasses
import functools

import pytest
import torch

import eval.lora_mode as lora_mode
import eval.lora_ttt as lora_ttt
from eval.lora_batch import BatchedLoRA, plan_lora_rounds
from eval.lora_ttt import (count_lora_work, estimate_lora_work, lora_batch_windows, project_lora_seconds,
                           split_lora_chunks)
from eval.sliding import EvalTimeError, eval_sliding
from eval.ttt_modes import TTT_MODES, run_mode
from eval.walk import check_ttt_legality
from lora_reference import sequential_lora_ttt
from model.gpt import GPT
from test_eval_support import ClockedForward, mixed_stream, read_docs

run_lora_ttt = functools.partial(run_mode, "lora", epochs=1)
QUIET = dict(device="cpu", log=lambda msg: None)
CONFIG = dict(vocab_size=1024, num_layers=2, model_dim=32, num_heads=2, num_kv_heads=1, mlp_mult=2.0, rope_dims=8,
              xsa_last_n=1)


class ClockedGPT(ClockedForward, GPT):
    """GPT whose trunk (forward_hidden: every scoring forward and training step runs it once) advances a fake
    clock: score_seconds under inference mode, else train_seconds."""

    def forward_logits(self, input_ids):
        return GPT.forward_logits(self, input_ids)  # ticks once, in forward_hidden

    def forward_hidden(self, input_ids):
        self.tick()
        return GPT.forward_hidden(self, input_ids)


def tiny_gpt(seed=0, **clock):
    torch.manual_seed(seed)
    model = ClockedGPT(**clock, **CONFIG)
    model.init_weights(0.05)
    return model


@pytest.fixture(scope="module")
def stream(sp):
    return mixed_stream(sp, 1200)  # documents of <= 121 tokens, every other one the same text


def repeated_docs(sp, num_docs=6, half=48, skip=0):
    """Documents [BOS] + T + T, T the first `half` tokens of a real document: the second copy is
    predictable from the first, so adapting on the scored tokens must help."""
    ids = []
    for d in read_docs(limit=num_docs + skip)[skip:]:
        t = sp.encode(d)[:half]
        ids += [sp.bos_id()] + t + t
    return torch.tensor(ids, dtype=torch.int64)


def test_chunks_cut_each_document(stream):
    bounds, doc_starts = split_lora_chunks(stream, 16)
    assert bounds[0] == 0 and bounds[-1] == len(stream) - 1 and bounds == sorted(set(bounds))
    assert len(doc_starts) == len(bounds) - 1
    for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        assert 0 < hi - lo <= 16 and lo >= doc_starts[c]
        assert (lo == doc_starts[c]) == (lo == 0 or stream[lo + 1] == 1)  # a document starts with its BOS target
        assert not (stream[lo + 2:hi + 1] == 1).any()  # no document start inside a chunk
    assert split_lora_chunks(torch.tensor([1, 5, 6, 7, 1, 8, 9]), 2) == ([0, 2, 3, 5, 6], [0, 0, 3, 3])


def test_adapter_is_the_identity_until_trained_its_slots_never_mix_and_it_leaves_no_trace():
    model, x = tiny_gpt(), torch.randint(0, 1024, (3, 20))
    before = model.forward_logits(x)
    lora = BatchedLoRA(model, 4, 2)
    assert len(lora.modules) == 3 * 2 and all(n.endswith(("attn.c_q", "attn.c_v", "mlp.proj")) for n, _ in lora.modules)
    assert [tuple(p.shape) for p in lora.params[:2]] == [(2, 4, 32), (2, 32, 4)]
    lora.set_rows([0, 1, 0])
    assert torch.equal(model.forward_logits(x), before)
    with torch.no_grad():
        lora.params[1][1].fill_(0.1)  # slot 1's B of the first target
    after = model.forward_logits(x)
    assert torch.equal(after[[0, 2]], before[[0, 2]]) and not torch.equal(after[1], before[1])  # only slot 1's row moved
    lora.reset_slot(1)
    assert torch.equal(model.forward_logits(x), before)
    lora.remove()
    with torch.no_grad():
        lora.params[1].fill_(0.1)
    assert torch.equal(model.forward_logits(x), before)
    with pytest.raises(ValueError, match="no linear of the model matches"):
        BatchedLoRA(model, 4, 1, "nothing_here")


def test_schedule_deals_documents_in_val_order_to_free_slots():
    rounds = plan_lora_rounds([3, 1, 2, 1], slots=2)
    assert rounds == [[(0, 0, 0), (1, 1, 0)], [(0, 0, 1), (1, 2, 0)], [(0, 0, 2), (1, 2, 1)], [(0, 3, 0)]]
    assert plan_lora_rounds([2, 2], slots=1) == [[(0, 0, 0)], [(0, 0, 1)], [(0, 1, 0)], [(0, 1, 1)]]
    assert plan_lora_rounds([1, 1, 1], slots=8) == [[(0, 0, 0), (1, 1, 0), (2, 2, 0)]]


@pytest.mark.parametrize("seq_len,stride,chunk,eval_batch_seqs,batch_docs", [(32, 16, 16, 4, 1), (32, 32, 32, 3, 5),
                                                                            (48, 20, 7, 5, 3), (32, 16, 16, 32, 64)])
def test_without_updates_it_is_the_sliding_eval(stream, luts, seq_len, stride, chunk, eval_batch_seqs, batch_docs):
    model = tiny_gpt(seed=1)
    ref = eval_sliding(model, stream, luts, seq_len=seq_len, stride=stride, batch_seqs=eval_batch_seqs, **QUIET)
    for kwargs in (dict(epochs=0), dict(lr=0.0)):
        res = run_lora_ttt(model, stream, luts, seq_len=seq_len, stride=stride, chunk_tokens=chunk,
                           eval_batch_seqs=eval_batch_seqs, batch_docs=batch_docs, **kwargs, **QUIET)
        assert res["num_updates"] == 0 and res["num_documents"] == 1 + int((stream[2:] == 1).sum())
        assert (res["num_scored_tokens"], res["num_bytes"]) == (ref["num_scored_tokens"], ref["num_bytes"])
        assert res["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-12, abs=0)
        assert res["val_bpb"] == pytest.approx(ref["val_bpb"], rel=1e-12, abs=0)


def test_model_weights_are_bit_identical_after_the_eval(stream, luts):
    model = tiny_gpt(seed=2)
    model.tok_emb.weight.requires_grad_(False)  # a flag that must come back as it was
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = stream[None, :40]
    before = model.forward_logits(x)
    res = run_lora_ttt(model, stream, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05, **QUIET)
    assert res["num_updates"] > 0
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == ["tok_emb.weight"]
    assert torch.equal(model.forward_logits(x), before)


@pytest.mark.parametrize("batch_docs", [1, 3, 8])
def test_batched_slots_score_as_the_document_by_document_oracle(sp, stream, luts, batch_docs):
    """Every chunk's loss equals the oracle's (tests/lora_reference.py: one adapter, torch.optim.Adam, documents
    one by one) to 1e-6 relative, the totals to 1e-8: float32 on CPU, where the batched matmuls (another
    summation order than F.linear's) and the hand-written Adam (same formulas, per-slot bias corrections)
    differ from the oracle by float32 rounding (1 ulp ~ 6e-8), carried through at most 8 Adam steps per
    document; measured 5.5e-8 per chunk and 7e-11 in total at every slot count here (2026-11-26)."""
    tokens = torch.cat([stream[:700], repeated_docs(sp, num_docs=4, half=30)])  # documents of 31 to 121 tokens
    kwargs = dict(seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05, lora_rank=4)
    ref = sequential_lora_ttt(tiny_gpt(seed=9), tokens, luts, **kwargs)
    res = run_lora_ttt(tiny_gpt(seed=9), tokens, luts, batch_docs=batch_docs, **kwargs, **QUIET)
    assert res["num_rounds"] < res["num_chunks"] or batch_docs == 1
    assert res["num_updates"] == ref["num_updates"] > 0 and res["num_bytes"] == ref["num_bytes"]
    assert len({r["slot"] for r in res["chunks"]}) == min(batch_docs, res["num_documents"])
    assert [r["val_loss"] for r in res["chunks"]] == pytest.approx([r["val_loss"] for r in ref["chunks"]], rel=1e-6)
    assert (res["val_loss"], res["val_bpb"]) == pytest.approx((ref["val_loss"], ref["val_bpb"]), rel=1e-8)
    check_ttt_legality(res["chunks"])


def test_a_reused_slot_restarts_its_adam_step_count(sp, stream, luts, monkeypatch):
    """The variant that keeps a slot's Adam step count (bias corrections) across its documents is caught by the
    oracle comparison: the slot reused by a later document scores differently."""
    tokens = torch.cat([stream[:300], repeated_docs(sp, num_docs=3, half=30)])
    kwargs = dict(seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05, lora_rank=4)
    ref = [r["val_loss"] for r in sequential_lora_ttt(tiny_gpt(seed=9), tokens, luts, **kwargs)["chunks"]]
    reset = BatchedLoRA.reset_slot

    def keep_steps(self, s):
        steps = self.steps[s]
        reset(self, s)
        self.steps[s] = steps
    monkeypatch.setattr(BatchedLoRA, "reset_slot", keep_steps)
    res = run_lora_ttt(tiny_gpt(seed=9), tokens, luts, batch_docs=2, **kwargs, **QUIET)
    assert [r["val_loss"] for r in res["chunks"]] != pytest.approx(ref, rel=1e-6)


def test_ledger_is_legal_and_training_before_scoring_is_refused(stream, luts, monkeypatch):
    res = run_lora_ttt(tiny_gpt(seed=3), stream, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05,
                       batch_docs=4, **QUIET)
    recs = res["chunks"]
    check_ttt_legality(recs)
    assert recs[0]["scored_at_step"] == 0 and res["num_updates"] == 2 * sum(
        a["document"] == b["document"] for a, b in zip(recs, recs[1:]))  # every chunk but a document's last
    for a, b in zip(recs, recs[1:]):
        if a["document"] == b["document"]:  # trained on right after it was scored, never again
            assert a["first_update_step"] == a["scored_at_step"] + 1 and a["last_update_step"] == b["scored_at_step"]
        else:  # a document's last chunk: never trained on
            assert a["first_update_step"] is None
    # documents are scored side by side (a later document's first chunk before an earlier one's last), but within a
    # document the chunks must come in scoring order: swapping two of them is refused
    assert any(b["scored_at_step"] < a["scored_at_step"] for a, b in zip(recs, recs[1:]))
    c = next(c for c in range(len(recs) - 1) if recs[c]["document"] == recs[c + 1]["document"])
    swapped = [dict(r) for r in recs]
    swapped[c]["scored_at_step"], swapped[c + 1]["scored_at_step"] = recs[c + 1]["scored_at_step"], recs[c]["scored_at_step"]
    swapped[c]["first_update_step"] = swapped[c + 1]["first_update_step"] = None  # only the order is wrong
    with pytest.raises(ValueError, match=f"TTT illegal: chunk {c + 1} .* in scoring order"):
        check_ttt_legality(swapped)
    # the illegal variant: the updates after chunk c train on chunk c + 1 too, before it is scored
    two_chunks = lambda sched, c: (sched.bounds[c], sched.bounds[min(c + 2, len(sched.bounds) - 1)])
    monkeypatch.setitem(TTT_MODES, "lora", dataclasses.replace(TTT_MODES["lora"], scope=two_chunks))
    with pytest.raises(ValueError, match=r"TTT illegal: chunk 1 \(targets 16\.\.\d+\) was scored after 2 updates, "
                                         r"but update 1 had already trained on it"):
        run_lora_ttt(tiny_gpt(seed=3), stream, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05,
                     batch_docs=4, **QUIET)


def test_the_adapter_is_reset_at_each_document(sp, luts, monkeypatch):
    """Two streams whose first documents differ except in their last seq_len tokens: the second
    document's scores (same context) must not depend on what the adapter learnt on the first."""
    one = repeated_docs(sp, num_docs=2, half=40)
    other = one.clone()
    other[1:40] = repeated_docs(sp, num_docs=1, half=40, skip=5)[1:40]  # first doc: 81 tokens, its last 42 kept
    kwargs = dict(seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05, batch_docs=1, **QUIET)  # one slot, reused
    runs = [run_lora_ttt(tiny_gpt(seed=4), s, luts, **kwargs)["chunks"] for s in (one, other)]
    firsts, seconds = ([[r["val_loss"] for r in recs if r["document"] == d] for recs in runs] for d in (0, 1))
    assert firsts[0] != firsts[1] and len(seconds[0]) == 6  # the adapters trained on different text
    assert seconds[0] == seconds[1]
    monkeypatch.setattr(BatchedLoRA, "reset_slot", lambda self, s: None)  # the one slot's first document leaks
    leaky = [run_lora_ttt(tiny_gpt(seed=4), s, luts, **kwargs)["chunks"] for s in (one, other)]
    assert [r["val_loss"] for r in leaky[0] if r["document"] == 1] != [r["val_loss"] for r in leaky[1] if r["document"] == 1]


def test_lora_ttt_learns_on_repeated_text(sp, luts):
    tokens = repeated_docs(sp)
    model = tiny_gpt(seed=5)
    base = run_lora_ttt(model, tokens, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=0, **QUIET)
    ttt = run_lora_ttt(model, tokens, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=3, lr=0.05, **QUIET)
    assert ttt["num_updates"] == 3 * (ttt["num_chunks"] - ttt["num_documents"]) and ttt["num_documents"] == 6
    assert ttt["num_bytes"] == base["num_bytes"]
    assert ttt["val_bpb"] < base["val_bpb"] - 0.1
    recs = ttt["chunks"]
    gains = [b["val_loss"] - t["val_loss"] for b, t in zip(base["chunks"], recs)]
    firsts = [c for c, r in enumerate(recs) if c == 0 or r["document"] != recs[c - 1]["document"]]
    assert len(firsts) == 6 and all(gains[c] == 0 for c in firsts)  # a fresh adapter scores as the base model
    # the gain is on the second copy of each document (position >= 48 in it), learnt from the first
    offset = [r["first_target"] - recs[max(f for f in firsts if f <= c)]["first_target"] for c, r in enumerate(recs)]
    second = [g for g, o in zip(gains, offset) if 48 <= o < 96]
    first = [g for g, o in zip(gains, offset) if 0 < o < 48]
    assert sum(second) / len(second) > 0.3 > 0.1 > sum(first) / len(first)


def test_bad_settings_are_refused_before_anything_runs(stream, luts):
    for bad in (dict(chunk_tokens=0), dict(chunk_tokens=33), dict(epochs=-1), dict(lora_rank=0), dict(stride=0),
                dict(batch_docs=0)):
        kwargs = dict(dict(seq_len=32, stride=16, chunk_tokens=16), **bad)
        with pytest.raises(ValueError, match="TTT_LORA_CHUNK_TOKENS="):
            run_lora_ttt(tiny_gpt(), stream, luts, **kwargs, **QUIET)


def test_time_guard_stops_updates(stream, luts):
    model = tiny_gpt(seed=6, score_seconds=0.01, train_seconds=0.5)
    logs = []
    res = run_lora_ttt(model, stream, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=1, lr=0.05, batch_docs=2,
                       max_seconds=20, clock=model.clock, device="cpu", log=logs.append)
    stop = res["updates_stopped_at_chunk"]  # the round after which updates stopped
    assert stop is not None and "updates stop after round" in logs[0] and res["num_scored_tokens"] == len(stream) - 1
    assert all(r["first_update_step"] is None for r in res["chunks"] if r["round"] >= stop) and res["num_updates"] > 0
    assert any(r["first_update_step"] is not None for r in res["chunks"] if r["round"] == stop - 1)
    check_ttt_legality(res["chunks"])


def test_time_guard_refuses_when_scoring_alone_cannot_fit(stream, luts):
    model = tiny_gpt(seed=6, score_seconds=1.0)
    with pytest.raises(EvalTimeError, match=r"run_lora_ttt: projected [\d.]+s for scoring alone after round 2/\d+ "
                                            r"\([\d.]+s elapsed\) > EVAL_MAX_SECONDS 20\.0s: raise EVAL_STRIDE") as err:
        run_lora_ttt(model, stream, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=1, lr=0.05, batch_docs=2,
                     eval_batch_seqs=2, max_seconds=20, clock=model.clock, device="cpu", log=lambda msg: None)
    partial = err.value.partial
    assert {r["round"] for r in partial} == {0, 1} and len(partial) == 4  # 2 rounds of 2 slots, then refused
    assert all(r["scored_at_step"] is not None for r in partial)


def test_the_projection_counts_the_runs_forwards_and_steps(stream, luts, monkeypatch):
    calls, real = [], lora_mode.score_lora_batch
    monkeypatch.setattr(lora_mode, "score_lora_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = run_lora_ttt(tiny_gpt(seed=7), stream, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.01,
                       batch_docs=3, eval_batch_seqs=4, **QUIET)
    windows = lora_batch_windows(16, 16, 1, 4, 3)
    work = count_lora_work(stream, chunk_tokens=16, batch_docs=3, seq_len=32, stride=16, batch_windows=windows)
    assert (work["chunks"], work["documents"], work["rounds"]) == (res["num_chunks"], res["num_documents"], res["num_rounds"])
    assert work["forwards"] == len(calls) == project_lora_seconds(forward_seconds=1, step_seconds=0, work=work, epochs=2)
    steps = max(r["last_update_step"] or 0 for r in res["chunks"])
    assert steps == 2 * work["update_rounds"] == project_lora_seconds(forward_seconds=0, step_seconds=1, work=work, epochs=2)
    est = estimate_lora_work(num_val_tokens=len(stream), num_docs=res["num_documents"], chunk_tokens=16, batch_docs=3,
                             stride=16, batch_windows=windows)
    assert res["num_chunks"] <= est["chunks"] <= res["num_chunks"] + res["num_documents"]  # short chunks counted whole
    assert est["rounds"] == -(-est["chunks"] // 3) and est["forwards"] == est["rounds"] * 2  # 3 x 2 windows: 2 forwards of 4


def test_the_forward_count_at_every_stride_is_the_runs_window_list(stream):
    """lora_work_counter (the plan's recount at each stride it tries) counts, for every stride, slot count and
    rank count, the forwards of the windows the run scores (eval.lora_batch.round_windows of each round)."""
    from eval.lora_batch import count_round_forwards, round_windows

    for batch_docs in (1, 3):
        bounds, doc_starts = lora_ttt.split_lora_chunks(stream, 16)
        rounds, _, _ = lora_ttt.lora_schedule(bounds, doc_starts, batch_docs)
        for world_size in (1, 2):
            counter = lora_ttt.lora_work_counter(stream, chunk_tokens=16, batch_docs=batch_docs, seq_len=32,
                                                 world_size=world_size)
            for stride in (1, 5, 8, 16, 17, 31, 32):
                bw = lora_batch_windows(16, stride, world_size, 4, batch_docs)
                run = sum(count_round_forwards(len(round_windows(bounds, [c for _, c, _ in r], seq_len=32, stride=stride)),
                                               bw, world_size) for r in rounds)
                assert counter(stride, bw)["forwards"] == run, (batch_docs, world_size, stride)


def _dist_worker(rank, world_size, init_file, tokens, luts, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        res = run_lora_ttt(tiny_gpt(seed=8), tokens, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05,
                           eval_batch_seqs=1, batch_docs=3, rank=rank, world_size=world_size, **QUIET)
        out[rank] = (res["val_loss"], res["val_bpb"], res["num_bytes"], res["num_updates"],
                     [(c["scored_at_step"], c["first_update_step"]) for c in res["chunks"]])
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one(stream, luts, tmp_path):
    """Each rank scores a share of every round's windows (eval_batch_seqs=1: both ranks score) and takes
    every slot's adapter step itself: the same adapters, the same score as one rank."""
    import torch.multiprocessing as mp

    tokens = stream[:600]
    res = run_lora_ttt(tiny_gpt(seed=8), tokens, luts, seq_len=32, stride=16, chunk_tokens=16, epochs=2, lr=0.05,
                       eval_batch_seqs=1, batch_docs=3, **QUIET)
    out = mp.Manager().dict()
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), tokens, luts, out), nprocs=2, join=True)
    for rank in (0, 1):
        loss, bpb, num_bytes, num_updates, ledger = out[rank]
        assert (num_bytes, num_updates) == (res["num_bytes"], res["num_updates"]) and num_updates > 0
        assert ledger == [(c["scored_at_step"], c["first_update_step"]) for c in res["chunks"]]
        assert (loss, bpb) == pytest.approx((res["val_loss"], res["val_bpb"]), rel=1e-6)
