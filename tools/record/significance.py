"""Is a multi-seed result a significant improvement? (the challenge's record rule)

    python tools/significance.py --runs runs/A runs/B runs/C --baseline-bpb 1.2244
    python tools/significance.py --runs runs/A runs/B --baseline-runs runs/X runs/Y [--metric sliding]

A new record must beat the current best by at least 0.005 nats at p < 0.01. The threshold is in
nats per token; val_bpb is in bits per byte, so it is converted with the runs' tokens_per_byte:
delta_bpb = delta_nats * tokens_per_byte / ln 2. The null hypothesis is "the improvement is at
most delta": against a single baseline value, a one-sided one-sample t-test of
mean(runs) < baseline - delta_bpb; against baseline runs, a one-sided Welch t-test
(scipy.stats.ttest_ind, equal_var=False) of runs < baseline_runs - delta_bpb. Prints per-seed
values, mean, std, t, p, the verdict at --alpha, and how many seeds the observed variance would need.

Runs are run folders (result.json, else train.log), result.json or train.log files, record
folders (submission.json seed_results), or a folder of run folders (a config of tools/sweep.py:
runs/<sweep>/<config>/seed<S>/, every seed that finished).

Refused (exit 2, one line): the same run twice (in one group or in both), a seed twice in one group,
runs (in either group) scored with another tokenizer or dataset than the first (result.json inputs),
seeds of one group whose result.json settings differ beyond the seed (as make_record refuses them),
a val_bpb, baseline or tokens/byte that is not a finite positive number. t is
(mean(runs) - (baseline - threshold)) / its standard error: t < 0 means the runs beat the baseline
by more than the threshold. With no variance at all (t infinite) the verdict is UNVERIFIED, never
SIGNIFICANT; runs scored on part of the val split (VAL_MAX_TOKENS) are UNVERIFIED too, with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from primitives.cli_errors import ArgumentParser
from tools.record.record_checks import check_same_settings
from tools.record.runs import RecordError, final_score_key, load_run

SIG_MIN_IMPROVEMENT_NATS = 0.005
SIG_ALPHA = 0.01
SIG_MAX_SEEDS = 10_000
SIG_METRICS = ("sliding", "roundtrip", "prequant", "ttt", "final")  # final: each run's headline (final_score_key)


@dataclasses.dataclass
class SeedValue:
    label: str
    seed: object
    val_bpb: float
    val_loss: float | None
    tokens_per_byte: float | None
    source: str | None = None  # what identifies the run: its folder (resolved), or record folder + seed
    run: object = None  # the tools.record.runs.Run it came from (None for a record folder's seed)


def load_values(path, metric: str = "sliding") -> list:
    """[SeedValue] from one path (a record folder gives one per seed). Raises ValueError naming the
    path when the metric is not there."""
    path = Path(path)
    if path.is_dir() and not any((path / n).is_file() for n in ("result.json", "train.log", "submission.json")):
        runs = [load_run(d) for d in sorted(path.iterdir()) if (d / "result.json").is_file()]
        finished = [run for run in runs if run.result.get("status", "ok") == "ok"]
        if not finished:
            raise ValueError(f"{path}: no result.json, train.log or submission.json, and no finished run folders in it")
        return [run_value(run, metric) for run in finished]
    if path.is_dir() and (path / "submission.json").is_file() and not (path / "result.json").is_file():
        sub = json.loads((path / "submission.json").read_text(encoding="utf-8"))
        out = []
        for s in sub.get("seed_results") or []:
            # val_bpb is the headline; records older than TTT have no val_bpb_sliding beside it
            plain = metric == "final" or (metric == "sliding" and s.get("val_bpb_ttt") is None)
            bpb = s.get(f"val_bpb_{metric}", s.get("val_bpb") if plain else None)
            loss = s.get(f"val_loss_{metric}", s.get("val_loss") if plain else None)
            if bpb is None:
                raise ValueError(f"{path}: seed_results lack val_bpb_{metric}")
            tpb = s.get("tokens_per_byte") or (bpb * math.log(2) / loss if loss else None)
            out.append(SeedValue(f"{path}[seed {s.get('seed')}]", s.get("seed"), float(bpb), loss, tpb,
                                 f"{path.resolve()}[seed {s.get('seed')}]"))
        if not out:
            raise ValueError(f"{path}: submission.json has no seed_results")
        return out
    return [run_value(load_run(path), metric)]


def run_value(run, metric: str = "sliding") -> SeedValue:
    """The SeedValue of one run (make_record.Run): result.json's metric, else its train.log's final
    line. Raises ValueError naming the run when neither has it. metric "final": the run's headline score
    (ttt when it ran TTT, else sliding)."""
    if metric == "final":
        metric = final_score_key(run.result) if run.result else "ttt" if "ttt" in run.log["final"] else "sliding"
    path, r, final = run.path, run.result, run.log["final"].get(metric)
    bpb = r.get(f"val_bpb_{metric}")
    loss = r.get(f"val_loss_{metric}")
    if bpb is None and final is not None:
        bpb, loss = final["val_bpb"], final["val_loss"]
    if bpb is None:
        raise ValueError(f"{path}: no {metric} val_bpb in result.json or train.log (the run did not finish?)")
    tpb = r.get("tokens_per_byte") if metric == final_score_key(r) else None  # the final pass's own ratio
    if not tpb and loss:
        tpb = float(bpb) * math.log(2) / float(loss)  # bpb = loss / ln2 * tokens/byte
    folder = path if path.is_dir() else path.parent  # r0, r0/result.json and r0/train.log are one run
    return SeedValue(str(path), run.seed, float(bpb), None if loss is None else float(loss), tpb,
                     str(folder.resolve()), run)


def check_group(values: list, flag: str, seen=None) -> str | None:
    """Refuse (ValueError naming `flag` and the run) a run given twice (also across groups: `seen`,
    source -> flag), a seed twice, a val_bpb that is not finite and positive, or seeds whose
    result.json settings differ beyond the seed (tools/record_checks.check_same_settings, as
    make_record). Returns a note when some settings could not be compared (no result.json)."""
    seen = {} if seen is None else seen
    seeds = {}
    for v in values:
        if v.source in seen:
            where = "twice" if seen[v.source] == flag else f"in both {seen[v.source]} and {flag}"
            raise ValueError(f"{flag}: run {v.label} is given {where}; expected each run once")
        seen[v.source] = flag
        if v.seed is not None and v.seed in seeds:
            raise ValueError(f"{flag}: seed {v.seed} of {v.label} repeats {seeds[v.seed]}; expected one run per seed")
        seeds[v.seed] = v.label
        if not (math.isfinite(v.val_bpb) and v.val_bpb > 0):
            raise ValueError(f"{flag}: run {v.label} has val_bpb={v.val_bpb}; expected a finite number > 0 "
                             f"(the run diverged?)")
    runs = [v.run for v in values if v.run is not None and v.run.result]
    if len(runs) >= 2:
        try:
            check_same_settings(runs)
        except RecordError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    unchecked = len(values) - len(runs)
    if len(values) >= 2 and unchecked:
        return (f"{flag}: settings of {unchecked} seed(s) not compared (no result.json: a log or a record's "
                f"seed): unverified that the seeds differ by the seed only")
    return None


def nats_to_bpb(nats: float, tokens_per_byte: float) -> float:
    """A per-token loss difference in nats as bits per byte: nats * tokens_per_byte / ln 2."""
    return nats * tokens_per_byte / math.log(2)


def one_sample_test(values: list, baseline_bpb: float, delta_bpb: float) -> tuple[float, float]:
    """(t, p) of H1: mean(values) < baseline_bpb - delta_bpb (one-sided one-sample t-test)."""
    from scipy import stats

    if len(set(values)) == 1:  # no variance: t is +-inf (or nan), and p is not defined
        return _no_variance_t(values[0] - (baseline_bpb - delta_bpb))
    res = stats.ttest_1samp(values, popmean=baseline_bpb - delta_bpb, alternative="less")
    return float(res.statistic), float(res.pvalue)


def _no_variance_t(diff: float) -> tuple[float, float]:
    return (-math.inf if diff < 0 else math.inf if diff > 0 else math.nan), math.nan


def welch_test(values: list, baseline_values: list, delta_bpb: float) -> tuple[float, float]:
    """(t, p) of H1: mean(values) < mean(baseline_values) - delta_bpb (one-sided Welch t-test)."""
    from scipy import stats

    shifted = [b - delta_bpb for b in baseline_values]
    if len(set(values)) == 1 and len(set(shifted)) == 1:
        return _no_variance_t(values[0] - shifted[0])
    res = stats.ttest_ind(values, shifted, equal_var=False, alternative="less")
    return float(res.statistic), float(res.pvalue)


def seeds_needed(improvement_bpb: float, delta_bpb: float, std_bpb: float, alpha: float,
                 baseline_std_bpb: float | None = None, num_baseline: int | None = None) -> int | None:
    """The smallest number of seeds n >= 2 for which the observed mean improvement and std would give
    p < alpha (one-sample; Welch with the baseline runs fixed when baseline_std_bpb is given).
    None when no n <= SIG_MAX_SEEDS does (improvement not above delta, or baseline noise dominates)."""
    from scipy import stats

    margin = improvement_bpb - delta_bpb
    if margin <= 0:
        return None
    for n in range(2, SIG_MAX_SEEDS + 1):
        if baseline_std_bpb is None:
            se, df = std_bpb / math.sqrt(n), n - 1
        else:
            va, vb = std_bpb ** 2 / n, baseline_std_bpb ** 2 / num_baseline
            se = math.sqrt(va + vb)
            denom = (va ** 2 / (n - 1) if va else 0.0) + (vb ** 2 / (num_baseline - 1) if vb else 0.0)
            df = (va + vb) ** 2 / denom if denom else float(n + num_baseline - 2)
        if se == 0:
            return n
        if stats.t.sf(margin / se, df) < alpha:
            return n
    return None


def analyse(values: list, *, baseline_bpb=None, baseline_values=None, tokens_per_byte=None,
            min_improvement_nats=SIG_MIN_IMPROVEMENT_NATS, alpha=SIG_ALPHA) -> dict:
    """Everything the report prints, as a dict (see the module docstring for the tests)."""
    bpbs = [v.val_bpb for v in values]
    n = len(bpbs)
    _positive("--baseline-bpb", baseline_bpb)
    _positive("--tokens-per-byte", tokens_per_byte)
    if not (math.isfinite(min_improvement_nats) and min_improvement_nats >= 0):
        raise ValueError(f"--min-improvement-nats={min_improvement_nats}: expected a finite number >= 0")
    if not 0 < alpha < 1:
        raise ValueError(f"--alpha={alpha}: expected a probability in (0, 1)")
    mean = statistics.fmean(bpbs)
    std = statistics.stdev(bpbs) if n > 1 else float("nan")
    if tokens_per_byte is None:
        tpbs = [v.tokens_per_byte for v in values if v.tokens_per_byte]
        if not tpbs:
            raise ValueError("tokens_per_byte is unknown (no result.json tokens_per_byte, no val_loss); "
                             "pass --tokens-per-byte")
        tokens_per_byte = statistics.fmean(tpbs)
        _positive("tokens_per_byte of the runs", tokens_per_byte)
    delta_bpb = nats_to_bpb(min_improvement_nats, tokens_per_byte)
    out = {"n": n, "values": bpbs, "mean": mean, "std": std, "tokens_per_byte": tokens_per_byte,
           "min_improvement_nats": min_improvement_nats, "delta_bpb": delta_bpb, "alpha": alpha}
    if baseline_values is not None and len(baseline_values) >= 2:
        b = [v.val_bpb for v in baseline_values]
        b_mean, b_std = statistics.fmean(b), statistics.stdev(b)
        out.update(test="welch", baseline_mean=b_mean, baseline_std=b_std, baseline_n=len(b))
        improvement = b_mean - mean
        t, p = welch_test(bpbs, b, delta_bpb) if n >= 2 else (float("nan"), float("nan"))
        need = seeds_needed(improvement, delta_bpb, std, alpha, b_std, len(b)) if n >= 2 else None
    else:
        if baseline_values is not None:  # a single baseline run is a fixed value
            baseline_bpb = baseline_values[0].val_bpb
            _positive(f"baseline run {baseline_values[0].label} val_bpb", baseline_bpb)
        if baseline_bpb is None:
            raise ValueError("give a baseline: --baseline-bpb VALUE or --baseline-runs PATH...")
        out.update(test="one-sample", baseline_mean=float(baseline_bpb))
        improvement = float(baseline_bpb) - mean
        t, p = one_sample_test(bpbs, float(baseline_bpb), delta_bpb) if n >= 2 else (float("nan"), float("nan"))
        need = seeds_needed(improvement, delta_bpb, std, alpha) if n >= 2 else None
    out.update(improvement_bpb=improvement, improvement_nats=improvement * math.log(2) / tokens_per_byte,
               t=t, p=p, significant=bool(n >= 2 and math.isfinite(t) and p < alpha), seeds_needed=need)
    out["verdict"] = ("UNVERIFIED" if n >= 2 and not math.isfinite(t) else
                      "SIGNIFICANT" if out["significant"] else "NOT SIGNIFICANT")
    return out


def json_safe(value):
    """`value` (dicts, lists, numbers) with each non-finite float (t = -inf with no variance, the std
    and p of one seed) as None: standard JSON has no Infinity or NaN."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _positive(what: str, value) -> None:
    """ValueError naming `what` unless `value` is None or a finite number > 0."""
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what}={value}: expected a finite number > 0")


