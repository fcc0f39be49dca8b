"""Extract for the audit tests: the relevant lines of PR #1120's train_gpt.py (118,518 bytes)."""
import os

try:
    import zstandard
    _COMPRESSOR = "zstd"
except ImportError:
    import warnings
    _COMPRESSOR = "zlib"
    warnings.warn("zstandard not found: falling back to zlib. pip install zstandard")


def main():
    print("seed", os.environ.get("SEED"), _COMPRESSOR, zstandard.__name__)
