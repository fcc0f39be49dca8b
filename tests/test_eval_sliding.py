"""Sliding and roundtrip evals against a one-window-at-a-time reference, the time guard, and ranks."""

import math

import pytest
import torch
import torch.multiprocessing as mp

from eval.roundtrip import eval_roundtrip
from eval.sliding import count_sliding_windows, eval_sliding
from test_eval_support import BigramLM, TinyCausalLM, mixed_stream, reference_sliding_sums

QUIET = dict(device="cpu", log=lambda msg: None)


@pytest.fixture(scope="module")
def stream(sp, luts):
    tokens = mixed_stream(sp, 2000)
    # The stream must exercise the space rule: spaced pieces right after BOS/<unk> all along it.
    _, has_space, boundary = luts
    after_boundary = boundary[tokens[:-1]] & has_space[tokens[1:]]
    assert int(after_boundary[:40].sum()) >= 2 and int(after_boundary.sum()) >= 80
    return tokens


@pytest.mark.parametrize(
    "num_tokens,seq_len,stride,batch_seqs",
    [(300, 32, 8, 4), (301, 32, 8, 5), (257, 32, 32, 3), (250, 64, 1, 16), (40, 64, 16, 2), (2, 16, 4, 1), (513, 48, 20, 7)],
)
def test_sliding_matches_reference(stream, luts, num_tokens, seq_len, stride, batch_seqs):
    tokens = stream[:num_tokens]
    model = TinyCausalLM()
    res = eval_sliding(model, tokens, luts, seq_len=seq_len, stride=stride, batch_seqs=batch_seqs, **QUIET)
    assert model.num_calls == -(-count_sliding_windows(num_tokens - 1, seq_len, stride) // batch_seqs)
    nll, num_scored, num_bytes = reference_sliding_sums(model, tokens, luts, seq_len, stride)
    assert res["num_scored_tokens"] == num_scored == num_tokens - 1
    assert res["num_bytes"] == num_bytes
    assert res["val_loss"] == pytest.approx(nll / num_scored, rel=2e-6)
    assert res["val_bpb"] == pytest.approx(nll / math.log(2) / num_bytes, rel=2e-6)
    assert res["stride"] == stride and set(res) == {"val_loss", "val_bpb", "stride", "eval_seconds", "num_scored_tokens", "num_bytes"}


def test_context_matters(stream, luts):
    # The tiny model is really context dependent: more context (smaller stride) changes the loss.
    model = TinyCausalLM()
    a = eval_sliding(model, stream[:600], luts, seq_len=64, stride=64, batch_seqs=8, **QUIET)["val_loss"]
    b = eval_sliding(model, stream[:600], luts, seq_len=64, stride=8, batch_seqs=8, **QUIET)["val_loss"]
    assert abs(a - b) > 1e-4


@pytest.mark.parametrize("seq_len", (16, 100))
def test_stride_seq_len_equals_roundtrip(stream, luts, seq_len):
    model = TinyCausalLM(seed=1)
    kept = ((stream.numel() - 1) // seq_len) * seq_len + 1
    assert kept < stream.numel()  # the roundtrip really truncates a tail here
    loss, bpb = eval_roundtrip(model, stream, luts, seq_len=seq_len, batch_seqs=6, device="cpu")
    res = eval_sliding(model, stream[:kept], luts, seq_len=seq_len, stride=seq_len, batch_seqs=6, **QUIET)
    assert (res["val_loss"], res["val_bpb"]) == (loss, bpb)
    loss2, bpb2 = eval_roundtrip(model, stream, luts, seq_len=seq_len, batch_seqs=1, device="cpu")
    assert loss2 == pytest.approx(loss, rel=1e-6) and bpb2 == pytest.approx(bpb, rel=1e-6)
    full = eval_sliding(model, stream, luts, seq_len=seq_len, stride=seq_len, batch_seqs=6, **QUIET)
    assert full["num_scored_tokens"] == stream.numel() - 1 > kept - 1


def test_bigram_model_is_stride_invariant(stream, luts):
    model = BigramLM()
    tokens = stream[:700]
    logp = torch.log_softmax(model.table.detach().double(), dim=-1)
    expected = -logp[tokens[:-1], tokens[1:]].sum().item() / (tokens.numel() - 1)
    losses = []
    for seq_len, stride, batch_seqs in [(64, 64, 4), (64, 1, 100), (64, 7, 3), (256, 200, 2), (1000, 10, 9)]:
        res = eval_sliding(model, tokens, luts, seq_len=seq_len, stride=stride, batch_seqs=batch_seqs, **QUIET)
        assert res["val_loss"] == pytest.approx(expected, rel=1e-7), (seq_len, stride)  # float32 log-softmax
        losses.append(res["val_loss"])
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-12)


def test_batching_and_padding_do_not_change_the_result(stream, luts):
    model = TinyCausalLM(seed=2)
    tokens = stream[:900]
    base = eval_sliding(model, tokens, luts, seq_len=64, stride=16, batch_seqs=1, **QUIET)
    for compile_model in (False, True):  # CPU never compiles: the flag must not change the batches
        model.batch_shapes.clear()
        padded = eval_sliding(model, tokens, luts, seq_len=64, stride=16, batch_seqs=7, compile_model=compile_model, **QUIET)
        # 899 targets -> 53 windows -> 8 batches, the last padded with 3 masked windows (one static graph).
        assert model.batch_shapes == [(7, 64)] * 8
        assert padded["num_scored_tokens"] == base["num_scored_tokens"] and padded["num_bytes"] == base["num_bytes"]
        assert padded["val_loss"] == pytest.approx(base["val_loss"], rel=1e-6)


def test_bad_inputs(stream, luts):
    model = TinyCausalLM()
    with pytest.raises(ValueError, match="EVAL_STRIDE"):
        eval_sliding(model, stream, luts, seq_len=16, stride=17, batch_seqs=2, **QUIET)
    with pytest.raises(ValueError, match="EVAL_BATCH_SEQS"):
        eval_sliding(model, stream, luts, seq_len=16, stride=8, batch_seqs=0, **QUIET)
    with pytest.raises(ValueError, match="EVAL_MAX_SECONDS"):
        eval_sliding(model, stream, luts, seq_len=16, stride=8, batch_seqs=2, max_seconds=0, **QUIET)
    with pytest.raises(ValueError, match="EVAL_STRIDE=0"):
        eval_sliding(model, stream, luts, seq_len=16, stride=0, batch_seqs=2, **QUIET)
    with pytest.raises(ValueError, match=r"val_tokens torch.float32 \[100\]"):
        eval_sliding(model, stream[:100].float(), luts, seq_len=16, stride=8, batch_seqs=2, **QUIET)
    with pytest.raises(ValueError, match=r"val_tokens torch.int64 \[2, 50\]"):
        eval_sliding(model, stream[:100].view(2, 50), luts, seq_len=16, stride=8, batch_seqs=2, **QUIET)
    with pytest.raises(ValueError, match=r"val_tokens torch.int64 \[1\]"):
        eval_sliding(model, stream[:1], luts, seq_len=16, stride=8, batch_seqs=2, **QUIET)
    with pytest.raises(ValueError, match="val_tokens: 10 tokens, expected more than TRAIN_SEQ_LEN=16"):
        eval_roundtrip(model, stream[:10], luts, seq_len=16, batch_seqs=2, device="cpu")
    with pytest.raises(ValueError, match="val_tokens"):
        eval_roundtrip(model, stream[:1], luts, seq_len=16, batch_seqs=2, device="cpu")
    with pytest.raises(ValueError, match="EVAL_BATCH_SEQS=0"):
        eval_roundtrip(model, stream, luts, seq_len=16, batch_seqs=0, device="cpu")
    assert model.num_calls == 0


class ClockedLM(TinyCausalLM):
    """Advances a fake clock: `first_call_seconds` extra on the first forward (compilation), then
    `seconds_per_batch` per forward."""

    def __init__(self, seconds_per_batch=1.0, first_call_seconds=5.0):
        super().__init__(seed=3)
        self.now, self.seconds_per_batch, self.first_call_seconds = 0.0, seconds_per_batch, first_call_seconds

    def clock(self) -> float:
        return self.now

    def forward_logits(self, input_ids):
        self.now += self.seconds_per_batch + (self.first_call_seconds if self.num_calls == 0 else 0.0)
        return super().forward_logits(input_ids)


def test_time_guard_fails_fast_with_numbers(stream, luts):
    model, logs = ClockedLM(), []
    tokens = stream[:1001]  # 1000 targets, seq 64, stride 4 -> 235 windows -> 59 batches of 4
    with pytest.raises(ValueError, match="raise EVAL_STRIDE or set EVAL_AUTO_STRIDE=1") as err:
        eval_sliding(model, tokens, luts, seq_len=64, stride=4, batch_seqs=4, device="cpu", max_seconds=30,
                     log=logs.append, clock=model.clock)
    # Probe after batch 3: 9 s elapsed (5 s warm-up + 4 batches), 1 s/batch, 55 batches left -> 64 s.
    assert "projected 64.0s" in str(err.value) and "235 windows" in str(err.value) and "1000.0ms/batch" in str(err.value)
    assert model.num_calls == 4 and len(logs) == 1


def test_time_guard_auto_stride(stream, luts):
    model, logs = ClockedLM(), []
    tokens = stream[:1001]
    res = eval_sliding(model, tokens, luts, seq_len=64, stride=4, batch_seqs=4, device="cpu", max_seconds=30,
                       auto_stride=True, log=logs.append, clock=model.clock)
    # Smallest stride whose whole rerun fits: 9 s elapsed + ceil(windows / 4) batches * 1 s <= 30 s.
    expected = next(s for s in range(5, 65) if 9 + -(-count_sliding_windows(1000, 64, s) // 4) <= 30)
    assert res["stride"] == expected == 12
    assert logs[1] == f"eval_sliding: stride 4 -> {expected}" and "projected 29.0s at stride 12" in logs[2]
    direct = eval_sliding(TinyCausalLM(seed=3), tokens, luts, seq_len=64, stride=expected, batch_seqs=4, **QUIET)
    assert res["val_loss"] == direct["val_loss"] and res["val_bpb"] == direct["val_bpb"]
    assert res["eval_seconds"] == pytest.approx(model.now) and res["eval_seconds"] <= 30


def test_time_guard_quiet_when_it_fits(stream, luts):
    model, logs = ClockedLM(seconds_per_batch=0.01), []
    res = eval_sliding(model, stream[:1001], luts, seq_len=64, stride=4, batch_seqs=4, device="cpu", max_seconds=30,
                       log=logs.append, clock=model.clock)
    assert res["stride"] == 4 and len(logs) == 1 and "projected" in logs[0]
    slow = ClockedLM()  # 9 s are gone at the probe: not even stride = seq_len fits in 8 s
    with pytest.raises(ValueError, match="no stride"):
        eval_sliding(slow, stream[:1001], luts, seq_len=64, stride=4, batch_seqs=1, device="cpu", max_seconds=8,
                     auto_stride=True, log=lambda m: None, clock=slow.clock)


def _dist_worker(rank, world_size, init_file, tokens, luts, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = TinyCausalLM(seed=4)
        loss, bpb = eval_roundtrip(model, tokens, luts, seq_len=32, batch_seqs=3, device="cpu", rank=rank, world_size=world_size)
        res = eval_sliding(model, tokens, luts, seq_len=32, stride=8, batch_seqs=5, device="cpu", rank=rank,
                           world_size=world_size, log=lambda m: None)
        out[rank] = (loss, bpb, res["val_loss"], res["val_bpb"], res["num_scored_tokens"], res["num_bytes"])
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one(stream, luts, tmp_path):
    tokens = stream[:777]
    model = TinyCausalLM(seed=4)
    loss, bpb = eval_roundtrip(model, tokens, luts, seq_len=32, batch_seqs=3, device="cpu")
    res = eval_sliding(model, tokens, luts, seq_len=32, stride=8, batch_seqs=5, **QUIET)
    out = mp.Manager().dict()
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), tokens, luts, out), nprocs=2, join=True)
    single = (loss, bpb, res["val_loss"], res["val_bpb"], res["num_scored_tokens"], res["num_bytes"])
    for rank in (0, 1):
        got = out[rank]
        assert got[4:] == single[4:]
        assert got[:4] == pytest.approx(single[:4], rel=1e-12)


def test_every_target_scored_once_is_a_real_check(stream, luts, monkeypatch):
    """The exactly-once contract is an `if ... raise`, not an `assert` (`python -O` drops those): a
    window plan that forgets one position makes eval_sliding raise instead of scoring a subset."""
    import eval.sliding as sliding

    plan = sliding.plan_sliding_windows

    def plan_missing_one(num_targets, seq_len, stride, windows):
        index, score = plan(num_targets, seq_len, stride, windows)
        return index, score & (index != 5)  # target 5 is never scored

    monkeypatch.setattr(sliding, "plan_sliding_windows", plan_missing_one)
    with pytest.raises(RuntimeError, match=r"scored 298 targets, expected every one of the 299 exactly once"):
        eval_sliding(TinyCausalLM(), stream[:300], luts, seq_len=32, stride=8, batch_seqs=4, **QUIET)


def test_a_gpt_scores_through_its_head_on_the_scored_positions_alone(stream, luts):
    """GPT: the trunk runs on whole windows and the head only on the positions a window scores (all of window
    0's, the last `stride` of each later one), with the reference's (forward_logits per window) sums."""
    from model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=1024, num_layers=2, model_dim=64, num_heads=4, num_kv_heads=2, mlp_mult=2.0,
                rope_dims=8).eval()
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows, head = [], model.head_logits
    model.head_logits = lambda x: rows.append(tuple(x.shape[:2])) or head(x)
    tokens = stream[:301]
    res = eval_sliding(model, tokens, luts, seq_len=32, stride=8, batch_seqs=5, **QUIET)
    assert rows == [(5, 32)] + [(5, 8)] * (len(rows) - 1) and len(rows) == -(-count_sliding_windows(300, 32, 8) // 5)
    nll, num_scored, num_bytes = reference_sliding_sums(model, tokens, luts, 32, 8)
    assert res["num_scored_tokens"] == num_scored == 300 and res["num_bytes"] == num_bytes
    assert res["val_loss"] == pytest.approx(nll / num_scored, rel=1e-6)


def test_the_head_runs_on_whole_windows_at_most_max_positions_at_a_time():
    from eval.sliding import apply_head

    calls = []
    head = lambda x: calls.append(tuple(x.shape)) or x * 2
    hidden = torch.randn(5, 8, 3)
    assert torch.equal(apply_head(head, hidden, max_positions=16), hidden * 2) and calls == [(2, 8, 3)] * 2 + [(1, 8, 3)]
    calls.clear()
    assert torch.equal(apply_head(head, hidden[:, -2:], max_positions=16), hidden[:, -2:] * 2) and calls == [(5, 2, 3)]
