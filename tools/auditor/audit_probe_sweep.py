"""The run probe over every record folder of a repository snapshot (a bare git dir, e.g. a mirror of
openai/parameter-golf), one JSON line per folder:

    python -m tools.auditor.audit_probe_sweep GIT_DIR [--ref HEAD] [--out rows.jsonl] [--timeout 150]
    python -m tools.auditor.audit_probe_sweep GIT_DIR --prs 1376,1485 [--ref HEAD]   # the folders PR heads add

Each folder (records/<track>/<name>/ at REF) is extracted with `git archive` into a temporary
directory and probed (tools/auditor/audit_probe.py); a row holds the folder, the status of each
run_* check, and the reason of a `not checkable`. Rows already in --out are skipped (resumable).
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


def record_folders(git_dir: Path, ref: str) -> list:
    def dirs(tree: str) -> list:  # NUL-separated: folder names hold spaces
        out = subprocess.run(["git", "--git-dir", str(git_dir), "ls-tree", "-d", "-z", "--name-only", tree],
                             capture_output=True, text=True, check=True).stdout
        return [n for n in out.split("\0") if n]

    return [f"records/{track}/{n}" for track in dirs(f"{ref}:records") for n in dirs(f"{ref}:records/{track}")]


def pr_folders(git_dir: Path, base: str, pr: int) -> list:
    """The record folders a pull request's head adds or changes against `base` (refs/pull/N/head)."""
    names = subprocess.run(["git", "--git-dir", str(git_dir), "diff", "-z", "--name-only", f"{base}...refs/pull/{pr}/head",
                            "--", "records/"], capture_output=True, text=True, check=True).stdout.split("\0")
    return sorted({"/".join(n.split("/")[:3]) for n in names if n.count("/") >= 3})


def extract(git_dir: Path, ref: str, folder: str, into: Path) -> Path:
    blob = subprocess.run(["git", "--git-dir", str(git_dir), "archive", "--format=tar", ref, folder],
                          capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.auditor.audit_probe_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("git_dir")
    parser.add_argument("--ref", default="HEAD")
    parser.add_argument("--out", default="probe_sweep.jsonl")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per toy run")
    parser.add_argument("--prs", help="comma-separated pull request numbers: probe the record folders each head adds")
    args = parser.parse_args(argv)
    out, git_dir = Path(args.out), Path(args.git_dir)
    done = {json.loads(line)["folder"] for line in out.read_text().splitlines() if line.strip()} if out.is_file() else set()
    if args.prs:
        todo = [(f"refs/pull/{n}/head", f, int(n)) for n in args.prs.split(",") for f in pr_folders(git_dir, args.ref, int(n))]
    else:
        todo = [(args.ref, f, None) for f in record_folders(git_dir, args.ref)]
    for ref, folder, pr in todo:
        if folder in done:
            continue
        with tempfile.TemporaryDirectory(prefix="probe_sweep_") as tmp:
            path = extract(git_dir, ref, folder, Path(tmp))
            checks = probe_folder(path, timeout_s=args.timeout)
        row = {"folder": folder, "pr": pr, "checks": {c.name: c.status for c in checks},
               "evidence": {c.name: c.evidence for c in checks if c.status in ("fail", "warn", "n/a")}}
        with open(out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(folder, " ".join(f"{k}={v}" for k, v in row["checks"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
