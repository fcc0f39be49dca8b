"""The run probe's verdicts from two traced toy runs (tools/auditor/audit_probe.py has the rules).

Events come from tools/auditor/audit_probe_trace.py: `ce` (the softmax cross-entropy of each located
target), `score` / `train` (a traced -log p reduced without / with grad), `line` (a printed line),
`embed` (a token embedding lookup on val or train tokens).
"""

from __future__ import annotations

import math
import re

from tools.auditor.audit_checks import Check

DIFF_TOL = 1e-6  # |-log p| difference that counts as changed (two runs of the same script agree bit for bit)
CE_TOL = 1e-6
NORM_TOL = 1e-4
_CLOSE = re.compile(r"val_loss[:=]\s*(-?\d+\.?(\d*))\b.*?val_bpb[:=]\s*(-?\d+\.?(\d*))")
_STEP_LINE = re.compile(r"train_time|stopping_early")
_CALIB_TIME = re.compile(r"(gptq|calib|hessian)[^\n]*?\d+(\.\d+)?\s*(ms|s)\b", re.I)
_RESERVE = re.compile(r"reserv\w*\s*[:=]?\s*\d+(\.\d+)?\s*(s|ms|sec|seconds)\b", re.I)  # "gptq:reserving 4s"


def passes(events: list) -> list:
    """Eval passes: [{"label", "line", "loss", "bpb", "bpb_decimals", "scores": {pos: [(seq, value)]},
    "trains": [(seq, positions)], "start": seq}], one per closing line; a closing line right after
    another with no score between them restates the pass more precisely (the _exact lines)."""
    out, cur = [], {"scores": {}, "trains": [], "start": 0}
    for e in events:
        if e["kind"] == "score":
            cur.setdefault("first", e["seq"])
            for p, v in zip(e["pos"], e["val"]):
                cur["scores"].setdefault(p, []).append((e["seq"], v))
        elif e["kind"] == "train":
            cur["trains"].append((e["seq"], e["pos"]))
        elif e["kind"] == "line":
            m = _CLOSE.search(e["text"])
            if not m:
                continue
            info = {"label": e["text"].split("val_loss")[0].strip(" :=") or "eval",
                    "line": e["text"], "loss": float(m.group(1)), "bpb": float(m.group(3)),
                    "bpb_decimals": len(m.group(4)), "end": e["seq"]}
            if not cur["scores"] and out and info["bpb_decimals"] >= out[-1]["bpb_decimals"] and abs(
                    info["bpb"] - out[-1]["bpb"]) <= 0.5 * 10.0 ** -out[-1]["bpb_decimals"] + 1e-12:
                out[-1].update({k: info[k] for k in ("line", "loss", "bpb", "bpb_decimals")})
                continue
            if cur["scores"]:
                out.append({**cur, **info})
            cur = {"scores": {}, "trains": [], "start": e["seq"]}
    return out


def _ce_values(events: list) -> dict:
    """{position: [(seq, -log softmax)]} from every traced cross-entropy."""
    out = {}
    for e in events:
        if e["kind"] == "ce":
            for p, v in zip(e["pos"], e["val"]):
                out.setdefault(p, []).append((e["seq"], v))
    return out


def check_single_pass(pa: list) -> Check:
    """Fail: a position scored twice with a training step between (or anywhere but the pass's tail).
    Warn: only the last positions of a pass scored again by shorter tail windows with no update
    between (the sliding-window tail of merged records, e.g. PR #1617's eval_val_sliding)."""
    tails = []
    for ps in pa:
        twice = {p: s for p, s in ps["scores"].items() if len(s) > 1}
        if not twice:
            continue
        p = min(twice)
        vals = ", ".join(f"{v:.6f}" for _, v in twice[p][:3])
        what = (f"pass '{ps['label']}' scores {len(twice)} positions more than once: position {p} "
                f"{len(twice[p])} times (-log p {vals})")
        top = max(ps["scores"])
        updated = any(s[0][0] < seq < s[-1][0] for s in twice.values() for seq, _ in ps["trains"])
        if updated or set(twice) != set(range(top - len(twice) + 1, top + 1)):
            return Check("run_single_pass", "fail", f"(4) {what}" + (", with a training step between" if updated
                                                                      else ""))
        tails.append(what)
    n = sum(len(ps["scores"]) for ps in pa)
    if tails:
        return Check("run_single_pass", "warn", f"ran: {tails[0]}: the pass's last positions, scored again by "
                     "its shorter tail windows with no update between (merged records do this; it is re-scoring)")
    return Check("run_single_pass", "pass", f"ran: {len(pa)} eval passes, each of their {n} scored positions once")


