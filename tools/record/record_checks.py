"""The checks that decide whether finished runs may become a record (tools/make_record.py).

check_run (one run finished, within the byte budget, its log agrees with result.json),
check_runs_agree (the seeds of one record differ by the seed only), check_code_is_current (the
shipped file is the code that ran), check_rules (the challenge rules, decided from the evidence by
tools/auditor/audit_run.py, never from result.json's own `compliance` flags) and choose_track. Each raises
RecordError naming the run and the field.
"""

from __future__ import annotations

from pathlib import Path

from tools.auditor.audit_run import number, run_rules
from kit.bundle import BUNDLE_PACKED_NAME, REPO_ROOT, unpack_packed
from tools.record.runs import FINAL_LINES, RecordError, Run, final_score_key

RECORD_BYTE_BUDGET = 16_000_000  # decimal bytes: code + compressed model
RECORD_TRAIN_LIMIT_SECONDS = 600.0
RECORD_EVAL_LIMIT_SECONDS = 600.0
RECORD_TRACKS = ("track_10min_16mb", "track_non_record_16mb")
RECORD_IGNORED_HYPERPARAMETERS = ("seed", "run_id", "out_dir")
RECORD_MIN_STEPS = 20  # make_record's floor of training steps per seed (--min-steps overrides it)
# result.json["compliance"] (train_gpt.check_compliance): one challenge rule per flag, and the
# result.json field that is its evidence
RECORD_RULES = {
    "train_time_ok": ("training <= 600 s", "train_seconds"),
    "eval_time_ok": ("evaluation <= 600 s", "eval_seconds"),
    "bytes_ok": ("code + artifact <= 16,000,000 bytes", "bytes_total"),
    "full_val_split": ("scored on the full val split", "val_tokens"),
    "val_not_seen_in_training": ("no val shard read by the training loader", "train_shards"),
    "splits_disjoint": ("train/val documents disjoint (manifest hashes)", "train_shards"),
}
NON_RECORD_ACCEPTS = ("train_time_ok", "eval_time_ok")  # track_non_record_16mb: unlimited compute

_REQUIRED_RESULT = ("seed", "steps", "train_seconds", "eval_seconds", "ms_per_step", "world_size", "device",
                    "bytes_model", "bytes_code", "bytes_total", "hyperparameters", "torch_version")


_NUMERIC_RESULT = ("steps", "train_seconds", "eval_seconds", "ms_per_step")


def _run_cwd(run: Run) -> Path:
    """Where the run was launched: OUT_DIR/RUN_ID is the run folder, OUT_DIR relative to the cwd."""
    out_dir = Path(str(run.result["hyperparameters"].get("out_dir", "runs")))
    if out_dir.is_absolute():
        return REPO_ROOT
    path = run.path.resolve()
    return path.parents[len(out_dir.parts)] if len(path.parents) > len(out_dir.parts) else REPO_ROOT


def resolve_run_path(run: Run, key: str) -> Path:
    """A path hyperparameter of the run (data_path, tokenizer_path), absolute: a relative one is read
    from where the run was launched."""
    value = Path(str(run.result["hyperparameters"][key]))
    return value if value.is_absolute() else (_run_cwd(run) / value).resolve()


def check_steps(run: Run, min_steps: int) -> None:
    """Refuse (RecordError naming the run) a seed that trained fewer than `min_steps` optimizer steps (a "60 s"
    CPU seed once trained 1 step and became a record): below RECORD_MIN_STEPS the schedule's warmdown, late
    QAT and momentum warmup are under a step each, so the seed shows nothing of the recipe."""
    steps = int(run.result.get("steps") or 0)
    if steps < min_steps:
        raise RecordError(f"run {run.label}: trained {steps} step(s), fewer than --min-steps {min_steps}; expected a "
                          "longer run (MAX_WALLCLOCK_SECONDS or ITERATIONS), or --min-steps 0 to make the record anyway")


