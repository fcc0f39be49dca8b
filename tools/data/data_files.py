"""File helpers of the data tools (tools/prepare_data.py): fsync + rename, sha256 of a file, JSON
written atomically, and the keys every dataset manifest.json starts with."""

import json
import os
from pathlib import Path

from primitives.files import atomic_write_bytes, sha256_file  # noqa: F401  (callers import it from here)
from shards.format import SHARD_MANIFEST_FORMAT


def fsync_replace(tmp: Path, path: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def manifest_header(tokenizer_path: Path, vocab_size: int, bos_id: int, name: str = None) -> dict:
    """The keys every manifest.json starts with (format, tokenizer identity, BOS, no EOS). `name`:
    the tokenizer's file name when `tokenizer_path` is a temporary file (default: its own name)."""
    return {"format": SHARD_MANIFEST_FORMAT, "format_version": 1, "tokenizer": name or tokenizer_path.name,
            "tokenizer_sha256": sha256_file(tokenizer_path), "vocab_size": vocab_size, "bos_id": bos_id,
            "append_eos": False}


def write_json_atomic(path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())
