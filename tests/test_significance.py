"""tools/significance.py against t statistics computed by hand (formulas written out here)."""

import json
import math
from pathlib import Path

import pytest

from tools.record import significance
from tools.record.significance import SeedValue, analyse, seeds_needed

LN2 = math.log(2)
TPB = 0.41
NEW = [1.1000, 1.1020, 1.1010]
BASE_RUNS = [1.1150, 1.1190, 1.1170, 1.1230]


def values(bpbs, tpb=TPB):
    return [SeedValue(f"run{i}", i, b, b * LN2 / tpb, tpb) for i, b in enumerate(bpbs)]


def sample_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_threshold_is_nats_converted_with_tokens_per_byte():
    assert significance.nats_to_bpb(0.005, TPB) == pytest.approx(0.005 * TPB / LN2)
    assert significance.nats_to_bpb(0.005, TPB) == pytest.approx(0.0029575248, abs=1e-10)


def test_one_sample_t_statistic_matches_the_formula():
    delta = 0.005 * TPB / LN2
    mean, s = sum(NEW) / 3, sample_std(NEW)
    t_hand = (mean - (1.12 - delta)) / (s / math.sqrt(3))
    assert t_hand == pytest.approx(-27.786382067, rel=1e-9)
    res = analyse(values(NEW), baseline_bpb=1.12)
    assert res["test"] == "one-sample" and res["t"] == pytest.approx(t_hand, rel=1e-9)
    assert res["p"] == pytest.approx(0.00064634330, rel=1e-6)  # Student t cdf(t, df=2)
    assert res["significant"] and res["delta_bpb"] == pytest.approx(delta)
    assert res["improvement_bpb"] == pytest.approx(0.019)
    assert res["improvement_nats"] == pytest.approx(0.019 * LN2 / TPB)


def test_welch_t_statistic_and_degrees_of_freedom_match_the_formula():
    delta = 0.005 * TPB / LN2
    ma, mb = sum(NEW) / 3, sum(BASE_RUNS) / 4
    va, vb = sample_std(NEW) ** 2 / 3, sample_std(BASE_RUNS) ** 2 / 4
    t_hand = (ma - (mb - delta)) / math.sqrt(va + vb)
    df_hand = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    assert (t_hand, df_hand) == (pytest.approx(-8.0667138283, rel=1e-9), pytest.approx(3.6533226581, rel=1e-9))
    res = analyse(values(NEW), baseline_values=values(BASE_RUNS))
    assert res["test"] == "welch" and res["t"] == pytest.approx(t_hand, rel=1e-9)
    assert res["p"] == pytest.approx(0.00093295768, rel=1e-6)
    assert res["significant"]


def test_an_improvement_below_the_threshold_is_not_significant_however_tight():
    tight = [1.1180, 1.1181, 1.1179]  # 0.002 bpb better than 1.12, threshold 0.00296 bpb
    res = analyse(values(tight), baseline_bpb=1.12)
    assert res["t"] > 0 and res["p"] > 0.5 and not res["significant"] and res["seeds_needed"] is None


def test_seeds_needed_is_the_smallest_n_that_reaches_alpha():
    from scipy import stats

    improvement, delta, s = 0.0045, 0.0029575, 0.0012
    n = seeds_needed(improvement, delta, s, 0.01)
    p = lambda k: stats.t.sf((improvement - delta) / (s / math.sqrt(k)), k - 1)  # noqa: E731
    assert n is not None and n > 2 and p(n) < 0.01 <= p(n - 1)
    assert seeds_needed(0.002, delta, s, 0.01) is None  # not above the threshold: no n helps
    assert seeds_needed(0.01, delta, 0.0, 0.01) == 2  # no variance at all


def test_one_seed_reports_that_it_cannot_be_significant(capsys):
    res = analyse(values([1.0]), baseline_bpb=1.2)
    assert math.isnan(res["t"]) and not res["significant"]
    report = significance.format_report(values([1.0]), res)
    assert "needs at least 2 seeds" in report and "NOT SIGNIFICANT" in report


