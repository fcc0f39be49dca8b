"""The three limits of tools/audit.py, per seed log: training time, evaluation time, artifact bytes.

Rules as the organizers applied them (sources in each function): a `fail` only where folders were
rejected for it, a `warn` where our reading is stricter than what they merged.
"""

from __future__ import annotations

import lzma
import re

from tools.auditor.audit_checks import NON_RECORD_TRACK, Check

BYTE_BUDGET = 16_000_000
TRAIN_LIMIT_SECONDS = 600.0
EVAL_LIMIT_SECONDS = 600.0
OVERSHOOT_STEPS = 2
SMALL_OVERSHOOT_S = 0.5  # over the cap by more than the step in flight but under this: warn (PR #1120 accepted)
SAME_PASS_RELATIVE = 0.02  # `ttt_sliding:done ... elapsed=293.2s` then `legal_ttt_exact ... eval_time:293400ms`: one pass
# README claims such as "Total eval time: ~560s" or "eval took ~688 s"
_RE_README_EVAL = re.compile(r"\beval(?:uation)?(?:[ _]ops)?(?: time| took| takes| wall(?:clock)?)?\b[^0-9\n]{0,24}?~?"
                             r"(\d+(?:\.\d+)?)\s*(?:s|sec|seconds)\b", re.I)
_SUBMISSION_EVAL_KEYS = ("eval_ops_seconds", "eval_seconds", "eval_time_seconds", "total_eval_seconds", "eval_time_s")


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.3f} s"


def _over_limit(rec, name: str, text: str) -> Check:
    """Over 600 s fails, except in the non-record track (unlimited compute, official README)."""
    if rec.track == NON_RECORD_TRACK:
        return Check(name, "n/a", f"{text}: allowed in {NON_RECORD_TRACK} (unlimited compute; the README must say so)")
    return Check(name, "fail", text)


def check_train_time(rec) -> Check:
    """Logged train clock <= 600 s (+ the step in flight at the cap). GPTQ calibration on training data
    after the clock (issue #1017 asks it inside the 600 s) only warns: the organizers merged
    2026-04-09_A2_Muon097_3Seed (588.0 + 12.7 s, `gptq:reserving 12s`) and 2026-04-27_SP8192_LQER
    (599.6 + 4.7 s). Only the calibration after the log's last run end counts (a log may hold two runs)."""
    rows = []
    for lg in rec.seed_logs:
        f = lg.facts
        json_s = (lg.seed_result or {}).get("train_seconds")
        if f.train_ms is None and not isinstance(json_s, (int, float)):
            continue
        json_train_s = float(json_s) if isinstance(json_s, (int, float)) else 0.0
        train_s = max(f.train_ms[0] / 1000.0 if f.train_ms else 0.0, json_train_s)
        where = f"{lg.name}:{f.train_ms[1]}" if f.train_ms else f"submission.json seed {lg.seed}"
        last_end = f.stops[-1] if f.stops else (f.train_ms[1] if f.train_ms else 0)
        calib = [(s, n) for s, n in f.gptq_calib if n > last_end]
        calib_s = sum(s for s, _ in calib)
        step_ms = f.step_avg_ms or (f.train_ms[0] / f.last_step[0] if f.train_ms and f.last_step and f.last_step[0] else 0.0)
        overshoot = OVERSHOOT_STEPS * step_ms / 1000.0 if f.stop and "wallclock" in f.stop[0] else 0.0
        limit = TRAIN_LIMIT_SECONDS + overshoot
        text = f"{where} train_time {_fmt_s(train_s)}"
        if overshoot and TRAIN_LIMIT_SECONDS < train_s <= limit:
            text += f" (the step in flight at the cap: within {OVERSHOOT_STEPS} x {step_ms:.1f} ms steps)"
        note = ""
        if calib_s:
            reserve = f" (the run reserved {f.gptq_reserve_s[0]:.0f} s)" if f.gptq_reserve_s else ""
            note = (f"GPTQ calibration on training data after the train clock {calib_s:.1f} s ({lg.name}:{calib[-1][1]})"
                    f"{reserve}: train + calibration = {_fmt_s(train_s + calib_s)}")
        world = f.world_size[0] if f.world_size else None
        if train_s > limit and world and world < 8 and train_s <= limit * 8 / world:
            # 8xH100-equivalent budget on fewer GPUs: merged 2026-03-17_LoRA_TTT train_v1.txt (2xH100, 2400 s)
            note = (f"{text} on world_size {world} (line {f.world_size[1]}): within 600 s x 8/{world} GPUs, the 8xH100 "
                    f"budget scaled (merged precedent 2026-03-17_LoRA_TTT)")
            rows.append((0.0, text, False, note, True))
            continue
        if limit < train_s <= TRAIN_LIMIT_SECONDS + SMALL_OVERSHOOT_S:
            # accepted row PR #1120 (Rascal): 600.365 s; PR #1945's 602.048 s seed was re-run strictly under 600 s
            note = (f"{text}: {train_s - TRAIN_LIMIT_SECONDS:.3f} s over the 600 s cap, more than the step in flight "
                    f"(accepted: PR #1120 at 600.365 s; a seed at 602.048 s had to be re-run, PR #1945)")
            rows.append((0.0, text, False, note, True))
            continue
        rows.append((train_s - limit, text, train_s > limit, note, bool(calib_s) and train_s + calib_s > limit))
    if not rows:
        return Check("train_under_600s", "n/a", "no training time logged (no step/stopping_early train_time)")
    bad = [r for r in rows if r[2]]
    if bad:
        return _over_limit(rec, "train_under_600s", f"{'; '.join(r[1] for r in bad[:3])} > {TRAIN_LIMIT_SECONDS:.0f} s")
    worst = max(rows)
    warned = [r for r in rows if r[4]]
    if warned:
        if "world_size" in warned[0][3] or "over the 600 s cap" in warned[0][3]:
            return Check("train_under_600s", "warn", warned[0][3])
        return Check("train_under_600s", "warn", f"{worst[1]} <= {TRAIN_LIMIT_SECONDS:.0f} s; but {warned[0][3]} > "
                                                 f"{TRAIN_LIMIT_SECONDS:.0f} s (issue #1017 reading; merged precedents "
                                                 f"2026-04-09_A2_Muon097_3Seed, 2026-04-27_SP8192_LQER count the "
                                                 f"clock only)")
    return Check("train_under_600s", "pass", f"max over {len(rows)} log(s): {worst[1]} <= {TRAIN_LIMIT_SECONDS:.0f} s"
                 + (f"; {worst[3]}" if worst[3] else ""))


