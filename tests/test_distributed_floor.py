"""The oldest torch hookcli runs on under torchrun (docs/distributed.md "Which torch"): the version
check as a pure function of ``torch.__version__`` strings, and the floor declared once in pyproject's
``distributed`` extra. No process group and no torch mock: the check reads only the string."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hookcli.engine import distributed
from hookcli.errors import EXIT_USAGE, UnsupportedError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("version", "refused"), [
    ("2.6.0", True), ("2.7.1+cpu", True), ("2.8.0+cu128", True), ("1.13.1", True),
    ("2.9.0", False), ("2.9.0a0+git1234abc", False), ("2.9.0rc1", False), ("2.10.0", False),  # 10 > 9, not "10" < "9"
    ("2.11.0+cu130", False), ("2.14.1", False), ("3.0.0.dev20270101", False),
    ("custom", False),  # nothing to compare: not refused
])
def test_torch_versions_below_the_floor_are_refused(version: str, refused: bool) -> None:
    if not refused:
        distributed.check_torch_version(version)
        return
    with pytest.raises(UnsupportedError) as caught:
        distributed.check_torch_version(version)
    assert caught.value.exit_code == EXIT_USAGE
    assert str(caught.value) == f"hookcli under torchrun needs torch 2.9 or newer, this is {version}"
    assert "torch>=2.9" in caught.value.hint


@given(major=st.integers(0, 12), minor=st.integers(0, 40), patch=st.integers(0, 9),
       suffix=st.sampled_from(["", "+cpu", "+cu128", "a0+gitdeadbee", "rc2", ".dev20260101"]))
def test_the_major_and_minor_decide(major: int, minor: int, patch: int, suffix: str) -> None:
    version = f"{major}.{minor}.{patch}{suffix}"
    if (major, minor) >= distributed.MIN_TORCH:
        distributed.check_torch_version(version)
    else:
        with pytest.raises(UnsupportedError, match=re.escape(f"this is {version}")):
            distributed.check_torch_version(version)


def test_the_distributed_extra_declares_the_same_floor() -> None:
    """``pip install hookcli[distributed]`` asks for the torch the check accepts: one floor."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    floor = ".".join(map(str, distributed.MIN_TORCH))
    assert extras["distributed"] == [f"torch>={floor}"]
    assert f"torch {floor}" in (ROOT / "docs" / "distributed.md").read_text()