def check_diff(pa: list, pb: list, t: int) -> tuple:
    """(run_causal, run_score_first) from the two runs' passes."""
    if len(pa) != len(pb):
        why = f"not checkable (the two runs printed {len(pa)} and {len(pb)} eval results)"
        return Check("run_causal", "n/a", why), Check("run_score_first", "n/a", why)
    for a, b in zip(pa, pb):
        for p in sorted(a["scores"]):
            if p >= t or p not in b["scores"]:
                continue
            va, vb = a["scores"][p][0][1], b["scores"][p][0][1]
            if abs(va - vb) <= DIFF_TOL * max(1.0, abs(va)):
                continue
            seq = b["scores"][p][0][0]
            trained = sorted({q for s, qs in b["trains"] if s < seq for q in qs if q >= p})
            what = (f"pass '{a['label']}', position {p}: -log p = {va:.8f} with the val split as made, {vb:.8f} "
                    f"with the val tokens from index {t} on changed")
            if trained:
                cause = (f"(3) trained on val positions {trained[0]}..{trained[-1]} before scoring position {p}: "
                         + what)
                return Check("run_causal", "fail", f"(1) follows from (3): {what}"), Check(
                    "run_score_first", "fail", cause)
            return Check("run_causal", "fail", f"(1) {what}"), Check(
                "run_score_first", "pass", f"ran: no training step on val tokens before they were scored ({what} "
                "without one: a causality break, not an update)")
    n = sum(1 for ps in pa for p in ps["scores"] if p < t)
    ok = f"ran: {n} scored probabilities before index {t} identical with the val tokens from {t} on changed"
    return Check("run_causal", "pass", ok), Check("run_score_first", "pass", ok + " (training on them included)")