def _stem_words(name: str) -> set:
    return {w for w in re.split(r"[^a-z]+", name.lower()) if len(w) >= 3} - {"done", "val", "exact", "eval", "time"}


def _drop_nested(ops, timer_starts, nested) -> list:
    """Timed operations logged inside a scored pass's own timer are read once, as part of it: those
    after a `beginning ... timer` line and before the score line that closes it, and sub-phases named
    like the pass (`ttt_short:done`, `ttt_long:done` before `final_ttt_exact ... eval_time`) that sum
    to no more than its eval_time. The dropped ones are appended to `nested` as (name, s, line, into)."""
    out, pending, prev = [], [], 0
    for op in ops:
        name, s, n, bpb = op
        if bpb is None:
            pending.append(op)
            continue
        started = [t for t in timer_starts if prev < t < n]
        inside = [p for p in pending if started and p[2] > started[0]]
        rest = [p for p in pending if p not in inside]
        related = [p for p in rest if _stem_words(p[0]) & _stem_words(name)]
        if related and sum(p[1] for p in related) <= s * (1 + SAME_PASS_RELATIVE):
            inside += related
            rest = [p for p in rest if p not in related]
        nested += [(p[0], p[1], p[2], f"{name} (line {n})") for p in inside]
        out += rest + [op]
        pending, prev = [], n
    return out + pending


def eval_passes(facts, timer_starts=(), nested=None) -> list:
    """[(name, seconds, line)] of every timed eval-phase operation after training (scored passes,
    TTT, warm-ups, unscored passes on val), one entry per pass: a `...:done elapsed=` line and the
    score line that reports the same pass are merged; timers nested in a scored pass are read once
    (`_drop_nested`; the dropped ones go to `nested`)."""
    end = max([facts.train_ms[1] if facts.train_ms else 0] + list(facts.stops))
    ops = [(m.name, m.eval_seconds, m.line, m.val_bpb) for m in facts.metrics if m.eval_seconds is not None and m.line > end]
    timers = []  # progress lines of one op (`prequant_ttt:epoch 3/10 elapsed=51.8s`) are cumulative: keep the last
    for name, s, n in facts.eval_ops:
        if n <= end or any(o[2] == n for o in ops):
            continue
        if timers and timers[-1][0].split(":")[0] == name.split(":")[0] and s >= timers[-1][1]:
            timers[-1] = (timers[-1][0].split(":")[0], s, n, None)
        else:
            timers.append((name, s, n, None))
    ops = _drop_nested(sorted(ops + timers, key=lambda o: o[2]), timer_starts, [] if nested is None else nested)
    out = []
    for name, s, n, bpb in ops:
        prev = out[-1] if out else None
        if prev and n - prev[2] <= 3 and abs(prev[1] - s) <= SAME_PASS_RELATIVE * max(s, prev[1]) and (
                bpb is None or prev[3] is None or abs(prev[3] - bpb) < 5e-5):
            out[-1] = (prev[0] + " = " + name, max(prev[1], s), n, bpb if bpb is not None else prev[3])
            continue
        out.append((name, s, n, bpb))
    return [(name, s, n) for name, s, n, _ in out]


