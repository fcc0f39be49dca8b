"""Shared helpers of the eval tests: tiny models with `forward_logits`, real-text token streams, and a
reference sliding eval written straight from the rule text (one window at a time, float64).

Imported by the other tests/test_eval_*.py files (pytest puts tests/ on sys.path).
"""

import atexit
import functools
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SHARED = Path(__file__).resolve().parents[2] / "shared"
TOKENIZER_DIR = SHARED / "data" / "tokenizers"
TEXT_DIR = SHARED / "data" / "text"


class TinyCausalLM(nn.Module):
    """A one-block causal transformer (no positional signal besides causality) over a small width:
    its logits at a position depend on the whole prefix, which is what the sliding tests need."""

    def __init__(self, vocab_size: int = 1024, dim: int = 16, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.emb = nn.Parameter(torch.randn(vocab_size, dim, generator=gen))
        self.qkv = nn.Parameter(torch.randn(3 * dim, dim, generator=gen) / math.sqrt(dim))
        self.head = nn.Parameter(torch.randn(vocab_size, dim, generator=gen))
        self.num_calls = 0
        self.batch_shapes = []

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        self.batch_shapes.append(tuple(input_ids.shape))
        h = self.emb[input_ids]
        q, k, v = F.linear(h, self.qkv).chunk(3, dim=-1)
        h = h + F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)[:, 0]
        return 2.0 * torch.tanh(F.linear(F.rms_norm(h, (h.size(-1),)), self.head) / 2.0)


class BigramLM(nn.Module):
    """Logits depend only on the current token: every window set must give the same sums."""

    def __init__(self, vocab_size: int = 1024, seed: int = 0):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(seed)))

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]


class UniformLM(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, self.vocab_size)


@functools.cache
def _sample_documents() -> tuple:
    from tools.data.data_sample import sample_documents

    return tuple(sample_documents())


def read_docs(name: str = "fineweb_textfixer", limit: int | None = None) -> list[str]:
    """Documents of ../shared/data/text/<name>.jsonl, or in a fresh clone without ../shared the sample
    text (`tools/prepare_data.py sample`: Python's help texts, 330 documents, about half with
    characters outside a small vocabulary) whatever the name."""
    if not (TEXT_DIR / f"{name}.jsonl").is_file():
        return list(_sample_documents()[:limit])
    docs = []
    with open(TEXT_DIR / f"{name}.jsonl", encoding="utf-8") as f:
        for line in f:
            docs.append(json.loads(line)["text"])
            if limit is not None and len(docs) >= limit:
                break
    return docs


@functools.cache
def tokenizer_path(vocab_size: int = 1024) -> Path:
    """The challenge's fineweb_<V>_bpe.model from ../shared, else (a fresh clone) a tokenizer of the same
    size trained on the sample text with the official settings (~2 s): 1024 without byte fallback, as
    the published sp1024, larger ones with it, so both byte rules (<unk> boundaries, byte pieces) stay
    exercised. Never a skip."""
    path = TOKENIZER_DIR / f"fineweb_{vocab_size}_bpe.model"
    if path.is_file():
        return path
    from tools.data.data_tokenizer import train_tokenizer

    out = Path(tempfile.mkdtemp(prefix="sample_tokenizers_"))
    atexit.register(shutil.rmtree, out, True)
    return train_tokenizer(lambda: iter(read_docs()), vocab_size, out / f"sample_{vocab_size}_bpe",
                           byte_fallback=vocab_size != 1024, log=lambda msg: None)


def load_sp(vocab_size: int = 1024):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(tokenizer_path(vocab_size)))


def real_stream(sp, num_docs: int = 6, max_tokens: int | None = None) -> torch.Tensor:
    """Val-style stream: [BOS] + sp.encode(doc) per document, concatenated (int64 [N])."""
    ids = []
    for doc in read_docs(limit=num_docs):
        ids += [sp.bos_id()] + sp.encode(doc)
    tokens = torch.tensor(ids, dtype=torch.int64)
    return tokens[:max_tokens] if max_tokens else tokens


# Characters outside the sp1024-4096 vocabularies encode to <unk> (a boundary token) followed by
# pieces with a leading space: the case where the space must NOT be counted.
UNKNOWN_CHARS_DOC = "Tokyo \u6771\u4eac is big, \U0001f600 and \u4e2d \u2713 ok. \u65e5\u672c and \ud55c\uad6d or \u03a9 sure"


