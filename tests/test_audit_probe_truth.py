"""The auditor against the organizers on real folders of openai/parameter-golf, from stored evidence
(tests/data/audit/probe_truth.json; rows written by `python -m tools.auditor.audit_probe_sweep MIRROR
--prs N --static`, the organizers' words and thread added by hand): every rejected pull-request head
fails a check named for the organizers' reason, or says `not checkable` with why, or is a stated
disagreement (a row the probe has not run yet says so and is judged on the static audit); no merged
folder fails. No probe runs here: the stored verdicts are checked against the
reasons (the map below, not the file's own `match`) and each fail's evidence against itself."""

import json
import re
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "audit" / "probe_truth.json"
TRUTH = json.loads(DATA.read_text(encoding="utf-8"))
README = Path(__file__).resolve().parents[1] / "README.md"
PROBE = ("run_causal", "run_normalized", "run_score_first", "run_single_pass", "run_bytes", "run_after_clock")
# the organizers' reason -> the checks (run probe or static audit) that state it
REASON_CHECKS = {
    "val_training": {"run_score_first", "val_not_trained"},  # trained on val tokens before scoring them
    "ngram_cache": {"run_normalized", "run_causal:direct"},  # not a normalized distribution / looks at the target
    "val_only_training": {"run_score_first", "val_not_trained", "data_disjoint"},  # trained on the val shard
    "vocab_clamp": {"run_normalized", "run_bytes"},  # scored targets clamped into another vocabulary
    "seed_configs": {"same_config"},
    "local_data": {"data_disjoint"},
    "byte_fallback": {"byte_accounting", "run_bytes"},
}
# run_causal:direct: a causality break that does not follow from training on val (not "(1) follows from (3)")
THREAD = re.compile(r"^https://github\.com/openai/parameter-golf/(pull|issues|commit)/\w+")
NUM = r"(-?\d+(?:\.\d+)?)"


def failed(row) -> set:
    out = {k for k, v in row["probe"].items() if v == "fail"} | set(row.get("static_fails", {}))
    if "run_causal" in out and not row["probe_evidence"]["run_causal"].startswith("(1) follows from (3)"):
        out.add("run_causal:direct")
    return out


def expected_match(row) -> str:
    """yes: a check of the reason fails; log not from this code: the static log_from_code fails (the logs were
    printed by code the folder does not ship, so the reason cannot be tested on its code); not probed: the probe has not run it and no static check states
    the reason; not checkable: each probe check of the reason could not run and no static check states it;
    no: the auditor ran and does not state the reason."""
    checks = REASON_CHECKS[row["reason"]]
    if failed(row) & checks:
        return "yes"
    if "log_from_code" in failed(row):  # the folder fails; its reason lies in code that it does not ship
        return "log not from this code"
    if not row["probe"]:
        return "not probed"
    if all(row["probe"][c] == "n/a" for c in {c.split(":")[0] for c in checks} & set(PROBE)):
        return "not checkable"
    return "no"


def test_the_table_holds_25_real_rejected_heads_with_the_organizers_words():
    rows = TRUTH["rejected"]
    assert len(rows) >= 25 and len({r["pr"] for r in rows}) == len(rows)
    for r in rows:
        assert re.fullmatch(r"[0-9a-f]{40}", r["commit"]) and r["folder"].startswith("records/"), r["pr"]
        assert THREAD.match(r["thread"]) and len(r["organizers"]) > 20 and r["reason"] in REASON_CHECKS, r["pr"]
        assert set(r["probe"]) == set(PROBE) or (not r["probe"] and len(r.get("probe_note", "")) > 20), r["pr"]


@pytest.mark.parametrize("row", TRUTH["rejected"], ids=lambda r: f"pr{r['pr']}")
def test_each_rejected_head_fails_for_the_organizers_reason_or_says_why_not(row):
    assert row["match"] == expected_match(row), (row["pr"], failed(row), row["reason"])
    if row["match"] != "yes":
        assert len(row.get("why", row.get("probe_note", ""))) > 20, row["pr"]  # why not, or the disagreement


def _evidence_holds(check: str, text: str) -> bool:
    """A fail's evidence is consistent with itself: the two values it names differ, before the changed index."""
    if check in ("run_causal", "run_score_first"):
        m = re.search(rf"position (\d+): -log p = {NUM} with the val split as made, {NUM} with the val tokens "
                      r"from index (\d+) on changed", text)
        p, va, vb, t = int(m[1]), float(m[2]), float(m[3]), int(m[4])
        ok = p < t and abs(va - vb) > 1e-6 * max(1.0, abs(va))
        if check == "run_score_first":
            a, b, q = map(int, re.search(r"trained on val positions (\d+)\.\.(\d+) before scoring position (\d+)",
                                         text).groups())
            ok = ok and a <= b and b >= q == p
        return ok
    if check == "run_normalized":
        n, s = re.search(rf"the (\d+) vocabulary entries sum to {NUM}, not 1", text).groups()
        return int(n) > 1 and abs(float(s) - 1.0) > 1e-4
    if check == "run_single_pass":
        return int(re.search(r"position \d+ (\d+) times", text)[1]) >= 2
    if check == "run_bytes":
        x, y = re.search(r"denominator is ([\d,.]+) bytes .* is ([\d,]+) bytes", text).groups()
        return abs(float(x.replace(",", "")) - float(y.replace(",", ""))) > 0.5
    if check == "run_after_clock":
        return int(re.match(r"(\d+) forward passes", text)[1]) >= 1
    return False


@pytest.mark.parametrize("row", TRUTH["rejected"] + TRUTH["merged"], ids=lambda r: r.get("folder", "")[-40:])
def test_stored_probe_verdicts_carry_their_evidence(row):
    for check, status in row["probe"].items():
        text = row["probe_evidence"].get(check, "")
        if status == "fail":
            assert _evidence_holds(check, text), (check, text)
        elif status == "n/a":
            assert text.startswith("not checkable (") and len(text) > 30, (check, text)


def test_no_merged_folder_fails_and_the_readme_counts_them():
    rows = TRUTH["merged"]
    assert not [r["folder"] for r in rows if "fail" in r["probe"].values()]
    assert {r["log_from_code"] for r in rows} <= {"pass", "n/a"}  # the static check that PR #945 fails
    ran = [r for r in rows if set(r["probe"].values()) != {"n/a"}]
    line = next(x for x in README.read_text(encoding="utf-8").splitlines() if "merged record folders" in x)
    assert f"{len(ran)} of the {len(rows)} merged record folders" in line, line
