"""Atomic file writes: the one writer of the kit (artifact, result.json, shards, checkpoints, records).

A leaf module (stdlib only), so quant/, eval/ and tools/ use it without importing the trainer.
"""

import hashlib
import json
import os
from pathlib import Path


def atomic_write_bytes(path, data: bytes) -> None:
    """Write to a temp file `.{name}.tmp{pid}` in the same folder, fsync, then rename: a crash never
    leaves a half-written file at `path`, and a failed write (an OSError, an interrupt) leaves the
    previous file intact and removes its temp file before re-raising."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_json(path, obj: dict) -> None:
    """`obj` as indented JSON with sorted keys and a final newline, written atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_file(path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
