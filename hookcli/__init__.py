"""hookcli: inspect PyTorch models from the command line and from Python.

The public functions are those of ``hookcli.api`` (its ``__all__``); importing them does not import
torch, so ``import hookcli`` and ``hookcli --help`` stay fast.
"""

from __future__ import annotations

from typing import Any

from hookcli._version import __version__
from hookcli.errors import HookcliError

from hookcli import api as _api  # torch-free at import: each function imports what it runs


def __getattr__(name: str) -> Any:
    if name in _api.__all__:
        return getattr(_api, name)
    raise AttributeError(f"module 'hookcli' has no attribute {name!r}")


__all__ = ["__version__", "HookcliError", *_api.__all__]
