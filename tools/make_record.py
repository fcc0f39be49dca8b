"""Turn 1-3 finished seed runs into a record folder laid out like the official repo (design §4).

    python tools/make_record.py --runs runs/A runs/B runs/C --name MyIdea --author "Jane Doe" \
        --github-id janedoe [--track track_non_record_16mb] [--blurb TEXT] [--force] [--skip-smoke]

writes `records/<track>/<YYYY-MM-DD>_<NAME>/` with README.md (what the run is, per-seed table, mean
and std, the command that reproduces it, compliance, loss curve), submission.json (the official
fields plus track, seeds, seed_results, val_bpb_std, hardware, pytorch_version), the logs as
train_seed<SEED>.log, the packed train_gpt.py (plain ASCII by default; latin-1 only when the runs
measured that opt-in, BUNDLE_ENCODING=latin1, see tools/bundle.py; copied as bytes) and
train_gpt_human.py,
requirements.txt (runtime deps at the run's versions) and loss_curve.png. The score is each run's
final sliding-window line, or its legal score-first TTT line when TTT ran in its place
(tools/runs.py final_score_key); the seeds of one record share one of them.

It refuses (exit 2, the message names the run and the field) runs that are over the byte budget,
did not finish (no final log lines, status not ok), hold a field that is not a number,
break a challenge rule that every track keeps (bytes_ok, full_val_split, val_not_seen_in_training,
splits_disjoint: decided from the evidence by tools/audit_run.py, never from result.json's own
`compliance` flags), differ in
configuration beyond SEED/RUN_ID/OUT_DIR, repeat a seed, report different code bytes, or whose code
is not the current source (the shipped file must be the code that ran); a track_10min_16mb record
with any rule unmet (train_time_ok / eval_time_ok false or the seconds over 600 too), naming the
flag and the run; an existing folder without --force; a track name that is not official or does
not fit the hardware. The non-record track accepts longer runs: its README and submission.json
(`rules_not_met`) state which rules each run does not meet.
The folder is written to a temp dir next to its destination, checked (`check_record`), audited
(tools/audit.py: a failed check refuses the record, except three_seeds / significance, which are
flagged; the result goes into submission.json as its `compliance` block), smoke-run
(the packed train_gpt.py from inside the folder, nothing else on sys.path: 2 CPU steps, export and
the final evals on the first SMOKE_VAL_MAX_TOKENS val tokens; a smoke check, never a score), then
renamed into place: a refused or failed record leaves nothing behind.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python tools/make_record.py`: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.audit_run import number, run_rules
from tools.runs import (FINAL_LINES, LOG_CODE_SEPARATOR, RecordError, Run, final_score_key,  # noqa: F401 (re-exported)
                        load_run, parse_train_log)
from tools.bundle import (BUNDLE_HUMAN_NAME, BUNDLE_PACKED_NAME, LATIN1_TRADE_OFF, REPO_ROOT, build_human_source,
                          minify_source, pack_code, packed_encoding, set_bundle_kind, unpack_packed)

RECORD_BYTE_BUDGET = 16_000_000  # decimal bytes: code + compressed model
RECORD_TRAIN_LIMIT_SECONDS = 600.0
RECORD_EVAL_LIMIT_SECONDS = 600.0
RECORD_TRACKS = ("track_10min_16mb", "track_non_record_16mb")
RECORD_IGNORED_HYPERPARAMETERS = ("seed", "run_id", "out_dir")
RECORD_RUNTIME_PACKAGES = ("torch", "numpy", "sentencepiece", "zstandard", "brotli", "safetensors")
SMOKE_RUN_ID = "record_smoke"
SMOKE_VAL_MAX_TOKENS = 4096  # the smoke run evaluates on this many val tokens: proves the eval runs, scores nothing
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
SMOKE_TIMEOUT_SECONDS = 600
SCORE_LABELS = {"sliding": "sliding window", "ttt": "legal score-first TTT"}  # final_score_key -> words

# -----------------------------------------------------------------------------------------------
# checks
# -----------------------------------------------------------------------------------------------

_REQUIRED_RESULT = ("seed", "steps", "train_seconds", "eval_seconds", "ms_per_step", "world_size", "device",
                    "bytes_model", "bytes_code", "bytes_total", "hyperparameters", "torch_version")


_NUMERIC_RESULT = ("steps", "train_seconds", "eval_seconds", "ms_per_step")


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
    """{flag: (ok, evidence)} of RECORD_RULES from the run's evidence (tools/audit_run.py), cached on
    the run; result.json's own compliance flags are never read."""
    if getattr(run, "_rules", None) is None:
        data = resolve_run_path(run, "data_path") if run.result["hyperparameters"].get("data_path") else None
        run._rules = run_rules(run, data if data is not None and data.is_dir() else None)
    return run._rules


