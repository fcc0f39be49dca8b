"""Audit a record folder the way a reviewer of openai/parameter-golf would, ours or anyone's.

    python tools/audit.py FOLDER [FOLDER ...] [--tokenizer M --data-path D]
                          [--baseline-bpb X | --baseline FOLDER] [--python EXE] [--json]

FOLDER is laid out like `records/<track>/<date>_<name>/` of the official repository. Per folder it
prints a table of checks (pass / fail / n/a = not checkable, with the evidence: file, line, value)
and exits 1 if any check fails, 2 for unusable input. Nothing is trained, run or executed: packed
scripts are decoded by tools/audit_code.py, logs read by tools/audit_logs.py; seconds per folder
(torch is imported only for --data-path or a manifest.json in the folder).

checks (tools/audit_checks.py):
  files               README.md, submission.json, train_gpt.py and at least one train log
  submission_fields   author, github_id, name, blurb, date, val_loss, val_bpb, bytes_total, bytes_code
  code_size           the real bytes of train_gpt.py (+ files it execs) = bytes_code = the logged code size
  code_parses         the script (unpacked when packed) parses as Python
  requirements        imports beyond the official environment are named in requirements.txt or README.md
  train_under_600s    per seed: train_time (+ GPTQ calibration on training data after the clock) <= 600 s
  eval_under_600s     per seed: the logged eval time (all passes after training) <= 600 s
  artifact_under_16mb per seed: compressed model + the real shipped code <= 16,000,000 bytes
  claims_match_logs   submission.json val_bpb = mean over the seed logs; per-seed values; bytes_total
  byte_accounting     each final line's implied tokens/byte = the canonical ratio (tools/audit_bytes.py)
  three_seeds         record track: at least 3 seeds
  significance        with a baseline: tools/significance.py's test (0.005 nats, p < 0.01)
  data_disjoint       train/val documents disjoint, from a manifest or shard names when available
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools import audit_checks as C
from tools.audit_code import unpack_script
from tools.audit_logs import parse_log

AUDIT_CHECKS = ("files", "submission_fields", "code_size", "code_parses", "requirements", "train_under_600s",
                "eval_under_600s", "artifact_under_16mb", "claims_match_logs", "byte_accounting", "three_seeds",
                "significance", "data_disjoint")
LOG_MAX_BYTES = 32 << 20
_RE_FILE_SEED = re.compile(r"seed[_-]?(\d+)", re.I)


class AuditInputError(ValueError):
    """Unusable input (not a folder, bad option): the CLI exits 2 with this message."""


@dataclasses.dataclass
class LogEntry:
    name: str
    facts: object
    seed: int | None
    seed_result: dict | None = None
    score: object = None  # the audit_logs.Metric this log's claim rests on


@dataclasses.dataclass
class Record:
    folder: Path
    readme: str | None = None
    submission_path: Path | None = None
    submission: dict = dataclasses.field(default_factory=dict)
    submission_error: str | None = None
    requirements: str | None = None
    script_bytes: bytes | None = None
    script: object = None
    script_error: str | None = None
    code_bytes: int | None = None
    logs: list = dataclasses.field(default_factory=list)
    seed_logs: list = dataclasses.field(default_factory=list)
    extra_logs: list = dataclasses.field(default_factory=list)
    missing_seeds: list = dataclasses.field(default_factory=list)
    claims: dict = dataclasses.field(default_factory=dict)
    track: str | None = None
    imports: tuple | None = None
    pythons: tuple = ()
    measured: dict | None = None
    measured_label: str = ""
    data_path: str | None = None


@dataclasses.dataclass
class FolderAudit:
    folder: Path
    checks: list

    @property
    def failed(self) -> list:
        return [c.name for c in self.checks if c.status == "fail"]

    def status(self, name: str) -> str:
        return next(c.status for c in self.checks if c.name == name)


# -----------------------------------------------------------------------------------------------
# reading a folder
# -----------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _claimed_seeds(sub: dict) -> dict:
    """{seed: per-seed result dict} from the shapes seen in records: seed_results as a list of
    {"seed": ...} (ours) or a dict keyed by seed, `seeds`, `seed`."""
    out = {}
    sr = sub.get("seed_results")
    if isinstance(sr, list):
        out.update({s["seed"]: s for s in sr if isinstance(s, dict) and isinstance(s.get("seed"), int)})
    elif isinstance(sr, dict):
        for k, v in sr.items():
            if str(k).isdigit():
                out[int(k)] = v if isinstance(v, dict) else {"val_bpb": v}
    for s in sub.get("seeds") or ([sub["seed"]] if isinstance(sub.get("seed"), int) else []):
        if isinstance(s, int):
            out.setdefault(s, {})
    return out


def _find_logs(folder: Path) -> list:
    """Train logs (*.log, *.txt, *log*) up to 2 dirs deep; an identical copy (train.log beside
    train_seed1337.log) counts once, under its seed-named name."""
    import hashlib

    found, seen = [], {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or len(rel.parts) > 3 or path.stat().st_size > LOG_MAX_BYTES:
            continue
        name = path.name.lower()
        if name.startswith(("requirements", "readme", "results")) or not (
                path.suffix in (".log", ".txt") or ("log" in name and not path.suffix)):
            continue
        data = path.read_bytes()
        facts = parse_log(data.decode("utf-8", errors="replace"))
        if facts.is_train_log:
            m = _RE_FILE_SEED.search(path.name)
            seed = facts.seed[0] if facts.seed else (int(m.group(1)) if m else None)
            entry = LogEntry(str(rel), facts, seed)
            digest = hashlib.sha256(data).digest()
            if digest in seen:
                if m and not _RE_FILE_SEED.search(seen[digest].name):
                    found[found.index(seen[digest])] = entry
                    seen[digest] = entry
                continue
            seen[digest] = entry
            found.append(entry)
    return found


def _closest(metrics, value):
    return min(metrics, key=lambda m: abs(m.val_bpb - value)) if metrics else None


def _assign_seed_logs(rec: Record) -> None:
    claims = rec.claims = _claimed_seeds(rec.submission)
    scored = [lg for lg in rec.logs if lg.facts.metrics]
    chosen = []
    for seed, result in claims.items():
        cands = [lg for lg in scored if lg.seed == seed]
        per = result.get("val_bpb") if isinstance(result, dict) else None
        if not cands:
            rec.missing_seeds.append(seed)
            continue
        if isinstance(per, (int, float)):
            cands.sort(key=lambda lg: abs(_closest(lg.facts.metrics, per).val_bpb - per))
        lg = cands[0]
        lg.seed_result = result
        chosen.append(lg)
    if not chosen:  # no seeds claimed (or none of them logged): every train log backs the claim
        chosen, rec.missing_seeds = list(rec.logs), [] if not claims else rec.missing_seeds
    rec.seed_logs = chosen
    rec.extra_logs = [lg for lg in rec.logs if lg not in chosen]
    claimed = rec.submission.get("val_bpb", rec.submission.get("mean_val_bpb"))
    rest = []
    for lg in chosen:
        per = (lg.seed_result or {}).get("val_bpb")
        if isinstance(per, (int, float)):
            lg.score = _closest(lg.facts.metrics, per)
        elif lg.facts.metrics:
            rest.append(lg)
    if rest and isinstance(claimed, (int, float)):
        # the metric name shared by these logs whose mean best explains the claim
        common = set.intersection(*({m.name for m in lg.facts.metrics} for lg in rest))
        if common:
            def last(lg, name):
                return [m for m in lg.facts.metrics if m.name == name][-1]
            best = min(sorted(common), key=lambda n: abs(statistics.fmean(last(lg, n).val_bpb for lg in rest) - claimed))
            for lg in rest:
                lg.score = last(lg, best)
        else:
            for lg in rest:
                lg.score = _closest(lg.facts.metrics, claimed)
    else:
        for lg in rest:
            lg.score = lg.facts.metrics[-1]


def read_record(folder, *, pythons=(), measured=None, measured_label="", data_path=None) -> Record:
    """Everything the checks need from `folder`. Raises AuditInputError if it is not a folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AuditInputError(f"{folder}: not a folder (expected records/<track>/<date>_<name>/)")
    rec = Record(folder, pythons=tuple(pythons), measured=measured, measured_label=measured_label, data_path=data_path)
    readmes = [p for p in folder.iterdir() if p.is_file() and p.name.lower() == "readme.md"]
    rec.readme = _read_text(readmes[0]) if readmes else None
    if (folder / "requirements.txt").is_file():
        rec.requirements = _read_text(folder / "requirements.txt")
    if (folder / "submission.json").is_file():
        rec.submission_path = folder / "submission.json"
        try:
            sub = json.loads(rec.submission_path.read_bytes())
            if not isinstance(sub, dict):
                raise ValueError("expected a JSON object")
            rec.submission = sub
        except ValueError as e:
            rec.submission_error = f"not valid JSON ({e})"
    script = folder / "train_gpt.py"
    if script.is_file():
        rec.script_bytes = script.read_bytes()
        try:
            rec.script = unpack_script(rec.script_bytes, folder)
            rec.code_bytes = len(rec.script_bytes) + sum((folder / n).stat().st_size for n in rec.script.files)
        except SyntaxError as e:
            rec.script_error = f"line {e.lineno}: {e.msg}"
            rec.code_bytes = len(rec.script_bytes)
    rec.logs = _find_logs(folder)
    _assign_seed_logs(rec)
    track = folder.resolve().parent.name
    claimed_track = str(rec.submission.get("track") or "")
    rec.track = track if track in (C.RECORD_TRACK, C.NON_RECORD_TRACK) else (
        ("track_" + claimed_track.removeprefix("track_")) if claimed_track else None)
    return rec


