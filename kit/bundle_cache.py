"""What a package run remembers of the bundler's work between runs: the human source it would ship for its
settings and that file's packed size. Building them costs a package run ~1.5 s (the human source) and ~3 s
(minifying and trying every compressor) on one core before its first step; every later run with the same
sources and settings reads them back in milliseconds.

Each entry is one file under `cache_dir` (default env BUNDLE_CACHE_DIR, else ~/.cache/parameter-golf-kit/bundle)
named by a sha256 over everything it depends on, so a changed source, bundler, setting or library version is
a different entry, never a stale one. An unreadable, damaged or unwritable cache only costs the build.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import zlib
from importlib import metadata
from pathlib import Path

from kit.bundle_modules import REPO_ROOT, BundleError, package_relpaths
from kit.bundle_pack import default_encoding, human_and_header, minify_source, pack_code, set_bundle_kind
from kit.bundle_when import condition_names
from primitives.files import atomic_write_bytes

KIT_DIR = Path(__file__).resolve().parent
# human sources kept (each ~50 KB compressed); the least recently used beyond this are removed when one is added
MAX_HUMAN_ENTRIES = 32
HUMAN_PREFIX = "human-"


def cache_dir_of(cache_dir=None) -> Path:
    return Path(cache_dir or os.environ.get("BUNDLE_CACHE_DIR") or Path.home() / ".cache/parameter-golf-kit/bundle")


def _digest(parts: list) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()


def _bundler_parts() -> list:
    """The bundler's own code (every kit/bundle*.py) and the versions of Python and the packing libraries."""
    parts = [p.read_text(encoding="utf-8") for p in sorted(KIT_DIR.glob("bundle*.py"))] + [sys.version]
    for dist in ("python-minifier", "brotli", "zstandard"):
        try:
            parts.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}: absent")
    return parts


# a module's PACKED_WHEN declaration as kit/bundle_when.py reads it, on one line of its own
_WHEN_START = re.compile(r"^PACKED_WHEN\b", re.M)
_WHEN_LINE = re.compile(r"""^PACKED_WHEN = ("[^"\\\n]*"|'[^'\\\n]*')[ \t]*(#[^\n]*)?$""", re.M)


def package_fingerprint(root=None) -> tuple[str, set | None]:
    """(sha256 over every file the bundler reads under `root` (default: this kit) with their paths, the bundler's
    own code and the library versions; the setting names the modules' PACKED_WHEN conditions read, or None when
    a declaration is not one plain line, the form kit/bundle_when.py documents: then every setting decides)."""
    root = Path(root) if root is not None else REPO_ROOT
    parts, names = [], set()
    for relpath in package_relpaths(root):
        text = (root / relpath).read_text(encoding="utf-8")
        parts.append(f"{relpath}\n{text}")
        found = _WHEN_LINE.findall(text)
        if names is None or len(_WHEN_START.findall(text)) != len(found):
            names = None
            continue
        try:
            names.update(*(condition_names(ast.literal_eval(c)) for c, _ in found))
        except BundleError:  # the build refuses it with its own message
            names = None
    return _digest(parts + _bundler_parts()), names


def _settings_key(settings, names: set | None) -> str:
    """What of the settings the human source depends on: the preset (its rows are kept) and the settings the
    conditions read (the modules kept, the refusals and the header); every setting when `names` is None."""
    if settings is None:
        return "every module"
    names = settings.values if names is None else sorted(names)
    picked = [[n, settings.values.get(n, "<absent>"), settings.owner.get(n)] for n in names]
    return json.dumps([settings.preset, picked], sort_keys=True, default=repr)


def _read(path: Path):
    try:
        return json.loads(zlib.decompress(path.read_bytes()))
    except (OSError, ValueError, zlib.error):  # missing, damaged or half-removed: rebuilt
        return None


def _write(path: Path, entry) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, zlib.compress(json.dumps(entry).encode("utf-8"), 1))
    except OSError:
        pass


def _prune_human(cache: Path) -> None:
    try:
        entries = sorted(cache.glob(f"{HUMAN_PREFIX}*.z"), key=lambda p: p.stat().st_mtime, reverse=True)
        for path in entries[MAX_HUMAN_ENTRIES:]:
            path.unlink(missing_ok=True)
    except OSError:  # another run pruned it first
        pass


def cached_human_and_header(settings=None, cache_dir=None, root=None) -> tuple[str, str]:
    """kit.bundle_pack.human_and_header(root, settings), remembered per package_fingerprint and the settings it
    depends on (runs that differ only in RUN_ID, SEED, DATA_PATH, ... share an entry)."""
    fingerprint, names = package_fingerprint(root)
    key = _digest([fingerprint, _settings_key(settings, names)])
    cache = cache_dir_of(cache_dir)
    path = cache / f"{HUMAN_PREFIX}{key}.z"
    entry = _read(path)
    if isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry):
        try:
            os.utime(path)  # the least recently used entries are the ones pruned
        except OSError:
            pass
        return entry[0], entry[1]
    human, header = human_and_header(root, settings)
    _write(path, [human, header])
    _prune_human(cache)
    return human, header


def packed_size_cache_key(human: str, encoding: str) -> str:
    """sha256 over everything the packed bytes depend on: the concatenated source, the encoding, the bundler's
    own code (every kit/bundle*.py) and the versions of Python, python-minifier, brotli and zstandard."""
    return _digest([human, encoding] + _bundler_parts())


def packed_size(root=None, encoding: str | None = None, cache_dir=None, settings=None, built=None) -> int:
    """len(build_packed_bytes(root, encoding, settings)), remembered per packed_size_cache_key.
    built: human_and_header(root, settings) when the caller has it already (the trainer logs the source too)."""
    encoding = encoding or default_encoding()
    human, header = built or human_and_header(root, settings)
    path = cache_dir_of(cache_dir) / f"{packed_size_cache_key(human, encoding)}.z"
    entry = _read(path)
    if isinstance(entry, dict) and isinstance(entry.get("packed_bytes"), int):
        return entry["packed_bytes"]
    size = len(pack_code(minify_source(set_bundle_kind(human, "packed")), encoding, header)[0])
    _write(path, {"packed_bytes": size})
    return size