def _write_run(folder: Path, seed, bpb, loss, with_result=True):
    folder.mkdir(parents=True)
    log = ("code\n" + "=" * 100 + f"\nSEED:{seed}\nfinal_sliding_window_exact val_loss:{loss:.8f} val_bpb:{bpb:.8f} "
           "stride:64 eval_time:1ms\nTotal submission size: 10 bytes\n")
    (folder / "train.log").write_text(log)
    if with_result:
        (folder / "result.json").write_text(json.dumps({"seed": seed, "val_bpb_sliding": bpb, "val_loss_sliding": loss,
                                                        "tokens_per_byte": bpb * LN2 / loss, "hyperparameters": {}}))


def test_cli_reads_result_json_and_bare_logs_and_prints_the_verdict(tmp_path, capsys):
    paths = []
    for i, bpb in enumerate(NEW):
        _write_run(tmp_path / f"r{i}", 100 + i, bpb, bpb * LN2 / TPB, with_result=(i != 2))
    paths = [str(tmp_path / "r0"), str(tmp_path / "r1" / "result.json"), str(tmp_path / "r2" / "train.log")]
    assert significance.main(["--runs", *paths, "--baseline-bpb", "1.12"]) == 0
    out = capsys.readouterr().out
    assert "100        1.10000000" in out and "102        1.10100000" in out  # seed from the log for r2
    assert "t = -27.7864" in out and "verdict: SIGNIFICANT at p < 0.01" in out
    assert "tokens/byte 0.41000" in out
    assert significance.main(["--runs", *paths, "--baseline-bpb", "1.12", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["t"] == pytest.approx(-27.786382067, rel=1e-7)


def test_cli_welch_against_baseline_runs_and_errors(tmp_path, capsys):
    for i, bpb in enumerate(NEW):
        _write_run(tmp_path / "new" / str(i), i, bpb, bpb * LN2 / TPB)
    for i, bpb in enumerate(BASE_RUNS):
        _write_run(tmp_path / "base" / str(i), i, bpb, bpb * LN2 / TPB)
    new = [str(p) for p in sorted((tmp_path / "new").iterdir())]
    base = [str(p) for p in sorted((tmp_path / "base").iterdir())]
    assert significance.main(["--runs", *new, "--baseline-runs", *base]) == 0
    out = capsys.readouterr().out
    assert "Welch" in out and "t = -8.0667" in out and "SIGNIFICANT" in out
    assert significance.main(["--runs", str(tmp_path / "missing"), "--baseline-bpb", "1"]) == 2
    assert "no result.json and no train.log" in capsys.readouterr().err


def test_a_sweep_config_folder_is_read_as_its_group_of_seeds(tmp_path, capsys):
    """tools/sweep.py lays runs out as <sweep>/<config>/seed<S>/: the config folder is the group."""
    for i, bpb in enumerate(NEW):
        _write_run(tmp_path / "sweep" / "new" / f"seed{i}", i, bpb, bpb * LN2 / TPB)
    for i, bpb in enumerate(BASE_RUNS):
        _write_run(tmp_path / "sweep" / "base" / f"seed{i}", i, bpb, bpb * LN2 / TPB)
    (tmp_path / "sweep" / "base" / "seed9").mkdir()  # a run that never finished is not a seed
    (tmp_path / "sweep" / "base" / "seed9" / "result.json").write_text(json.dumps({"status": "stopped_by_signal"}))
    assert significance.main(["--runs", str(tmp_path / "sweep" / "new"),
                              "--baseline-runs", str(tmp_path / "sweep" / "base")]) == 0
    out = capsys.readouterr().out
    assert "t = -8.0667" in out and f"n {len(BASE_RUNS)} (runs)" in out
    (tmp_path / "empty").mkdir()
    assert significance.main(["--runs", str(tmp_path / "empty"), "--baseline-bpb", "1"]) == 2
    assert "no finished run folders in it" in capsys.readouterr().err
    (tmp_path / "sweep" / "new" / "seed7").mkdir()  # a damaged seed: one line naming it, no traceback
    (tmp_path / "sweep" / "new" / "seed7" / "result.json").write_text("{")
    assert significance.main(["--runs", str(tmp_path / "sweep" / "new"), "--baseline-bpb", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sweep' / 'new' / 'seed7'}: result.json is not valid JSON" in err and len(err.splitlines()) == 1


def test_metric_final_reads_each_run_s_headline_and_sliding_never_takes_a_ttt_score(tmp_path):
    """A run whose plan kept TTT has val_bpb_ttt and `final_ttt_exact`, no sliding score: "ttt" and
    "final" read it (from result.json, or its log alone), "sliding" refuses; a sliding run under
    "final" reads its sliding score. A record folder's TTT seeds likewise (val_bpb is the headline)."""
    ttt = tmp_path / "ttt"
    ttt.mkdir()
    (ttt / "train.log").write_text("code\n" + "=" * 100 + "\nSEED:5\nfinal_roundtrip_exact val_loss:2.1 val_bpb:1.25\n"
                                   "final_ttt_exact val_loss:2.00000000 val_bpb:1.18000000 eval_time:9ms stride:64 "
                                   "chunks:2 updates:3\n")
    (ttt / "result.json").write_text(json.dumps({"seed": 5, "val_bpb_ttt": 1.18, "val_loss_ttt": 2.0,
                                                 "val_bpb_roundtrip": 1.25, "tokens_per_byte": 0.4}))
    _write_run(tmp_path / "sliding", 6, 1.19, 2.02)
    for metric in ("ttt", "final"):
        (v,) = significance.load_values(ttt, metric)
        assert (v.val_bpb, v.val_loss, v.tokens_per_byte, v.seed) == (1.18, 2.0, 0.4, 5)
    (v,) = significance.load_values(ttt / "train.log", "final")  # no result.json: the log's TTT line
    assert (v.val_bpb, v.val_loss) == (1.18, 2.0)
    with pytest.raises(ValueError, match="no sliding val_bpb"):
        significance.load_values(ttt, "sliding")
    assert significance.load_values(tmp_path / "sliding", "final")[0].val_bpb == 1.19
    record = tmp_path / "record"
    record.mkdir()
    (record / "submission.json").write_text(json.dumps({"seed_results": [
        {"seed": 1, "val_bpb": 1.18, "val_loss": 2.0, "val_bpb_ttt": 1.18, "val_loss_ttt": 2.0, "val_bpb_sliding": None}]}))
    assert [v.val_bpb for v in significance.load_values(record, "final")] == [1.18]
    assert [v.val_bpb for v in significance.load_values(record, "ttt")] == [1.18]
    with pytest.raises(ValueError, match="seed_results lack val_bpb_sliding"):
        significance.load_values(record, "sliding")


def _tool_imports(path) -> set:
    """Every tools.* module `path` imports, at module or function level (ast: no code is run)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tools"):
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("tools."))
    return names


def test_no_import_cycle_among_tools_modules():
    """make_record -> audit -> audit_checks -> significance -> make_record was a circle hidden by lazy
    imports; run loading now lives in tools/record/runs.py. Function-level imports count too."""
    tools_dir = Path(__file__).resolve().parents[1] / "tools"
    mods = {".".join(p.relative_to(tools_dir.parent).with_suffix("").parts): p
            for p in [*tools_dir.glob("*.py"), *tools_dir.glob("*/*.py")] if p.stem != "__init__"}
    graph = {m: _tool_imports(p) & set(mods) for m, p in mods.items()}

    def cycle_from(start):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in map(cycle_from, sorted(graph)) if c]
    assert not cycles, "import cycle(s) among tools/: " + "; ".join(" -> ".join(c) for c in cycles)
    assert "tools.record.runs" in graph["tools.record.make_record"]
    assert "tools.record.make_record" not in graph["tools.record.significance"]


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "SIGNIFICANT" not in captured.out, captured
    return lines[0]


def test_the_same_run_twice_or_a_repeated_seed_is_refused(tmp_path, capsys):
    """The same run three times gave t = -inf and "SIGNIFICANT at p < 0.01"."""
    for i, bpb in enumerate(NEW):
        _write_run(tmp_path / f"r{i}", 100 + i, bpb, bpb * LN2 / TPB)
    r0 = str(tmp_path / "r0")
    assert significance.main(["--runs", r0, r0, r0, "--baseline-bpb", "1.12"]) == 2
    assert f"--runs: run {r0} is given twice; expected each run once" in _one_line_error(capsys)
    assert significance.main(["--runs", r0, f"{r0}/result.json", "--baseline-bpb", "1.12"]) == 2  # one run, two names
    assert "is given twice" in _one_line_error(capsys)
    others = [str(tmp_path / "r1"), str(tmp_path / "r2")]
    assert significance.main(["--runs", r0, others[0], "--baseline-runs", others[1], f"{r0}/train.log"]) == 2
    assert "is given in both --runs and --baseline-runs" in _one_line_error(capsys)
    _write_run(tmp_path / "again", 100, 1.1015, 1.1015 * LN2 / TPB)  # another folder, seed 100 again
    assert significance.main(["--runs", r0, *others, str(tmp_path / "again"), "--baseline-bpb", "1.12"]) == 2
    assert "--runs: seed 100 of " in _one_line_error(capsys)


def test_seeds_with_different_settings_are_refused_as_make_record_refuses_them(tmp_path, capsys):
    for i, bpb in enumerate(NEW):
        _write_run(tmp_path / f"r{i}", 100 + i, bpb, bpb * LN2 / TPB)
        result = json.loads((tmp_path / f"r{i}" / "result.json").read_text())
        result["hyperparameters"] = {"seed": 100 + i, "run_id": f"r{i}", "iterations": 20000,
                                     "max_wallclock_seconds": 240.0 if i < 2 else 0.0}
        (tmp_path / f"r{i}" / "result.json").write_text(json.dumps(result))
    runs = [str(tmp_path / f"r{i}") for i in range(3)]
    assert significance.main(["--runs", *runs, "--baseline-bpb", "1.12"]) == 2
    line = _one_line_error(capsys)
    assert "--runs: run" in line and "differs from run" in line and "MAX_WALLCLOCK_SECONDS=0.0 vs 240.0" in line
    assert significance.main(["--runs", *runs[:2], "--baseline-bpb", "1.12"]) == 0  # seed and run_id may differ
    capsys.readouterr()


@pytest.mark.parametrize("baseline", ["-1.2", "0", "nan", "inf", "-inf"])
def test_a_baseline_that_is_not_a_finite_positive_number_is_refused(tmp_path, capsys, baseline):
    for i, bpb in enumerate(NEW):
        _write_run(tmp_path / f"r{i}", 100 + i, bpb, bpb * LN2 / TPB)
    runs = [str(tmp_path / f"r{i}") for i in range(3)]
    assert significance.main(["--runs", *runs, f"--baseline-bpb={baseline}"]) == 2
    assert "--baseline-bpb=" in _one_line_error(capsys)
    _write_run(tmp_path / "nanbase", 7, float("nan"), 2.0)
    assert significance.main(["--runs", *runs, "--baseline-runs", str(tmp_path / "nanbase")]) == 2
    assert "has val_bpb=nan; expected a finite number > 0" in _one_line_error(capsys)


def test_no_variance_is_never_significant_and_t_s_sign_is_stated(tmp_path, capsys):
    same = [1.1000, 1.1000, 1.1000]  # three seeds, one value: t = -inf
    res = analyse(values(same), baseline_bpb=1.12)
    assert math.isinf(res["t"]) and not res["significant"]
    report = significance.format_report(values(same), res)
    assert "SIGNIFICANT" not in report.replace("NOT SIGNIFICANT", "") and "verdict: UNVERIFIED" in report
    res = analyse(values(NEW), baseline_bpb=1.12)
    report = significance.format_report(values(NEW), res)
    assert "t < 0 means the runs beat the baseline by more than the threshold" in report and res["t"] < 0


@pytest.mark.parametrize("bpbs, verdict", [([1.10], "NOT SIGNIFICANT"), ([1.10, 1.10, 1.10], "UNVERIFIED")])
def test_json_is_standard_json_with_null_for_numbers_that_are_not_finite(tmp_path, capsys, bpbs, verdict):
    """Before: one seed printed "std": NaN, identical seeds "t": -Infinity: not JSON (a strict parser refuses)."""
    for i, bpb in enumerate(bpbs):
        _write_run(tmp_path / f"r{i}", 100 + i, bpb, bpb * LN2 / TPB)
    runs = [str(tmp_path / f"r{i}") for i in range(len(bpbs))]
    assert significance.main(["--runs", *runs, "--baseline-bpb", "1.12", "--json"]) == 0
    text = capsys.readouterr().out

    def refuse(constant):
        raise ValueError(f"not standard JSON: {constant}")

    res = json.loads(text, parse_constant=refuse)
    assert res["p"] is None and res["significant"] is False and res["verdict"] == verdict
    if len(bpbs) == 1:
        assert res["std"] is None and res["t"] is None and res["seeds_needed"] is None
    else:
        assert res["t"] is None and res["std"] == 0.0 and res["mean"] == pytest.approx(1.10)
