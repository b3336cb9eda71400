"""Which MODEL import paths hookcli refuses: Python's own modules are never a model.

Torch-free (the config reader uses it too). A MODEL import path runs code: importing the module runs
its top level, and the target is called with ``model_args``. A config file may come from someone
else's repository (bare ``hookcli check`` reads ``[tool.hookcli]`` of ./pyproject.toml by itself), so
a target in the standard library (``os:system``, ``subprocess:run``, ``builtins:eval``) is refused
before it is imported or called. The loader (``hookcli.engine.loading.check_target``) also checks what an
import path resolves to, which catches re-exports (``mymod:system`` after ``from os import system``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

from hookcli.options import TORCHVISION

#: The hint of every refused MODEL target.
OWN_CODE_HINT = ("the MODEL import path must name an nn.Module class or a factory function from your own code "
                 "(package.module:Net or path/to/net.py:build)")


@lru_cache(maxsize=1)
def _stdlib_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys(os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)))


@lru_cache(maxsize=1)
def _site_dirs() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = [paths.get("purelib"), paths.get("platlib"), *site.getsitepackages(), site.getusersitepackages()]
    return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs if d))


def is_inside(path: str, dirs: Sequence[str]) -> bool:
    """Whether ``path`` (symlinks and ``..`` resolved) is one of ``dirs`` (real paths) or inside one."""
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + os.sep) for d in dirs)


def _is_stdlib_file(location: str | None) -> bool:
    """Whether a module at ``location`` (a file, or None/'built-in'/'frozen') is part of Python."""
    if not location or location in ("built-in", "frozen"):
        return True
    return is_inside(location, _stdlib_dirs()) and not is_inside(location, _site_dirs())


def is_stdlib_module(name: str) -> bool:
    """Whether the module called ``name`` is Python's own (``sys.stdlib_module_names``, builtins),
    judged by where it was loaded from: a user's ``test/`` package that shares a standard name is
    not. Never imports anything."""
    top = name.partition(".")[0]
    if top not in sys.stdlib_module_names:
        return False
    module = sys.modules.get(top)
    if module is not None:
        spec = getattr(module, "__spec__", None)
        origin = getattr(module, "__file__", None) or getattr(spec, "origin", None)
        return _is_stdlib_file(origin)
    try:
        with _cwd_on_sys_path():
            spec = importlib.util.find_spec(top)  # a top-level name: finds, executes nothing
    except (ImportError, ValueError):
        return True
    return spec is None or _is_stdlib_file(spec.origin)


@contextmanager
def _cwd_on_sys_path() -> Iterator[None]:
    """The working directory first on sys.path (as the loader imports), for one lookup."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def module_locations(name: str) -> tuple[str, ...]:
    """Where the top-level package of module ``name`` would be imported from (as the loader imports:
    the working directory first on sys.path): its file, or each folder of a namespace package;
    ``("built-in",)`` for one compiled into Python; ``()`` when it is not found. Executes nothing."""
    top = name.partition(".")[0]
    module = sys.modules.get(top)
    spec = getattr(module, "__spec__", None) if module is not None else None
    if module is None:
        try:
            with _cwd_on_sys_path():
                spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return ()
    if spec is None:
        found = getattr(module, "__file__", None) if module is not None else None
        return (found,) if found else (("built-in",) if module is not None else ())
    if spec.origin and spec.origin != "namespace":
        return ("built-in",) if spec.origin in ("built-in", "frozen") else (spec.origin,)
    return tuple(spec.submodule_search_locations or ())


def is_stdlib_path(path: str | os.PathLike[str]) -> bool:
    """Whether a ``file.py`` of a MODEL spec is a file of Python's standard library."""
    try:
        return os.path.isfile(path) and _is_stdlib_file(os.fspath(path))
    except (OSError, ValueError):
        return False


def stdlib_target(spec: str) -> str | None:
    """What in ``spec`` is Python's own: the module of ``pkg.mod:attr`` or the file of
    ``file.py:attr`` (relative to the working directory); None for anything else."""
    module = import_target_module(spec)
    if module is not None:
        return module if is_stdlib_module(module) else None
    text = spec.strip()
    if ":" in text and not text.lower().startswith(TORCHVISION.prefix):
        target = text.rpartition(":")[0].strip()
        if target.endswith(".py") and is_stdlib_path(os.path.expanduser(target)):
            return target
    return None


def import_target_module(spec: str) -> str | None:
    """The module part of an import-path spec (``pkg.mod`` of ``pkg.mod:Net``); None for a
    torchvision name or a ``file.py:attr`` spec."""
    text = spec.strip()
    if ":" not in text or text.lower().startswith(TORCHVISION.prefix):
        return None
    target = text.rpartition(":")[0].strip()
    return None if not target or target.endswith(".py") else target


__all__ = ["OWN_CODE_HINT", "import_target_module", "is_stdlib_module", "is_inside", "is_stdlib_path", "module_locations",
           "stdlib_target"]
