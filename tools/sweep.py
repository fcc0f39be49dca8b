"""The `python tools/sweep.py` command; its code is tools/sweeps/sweep.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.sweeps.sweep import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