def mixed_stream(sp, num_tokens: int = 2000) -> torch.Tensor:
    """Val-style stream that alternates the first 120 tokens of real documents with
    UNKNOWN_CHARS_DOC, so BOS and <unk> boundaries followed by spaced pieces occur all along it."""
    ids, docs = [], read_docs(limit=64)
    for i in range(10 ** 6):
        ids += [sp.bos_id()] + sp.encode(UNKNOWN_CHARS_DOC if i % 2 == 0 else docs[(i // 2) % len(docs)])[:120]
        if len(ids) >= num_tokens:
            return torch.tensor(ids[:num_tokens], dtype=torch.int64)
    raise AssertionError("unreachable")


def random_stream(num_tokens: int, vocab_size: int = 1024, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))


def reference_windows(num_targets: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) straight from the rule: starts 0, stride, ... while
    start + context < num_targets (window 0 always); the first window scores everything, later
    ones their last `stride` positions; a window ends at min(start + seq_len, num_targets)."""
    context = seq_len - stride
    windows, start = [], 0
    while start == 0 or start + context < num_targets:
        end = min(start + seq_len, num_targets)
        windows.append((start, end, start if start == 0 else start + context))
        start += stride
    return windows


def reference_sliding_sums(model, tokens: torch.Tensor, luts, seq_len: int, stride: int) -> tuple[float, int, int]:
    """One window per forward, per-token float64 log-softmax, bytes from the LUTs by hand."""
    base_bytes, has_leading_space, is_boundary = (t.tolist() for t in luts)
    nll_sum, num_tokens, num_bytes = 0.0, 0, 0
    with torch.no_grad():
        for start, end, first in reference_windows(tokens.numel() - 1, seq_len, stride):
            logp = torch.log_softmax(model.forward_logits(tokens[None, start:end])[0].double(), dim=-1)
            for t in range(first, end):
                prev, target = int(tokens[t]), int(tokens[t + 1])
                nll_sum -= float(logp[t - start, target])
                num_tokens += 1
                num_bytes += base_bytes[target] + int(has_leading_space[target] and not is_boundary[prev])
    return nll_sum, num_tokens, num_bytes


def test_reference_windows_cover_each_target_once():
    # The reference itself must satisfy the rule before anything is compared against it.
    for num_targets, seq_len, stride in [(1, 4, 1), (10, 4, 4), (10, 4, 3), (37, 8, 2), (5, 16, 4)]:
        seen = [t for _, end, first in reference_windows(num_targets, seq_len, stride) for t in range(first, end)]
        assert seen == list(range(num_targets))


class ClockedForward:
    """Mixin for a model with forward_logits: each call advances a fake clock (`clock()`) by score_seconds
    under inference mode (a scoring forward), else by train_seconds (a TTT step's forward)."""

    def __init__(self, *args, score_seconds: float = 0.0, train_seconds: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.now, self.score_seconds, self.train_seconds = 0.0, score_seconds, train_seconds

    def clock(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.score_seconds if torch.is_inference_mode_enabled() else self.train_seconds

    def forward_logits(self, input_ids):
        self.tick()
        return super().forward_logits(input_ids)


class BatchClock:
    """A clock for eval_sliding's time guard that advances `seconds_per_batch` per forward call of
    the models it wraps: the guard's projections become exact and independent of a loaded machine."""

    def __init__(self, seconds_per_batch: float):
        self.calls, self.seconds_per_batch = 0, seconds_per_batch

    def __call__(self) -> float:
        return self.calls * self.seconds_per_batch

    def wrap(self, forward):
        def counted(*args, **kwargs):
            self.calls += 1
            return forward(*args, **kwargs)

        return counted


def expected_auto_stride(num_targets: int, seq_len: int, stride: int, batch_seqs: int, max_seconds: float,
                         seconds_per_batch: float, probe: int = 3) -> int:
    """The stride eval_sliding restarts at under a BatchClock (one rank): the probe after batch
    `probe` has seen probe + 1 batches; the first stride > `stride` whose full pass fits on top of
    them (0 when none <= seq_len does)."""
    from eval.sliding import count_sliding_windows

    batches = lambda s: -(-count_sliding_windows(num_targets, seq_len, s) // batch_seqs)
    return next((s for s in range(stride + 1, seq_len + 1)
                 if (probe + 1 + batches(s)) * seconds_per_batch <= max_seconds), 0)


def assert_cli_scores_as_the_trainer(command: str, env: dict, result: dict, settings_re: str, final_re: str) -> None:
    """`python -m eval score` of a TTT run's score_command cut after `--ttt 1` (every TTT setting from the
    artifact, none from flags or the TTT_* environment) reproduces the trainer's val_loss_ttt, val_bpb_ttt
    and ttt_updates, and its `ttt settings:` line matches settings_re; `--ttt-epochs 0` gives another score
    (the plain sliding one). final_re: the end of the final_ttt_exact line, its last group the updates."""
    bare = command[:command.index(" --ttt 1 ")] + " --ttt 1"
    cli_env = {k: v for k, v in env.items() if not k.startswith("TTT_")}
    repo = Path(__file__).resolve().parents[1]
    score = subprocess.run([sys.executable, *bare.split()[1:]], cwd=repo, capture_output=True, text=True, timeout=300,
                           env=cli_env)
    assert score.returncode == 0, score.stderr[-2000:]
    assert re.search(settings_re, score.stdout, re.M), score.stdout[-2000:]
    cli = re.search(r"^final_ttt_exact val_loss:(\S+) val_bpb:(\S+) .* " + final_re + "$", score.stdout, re.M)
    assert cli, score.stdout[-2000:]
    assert abs(float(cli.group(2)) - result["val_bpb_ttt"]) <= 1e-7 and abs(float(cli.group(1)) - result["val_loss_ttt"]) <= 1e-7
    assert int(cli.group(cli.lastindex)) == result["ttt_updates"]
    plain = subprocess.run([sys.executable, *bare.split()[1:], "--ttt-epochs", "0"], cwd=repo, capture_output=True,
                           text=True, timeout=300, env=cli_env)
    sliding = float(re.search(r"^final_ttt_exact val_loss:\S+ val_bpb:(\S+)", plain.stdout, re.M).group(1))
    assert abs(sliding - result["val_bpb_ttt"]) > 1e-5
