"""One probe run of a record script (started by tools/auditor/audit_probe.py in its own process):

    python -m tools.auditor.audit_probe_child SCRIPT DATA_DIR EVENTS_JSON [SWEEP_JSON]

runs SCRIPT as __main__ in the current directory under the CPU stand-ins (tools/parity/standins.py),
with a deterministic clock (every time.* reading advances 1 ms, so two runs take the same
wallclock branches), the scoring traced (tools/auditor/audit_probe_trace.py), and writes the events,
plus the exception that stopped the script if one did, to EVENTS_JSON.

SWEEP_JSON ({"position": p, "lines": k, "vocab": V}) asks for condition 2's sweep instead: at the first
score after the k-th printed line with val_loss and val_bpb, the process forks once per vocabulary entry v, each fork sets
the val token at p to v in every tensor holding the val stream, runs on until p is scored and reports
-log q(v); the parent writes {"nll": [...]} (the sum over v of q(v) is what must be 1).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.auditor import audit_probe_trace as T
from tools.parity.standins_cuda import record_standins

CLOCK_STEP_S = 0.001
SWEEP_WORKERS = 2  # forks running at once


class _Clock:
    def __init__(self):
        self.now = 1_700_000_000.0

    def tick(self):
        self.now += CLOCK_STEP_S
        return self.now

    def tick_ns(self):
        return int(self.tick() * 1e9)


def _fake_clock() -> None:
    clock = _Clock()
    for name in ("time", "perf_counter", "monotonic", "process_time"):
        setattr(time, name, clock.tick)
    for name in ("time_ns", "perf_counter_ns", "monotonic_ns"):
        setattr(time, name, clock.tick_ns)


def _val_holders(val: np.ndarray) -> list:
    """(tensor, offset) of every 1-D CPU tensor whose elements from `offset` are the val stream."""
    head, found = torch.from_numpy(val[:16].astype(np.int64)), []
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.dim() != 1 or obj.numel() < len(val) - 256:
            continue
        t = obj.detach()
        if t.dtype.is_floating_point or t.numel() < 16:
            continue
        if torch.equal(t[:16].to(torch.int64), head):
            found.append((t, 0))
    return found


class Sweep:
    """Condition 2's fork per vocabulary entry (module docstring). The fork point is the first
    cross-entropy call of the pass whose targets hold position p: the logits there do not depend on
    the target (condition 1 tests that), so each fork writes v into those targets in place (and into
    every tensor holding the val stream, for scoring code that reads the target from there), and runs
    on only until p is scored."""

    def __init__(self, spec: dict, trace, out: Path):
        self.p, self.k, self.vocab, self.trace, self.out = spec["position"], spec["lines"], spec["vocab"], trace, out
        self.nll, self.forked, self.child_v = [], False, None

    def passes_closed(self) -> int:
        return sum(1 for e in self.trace.events if e["kind"] == "line" and "val_bpb" in e["text"]
                   and "val_loss" in e["text"])

    def wrap(self, traced_ce):
        def sweep_ce(input, target, *args, **kwargs):
            if (not self.forked and not T._DEPTH[0] and isinstance(target, torch.Tensor)
                    and not target.dtype.is_floating_point and self.passes_closed() == self.k):
                hits = np.flatnonzero(self.trace.val.locate(target.detach().to("cpu").numpy()).reshape(-1) == self.p)
                if len(hits):
                    target = self.fork(target, hits)
            return traced_ce(input, target, *args, **kwargs)
        return sweep_ce

    def fork(self, target, hits):
        self.forked = True
        holders, val = _val_holders(self.trace.val.tokens), self.trace.val.tokens
        running, results = {}, {}
        for v in list(range(self.vocab)) + [None] * SWEEP_WORKERS:
            while running and (v is None or len(running) >= SWEEP_WORKERS):
                pid, _ = os.wait()
                if pid in running:
                    u, r = running.pop(pid)
                    with os.fdopen(r) as fh:
                        got = fh.read()
                    results[u] = float(got) if got else float("nan")
            if v is None:
                continue
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                self.child_v, self.wfd = v, w
                self.trace.on_collective = lambda: os._exit(0)  # another rank scores p: no value from this fork
                for t, off in holders:
                    t[off + self.p] = v
                tokens = val.copy()
                tokens[self.p] = v
                self.trace.val = T.ValIndex(tokens, self.trace.val.bos, self.trace.val.prefix, override={v: self.p})
                try:
                    target.view(-1)[torch.from_numpy(hits)] = v  # the script's own tensor, where a view
                except RuntimeError:
                    target = target.clone()
                    target.view(-1)[torch.from_numpy(hits)] = v
                return target
            os.close(w)
            running[pid] = (v, r)
        self.nll = [results[v] for v in range(self.vocab)]
        self.out.write_text(json.dumps({"nll": self.nll, "holders": len(holders)}))
        os._exit(0)

    def on_score(self, pos, vals) -> None:
        if self.child_v is None:
            return
        hit = np.flatnonzero(pos == self.p)
        if len(hit):
            os.write(self.wfd, repr(float(vals[hit[0]])).encode())
            os._exit(0)


def main(argv) -> int:
    script, data_dir, events_out = Path(argv[0]).resolve(), Path(argv[1]), Path(argv[2])
    val, train = np.load(data_dir / "probe_val.npy"), np.load(data_dir / "probe_train.npy")
    meta = json.loads((data_dir / "probe.json").read_text())
    trace = T.Trace(val, train, int(meta["bos"]), int(meta.get("prefix", 0)))
    sweep = Sweep(json.loads(Path(argv[3]).read_text()), trace, events_out) if len(argv) > 3 else None
    if sweep is not None:
        trace.on_score = sweep.on_score
        T.traced_cross_entropy = sweep.wrap(T.traced_cross_entropy)
    error = None
    _fake_clock()
    T.install(trace)
    sys.argv = [str(script)]
    try:
        with record_standins():
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            error = f"SystemExit({e.code})"
    except BaseException as e:  # noqa: BLE001 - the probe reports whatever stopped the script
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if f.filename == str(script)), "")
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" + (f" (at {where})" if where else "")
    if sweep is not None:
        if sweep.child_v is not None:
            os._exit(0)
        events_out.write_text(json.dumps({"nll": sweep.nll, "error": error or "the pass was never reached"}))
        return 0
    sys.stdout.flush()
    events_out.write_text(json.dumps({"events": trace.events, "error": error}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
