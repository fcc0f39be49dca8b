"""The documents of the data tools' inputs (tools/prepare_data.py jsonl / tokenizer): `.jsonl` (one
`{"text": ...}` object per line) or `.txt` (blank-line separated documents), either optionally gzipped."""

import gzip
import json
import zlib
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")


def _input_kind(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes[-1:] == [".gz"]:
        suffixes = suffixes[:-1]
    suffix = suffixes[-1] if suffixes else ""
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in TEXT_SUFFIXES:
        return "text"
    raise ValueError(f"input {path}: unsupported file type {suffix or '(none)'!r}; expected one of "
                     f"{', '.join(JSONL_SUFFIXES + TEXT_SUFFIXES)} (optionally .gz)")


def check_inputs(paths) -> list[Path]:
    """Resolve input paths; FileNotFoundError / ValueError before any long work."""
    if not paths:
        raise ValueError("no --input files given")
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            raise ValueError(f"--input {p}: is a folder; expected a .jsonl or .txt file (optionally .gz)")
        if not p.is_file():
            raise FileNotFoundError(f"--input {p}: no such file; expected a .jsonl or .txt file (optionally .gz)")
        _input_kind(p)
        out.append(p)
    return out


def iter_documents(paths):
    """Yield the documents (str) of the input files in order.

    `.jsonl`: one JSON object with a string "text" per line (blank lines skipped).
    `.txt`: documents separated by one or more blank (whitespace-only) lines.
    Raises ValueError naming file and line for bad JSON, a missing "text" or non-UTF-8 bytes, and
    naming the file for a truncated or damaged .gz.
    """
    for path in paths:
        path = Path(path)
        kind = _input_kind(path)
        opener = gzip.open if path.suffix.lower() == ".gz" else open
        lineno = 0
        try:
            with opener(path, "rb") as raw:
                f = _decoded_lines(raw, path)
                if kind == "jsonl":
                    for lineno, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None
                        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                            raise ValueError(f'{path}:{lineno}: expected a JSON object with a string "text" field')
                        yield obj["text"]
                else:
                    block = []
                    for line in f:
                        if line.strip():
                            block.append(line.rstrip("\n"))
                        elif block:
                            yield "\n".join(block)
                            block = []
                    if block:
                        yield "\n".join(block)
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ValueError(f"{path}: damaged or truncated gzip file after line {lineno} ({exc}); expected a "
                             "complete .gz file") from None


def _decoded_lines(raw, path):
    """Lines of the binary file `raw` as str (newlines kept as "\n"), each decoded on its own so that
    a non-UTF-8 byte is reported on its own line: ValueError "PATH:LINE: not UTF-8 text"."""
    for lineno, line in enumerate(raw, 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
                             "expected UTF-8") from None
        yield text[:-2] + "\n" if text.endswith("\r\n") else text
