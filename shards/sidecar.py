"""The val byte sidecar of CaseOps data: its checks and its reader.

CaseOps data (PR #1729 / #1855, shards/caseops.py) is tokenized from transformed text, so the
tokenizer's pieces do not spell the original bytes (an operator piece is 3 UTF-8 bytes of text that
was never there). Its val split comes with `fineweb_val_bytes_NNNNNN.bin` beside the val shards:
the shard format, one uint16 per val token = the original UTF-8 bytes that token stands for (0 for
BOS and the operators). val_bpb then divides by the sidecar's bytes of the scored targets instead of
the byte LUT's (eval/bpb.py `count_scored_bytes`).

A run scores on the sidecar with CASEOPS_ENABLED=1 (PR #1855's switch; the 8xh100-pr1855 preset sets it), and
only then is this module packed (a record's train_gpt.py without it refuses CASEOPS_ENABLED=1; the trainer refuses
CaseOps data without it, shards/data_kind.py). `check_val_bytes` refuses, in one line, a CaseOps val split without
its sidecar, a sidecar whose token counts differ from the val shards', and a tokenizer that is not the data's.
"""

import numpy as np

from shards.data_kind import (CASEOPS_TRANSFORM, VAL_BYTES_PREFIX, caseops_signs, list_val_byte_shards, read_manifest,
                              reserves_caseops)
from shards.format import list_shards, read_shard_header, load_data_shard

PACKED_WHEN = "CASEOPS_ENABLED"
BYTE_COUNT_SIDECAR, BYTE_COUNT_TOKENIZER = "sidecar", "tokenizer"  # result.json's val_byte_count


def check_val_bytes(data_path, sp, tokenizer_path, tokenizer_sha256=None) -> dict:
    """How the val split of `data_path` is byte-counted, checked before any long work.

    Returns {"val_byte_count": "sidecar", "val_bytes_shards": [names], "val_bytes_tokens": N} for a
    dataset with sidecar shards, else {"val_byte_count": "tokenizer"} (the official byte LUT).
    Raises ValueError naming DATA_PATH / TOKENIZER_PATH for: CaseOps data (manifest text_transform, or
    a tokenizer reserving the operators) without a sidecar; a sidecar beside a tokenizer that does not
    reserve the operators, or whose sha256 is not the manifest's; sidecar shards whose count or
    per-shard token counts differ from the val shards'.
    """
    files, manifest = list_val_byte_shards(data_path), read_manifest(data_path)
    if not files:
        why = caseops_signs(data_path, sp, tokenizer_path)
        if why:
            raise ValueError(f"DATA_PATH={data_path}: a CaseOps val split ({why}) without its byte sidecar "
                             f"{VAL_BYTES_PREFIX}*.bin; expected the sidecar beside the val shards (tools/prepare_data.py "
                             "caseops writes it), or the tokenizer of this data")
        return {"val_byte_count": BYTE_COUNT_TOKENIZER}
    caseops = manifest.get("text_transform") == CASEOPS_TRANSFORM
    want = manifest.get("tokenizer_sha256")
    if not reserves_caseops(sp) or (caseops and want and tokenizer_sha256 and want != tokenizer_sha256):
        why = "does not reserve the CaseOps operators" if not reserves_caseops(sp) else \
            f"has sha256 {tokenizer_sha256[:16]}..., not the manifest's {want[:16]}..."
        raise ValueError(f"TOKENIZER_PATH={tokenizer_path}: {why}; DATA_PATH={data_path} is CaseOps data (a byte "
                         f"sidecar); expected its tokenizer ({manifest.get('tokenizer', 'the CaseOps sp8192 model')})")
    val = list_shards(data_path, "val")
    val_counts = [read_shard_header(p) for p in val]
    side_counts = [read_shard_header(p) for p in files]
    if side_counts != val_counts:
        raise ValueError(f"DATA_PATH={data_path}: the byte sidecar holds {sum(side_counts):,} counts in {len(files)} "
                         f"shard(s), the val split {sum(val_counts):,} tokens in {len(val)} shard(s) "
                         f"({side_counts[:4]} vs {val_counts[:4]}); expected one count per val token, shard by shard "
                         "(remake the dataset with tools/prepare_data.py caseops)")
    return {"val_byte_count": BYTE_COUNT_SIDECAR, "val_bytes_shards": [p.name for p in files],
            "val_bytes_tokens": sum(side_counts)}


def require_val_bytes(data_path, sp, tokenizer_path, tokenizer_sha256=None) -> dict:
    """CASEOPS_ENABLED=1: check_val_bytes, and ValueError naming CASEOPS_ENABLED and DATA_PATH when the data has
    no byte sidecar (plain data, which the tokenizer's byte LUT scores)."""
    info = check_val_bytes(data_path, sp, tokenizer_path, tokenizer_sha256)
    if info["val_byte_count"] != BYTE_COUNT_SIDECAR:
        raise ValueError(f"CASEOPS_ENABLED=True: DATA_PATH={data_path} has no byte sidecar {VAL_BYTES_PREFIX}*.bin; "
                         "expected CaseOps data (tools/prepare_data.py caseops)")
    return info


def load_val_bytes(data_path):
    """The sidecar of `data_path` concatenated in sorted order: int16 torch tensor [N], N = val tokens,
    entry i = the original UTF-8 bytes of val token i. ValueError naming the file for an entry over
    32767 (no token stands for that many bytes: not a byte sidecar)."""
    import torch

    parts = []
    for path in list_val_byte_shards(data_path):
        counts = load_data_shard(path)
        if counts.numel() and int(counts.numpy().max()) > 32767:
            raise ValueError(f"{path}: a count of {int(counts.numpy().max())} bytes for one token; expected a byte sidecar")
        parts.append(torch.from_numpy(counts.numpy().astype(np.int16)))
    return torch.cat(parts)