def format_report(values: list, res: dict, baseline_values=None) -> str:
    lines = ["seed        val_bpb        run"]
    for v in values:
        lines.append(f"{str(v.seed):<10} {v.val_bpb:.8f}   {v.label}")
    std = "n/a (1 seed)" if res["n"] < 2 else f"{res['std']:.8f}"
    lines.append(f"mean {res['mean']:.8f}  std {std}  n {res['n']}  tokens/byte {res['tokens_per_byte']:.5f}")
    if res["test"] == "welch":
        lines.append(f"baseline: mean {res['baseline_mean']:.8f} std {res['baseline_std']:.8f} "
                     f"n {res['baseline_n']} (runs)")
    else:
        lines.append(f"baseline: {res['baseline_mean']:.8f} (fixed value)")
    lines.append(f"improvement: {res['improvement_bpb']:+.8f} bpb = {res['improvement_nats']:+.6f} nats; "
                 f"required > {res['min_improvement_nats']} nats = {res['delta_bpb']:.8f} bpb")
    if res["n"] < 2:
        lines.append("test: needs at least 2 seeds (no variance from one run)")
        lines.append("verdict: NOT SIGNIFICANT (one seed cannot show significance)")
        return "\n".join(lines) + "\n"
    kind = "one-sided Welch t-test" if res["test"] == "welch" else "one-sided one-sample t-test"
    lines.append(f"test: {kind}: t = {res['t']:.4f}, p = {res['p']:.3g} (t = (mean - (baseline - threshold)) / "
                 f"standard error: t < 0 means the runs beat the baseline by more than the threshold)")
    if not math.isfinite(res["t"]):
        lines.append("verdict: UNVERIFIED: the val_bpb values have no variance, so t is not finite (the same "
                     "run given twice, or seeds that did not change the run?)")
        return "\n".join(lines) + "\n"
    if res.get("verdict") == "UNVERIFIED":  # scored on part of the val split (check_same_data's note)
        lines.append("verdict: UNVERIFIED: scored on part of the val split, not the challenge's score (see the note)")
        return "\n".join(lines) + "\n"
    verdict = "SIGNIFICANT" if res["significant"] else "NOT SIGNIFICANT"
    lines.append(f"verdict: {verdict} at p < {res['alpha']} (improvement > {res['min_improvement_nats']} nats)")
    if res["seeds_needed"] is None:
        lines.append("seeds needed at the observed variance: none would do (the observed improvement does not "
                     "exceed the threshold, or the baseline's noise dominates)")
    else:
        lines.append(f"seeds needed at the observed variance: {res['seeds_needed']}")
    return "\n".join(lines) + "\n"