def unmet_rules(run: Run) -> dict:
    """{flag: evidence} for each challenge rule (RECORD_RULES) the run's evidence shows unmet. None
    (not checkable, e.g. splits_disjoint without a manifest) is not a failure."""
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
    first = runs[0]
    base_hp = {k: v for k, v in first.result["hyperparameters"].items() if k not in RECORD_IGNORED_HYPERPARAMETERS}
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
        hp = {k: v for k, v in run.result["hyperparameters"].items() if k not in RECORD_IGNORED_HYPERPARAMETERS}
        diff = sorted(k for k in set(hp) | set(base_hp) if hp.get(k, "<missing>") != base_hp.get(k, "<missing>"))
        if diff:
            detail = ", ".join(f"{k.upper()}={hp.get(k)!r} vs {base_hp.get(k)!r}" for k in diff[:6])
            raise RecordError(f"run {run.label}: configuration differs from run {first.label} beyond the seed: "
                              f"hyperparameters {detail}")
        for key in ("world_size", "quant_policy"):
            if run.result.get(key) != first.result.get(key):
                raise RecordError(f"run {run.label}: {key}={run.result.get(key)!r} differs from run {first.label} "
                                  f"({first.result.get(key)!r})")
        if int(run.result["bytes_code"]) != int(first.result["bytes_code"]):
            raise RecordError(f"run {run.label}: bytes_code={run.result['bytes_code']} differs from run {first.label} "
                              f"({first.result['bytes_code']}): the runs used different code")


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
    if entry.is_file():  # the trainer logs its own file when tools.bundle cannot be imported
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


# -----------------------------------------------------------------------------------------------
# the folder's contents
# -----------------------------------------------------------------------------------------------


def _mean_std(values: list) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def seed_results(runs: list) -> list:
    """One dict per run: val_loss / val_bpb are its headline score (final_score_key); val_*_sliding
    is None for a TTT run (no sliding pass), which adds val_*_ttt and ttt_epochs."""
    out = []
    for run in runs:
        r, key = run.result, final_score_key(run.result)
        ttt = {k: r.get(k) for k in ("val_loss_ttt", "val_bpb_ttt", "ttt_epochs")} if key == "ttt" else {}
        out.append({
            "seed": run.seed, "steps": r["steps"], "ms_per_step": r["ms_per_step"],
            "train_seconds": r["train_seconds"], "eval_seconds": r["eval_seconds"],
            "val_loss": r[f"val_loss_{key}"], "val_bpb": r[f"val_bpb_{key}"],
            "val_loss_prequant": r["val_loss_prequant"], "val_bpb_prequant": r["val_bpb_prequant"],
            "val_loss_roundtrip": r["val_loss_roundtrip"], "val_bpb_roundtrip": r["val_bpb_roundtrip"],
            "val_loss_sliding": r.get("val_loss_sliding"), "val_bpb_sliding": r.get("val_bpb_sliding"), **ttt,
            "eval_stride": r.get("eval_stride"), "bytes_model": r["bytes_model"], "bytes_total": r["bytes_total"],
            "tokens_per_byte": r.get("tokens_per_byte"), "val_tokens": r.get("val_tokens"), "run_id": r.get("run_id"),
            "compliance": {flag: ok for flag, (ok, _) in rules_of(run).items()},
        })
    return out


