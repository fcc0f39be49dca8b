"""Eval and data helpers that the trainer run never calls, kept out of the counted train_gpt.py.

train_gpt.py does not import this module, so tools/bundle.py leaves it out of the record's
single file (every byte there counts against the 16 MB artifact): `load_sentencepiece_luts` and
`count_stream_bytes` for `python -m eval`, tools and tests. The shard format (reader, writer,
constants) is shards/format.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import sentencepiece as spm

if TYPE_CHECKING:
    import torch

# torch and eval.bpb are imported where they are used: a CLI's bad input must fail before torch's
# import (seconds)

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


def load_val_byte_luts(tokenizer_path, vocab_size: int, data_path, artifact_run=None, log=print) -> tuple:
    """(luts, byte count name) for scoring the val split of `data_path` (eval/bpb.py count_scored_bytes):
    its CaseOps byte sidecar when it has one, else the tokenizer's LUTs (load_sentencepiece_luts).

    artifact_run: the artifact's run metadata; one that says the run scored on a sidecar
    (run["val_byte_count"] == "sidecar") refuses data without one. Raises ValueError (one line) for
    what shards/sidecar.py check_val_bytes refuses: a CaseOps split without its sidecar, a count
    mismatch, a tokenizer that is not the data's; first, what shards/format.py verify_dataset refuses
    (a tokenizer or val shard not the manifest's, an unlisted shard), its WARNING through `log`.
    """
    from primitives.files import sha256_file
    from shards.format import verify_dataset
    from shards.sidecar import BYTE_COUNT_SIDECAR, check_val_bytes, load_val_bytes

    luts = load_sentencepiece_luts(tokenizer_path, vocab_size)  # checks the file first
    verify_dataset(data_path, tokenizer_path, vocab_size, log=log, hash_splits=("val",))  # the val split is what is scored
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    byte_count = check_val_bytes(data_path, sp, tokenizer_path, sha256_file(tokenizer_path))["val_byte_count"]
    if (artifact_run or {}).get("val_byte_count") == BYTE_COUNT_SIDECAR != byte_count:
        raise ValueError(f"DATA_PATH={data_path}: no CaseOps byte sidecar (fineweb_val_bytes_*.bin), but the artifact's "
                         "run scored on one; expected the CaseOps dataset it was trained on")
    return ((load_val_bytes(data_path),) if byte_count == BYTE_COUNT_SIDECAR else luts), byte_count


def count_stream_bytes(tokens: torch.Tensor, luts) -> int:
    """Bytes of all targets tokens[1:] of a token stream int64 [N] (each scored after its predecessor); luts:
    the byte LUTs or (a byte sidecar,) (eval/bpb.py count_scored_bytes)."""
    import torch

    from eval.bpb import count_scored_bytes

    tokens = tokens.to(torch.int64)
    return int(count_scored_bytes(tokens, torch.arange(len(tokens) - 1), luts).sum(dtype=torch.int64))


SUBMISSION_BYTE_BUDGET = 16_000_000  # the challenge's cap on code + compressed model bytes (decimal)


def submission_bytes_line(artifact_path, code_path=None) -> str:
    """`bytes: model M + code C (<where>) = T of 16,000,000 (margin K)` for `python -m eval score`.

    model: the artifact file's size. code: `code_path`'s size, else a train_gpt.py beside the
    artifact, else result.json's `bytes_code` beside it (the run's measured shipped file); without
    any of them the total is printed as unverified (`--code train_gpt.py` gives it)."""
    artifact = Path(artifact_path)
    model_bytes = artifact.stat().st_size
    code_bytes, where = None, ""
    beside = artifact.parent / "train_gpt.py"
    if code_path is not None or beside.is_file():
        path = Path(code_path) if code_path is not None else beside
        code_bytes, where = path.stat().st_size, str(path)
    else:
        import json

        try:
            code_bytes = int(json.loads((artifact.parent / "result.json").read_text(encoding="utf-8"))["bytes_code"])
            where = f"{artifact.parent / 'result.json'} bytes_code"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if code_bytes is None:
        return (f"bytes: model {model_bytes:,} + code unknown = total unverified of {SUBMISSION_BYTE_BUDGET:,} "
                f"(--code train_gpt.py counts the shipped script)")
    total = model_bytes + code_bytes
    verdict = f"margin {SUBMISSION_BYTE_BUDGET - total:,}" if total <= SUBMISSION_BYTE_BUDGET else \
        f"OVER by {total - SUBMISSION_BYTE_BUDGET:,}"
    return (f"bytes: model {model_bytes:,} + code {code_bytes:,} ({where}) = {total:,} of "
            f"{SUBMISSION_BYTE_BUDGET:,} ({verdict})")

class NonFiniteScoreError(ValueError):
    """A score (val_loss / val_bpb) is NaN or infinite: never printed as a result (one line, exit 1: the scoring
    ran, its result is not a score; exit 2 is for a bad input found before any work)."""


def require_finite_scores(scores: dict) -> None:
    """NonFiniteScoreError naming the first pass of `scores` ({pass: (val_loss, val_bpb)}, in the order run)
    whose score is NaN or infinite."""
    for phase, (val_loss, val_bpb) in scores.items():
        if not (math.isfinite(val_loss) and math.isfinite(val_bpb)):
            raise NonFiniteScoreError(f"the {phase} pass produced val_loss:{val_loss} val_bpb:{val_bpb}; expected finite "
                                      "scores (a diverged TTT, or weights that are not finite): no score is reported")