# -----------------------------------------------------------------------------------------------
# running the checks, output
# -----------------------------------------------------------------------------------------------


def audit_folder(folder, *, baseline_bpb=None, baseline_values=None, pythons=(), measured=None,
                 measured_label="", data_path=None) -> FolderAudit:
    """Run every check on one folder; never raises on a malformed folder (only AuditInputError
    when `folder` is not a directory)."""
    rec = read_record(folder, pythons=pythons, measured=measured, measured_label=measured_label, data_path=data_path)
    checks = [C.check_files(rec), C.check_submission_fields(rec), C.check_code_size(rec), C.check_code_parses(rec),
              C.check_requirements(rec), C.check_train_time(rec), C.check_eval_time(rec), C.check_artifact_bytes(rec),
              C.check_claims(rec), C.check_byte_accounting(rec), C.check_seeds(rec),
              C.check_significance(rec, baseline_bpb, baseline_values), C.check_data(rec)]
    if rec.missing_seeds:
        claims = checks[AUDIT_CHECKS.index("claims_match_logs")]
        note = f"no log for claimed seed(s) {', '.join(map(str, rec.missing_seeds))}"
        claims.status, claims.evidence = "fail", note + ("; " + claims.evidence if claims.status == "fail" else "")
    assert tuple(c.name for c in checks) == AUDIT_CHECKS
    return FolderAudit(Path(folder), checks)


