"""Challenge token shards: write, read and validate `fineweb_{train,val}_NNNNNN.bin` files.

Official format (openai/parameter-golf data export, same as modded-nanogpt): a header of 256
little-endian int32 (magic 20240520, version 1, num_tokens, rest 0) followed by num_tokens
little-endian uint16 token ids. A dataset dir may hold `manifest.json` (written by
tools/prepare_data.py) with per-split counts and the files of document hashes used to prove that
the train and val splits are disjoint.
"""

import json
import os
from pathlib import Path

import numpy as np
import torch

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
SHARD_TOKENS_PER_FILE = 100_000_000
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
SHARD_MANIFEST_FORMAT = "parameter-golf-shards"


def write_data_shard(path, tokens) -> None:
    """Write `tokens` (integer array [N], ids in [0, 65535]) as one shard file, atomically.

    Writes `path.tmp` in the same dir, fsyncs, then renames. Raises ValueError (naming the path)
    for a non-integer / non-1-D array, ids that do not fit uint16, or N >= 2**31.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"shard {path}: expected a 1-D integer token array, got dtype {arr.dtype} shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 65535):
        raise ValueError(f"shard {path}: token ids must fit uint16 [0, 65535], got range [{arr.min()}, {arr.max()}]")
    if arr.size >= 2**31:
        raise ValueError(f"shard {path}: {arr.size} tokens do not fit the int32 header count")
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, arr.size)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(arr.astype("<u2", copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard_header(path) -> int:
    """Return num_tokens of the shard at `path` after validating its header and file size.

    Raises FileNotFoundError if absent; ValueError naming the path for a truncated header, wrong
    magic or version, negative count, or a file size other than 1024 + 2 * num_tokens bytes.
    """
    path = Path(path)
    size_bytes = path.stat().st_size
    if size_bytes < SHARD_HEADER_BYTES:
        raise ValueError(f"shard {path}: truncated, {size_bytes} bytes is shorter than the {SHARD_HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    if int(header[0]) != SHARD_MAGIC:
        raise ValueError(f"shard {path}: bad magic {int(header[0])}, expected {SHARD_MAGIC} (not a challenge shard)")
    if int(header[1]) != SHARD_VERSION:
        raise ValueError(f"shard {path}: unsupported version {int(header[1])}, expected {SHARD_VERSION}")
    num_tokens = int(header[2])
    expected_bytes = SHARD_HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size_bytes != expected_bytes:
        what = "truncated" if size_bytes < expected_bytes else "size mismatch"
        raise ValueError(f"shard {path}: {what}: header says {num_tokens} tokens ({expected_bytes} bytes), file has {size_bytes} bytes")
    return num_tokens


def load_data_shard(path) -> torch.Tensor:
    """Load one shard as a uint16 tensor [num_tokens]; header and size validated first (ValueError)."""
    num_tokens = read_shard_header(path)
    tokens = np.fromfile(path, dtype="<u2", count=num_tokens, offset=SHARD_HEADER_BYTES)
    assert tokens.size == num_tokens, (path, tokens.size, num_tokens)
    return torch.from_numpy(tokens.astype(np.uint16, copy=False))


def list_shards(data_path, split: str) -> list[Path]:
    """Sorted shard paths `fineweb_{split}_*.bin` in dir `data_path`; split is "train" or "val".

    Raises ValueError for another split, FileNotFoundError naming the dir and pattern if none match.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    pattern = f"fineweb_{split}_*.bin"
    files = sorted(Path(data_path).glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {split} shards matching {pattern} in DATA_PATH={data_path}")
    return files


def load_validation_tokens(data_path, vocab_size=None) -> torch.Tensor:
    """All val shards of `data_path` concatenated in sorted order, int64 [N] (BOS tokens kept).

    Raises ValueError if there are no tokens or (when vocab_size is given) any id >= vocab_size,
    naming the shard; FileNotFoundError if there are no val shards.
    """
    parts = []
    for path in list_shards(data_path, "val"):
        part = load_data_shard(path).to(torch.int64)  # uint16 tensors lack most ops (max, index)
        if vocab_size is not None and part.numel() and int(part.max()) >= vocab_size:
            raise ValueError(f"shard {path}: token id {int(part.max())} >= VOCAB_SIZE={vocab_size} (tokenizer/data mismatch)")
        parts.append(part)
    tokens = torch.cat(parts)
    if tokens.numel() == 0:
        raise ValueError(f"val shards in DATA_PATH={data_path} hold no tokens")
    return tokens


def _shard_read_doc_hashes(path: Path) -> np.ndarray:
    # One 16-hex-char hash per line: a fixed 17-byte record, so numpy reads it without a Python loop.
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size % 17 or (raw.size and not (raw.reshape(-1, 17)[:, 16] == 10).all()):
        raise ValueError(f"doc hash file {path}: expected lines of 16 hex chars")
    return raw.reshape(-1, 17)[:, :16].copy().view("S16").ravel()


def check_data_manifest(data_path, vocab_size=None, log=print) -> dict | None:
    """Validate `data_path/manifest.json`; return it with "splits_disjoint" added, or None if absent.

    splits_disjoint is True when the train and val document-hash files were compared (no hash in
    both), None when the manifest lists no hash files (overlap check skipped, logged). Raises
    ValueError for an unreadable/foreign manifest, a vocab_size that differs from VOCAB_SIZE,
    a listed shard or hash file that is missing, or train/val documents that overlap.
    """
    path = Path(data_path) / "manifest.json"
    if not path.is_file():
        log(f"warning: no manifest.json in DATA_PATH={data_path}: split disjointness not verified")
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"manifest {path}: unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != SHARD_MANIFEST_FORMAT:
        raise ValueError(f"manifest {path}: expected format {SHARD_MANIFEST_FORMAT!r}")
    if vocab_size is not None and manifest.get("vocab_size") != vocab_size:
        raise ValueError(f"manifest {path}: vocab_size {manifest.get('vocab_size')} != VOCAB_SIZE={vocab_size}")
    splits = manifest.get("splits") or {}
    hashes = {}
    for split in ("train", "val"):
        info = splits.get(split) or {}
        for name in info.get("shards", []):
            if not (path.parent / name).is_file():
                raise ValueError(f"manifest {path}: {split} shard {name} is missing")
        if info.get("doc_hashes_file"):
            hash_path = path.parent / info["doc_hashes_file"]
            if not hash_path.is_file():
                raise ValueError(f"manifest {path}: {split} doc hash file {hash_path.name} is missing")
            hashes[split] = _shard_read_doc_hashes(hash_path)
    manifest = dict(manifest, splits_disjoint=None)
    if len(hashes) < 2:
        log(f"manifest {path}: no doc hashes for both splits; skipping the train/val overlap check")
        return manifest
    overlap = np.unique(hashes["val"][np.isin(hashes["val"], hashes["train"])])
    if overlap.size:
        raise ValueError(f"manifest {path}: {overlap.size} val documents also appear in train (e.g. hash {overlap[0].decode()})")
    manifest["splits_disjoint"] = True
    return manifest