def hardware_of(run: Run) -> str:
    return f"{run.result['world_size']}x {run.result['device']}"


def build_submission(runs: list, *, name, author, github_id, blurb, date_iso, track, bytes_code) -> dict:
    per_seed = seed_results(runs)
    bpb_mean, bpb_std = _mean_std([s["val_bpb"] for s in per_seed])
    loss_mean, loss_std = _mean_std([s["val_loss"] for s in per_seed])
    r0 = runs[0].result
    return {
        "author": author, "github_id": github_id, "name": name, "blurb": blurb, "date": date_iso,
        "val_loss": round(loss_mean, 8), "val_bpb": round(bpb_mean, 8),
        "bytes_total": max(int(s["bytes_total"]) for s in per_seed), "bytes_code": int(bytes_code),
        "track": track, "seeds": [s["seed"] for s in per_seed], "seed_results": per_seed,
        "val_bpb_std": round(bpb_std, 8), "val_loss_std": round(loss_std, 8),
        "hardware": hardware_of(runs[0]), "pytorch_version": r0["torch_version"],
        "python_version": r0.get("python_version"), "preset": r0.get("preset"),
        "metric": f"{FINAL_LINES[final_score_key(r0)]} (mean over seeds)",
    }


def _strip_local_version(version: str) -> str:
    return version.split("+", 1)[0]


def build_requirements(runs: list) -> str:
    """Runtime deps at the versions the run logged; packages the run did not log get the version
    installed now, marked as such."""
    from importlib import metadata

    logged = dict(runs[0].log["versions"])
    logged.setdefault("torch", runs[0].result.get("torch_version"))
    lines = ["# Runtime dependencies of train_gpt.py, at the versions of the runs (python "
             f"{runs[0].result.get('python_version') or logged.get('python', '?')})."]
    for pkg in RECORD_RUNTIME_PACKAGES:
        version = logged.get(pkg)
        note = ""
        if version is None:
            try:
                version, note = metadata.version(pkg), "  # not logged by the run: version installed at record time"
            except metadata.PackageNotFoundError:
                lines.append(f"{pkg}")
                continue
        if "+" in version:
            note = f"  # the run used {version} (local build tag dropped for pip)"
        lines.append(f"{pkg}=={_strip_local_version(version)}{note}")
    return "\n".join(lines) + "\n"


