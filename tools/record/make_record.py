"""Turn 1-3 finished seed runs into a record folder laid out like the official repo.

    python tools/make_record.py --runs runs/A runs/B runs/C --name MyIdea --author "Jane Doe" \
        --github-id janedoe --approach-file approach.md [--track track_non_record_16mb] [--blurb TEXT] \
        [--force] [--smoke-timeout-seconds S | --skip-smoke]

writes `records/<track>/<YYYY-MM-DD>_<NAME>/` with README.md (the author's Approach, given by --approach or
--approach-file and required, what the run is, per-seed table, mean
and std, the command that reproduces it with the official data command, compliance, loss curve), submission.json (the official
fields plus track, seeds, seed_results, val_bpb_std, hardware, pytorch_version), the logs as
train_seed<SEED>.log, the packed train_gpt.py (plain ASCII by default; latin-1 only when the runs
measured that opt-in, BUNDLE_ENCODING=latin1, see tools/bundle.py; copied as bytes) and
train_gpt_human.py,
requirements.txt (runtime deps at the run's versions) and loss_curve.png. The score is each run's
final sliding-window line, or its legal score-first TTT line when TTT ran in its place
(tools/record/runs.py final_score_key); the seeds of one record share one of them.

It refuses (exit 2, `error: ...` naming the run and the field) runs that are over the byte budget,
did not finish (no final log lines, status not ok), hold a field that is not a number,
break a challenge rule that every track keeps (bytes_ok, full_val_split, val_not_seen_in_training,
splits_disjoint: decided from the evidence by tools/auditor/audit_run.py, never from result.json's own
`compliance` flags), differ in
configuration beyond SEED/RUN_ID/OUT_DIR, repeat a seed, report different code bytes, or whose code
is not the current source (the shipped file must be the code that ran); a track_10min_16mb record
with any rule unmet (train_time_ok / eval_time_ok false or the seconds over 600 too), naming the
flag and the run; an existing folder without --force; a track name that is not official or does
not fit the hardware. The non-record track accepts longer runs: its README and submission.json
(`rules_not_met`) state which rules each run does not meet. A rule the evidence cannot decide (no
manifest with document hashes, as in the official export: val_not_seen_in_training and
splits_disjoint) is not refused but written as null with why (submission.json seed_results
compliance.unverified) and "unverified: ..." in the README, never as met.
The folder is written to a temp dir next to its destination, checked (`check_record`), audited
(tools/audit.py: a failed check refuses the record, except three_seeds / significance, which are
flagged; the result goes into submission.json as its `compliance` block), smoke-run
(the packed train_gpt.py from inside the folder, nothing else on sys.path: 2 CPU steps, export and
the final evals on the first SMOKE_VAL_MAX_TOKENS val tokens; a smoke check, never a score; its output
shown live, stopped after --smoke-timeout-seconds, by default twice the runs' own train + export + eval
seconds), then renamed into place: a refused or failed record leaves nothing behind. --skip-smoke
builds it without the smoke run and says so in its README and submission.json ("smoke_run": "skipped").

The run checks are tools/record/record_checks.py, the folder's contents tools/record/record_readme.py, the smoke
run tools/record/record_smoke.py; this module is the CLI, the flow, and the check and audit of the folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/make_record.py`: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kit.bundle import (BUNDLE_HUMAN_NAME, BUNDLE_PACKED_NAME, REPO_ROOT, build_human_parts, minify_source, pack_code,
                          packed_encoding, set_bundle_kind, settings_from_result, unpack_packed)
from tools.record.record_checks import (RECORD_BYTE_BUDGET, RECORD_MIN_STEPS, RECORD_TRACKS, check_code_is_current,
                                       check_rules, check_run, check_runs_agree, check_steps, choose_track,
                                       resolve_run_path)
from tools.record.record_readme import (SCORE_LABELS, build_readme, build_requirements, build_submission, hardware_of,
                                 mean_std, plot_loss_curves, reproduce_command)
from tools.record.record_smoke import default_smoke_timeout_seconds, runs_measured_seconds, smoke_run
from tools.record.runs import FINAL_LINES, RecordError, final_score_key, load_run, parse_train_log


# -----------------------------------------------------------------------------------------------
# checking and auditing a folder
# -----------------------------------------------------------------------------------------------

_SUBMISSION_FIELDS = ("author", "github_id", "name", "blurb", "date", "val_loss", "val_bpb", "bytes_total",
                      "bytes_code", "track", "seeds", "seed_results", "val_bpb_std", "hardware", "pytorch_version")


def _refuse_outside_links(folder: Path) -> None:
    """A file of the folder that is a symlink out of it (a log, the script) is refused: the folder
    must hold its own evidence and code."""
    from tools.auditor.audit_rules import folder_files, is_inside

    for path in folder_files(folder):
        if path.is_symlink() and not is_inside(folder, path):
            raise RecordError(f"record {folder}: {path.relative_to(folder)} is a symlink to {os.readlink(path)}, "
                              f"outside the folder: expected a file inside it")


def _read_submission(folder: Path) -> dict:
    """submission.json as an object with the fields of _SUBMISSION_FIELDS, numbers where numbers go."""
    path = folder / "submission.json"
    try:
        sub = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"record {folder}: submission.json is not valid JSON ({e}): expected an object") from e
    if not isinstance(sub, dict):
        raise RecordError(f"record {folder}: submission.json is a JSON {type(sub).__name__}: expected an object")
    missing = [k for k in _SUBMISSION_FIELDS if k not in sub]
    if missing:
        raise RecordError(f"record {folder}: submission.json lacks {', '.join(missing)}")
    for key in ("val_bpb", "val_loss", "bytes_total", "bytes_code"):
        value = sub[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(f"record {folder}: submission.json {key}={value!r}: expected a number")
    per = sub["seed_results"]
    if not isinstance(per, list) or not all(isinstance(s, dict) and {"seed", "val_bpb", "val_loss", "bytes_total"} <= set(s)
                                            for s in per):
        raise RecordError(f"record {folder}: submission.json seed_results={json.dumps(per)[:60]}: expected a list of "
                          f"objects with seed, val_bpb, val_loss, bytes_total")
    return sub


def check_record(folder) -> dict:
    """Verify a record folder against itself; returns submission.json, raises RecordError.

    Files present; submission.json complete; val_bpb / val_loss are the means of seed_results;
    bytes_code is the size of train_gpt.py, which unpacks (its wrapper yields the code; catches a
    latin-1 file re-saved as UTF-8); each train_seed<S>.log has final lines that match its seed
    result; bytes_total within the budget."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RecordError(f"record {folder}: not a folder (expected records/<track>/<date>_<name>/)")
    for name in ("README.md", "submission.json", BUNDLE_PACKED_NAME, BUNDLE_HUMAN_NAME, "requirements.txt",
                 "loss_curve.png"):
        if not (folder / name).is_file():
            raise RecordError(f"record {folder}: {name} is missing")
    _refuse_outside_links(folder)
    sub = _read_submission(folder)
    if sub["track"] not in RECORD_TRACKS or folder.resolve().parent.name != sub["track"]:
        raise RecordError(f"record {folder}: track {sub['track']!r} does not match the folder {folder.parent.name!r}")
    per = sub["seed_results"]
    if not per or [s["seed"] for s in per] != sub["seeds"]:
        raise RecordError(f"record {folder}: seeds and seed_results disagree")
    for field, key in (("val_bpb", "val_bpb"), ("val_loss", "val_loss")):
        mean = statistics.fmean(float(s[key]) for s in per)
        if abs(mean - float(sub[field])) > 1e-8:
            raise RecordError(f"record {folder}: submission.json {field}={sub[field]} is not the mean {mean:.8f}")
    size = (folder / BUNDLE_PACKED_NAME).stat().st_size
    if size != int(sub["bytes_code"]):
        raise RecordError(f"record {folder}: bytes_code={sub['bytes_code']} but {BUNDLE_PACKED_NAME} has {size} bytes")
    packed = (folder / BUNDLE_PACKED_NAME).read_bytes()
    try:
        unpack_packed(packed)
    except Exception as e:  # SyntaxError, ValueError, a decompressor's error: the file is damaged
        raise RecordError(f"record {folder}: {BUNDLE_PACKED_NAME} does not unpack ({type(e).__name__}: {e}); "
                          f"a {packed_encoding(packed)} file must be copied as bytes, never re-saved as text") from e
    if int(sub["bytes_total"]) > RECORD_BYTE_BUDGET:
        raise RecordError(f"record {folder}: bytes_total={sub['bytes_total']:,} is over {RECORD_BYTE_BUDGET:,}")
    for s in per:
        log_path = folder / f"train_seed{s['seed']}.log"
        if not log_path.is_file():
            raise RecordError(f"record {folder}: {log_path.name} is missing")
        log = parse_train_log(log_path.read_text(encoding="utf-8", errors="replace"))
        key = final_score_key(s)
        final = log["final"].get(key)
        if final is None or abs(final["val_bpb"] - float(s["val_bpb"])) > 1e-7:
            raise RecordError(f"record {folder}: {log_path.name} {FINAL_LINES[key]} val_bpb does not match seed_results")
        if log["total_bytes"] != int(s["bytes_total"]):
            raise RecordError(f"record {folder}: {log_path.name} total size does not match seed_results")
    return sub


