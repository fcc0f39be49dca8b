"""The run probe over every record folder of a repository snapshot (a bare git dir, e.g. a mirror of
openai/parameter-golf), one JSON line per folder:

    python -m tools.auditor.audit_probe_sweep GIT_DIR [--ref HEAD] [--out rows.jsonl] [--timeout 150]
    python -m tools.auditor.audit_probe_sweep GIT_DIR --prs 1376,1485 [--ref HEAD]   # the folders PR heads add
    python -m tools.auditor.audit_probe_sweep GIT_DIR --prs 887:NgramBackoff --static  # one of them, + static audit
    python -m tools.auditor.audit_probe_sweep GIT_DIR --only 2026-04-14_,LegendreGPT   # folders whose path holds a text

Each folder (records/<track>/<name>/ at REF) is extracted with `git archive` into a temporary
directory and probed (tools/auditor/audit_probe.py); a row holds the folder, the commit it came from,
the status of each run_* check, and the evidence of each fail, warn and `not checkable`; with
--static also the static audit's (tools/audit.py --no-run) fails and their evidence. `N:TEXT` keeps
only the folders of PR N whose path holds TEXT. Rows already in --out are skipped (resumable).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.auditor.audit_probe import probe_folder


def static_fails(folder: Path) -> dict:
    """{check: evidence} of each check the static audit (tools/audit.py --no-run) fails on `folder`."""
    from tools.auditor.audit import audit_folder

    return {c.name: c.evidence for c in audit_folder(folder).checks if c.status == "fail"}


def record_folders(git_dir: Path, ref: str) -> list:
    def dirs(tree: str) -> list:  # NUL-separated: folder names hold spaces
        out = subprocess.run(["git", "--git-dir", str(git_dir), "ls-tree", "-d", "-z", "--name-only", tree],
                             capture_output=True, text=True, check=True).stdout
        return [n for n in out.split("\0") if n]

    return [f"records/{track}/{n}" for track in dirs(f"{ref}:records") for n in dirs(f"{ref}:records/{track}")]


def pr_folders(git_dir: Path, base: str, pr: int) -> list:
    """The record folders a pull request's head adds or changes against `base` (refs/pull/N/head); files
    the head deletes are not counted."""
    names = subprocess.run(["git", "--git-dir", str(git_dir), "diff", "-z", "--name-only", "--no-renames", "--diff-filter=d",
                            f"{base}...refs/pull/{pr}/head",
                            "--", "records/"], capture_output=True, text=True, check=True).stdout.split("\0")
    return sorted({"/".join(n.split("/")[:3]) for n in names if n.count("/") >= 3})


def extract(git_dir: Path, ref: str, folder: str, into: Path) -> Path:
    """`folder` at `ref` written under `into`; in a snapshot whose largest blobs are absent (a model file of
    a PR head), the files it has, one by one."""
    git = ["git", "--git-dir", str(git_dir)]
    got = subprocess.run([*git, "archive", "--format=tar", ref, folder], capture_output=True)
    if got.returncode == 0:
        with tarfile.open(fileobj=io.BytesIO(got.stdout)) as tar:
            tar.extractall(into, filter="data")
        return into / folder
    listing = subprocess.run([*git, "ls-tree", "-r", "-z", ref, "--", folder], capture_output=True, text=True,
                             check=True).stdout
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, kind, sha = meta.split()
        blob = subprocess.run([*git, "cat-file", "blob", sha], capture_output=True)
        if kind != "blob" or mode == "120000" or blob.returncode != 0:
            continue  # links are not followed; an absent blob is left out
        (into / path).parent.mkdir(parents=True, exist_ok=True)
        (into / path).write_bytes(blob.stdout)
    return into / folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.auditor.audit_probe_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("git_dir")
    parser.add_argument("--ref", default="HEAD")
    parser.add_argument("--out", default="probe_sweep.jsonl")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per toy run")
    parser.add_argument("--prs", help="comma-separated pull request numbers (N or N:TEXT, the folders whose path "
                        "holds TEXT): probe the record folders each head adds")
    parser.add_argument("--static", action="store_true", help="add the static audit's fails to each row")
    parser.add_argument("--only", help="comma-separated texts: probe only the folders whose path holds one of them")
    args = parser.parse_args(argv)
    out, git_dir = Path(args.out), Path(args.git_dir)
    done = {json.loads(line)["folder"] for line in out.read_text().splitlines() if line.strip()} if out.is_file() else set()
    if args.prs:
        picks = [(int(n), text) for n, _, text in (item.partition(":") for item in args.prs.split(","))]
        todo = [(f"refs/pull/{n}/head", f, n) for n, text in picks for f in pr_folders(git_dir, args.ref, n) if text in f]
    else:
        todo = [(args.ref, f, None) for f in record_folders(git_dir, args.ref)]
    only = [t for t in (args.only or "").split(",") if t]
    for ref, folder, pr in todo:
        if folder in done or (only and not any(t in folder for t in only)):
            continue
        with tempfile.TemporaryDirectory(prefix="probe_sweep_") as tmp:
            path = extract(git_dir, ref, folder, Path(tmp))
            checks = probe_folder(path, timeout_s=args.timeout)
            static = static_fails(path) if args.static else None
        commit = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", ref], capture_output=True, text=True,
                                check=True).stdout.strip()
        row = {"folder": folder, "pr": pr, "commit": commit, "checks": {c.name: c.status for c in checks},
               "evidence": {c.name: c.evidence for c in checks if c.status in ("fail", "warn", "n/a")}}
        if static is not None:
            row["static_fails"] = static
        with open(out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(folder, " ".join(f"{k}={v}" for k, v in row["checks"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
