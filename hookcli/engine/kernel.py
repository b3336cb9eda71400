"""The optional C statistics kernel (``hookcli/engine/_fastreduce.c``): finding it, checking it, switching it off.

Torch-free, so that ``hookcli --version`` can say whether it is usable. Code that computes statistics
imports torch before calling ``load()``: the kernel then shares the OpenMP runtime torch loaded.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

#: The interface version of ``_fastreduce.c`` this package speaks (its ``HK_ABI``); 3: memory is passed
#: as a buffer-protocol object whose layout the kernel checks, never as an address; 4: ``centred``; 5: power sums up to x**4 (``reduce`` returns 7 values, ``centred`` 4).
ABI = 5
#: Set to 1 to compute CPU statistics with torch reductions even where the kernel is built.
NO_KERNEL_ENV = "HOOKCLI_NO_KERNEL"


@functools.cache
def load() -> ModuleType | None:
    """The built kernel module, or None when it was not built or is stale."""
    try:
        from hookcli.engine import _fastreduce
    except ImportError:  # no C compiler at install time: torch reductions give the same numbers
        return None
    if getattr(_fastreduce, "ABI", None) != ABI:
        return None  # a build left over from an older checkout (an editable install keeps it)
    return _fastreduce


def switched_off() -> bool:
    return os.environ.get(NO_KERNEL_ENV, "") not in ("", "0")


def enabled() -> bool:
    """Whether CPU statistics take the kernel: built, current, and not switched off."""
    return load() is not None and not switched_off()


def status() -> str:
    """One phrase for ``--version``."""
    try:
        from hookcli.engine import _fastreduce
    except ImportError:
        return "not built, CPU statistics use torch reductions"
    if getattr(_fastreduce, "ABI", None) != ABI:
        return "stale build, run pip install -e . again"
    return f"built, switched off by {NO_KERNEL_ENV}" if switched_off() else "built"
