"""The sliding window plan: exact set, every target scored exactly once, tails shorter than a window."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eval.sliding import count_sliding_windows, plan_sliding_windows
from test_eval_support import reference_windows


def check_plan(num_targets: int, seq_len: int, stride: int) -> None:
    starts, lengths, offsets = plan_sliding_windows(num_targets, seq_len, stride)
    assert starts.dtype == lengths.dtype == offsets.dtype == torch.int64
    num_windows = starts.numel()
    assert num_windows == count_sliding_windows(num_targets, seq_len, stride)
    # Each target counted once: scatter-add the scored ranges.
    hits = torch.zeros(num_targets + 1, dtype=torch.int64)
    for s, n, o in zip(starts.tolist(), lengths.tolist(), offsets.tolist()):
        assert 1 <= n <= seq_len and 0 <= o < n
        assert s + n <= num_targets  # the last input is token num_targets-1, the last target token num_targets
        hits[s + o : s + n] += 1
    assert hits[:num_targets].eq(1).all() and hits[num_targets] == 0, (num_targets, seq_len, stride, hits)
    # Exact set: starts are 0, stride, 2*stride, ... ; window 0 scores all, later ones their last `stride`.
    assert starts.tolist() == [k * stride for k in range(num_windows)]
    assert offsets[0] == 0 and (offsets[1:] == seq_len - stride).all()
    assert ((lengths[1:] - offsets[1:]) <= stride).all()
    # Every window but the last is full length unless the stream is shorter than one window.
    assert (lengths[:-1] == seq_len).all()
    assert starts[-1] + lengths[-1] == num_targets
    # Identical to the rule written out independently.
    ref = reference_windows(num_targets, seq_len, stride)
    assert [(s, s + n, s + o) for s, n, o in zip(starts.tolist(), lengths.tolist(), offsets.tolist())] == ref


def test_exhaustive_small_grid():
    for seq_len in (1, 2, 3, 5, 8, 16):
        for stride in range(1, seq_len + 1):
            for num_targets in range(1, 3 * seq_len + 7):
                check_plan(num_targets, seq_len, stride)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 300), st.data())
def test_random_plans(num_targets, seq_len, data):
    stride = data.draw(st.integers(1, seq_len))
    check_plan(num_targets, seq_len, stride)


def test_known_values():
    # 10 targets, windows of 4, stride 2 (context 2): starts 0,2,4,6 (8 + 2 = 10 is not < 10).
    starts, lengths, offsets = plan_sliding_windows(10, 4, 2)
    assert starts.tolist() == [0, 2, 4, 6]
    assert lengths.tolist() == [4, 4, 4, 4]
    assert offsets.tolist() == [0, 2, 2, 2]
    # 11 targets: a fifth, shorter window scores only target 10.
    starts, lengths, offsets = plan_sliding_windows(11, 4, 2)
    assert starts.tolist() == [0, 2, 4, 6, 8] and lengths.tolist() == [4, 4, 4, 4, 3] and offsets.tolist() == [0, 2, 2, 2, 2]
    # Shorter than one window: a single window scores everything.
    assert [t.tolist() for t in plan_sliding_windows(5, 2048, 64)] == [[0], [5], [0]]
    # Official sp1024 val set at seq 2048, stride 64: ceil((62021845 - 1984) / 64) windows.
    assert count_sliding_windows(62_021_845, 2048, 64) == 969_061


def test_bad_arguments():
    with pytest.raises(ValueError, match="EVAL_STRIDE"):
        plan_sliding_windows(100, 16, 0)
    with pytest.raises(ValueError, match="EVAL_STRIDE"):
        plan_sliding_windows(100, 16, 17)
    with pytest.raises(ValueError, match="num_targets"):
        plan_sliding_windows(0, 16, 4)
