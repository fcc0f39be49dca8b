"""The sliding window plan of the engine: exact set, every target scored exactly once, short tails."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eval.sliding import count_sliding_windows, plan_sliding_windows
from test_eval_support import reference_windows


def windows_of(num_targets: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored target) of every window, read back from the engine's plan."""
    num_windows = count_sliding_windows(num_targets, seq_len, stride)
    index, score = plan_sliding_windows(num_targets, seq_len, stride, torch.arange(num_windows))
    assert index.dtype == torch.int64 and score.dtype == torch.bool
    assert index.shape == score.shape == (num_windows, min(seq_len, num_targets))
    out = []
    for row, mask in zip(index.tolist(), score.tolist()):
        real = [t for t in row if t < num_targets]
        assert real == list(range(row[0], row[0] + len(real)))  # contiguous, padding only at the end
        scored = [t for t, m in zip(row, mask) if m]
        assert scored == list(range(scored[0], real[-1] + 1))  # a window scores a suffix of its real part
        out.append((row[0], real[-1] + 1, scored[0]))
    return out


def check_plan(num_targets: int, seq_len: int, stride: int) -> None:
    windows = windows_of(num_targets, seq_len, stride)
    # Each target counted once.
    seen = [t for _, end, first in windows for t in range(first, end)]
    assert seen == list(range(num_targets)), (num_targets, seq_len, stride)
    # Exact set: starts are 0, stride, 2*stride, ... ; window 0 scores all, later ones their last `stride`.
    assert [s for s, _, _ in windows] == [k * stride for k in range(len(windows))]
    assert all(first == s + seq_len - stride and end - first <= stride for s, end, first in windows[1:])
    # Every window but the last is full length unless the stream is shorter than one window.
    assert all(end - s == seq_len for s, end, _ in windows[:-1]) and windows[-1][1] == num_targets
    # Identical to the rule written out independently.
    assert windows == reference_windows(num_targets, seq_len, stride)


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
    assert windows_of(10, 4, 2) == [(0, 4, 0), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    # 11 targets: a fifth, shorter window scores only target 10.
    assert windows_of(11, 4, 2) == [(0, 4, 0), (2, 6, 4), (4, 8, 6), (6, 10, 8), (8, 11, 10)]
    # Shorter than one window: a single window scores everything.
    assert windows_of(5, 2048, 64) == [(0, 5, 0)]
    # Official sp1024 val set at seq 2048, stride 64: ceil((62021845 - 1984) / 64) windows.
    assert count_sliding_windows(62_021_845, 2048, 64) == 969_061


def test_padding_windows_index_past_the_stream():
    # Windows past the last one (the padding of a compiled last batch) still plan in range of the
    # arange; the engine masks them by window index and clamps their token indices.
    index, score = plan_sliding_windows(10, 4, 2, torch.arange(3, 6))
    assert index[-1].tolist() == [10, 11, 12, 13] and not score[-1].any()
