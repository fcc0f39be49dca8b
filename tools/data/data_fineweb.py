"""The `fineweb` download (tools/prepare_data.py fineweb): a cached FineWeb export (shards + tokenizer)
from a Hugging Face dataset repo, driven by the repo's manifest like the official
data/cached_challenge_fineweb.py, plus our manifest.json."""

import json
import re
import sys
from pathlib import Path, PurePosixPath

import numpy as np
from tqdm import tqdm

from tools.data.data_files import fsync_replace, manifest_header, sha256_file, write_json_atomic
from tools.data.data_stage import link_or_copy, staged_writes
from tools.data.data_tokenizer import load_tokenizer
from shards.format import read_shard_header

DEFAULT_HF_REPO_ID = "willdepueoai/parameter-golf"
LARGE_VOCAB_HF_REPO_ID = "kevclark/parameter-golf"  # sp4096 / sp8192 exports of the same documents
HUB_MANIFESTS_DIR = "hub_manifests"
DEFAULT_HF_REMOTE_ROOT = "datasets"
OFFLINE_MODES_HINT = (
    "Offline alternatives: `python tools/prepare_data.py sample --out data` (real English text that "
    "ships with Python, no network) or `python tools/prepare_data.py jsonl --input DOCS.jsonl "
    "--tokenizer MODEL --out DIR --val-docs N` (your own text)."
)


class HubUnreachableError(RuntimeError):
    """The Hugging Face Hub could not be reached (no network, offline mode, DNS, timeout)."""


def dataset_dir_for_variant(variant: str) -> str:
    """Official dataset dir name: sp1024 -> fineweb10B_sp1024, byte260 -> fineweb10B_byte260."""
    if variant == "byte260" or re.fullmatch(r"sp[0-9]+", variant):
        return f"fineweb10B_{variant}"
    raise ValueError(f"--variant {variant!r}: expected sp<VOCAB_SIZE> (e.g. sp1024) or byte260")


def local_path_for_remote(remote_path: str, remote_root: str, out_root) -> Path:
    """Map `<remote_root>/datasets/X` -> out_root/datasets/X, `<remote_root>/tokenizers/X` ->
    out_root/tokenizers/X, `<remote_root>/manifest.json` -> out_root/manifest.json."""
    parts = PurePosixPath(remote_path).parts
    if remote_root and parts[:1] == (remote_root,):
        parts = parts[1:]
    if not parts or any(p in ("..", ".", "") or "/" in p or "\\" in p for p in parts) or PurePosixPath(remote_path).is_absolute():
        raise ValueError(f"refusing remote path {remote_path!r} (empty, absolute or with '..')")
    return Path(out_root).joinpath(*parts)


_REPO_ID_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def check_repo_id(repo_id) -> tuple:
    """Split a Hugging Face repo id `owner/name` into (owner, name), each safe as a path part.

    Raises ValueError naming --repo-id for anything else: not two parts, characters other than
    letters, digits, '-', '_', '.', a part starting or ending with '-'/'.', or containing '..'/'--'.
    """
    parts = repo_id.split("/") if isinstance(repo_id, str) else []
    if len(parts) != 2 or not all(_REPO_ID_PART.fullmatch(p) and ".." not in p and "--" not in p for p in parts):
        raise ValueError(f"--repo-id {repo_id!r}: expected a Hugging Face dataset repo id 'owner/name' (letters, "
                         f"digits, '-', '_', '.'), e.g. {DEFAULT_HF_REPO_ID} or {LARGE_VOCAB_HF_REPO_ID}")
    return parts[0], parts[1]


def hub_manifest_remote_path(remote_root: str) -> str:
    return f"{remote_root}/manifest.json" if remote_root else "manifest.json"


def hub_manifest_local_path(out_root, repo_id: str, remote_root: str = DEFAULT_HF_REMOTE_ROOT) -> Path:
    """Where the manifest of dataset repo `repo_id` is kept, one per repo (and remote root):
    out_root/hub_manifests/<owner>/<name>/<remote_root>/manifest.json.
    Raises ValueError for a repo id that is not `owner/name` or a remote root with '..'."""
    owner, name = check_repo_id(repo_id)
    return local_path_for_remote(hub_manifest_remote_path(remote_root), "", Path(out_root) / HUB_MANIFESTS_DIR / owner / name)


def hf_download(repo_id: str, remote_path: str) -> Path:
    """Download one file of the dataset repo into the Hugging Face cache; return its cached path."""
    from huggingface_hub import hf_hub_download

    remote = PurePosixPath(remote_path)
    subfolder = None if str(remote.parent) == "." else str(remote.parent)
    return Path(hf_hub_download(repo_id=repo_id, filename=remote.name, subfolder=subfolder, repo_type="dataset"))


