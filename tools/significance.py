"""The `python tools/significance.py` command; its code is tools/record/significance.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.record.significance import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
