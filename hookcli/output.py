"""Writing output files atomically (temp file in the same directory + ``os.replace``)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hookcli.errors import OutputError


def _target(path: str | os.PathLike[str]) -> Path:
    """The absolute path to write; a symlink is followed so its target is replaced, not the link."""
    p = Path(os.fspath(path)).expanduser()
    if p.is_symlink():
        p = p.resolve()
    return p.absolute()


def ensure_writable(path: str | os.PathLike[str]) -> Path:
    """Check up front that ``path`` can be written (so a command fails before running a model).

    Missing parent directories are fine (the writers create them, only when they write, so a
    failed run leaves none behind) as long as the nearest existing one is a writable directory.
    Raises OutputError when the path is empty or a directory, or that directory is not a
    directory or not writable. Returns the absolute target path.
    """
    if not os.fspath(path):
        raise OutputError("output path is empty", hint="give a file name, e.g. -o report.json")
    target = _target(path)
    if target.is_dir():
        raise OutputError(f"cannot write {path}: it is a directory", hint="give a file name inside it")
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {path}: {parent} is not a directory", hint="choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: permission denied for directory {parent}",
                          hint="choose a directory you can write to")
    return target


def _make_parents(target: Path, path: str | os.PathLike[str]) -> None:
    """Create the missing parent directories of ``target`` (``-o`` and ``--junit`` alike)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(_describe(path, exc), hint=_hint(exc)) from exc


def _new_file_mode(target: Path) -> int:
    """The mode a plain ``open()`` would give: the old file's mode, else 0o666 & ~umask."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _hint(exc: BaseException) -> str:
    """What to do about a failed write."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "free some space, or write to another disk"
    if isinstance(exc, PermissionError):
        return "choose a file you can write, in a directory you can write to"
    return "choose another output file"


def _describe(path: str | os.PathLike[str], exc: BaseException) -> str:
    if isinstance(exc, UnicodeEncodeError):
        return f"cannot write {path}: the text cannot be encoded as UTF-8 ({exc.reason})"
    if isinstance(exc, IsADirectoryError):
        return f"cannot write {path}: it is a directory"
    if isinstance(exc, PermissionError):
        return f"cannot write {path}: permission denied"
    if isinstance(exc, FileNotFoundError):
        return f"cannot write {path}: directory {Path(os.fspath(path)).parent} does not exist"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"cannot write {path}: no space left on device"
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"cannot write {path}: {detail}"


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (str is encoded as UTF-8) to ``path`` atomically; return the absolute path.

    The data goes to a temporary file next to the target (``.<name>.XXXX.tmp``), is flushed and
    fsynced, then renamed over the target with ``os.replace``: readers see the old file or the new
    one, never a partial one. A new file gets the usual permissions (0o666 minus the umask), an
    existing one keeps its mode. On any failure the temporary file is removed and OutputError is
    raised; the old file, if any, is left as it was.
    """
    if not isinstance(data, (str, bytes)):
        raise TypeError(f"write_atomic expects str or bytes, got {type(data).__name__}")
    target = ensure_writable(path)
    _make_parents(target, path)
    tmp_name: str | None = None
    try:
        payload = data.encode("utf-8") if isinstance(data, str) else data
        mode = _new_file_mode(target)
        with tempfile.NamedTemporaryFile(
            mode="wb", delete=False, dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
        ) as tmp:
            tmp_name = tmp.name
            tmp.write(payload)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
        tmp_name = None
    except (OSError, UnicodeEncodeError) as exc:
        raise OutputError(_describe(path, exc), hint=_hint(exc)) from exc
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
    _fsync_dir(target.parent)
    return target


def _fsync_dir(directory: Path) -> None:
    """Best effort: persist the rename (POSIX only; ignored where directories cannot be opened)."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path next to ``path`` for writers that want a file name (``torch.save``,
    ``safetensors.torch.save_file``); renamed over ``path`` when the block succeeds.

    >>> with atomic_path("feats.safetensors") as tmp:
    ...     save_file(tensors, tmp)

    Same guarantees as :func:`write_atomic`: readers see the old file or the complete new one, the
    new file gets the usual permissions, and when the block raises the temporary file is removed
    (an OSError becomes OutputError; other exceptions propagate unchanged).
    """
    target = ensure_writable(path)
    _make_parents(target, path)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise OutputError(_describe(path, exc), hint=_hint(exc)) from exc
    done = False
    try:
        yield Path(tmp_name)
        try:
            mode = _new_file_mode(target)
            with open(tmp_name, "rb+") as tmp:
                os.fsync(tmp.fileno())
            os.chmod(tmp_name, mode)
            os.replace(tmp_name, target)
        except OSError as exc:
            raise OutputError(_describe(path, exc), hint=_hint(exc)) from exc
        done = True
    except OSError as exc:
        raise OutputError(_describe(path, exc), hint=_hint(exc)) from exc
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
    _fsync_dir(target.parent)