AUDIT_SOFT_CHECKS = ("three_seeds", "significance")  # flagged in submission.json, never a refusal


def audit_record(folder: Path, runs: list, submission: dict, log=print) -> dict:
    """Audit the written folder with tools/audit.py, as a reviewer would, and store the result as
    submission.json["compliance"] (each check true / false / null = not checkable, with evidence).
    The byte accounting is measured on the runs' own tokenizer and val split when both are on this
    machine. Raises RecordError naming every failed check except AUDIT_SOFT_CHECKS (logged)."""
    from tools.auditor.audit import audit_folder, compliance, format_table
    from tools.auditor.audit_bytes import measure_tokens_per_byte

    measured, label, data_path = None, "", None
    tokenizer, data = (resolve_run_path(runs[0], k) for k in ("tokenizer_path", "data_path"))
    if tokenizer.is_file() and data.is_dir():
        try:
            measured = measure_tokens_per_byte(tokenizer, data)
            label, data_path = f"measured {measured['tokens_per_byte']:.7f} ({tokenizer.name}, {data.name})", str(data)
        except (OSError, ValueError) as e:
            log(f"audit: tokens/byte not measured ({e})")
    result = audit_folder(folder, measured=measured, measured_label=label, data_path=data_path, strict=True)
    hard = [c for c in result.checks if c.status == "fail" and c.name not in AUDIT_SOFT_CHECKS]
    if hard:
        raise RecordError("the record folder fails its audit (python tools/audit.py FOLDER):\n"
                          + "\n".join(f"  {c.name}: {c.evidence}" for c in hard))
    for c in result.checks:
        if c.status == "fail":
            log(f"audit: flagged {c.name}: {c.evidence}")
    submission["compliance"] = compliance(result)
    (folder / "submission.json").write_text(json.dumps(submission, indent=2) + "\n", encoding="utf-8")
    log(format_table(result).rstrip("\n"))
    return submission["compliance"]


