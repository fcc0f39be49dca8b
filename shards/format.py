"""Challenge token shards: the format, its reader and writer, the dataset manifest check.

Official format (openai/parameter-golf data export, as modded-nanogpt): a header of 256
little-endian int32 (magic 20240520, version 1, num_tokens, rest 0), then num_tokens little-endian
uint16 token ids: a valid file has exactly 1024 + 2 * num_tokens bytes. A dataset dir may hold
`manifest.json` (tools/prepare_data.py writes it) with per-split counts and the files of document
hashes that prove the train and val splits disjoint. torch is imported where a tensor is made:
tools/prepare_data.py writes shards, and its bad inputs fail before torch's import (seconds).
"""

import filecmp
import json
import os
from pathlib import Path

import numpy as np

from primitives.env import BUNDLE_KIND
from primitives.files import atomic_write_bytes, sha256_file

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_HEADER_INTS = 256
SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4
SHARD_TOKENS_PER_FILE = 100_000_000
SHARD_MANIFEST_FORMAT = "parameter-golf-shards"


def read_shard_header(path) -> int:
    """Return num_tokens of the shard at `path` after validating its header and file size.

    Raises FileNotFoundError if absent; ValueError naming the path (with the first three header
    ints and the file size) for a wrong magic or version, a negative count, or a file size other
    than 1024 + 2 * num_tokens bytes (which covers a truncated header or payload).
    """
    size_bytes = os.path.getsize(path)
    # Padded with -1 so that a header cut short still unpacks, and then fails the check.
    header = np.fromfile(path, "<i4", 3).tolist() + [-1] * 3
    if header[:2] != [SHARD_MAGIC, SHARD_VERSION] or not 0 <= 2 * header[2] == size_bytes - SHARD_HEADER_BYTES:
        raise ValueError(f"shard {path}: magic, version, n {header[:3]}, {size_bytes} bytes; "
                         f"expected [{SHARD_MAGIC}, {SHARD_VERSION}, n], {SHARD_HEADER_BYTES} + 2n bytes")
    return header[2]


def load_data_shard(path):
    """Load one shard as a uint16 torch tensor [num_tokens]; header and size validated first (ValueError)."""
    import torch

    return torch.from_numpy(np.fromfile(path, "<u2", read_shard_header(path), offset=SHARD_HEADER_BYTES))


