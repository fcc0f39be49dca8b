"""The error rule of every CLI of the kit: a user's mistake is one line and exit 2, a bug is a traceback.

A user's mistake (a bad flag, environment variable, file or folder) surfaces as a ValueError or an
OSError (FileNotFoundError, IsADirectoryError, PermissionError, ...) raised before the work starts
(or, for what only the work can find, such as a damaged artifact, during it). The CLI then prints

    error: <the input, e.g. EVAL_BATCH_SEQS='abc' or --artifact runs/x>: <what is wrong>; expected <what>

as ONE line on stderr and exits 2 (`report_user_error`). Anything else (RuntimeError, KeyError,
AssertionError, ...) is a bug of the kit and keeps its traceback. Argument-parsing errors follow the
same rule (`ArgumentParser`: one line instead of argparse's usage block, still exit 2).

Helpers to read settings so that the message names the input: `env_int`, `env_float`, `env_choice`,
`check_file`, `check_dir`. Not bundled into train_gpt.py (the trainer keeps its own copy of the rule).
"""

import argparse
import math
import os
import sys

from primitives.env import parse_env_value
from primitives.progress import protect_console  # noqa: F401 (for the CLIs' entry points)

EXIT_USER_ERROR = 2
USER_ERRORS = (ValueError, OSError)


def one_line(text) -> str:
    """`text` with its lines joined by "; " (YAML and JSON errors span several lines)."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def describe_user_error(exc: BaseException) -> str:
    """The one-line message of a user error: an OSError of the system names its file and reason."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return one_line(f"{exc.filename}: {exc.strerror}")
    return one_line(exc) or type(exc).__name__


def report_user_error(exc: BaseException, file=None) -> int:
    """Print `error: <one line>` on stderr and return exit code 2."""
    print(f"error: {describe_user_error(exc)}", file=file or sys.stderr, flush=True)
    return EXIT_USER_ERROR


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors on one line (`error: <prog>: <message> (see --help)`), exit 2."""

    def error(self, message):
        self.exit(EXIT_USER_ERROR, f"error: {self.prog}: {one_line(message)} (see --help)\n")


def parse_number(name: str, raw, kind=int, *, minimum=None, above=None, expected=None):
    """`raw` (a str, or an already parsed number) as a finite `kind` (int or float) >= minimum
    (> above); ValueError "NAME='raw': expected ..." otherwise. `name` is the env var or the flag."""
    want = expected or ("an integer" if kind is int else "a finite number") + (
        f" >= {minimum:g}" if minimum is not None else "") + (f" > {above:g}" if above is not None else "")
    try:  # text goes through the kit's one env parser (primitives/env.py), as the trainer's settings do
        value = parse_env_value(name, raw, kind) if isinstance(raw, str) else kind(raw)
        ok = math.isfinite(value) and (minimum is None or value >= minimum) and (above is None or value > above)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name}={raw!r}: expected {want}")
    return value


def env_int(name: str, default: int, environ=None, **limits) -> int:
    """Integer env var `name` (default when unset), checked by `parse_number`."""
    raw = (os.environ if environ is None else environ).get(name)
    return default if raw is None else parse_number(name, raw.strip(), int, **limits)


def env_float(name: str, default: float, environ=None, **limits) -> float:
    """Finite float env var `name` (default when unset), checked by `parse_number`."""
    raw = (os.environ if environ is None else environ).get(name)
    return default if raw is None else parse_number(name, raw.strip(), float, **limits)


def env_choice(name: str, default: str, choices, environ=None) -> str:
    """Env var `name` that must be one of `choices` (strings)."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return default
    if raw.strip() not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw.strip()


def check_file(what: str, path, expected: str) -> None:
    """ValueError/FileNotFoundError naming `what` (a flag or env var) unless `path` is a readable,
    non-empty file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path}: no such file; expected {expected}")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path}: is a folder; expected {expected}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{what} {path}: not readable; expected {expected}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{what} {path}: is empty (0 bytes); expected {expected}")


def check_dir(what: str, path, expected: str) -> None:
    """ValueError/FileNotFoundError naming `what` unless `path` is an existing folder."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path}: no such folder; expected {expected}")
    if not os.path.isdir(path):
        raise ValueError(f"{what} {path}: is a file, not a folder; expected {expected}")
