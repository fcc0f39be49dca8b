"""Whole-dataset writes of the data tools (tools/prepare_data.py): every file and dataset folder is
written under a temporary name beside its target and renamed into place only once all of it is
written, so a failure (disk full, a damaged input, Ctrl-C) leaves the previous dataset as it was and
no temporary files, and a new folder is either complete or absent.

    with staged_writes() as stage:
        folder = stage.folder(out_dir)         # an empty folder beside out_dir: write the dataset here
        tmp = stage.file(tokenizer_path)       # a temporary file name beside tokenizer_path
    # here: files renamed into place, then out_dir swapped for the new folder (old -> backup name,
    # new -> out_dir, backup removed); files of out_dir the tools do not own are carried over.
"""

import contextlib
import os
import shutil
from pathlib import Path

# Files of a dataset folder that the data tools write; anything else in it is the user's and is kept.
OWNED_PATTERNS = ("manifest.json", "fineweb_train_*.bin", "fineweb_val_*.bin", "doc_hashes_*.txt", "*.tmp")
STAGING_TAG, BACKUP_TAG = "tmp", "old"


class WriteInterrupted(KeyboardInterrupt):
    """Ctrl-C while a dataset was written; str() names the target and says what was kept."""


def _tagged(final: Path, tag: str, pid: int = None) -> Path:
    return final.with_name(f".{final.name}.{tag}-{os.getpid() if pid is None else pid}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers (a reused pid) are stale by definition
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def recover_leftovers(final: Path, log=print) -> None:
    """Remove what a killed writer left beside `final` (its staging folder, its backup); when
    `final` itself is missing and a backup exists (killed between the two renames), put it back."""
    for path in sorted(final.parent.glob(f".{glob_escape(final.name)}.*-*")):
        tag, _, pid = path.name.rpartition(".")[2].partition("-")
        if tag not in (STAGING_TAG, BACKUP_TAG) or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        if tag == BACKUP_TAG and not os.path.lexists(final):
            os.rename(path, final)
            log(f"restored {final} from {path.name} (left by an interrupted write)")
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def link_or_copy(src, dst) -> None:
    """`dst` as a hard link to `src` (no bytes copied), or a copy where links are not possible."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _owned(name: str) -> bool:
    return any(Path(name).match(pattern) for pattern in OWNED_PATTERNS)


def carry_over(old: Path, new: Path) -> None:
    """Hard-link (or copy) into `new` the entries of `old` that the data tools do not own."""
    for entry in sorted(old.iterdir()):
        if _owned(entry.name) or os.path.lexists(new / entry.name):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(entry, new / entry.name)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_folder(staging: Path, final: Path) -> None:
    """Put the folder `staging` at `final`: old -> backup name, staging -> final, backup removed.
    If the second rename fails the backup is renamed back, so `final` is never left missing."""
    if not os.path.lexists(final):
        os.rename(staging, final)
    else:
        carry_over(final, staging)
        backup = _tagged(final, BACKUP_TAG)
        os.rename(final, backup)
        try:
            os.rename(staging, final)
        except BaseException:
            os.rename(backup, final)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    _fsync_dir(final.parent)


class Staging:
    """Temporary files and folders of one write, renamed into place together by commit()."""

    def __init__(self, log=print):
        self.files: list = []  # (tmp, final)
        self.folders: list = []  # (staging, final, existed)
        self.created: list = []  # folders made for the targets' parents, outermost first
        self.log = log

    def _make_parents(self, folder: Path) -> None:
        missing = []
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = folder.parent
        for path in reversed(missing):
            path.mkdir()
            self.created.append(path)

    def file(self, final) -> Path:
        """A temporary path beside `final` (same folder); renamed to `final` by commit()."""
        final = Path(final)
        self._make_parents(final.parent)
        tmp = _tagged(final, STAGING_TAG)
        tmp.unlink(missing_ok=True)
        self.files.append((tmp, final))
        return tmp

    def folder(self, final) -> Path:
        """An empty folder beside `final` to write the new dataset into; it replaces `final` at commit()
        (the same folder again for the same `final`).
        A symlinked `final` is resolved (the real folder is replaced). ValueError if `final` is a file."""
        final = Path(final)
        if final.is_symlink():
            final = final.resolve()
        if os.path.lexists(final) and not final.is_dir():
            raise ValueError(f"{final}: is a file; expected a dataset folder (created if missing)")
        for staging, known, _ in self.folders:
            if known == final:
                return staging
        self._make_parents(final.parent)
        recover_leftovers(final, self.log)
        staging = _tagged(final, STAGING_TAG)
        staging.mkdir()
        self.folders.append((staging, final, final.is_dir()))
        return staging

    def targets(self) -> list:
        return [final for _, final, _ in self.folders] + [final for _, final in self.files]

    def commit(self) -> None:
        for tmp, final in self.files:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        for staging, final, _ in self.folders:
            swap_folder(staging, final)

    def abort(self) -> None:
        """Remove every temporary file and folder, and the folders made for the targets (if empty)."""
        for tmp, _ in self.files:
            tmp.unlink(missing_ok=True)
        for staging, _, _ in self.folders:
            shutil.rmtree(staging, ignore_errors=True)
        for path in reversed(self.created):
            with contextlib.suppress(OSError):
                path.rmdir()

    def kept(self) -> str:
        """What a failed write left: the previous dataset, or nothing."""
        existed = any(existed for _, _, existed in self.folders) or any(final.exists() for _, final in self.files)
        return ("the previous files there are unchanged" if existed else "nothing was written") + \
            ", temporary files removed"


@contextlib.contextmanager
def staged_writes(log=print):
    """Yield a Staging; commit it when the block ends, or abort it on any exception. An OSError
    (disk full, no permission, ...) is re-raised as one naming the target (the dataset folder);
    Ctrl-C as WriteInterrupted naming it, both saying what was kept."""
    stage = Staging(log)
    try:
        yield stage
        stage.commit()
    except KeyboardInterrupt:
        stage.abort()
        where = ", ".join(map(str, stage.targets()[:1])) or "the dataset"
        raise WriteInterrupted(f"interrupted while writing {where}; {stage.kept()}") from None
    except OSError as exc:
        stage.abort()
        if not stage.targets():
            raise
        target = stage.targets()[0]
        inner = Path(exc.filename).name if exc.filename else None
        reason = exc.strerror or str(exc)
        where = f" (writing {inner})" if inner and inner != target.name else ""
        raise OSError(exc.errno, f"{reason}{where}; {stage.kept()}", str(target)) from None
    except BaseException:
        stage.abort()
        raise