def write_data_shard(path, tokens) -> None:
    """Write `tokens` (integer array [N], ids in [0, 65535]) as one shard file, atomically.

    Raises ValueError (naming the path) for a non-integer / non-1-D array, ids that do not fit
    uint16, or N >= 2**31.
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
    atomic_write_bytes(path, header.tobytes() + arr.astype("<u2", copy=False).tobytes())


def list_shards(data_path, split: str) -> list:
    """Sorted shard paths `fineweb_{split}_*.bin` (split "train" or "val") in dir `data_path`.

    Raises ValueError naming DATA_PATH and the pattern if none match (a user's input error, so the
    CLIs exit 2 with one line, with or without a manifest.json).
    """
    files = _shard_files(data_path, split)
    if not files:
        raise ValueError(f"DATA_PATH={data_path}: no fineweb_{split}_*.bin")
    if BUNDLE_KIND == "package":  # the kit's one line for a folder or a dangling link named like a shard
        for path in files:
            if not path.is_file():
                what = ("is a folder" if path.is_dir() else f"is a dangling symlink (to {os.readlink(path)})"
                        if path.is_symlink() else "is not a regular file")
                raise ValueError(f"DATA_PATH={data_path}: {path.name} {what}; expected a shard file")
    return files


def _shard_files(data_path, split: str) -> list:
    # a CaseOps byte sidecar (fineweb_val_bytes_*.bin, shards/sidecar.py) matches the val pattern: not a val shard
    return sorted(p for p in Path(data_path).glob(f"fineweb_{split}_*.bin") if not p.name.startswith("fineweb_val_bytes_"))


def val_shard_copy(path, val_files):
    """The first of `val_files` that the shard at `path` is: the same file (a link) or a copy (same
    size and bytes, read up to the first differing block); None otherwise, or when it holds no tokens."""
    for val in val_files if os.path.getsize(path) > SHARD_HEADER_BYTES else ():
        if filecmp.cmp(path, val, shallow=False):  # regular files of one size and the same bytes
            return val
    return None


def load_validation_tokens(data_path, vocab_size=None):
    """All val shards of `data_path` concatenated in sorted order, an int64 torch tensor [N] (BOS kept).

    Raises ValueError naming DATA_PATH and the largest id (-1 when there are no tokens) if there
    are no val shards, no tokens or (when vocab_size is given) any id >= vocab_size.
    """
    import torch

    tokens = torch.cat([load_data_shard(p).long() for p in list_shards(data_path, "val")])
    top_id = tokens.numpy().max(initial=-1)  # ids are >= 0: -1 means no tokens
    if top_id < 0 or vocab_size and top_id >= vocab_size:
        raise ValueError(f"val shards in DATA_PATH={data_path}: max id {top_id}; expected tokens, ids < VOCAB_SIZE={vocab_size}")
    return tokens


def check_data_manifest(data_path, vocab_size=None, log=print, tokenizer_path=None):
    """Validate `data_path/manifest.json` and prove that its train and val documents are disjoint.

    Returns the manifest (dict) when the train and val document-hash files were compared and no
    hash is in both; None, with a warning through `log`, when that check could not run (no
    manifest, or no hash file for both splits, as in the official HF download), so that
    `manifest is not None` means "splits verified disjoint". A hash file holds one 16-hex-char hash
    per line (fixed 17-byte records, compared by numpy without a Python loop). Raises ValueError
    naming the manifest for an unreadable or foreign manifest, a vocab_size other than VOCAB_SIZE,
    a listed shard or hash file that is missing or malformed, a split whose listed shards' header
    counts do not add up to its `num_tokens` (a shard replaced, e.g. a val shard copied over a train
    shard), or train/val documents that overlap; and naming TOKENIZER_PATH when the sha256 of
    `tokenizer_path` (the run's tokenizer) is not the manifest's (the data was made with another tokenizer).
    """
    manifest, disjoint = checked_manifest(data_path, vocab_size, log, tokenizer_path)
    return manifest if disjoint else None


def checked_manifest(data_path, vocab_size=None, log=print, tokenizer_path=None) -> tuple:
    """(the manifest as check_data_manifest checks it, None without one; True when its train and val document
    hashes were compared and are disjoint): check_data_manifest's checks, for the callers that read the
    manifest's other entries too (verify_dataset). Raises what check_data_manifest raises."""
    path = Path(data_path) / "manifest.json"
    hashes, manifest = [], None
    if path.is_file():
        try:
            manifest = json.loads(path.read_bytes())
            got = manifest["format"], vocab_size and manifest["vocab_size"]
            if got != (SHARD_MANIFEST_FORMAT, vocab_size):
                raise ValueError(f"got (format, vocab_size) {got}")
            for info in manifest["splits"].values():
                for name in info["shards"]:
                    (path.parent / name).stat()  # FileNotFoundError names a missing shard
                if "doc_hashes_file" in info:
                    hashes.append(np.fromfile(path.parent / info["doc_hashes_file"], np.uint8).reshape(-1, 17).view("S17"))
        except Exception as e:
            raise ValueError(f"manifest {path}: {e}; expected format {SHARD_MANIFEST_FORMAT}, vocab_size "
                             f"VOCAB_SIZE={vocab_size}, the listed files, lines of 16 hex chars") from e
        want = manifest.get("tokenizer_sha256")
        if tokenizer_path and want and want != (got := sha256_file(tokenizer_path)):
            raise ValueError(f"TOKENIZER_PATH={str(tokenizer_path)!r}: sha256 {got[:16]}... is not the tokenizer_sha256 "
                             f"{want[:16]}... of {path}; expected the tokenizer the data was made with "
                             f"({manifest.get('tokenizer', 'named in the manifest')})")
        if BUNDLE_KIND == "package":  # the kit's: verify_dataset's sha256 per shard binds the shards in a record's file
            check_manifest_counts(path, manifest)
    if len(hashes) < 2:
        if BUNDLE_KIND == "package":  # (result.json's compliance says it: `unverified`)
            log(f"warning: no doc hashes of both splits in {path}: train/val overlap not checked")
        return manifest, False
    common = np.intersect1d(*hashes)
    if len(common):
        raise ValueError(f"manifest {path}: {len(common)} documents in both train and val, e.g. hash {common[0][:16].decode()}")
    return manifest, True


def check_manifest_counts(path: Path, manifest: dict) -> None:
    """ValueError naming the manifest and a shard unless each split's listed shards hold (header
    counts) its `num_tokens`, and every shard but a split's last holds `shard_tokens` when given."""
    for split, info in manifest["splits"].items():
        names = info["shards"]
        counts = [read_shard_header(path.parent / n) for n in names]
        per_shard = manifest.get("shard_tokens")
        odd = [(n, c) for n, c in zip(names[:-1], counts) if per_shard and c != per_shard]
        if names and per_shard and counts[-1] > per_shard:
            odd.append((names[-1], counts[-1]))
        if odd or ("num_tokens" in info and sum(counts) != info["num_tokens"]):
            shard = f" ({odd[0][0]} holds {odd[0][1]:,}, expected {per_shard:,})" if odd else ""
            raise ValueError(f"manifest {path}: the {split} shards hold {sum(counts):,} tokens{shard}; the manifest "
                             f"says {info.get('num_tokens', sum(counts)):,}: a shard was replaced or changed (e.g. a val "
                             f"shard copied over a train shard); expected the shards the manifest was written with")


def verify_dataset(data_path, tokenizer_path, vocab_size=None, log=print, hash_splits=("train", "val")):
    """The one binding of a dataset to its consumer (the trainer, python -m eval score|bytes, the
    auditor's measurement): check_data_manifest with `tokenizer_path`, then every
    fineweb_{train,val}_*.bin in `data_path` must be a shard its manifest.json lists, and each listed
    shard of `hash_splits` must have the sha256 the manifest records (splits.<split>.shard_sha256,
    tools/prepare_data.py; one streamed read per file, no cache: a 100M-token shard is 200 MB).

    Returns check_data_manifest's value (the manifest, None when the splits are not proven disjoint).
    A manifest without per-shard sha256 (a dataset made before they were recorded) logs one WARNING
    line: the shards are unverified. Raises ValueError (one line) naming TOKENIZER_PATH for a
    tokenizer that is not the manifest's, and DATA_PATH and the file for an unlisted shard (e.g. an
    extra val shard) or a shard whose bytes changed (e.g. val tokens written into a train shard).
    """
    manifest, disjoint = checked_manifest(data_path, vocab_size, log, tokenizer_path)
    if manifest is None:
        return None  # checked_manifest warned: nothing to bind the shards to
    path, splits = Path(data_path) / "manifest.json", manifest["splits"]
    for split in ("train", "val"):
        listed = splits.get(split, {}).get("shards", [])
        extra = [p.name for p in _shard_files(data_path, split) if p.name not in listed]
        if extra:
            raise ValueError(f"DATA_PATH={data_path}: {extra[0]} is not a {split} shard of {path} ({len(extra)} unlisted); "
                             f"expected only the shards the manifest lists")
    if BUNDLE_KIND == "package":  # (result.json's compliance says it: `unverified`)
        unhashed = [s for s in hash_splits if s in splits and "shard_sha256" not in splits[s]]
        if unhashed:
            log(f"WARNING: {path} records no sha256 per shard ({', '.join(unhashed)}): the shards are unverified "
                f"(tools/prepare_data.py records them in new datasets)")
    for split in hash_splits:
        info = splits.get(split, {})
        if "shard_sha256" not in info:
            continue  # a dataset made before they were recorded: unverified
        names, hashes = info["shards"], info["shard_sha256"]
        if len(hashes) != len(names):
            raise ValueError(f"manifest {path}: {len(hashes)} shard_sha256 for {len(names)} {split} shards; expected one each")
        for name, want in zip(names, hashes):
            got = sha256_file(path.parent / name)
            if got != want:
                raise ValueError(f"DATA_PATH={data_path}: {split} shard {name} has sha256 {got[:16]}..., not the "
                                 f"{want[:16]}... {path.name} records; expected the shard as the dataset was made")
    return manifest if disjoint else None


def shards_unverified(data_path, manifest: dict = None) -> str | None:
    """Why the shards of `data_path` are not bound by sha256 (no manifest.json, or one without
    shard_sha256 for a split), None when they are (verify_dataset checked them). `manifest`: the one
    verify_dataset returned (the trainer's compliance flags); None: read here (the package's callers)."""
    path = Path(data_path) / "manifest.json"
    if BUNDLE_KIND == "package":  # a record's file passes the manifest its run checked
        if manifest is None:
            try:
                manifest = {"splits": json.loads(path.read_bytes())["splits"]}
            except (OSError, ValueError, KeyError, TypeError):
                return f"no readable manifest.json in DATA_PATH={data_path}: the shards' bytes are not checked"
    missing = [s for s, info in manifest["splits"].items() if "shard_sha256" not in info]
    return f"{path} records no sha256 per shard ({', '.join(missing)}): the shards are unverified" if missing else None