def check_run(run: Run) -> None:
    """Refuse a single run that did not finish or breaks a limit (RecordError). The score is
    val_*_<final_score_key> (sliding, or ttt), and the train.log line of each score must agree."""
    r, who = run.result, f"run {run.label}"
    if not r:
        raise RecordError(f"{who}: no result.json (the run did not finish)")
    if r.get("status", "ok") != "ok":
        raise RecordError(f"{who}: result.json status={r['status']!r}, expected 'ok'")
    headline = final_score_key(r)  # a TTT run has no sliding pass; a sliding score beside TTT is checked too
    scores = ("prequant", "roundtrip",
              *(k for k in ("sliding", "ttt") if k == headline or r.get(f"val_bpb_{k}") is not None))
    score_fields = [f"{field}_{k}" for k in scores for field in ("val_loss", "val_bpb")]
    missing = [k for k in (*_REQUIRED_RESULT, *score_fields) if r.get(k) is None]
    if missing:
        raise RecordError(f"{who}: result.json lacks {', '.join(missing)} (the run did not finish its evaluation?)")
    for field in (*_NUMERIC_RESULT, *score_fields):
        number(run, field)
    for field in ("bytes_total", "bytes_code", "bytes_model", "world_size"):
        number(run, field, integer=True)
    if not isinstance(r["hyperparameters"], dict):
        raise RecordError(f"{who}: result.json hyperparameters={r['hyperparameters']!r}: expected an object")
    if run.log_path is None:
        raise RecordError(f"{who}: no train.log")
    for key, line in ((k, FINAL_LINES[k]) for k in scores):
        if key not in run.log["final"]:
            raise RecordError(f"{who}: train.log has no `{line}` line (the log is incomplete)")
        logged = run.log["final"][key]
        for field in ("val_loss", "val_bpb"):
            if abs(logged[field] - float(r[f"{field}_{key}"])) > 1e-7:
                raise RecordError(f"{who}: train.log {line} {field}:{logged[field]:.8f} disagrees with "
                                  f"result.json {field}_{key}={r[f'{field}_{key}']}")
    if run.log["total_bytes"] is None:
        raise RecordError(f"{who}: train.log has no `Total submission size:` line (the log is incomplete)")
    if run.log["total_bytes"] != int(r["bytes_total"]):
        raise RecordError(f"{who}: train.log Total submission size {run.log['total_bytes']} disagrees with "
                          f"result.json bytes_total={r['bytes_total']}")
    if int(r["bytes_total"]) > RECORD_BYTE_BUDGET:
        raise RecordError(f"{who}: bytes_total={r['bytes_total']:,} is over the budget of {RECORD_BYTE_BUDGET:,} bytes")
    if int(r["bytes_code"]) + int(r["bytes_model"]) != int(r["bytes_total"]):
        raise RecordError(f"{who}: bytes_code + bytes_model != bytes_total in result.json")
    hp = r["hyperparameters"]
    if hp.get("val_max_tokens"):
        raise RecordError(f"{who}: hyperparameters VAL_MAX_TOKENS={hp['val_max_tokens']}: scored on part of the "
                          f"val split only")
    number(run, "val_tokens", integer=True)  # the evidence of full_val_split (the run's own flags are not read)


def rules_of(run: Run) -> dict:
    """{flag: (ok, evidence)} of RECORD_RULES from the run's evidence (tools/auditor/audit_run.py), cached on
    the run; result.json's own compliance flags are never read."""
    if getattr(run, "_rules", None) is None:
        data = resolve_run_path(run, "data_path") if run.result["hyperparameters"].get("data_path") else None
        run._rules = run_rules(run, data if data is not None and data.is_dir() else None)
    return run._rules


def unmet_rules(run: Run) -> dict:
    """{flag: evidence} for each challenge rule (RECORD_RULES) the run's evidence shows unmet. None
    (unverified, e.g. splits_disjoint without a manifest with document hashes) is not a failure: the
    README and submission.json say "unverified" (tools/record/record_readme.py)."""
    return {flag: f"{RECORD_RULES[flag][0]}: {evidence}" for flag, (ok, evidence) in rules_of(run).items()
            if ok is False}


def check_rules(runs: list, track: str) -> dict:
    """Refuse (RecordError naming the flag and the run) a track_10min_16mb record with any rule
    unmet, and any record with a rule every track keeps unmet; returns {seed: {flag: evidence}} of
    the rules a non-record run does not meet (that track accepts longer runs), for the README and
    submission.json."""
    accepted = NON_RECORD_ACCEPTS if track == "track_non_record_16mb" else ()
    out = {}
    for run in runs:
        unmet = unmet_rules(run)
        refused = [f for f in unmet if f not in accepted]
        if refused:
            raise RecordError("; ".join(f"run {run.label}: {f} not met ({unmet[f]})"
                                        for f in refused)
                              + (f": {track} needs every rule met" if track == "track_10min_16mb" else ""))
        if unmet:
            out[str(run.seed)] = unmet
    return out


def check_runs_agree(runs: list) -> None:
    """Refuse runs that differ beyond the seed, repeat a seed, mix TTT and sliding-window scores (a
    TTT_ENABLED plan may skip TTT on one run), or report different code bytes."""
    check_same_settings(runs)
    first = runs[0]
    for run in runs[1:]:
        if int(run.result["bytes_code"]) != int(first.result["bytes_code"]):
            raise RecordError(f"run {run.label}: bytes_code={run.result['bytes_code']} differs from run {first.label} "
                              f"({first.result['bytes_code']}): the runs used different code")


