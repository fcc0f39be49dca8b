"""Progress of a long phase (export, GPTQ, eval, TTT, the plan's timings) on stderr, never in
train.log: the log's lines are parsed by records and the auditor, so progress stays out of them.

On a terminal the line is rewritten in place (at most every PROGRESS_TTY_EVERY_SECONDS); otherwise
one line every PROGRESS_EVERY_SECONDS:
`<label>: <done>/<total> <unit> (<percent>%) <elapsed>s elapsed, ETA <seconds>s`. Only the process
of rank 0 (torchrun's RANK) reports. Primitives layer: standard library only.
"""

import os
import sys
import time

from primitives.env import BUNDLE_KIND

PROGRESS_EVERY_SECONDS = 10.0  # a line at most this often when stderr is not a terminal
PROGRESS_TTY_EVERY_SECONDS = 0.5  # a rewrite at most this often on a terminal (update runs per eval batch)


class Progress:
    """Progress(label, total, unit): `update(n)` after each n units of work, `close()` at the end
    (a final line only when a line was already shown). total: the units expected (int >= 0).
    The kit's: in a record's packed file it shows nothing (kit/bundle_fold.py)."""

    def __init__(self, label: str, total: int, unit: str):
        if BUNDLE_KIND == "package":
            self.label, self.total, self.unit, self.done = label, max(int(total), 0), unit, 0
            self.start = self.last = time.perf_counter()
            self.shown_done = None  # `done` when a line was last shown
            self.on = os.environ.get("RANK", "0") == "0"
            self.tty = self.on and sys.stderr.isatty()

    def line(self) -> str:
        if BUNDLE_KIND == "package":  # (update and close call it there only)
            elapsed = time.perf_counter() - self.start
            eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
            return (f"{self.label}: {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%) "
                    f"{elapsed:.0f}s elapsed, ETA {eta:.0f}s")

    def update(self, n: int = 1) -> None:
        if BUNDLE_KIND == "package":
            self.done += n
            now = time.perf_counter()
            if self.on and now - self.last >= (PROGRESS_TTY_EVERY_SECONDS if self.tty else PROGRESS_EVERY_SECONDS):
                print(("\r" if self.tty else "") + self.line(), end="" if self.tty else "\n", file=sys.stderr,
                      flush=True)
                self.last, self.shown_done = now, self.done

    def close(self) -> None:
        if BUNDLE_KIND == "package":
            if self.shown_done is not None and self.tty:  # the last rewrite may be up to 0.5 s old
                print("\r" + self.line(), file=sys.stderr, flush=True)
            elif self.shown_done not in (None, self.done):
                print(self.line(), file=sys.stderr, flush=True)


class ConsoleStream:
    """sys.stdout or sys.stderr whose failure ends the console output, never the run: a write or flush that
    fails (`| head` closed the pipe, a full device, a closed descriptor) or a stream that is missing (`2>&-`)
    makes it a sink, and its descriptor is pointed at os.devnull so that the interpreter's own flush at exit
    cannot fail either. Other attributes (encoding, ...) are the stream's."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def drop(self) -> None:
        fd = None
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):
            pass
        if fd is not None:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        self.stream = None

    def write(self, text: str) -> int:
        if self.stream is not None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):  # EPIPE, ENOSPC, EBADF; ValueError: the stream was closed
                self.drop()
        return len(text)

    def flush(self) -> None:
        if self.stream is not None:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.drop()

    def isatty(self) -> bool:
        try:
            return self.stream is not None and self.stream.isatty()
        except (OSError, ValueError):
            return False


def protect_console() -> None:
    """Make the process's output survive its console (an entry point calls it first): descriptors 0-2 that
    are closed (`2>&-`) are opened on os.devnull, so that no file the run opens later takes their number
    (C code writing to descriptor 2 would write into it), and sys.stdout / sys.stderr become ConsoleStreams."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:  # closed: the lowest free descriptor is this one
            os.open(os.devnull, os.O_RDWR)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, ConsoleStream):
            if stream is None:  # Python started with the descriptor closed: a text stream on the devnull one
                stream = open(1 if name == "stdout" else 2, "w", encoding="utf-8", closefd=False)
            setattr(sys, name, ConsoleStream(stream))