def check_normalized(pa: list, events: list, sweep, vocab: int) -> Check:
    """Pass where every scored -log p is the softmax cross-entropy of its position (a full distribution
    over the vocabulary); otherwise the sweep decides at one sampled position."""
    ce = _ce_values(events)

    def softmax_ce(p, seq, v) -> bool:
        return any(abs(c - v) <= CE_TOL * max(1.0, abs(v)) for s, c in ce.get(p, []) if s < seq)

    for ps in pa:
        odd = [p for p in sorted(ps["scores"]) if not softmax_ce(p, *ps["scores"][p][0])]
        if odd:
            p = odd[0]
            seq, v = ps["scores"][p][0]
            base = f"pass '{ps['label']}', position {p}: the scored -log p {v:.6f} is not a softmax cross-entropy"
            chosen = odd[len(odd) // 2]  # the middle of the positions so scored (a cache warms up first)
            lines_before = sum(1 for e in events if e["kind"] == "line" and e["seq"] < ps["first"]
                               and _CLOSE.search(e["text"]))
            got = sweep(chosen, lines_before)
            nll = got.get("nll") or []
            if len(nll) != vocab or any(not math.isfinite(x) for x in nll):
                return Check("run_normalized", "n/a", f"not checkable (could not run: the sweep over the {vocab} "
                             f"entries at position {chosen} returned {len(nll)} values; {got.get('error')}); {base}")
            total = sum(math.exp(-x) for x in nll)
            if abs(total - 1.0) > NORM_TOL:
                return Check("run_normalized", "fail", f"(2) {base}; at position {chosen} the probabilities the "
                             f"script gives the {vocab} vocabulary entries sum to {total:.6f}, not 1")
            return Check("run_normalized", "pass", f"ran: {base}, but at position {chosen} the probabilities of "
                         f"the {vocab} vocabulary entries sum to {total:.6f}")
    n = sum(len(ps["scores"]) for ps in pa)
    return Check("run_normalized", "pass", f"ran: each of {n} scored -log p is a softmax over the {vocab}-entry "
                 "vocabulary (the cross-entropy of its full logits row)")


def check_bytes(pa: list, val, sp) -> Check:
    from tools.auditor.audit_probe_data import decoded_bytes

    notes = []
    for ps in pa:
        pos = sorted(ps["scores"])
        every = [v for p in pos for _, v in ps["scores"][p]]
        mean = sum(every) / len(every)
        if abs(mean - ps["loss"]) > 1e-3 * max(1.0, abs(ps["loss"])) or ps["bpb"] <= 0:
            notes.append(f"'{ps['label']}' (traced mean {mean:.6f}, logged val_loss {ps['loss']})")
            continue
        run_bytes = len(every) * mean / (math.log(2) * ps["bpb"])
        tol = run_bytes * 0.5 * 10.0 ** -ps["bpb_decimals"] / ps["bpb"] + 0.5
        truth = decoded_bytes(sp, val, pos) + sum((len(ps["scores"][p]) - 1) * decoded_bytes(sp, val, [p])
                                                  for p in pos if len(ps["scores"][p]) > 1)
        if abs(run_bytes - truth) > tol:
            return Check("run_bytes", "fail", f"pass '{ps['label']}': the bpb denominator is {run_bytes:,.1f} bytes "
                         f"({len(every)} scored tokens, val_loss {mean:.6f}, {ps['line'].strip()[:120]}), the "
                         f"decoded text of those tokens is {truth:,} bytes")
    checked = len(pa) - len(notes)
    if not checked:
        return Check("run_bytes", "n/a", "not checkable (no eval pass whose traced scores explain its val_loss: "
                     + "; ".join(notes[:2]) + ")")
    return Check("run_bytes", "pass", f"ran: {checked} eval passes divide by the UTF-8 bytes of their decoded "
                 f"scored tokens" + (f" ({len(notes)} not traced: {notes[0]})" if notes else ""))


def check_after_clock(events: list) -> Check:
    lines = [e for e in events if e["kind"] == "line"]
    stops = [e for e in lines if _STEP_LINE.search(e["text"]) and not _CLOSE.search(e["text"])] or [
        e for e in lines if _STEP_LINE.search(e["text"])]
    if not stops:
        return Check("run_after_clock", "n/a", "not checkable (no line reports the training time)")
    stop = stops[-1]
    late = [e for e in events if e["kind"] == "embed" and e["stream"] == "train" and e["seq"] > stop["seq"]]
    if not late:
        return Check("run_after_clock", "pass", f"ran: no forward pass on training tokens after '{stop['text'][:80]}'")
    timed = [e["text"] for e in lines if _RESERVE.search(e["text"]) or (
        e["seq"] > stop["seq"] and _CALIB_TIME.search(e["text"]))]
    what = (f"{len(late)} forward passes on {sum(e['tokens'] for e in late):,} training tokens after the log's "
            f"training stop '{stop['text'][:80]}'")
    if timed:
        return Check("run_after_clock", "pass", f"ran: {what}; the log times them: '{timed[0][:100]}'")
    return Check("run_after_clock", "fail", f"{what}, and no logged time for them (GPTQ calibration or extra "
                 "steps outside the 600 s clock)")


def untraced_results(events: list, pa: list) -> list:
    """Printed eval results the trace does not explain: a val_loss/val_bpb line with no traced -log p since
    the previous one (and not restating a traced pass's bpb), or a pass whose traced mean is not its logged
    val_loss; the scoring left torch there (numpy n-gram mixtures of closed PRs #779, #982)."""
    out, scored = [], False
    for e in events:
        if e["kind"] == "score":
            scored = True
        elif e["kind"] == "line" and (m := _CLOSE.search(e["text"])):
            bpb, dec = float(m.group(3)), len(m.group(4))
            if not scored and not any(abs(bpb - p["bpb"]) <= 0.5 * 10.0 ** -min(dec, p["bpb_decimals"]) + 1e-12
                                      for p in pa):
                out.append(f"'{e['text'].strip()[:100]}' has no traced -log p behind it")
            scored = False
    for ps in pa:
        every = [v for s in ps["scores"].values() for _, v in s]
        if abs(sum(every) / len(every) - ps["loss"]) > 1e-3 * max(1.0, abs(ps["loss"])):
            out.append(f"pass '{ps['label']}' logs val_loss {ps['loss']} where its traced -log p average "
                       f"{sum(every) / len(every):.6f}")
    return out


def verdicts(pair: dict, sweep_runner) -> list:
    ea, eb = pair["a"]["events"], pair["b"]["events"]
    pa, pb = passes(ea), passes(eb)
    if not pa:
        why = "not checkable (could not run: no eval pass was traced: no cross-entropy on val targets reached a result)"
        return [Check(n, "n/a", why) for n in ("run_causal", "run_normalized", "run_score_first", "run_single_pass",
                                               "run_bytes")] + [check_after_clock(ea)]
    causal, first = check_diff(pa, pb, pair["t"])
    normalized = check_normalized(pa, ea, lambda p, k: sweep_runner(pair, p, k), pair["vocab"])
    untraced = untraced_results(ea, pa)
    if untraced:  # conditions (1)-(3) hold for the traced passes only: not checkable for the rest
        causal, normalized, first = (c if c.status != "pass" else Check(c.name, "n/a", (
            f"not checkable ({untraced[0]}: the scored -log p do not come from F.cross_entropy, which the trace "
            "follows (numpy or Python arithmetic, or log-probabilities gathered and mixed); "
            f"{len(untraced)} such result(s)); {c.evidence}")) for c in (causal, normalized, first))
    return [causal, normalized, first, check_single_pass(pa), check_bytes(pa, pair["val"], pair["sp"]),
            check_after_clock(ea)]