def plot_loss_curves(runs: list, path: Path, title: str) -> None:
    """train_loss per logged step (one line per seed) and the validation points, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for i, run in enumerate(runs):
        color = f"C{i}"
        if run.log["train"]:
            steps, losses = zip(*run.log["train"])
            ax.plot(steps, losses, color=color, lw=1.2, label=f"seed {run.seed} train_loss")
        if run.log["val"]:
            vs, vl, _ = zip(*run.log["val"])
            ax.plot(vs, vl, "o", color=color, ms=5, mfc="white", label=f"seed {run.seed} val_loss")
        key = final_score_key(run.result)
        final = run.log["final"].get(key)
        if final and run.result.get("steps") is not None:
            ax.plot([run.result["steps"]], [final["val_loss"]], "*", color=color, ms=10,
                    label=f"seed {run.seed} final {SCORE_LABELS[key]} val_loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def _run_cwd(run: Run) -> Path:
    """Where the run was launched: OUT_DIR/RUN_ID is the run folder, OUT_DIR relative to the cwd."""
    out_dir = Path(str(run.result["hyperparameters"].get("out_dir", "runs")))
    if out_dir.is_absolute():
        return REPO_ROOT
    path = run.path.resolve()
    return path.parents[len(out_dir.parts)] if len(path.parents) > len(out_dir.parts) else REPO_ROOT


def resolve_run_path(run: Run, key: str) -> Path:
    value = Path(str(run.result["hyperparameters"][key]))
    return value if value.is_absolute() else (_run_cwd(run) / value).resolve()


def _env_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return shlex.quote(str(value))


def preset_defaults(preset: str, root: Path) -> dict | None:
    """The resolved hyperparameters of PRESET alone, from the trainer in `root` (None if unavailable)."""
    code = ("import json,sys,dataclasses;sys.path.insert(0,sys.argv[1]);import train_gpt as t;"
            "hp=t.Hyperparameters.from_env({'PRESET':sys.argv[2],'RUN_ID':'x'},log=lambda *a:None);"
            "print(json.dumps(dataclasses.asdict(hp)))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(root), preset], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": ""})
        return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def reproduce_command(runs: list, record_dir: Path, name: str, root: Path) -> str:
    """The command that reruns seed 1 from inside the record folder: PRESET, the paths, the seed and
    every hyperparameter that differs from the preset's default."""
    r = runs[0].result
    hp = r["hyperparameters"]
    defaults = preset_defaults(hp.get("preset", "1xh100"), root) or {}
    env = {"PRESET": hp.get("preset", "1xh100")}
    for key in ("data_path", "tokenizer_path"):
        path = resolve_run_path(runs[0], key)
        try:
            env[key.upper()] = os.path.relpath(path, record_dir) if path.is_relative_to(REPO_ROOT) else str(path)
        except ValueError:
            env[key.upper()] = str(path)
    skip = set(RECORD_IGNORED_HYPERPARAMETERS) | {"preset", "data_path", "tokenizer_path"}
    for key in sorted(hp):
        if key not in skip and (key not in defaults or defaults[key] != hp[key]):
            env[key.upper()] = hp[key]
    env["SEED"] = runs[0].seed
    env["RUN_ID"] = f"{name}_seed{runs[0].seed}"
    assignments = " \\\n  ".join(f"{k}={_env_value(v)}" for k, v in env.items())
    world = int(r["world_size"])
    launcher = ("python train_gpt.py" if world == 1 else
                f"torchrun --standalone --nproc_per_node={world} train_gpt.py")
    return f"{assignments} \\\n  {launcher}"


def _fmt_bpb(x) -> str:
    return f"{float(x):.8f}"


