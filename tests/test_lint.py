"""The linter is part of the test command: ``ruff check`` over the package, tests, benchmarks and docs
scripts, with the rules chosen in pyproject.toml (pyflakes, syntax errors, bugbear). ruff is pinned in
the ``test`` extra, so a new release cannot fail a fresh clone with rules nobody chose."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing() -> None:
    ruff = pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    del ruff
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "hookcli", "tests", "benchmarks",
                             "docs"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
