"""The `python tools/make_record.py` command; its code is tools/record/make_record.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.record.make_record import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
