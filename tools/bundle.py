"""`python tools/bundle.py --out DIR`: generate the record's single-file train_gpt.py and
train_gpt_human.py from the readable package. The bundler's code is kit/bundle.py (the trainer
measures its own packed size with it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kit.bundle import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
