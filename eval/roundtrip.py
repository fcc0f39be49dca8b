"""Batched window scoring (the engine of every evaluator) and the non-overlapping roundtrip eval.

A "window" w is (start s, length n, score offset o): the model sees inputs tokens[s : s+n] and
predicts targets tokens[s+1 : s+n+1]; only positions o..n-1 count. The roundtrip eval of the
official script is the window set s = 0, L, 2L, ... with n = L, o = 0 on the stream truncated to
((N-1)//L)*L + 1 tokens; the sliding eval (eval/sliding.py) is another window set fed to the same
engine, so both share one scoring path (eval/bpb.py `eval_score_logits`).
"""

import sys

import torch

from eval.bpb import eval_all_reduce_sums, eval_metrics_from_sums, eval_score_logits

try:
    from tqdm import tqdm as eval_tqdm
except ImportError:
    eval_tqdm = None


def eval_check_tokens(val_tokens: torch.Tensor, seq_len: int, batch_seqs: int) -> torch.Tensor:
    """Validate the common eval inputs; return val_tokens as a contiguous int64 CPU tensor [N].

    Raises ValueError naming TRAIN_SEQ_LEN / EVAL_BATCH_SEQS / the token tensor when invalid.
    """
    if int(seq_len) < 1:
        raise ValueError(f"TRAIN_SEQ_LEN must be >= 1, got {seq_len}")
    if int(batch_seqs) < 1:
        raise ValueError(f"EVAL_BATCH_SEQS must be >= 1, got {batch_seqs}")
    if val_tokens.dim() != 1 or val_tokens.numel() < 2 or val_tokens.is_floating_point():
        raise ValueError(f"val_tokens must be a 1-D integer tensor of >= 2 tokens, got {val_tokens.dtype} {tuple(val_tokens.shape)}")
    return val_tokens.detach().to("cpu", torch.int64).contiguous()


def eval_score_windows(
    model,
    tokens: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    score_offsets: torch.Tensor,
    luts,
    *,
    batch_seqs: int,
    device,
    autocast_dtype=None,
    compile_model: bool = False,
    show_progress: bool = False,
    on_batch=None,
) -> torch.Tensor:
    """Score a set of windows, `batch_seqs` windows per `model.forward_logits` call.

    tokens: int64 CPU [N] stream; starts, lengths, score_offsets: int64 CPU [W] (see module
    docstring; needs starts + lengths <= N - 1). Windows are right-padded to the longest one
    (causal attention: padding never changes a real position); with compile_model the last batch
    is padded to batch_seqs windows too, so one static graph serves every batch, and the forward
    is torch.compile'd (dynamic=False) when the device is CUDA.
    on_batch(batch_index, num_batches) is called after each batch (the time guard hooks in there).
    Returns this process' float64 [3] sums (NLL nats, tokens, bytes) on `device`, not reduced.
    """
    device = torch.device(device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    num_windows = int(starts.numel())
    if num_windows == 0:
        return sums
    assert int((starts + lengths).max()) <= tokens.numel() - 1 and bool((score_offsets < lengths).all())
    luts = tuple(t.to(device) for t in luts)
    width = int(lengths.max())
    token_lo = int(starts.min())
    token_hi = int((starts + lengths).max()) + 1
    local_tokens = tokens[token_lo:token_hi].to(device)
    positions = torch.arange(width, device=device)
    starts_dev = (starts - token_lo).to(device)
    lengths_dev, offsets_dev = lengths.to(device), score_offsets.to(device)
    forward = model.forward_logits
    # The padding is the CPU twin of the compiled path: it runs (and is tested) on any device.
    pad_batches = bool(compile_model)
    if pad_batches and device.type == "cuda":
        forward = torch.compile(forward, dynamic=False)
    num_batches = (num_windows + batch_seqs - 1) // batch_seqs
    bar = eval_tqdm(total=num_batches, desc="eval", leave=False) if show_progress and eval_tqdm is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch_index in range(num_batches):
                b0, b1 = batch_index * batch_seqs, min(num_windows, (batch_index + 1) * batch_seqs)
                rows = torch.arange(b0, b1, device=device)
                if pad_batches and b1 - b0 < batch_seqs:
                    rows = torch.cat((rows, rows[-1:].expand(batch_seqs - (b1 - b0))))
                index = starts_dev[rows, None] + positions
                x = local_tokens[index.clamp(max=local_tokens.numel() - 2)]
                y = local_tokens[(index + 1).clamp(max=local_tokens.numel() - 1)]
                mask = (positions >= offsets_dev[rows, None]) & (positions < lengths_dev[rows, None])
                if pad_batches:
                    mask[b1 - b0 :] = False
                # Only positions that any window of this batch scores need a log-softmax (host-side
                # bounds from the CPU plan: no device sync).
                p0, p1 = int(score_offsets[b0:b1].min()), int(lengths[b0:b1].max())
                with torch.autocast(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    logits = forward(x)
                sums += eval_score_logits(logits[:, p0:p1], x[:, p0:p1], y[:, p0:p1], mask[:, p0:p1], luts)
                if bar is not None:
                    bar.update(1)
                if on_batch is not None:
                    on_batch(batch_index, num_batches)
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    return sums


def eval_roundtrip(
    model,
    val_tokens: torch.Tensor,
    luts,
    *,
    seq_len: int,
    batch_seqs: int,
    device,
    rank: int = 0,
    world_size: int = 1,
    autocast_dtype=None,
    compile_model: bool = False,
) -> tuple[float, float]:
    """Official-style val eval: non-overlapping windows of seq_len, every position scored.

    val_tokens int64 [N] (all val shards, BOS kept) is truncated to ((N-1)//seq_len)*seq_len + 1
    tokens as in openai/parameter-golf `load_validation_tokens`; sequence k has inputs
    tokens[k*L : (k+1)*L] and targets tokens[k*L+1 : (k+1)*L+1]. Sequences are split into
    contiguous per-rank ranges; the sums are all-reduced when torch.distributed is initialized.
    batch_seqs: sequences per forward on this rank. Returns (val_loss nats/token, val_bpb).
    Raises ValueError if the stream is shorter than seq_len + 1 tokens or inputs are invalid.
    """
    tokens = eval_check_tokens(val_tokens, seq_len, batch_seqs)
    num_seqs = (tokens.numel() - 1) // seq_len
    if num_seqs < 1:
        raise ValueError(f"validation split of {tokens.numel()} tokens is too short for TRAIN_SEQ_LEN={seq_len}")
    seq_lo, seq_hi = num_seqs * rank // world_size, num_seqs * (rank + 1) // world_size
    starts = torch.arange(seq_lo, seq_hi, dtype=torch.int64) * seq_len
    sums = eval_score_windows(
        model, tokens, starts, torch.full_like(starts, seq_len), torch.zeros_like(starts), luts,
        batch_seqs=batch_seqs, device=device, autocast_dtype=autocast_dtype, compile_model=compile_model,
        show_progress=rank == 0 and sys.stderr.isatty(),
    )
    return eval_metrics_from_sums(eval_all_reduce_sums(sums))
