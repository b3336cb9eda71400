"""Shared fixtures: tests/ on sys.path (for ``tiny_models:...`` specs) and a CLI runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch):
    """Invoke the hookcli CLI in-process; returns a function (args) -> click Result.

    Fixed width and no colour so tables are stable; exceptions propagate (catch_exceptions=False).
    """
    from click.testing import CliRunner

    from hookcli.cli import main

    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.delenv("HOOKCLI_DEBUG", raising=False)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    runner = CliRunner()

    def invoke(*args: str, **kwargs):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False, **kwargs)

    return invoke


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--update-docs``: rewrite the outputs shown in README.md, docs/ and tests/golden/ (tests/test_docs.py)."""
    parser.addoption("--update-docs", action="store_true", default=False,
                     help="regenerate the console blocks of README.md and docs/ and the golden files")