_UNREACHABLE_NAMES = {"LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError", "ConnectError",
                      "ConnectTimeout", "TimeoutError", "TimeoutException", "NetworkError", "gaierror"}


def _is_unreachable(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in _UNREACHABLE_NAMES for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def download_fineweb(variant: str, train_shards: int, out_root="data", *, repo_id: str = DEFAULT_HF_REPO_ID,
                     remote_root: str = DEFAULT_HF_REMOTE_ROOT, downloader=hf_download, progress=True,
                     log=print) -> dict:
    """`fineweb` subcommand: official cached export, manifest-driven (as data/cached_challenge_fineweb.py).

    Reads `<remote_root>/manifest.json` of the dataset repo, downloaded again on every call and kept
    per repo (hub_manifest_local_path; when the hub is unreachable a kept copy is used, with a warning):
    `datasets[]` entries {name, tokenizer_name, stats: {files_train, files_val, docs_val, ...}} and
    `tokenizers[]` entries {name, vocab_size, bos_id, model_path, vocab_path}. Fetches all val
    shards, train shards 0..train_shards-1 and the tokenizer files that are not already present
    (valid shards of the dataset dir are kept), into a new folder beside the dataset dir with our
    manifest.json, swapped in when complete (tools/data/data_stage.py; no doc hashes: the overlap check is
    skipped there; it records the repo id and the tokenizer's sha256, so a tokenizer file already
    present from another repo shows). downloader(repo_id, remote_path) -> cached file path
    (injectable for tests). Raises ValueError for a bad variant / repo id / shard count / manifest
    (before any download for the first two), HubUnreachableError offline.
    """
    dataset_name = dataset_dir_for_variant(variant)
    if train_shards < 0:
        raise ValueError(f"--train-shards must be >= 0, got {train_shards}")
    out_root = Path(out_root)
    hub_manifest_path = hub_manifest_local_path(out_root, repo_id, remote_root)

    def download(remote_path: str, dest: Path) -> None:
        """The repo's file at `dest` (a temporary name: a hard link to the cache blob, or a copy)."""
        try:
            cached = Path(downloader(repo_id, remote_path)).resolve(strict=True)
        except Exception as exc:
            if _is_unreachable(exc):
                raise HubUnreachableError(f"cannot reach the Hugging Face Hub for dataset repo {repo_id} "
                                          f"(file {remote_path}): {type(exc).__name__}: {exc}\n{OFFLINE_MODES_HINT}") from exc
            raise ValueError(f"cannot download {remote_path} from dataset repo {repo_id}: {type(exc).__name__}: {exc}") from exc
        dest.unlink(missing_ok=True)
        link_or_copy(cached, dest)  # the HF cache blob: hard link when on the same filesystem
        if dest.suffix == ".bin":
            read_shard_header(dest)

    def fetch(remote_path: str, dest: Path) -> Path:  # the hub manifest: always downloaded again
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        try:
            download(remote_path, tmp)
            fsync_replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    try:
        fetch(hub_manifest_remote_path(remote_root), hub_manifest_path)
    except HubUnreachableError as exc:
        if not hub_manifest_path.is_file():
            raise
        log(f"warning: {str(exc).splitlines()[0]}; using the copy kept in {hub_manifest_path} (may be stale)")
    try:
        hub_manifest = json.loads(hub_manifest_path.read_text(encoding="utf-8"))
        entry = next((d for d in hub_manifest.get("datasets", []) if d.get("name") == dataset_name), None)
    except (json.JSONDecodeError, AttributeError, TypeError) as exc:
        raise ValueError(f"{hub_manifest_path}: not a dataset manifest: {exc}") from None
    if entry is None:
        names = [d.get("name") for d in hub_manifest.get("datasets", [])]
        hint = ""
        if variant in ("sp4096", "sp8192") and repo_id != LARGE_VOCAB_HF_REPO_ID:
            hint = f"; the {variant} export is in --repo-id {LARGE_VOCAB_HF_REPO_ID}"
        raise ValueError(f"dataset {dataset_name} (--variant {variant}) not in {hub_manifest_path} (dataset repo "
                         f"{repo_id}); available: {names}{hint}")
    stats = entry.get("stats") or {}
    try:
        num_train_available, num_val_files = int(stats["files_train"]), int(stats["files_val"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{hub_manifest_path}: dataset {dataset_name} lacks stats.files_train/files_val") from None
    if train_shards > num_train_available:
        raise ValueError(f"--train-shards {train_shards}: {variant} has only {num_train_available} train shards on {repo_id}")
    tok_entry = next((t for t in hub_manifest.get("tokenizers", []) if t.get("name") == entry.get("tokenizer_name")), None)
    if tok_entry is None:
        raise ValueError(f"{hub_manifest_path}: tokenizer {entry.get('tokenizer_name')!r} of {dataset_name} not listed")
    tok_files = [str(tok_entry[k]) for k in ("model_path", "vocab_path", "path") if tok_entry.get(k)]
    if not tok_files:
        raise ValueError(f"{hub_manifest_path}: tokenizer entry {tok_entry.get('name')!r} lists no files")

    prefix = f"{remote_root}/" if remote_root else ""
    remote_files = [f"{prefix}datasets/{dataset_name}/fineweb_val_{i:06d}.bin" for i in range(num_val_files)]
    remote_files += [f"{prefix}datasets/{dataset_name}/fineweb_train_{i:06d}.bin" for i in range(train_shards)]
    data_path = out_root / "datasets" / dataset_name
    tokenizer_path = local_path_for_remote(f"{prefix}{tok_files[0]}", remote_root, out_root)
    with staged_writes(log) as stage:  # a new folder beside data_path, swapped in when complete
        folder = stage.folder(data_path)
        _link_valid_shards(data_path, folder, log)
        for remote in tqdm(remote_files, desc=f"download {dataset_name}", unit="file", disable=None if progress else True,
                           file=sys.stderr):
            dest = folder / PurePosixPath(remote).name
            if not dest.is_file():
                download(remote, dest)
        tokenizer_file = tokenizer_path
        for remote in (f"{prefix}{p}" for p in tok_files):  # a tokenizer file already there is kept
            dest = local_path_for_remote(remote, remote_root, out_root)
            if not dest.is_file():
                tmp = stage.file(dest)
                download(remote, tmp)
                tokenizer_file = tmp if dest == tokenizer_path else tokenizer_file
        manifest = _fineweb_manifest(folder, tokenizer_file, tokenizer_path.name, tok_entry, entry, stats, log)
        manifest["source"] = {"command": "fineweb", "repo_id": repo_id, "remote_root": remote_root, "variant": variant,
                              "dataset": dataset_name, "num_train_shards_available": num_train_available,
                              "hub_stats": stats,
                              "note": "no document hashes published: train/val overlap not checkable"}
        write_json_atomic(folder / "manifest.json", manifest)
    splits = manifest["splits"]
    log(f"{dataset_name}: val {splits['val']['num_tokens']} tokens, train {len(splits['train']['shards'])} shards "
        f"{splits['train']['num_tokens']} tokens")
    return {"data_path": data_path, "tokenizer_path": tokenizer_path, "vocab_size": manifest["vocab_size"],
            "manifest": manifest}


def _link_valid_shards(old: Path, new: Path, log) -> None:
    """Hard-link (or copy) the shards of the previous dataset folder whose header is valid into the
    new one, so a re-run downloads only what is missing or damaged."""
    if not old.is_dir():
        return
    for shard in sorted(old.glob("fineweb_*_*.bin")):
        try:
            read_shard_header(shard)
        except (ValueError, OSError) as exc:
            log(f"re-downloading damaged {shard}: {exc}")
            continue
        link_or_copy(shard, new / shard.name)


def _fineweb_manifest(folder: Path, tokenizer_file: Path, tokenizer_name: str, tok_entry, entry, stats, log) -> dict:
    """Our manifest.json for the downloaded shards in `folder` (counts read from the shards)."""
    bos_id = int(tok_entry.get("bos_id", entry.get("bos_id", 1)))
    vocab_size = int(tok_entry.get("vocab_size", entry.get("vocab_size", 0)))
    if tokenizer_name.endswith(".model"):
        vocab_size = int(load_tokenizer(tokenizer_file).vocab_size())
    splits = {}
    for split in ("val", "train"):
        names = sorted(p.name for p in folder.glob(f"fineweb_{split}_*.bin"))
        num_tokens = num_docs = 0
        for name in names:
            num_tokens += read_shard_header(folder / name)
            tokens = np.memmap(folder / name, dtype="<u2", mode="r", offset=1024)
            num_docs += int(np.count_nonzero(tokens == bos_id))  # one BOS per document (official layout)
        splits[split] = {"num_docs": num_docs, "num_tokens": num_tokens, "shards": names,
                         "shard_sha256": [sha256_file(folder / name) for name in names]}  # shards/format.py verify_dataset
    if stats.get("docs_val") is not None and int(stats["docs_val"]) != splits["val"]["num_docs"]:
        log(f"warning: {splits['val']['num_docs']} BOS tokens in val shards, hub manifest says docs_val={stats['docs_val']}")
    return {**manifest_header(tokenizer_file, vocab_size, bos_id, name=tokenizer_name), "splits": splits}
