"""Shared fixtures: tests/ on sys.path (for ``tiny_models:...`` specs) and a CLI runner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
