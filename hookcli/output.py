"""Writing output files without ever losing what was there.

Every file hookcli writes (``-o`` reports, ``features``/``fmaps`` files, ``--junit``) goes through
this module, which decides *how* to write from what the path is:

- a new path or a regular file: a temporary file next to it (``.<name>.XXXX.tmp``), flushed and
  fsynced, then renamed over it (``os.replace``): readers see the old file or the complete new one;
- a FIFO or a character/block device (``/dev/null``, a terminal, a named pipe), or an open file
  named through ``/dev/stdout``, ``/dev/fd/N`` or ``/proc``: opened and written in place; never
  replaced by a regular file;
- a symlink (chains and relative links too): followed, and its target written as above (the link
  stays a link);
- a file the user cannot write: refused before anything runs (OutputError, exit 2). A regular file
  with no write bit at all counts as "cannot write" even for root, who could replace it: someone
  made it read-only on purpose.

Temporary files are removed on every failure, including SIGINT/SIGTERM turned into exceptions by
the CLI (the few statements that create or rename them hold those signals, so no signal can land
between creating a temporary file and remembering to remove it). An OSError while writing becomes
OutputError with one line and a hint (no space left, broken pipe, ...).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shlex
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hookcli.errors import OutputError
from hookcli.options import check_path_text

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Target:
    """Where an output goes: ``path`` (symlinks followed) and how it is written."""

    path: Path
    #: a FIFO or device: opened and written in place, never renamed over
    in_place: bool
    #: something already exists at ``path`` (and will be replaced or written into)
    exists: bool
    #: the path as the user gave it (for messages)
    given: str
    #: an in-place regular file (reached through ``/dev/stdout`` and the like): truncated when opened
    truncate: bool = False


def _shown(text: str, real: Path) -> str:
    """``text``, plus where it leads when it is a symlink (for messages)."""
    return text if Path(text).expanduser().absolute() == real else f"{text} (a link to {real})"


def _follow(text: str) -> Path:
    """The absolute path to write: a symlink (chain, relative) is followed to its final target."""
    p = Path(text).expanduser()
    if not p.is_symlink():
        return p.absolute()
    try:
        return p.resolve(strict=False)
    except (RuntimeError, OSError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise OutputError(f"cannot write {text}: the symlink does not lead to a file ({exc})",
                          hint="fix the link, or choose another path") from None


def _check_parent(text: str, real: Path) -> None:
    """A new file or a replaced one needs a writable directory (the temporary file and the rename).

    Missing directories are fine when the nearest existing one is writable: they are created when
    the output is written (``_make_parents``), so a run that fails first creates nothing.
    """
    shown = _shown(text, real)
    parent = real.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write {shown}: {parent} is not a directory", hint="choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown}: permission denied for directory {parent}",
                          hint="choose a directory you can write to")


def _check_file_writable(text: str, real: Path, st: os.stat_result) -> None:
    """Refuse a file the user cannot write; a file without any write bit is refused even for root."""
    shown = _shown(text, real)
    if not st.st_mode & 0o222:
        raise OutputError(f"cannot write {shown}: the file is read-only",
                          hint=f"make it writable first (chmod u+w {shlex.quote(str(real))}), or choose another path")
    if not os.access(real, os.W_OK):
        raise OutputError(f"cannot write {shown}: permission denied", hint="choose a path you can write to")


#: Paths that name an open file of a process (``-o /dev/stdout``): written in place through the
#: path, as the shell's ``>`` would, never renamed over (the link may not even have a real target).
_DESCRIPTOR_PATHS = ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/")


def resolve_target(path: str | os.PathLike[str]) -> Target:
    """Decide how ``path`` will be written, and check up front that it can be (before a model runs).

    Raises OutputError (exit 2) for an empty path, a directory, a socket, a missing or unwritable
    directory, a symlink loop, or a file the user cannot write.
    """
    text = os.fspath(path)
    if not text:
        raise OutputError("output path is empty", hint="give a file name, e.g. -o report.json")
    check_path_text(text, "output path", OutputError)
    given = Path(text).expanduser().absolute()
    try:
        st: os.stat_result | None = os.stat(given)  # the kernel follows every link, /proc magic ones too
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise OutputError(f"cannot write {text}: a part of the path before the file name is not a directory",
                          hint="choose another path") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(f"cannot write {text}: the symlink does not lead to a file (a symlink loop)",
                              hint="fix the link, or choose another path") from None
        message, hint = describe(text, exc)
        raise OutputError(message, hint=hint) from None
    if st is not None and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        _check_file_writable(text, given, st)
        return Target(given, in_place=True, exists=True, given=text)
    if st is not None and stat.S_ISREG(st.st_mode) and str(given).startswith(_DESCRIPTOR_PATHS):
        _check_file_writable(text, given, st)  # e.g. -o /dev/stdout with stdout redirected to a file
        return Target(given, in_place=True, exists=True, given=text, truncate=True)
    real = _follow(text)
    shown = _shown(text, real)
    if st is None:
        _check_parent(text, real)
        return Target(real, in_place=False, exists=False, given=text)
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write {shown}: it is a directory", hint="give a file name inside it")
    if stat.S_ISREG(st.st_mode):
        _check_file_writable(text, real, st)
        _check_parent(text, real)
        return Target(real, in_place=False, exists=True, given=text)
    kind = "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file, FIFO or device"
    raise OutputError(f"cannot write {shown}: it is {kind}", hint="choose another path")


def ensure_writable(path: str | os.PathLike[str]) -> Path:
    """Check up front that ``path`` can be written (so a command fails before running a model).

    Returns the absolute path that will be written (a symlink's target); see :func:`resolve_target`.
    """
    return resolve_target(path).path


# --------------------------------------------------------------------------- errors

_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error prints itself


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, one in its cause/context chain, or one a native writer
    (safetensors' Rust code) only named in its message (``... (os error 28)``); else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        match = _OS_ERROR_IN_TEXT.search(str(current))
        if match:
            code = int(match.group(1))
            return OSError(code, os.strerror(code))
        current = current.__cause__ or current.__context__
    return None


_ERRNO_TEXT: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on device", "free some space, or write to another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free some space, or write to another disk"),
    errno.EFBIG: ("the file is too large for this file system", "write to another disk"),
    errno.EROFS: ("the file system is read-only", "write to another disk"),
    errno.EPIPE: ("the reader closed the pipe", "keep the reading end open until hookcli finishes"),
    errno.ENXIO: ("no reader or device behind it", "start the reader first, or choose another path"),
    errno.EACCES: ("permission denied", "choose a path you can write to"),
    errno.EPERM: ("operation not permitted", "choose a path you can write to"),
    errno.EISDIR: ("it is a directory", "give a file name inside it"),
}


def describe(path: str | os.PathLike[str], exc: BaseException, directory: Path | None = None) -> tuple[str, str]:
    """One line saying why ``path`` (in ``directory``) could not be written, and a hint."""
    if isinstance(exc, UnicodeEncodeError):
        return (f"cannot write {path}: the text cannot be encoded as UTF-8 ({exc.reason})",
                "write --format json, which escapes every character")
    if isinstance(exc, FileNotFoundError):
        parent = directory if directory is not None else Path(os.fspath(path)).parent
        return (f"cannot write {path}: directory {parent} does not exist",
                "create it first, or choose another path")
    if isinstance(exc, OSError) and exc.errno in _ERRNO_TEXT:
        text, hint = _ERRNO_TEXT[exc.errno]
        return f"cannot write {path}: {text}", hint
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"cannot write {path}: {detail}", "check the path, or choose another one"


def _output_error(target: Target, exc: BaseException) -> OutputError:
    message, hint = describe(_shown(target.given, target.path), exc, target.path.parent)
    return OutputError(message, hint=hint)


# --------------------------------------------------------------------------- signals


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for a few statements (delivered right after).

    Creating a temporary file and remembering its name (or renaming it and forgetting it) must not be
    split by an exception from a signal handler, or the file would be left behind.
    """
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# --------------------------------------------------------------------------- writing


class OutputStream(io.RawIOBase):
    """A write-only, unseekable binary stream on a file descriptor that counts what it writes.

    Writes go straight to the descriptor (an error such as ENOSPC raises OSError at the write that
    failed, never later or silently); unseekable so writers stream as they would into a pipe
    (``torch.save``, ``numpy.savez`` and ``zipfile`` all can).
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self.bytes_written = 0
        #: what a write raised (a full disk's OSError, SIGTERM's ``Terminated``), kept: a writer may catch it
        #: and raise its own error instead (``torch.save``'s C++ writer reports only "unexpected pos")
        self.failure: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        try:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):
                done += os.write(self._fd, view[done:])
        except BaseException as exc:
            self.failure = exc
            raise
        self.bytes_written += done
        return done


@contextlib.contextmanager
def _failures_of(stream: OutputStream) -> Iterator[OutputStream]:
    """``stream``, and when the block raises after one of its writes failed, that failure instead: what a
    writer made of it (torch.save turns a signal's exception or ENOSPC into a RuntimeError) is not the cause."""
    try:
        yield stream
    except Exception as exc:
        if stream.failure is not None and stream.failure is not exc:
            raise stream.failure from exc
        raise


def _new_file_mode(target: Target) -> int:
    """The mode a plain ``open()`` would give: the old file's mode, else 0o666 & ~umask."""
    if target.exists:
        with contextlib.suppress(OSError):
            return stat.S_IMODE(target.path.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _take_over(tmp_name: str, target: Target) -> None:
    """Give the temporary file the mode (and, where allowed, owner) of the file it replaces."""
    os.chmod(tmp_name, _new_file_mode(target))
    if target.exists and hasattr(os, "chown"):
        with contextlib.suppress(OSError):
            st = target.path.stat()
            mine = os.stat(tmp_name)
            if (st.st_uid, st.st_gid) != (mine.st_uid, mine.st_gid):
                os.chown(tmp_name, st.st_uid, st.st_gid)


def _make_parents(target: Target) -> None:
    """Create the missing directories above a new output file (``-o`` and ``--junit`` alike)."""
    try:
        target.path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _output_error(target, exc) from exc


@contextlib.contextmanager
def _mapped_errors(target: Target) -> Iterator[None]:
    """An OSError raised in the block (also one behind a writer's own exception, such as safetensors'
    Rust error naming an ``os error``) becomes OutputError naming ``target``; other errors pass."""
    try:
        yield
    except Exception as exc:
        os_exc = os_error_in(exc)
        if os_exc is None or isinstance(exc, OutputError):
            raise
        raise _output_error(target, os_exc) from exc


@contextlib.contextmanager
def _replacing(target: Target) -> Iterator[str]:
    """The name of a new temporary file beside ``target`` (missing directories created), renamed over
    it when the block succeeds: fsynced by name (a writer may have replaced the file), given the old
    file's mode and owner, renamed with SIGINT/SIGTERM held. When the block raises the temporary file
    is removed and the old file is left as it was."""
    tmp_name: str | None = None
    _make_parents(target)
    try:
        with _mapped_errors(target):
            with _signals_held():
                fd, tmp_name = tempfile.mkstemp(dir=target.path.parent, prefix=f".{target.path.name}.",
                                                suffix=".tmp")
                os.close(fd)
            yield tmp_name
            with open(tmp_name, "rb+") as tmp:
                os.fsync(tmp.fileno())
            _take_over(tmp_name, target)
            with _signals_held():
                os.replace(tmp_name, target.path)
                tmp_name = None
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
    _fsync_dir(target.path.parent)


@contextlib.contextmanager
def open_output(path: str | os.PathLike[str] | Target) -> Iterator[OutputStream]:
    """A binary stream to write an output to, committed when the block succeeds.

    For a new path or a regular file the stream is a temporary file renamed over the target at the
    end; for a FIFO or device it is the target itself, opened in place (a FIFO's open waits for a
    reader, as the shell's ``>`` does). When the block raises, the temporary file is removed and the
    old file is left as it was. An OSError (also one behind a writer's own exception) becomes
    OutputError; other exceptions propagate unchanged.
    """
    target = path if isinstance(path, Target) else resolve_target(path)
    if target.in_place:
        yield from _in_place(target)
        return
    with _replacing(target) as tmp_name:
        fd = os.open(tmp_name, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            with _failures_of(OutputStream(fd)) as stream:
                yield stream
        finally:
            os.close(fd)


def _in_place(target: Target) -> Iterator[OutputStream]:
    """Open a FIFO or device for writing (no create, no temporary file) and yield it."""
    try:
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | (os.O_TRUNC if target.truncate else 0)
        fd = os.open(target.path, flags)
    except OSError as exc:
        raise _output_error(target, exc) from exc
    try:
        with _mapped_errors(target), _failures_of(OutputStream(fd)) as stream:
            yield stream
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` (str is encoded as UTF-8) to ``path``; return the absolute path written.

    A new or regular file is replaced atomically (temporary file, fsync, rename: readers see the old
    file or the new one, the new file gets the usual permissions or the old file's mode); a FIFO or
    device is written in place; a symlink's target is written. On any failure OutputError is raised,
    no temporary file is left and the old file is as it was. See :func:`open_output`.
    """
    if not isinstance(data, (str, bytes)):
        raise TypeError(f"write_atomic expects str or bytes, got {type(data).__name__}")
    target = resolve_target(path)
    try:
        payload = data.encode("utf-8") if isinstance(data, str) else data
    except UnicodeEncodeError as exc:
        raise _output_error(target, exc) from exc
    with open_output(target) as out:
        out.write(payload)
    return target.path


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
def atomic_path(path: str | os.PathLike[str] | Target) -> Iterator[Path]:
    """A temporary path for writers that want a file name (``safetensors.torch.save_file``).

    >>> with atomic_path("feats.safetensors") as tmp:
    ...     save_file(tensors, tmp)

    For a new or regular file the path is next to the target and renamed over it when the block
    succeeds (same guarantees as :func:`open_output`). For a FIFO or device, which must never be
    replaced, the path is in a private temporary directory and its bytes are copied into the target
    in place. When the block raises, the temporary file is removed; an OSError (also one behind a
    writer's own exception) becomes OutputError, other exceptions propagate unchanged.
    """
    target = path if isinstance(path, Target) else resolve_target(path)
    if target.in_place:
        with tempfile.TemporaryDirectory(prefix="hookcli-") as scratch:
            tmp = Path(scratch) / target.path.name
            with _mapped_errors(target):
                yield tmp
            with open_output(target) as out, open(tmp, "rb") as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
        return
    with _replacing(target) as tmp_name:
        yield Path(tmp_name)


__all__ = ["OutputStream", "Target", "atomic_path", "describe", "ensure_writable", "open_output",
           "os_error_in", "resolve_target", "write_atomic"]


# --------------------------------------------------------------------------- logs


class LineLog:
    """A log written a line at a time (``hookcli.watch``'s JSON Lines): appended to, never replaced.

    The path is checked when the log is made (OutputError, before any training step); the file is
    created at the first line (with missing directories), and opened ``O_APPEND``: an existing log
    keeps its lines and the new ones follow (on a line of their own when its last line was torn by a
    crash). Each line goes to the file in one unbuffered write (into a regular file with SIGINT and
    SIGTERM held), so a process that dies leaves every line written before complete; a write that fails
    part way (no space left) is cut back off a regular file, which then ends with its last whole line.
    Only a regular file is read (its last byte) or cut: a FIFO or ``/dev/stdout`` is written as a stream,
    never sought. An OSError is OutputError.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.target = resolve_target(path)
        self._fd: int | None = None
        self._regular = False

    def write_line(self, line: str) -> None:
        """Append ``line`` (one line ending with a newline) to the file."""
        with _mapped_errors(self.target):
            if self._fd is None:
                if not self.target.in_place:
                    _make_parents(self.target)
                flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
                self._fd = os.open(self.target.path, flags | (0 if self.target.in_place else os.O_CREAT), 0o666)
                self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
                if self._regular and _ends_mid_line(self.target.path):  # a run that died mid-write
                    line = "\n" + line  # its torn line stays alone
            st = os.fstat(self._fd) if self._regular else None
            if st is not None and st.st_nlink == 0:  # its lines would go nowhere
                raise OutputError(f"cannot write {_shown(self.target.given, self.target.path)}: the file (or its "
                                  "folder) was removed during the run", hint="keep the log's folder until the run ends")
            size = st.st_size if st is not None else None
            # (a pipe's reader may stall a write: SIGINT and SIGTERM are held for files only)
            with _signals_held() if self._regular else contextlib.nullcontext():
                try:
                    OutputStream(self._fd).write(line.encode())
                except OSError:
                    if size is not None:  # the part written is cut off: the file ends with a whole line
                        with contextlib.suppress(OSError):
                            os.ftruncate(self._fd, size)
                    raise

    def close(self) -> None:
        """Close the file (the lines are written already). Safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _ends_mid_line(path: str | os.PathLike[str]) -> bool:
    """Whether the regular file holds bytes after its last newline (a line torn by a crash mid-write);
    False when it cannot be read."""
    try:
        with open(path, "rb") as file:
            if file.seek(0, os.SEEK_END) == 0:
                return False
            file.seek(-1, os.SEEK_END)
            return file.read(1) != b"\n"
    except OSError:
        return False