def build_readme(runs: list, submission: dict, *, track_reason: str, command: str, folder_rel: str,
                 code_encoding: str = "base93") -> str:
    r0 = runs[0].result
    hp = r0["hyperparameters"]
    per = submission["seed_results"]
    n, key = len(per), final_score_key(per[0])  # the last score column: the headline (val_bpb) of each seed
    stats = {k: _mean_std([float(s[k]) for s in per]) for k in
             ("steps", "ms_per_step", "val_bpb_prequant", "val_bpb_roundtrip", "val_bpb", "bytes_total")}
    max_total = max(int(s["bytes_total"]) for s in per)
    max_train = max(float(s["train_seconds"]) for s in per)
    max_eval = max(float(s["eval_seconds"]) for s in per)
    tok = Path(str(hp.get("tokenizer_path", "?"))).name
    params = r0.get("model_params")
    model_line = (f"- Model: {hp.get('num_layers')} layers, d_model {hp.get('model_dim')}, {hp.get('num_heads')} query / "
                  f"{hp.get('num_kv_heads')} KV heads, MLP {hp.get('mlp_mult')}x {hp.get('mlp_activation', '')}, vocab "
                  f"{hp.get('vocab_size')} (`{tok}`)" + (f", {params:,} parameters." if isinstance(params, int) else "."))
    cap = (f"wallclock cap {float(hp['max_wallclock_seconds']):.0f} s" if hp.get("max_wallclock_seconds")
           else f"no wallclock cap (ITERATIONS={hp.get('iterations')})")
    train_line = (f"- Training: {int(hp.get('train_batch_tokens', 0)):,} tokens/step at sequence length "
                  f"{hp.get('train_seq_len')}, {cap}, {stats['steps'][0]:.0f} steps on average.")
    lines = [
        f"# {submission['name']}",
        "",
        submission["blurb"],
        "",
        f"**val_bpb {submission['val_bpb']:.8f}** (mean of {n} seed{'s' if n > 1 else ''}, {SCORE_LABELS[key]}, "
        f"stride {per[0].get('eval_stride')}, std {submission['val_bpb_std']:.8f}; val_loss "
        f"{submission['val_loss']:.8f} nats) · artifact at most {max_total:,} bytes · "
        f"track `{submission['track']}` · {submission['hardware']}",
        "",
        "## What this is",
        "",
        f"- Trainer: `train_gpt.py` of the parameter-golf kit, preset `{hp.get('preset')}`, generated from the "
        f"readable package by `tools/bundle.py` (`train_gpt_human.py` is the same code before stripping).",
        model_line,
        train_line,
        f"- Track: `{submission['track']}` ({track_reason}).",
        f"- Software: PyTorch {submission['pytorch_version']}, Python {submission.get('python_version')}.",
        "",
        "## Results",
        "",
        f"| seed | steps | ms/step | pre-quant val_bpb | roundtrip val_bpb | {'TTT' if key == 'ttt' else 'sliding'} "
        "val_bpb | artifact bytes |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in per:
        lines.append(f"| {s['seed']} | {s['steps']} | {float(s['ms_per_step']):.2f} | {_fmt_bpb(s['val_bpb_prequant'])} | "
                     f"{_fmt_bpb(s['val_bpb_roundtrip'])} | {_fmt_bpb(s['val_bpb'])} | {int(s['bytes_total']):,} |")
    lines.append(f"| **mean** | {stats['steps'][0]:.1f} | {stats['ms_per_step'][0]:.2f} | "
                 f"{_fmt_bpb(stats['val_bpb_prequant'][0])} | {_fmt_bpb(stats['val_bpb_roundtrip'][0])} | "
                 f"**{_fmt_bpb(stats['val_bpb'][0])}** | {stats['bytes_total'][0]:,.0f} |")
    lines.append(f"| std | {stats['steps'][1]:.1f} | {stats['ms_per_step'][1]:.2f} | "
                 f"{_fmt_bpb(stats['val_bpb_prequant'][1])} | {_fmt_bpb(stats['val_bpb_roundtrip'][1])} | "
                 f"{_fmt_bpb(stats['val_bpb'][1])} | {stats['bytes_total'][1]:,.0f} |")
    lines += [
        "",
        "std is the sample standard deviation over seeds (0 with one seed). val_bpb = (sum of NLL in nats / ln 2) "
        "/ (UTF-8 bytes of the scored targets), on the full validation split, evaluated on the weights re-read "
        "from the compressed artifact." + (" TTT (eval/ttt.py) scores each val chunk before it adapts the model on "
                                            "it: no token is scored by weights that have seen it." if key == "ttt" else ""),
        "",
        "![loss curves](loss_curve.png)",
        "",
        "## Reproduce",
        "",
        "From the repository root, with the dataset and tokenizer in place:",
        "",
        "```bash",
        f"cd {folder_rel}",
        command,
        "```",
        "",
    ]
    if n > 1:
        others = ", ".join(str(s["seed"]) for s in per[1:])
        lines += [f"The other seeds: the same command with SEED={others} (and a matching RUN_ID).", ""]
    flags = [s["compliance"] for s in per]

    def met(flag) -> str:  # over all seeds: yes / NO (seeds) / n/a (not checkable)
        bad = [str(s["seed"]) for s in per if s["compliance"].get(flag) is False]
        if bad:
            return f"NO (seed {', '.join(bad)})"
        return "yes" if all(f.get(flag) is True for f in flags) else "n/a"

    disjoint = {"yes": "checked", "n/a": "no manifest: not checked"}.get(met("splits_disjoint"), "OVERLAP")
    lines += [
        "## Compliance",
        "",
        "Each rule is decided by `tools/make_record.py` from what the run measured and logged (times, "
        "bytes, val tokens, train shards, manifest; never the run's own flags), per seed in `submission.json`.",
        "",
        "| rule | value | limit | met |",
        "|---|---:|---:|:---:|",
        f"| training time (max over seeds) | {max_train:.1f} s | {RECORD_TRAIN_LIMIT_SECONDS:.0f} s | "
        f"{met('train_time_ok')} |",
        f"| evaluation time (max over seeds) | {max_eval:.1f} s | {RECORD_EVAL_LIMIT_SECONDS:.0f} s | "
        f"{met('eval_time_ok')} |",
        f"| artifact bytes (max over seeds) | {max_total:,} | {RECORD_BYTE_BUDGET:,} | "
        f"{met('bytes_ok')} (margin {RECORD_BYTE_BUDGET - max_total:,}) |",
        f"| code bytes (`train_gpt.py`, measured) | {submission['bytes_code']:,} | counted in the artifact | yes |",
        f"| validation split scored | every token of the val shards | full | {met('full_val_split')} |",
        f"| val shards read by the training loader | none (it opened train shards only) | none | "
        f"{met('val_not_seen_in_training')} |",
        f"| train/val documents disjoint (manifest doc hashes) | {disjoint} | disjoint | {met('splits_disjoint')} |",
        "",
    ]
    not_met = submission.get("rules_not_met") or {}
    if not_met:
        lines += [f"**Rules not met** (accepted in `{submission['track']}`, which takes runs beyond the limits; a "
                  "`track_10min_16mb` record must meet every rule):", ""]
        lines += [f"- seed {seed}: `{flag}`: {evidence}" for seed, unmet in not_met.items()
                  for flag, evidence in unmet.items()]
        lines.append("")
    lines += [
        f"Hardware: {submission['hardware']}. Track: `{submission['track']}` ({track_reason}).",
        "",
        "## Files",
        "",
        f"- `{BUNDLE_PACKED_NAME}`: the counted script ({submission['bytes_code']:,} bytes; runs from this folder)"
        + (f"; {LATIN1_TRADE_OFF}." if code_encoding == "latin1" else
           f"; plain ASCII: minified, compressed, {code_encoding}-encoded code and a short exec wrapper."),
        f"- `{BUNDLE_HUMAN_NAME}`: the same code, readable (not counted).",
        "- " + ", ".join(f"`train_seed{s['seed']}.log`" for s in per) + ": the training logs.",
        "- `submission.json`, `requirements.txt`, `loss_curve.png`.",
        "",
    ]
    return "\n".join(lines)


# -----------------------------------------------------------------------------------------------
# checking and smoke-running a folder
# -----------------------------------------------------------------------------------------------

_SUBMISSION_FIELDS = ("author", "github_id", "name", "blurb", "date", "val_loss", "val_bpb", "bytes_total",
                      "bytes_code", "track", "seeds", "seed_results", "val_bpb_std", "hardware", "pytorch_version")


def _refuse_outside_links(folder: Path) -> None:
    """A file of the folder that is a symlink out of it (a log, the script) is refused: the folder
    must hold its own evidence and code."""
    from tools.audit_rules import folder_files, is_inside

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
    from tools.audit import audit_folder, compliance, format_table
    from tools.audit_bytes import measure_tokens_per_byte

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


def smoke_run(folder: Path, run: Run, log=print) -> dict:
    """Run the packed train_gpt.py from inside `folder`, with no PYTHONPATH (only the file itself can
    provide the code): 2 CPU-sized steps (PRESET=smoke), the export, then the final evals on the first
    SMOKE_VAL_MAX_TOKENS val tokens (a smoke check that the shipped file evaluates, not a score).
    Checks that it exits 0, logs its own size as code_bytes, the 2 steps and every final line (the
    sliding pass: no TTT_* or QUANT_* variable of the shell reaches it, nor any of the run's settings).
    Leaves the folder as it was; returns {"code_bytes", "train", "final"} from its log."""
    before = sorted(p.name for p in folder.iterdir())
    packed_bytes = (folder / BUNDLE_PACKED_NAME).stat().st_size
    hp = run.result["hyperparameters"]
    with tempfile.TemporaryDirectory(prefix="record_smoke_") as out_dir:
        env = {k: v for k, v in os.environ.items()
               if k != "PYTHONPATH" and not k.startswith(("QUANT_", "TTT_")) and k.lower() not in hp}
        env.update(PRESET="smoke", ITERATIONS="2", VAL_MAX_TOKENS=str(SMOKE_VAL_MAX_TOKENS), EVAL_AUTO_STRIDE="0",
                   MAX_WALLCLOCK_SECONDS="0", WARMUP_STEPS="0", TRAIN_LOG_EVERY="1", RUN_ID=SMOKE_RUN_ID, OUT_DIR=out_dir,
                   DATA_PATH=str(resolve_run_path(run, "data_path")),
                   TOKENIZER_PATH=str(resolve_run_path(run, "tokenizer_path")),
                   VOCAB_SIZE=str(hp.get("vocab_size", 1024)), SEED=str(run.seed))
        env.setdefault("OMP_NUM_THREADS", "2")
        cmd = [sys.executable, BUNDLE_PACKED_NAME]
        log(f"smoke: cd {folder} && PRESET=smoke ITERATIONS=2 VAL_MAX_TOKENS={SMOKE_VAL_MAX_TOKENS} ... "
            f"python {BUNDLE_PACKED_NAME}")
        try:
            proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True,
                                  timeout=SMOKE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired as e:
            raise RecordError(f"smoke run of {BUNDLE_PACKED_NAME} timed out after {SMOKE_TIMEOUT_SECONDS} s") from e
        tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-2500:]).strip()
        if proc.returncode != 0:
            raise RecordError(f"smoke run of {BUNDLE_PACKED_NAME} from inside the record folder failed "
                              f"(exit {proc.returncode}); use --skip-smoke only if the data is not on this "
                              f"machine:\n{tail}")
        log_path = Path(out_dir) / SMOKE_RUN_ID / "train.log"
        parsed = parse_train_log(log_path.read_text(encoding="utf-8")) if log_path.is_file() else None
        if parsed is None or parsed["code_bytes"] != packed_bytes:
            raise RecordError(f"smoke run: the log reports code_bytes={parsed and parsed['code_bytes']}, expected "
                              f"the packed file's {packed_bytes} bytes")
        if not parsed["train"] or parsed["train"][-1][0] != 2:
            raise RecordError(f"smoke run: the log has no `step:2/2 train_loss:` line:\n{tail}")
        missing = [f"final_{k}_exact" for k, key in (("prequant", "prequant"), ("roundtrip", "roundtrip"),
                                                    ("sliding_window", "sliding")) if key not in parsed["final"]]
        if missing or parsed["total_bytes"] is None:
            raise RecordError(f"smoke run: the log lacks {', '.join(missing) or 'Total submission size'}:\n{tail}")
    for p in folder.iterdir():  # nothing may be left behind (e.g. a runs/ folder from a bad OUT_DIR)
        if p.name not in before:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    sliding = parsed["final"]["sliding"]
    log(f"smoke: ok, packed file ran from the folder: code_bytes:{parsed['code_bytes']} steps:2 "
        f"final_sliding_window_exact val_bpb:{sliding['val_bpb']:.4f} stride:{sliding['stride']} "
        f"(smoke check on {SMOKE_VAL_MAX_TOKENS} val tokens, not a score)")
    return {"code_bytes": parsed["code_bytes"], "train": parsed["train"], "final": parsed["final"]}


