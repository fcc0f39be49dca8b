"""Read training logs of any parameter-golf record, ours or anyone's (tools/audit.py).

Liberal in what it accepts: the line formats of openai/parameter-golf records vary from script to
script. What it reads (each value with its 1-based line number, for the audit's evidence):

- final metric lines: any line with `val_loss:X val_bpb:Y` (or `=`) that is not a `step:` line, e.g.
  `final_int8_zlib_roundtrip_exact val_loss:2.07269931 val_bpb:1.22436570`,
  `final_sliding_window_exact val_loss:... val_bpb:... stride:64 eval_time:70123ms` (ours),
  `quantized_ttt_phased val_loss:... eval_time:519546ms`, `ttt_sliding:done val_loss=... elapsed=405.0s`;
  the number of decimals printed is kept (it bounds the rounding error of val_bpb / val_loss);
- training time: `step:N/M ... train_time:Tms` (or `t:Tms`, or `N/M ... train_time: 9.1m`), `stopping_early: wallclock_cap
  train_time: Tms step: N/M`, the step average (`step_avg:` / `avg:`);
- eval time: `eval_time:` / `elapsed=` on metric lines, `total_eval_time:Fs`;
- sizes: `Total submission size[ LABEL]: N bytes` (the official script logs the raw model +
  code unlabelled, then the counted compressed size with a label such as `int8+zlib`; ours logs
  only the counted size, unlabelled), `Serialized model[ LABEL]: N bytes`, `Code size[ (..)]: N
  bytes`, `code_bytes:N`;
- GPTQ calibration after training: `gptq:reserving Ns`, `GPTQ:collected N Hessians in Fs`
  (training-data calibration, which must fit in the 600 s, openai/parameter-golf issue #1017),
  `gptq:generated N sequences in Fs` (autoregressive self-generated calibration, PR #1019);
- timed eval-phase operations without a score (`prequant_ttt:done total_time=523.0s`, warm-ups, ...),
  a scored-subset marker (`val_max_tokens:N`, `N of M val tokens`), each run end (a log may hold two runs);
- identity: seed, python version, vocab size, training sequence length, tokenizer path, dataset name, val token count,
  train/val shard patterns.

Lines that start with whitespace or contain `{` are code (many logs open with the script's source),
never values. `parse_log` never raises on odd input.
"""

from __future__ import annotations

import dataclasses
import re

