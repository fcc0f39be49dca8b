"""The `python tools/gpu_report.py` command; its code is tools/bench/gpu_report.py, run as a script so that
`--help` and usage errors answer before it imports torch (as `python -m tools.bench.gpu_report`)."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    runpy.run_module("tools.bench.gpu_report", run_name="__main__", alter_sys=True)