# -----------------------------------------------------------------------------------------------
# main flow
# -----------------------------------------------------------------------------------------------


def make_record(run_paths, *, name, author, github_id, track=None, blurb=None, force=False, skip_smoke=False,
                records_dir=None, root=None, date=None, log=print) -> Path:
    """Build and check the record folder; returns its path. Raises RecordError when refused."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name or ""):
        raise RecordError(f"--name {name!r}: expected letters, digits, '.', '_' or '-' (it names the folder)")
    if not run_paths:
        raise RecordError("--runs: give at least one run folder")
    root = Path(root) if root is not None else REPO_ROOT
    records_dir = Path(records_dir) if records_dir is not None else root / "records"
    runs = [load_run(p) for p in run_paths]
    for run in runs:
        check_run(run)
    check_runs_agree(runs)
    human = build_human_source(root)
    packed = pack_code(minify_source(set_bundle_kind(human, "packed")))[0]  # bytes; ASCII unless BUNDLE_ENCODING
    check_code_is_current(runs, human, packed, root)
    track_name, reason = choose_track(runs, track)
    rules_not_met = check_rules(runs, track_name)
    now = dt.datetime.now(dt.timezone.utc)
    day = date or now.strftime("%Y-%m-%d")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", day):
        raise RecordError(f"--date {day!r}: expected YYYY-MM-DD")
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
    mean_bpb, std_bpb = _mean_std([float(r.result[f"val_bpb_{key}"]) for r in runs])
    hp = runs[0].result["hyperparameters"]
    if not blurb:
        blurb = (f"{hp.get('num_layers')}x{hp.get('model_dim')} GPT, preset {hp.get('preset')}, "
                 f"{len(runs)} seed{'s' if len(runs) > 1 else ''} on {hardware_of(runs[0])}: val_bpb "
                 f"{mean_bpb:.4f} (std {std_bpb:.4f}, {SCORE_LABELS[key]}), artifact "
                 f"{max(int(r.result['bytes_total']) for r in runs):,} bytes.")
    submission = build_submission(runs, name=name, author=author, github_id=github_id, blurb=blurb,
                                  date_iso=date_iso, track=track_name, bytes_code=len(packed))
    submission["rules_not_met"] = rules_not_met  # {seed: {flag: evidence}}; {} when every run meets every rule
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
                                                    folder_rel=folder_rel, code_encoding=packed_encoding(packed)),
                                       encoding="utf-8")
        check_record(tmp)
        audit_record(tmp, runs, submission, log=log)
        if skip_smoke:
            log("smoke run skipped (--skip-smoke)")
        else:
            smoke_run(tmp, runs[0], log=log)
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
    parser.add_argument("--skip-smoke", action="store_true", help="do not run the packed script from the folder")
    parser.add_argument("--records-dir", help="default: <repo>/records")
    parser.add_argument("--date", help="YYYY-MM-DD for the folder name (default: today, UTC)")
    parser.add_argument("--check", metavar="FOLDER", help="only check an existing record folder")
    parser.add_argument("--root", default=str(REPO_ROOT), help="source root to bundle (default: this repo)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            sub = check_record(args.check)
            print(f"ok: {args.check} (val_bpb {sub['val_bpb']}, {len(sub['seeds'])} seeds)")
            return 0
        for flag in ("runs", "name", "author", "github_id"):
            if not getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} is required")
        make_record(args.runs, name=args.name, author=args.author, github_id=args.github_id, track=args.track,
                    blurb=args.blurb, force=args.force, skip_smoke=args.skip_smoke, records_dir=args.records_dir,
                    root=args.root, date=args.date)
    except RecordError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