def compliance(result: FolderAudit) -> dict:
    """The `compliance` block make_record writes into submission.json: each check as true / false /
    null (not checkable), and its evidence."""
    flags = {c.name: {"pass": True, "fail": False}.get(c.status) for c in result.checks}
    return {"checked_by": "tools/audit.py", **flags, "evidence": {c.name: c.evidence for c in result.checks}}


def format_table(result: FolderAudit, width: int = 120) -> str:
    import textwrap

    name_w = max(len(n) for n in AUDIT_CHECKS)
    lines = [f"audit {result.folder}", f"  {'check':<{name_w}}  status  evidence"]
    for c in result.checks:
        wrapped = textwrap.wrap(c.evidence, width - name_w - 12) or [""]
        lines.append(f"  {c.name:<{name_w}}  {c.status:<6}  {wrapped[0]}")
        lines += [f"  {'':<{name_w}}          {w}" for w in wrapped[1:]]
    na = [c.name for c in result.checks if c.status == "n/a"]
    verdict = f"FAIL ({', '.join(result.failed)})" if result.failed else "PASS"
    lines.append(f"result: {verdict}" + (f"; not checkable: {', '.join(na)}" if na else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/audit.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("folders", nargs="+", help="record folders")
    parser.add_argument("--tokenizer", help="SentencePiece model: measure the canonical tokens/byte (needs --data-path)")
    parser.add_argument("--data-path", help="dataset dir with fineweb_val_*.bin (and manifest.json for data_disjoint)")
    base = parser.add_mutually_exclusive_group()
    base.add_argument("--baseline-bpb", type=float, help="the val_bpb to beat (significance check)")
    base.add_argument("--baseline", metavar="FOLDER", help="record folder of the baseline (Welch t-test over its seeds)")
    parser.add_argument("--python", action="append", default=[], metavar="EXE",
                        help="another interpreter to parse scripts with newer syntax (e.g. python3.12)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    try:
        if args.tokenizer and not args.data_path:
            raise AuditInputError("--tokenizer needs --data-path (the val shards to count)")
        measured, label = None, ""
        if args.tokenizer:
            from tools.audit_bytes import measure_tokens_per_byte

            try:
                measured = measure_tokens_per_byte(args.tokenizer, args.data_path)
            except (OSError, ValueError) as e:
                raise AuditInputError(str(e)) from e
            label = (f"measured {measured['tokens_per_byte']:.7f} ({Path(args.tokenizer).name} on "
                     f"{measured['val_tokens']:,} val tokens of {args.data_path})")
        baseline_values = None
        if args.baseline:
            base_rec = read_record(args.baseline, pythons=args.python)
            baseline_values = C.seed_values(base_rec)
            if not baseline_values:
                raise AuditInputError(f"--baseline {args.baseline}: no final val_bpb in its logs")
        results = [audit_folder(f, baseline_bpb=args.baseline_bpb, baseline_values=baseline_values,
                                pythons=args.python, measured=measured, measured_label=label,
                                data_path=args.data_path) for f in args.folders]
    except AuditInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"folder": str(r.folder), "failed": r.failed,
                           "checks": [dataclasses.asdict(c) for c in r.checks]} for r in results], indent=2))
    else:
        print("\n".join(format_table(r) for r in results), end="")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