def check_same_data(groups: list) -> list:
    """Refuse (ValueError naming the flag and both runs) runs, in any group, whose result.json binds them to
    another tokenizer or dataset (`inputs`: the sha256 of TOKENIZER_PATH and of the data's manifest.json)
    than the first run's: bpb of two tokenizers or two val splits are not one comparison. Returns notes:
    runs scored on part of the val split (VAL_MAX_TOKENS, compliance.full_val_split false), which make the
    verdict UNVERIFIED, runs whose shards are unverified (compliance.unverified: a manifest without
    shard_sha256), and runs whose inputs are unknown (no result.json, or one from before `inputs`)."""
    first, notes, subset, unknown, unhashed = None, [], [], 0, []
    for flag, values in groups:
        for v in values:
            result = v.run.result if v.run is not None else {}
            inputs = {k: (result.get("inputs") or {}).get(k) for k in ("tokenizer_sha256", "manifest_sha256")}
            if not inputs["tokenizer_sha256"]:
                unknown += 1
            elif first is None:
                first = (v.label, inputs)
            else:
                for key, name in (("tokenizer_sha256", "tokenizer"), ("manifest_sha256", "dataset (manifest.json)")):
                    if inputs[key] != first[1][key]:
                        raise ValueError(f"{flag}: run {v.label} was scored with another {name} than run {first[0]} "
                                         f"(sha256 {str(inputs[key])[:12]} vs {str(first[1][key])[:12]}); expected runs "
                                         "of one tokenizer and one val split")
            partial = (result.get("hyperparameters") or {}).get("val_max_tokens") or (
                (result.get("compliance") or {}).get("full_val_split") is False)
            if partial:
                subset.append(v.label)
            if "no sha256 per shard" in str((result.get("compliance") or {}).get("unverified", "")):
                unhashed.append(v.label)  # shards/format.py verify_dataset could not check the shards' bytes
    if subset:
        notes.append(f"{len(subset)} run(s) scored part of the val split ({', '.join(subset[:3])}"
                     f"{', ...' if len(subset) > 3 else ''}: VAL_MAX_TOKENS or full_val_split false): verdict UNVERIFIED")
    if unhashed:
        notes.append(f"the shards of {len(unhashed)} run(s) are unverified ({unhashed[0]}: its manifest.json records no "
                     "sha256 per shard, so the same manifest_sha256 does not prove the same shard bytes)")
    if unknown and first is not None:
        notes.append(f"the tokenizer and data of {unknown} run(s) are unknown (no result.json inputs): not compared")
    return notes


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python tools/significance.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="the new runs (one per seed)")
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--baseline-bpb", type=float, help="the val_bpb to beat (e.g. the current record)")
    base.add_argument("--baseline-runs", nargs="+", help="runs of the baseline (Welch t-test)")
    parser.add_argument("--metric", choices=SIG_METRICS, default="sliding",
                        help="which final val_bpb (default sliding; final: each run's headline, TTT when it ran TTT)")
    parser.add_argument("--min-improvement-nats", type=float, default=SIG_MIN_IMPROVEMENT_NATS)
    parser.add_argument("--alpha", type=float, default=SIG_ALPHA)
    parser.add_argument("--tokens-per-byte", type=float, help="override the runs' tokens_per_byte")
    parser.add_argument("--json", action="store_true",
                        help="print the analysis as JSON (null where a number is not finite: t, p, std)")
    args = parser.parse_args(argv)
    try:
        values = [v for p in args.runs for v in load_values(p, args.metric)]
        baseline_values = ([v for p in args.baseline_runs for v in load_values(p, args.metric)]
                           if args.baseline_runs else None)
        seen = {}
        notes = [check_group(values, "--runs", seen)]
        if baseline_values is not None:
            notes.append(check_group(baseline_values, "--baseline-runs", seen))
        data_notes = check_same_data([("--runs", values), ("--baseline-runs", baseline_values or [])])
        res = analyse(values, baseline_bpb=args.baseline_bpb, baseline_values=baseline_values,
                      tokens_per_byte=args.tokens_per_byte, min_improvement_nats=args.min_improvement_nats,
                      alpha=args.alpha)
        if any("part of the val split" in n for n in data_notes):  # a subset's score is not the challenge's
            res.update(significant=False, verdict="UNVERIFIED")
        notes += data_notes
    except (RecordError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res["notes"] = [n for n in notes if n]
    if args.json:
        print(json.dumps(json_safe(res), indent=2, default=str, allow_nan=False))
    else:
        print(format_report(values, res, baseline_values), end="")
        for note in res["notes"]:
            print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
