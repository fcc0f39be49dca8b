"""The contents of a record folder (tools/make_record.py): submission.json's fields
(build_submission, seed_results), README.md (build_readme, with the command that reproduces seed 1:
reproduce_command), requirements.txt (build_requirements) and loss_curve.png (plot_loss_curves).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from kit.bundle import BUNDLE_HUMAN_NAME, BUNDLE_PACKED_NAME, LATIN1_TRADE_OFF, REPO_ROOT
from tools.record.record_checks import (RECORD_BYTE_BUDGET, RECORD_EVAL_LIMIT_SECONDS, RECORD_IGNORED_HYPERPARAMETERS,
                                 RECORD_TRAIN_LIMIT_SECONDS, resolve_run_path, rules_of)
from tools.record.runs import FINAL_LINES, Run, final_score_key

RECORD_RUNTIME_PACKAGES = ("torch", "numpy", "sentencepiece", "zstandard", "brotli", "safetensors")
SMOKE_SKIPPED_LINE = (f"**Not run from this folder:** built with `make_record --skip-smoke`, so this folder's "
                      f"`{BUNDLE_PACKED_NAME}` was never executed before submission (`submission.json`: "
                      '`"smoke_run": "skipped"`).')
SCORE_LABELS = {"sliding": "sliding window", "ttt": "legal score-first TTT"}  # final_score_key -> words


def mean_std(values: list) -> tuple[float, float]:
    """(mean, sample standard deviation); the std is 0 for one value."""
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
            "compliance": compliance_of(run),
        })
    return out


def compliance_of(run: Run) -> dict:
    """{flag: true / false / null} of the run's rules (tools/auditor/audit_run.py), plus `unverified`: {flag:
    why} for each null one (not checkable from the evidence here, e.g. no manifest with document
    hashes: not a failure, but not a fact either), when there is one."""
    rules = rules_of(run)
    out = {flag: ok for flag, (ok, _) in rules.items()}
    unverified = {flag: evidence for flag, (ok, evidence) in rules.items() if ok is None}
    return {**out, "unverified": unverified} if unverified else out


def hardware_of(run: Run) -> str:
    return f"{run.result['world_size']}x {run.result['device']}"


def build_submission(runs: list, *, name, author, github_id, blurb, date_iso, track, bytes_code) -> dict:
    per_seed = seed_results(runs)
    bpb_mean, bpb_std = mean_std([s["val_bpb"] for s in per_seed])
    loss_mean, loss_std = mean_std([s["val_loss"] for s in per_seed])
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
    # train_gpt.py imports it where present (the auditor's requirements row asks for it to be named)
    lines.append("# optional, CUDA only: liger-kernel (LOSS_KERNEL=auto takes its fused loss when it imports and passes "
                 "its self-check; else the torch loss)")
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


OFFICIAL_DATA_SCRIPT = "data/cached_challenge_fineweb.py"  # the official repository's downloader
OFFICIAL_DATA_REPO_ID = "willdepueoai/parameter-golf"  # its default dataset repo (sp1024)
RECORD_DEPTH_FROM_ROOT = "../../.."  # records/<track>/<folder> -> the repository root


def official_data(run: Run) -> dict | None:
    """How a reviewer gets the run's data with the official repository's downloader, or None when the
    run's tokenizer or data is not an official export. A `fineweb_<V>_bpe.model` tokenizer is the
    sp<V> export; the data folder's manifest.json (tools/prepare_data.py) must say it was downloaded
    (`source.command == "fineweb"`), not made from other text. Returns {"command", "data_path",
    "tokenizer_path"} with the paths relative to a record folder in the official layout."""
    tokenizer = Path(str(run.result["hyperparameters"].get("tokenizer_path", "")))
    m = re.fullmatch(r"fineweb_(\d+)_bpe\.model", tokenizer.name)
    if not m:
        return None
    variant = f"sp{m.group(1)}"
    data = resolve_run_path(run, "data_path")
    source = {}
    try:
        source = json.loads((data / "manifest.json").read_text(encoding="utf-8")).get("source") or {}
    except (OSError, ValueError, AttributeError):
        pass
    if source and (source.get("command") != "fineweb" or source.get("variant", variant) != variant):
        return None
    repo_id = source.get("repo_id") or (OFFICIAL_DATA_REPO_ID if variant == "sp1024" else "kevclark/parameter-golf")
    shards = sorted(data.glob("fineweb_train_*.bin")) if data.is_dir() else []
    num_shards = len(shards) or len(run.result.get("train_shards") or [])
    env = "" if repo_id == OFFICIAL_DATA_REPO_ID else f"MATCHED_FINEWEB_REPO_ID={repo_id} "
    command = f"{env}python3 {OFFICIAL_DATA_SCRIPT} --variant {variant}" + (
        f" --train-shards {num_shards}" if num_shards else "")
    return {"command": command, "data_path": f"{RECORD_DEPTH_FROM_ROOT}/data/datasets/fineweb10B_{variant}",
            "tokenizer_path": f"{RECORD_DEPTH_FROM_ROOT}/data/tokenizers/{tokenizer.name}"}


def reproduce_command(runs: list, record_dir: Path, name: str, root: Path) -> str:
    """The command that reruns seed 1 from inside the record folder: PRESET, the paths (the official
    layout's when the data is an official export: official_data), the seed and every hyperparameter
    that differs from the preset's default."""
    r = runs[0].result
    hp = r["hyperparameters"]
    defaults = preset_defaults(hp.get("preset", "1xh100"), root) or {}
    env = {"PRESET": hp.get("preset", "1xh100")}
    official = official_data(runs[0])
    for key in ("data_path", "tokenizer_path"):
        path = resolve_run_path(runs[0], key)
        try:
            env[key.upper()] = os.path.relpath(path, record_dir) if path.is_relative_to(REPO_ROOT) else str(path)
        except ValueError:
            env[key.upper()] = str(path)
        if official:
            env[key.upper()] = official[key]
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
                 code_encoding: str = "base93", approach: str = "", smoke_skipped: bool = False) -> str:
    """The record's README.md: headline, the author's Approach, what the run is, per-seed results,
    how to reproduce it (the official data command when the data is an official export), the
    compliance table and the files. `approach` must be non-empty (make_record checks it)."""
    r0 = runs[0].result
    hp = r0["hyperparameters"]
    per = submission["seed_results"]
    n, key = len(per), final_score_key(per[0])  # the last score column: the headline (val_bpb) of each seed
    stats = {k: mean_std([float(s[k]) for s in per]) for k in
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
        *([SMOKE_SKIPPED_LINE, ""] if smoke_skipped else []),
        "## Approach",
        "",
        approach.strip(),
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
    ]
    official = official_data(runs[0])
    if official:
        lines += ["From the root of the official repository (this folder at "
                  f"`{folder_rel}`), download the data and the tokenizer, then run:", "",
                  "```bash", official["command"], f"cd {folder_rel}", command, "```", ""]
    else:
        lines += [f"From the repository root (this folder at `{folder_rel}`). The run's tokenizer "
                  f"`{tok}` and its data are not an official FineWeb export: the author provides them "
                  "(they were made with the kit's `tools/prepare_data.py`; their `manifest.json` records how).", "",
                  "```bash", f"cd {folder_rel}", command, "```", ""]
    if n > 1:
        others = ", ".join(str(s["seed"]) for s in per[1:])
        lines += [f"The other seeds: the same command with SEED={others} (and a matching RUN_ID).", ""]
    flags = [s["compliance"] for s in per]

    def met(flag) -> str:  # over all seeds: yes / NO (seeds) / unverified: why (not checkable)
        bad = [str(s["seed"]) for s in per if s["compliance"].get(flag) is False]
        if bad:
            return f"NO (seed {', '.join(bad)})"
        if all(f.get(flag) is True for f in flags):
            return "yes"
        why = {unverified_reason(flag, f) for f in flags if f.get(flag) is not True}
        return "; ".join(sorted(why))

    disjoint = "checked" if met("splits_disjoint") == "yes" else "not checked" if flags and all(
        f.get("splits_disjoint") is None for f in flags) else "OVERLAP"
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


def unverified_reason(flag: str, compliance: dict) -> str:
    """The README's short word for a flag that is null in a seed's compliance: "unverified: " and
    why, without the run's paths (submission.json's `unverified` has the full evidence)."""
    evidence = str((compliance.get("unverified") or {}).get(flag, "unverified"))
    if "no manifest with document hashes" in evidence:
        return "unverified: no manifest with document hashes"
    if "not on this machine" in evidence:
        return "unverified: the run's data was not on the machine that built the record"
    return "unverified"
