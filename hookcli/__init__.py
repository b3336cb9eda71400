"""hookcli: inspect PyTorch models from the command line and from Python.

The public functions are loaded lazily so that ``import hookcli`` (and ``hookcli --help``) does not
import torch.
"""

from __future__ import annotations

from typing import Any

from hookcli._version import __version__
from hookcli.errors import HookcliError

_API = ("shapes", "stats", "grads", "inspect", "modules", "models", "check", "features", "fmaps", "diff")


def __getattr__(name: str) -> Any:
    if name in _API:
        from hookcli import api

        return getattr(api, name)
    raise AttributeError(f"module 'hookcli' has no attribute {name!r}")


__all__ = ["__version__", "HookcliError", *_API]
