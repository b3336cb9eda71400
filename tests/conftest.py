"""Shared fixtures: tests/ on sys.path (for ``tiny_models:...`` specs), a CLI runner, golden files."""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
GOLDEN_DIR = TESTS_DIR / "golden"
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


def _triton_interpreter_without_cuda() -> None:
    """Without a CUDA GPU, Triton kernels run in Triton's interpreter on CPU tensors
    (tests/test_reduce_triton.py). Triton reads ``TRITON_INTERPRET`` when it is imported (its own
    library functions are decorated then), so it is set here, before any test imports it."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interpreter_without_cuda()


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
    """``--update-docs``: rewrite the outputs shown in README.md, docs/ and tests/golden/ (the ``golden``
    fixture and tests/test_docs.py)."""
    parser.addoption("--update-docs", action="store_true", default=False,
                     help="regenerate the console blocks of README.md and docs/ and the golden files")


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """Compare a text with ``tests/golden/<name>``; returns a function (name, actual) -> None.

    Under ``pytest --update-docs`` (the flag that regenerates the docs and tests/golden/*.txt) the file
    is written instead. Rendered tables live in tests/golden/tables/: the ``*.txt`` files at its
    top are command transcripts that tests/test_docs.py runs."""
    update = bool(request.config.getoption("--update-docs"))

    def check(name: str, actual: str) -> None:
        path = GOLDEN_DIR / name
        if update:
            if not path.exists() or path.read_text() != actual:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(actual)
            return
        assert path.exists(), f"tests/golden/{name} is missing (create it: python -m pytest --update-docs)"
        expected = path.read_text()
        diff = "\n".join(difflib.unified_diff(expected.splitlines(), actual.splitlines(), f"tests/golden/{name}",
                                              "actual", lineterm=""))
        assert actual == expected, f"differs from its golden file (regenerate: --update-docs)\n{diff}"

    return check
