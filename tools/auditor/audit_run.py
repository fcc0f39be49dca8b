"""The challenge rules of one finished run, decided from its evidence (tools/make_record.py).

result.json's own `compliance` flags are never trusted: a run that trained on a val shard, scored
100 val tokens and set every flag true is refused all the same. Each rule gives (ok, evidence):
ok is True / False / None (not checkable here, e.g. no manifest for document disjointness).

Evidence per rule (source: the official README):
  train_time_ok            result.json train_seconds <= 600
  eval_time_ok             result.json eval_seconds (+ the TTT pass's eval_time when logged apart) <= 600
  bytes_ok                 bytes_total <= 16,000,000 (decimal)
  full_val_split           VAL_MAX_TOKENS unset, and val_tokens = the val shards' token count (headers read
                           when the data is on this machine, else the official count for the vocabulary)
  val_not_seen_in_training false for a train shard that is a val shard by name, by identity (a link) or by
                           content (same bytes); true only when, besides, the data's manifest.json has
                           the document hashes of both splits and they are disjoint; else null (unverified)
  splits_disjoint          manifest.json document hashes (shards.format) disjoint, and every train shard
                           the run opened listed in its train split; null (unverified) without them
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from tools.record.runs import RecordError

RULE_TRAIN_LIMIT_SECONDS = 600.0
RULE_EVAL_LIMIT_SECONDS = 600.0
RULE_BYTE_BUDGET = 16_000_000
SHARD_MAGIC = 20240520
# val tokens of the official splits by vocabulary (tools/auditor/audit_bytes.py's canonical table)
OFFICIAL_VAL_TOKENS = {1024: 62_021_632, 8192: 40_540_160}


def number(run, field: str, *, integer: bool = False, where: dict | None = None):
    """result.json[field] as a finite number; RecordError naming the run, field, value and what was
    expected otherwise (e.g. train_seconds: "abc")."""
    source = run.result if where is None else where
    value = source.get(field)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        kind = "an integer" if integer else "a finite number"
        raise RecordError(f"run {run.label}: result.json {field}={value!r}: expected {kind}")
    return value


def val_shard_tokens(data_path) -> int | None:
    """Token count of every fineweb_val_*.bin under `data_path` from their headers (magic 20240520,
    version 1, count); None when there are none. RecordError naming a damaged shard."""
    shards = sorted(p for p in Path(data_path).glob("fineweb_val_*.bin")  # not a CaseOps byte sidecar
                    if not p.name.startswith("fineweb_val_bytes_")) if data_path and Path(data_path).is_dir() else []
    total = 0
    for path in shards:
        with open(path, "rb") as fh:
            head = fh.read(12)
        if len(head) < 12 or struct.unpack("<3i", head)[:2] != (SHARD_MAGIC, 1):
            raise RecordError(f"val shard {path}: header {head[:12].hex()}: expected magic {SHARD_MAGIC}, version 1")
        total += struct.unpack("<3i", head)[2]
    return total if shards else None


def run_rules(run, data_path=None) -> dict:
    """{flag: (ok, evidence)} for one run (see the module docstring). `data_path`: the run's dataset
    dir resolved on this machine, or None."""
    r, hp = run.result, run.result.get("hyperparameters") or {}
    train_s, eval_s = float(number(run, "train_seconds")), float(number(run, "eval_seconds"))
    ttt = run.log.get("final", {}).get("ttt", {}).get("eval_ms") if isinstance(run.log, dict) else None
    eval_total = max(eval_s, ttt / 1000.0) if ttt else eval_s
    total = int(number(run, "bytes_total", integer=True))
    out = {"train_time_ok": (train_s <= RULE_TRAIN_LIMIT_SECONDS, f"train_seconds={train_s:.1f}"),
           "eval_time_ok": (eval_total <= RULE_EVAL_LIMIT_SECONDS, f"eval_seconds={eval_total:.1f}"),
           "bytes_ok": (total <= RULE_BYTE_BUDGET, f"bytes_total={total}")}
    val_tokens = number(run, "val_tokens", integer=True)
    max_tokens = hp.get("val_max_tokens") or 0
    expected, source = val_shard_tokens(data_path), f"the val shards of {data_path}"
    if expected is None:
        expected = OFFICIAL_VAL_TOKENS.get(hp.get("vocab_size"))
        source = f"the official sp{hp.get('vocab_size')} val split"
    seq_len = int(hp.get("train_seq_len") or 0)
    if max_tokens:
        out["full_val_split"] = (False, f"VAL_MAX_TOKENS={max_tokens}: part of the val split")
    elif expected is None:
        out["full_val_split"] = (None, f"unverified: val_tokens={val_tokens} (no val shards here, unknown vocabulary)")
    else:
        ok = val_tokens + max(seq_len, 1) >= expected
        out["full_val_split"] = (ok, f"val_tokens={val_tokens}" + ("" if ok else f", {source} has {expected:,}"))
    out["val_not_seen_in_training"], out["splits_disjoint"] = split_rules(r.get("train_shards"), data_path)
    return out


def split_rules(shards, data_path) -> tuple:
    """(val_not_seen_in_training, splits_disjoint), each (ok, evidence), from the train shard names
    the run opened (result.json train_shards) and its dataset dir on this machine (None: absent).
    ok is None, and the evidence starts with "unverified: ", where the evidence cannot decide it."""
    if not isinstance(shards, list) or not shards or not all(isinstance(s, str) for s in shards):
        reason = (f"unverified: train_shards={shards!r} (not listed)",) * 2
        return (None, reason[0]), (None, reason[1])
    named = [s for s in shards if "val" in Path(s).name]
    if named:
        seen = False, f"train_shards={shards} (a val file among the train shards)"
        return seen, seen
    if data_path is None:
        unknown = None, f"unverified: the run's data is not on this machine (train_shards={shards})"
        return unknown, unknown
    from shards.format import check_data_manifest, val_shard_copy  # imports numpy: only when the data is here

    data = Path(data_path)
    try:
        val_files = sorted(p for p in data.glob("fineweb_val_*.bin") if p.is_file())
        for name in shards:
            path = data / name
            same = val_shard_copy(path, val_files) if path.is_file() else None
            if same is not None:
                how = "the same file" if path.samefile(same) else "same bytes"
                seen = False, f"train shard {path} is the val shard {same.name} ({how})"
                return seen, seen
        missing = [n for n in shards if not (data / n).is_file()]
        if missing:
            unknown = None, f"unverified: train shard {missing[0]} is not in {data} (its bytes were not compared)"
            return unknown, unknown
        manifest = check_data_manifest(data, log=lambda *_: None)
    except ValueError as e:
        return (False, str(e)), (False, str(e))
    except OSError as e:
        unknown = None, f"unverified: the shards of {data} could not be read ({e})"
        return unknown, unknown
    if manifest is None:
        unknown = None, f"unverified: no manifest with document hashes in {data} (train_shards={shards})"
        return unknown, unknown
    listed = set(manifest["splits"]["train"]["shards"])
    seen = True, f"train_shards={shards}: no val shard by name or bytes; document hashes disjoint"
    stray = [n for n in shards if n not in listed]
    if stray:
        return seen, (False, f"train shard {stray[0]} is not listed in the train split of {data / 'manifest.json'}")
    return seen, (True, f"{data / 'manifest.json'}: train and val document hashes disjoint")
