"""The `python tools/prepare_data.py` command; its code is tools/data/prepare_data.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.data.prepare_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