def check_same_settings(runs: list) -> None:
    """Refuse (RecordError naming the run and the setting) runs with result.json that repeat a seed,
    mix TTT and sliding-window scores, or differ beyond the seed in their hyperparameters, world
    size or quantization policy: the seeds of one result (a record, a significance test)."""
    first = runs[0]
    base_hp = {k: v for k, v in (first.result.get("hyperparameters") or {}).items()
               if k not in RECORD_IGNORED_HYPERPARAMETERS}
    seeds = {}
    for run in runs:
        seed = run.seed
        if seed in seeds:
            raise RecordError(f"run {run.label}: seed={seed} repeats run {seeds[seed]}; use distinct SEEDs")
        seeds[seed] = run.label
    for run in runs[1:]:
        key, first_key = final_score_key(run.result), final_score_key(first.result)
        if key != first_key:
            raise RecordError(f"run {run.label}: scored by {FINAL_LINES[key]} (val_bpb_{key}) but run {first.label} by "
                              f"{FINAL_LINES[first_key]} (val_bpb_{first_key}): a record's seeds share one final eval")
        hp = {k: v for k, v in (run.result.get("hyperparameters") or {}).items() if k not in RECORD_IGNORED_HYPERPARAMETERS}
        diff = sorted(k for k in set(hp) | set(base_hp) if hp.get(k, "<missing>") != base_hp.get(k, "<missing>"))
        if diff:
            detail = ", ".join(f"{k.upper()}={hp.get(k)!r} vs {base_hp.get(k)!r}" for k in diff[:6])
            raise RecordError(f"run {run.label}: configuration differs from run {first.label} beyond the seed: "
                              f"hyperparameters {detail}")
        for key in ("world_size", "quant_policy"):
            if run.result.get(key) != first.result.get(key):
                raise RecordError(f"run {run.label}: {key}={run.result.get(key)!r} differs from run {first.label} "
                                  f"({first.result.get(key)!r})")


def check_code_is_current(runs: list, human: str, packed: bytes, root: Path) -> None:
    """The shipped files are built from the current source; refuse if that is not the code that ran
    (its packed size differs, or the code at the top of its log differs).

    `packed` is the packed file's bytes. A run logs the human source (package and human runs) or
    the minified source its wrapper execs (BUNDLE_SOURCE, packed runs); an ASCII (base93/base85)
    packed file's own text and the package's train_gpt.py are accepted too."""
    packed_bytes = len(packed)
    entry = root / BUNDLE_PACKED_NAME
    accepted = {human.rstrip("\n"), unpack_packed(packed).rstrip("\n")}
    if packed.isascii():
        accepted.add(packed.decode("ascii").rstrip("\n"))
    if entry.is_file():  # the trainer logs its own file when kit.bundle cannot be imported
        accepted.add(entry.read_text(encoding="utf-8").rstrip("\n"))
    for run in runs:
        if int(run.result["bytes_code"]) != packed_bytes:
            raise RecordError(f"run {run.label}: bytes_code={run.result['bytes_code']} but the current source packs to "
                              f"{packed_bytes} bytes: the code changed since the run (build the record from the "
                              f"commit that made the runs)")
        logged = run.log["code"]
        if logged and logged.rstrip("\n") not in accepted:
            raise RecordError(f"run {run.label}: the code logged at the top of train.log differs from the current "
                              f"source: the code changed since the run (build the record from the commit that "
                              f"made the runs)")


def choose_track(runs: list, requested: str | None) -> tuple[str, str]:
    """(track, reason). track_10min_16mb needs 8 H100s; everything else is a non-record run."""
    r = runs[0].result
    world, device = int(r["world_size"]), str(r["device"])
    is_8xh100 = world == 8 and "H100" in device
    reason = ("8xH100 within 600 s training, 600 s evaluation and 16,000,000 bytes" if is_8xh100 else
              f"run on {world}x {device}, not 8xH100: the 10-minute record track needs 8xH100 SXM")
    if requested is None:
        return ("track_10min_16mb" if is_8xh100 else "track_non_record_16mb"), reason
    if requested not in RECORD_TRACKS:
        raise RecordError(f"--track {requested!r}: expected one of {', '.join(RECORD_TRACKS)}")
    if requested == "track_10min_16mb" and not is_8xh100:
        raise RecordError(f"--track track_10min_16mb: run {runs[0].label} ran on {world}x {device}; the record "
                          f"track needs 8xH100 (use track_non_record_16mb)")
    if requested == "track_non_record_16mb" and is_8xh100:
        reason = "8xH100 run submitted as non-record by choice"
    return requested, reason

