"""The official non-overlapping roundtrip val eval, run by the one window engine (eval/sliding.py).

The official script (openai/parameter-golf `eval_val`) truncates the val stream of N tokens to
((N-1)//L)*L + 1 tokens and scores sequence k: inputs tokens[k*L : (k+1)*L], targets
tokens[k*L+1 : (k+1)*L+1], every position. That is exactly the sliding window set with
stride = seq_len (context 0) on the truncated stream, so both evals share one scoring path and
can not disagree on bytes, masking or reduction (tests/test_eval_sliding.py checks equality).
"""

import math

from eval.sliding import eval_sliding


def eval_roundtrip(model, val_tokens, luts, /, *, seq_len, **kwargs) -> tuple:
    """Official-style val eval: non-overlapping windows of seq_len, every position scored.

    val_tokens int64 [N] (all val shards, BOS kept) is truncated to ((N-1)//seq_len)*seq_len + 1
    tokens. kwargs go to `eval_sliding`: batch_seqs (sequences per forward on this rank), device,
    rank=0, world_size=1, autocast_dtype=None, compile_model=False (torch.compile on CUDA, static
    batches). Sequences are split into contiguous per-rank ranges and the float64 sums are
    all-reduced when torch.distributed is initialized. No time guard (no limit, nothing logged).
    Returns (val_loss nats/token, val_bpb bits/byte). Raises ValueError if the stream is shorter
    than seq_len + 1 tokens or an input is invalid (see `eval_sliding`).
    """
    num_tokens = (len(val_tokens) - 1) // seq_len * seq_len + 1
    if num_tokens < 2:
        raise ValueError(f"val_tokens: {len(val_tokens)} tokens, expected more than TRAIN_SEQ_LEN={seq_len}")
    # `str` is a no-op log: the guard never trips without a limit, and its projection line would
    # only confuse the roundtrip's log.
    result = eval_sliding(model, val_tokens[:num_tokens], luts, seq_len=seq_len, stride=seq_len,
                          max_seconds=math.inf, log=str, **kwargs)
    return result["val_loss"], result["val_bpb"]
