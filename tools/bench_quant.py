"""The `python tools/bench_quant.py` command; its code is tools/bench/bench_quant.py, run as a script so that
`--help` and usage errors answer before it imports torch (as `python -m tools.bench.bench_quant`)."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    runpy.run_module("tools.bench.bench_quant", run_name="__main__", alter_sys=True)
