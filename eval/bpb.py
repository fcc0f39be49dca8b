"""Tokenizer-agnostic byte accounting and val_bpb, shared by every evaluator.

val_bpb = (sum of per-token NLL in nats / ln 2) / (sum of UTF-8 bytes of the scored targets).
The byte count of a target follows the official openai/parameter-golf `build_sentencepiece_luts`:
  - control / unknown / unused ids are "boundary" tokens and count 0 bytes;
  - byte-fallback ids (`<0xNN>`) count exactly 1 byte (a known bug elsewhere counts 3, the UTF-8
    length of the printed piece);
  - a normal piece counts the UTF-8 bytes of its text with one leading `▁` removed, and that `▁`
    adds 1 byte only when the previous token is not a boundary token (SentencePiece drops the
    space of the first piece of a text, and each document starts after BOS).
The sum over a document equals len(sp.decode(segment).encode()) summed over the segments between
boundary tokens (tested on real text for the 1024/2048/4096/8192 challenge tokenizers).

Every evaluator (roundtrip, sliding, later TTT) turns logits into the same three float64 sums with
`eval_score_logits` and into (val_loss, val_bpb) with `eval_metrics_from_sums`, so the number
reported can not depend on which evaluator produced it.
"""

import math
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn.functional as F


def build_sentencepiece_luts(sp, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Byte look-up tables of a SentencePiece model (official rule, see module docstring).

    sp: a loaded `sentencepiece.SentencePieceProcessor`; vocab_size: the model's output size.
    Returns CPU tensors of size max(sp.vocab_size(), vocab_size):
      base_bytes int16 [V] (UTF-8 bytes of the piece without its leading `▁`),
      has_leading_space bool [V], is_boundary_token bool [V] (ids past the tokenizer's vocab are
      boundary tokens with 0 bytes, as in the official script).
    Raises ValueError if vocab_size < 1.
    """
    if int(vocab_size) < 1:
        raise ValueError(f"VOCAB_SIZE must be >= 1, got {vocab_size}")
    sp_vocab_size = int(sp.vocab_size())
    table_size = max(sp_vocab_size, int(vocab_size))
    base_bytes = np.zeros(table_size, dtype=np.int16)
    has_leading_space = np.zeros(table_size, dtype=np.bool_)
    is_boundary_token = np.ones(table_size, dtype=np.bool_)
    for token_id in range(sp_vocab_size):
        if sp.is_control(token_id) or sp.is_unknown(token_id) or sp.is_unused(token_id):
            continue
        is_boundary_token[token_id] = False
        if sp.is_byte(token_id):
            base_bytes[token_id] = 1
            continue
        piece = sp.id_to_piece(token_id)
        if piece.startswith("\u2581"):
            has_leading_space[token_id] = True
            piece = piece[1:]
        base_bytes[token_id] = len(piece.encode("utf-8"))
    return torch.from_numpy(base_bytes), torch.from_numpy(has_leading_space), torch.from_numpy(is_boundary_token)


def load_sentencepiece_luts(tokenizer_path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load the SentencePiece model at `tokenizer_path` and build its LUTs (`build_sentencepiece_luts`).

    Raises FileNotFoundError naming TOKENIZER_PATH if absent, ValueError if the tokenizer has more
    pieces than VOCAB_SIZE (the model could never predict them: wrong tokenizer for this model).
    """
    path = Path(tokenizer_path)
    if not path.is_file():
        raise FileNotFoundError(f"TOKENIZER_PATH={tokenizer_path} does not exist")
    sp = spm.SentencePieceProcessor(model_file=str(path))
    if int(sp.vocab_size()) > int(vocab_size):
        raise ValueError(
            f"TOKENIZER_PATH={tokenizer_path} has {sp.vocab_size()} pieces but VOCAB_SIZE={vocab_size}: "
            "expected a tokenizer with at most VOCAB_SIZE pieces"
        )
    return build_sentencepiece_luts(sp, vocab_size)


def count_target_bytes(prev_ids: torch.Tensor, target_ids: torch.Tensor, luts) -> torch.Tensor:
    """UTF-8 bytes of each target given its previous token: int32, same shape as target_ids.

    prev_ids, target_ids: int64 tensors of the same shape, on the device of `luts`
    (base_bytes, has_leading_space, is_boundary_token).
    """
    base_bytes, has_leading_space, is_boundary_token = luts
    space = has_leading_space[target_ids] & ~is_boundary_token[prev_ids]
    return base_bytes[target_ids].to(torch.int32) + space.to(torch.int32)


def count_stream_bytes(tokens: torch.Tensor, luts) -> int:
    """Bytes of all targets tokens[1:] of a token stream int64 [N] (each scored after its predecessor)."""
    tokens = tokens.to(torch.int64)
    return int(count_target_bytes(tokens[:-1], tokens[1:], luts).sum(dtype=torch.int64))


def eval_score_logits(logits: torch.Tensor, prev_ids: torch.Tensor, target_ids: torch.Tensor, score_mask: torch.Tensor, luts) -> torch.Tensor:
    """The three eval sums of one batch: float64 [3] = (NLL sum in nats, scored tokens, scored bytes).

    logits [B, T, V] (any float dtype; upcast to float32 for a full normalized log-softmax),
    prev_ids / target_ids int64 [B, T], score_mask bool [B, T] (positions that count).
    No host sync: the result stays on the logits' device.
    """
    vocab = logits.size(-1)
    nll = F.cross_entropy(logits.reshape(-1, vocab).float(), target_ids.reshape(-1), reduction="none")
    mask = score_mask.reshape(-1)
    token_bytes = count_target_bytes(prev_ids.reshape(-1), target_ids.reshape(-1), luts)
    return torch.stack(
        (
            torch.where(mask, nll.to(torch.float64), 0.0).sum(),
            mask.to(torch.float64).sum(),
            torch.where(mask, token_bytes, 0).to(torch.float64).sum(),
        )
    )


def eval_all_reduce_sums(sums: torch.Tensor) -> torch.Tensor:
    """Sum the float64 [3] eval sums over ranks when torch.distributed is initialized (in place)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums


def eval_metrics_from_sums(sums: torch.Tensor) -> tuple[float, float]:
    """(val_loss in nats/token, val_bpb in bits/byte) from the float64 [3] sums.

    Raises ValueError if nothing was scored (no tokens or no bytes).
    """
    nll_sum, num_tokens, num_bytes = (float(v) for v in sums.detach().cpu().tolist())
    if num_tokens <= 0 or num_bytes <= 0:
        raise ValueError(f"nothing to score: {num_tokens:.0f} tokens, {num_bytes:.0f} bytes")
    val_loss = nll_sum / num_tokens
    return val_loss, nll_sum / math.log(2.0) / num_bytes
