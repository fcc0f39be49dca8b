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


def lock_holder(lock_path) -> str | None:
    """Who holds the flock on `lock_path` (a run folder's run.lock: the text its holder wrote, "pid ... on ...
    since ..."), or None when no process does or there is no such file: for a tool that must not touch a
    running run's folder (tools/sweeps). Holds a shared lock only for the moment it looks."""
    import errno
    import fcntl

    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            busy = err.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN)
            return (handle.read().strip() or "another process") if busy else None
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None