_F = r"([-+]?\d+(?:\.(\d+))?(?:[eE][-+]?\d+)?)"  # a number; group 2 = its decimals
_RE_LOSS = re.compile(r"\bval_loss[:=]\s*" + _F)
_RE_BPB = re.compile(r"\bval_bpb[:=]\s*" + _F)
_RE_EVAL_TIME = re.compile(r"\b(?:eval_time|elapsed|time)[:=]\s*(\d+(?:\.\d+)?)(ms|s)\b")
_RE_STEP = re.compile(r"^(?:step:\s*)?(\d+)/(\d+)(\s.*)?$")
_RE_STEP_TIME = re.compile(r"\b(?:train_time|t):\s*(\d+(?:\.\d+)?)(ms|s|m)\b")
_TIME_UNIT_MS = {"ms": 1.0, "s": 1000.0, "m": 60000.0}
_RE_STEP_AVG = re.compile(r"\b(?:step_avg|avg):\s*(\d+(?:\.\d+)?)ms")
_RE_STOP = re.compile(r"^stopping_early:\s*(\S+)\s+train_time:\s*(\d+(?:\.\d+)?)ms\s+step:\s*(\d+)/(\d+)")
_RE_TOTAL = re.compile(r"^Total submission size(?: ([^:]+?))?:\s*(\d+) bytes")
_RE_MODEL = re.compile(r"^Serialized model(?: ([^:]+?))?:\s*(\d+) bytes")
_RE_ARTIFACT = re.compile(r"^artifact_bytes:\s*(\d+)\s*$")
_RE_CODE = re.compile(r"^Code size(?: \(([^)]*)\))?:\s*(\d+) bytes")
_RE_CODE_BYTES = re.compile(r"\bcode_bytes:(\d+)\b")
_RE_TOTAL_EVAL = re.compile(r"^total_eval_time:\s*(\d+(?:\.\d+)?)s")
_RE_GPTQ_RESERVE = re.compile(r"^gptq:reserving\s+(\d+(?:\.\d+)?)(ms|s)\b")
_RE_GPTQ_CALIB = re.compile(r"^(?:GPTQ:collected \d+ Hessians|gptq:calibrated \d+ layers) in (\d+(?:\.\d+)?)s")
_RE_GPTQ_SELFGEN = re.compile(r"^gptq:(?:generated \d+ sequences|done) in (\d+(?:\.\d+)?)s")
_RE_SEED = re.compile(r"(?:^|\s)(?:seed|SEED)[:=]\s?(\d+)\s*$|(?:^|\s)seed=(\d+)\b")
_RE_PYTHON = re.compile(r"(?:^python:|Running Python |^Python )(\d+\.\d+\.\d+)")
_RE_SEQ_LEN = re.compile(r"(?:^|\s)(?:train_seq_len|TRAIN_SEQ_LEN)[:=]\s?(\d+)\b")
_RE_VOCAB = re.compile(r"(?:^|\s)(?:vocab_size|VOCAB_SIZE)[:=]\s?(\d+)\b")
_RE_TOKENIZER = re.compile(r"(?:^|\s)(?:tokenizer_path|TOKENIZER_PATH)[:=]\s?(\S+?\.model)\b")
_RE_BYTE_TOKENIZER = re.compile(r"tokenizer_kind=byte\b")
_RE_DATA = re.compile(r"(?:^|\s)(?:data_path|DATA_PATH)[:=]\s?(\S+)|^train_loader:dataset:(\S+)")
_RE_WORLD = re.compile(r"(?:^|\s)(?:world_size|WORLD_SIZE)[:=]\s?(\d+)\b")
_RE_VAL_TOKENS = re.compile(r"^val_tokens:\s*(\d+)\s*$|^val_loader:.*\btokens:(\d+)\s*$")
_RE_TRAIN_PATTERN = re.compile(r"^train_loader:.*\bpattern=(\S+)|(?:^|\s)train_files[:=]\s?(\S+)")
_RE_EVAL_OP = re.compile(r"^([A-Za-z_][\w\-]*(?::\w+)*)\b.*\b(?:elapsed|total_time|eval_time|time)[=:]\s*"
                         r"(\d+(?:\.\d+)?)(ms|s)\b")
_RE_VAL_SUBSET = re.compile(r"(?:^|\s)(?:val_max_tokens|VAL_MAX_TOKENS|val_tokens_limit|eval_tokens)[:=]\s?([1-9]\d*)\b"
                            r"|\b(\d[\d,]*) of (\d[\d,]*) val(?:idation)? tokens\b|\bval(?:idation)? subset\b")
_RE_VAL_PATTERN = re.compile(r"^val_loader:.*\bpattern=(\S+)|(?:^|\s)val_files[:=]\s?(\S+)")


@dataclasses.dataclass
class Metric:
    """One final metric line: `name` (text before val_loss), values, decimals printed, eval time."""

    name: str
    val_loss: float
    val_bpb: float
    loss_decimals: int
    bpb_decimals: int
    eval_seconds: float | None
    line: int

    @property
    def tokens_per_byte(self) -> float | None:
        """val_bpb = val_loss / ln 2 * tokens / bytes, so tokens / bytes = val_bpb * ln 2 / val_loss."""
        import math

        return self.val_bpb * math.log(2) / self.val_loss if self.val_loss > 0 else None

    @property
    def rounding(self) -> float:
        """Relative error bound of tokens_per_byte from the printed decimals of both values."""
        return 0.5 * 10.0 ** -self.loss_decimals / self.val_loss + 0.5 * 10.0 ** -self.bpb_decimals / self.val_bpb


