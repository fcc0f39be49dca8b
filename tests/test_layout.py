"""The layout rules of issue 21: a thin entry, small modules, no layer imports the entry, lint-clean."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY_PACKAGES = ("trainer", "quant", "eval")
MAX_MODULE_LINES = 450


def test_entry_and_every_bundled_module_stay_small():
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text().splitlines())
             for p in [REPO / "train_gpt.py", *(f for pkg in LIBRARY_PACKAGES for f in (REPO / pkg).glob("*.py"))]}
    assert {k: v for k, v in sizes.items() if v > MAX_MODULE_LINES} == {}
    assert len(sizes) >= 20


def test_no_library_module_imports_the_entry():
    """eval/, quant/ and trainer/ take the model and the settings from the package, never from train_gpt
    (function-level imports included)."""
    offenders = []
    for pkg in LIBRARY_PACKAGES:
        for path in (REPO / pkg).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.name}:{node.lineno}" for n in names if n and n.split(".")[0] == "train_gpt"]
    assert offenders == []


def test_ruff_is_clean():
    """`ruff check .` with the rules of ruff.toml (E, W, F, B); a finding fails the suite."""
    pytest.importorskip("ruff")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