# -----------------------------------------------------------------------------------------------
# main flow
# -----------------------------------------------------------------------------------------------


def read_approach(text=None, path=None) -> str:
    """The author's Approach for the record README, from --approach TEXT or --approach-file PATH
    (UTF-8); RecordError when neither gives non-empty text."""
    if text is not None and path is not None:
        raise RecordError("--approach and --approach-file: give one of them, not both")
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RecordError(f"--approach-file {path}: cannot read it as UTF-8 text "
                              f"({getattr(e, 'strerror', None) or e}); expected a text file") from e
    if not (text or "").strip():
        where = f"--approach-file {path}: is empty" if path is not None else (
            "--approach: is empty" if text is not None else "no --approach or --approach-file")
        raise RecordError(f"{where}; expected the record's approach (what you changed and why, for its README's "
                          f"\"Approach\" section: --approach \"TEXT\" or --approach-file FILE)")
    return text.strip()


def make_record(run_paths, *, name, author, github_id, approach=None, track=None, blurb=None, force=False,
                skip_smoke=False, smoke_timeout_seconds=None, records_dir=None, root=None, date=None,
                min_steps=RECORD_MIN_STEPS, log=print) -> Path:
    """Build and check the record folder; returns its path. Raises RecordError when refused.
    `approach`: the author's text for the README (required); `smoke_timeout_seconds`: the smoke
    run's limit (None: default_smoke_timeout_seconds of the runs)."""
    if date is not None:
        check_date(date)
    approach = read_approach(approach)
    if smoke_timeout_seconds is not None and not (smoke_timeout_seconds > 0 and smoke_timeout_seconds < 1e7):
        raise RecordError(f"--smoke-timeout-seconds={smoke_timeout_seconds}: expected a number of seconds > 0")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name or ""):
        raise RecordError(f"--name {name!r}: expected letters, digits, '.', '_' or '-' (it names the folder)")
    if not run_paths:
        raise RecordError("--runs: give at least one run folder")
    root = Path(root) if root is not None else REPO_ROOT
    records_dir = Path(records_dir) if records_dir is not None else root / "records"
    runs = [load_run(p) for p in run_paths]
    for run in runs:
        check_run(run)
        check_steps(run, min_steps)
    check_runs_agree(runs)
    human, packed = pack_for_runs(runs, root, log)
    check_code_is_current(runs, human, packed, root)
    track_name, reason = choose_track(runs, track)
    rules_not_met = check_rules(runs, track_name)
    now = dt.datetime.now(dt.timezone.utc)
    day = date or now.strftime("%Y-%m-%d")
    date_iso = f"{day}T00:00:00Z" if date else now.strftime("%Y-%m-%dT%H:%M:%SZ")
    final_dir = records_dir / track_name / f"{day}_{name}"
    if final_dir.exists() and not force:
        raise RecordError(f"{final_dir} exists; pass --force to replace it")
    try:
        final_dir.parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.mkdtemp(prefix=".write_probe", dir=final_dir.parent)
        os.rmdir(probe)
    except OSError as e:
        raise RecordError(f"--records-dir {records_dir}: cannot write {final_dir.parent} ({e.strerror or e}): "
                          f"expected a writable folder") from e
    key = final_score_key(runs[0].result)  # the same for every run (check_runs_agree)
    mean_bpb, std_bpb = mean_std([float(r.result[f"val_bpb_{key}"]) for r in runs])
    hp = runs[0].result["hyperparameters"]
    if not blurb:
        blurb = (f"{hp.get('num_layers')}x{hp.get('model_dim')} GPT, preset {hp.get('preset')}, "
                 f"{len(runs)} seed{'s' if len(runs) > 1 else ''} on {hardware_of(runs[0])}: val_bpb "
                 f"{mean_bpb:.4f} (std {std_bpb:.4f}, {SCORE_LABELS[key]}), artifact "
                 f"{max(int(r.result['bytes_total']) for r in runs):,} bytes.")
    submission = build_submission(runs, name=name, author=author, github_id=github_id, blurb=blurb,
                                  date_iso=date_iso, track=track_name, bytes_code=len(packed))
    submission["rules_not_met"] = rules_not_met  # {seed: {flag: evidence}}; {} when every run meets every rule
    if skip_smoke:
        submission["smoke_run"] = "skipped"  # the folder's train_gpt.py was never run (the auditor warns)
    tmp = Path(tempfile.mkdtemp(prefix=f".{day}_{name}.tmp", dir=final_dir.parent))
    try:
        (tmp / BUNDLE_HUMAN_NAME).write_bytes(human.encode("utf-8"))
        (tmp / BUNDLE_PACKED_NAME).write_bytes(packed)  # may be latin-1: bytes only, never text
        for run in runs:
            shutil.copyfile(run.log_path, tmp / f"train_seed{run.seed}.log")
        (tmp / "requirements.txt").write_text(build_requirements(runs), encoding="utf-8")
        plot_loss_curves(runs, tmp / "loss_curve.png", f"{name}: {len(runs)} seed(s), {hardware_of(runs[0])}")
        (tmp / "submission.json").write_text(json.dumps(submission, indent=2) + "\n", encoding="utf-8")
        folder_rel = os.path.relpath(final_dir, root) if final_dir.resolve().is_relative_to(root.resolve()) \
            else str(final_dir)
        command = reproduce_command(runs, final_dir, name, root)
        (tmp / "README.md").write_text(build_readme(runs, submission, track_reason=reason, command=command,
                                                    folder_rel=folder_rel, code_encoding=packed_encoding(packed),
                                                    approach=approach, smoke_skipped=skip_smoke),
                                       encoding="utf-8")
        check_record(tmp)
        audit_record(tmp, runs, submission, log=log)
        if skip_smoke:
            log("smoke run skipped (--skip-smoke): the folder's README and submission.json say so")
        else:
            limit = smoke_timeout_seconds or default_smoke_timeout_seconds(runs)
            smoke_run(tmp, runs[0], log=log, timeout_seconds=limit, runs_seconds=runs_measured_seconds(runs))
        os.chmod(tmp, 0o755)
        if final_dir.exists():  # --force: swap, then delete the old folder
            old = final_dir.with_name(f".{final_dir.name}.old{os.getpid()}")
            os.replace(final_dir, old)
            os.replace(tmp, final_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    log(f"record: {final_dir} (val_bpb {submission['val_bpb']:.8f}, std {submission['val_bpb_std']:.8f}, "
        f"code {submission['bytes_code']:,} bytes, total {submission['bytes_total']:,} bytes, {track_name})")
    return final_dir


def pack_for_runs(runs: list, root: Path, log=print) -> tuple[str, bytes]:
    """(train_gpt_human.py, train_gpt.py bytes) packed for the runs' own settings (their result.json's
    hyperparameters and quant policy; the runs agree on them): the modules those settings need, nothing
    else; says the byte count and what was left out. ASCII unless BUNDLE_ENCODING says otherwise."""
    parts, info = build_human_parts(root, settings_from_result(runs[0].result))
    human = "\n\n\n".join(text for _, text in parts) + "\n"
    packed = pack_code(minify_source(set_bundle_kind(human, "packed")), None, info["packed_for"])[0]
    left = "; ".join(f"{', '.join(r)} (refused when {c})" for c, r in sorted(info["off"].items()))
    log(f"train_gpt.py: {len(packed):,} bytes, {info['packed_for'] or 'packed with every module'}"
        + (f"; left out: {left}" if left else ""))
    return human, packed


def check_date(day) -> None:
    """RecordError unless `day` is a real calendar date written YYYY-MM-DD (2026-13-45 is not)."""
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(day)):
        raise RecordError(f"--date {day!r}: expected a date YYYY-MM-DD, e.g. 2026-03-19")
    try:
        dt.date.fromisoformat(day)
    except ValueError as e:
        raise RecordError(f"--date {day!r}: not a calendar date ({e}); expected YYYY-MM-DD") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/make_record.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", help="run folders (runs/<RUN_ID>), one per seed")
    parser.add_argument("--name", help="record name: the folder is <date>_<name>")
    parser.add_argument("--author")
    parser.add_argument("--github-id")
    parser.add_argument("--track", help=f"one of {', '.join(RECORD_TRACKS)} (default: from the hardware)")
    parser.add_argument("--blurb", help="one-line description (default: generated)")
    parser.add_argument("--force", action="store_true", help="replace an existing record folder")
    parser.add_argument("--approach", metavar="TEXT", help="the record README's Approach: what you changed and "
                        "why (required, or --approach-file)")
    parser.add_argument("--approach-file", metavar="FILE", help="the Approach as a UTF-8 text/Markdown file")
    parser.add_argument("--skip-smoke", action="store_true", help="do not run the packed script from the folder "
                        "(the README and submission.json then say so)")
    parser.add_argument("--smoke-timeout-seconds", type=float, metavar="S",
                        help="limit of the smoke run (default: twice the runs' own train + export + eval "
                             "seconds, at least 600)")
    parser.add_argument("--records-dir", help="default: <repo>/records")
    parser.add_argument("--date", help="YYYY-MM-DD for the folder name (default: today, UTC)")
    parser.add_argument("--check", metavar="FOLDER", help="only check an existing record folder")
    parser.add_argument("--root", default=str(REPO_ROOT), help="source root to bundle (default: this repo)")
    parser.add_argument("--min-steps", type=int, default=RECORD_MIN_STEPS, metavar="N",
                        help=f"refuse a seed that trained fewer steps (default {RECORD_MIN_STEPS}; 0: any)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            sub = check_record(args.check)
            print(f"ok: {args.check} (val_bpb {sub['val_bpb']}, {len(sub['seeds'])} seeds)")
            return 0
        for flag in ("runs", "name", "author", "github_id"):
            if not getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} is required")
        try:
            if args.date is not None:  # a bad input: one `error:` line before any run is read
                check_date(args.date)
            approach = read_approach(args.approach, args.approach_file)
        except RecordError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        make_record(args.runs, name=args.name, author=args.author, github_id=args.github_id, approach=approach,
                    track=args.track, blurb=args.blurb, force=args.force, skip_smoke=args.skip_smoke,
                    smoke_timeout_seconds=args.smoke_timeout_seconds, records_dir=args.records_dir,
                    root=args.root, date=args.date, min_steps=args.min_steps)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
