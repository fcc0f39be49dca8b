"""Checks of tools/audit.py that read the logs' data evidence and settings (tools/auditor/audit_evidence.py).

- data_disjoint: a manifest's document hashes when there is one; else each log's train shard count and
  val token count against the canonical export of its tokenizer (`CANONICAL_EXPORTS`, with sources).
  The organizers excluded runs whose logs show a local build of the data (PR #2146: PR #2130's
  `train_shards: 1499` with a doubled `datasets/datasets` path, PR #2018) and accepted the canonical
  counts (`train_shards: 80`, `val_tokens: 47851520`: PR #2135, #1953, #2014).
- same_config: every seed log backing the claim ran one configuration (organizers on PR #2124: "A
  leaderboard row needs a 3-seed mean from the same submitted configuration"); a log that
  submission.json calls a reference / other-config run may not be in the README's headline mean.
- smoke_run: make_record --skip-smoke folders say their packed script was never run: a warning.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from tools.auditor.audit_checks import NON_RECORD_TRACK, Check, check_data as check_manifest_data
from tools.auditor.audit_evidence import (EVAL_KEYS, config_of, export_for, run_chosen_note, skip_smoke_marker,
                                          val_tokens_canonical)

_RE_NUMBER = re.compile(r"\b\d\.\d{4,8}\b")
_REFERENCE_KEYS = ("reference_logs", "excluded_logs", "other_logs", "ablation_logs")


def _data_row(rec, lg):
    """(status, text) for one log, or None when it logs no data evidence."""
    ev, f = lg.evidence, lg.facts
    if ev is None or (ev.train_shards is None and ev.val_tokens is None):
        return None
    names = [f.tokenizer[0] if f.tokenizer else None, f.dataset[0] if f.dataset else None]
    names += [ev.settings.get(k, ("",))[0] for k in ("tokenizer_path", "datasets_dir", "data_path")]
    names += [p for p, _ in ev.paths]
    export = export_for(names)
    doubled = next(((p, n) for p, n in ev.paths if "datasets/datasets" in p), None)
    parts, bad = [], []
    if ev.train_shards:
        count, line = ev.train_shards
        parts.append(f"{lg.name}:{line} train_shards {count:,}")
        if export and count > export.max_train_shards:
            bad.append(f"{count:,} train shards where the canonical {export.key} export has "
                       f"{export.max_train_shards} (default download {export.train_shards}): a local build of the "
                       f"data, whose train split can hold val documents")
    if ev.val_tokens:
        count, line = ev.val_tokens
        parts.append(f"{lg.name}:{line} val_tokens {count:,}")
        if export and not val_tokens_canonical(export, count):
            bad.append(f"{count:,} val tokens where the canonical {export.key} val split has "
                       f"{', '.join(f'{v:,}' for v in export.val_tokens)}: another split")
    if doubled:
        parts.append(f"{lg.name}:{doubled[1]} path {doubled[0]} (doubled datasets/datasets)")
    text = "; ".join(parts)
    if bad:
        return "fail", f"{text}: {'; '.join(bad)} (organizers excluded such runs: PR #2146, PR #2130)"
    if export is None:
        return "n/a", f"{text}: tokenizer not in the canonical export table"
    if ev.train_shards is None or ev.val_tokens is None:
        return "n/a", f"{text}: the log does not give both counts of the {export.key} export"
    return "pass", f"{text}: the canonical {export.key} export ({export.source.split(';')[0]})"


def check_data(rec) -> Check:
    base = check_manifest_data(rec)
    if base.status == "fail" or (base.status == "pass" and "document hashes" in base.evidence):
        return base
    rows = [r for r in (_data_row(rec, lg) for lg in rec.seed_logs + rec.extra_logs) if r is not None]
    bad = [t for s, t in rows if s == "fail"]
    if bad:
        return Check("data_disjoint", "fail", "; ".join(bad[:2]))
    if rows and all(s == "pass" for s, _ in rows):
        return Check("data_disjoint", "pass", f"{len(rows)} log(s); " + rows[0][1]
                     + (f"; {base.evidence}" if base.status == "pass" else ""))
    if base.status == "pass":
        return base
    why = [t for s, t in rows if s == "n/a"]
    return Check("data_disjoint", "n/a", "; ".join(why[:2]) if why else base.evidence)


def _reference_logs(sub: dict) -> dict:
    """{log file name: note} of logs submission.json itself says are not of the submitted configuration."""
    out = {}
    for key in _REFERENCE_KEYS:
        items = sub.get(key)
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and isinstance(item.get("log"), str):
                out[Path(item["log"]).name] = str(item.get("note", key))
            elif isinstance(item, str):
                out[Path(item).name] = key
    return out


def check_same_config(rec) -> Check:
    name = "same_config"
    logs = [lg for lg in rec.seed_logs + rec.extra_logs if lg.score is not None or lg.facts.metrics]
    configs = {lg.name: config_of(lg.evidence) for lg in logs if lg.evidence is not None and lg.evidence.settings}
    refs = _reference_logs(rec.submission)
    problems, eval_only = [], []
    backing = [lg for lg in rec.seed_logs if lg.name in configs]
    if len(backing) >= 2:
        first = backing[0]
        for lg in backing[1:]:
            a, b = configs[first.name], configs[lg.name]
            diff = sorted(k for k in set(a) & set(b) if a[k][0] != b[k][0]
                          and (a[k][0], b[k][0]) != (str(first.seed), str(lg.seed)))  # the seed under another name
            if diff and all(EVAL_KEYS.search(k) for k in diff):
                # merged 2026-04-04_SP4096_DepthRecurrence: one seed logged TTT on, its claim is the sliding score
                eval_only.append(f"{lg.name}:{b[diff[0]][1]} {diff[0]}={b[diff[0]][0]} but {first.name} "
                                 f"{diff[0]}={a[diff[0]][0]}")
                continue
            if diff:
                k = diff[0]
                problems.append(f"{lg.name}:{b[k][1]} {k}={b[k][0]} but {first.name}:{a[k][1]} {k}={a[k][0]}"
                                + (f" (+{len(diff) - 1} more setting(s))" if len(diff) > 1 else ""))
    ref_logs = [lg for lg in logs if Path(lg.name).name in refs]
    if ref_logs and rec.readme:
        per = [lg.score.val_bpb if lg.score else lg.facts.metrics[-1].val_bpb for lg in rec.seed_logs + ref_logs
               if lg.score or lg.facts.metrics]
        mixed = statistics.fmean(per) if per else None
        for n, line in enumerate(rec.readme.splitlines(), 1):
            hits = [float(x) for x in _RE_NUMBER.findall(line)]
            if mixed is not None and any(abs(h - mixed) <= 0.5 * 10.0 ** -len(str(h).split(".")[1]) + 1e-9
                                         for h in hits) and ("mean" in line.lower() or "final" in line.lower()):
                lg = ref_logs[0]
                problems.append(f"README.md:{n} states the mean {mixed:.8f} of {len(per)} logs, including "
                                f"{lg.name}, which submission.json calls another configuration "
                                f"(\"{refs[Path(lg.name).name][:90]}\")")
                break
    if problems and rec.track == NON_RECORD_TRACK and not (ref_logs and rec.readme):
        return Check(name, "pass", f"a study, not a record: its {len(backing)} logs ran different configurations "
                     f"in the non-record track ({problems[0]}), which claims no 3-seed mean of one configuration")
    chosen = run_chosen_note([lg.evidence.settings for lg in backing])
    if problems:
        return Check(name, "fail", "; ".join(problems[:2]) + ": seeds from different configurations (organizers, "
                                   "PR #2124: a leaderboard row needs a 3-seed mean from the same submitted "
                                   "configuration)" + chosen)
    if eval_only:
        return Check(name, "warn", "; ".join(eval_only[:2]) + ": the seeds differ in settings that act after "
                                   "training only (the same trained configuration)")
    if len(backing) >= 2:
        keys = len(set.intersection(*(set(configs[lg.name]) for lg in backing)))
        return Check(name, "pass", f"{len(backing)} seed logs log the same {keys} settings ("
                                   + ", ".join(lg.name for lg in backing[:4]) + ")" + chosen)
    if len(rec.seed_logs) >= 2:
        return Check(name, "n/a", f"{len(rec.seed_logs)} seed logs, but they log no settings block to compare")
    return Check(name, "n/a", f"{len(rec.seed_logs)} seed log(s): nothing to compare")


def check_smoke_run(rec) -> Check:
    marker = skip_smoke_marker(rec.submission, rec.readme)
    if marker:
        return Check("smoke_run", "warn", f"{marker}: the packed train_gpt.py of this folder was never run "
                                          f"(built with make_record --skip-smoke); run it once before submitting")
    return Check("smoke_run", "pass", "no mark of a skipped smoke run in submission.json or README.md")