@dataclasses.dataclass
class LogFacts:
    """Everything `parse_log` found; values are (value, line) pairs or lists of them."""

    metrics: list = dataclasses.field(default_factory=list)
    train_ms: tuple | None = None  # (max train time ms seen, line)
    step_avg_ms: float | None = None
    last_step: tuple | None = None  # (step, of, line)
    stop: tuple | None = None  # (reason, train_ms, line)
    totals: list = dataclasses.field(default_factory=list)  # (label or None, bytes, line)
    models: list = dataclasses.field(default_factory=list)  # (label or None, bytes, line)
    codes: list = dataclasses.field(default_factory=list)  # (label, bytes, line)
    total_eval: tuple | None = None  # (seconds, line)
    gptq_reserve_s: tuple | None = None
    gptq_calib: list = dataclasses.field(default_factory=list)  # (seconds, line) on training data
    gptq_selfgen: list = dataclasses.field(default_factory=list)  # (seconds, line) self-generated data
    seed: tuple | None = None
    python: str | None = None
    vocab_size: tuple | None = None
    seq_len: tuple | None = None
    tokenizer: tuple | None = None  # (path, line)
    byte_level: bool = False
    dataset: tuple | None = None  # (path or name, line)
    val_tokens: tuple | None = None
    train_patterns: list = dataclasses.field(default_factory=list)
    val_patterns: list = dataclasses.field(default_factory=list)
    eval_ops: list = dataclasses.field(default_factory=list)  # (name, seconds, line): timed non-metric ops
    val_subset: tuple | None = None  # (text, line): the log says part of the val split was scored
    stops: list = dataclasses.field(default_factory=list)  # line of every stopping_early / run end seen
    bad_bytes: tuple | None = None  # (byte offset, line) of the first byte that is not UTF-8
    world_size: tuple | None = None

    @property
    def counted_total(self) -> tuple | None:
        """(label, bytes, line) of the counted artifact size: the last labelled `Total submission
        size LABEL:` line (the official script's unlabelled one is the raw model), else the last
        unlabelled one (our trainer logs only the counted size), else `artifact_bytes:`."""
        labelled = [t for t in self.totals if t[0]]
        if labelled:
            return labelled[-1]
        return self.totals[-1] if self.totals else None

    @property
    def counted_model(self) -> tuple | None:
        """(label, bytes, line) of the compressed model: the last labelled `Serialized model` line."""
        labelled = [m for m in self.models if m[0]]
        return labelled[-1] if labelled else None

    @property
    def has_training(self) -> bool:
        return self.train_ms is not None or self.last_step is not None

    @property
    def is_train_log(self) -> bool:
        return bool(self.metrics) or self.has_training


def _decimals(group) -> int:
    return len(group) if group else 0


def parse_log(text: str) -> LogFacts:
    """Parse one log (see the module docstring). Never raises on odd input."""
    return parse_lines(text.splitlines())


def parse_lines(lines) -> LogFacts:
    """parse_log over an iterable of lines (numbered from 1 as str.splitlines numbers them)."""
    f = LogFacts()
    for lineno, raw in enumerate(lines, 1):
        line = raw.rstrip()
        if not line.strip() or "{" in line:  # blank, or code (f-strings) / a dict dump
            continue
        stripped = line.strip()
        if line[0].isspace():  # code, or an indented `key: value` dump of the hyperparameters
            for regex, handler in _IDENTITY_HANDLERS:
                m = regex.search(stripped)
                if m:
                    handler(f, m, lineno)
            continue
        m = _RE_STEP.match(stripped)
        if m:
            step, of, rest = int(m.group(1)), int(m.group(2)), m.group(3) or ""
            t = _RE_STEP_TIME.search(rest)
            if t:
                ms = float(t.group(1)) * _TIME_UNIT_MS[t.group(2)]
                if f.train_ms is None or ms >= f.train_ms[0]:
                    f.train_ms = (ms, lineno)
                f.last_step = (step, of, lineno)
            a = _RE_STEP_AVG.search(rest)
            if a:
                f.step_avg_ms = float(a.group(1))
            continue
        loss, bpb = _RE_LOSS.search(stripped), _RE_BPB.search(stripped)
        if loss and bpb:
            name = stripped[:loss.start()].strip()
            name = " ".join(tok for tok in name.split() if not re.fullmatch(r"[\d.:\-\[\]T]+", tok)) or "metric"
            et = _RE_EVAL_TIME.search(stripped, max(loss.end(), bpb.end()))
            seconds = None if not et else float(et.group(1)) / (1000.0 if et.group(2) == "ms" else 1.0)
            f.metrics.append(Metric(name, float(loss.group(1)), float(bpb.group(1)), _decimals(loss.group(2)),
                                    _decimals(bpb.group(2)), seconds, lineno))
            continue
        for regex, handler in _HANDLERS:
            m = regex.search(stripped)
            if m:
                handler(f, m, lineno)
        op = _RE_EVAL_OP.match(stripped)
        if op and not _RE_STOP.match(stripped) and "warmup_step" not in stripped:
            f.eval_ops.append((op.group(1), float(op.group(2)) / (1000.0 if op.group(3) == "ms" else 1.0), lineno))
    return f