def readme_eval_seconds(readme: str | None) -> tuple | None:
    """(seconds, line) of the largest evaluation time a README states ("eval took ~688 s")."""
    found = []
    for n, line in enumerate((readme or "").splitlines(), 1):
        m = _RE_README_EVAL.search(line)
        if m and float(m.group(1)) > 0:
            found.append((float(m.group(1)), n))
    return max(found) if found else None


def check_eval_time(rec) -> Check:
    """Every eval-phase operation the logs show after training, summed per seed (official README: 10
    more minutes of evaluation; a later `total_eval_time` line counts when larger); submission.json
    fields (`eval_ops_seconds`, per-seed `eval_seconds`) and README claims count when larger."""
    rows, diag_rows = [], []
    sub = rec.submission
    for lg in rec.seed_logs:
        f = lg.facts
        nested = []
        ev = getattr(lg, "evidence", None)
        passes = eval_passes(f, ev.timer_starts if ev else (), nested)
        value, text = None, ""
        if passes:
            value = sum(s for _, s, _ in passes)
            each = ", ".join(f"{name} {s:.1f} s (line {n})" for name, s, n in passes[:6])
            text = f"{lg.name}: {len(passes)} eval-phase operation(s) after training sum to {_fmt_s(value)} ({each})"
            if nested:
                flag = f"; the log's own {ev.precompute_outside[0]}: {ev.precompute_outside[1]} (line " \
                       f"{ev.precompute_outside[2]})" if ev and ev.precompute_outside else ""
                text += "; read once, inside their pass: " + ", ".join(
                    f"{name} {s:.1f} s (line {n}, inside {into})" for name, s, n, into in nested[:3]) + flag
            diag = sum(s for name, s, _ in passes if name.lower().startswith("diagnostic"))
            if diag and value > EVAL_LIMIT_SECONDS >= value - diag:
                # merged 2026-04-29_SmearGateBOSFix_3Seed: 525.6 s of scoring + 83.4 s of passes its log calls diagnostic
                diag_rows.append(f"{text}; without the {diag:.1f} s of passes logged as diagnostic: "
                                 f"{_fmt_s(value - diag)}")
                value -= diag
        if f.total_eval is not None and (value is None or f.total_eval[0] > value):
            value, text = f.total_eval[0], f"{lg.name}:{f.total_eval[1]} total_eval_time {_fmt_s(f.total_eval[0])}"
        res = lg.seed_result or {}
        for key in _SUBMISSION_EVAL_KEYS:
            if isinstance(res.get(key), (int, float)) and (value is None or res[key] > value):
                value, text = float(res[key]), f"submission.json seed {lg.seed} {key} {_fmt_s(float(res[key]))}"
        if value is not None:
            rows.append((value, text))
    for key in _SUBMISSION_EVAL_KEYS:
        if isinstance(sub.get(key), (int, float)) and not isinstance(sub.get(key), bool):
            rows.append((float(sub[key]), f"submission.json {key} {_fmt_s(float(sub[key]))}"))
    claim = readme_eval_seconds(rec.readme)
    if claim and (not rows or claim[0] > max(rows)[0]):
        rows.append((claim[0], f"README.md:{claim[1]} states an evaluation time of {claim[0]:g} s"))
    if not rows:
        return Check("eval_under_600s", "n/a", "no eval time logged")
    bad = [r for r in rows if r[0] > EVAL_LIMIT_SECONDS]
    if bad:
        return _over_limit(rec, "eval_under_600s", f"{'; '.join(r[1] for r in bad[:3])} > {EVAL_LIMIT_SECONDS:.0f} s")
    if diag_rows:
        return Check("eval_under_600s", "warn", f"{diag_rows[0]} <= {EVAL_LIMIT_SECONDS:.0f} s (the organizers merged "
                                                f"such a run: 2026-04-29_SmearGateBOSFix_3Seed)")
    return Check("eval_under_600s", "pass", f"max over {len(rows)} source(s): {max(rows)[1]} <= {EVAL_LIMIT_SECONDS:.0f} s")


