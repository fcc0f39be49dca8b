"""Read a finished run folder (runs/<RUN_ID>/: result.json + train.log) for make_record, significance, audit.

One small module that the record tools import, so that none of them imports another's CLI
(tools/make_record.py -> tools/audit.py -> tools/auditor/audit_checks.py -> tools/significance.py would
otherwise close a circle). `load_run` raises `RecordError` (a ValueError) naming the run and the file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

LOG_CODE_SEPARATOR = "=" * 100
_NUM = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_RE_TRAIN = re.compile(rf"^step:(\d+)/(\d+) train_loss:{_NUM} train_time:(\d+)ms step_avg:{_NUM}ms", re.M)
_RE_VAL = re.compile(rf"^step:(\d+)/(\d+) val_loss:{_NUM} val_bpb:{_NUM} train_time:(\d+)ms", re.M)
_RE_FINAL = re.compile(rf"^final_(prequant|roundtrip|sliding_window|ttt)_exact val_loss:{_NUM} val_bpb:{_NUM}"
                       rf"(?: stride:(\d+))?(?: eval_time:(\d+)ms)?(?: stride:(\d+))?", re.M)
_RE_TOTAL = re.compile(r"^Total submission size: (\d+) bytes", re.M)
_RE_CODE_BYTES = re.compile(r"\bcode_bytes:(\d+)")
_RE_VERSIONS = re.compile(r"^python:\S+(?: \w+:\S+)*$", re.M)
_RE_SEED = re.compile(r"^SEED:(\d+)$", re.M)
_FINAL_KEYS = {"prequant": "prequant", "roundtrip": "roundtrip", "sliding_window": "sliding", "ttt": "ttt"}
FINAL_LINES = {key: f"final_{name}_exact" for name, key in _FINAL_KEYS.items()}  # "ttt" -> "final_ttt_exact"


class RecordError(ValueError):
    """A run or a request that cannot become a record; the message says which run and field."""


def final_score_key(result: dict) -> str:
    """The run's headline score: "ttt" when its final eval was legal score-first TTT (result.json
    has val_bpb_ttt; that run has no sliding pass), else "sliding". result.json's val_bpb_<key> and
    the train.log line FINAL_LINES[key] hold it."""
    return "ttt" if result.get("val_bpb_ttt") is not None else "sliding"


# -----------------------------------------------------------------------------------------------
# reading runs
# -----------------------------------------------------------------------------------------------


def parse_train_log(text: str) -> dict:
    """Parse a train.log written by train_gpt.py.

    Returns {"code": the source logged before the separator line (or None), "train": [(step,
    loss)], "val": [(step, val_loss, val_bpb)], "final": {"prequant"|"roundtrip"|"sliding":
    {"val_loss", "val_bpb"[, "stride"][, "eval_ms"]}} ("ttt": `final_ttt_exact ... eval_time:Nms stride:S ...`),
    "total_bytes": int|None, "code_bytes":
    int|None, "versions": {"python": ..., "torch": ..., ...}, "seed": int|None}. Only lines after the logged code
    count (the code itself contains the format strings of these lines)."""
    code, body = None, text
    sep = "\n" + LOG_CODE_SEPARATOR + "\n"
    if text.startswith(LOG_CODE_SEPARATOR + "\n"):
        code, body = "", text[len(LOG_CODE_SEPARATOR) + 1:]
    elif sep in text:
        code, body = text.split(sep, 1)
    out = {"code": code, "train": [], "val": [], "final": {}, "total_bytes": None, "code_bytes": None,
           "versions": {}}
    for m in _RE_TRAIN.finditer(body):
        out["train"].append((int(m.group(1)), float(m.group(3))))
    for m in _RE_VAL.finditer(body):
        out["val"].append((int(m.group(1)), float(m.group(3)), float(m.group(4))))
    for m in _RE_FINAL.finditer(body):
        entry = {"val_loss": float(m.group(2)), "val_bpb": float(m.group(3))}
        if m.group(4) or m.group(6):  # the TTT line logs its stride after eval_time
            entry["stride"] = int(m.group(4) or m.group(6))
        if m.group(5):
            entry["eval_ms"] = int(m.group(5))
        out["final"][_FINAL_KEYS[m.group(1)]] = entry
    totals = _RE_TOTAL.findall(body)
    out["total_bytes"] = int(totals[-1]) if totals else None
    codes = _RE_CODE_BYTES.findall(body)
    out["code_bytes"] = int(codes[0]) if codes else None
    m = _RE_VERSIONS.search(body)
    if m:
        out["versions"] = dict(tok.split(":", 1) for tok in m.group(0).split())
    m = _RE_SEED.search(body)
    out["seed"] = int(m.group(1)) if m else None
    return out


@dataclasses.dataclass
class Run:
    """One finished run: its folder, result.json (or {} when only a log exists) and parsed log."""

    path: Path
    result: dict
    log_path: Path | None
    log_text: str
    log: dict

    @property
    def label(self) -> str:
        return str(self.path)

    @property
    def seed(self):
        for value in (self.result.get("seed"), self.result.get("hyperparameters", {}).get("seed"), self.log["seed"]):
            if value is not None:
                return value
        return None


def load_run(path) -> Run:
    """Read a run from its folder (result.json + train.log), a result.json or a train.log file.

    Raises RecordError naming the path when neither file can be read."""
    path = Path(path)
    if path.is_dir():
        result_path, log_path = path / "result.json", path / "train.log"
    elif path.name.endswith(".json"):
        result_path, log_path = path, path.with_name("train.log")
    else:
        result_path, log_path = path.with_name("result.json"), path
    result = {}
    if result_path.is_file():
        try:
            result = json.loads(result_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RecordError(f"run {path}: {result_path.name} is not valid JSON ({e})") from e
        if not isinstance(result, dict):
            raise RecordError(f"run {path}: {result_path.name} is malformed: a JSON {type(result).__name__} "
                              f"({json.dumps(result)[:40]}), expected an object of the run's results")
    log_text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.is_file() else ""
    if not result and not log_text:
        raise RecordError(f"run {path}: no result.json and no train.log there")
    return Run(path, result, log_path if log_text else None, log_text, parse_train_log(log_text))