def read_log_bytes(data: bytes) -> LogFacts:
    """parse_log of raw bytes; the first byte that is not UTF-8 is kept as `bad_bytes` (offset, line)
    instead of being replaced silently."""
    try:
        return parse_log(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        f = parse_log(data.decode("utf-8", errors="replace"))
        f.bad_bytes = (e.start, data.count(b"\n", 0, e.start) + 1)
        return f


def read_log_file(path) -> LogFacts:
    """read_log_bytes of a file, streamed line by line (a log of any size in constant memory); the
    first byte that is not UTF-8 is kept as `bad_bytes` (offset, line)."""
    bad = []

    def lines():
        offset, lineno = 0, 0
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    if not bad:
                        bad.append((offset + e.start, lineno + 1))
                    text = raw.decode("utf-8", errors="replace")
                parts = text.splitlines() or [""]
                lineno += len(parts)
                offset += len(raw)
                yield from parts

    f = parse_lines(lines())
    if bad:
        f.bad_bytes = bad[0]
    return f


def _stop(f, m, n):
    f.stop = (m.group(1), float(m.group(2)), n)
    f.stops.append(n)
    ms = float(m.group(2))
    if f.train_ms is None or ms >= f.train_ms[0]:
        f.train_ms = (ms, n)
    f.last_step = (int(m.group(3)), int(m.group(4)), n)


def _set(attr, convert=lambda m: m.group(1)):
    def handler(f, m, n):
        setattr(f, attr, (convert(m), n))
    return handler


def _first_group(m):
    return next(g for g in m.groups() if g is not None)


_HANDLERS = [
    (_RE_STOP, _stop),
    (_RE_TOTAL, lambda f, m, n: f.totals.append((m.group(1), int(m.group(2)), n))),
    (_RE_ARTIFACT, lambda f, m, n: f.totals.append(("artifact_bytes", int(m.group(1)), n))),
    (_RE_MODEL, lambda f, m, n: f.models.append((m.group(1), int(m.group(2)), n))),
    (_RE_CODE, lambda f, m, n: f.codes.append((f"Code size{' (' + m.group(1) + ')' if m.group(1) else ''}",
                                               int(m.group(2)), n))),
    (_RE_CODE_BYTES, lambda f, m, n: f.codes.append(("code_bytes", int(m.group(1)), n))),
    (_RE_TOTAL_EVAL, _set("total_eval", lambda m: float(m.group(1)))),
    (_RE_GPTQ_RESERVE, _set("gptq_reserve_s", lambda m: float(m.group(1)) / (1000.0 if m.group(2) == "ms" else 1.0))),
    (_RE_GPTQ_CALIB, lambda f, m, n: f.gptq_calib.append((float(m.group(1)), n))),
    (_RE_GPTQ_SELFGEN, lambda f, m, n: f.gptq_selfgen.append((float(m.group(1)), n))),
    (_RE_PYTHON, lambda f, m, n: setattr(f, "python", m.group(1))),
    (_RE_BYTE_TOKENIZER, lambda f, m, n: setattr(f, "byte_level", True)),
    (_RE_VAL_TOKENS, _set("val_tokens", lambda m: int(_first_group(m)))),
    (_RE_VAL_SUBSET, _set("val_subset", lambda m: m.group(0).strip())),
    (_RE_TRAIN_PATTERN, lambda f, m, n: f.train_patterns.append((_first_group(m), n))),
    (_RE_VAL_PATTERN, lambda f, m, n: f.val_patterns.append((_first_group(m), n))),
]
_IDENTITY_HANDLERS = [
    (_RE_SEED, _set("seed", lambda m: int(_first_group(m)))),
    (_RE_VOCAB, _set("vocab_size", lambda m: int(m.group(1)))),
    (_RE_WORLD, _set("world_size", lambda m: int(m.group(1)))),
    (_RE_SEQ_LEN, _set("seq_len", lambda m: int(m.group(1)))),
    (_RE_TOKENIZER, _set("tokenizer")),
    (_RE_DATA, _set("dataset", _first_group)),
]
_HANDLERS += _IDENTITY_HANDLERS
