"""The static audit's log_from_code check: the result lines of the folder's logs could have been printed by
the code it ships.

A result line (`<label> val_loss... val_bpb...`, audit_logs.Metric) is printed by a format in the code:
every word of its label (each run of two or more letters: `final_int6_ttt_exact` -> final, int, ttt,
exact) is somewhere in the shipped Python (train_gpt.py unpacked, and the folder's other .py files), as a
literal or as a name whose value is formatted in. Code that prints no `val_bpb` at all is not judged
(not checkable: a stand-in, not the code that scores). A label with a word the code does not hold came from other
code: closed PR #945 shipped the plain 9-layer baseline while its logs print `ttt:done val_loss=...` and
`final_int6_ttt ...` from an n-gram oracle that is not in the folder. Merged folders: each of the 47
folders with code and result lines passes (snapshot 4908dc46f). Other log lines are not held to it: merged
logs carry lines from wrappers (`nohup: ignoring input`) and from settings the script later dropped.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.auditor.audit_checks import Check
from tools.auditor.audit_rules import code_unreadable

NAME = "log_from_code"
_WORD = re.compile(r"[A-Za-z]{2,}")
_CODE_MAX_BYTES = 16 << 20  # a .py file larger than this is not code anyone ships


def code_text(rec) -> str:
    """Lower-cased text of the code that runs: the unpacked train_gpt.py (rec.script.source) and the folder's
    other .py files (two levels deep)."""
    parts = [rec.script.source]
    for path in sorted(Path(rec.folder).glob("*.py")) + sorted(Path(rec.folder).glob("*/*.py")):
        if path.name != "train_gpt.py" and path.is_file() and not path.is_symlink() and (
                path.stat().st_size <= _CODE_MAX_BYTES):
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n".join(parts).lower()


def foreign_words(label: str, code: str) -> list:
    """The words of a result line's label that `code` (lower-cased) does not hold, in order."""
    return [w for w in dict.fromkeys(_WORD.findall(label)) if w.lower() not in code]


def check_log_from_code(rec) -> Check:
    """Fail: a log's result line has a label word that no shipped code holds (the log came from other code)."""
    unreadable = code_unreadable(rec, NAME)  # no code, or code that does not parse (code_parses says so)
    if unreadable is not None:
        return unreadable
    code = code_text(rec)
    if "val_bpb" not in code:
        return Check(NAME, "n/a", "the shipped code prints no val_bpb: it is not the code that scores, no format to "
                     "compare the logs' result lines with")
    metrics = [(lg.name, m) for lg in rec.logs for m in lg.facts.metrics]
    if not metrics:
        return Check(NAME, "n/a", "no result line (val_loss and val_bpb) in the logs")
    bad = [(name, m, foreign_words(m.name, code)) for name, m in metrics]
    bad = [b for b in bad if b[2]]
    if bad:
        name, m, words = bad[0]
        logs = sorted({b[0] for b in bad})
        return Check(NAME, "fail", f"{name}:{m.line} `{m.name} val_loss {m.val_loss} val_bpb {m.val_bpb}`: the word"
                     f"{'s' if len(words) > 1 else ''} {', '.join(repr(w) for w in words)} of its label "
                     f"{'are' if len(words) > 1 else 'is'} nowhere in the shipped code: log not produced by this "
                     f"code ({len(bad)} such result line(s) in {len(logs)} log(s): {', '.join(logs[:3])})")
    labels = sorted({m.name for _, m in metrics})
    return Check(NAME, "pass", f"the labels of {len(metrics)} result lines ({len(labels)} distinct, e.g. "
                 f"'{labels[-1][:60]}') are words of the shipped code")
