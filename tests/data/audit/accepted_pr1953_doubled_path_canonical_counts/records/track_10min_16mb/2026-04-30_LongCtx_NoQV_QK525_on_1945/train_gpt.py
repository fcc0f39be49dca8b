"""Extract for the audit tests: the record's train_gpt.py (171,669 bytes) is not copied here."""
import os

import torch


def main():
    print("seed", os.environ.get("SEED"), torch.__version__)


if __name__ == "__main__":
    main()