def compressed_code_bytes(rec) -> int | None:
    """lzma (preset 9e) size of the code that runs: what a packed train_gpt.py of it would cost."""
    source = rec.script.source if rec.script is not None else None
    if not source:
        return None
    return len(lzma.compress(source.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))


def artifact_rows(rec, lg) -> list:
    """[(bytes, evidence)] for one log: each counted `Total submission size` line it prints (labelled
    ones; the unlabelled line is the raw model in the official script, the counted size in ours) and
    the compressed model + the shipped code."""
    f = lg.facts
    labelled = [t for t in f.totals if t[0]]
    rows = [(b, f"{lg.name}:{n} logged Total submission size{' ' + label if label else ''}", "logged")
            for label, b, n in (labelled or f.totals[-1:])]
    model = f.counted_model
    if model is not None and rec.code_bytes is not None:
        rows.append((model[1] + rec.code_bytes, f"{lg.name}:{model[2]} model {model[1]:,} ({model[0]}) + shipped code "
                                                f"{rec.code_bytes:,}", "shipped"))
    if not rows and isinstance((lg.seed_result or {}).get("bytes_total"), int):
        rows.append((lg.seed_result["bytes_total"], f"submission.json seed {lg.seed} bytes_total", "claimed"))
    return rows


def _repacked_after_run(rec, lg) -> bool:
    """The shipped code is smaller than the code the run measured: packed after the run."""
    codes = [b for label, b, _ in lg.facts.codes if "compressed" not in label or "uncompressed" in label]
    return bool(codes) and rec.code_bytes is not None and rec.code_bytes < min(codes)


def check_artifact_bytes(rec) -> Check:
    """The largest of the logged counted totals and model + shipped code <= 16,000,000 (official README;
    decimal). When the excess is code alone, the code shipped is the code the run measured, and a
    packed (lzma) copy of it would fit, it warns:
    the organizers merged runs that counted compressed code (2026-04-27_SP8192_LQER logs `Code size
    (compressed): 31999`) and 2026-04-06_SP8192_HessianSDClip (logged 16,054,963 with 78,688 B of code)."""
    rows = [(b, ev, lg, kind) for lg in rec.seed_logs for b, ev, kind in artifact_rows(rec, lg)]
    claimed = rec.submission.get("bytes_total")
    if isinstance(claimed, int) and not isinstance(claimed, bool):
        rows.append((claimed, "submission.json bytes_total", None, "claimed"))
    if not rows:
        return Check("artifact_under_16mb", "n/a", "no artifact size logged or claimed")
    worst = max(rows, key=lambda r: r[0])
    if worst[0] <= BYTE_BUDGET:
        return Check("artifact_under_16mb", "pass", f"max {worst[0]:,} bytes ({worst[1]}; decided over {len(rows)} "
                                                    f"figure(s)) <= {BYTE_BUDGET:,} (margin {BYTE_BUDGET - worst[0]:,})")
    packed = compressed_code_bytes(rec)
    over = [r for r in rows if r[0] > BYTE_BUDGET]
    # a run whose own logged total is over and whose code was packed only afterwards stays over (the organizers:
    # folders logging 16,071,321 and 16,004,026 with a smaller wrapper shipped were rejected)
    fixable = packed is not None and all(
        r[2] is not None and r[2].facts.counted_model is not None and r[2].facts.counted_model[1] + packed <= BYTE_BUDGET
        and not (r[3] == "logged" and _repacked_after_run(rec, r[2])) for r in over)
    text = "; ".join(f"{r[1]} = {r[0]:,}" for r in over[:3]) + f" > {BYTE_BUDGET:,} (decided by {worst[1]})"
    if fixable:
        model = max(r[2].facts.counted_model[1] for r in over)
        return Check("artifact_under_16mb", "warn", f"{text}; the code packs to {packed:,} bytes (lzma), model "
                                                    f"{model:,} + {packed:,} = {model + packed:,} fits: ship it packed "
                                                    f"(merged precedents count compressed code)")
    return Check("artifact_under_16mb", "fail", text)
