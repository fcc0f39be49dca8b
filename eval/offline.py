"""Eval and data helpers that the trainer run never calls, kept out of the counted train_gpt.py.

train_gpt.py does not import this module, so tools/bundle.py leaves it out of the record's
single file (every byte there counts against the 16 MB artifact). It holds:
  - the named shard-format constants and `write_data_shard` (tools/prepare_data.py writes shards;
    eval/shards.py, which is bundled, only reads them and spells the numbers as literals);
  - `load_sentencepiece_luts` and `count_stream_bytes` for `python -m eval`, tools and tests.
"""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
import sentencepiece as spm

if TYPE_CHECKING:
    import torch

# torch, eval.bpb and quant.artifact are imported where they are used: tools/prepare_data.py imports
# this module, and a bad input of it must fail before torch's import (seconds)

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
SHARD_TOKENS_PER_FILE = 100_000_000
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
SHARD_MANIFEST_FORMAT = "parameter-golf-shards"


def write_data_shard(path, tokens) -> None:
    """Write `tokens` (integer array [N], ids in [0, 65535]) as one shard file, atomically.

    Through quant.artifact.atomic_write_bytes (temp file `.{name}.tmp{pid}` in the same dir, fsync,
    rename). Raises ValueError (naming the path) for a non-integer / non-1-D array, ids that do not
    fit uint16, or N >= 2**31.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"shard {path}: expected a 1-D integer token array, got dtype {arr.dtype} shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 65535):
        raise ValueError(f"shard {path}: token ids must fit uint16 [0, 65535], got range [{arr.min()}, {arr.max()}]")
    if arr.size >= 2**31:
        raise ValueError(f"shard {path}: {arr.size} tokens do not fit the int32 header count")
    from quant.artifact import atomic_write_bytes

    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, arr.size)
    atomic_write_bytes(path, header.tobytes() + arr.astype("<u2", copy=False).tobytes())


def load_sentencepiece_luts(tokenizer_path, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load the SentencePiece model at `tokenizer_path` and build its LUTs (`build_sentencepiece_luts`).

    Raises FileNotFoundError naming TOKENIZER_PATH if absent, ValueError if it is not a SentencePiece
    model or has more pieces than VOCAB_SIZE (the model could never predict them: wrong tokenizer for this model).
    """
    from eval.bpb import build_sentencepiece_luts

    path = Path(tokenizer_path)
    if not path.is_file():
        raise FileNotFoundError(f"TOKENIZER_PATH={tokenizer_path} does not exist")
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as exc:  # sentencepiece's parse error: a user's wrong file, one line
        raise ValueError(f"TOKENIZER_PATH={tokenizer_path}: not a SentencePiece model ({exc}); expected a "
                         "SentencePiece .model file") from None
    if int(sp.vocab_size()) > int(vocab_size):
        raise ValueError(
            f"TOKENIZER_PATH={tokenizer_path} has {sp.vocab_size()} pieces but VOCAB_SIZE={vocab_size}: "
            "expected a tokenizer with at most VOCAB_SIZE pieces"
        )
    return build_sentencepiece_luts(sp, vocab_size)


def count_stream_bytes(tokens: torch.Tensor, luts) -> int:
    """Bytes of all targets tokens[1:] of a token stream int64 [N] (each scored after its predecessor)."""
    import torch

    from eval.bpb import count_target_bytes

    tokens = tokens.to(torch.int64)
    return int(count_target_bytes(tokens[:-1], tokens[1:], luts).sum(dtype=torch.int64))
