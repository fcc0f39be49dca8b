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

Every evaluator (roundtrip and sliding share one window engine, eval/sliding.py `eval_sliding`)
counts bytes with `count_scored_bytes`, so the number reported can not depend on which evaluator
produced it. CaseOps data (PR #1855) is scored on its val byte sidecar instead of the LUTs: `luts` is
then one tensor of bytes per val position (shards/sidecar.py), the original text's bytes.
Loading a tokenizer file and counting a whole stream (CLI/tools only) live in
eval/offline.py, outside the bundled train_gpt.py.
"""

import math

import numpy as np
import torch

from shards.sidecar import load_val_bytes


def build_sentencepiece_luts(sp, vocab_size: int, /) -> tuple:
    """Byte look-up tables of a SentencePiece model (official rule, see module docstring).

    sp: a loaded `sentencepiece.SentencePieceProcessor`; vocab_size: the model's output size.
    Returns CPU tensors of size max(sp.vocab_size(), vocab_size):
      base_bytes int16 [V] (UTF-8 bytes of the piece without its leading `\u2581`),
      has_leading_space bool [V], is_boundary_token bool [V] (ids past the tokenizer's vocab are
      boundary tokens with 0 bytes, as in the official script).
    """
    # Rows: base_bytes, has_leading_space, is_boundary_token (every id starts as a boundary token).
    table = np.zeros((3, max(sp.vocab_size(), vocab_size)), np.int16)
    table[2] = 1
    for i in range(sp.vocab_size()):
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)):
            piece = sp.id_to_piece(i)
            text = piece.removeprefix("\u2581")  # only ONE leading space marker is the space
            # Byte-fallback pieces (`<0xNN>`) are exactly 1 byte, not the length of their name.
            table[:, i] = 1 if sp.is_byte(i) else len(text.encode()), piece != text, 0
    table = torch.tensor(table)
    return table[0], table[1].bool(), table[2].bool()


def val_byte_luts(sp, vocab_size: int, data_path=None, sidecar: bool = False, /) -> tuple:
    """What `count_scored_bytes` counts a val split with: (the byte sidecar of data_path,) when `sidecar`
    (CaseOps data: shards/sidecar.py check_val_bytes said so), else the tokenizer's LUTs."""
    return (load_val_bytes(data_path),) if sidecar else build_sentencepiece_luts(sp, vocab_size)


def count_scored_bytes(tokens: torch.Tensor, index: torch.Tensor, luts, /) -> torch.Tensor:
    """UTF-8 bytes of the targets tokens[index + 1], each scored after tokens[index]: same shape as index.

    tokens: the val stream int64 [N]; index: int64 positions < N - 1, on the device of `luts`. luts: the
    three official tables (base_bytes, has_leading_space, is_boundary_token: a target's base bytes, plus 1 for its
    leading space unless the previous token is a boundary token), or one tensor [>= N] of bytes per stream
    position: a CaseOps byte sidecar (shards/sidecar.py, PR #1855), whose entry for a target is its original
    text's bytes, whatever its piece spells.
    """
    if len(luts) == 1:
        return luts[0][index + 1]
    base_bytes, has_leading_space, is_boundary_token = luts
    target = tokens[index + 1]
    return base_bytes[target] + (has_leading_space[target] & ~is_boundary_token[tokens[index]])

# where each score of result.json comes from: the status of a run whose score is not finite names it
SCORE_PHASES = (("_prequant", "prequant_eval"), ("_roundtrip", "roundtrip"), ("_sliding", "sliding"), ("_ttt", "ttt"))


def nonfinite_scores(summary: dict, /) -> dict:
    """{key: phase} for each top-level number of `summary` (a result.json) that is NaN or infinite; the
    phase is the pass that produced it (prequant_eval, roundtrip, sliding, ttt), else summary["phase"]."""
    bad = {}
    for key, value in summary.items():
        if isinstance(value, float) and not math.isfinite(value):
            bad[key] = next((phase for tail, phase in SCORE_PHASES if key.endswith(tail)), summary.get("phase", "train"))
    return bad
