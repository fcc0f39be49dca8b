"""The `python tools/bench_ttt.py` command; its code is tools/bench/bench_ttt.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench.bench_ttt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
