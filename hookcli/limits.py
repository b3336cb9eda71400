"""The size limits of the inputs hookcli reads, in one place, and the capped reads that apply them.

A file on the command line can be anything: ``/dev/zero`` as ``--baseline`` or a FIFO as ``--config``
(refused up front: hookcli reads regular files only, ``refuse_special``), a 30000x30000 PNG that
decodes to gigabytes, a small ``.npz`` whose members expand a thousandfold. Each read is checked
against its limit BEFORE the data is decoded or expanded (a header, a zip directory, the bytes read
so far), and a file over it is an input error (exit 2) that names the limit and the environment
variable that raises it. Torch-free (the config reader uses it).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hookcli.errors import InputError, UsageError

MiB = 1 << 20


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say (what a generated
    input or a model's weights are checked against before they are allocated)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(frozen=True)
class Limit:
    """One limit: its default, the unit it counts and the environment variable that overrides it."""

    name: str
    default: int
    unit: str  # "bytes" or "pixels"

    @property
    def env(self) -> str:
        return f"HOOKCLI_{self.name.upper()}"

    def value(self) -> int:
        """The limit in force: ``$HOOKCLI_<NAME>`` when set (a positive integer), else the default."""
        text = os.environ.get(self.env)
        if text is None or not text.strip():
            return self.default
        try:
            value = int(text.strip())
        except ValueError:
            value = 0
        if value <= 0:
            raise UsageError(f"{self.env}={text!r} is not a positive whole number of {self.unit}",
                             hint=f"set {self.env} to a number of {self.unit}, or unset it (default {self.default})")
        return value

    def exceeded(self, what: str, amount: str) -> InputError:
        """The error for ``what`` being over this limit (``amount``: how much it is, in words)."""
        return InputError(f"{what} is too large: {amount}, over the limit of {self.shown()}",
                          hint=f"raise the limit with the environment variable {self.env}=N ({self.unit}) "
                               "if you trust the file")

    def shown(self) -> str:
        limit = self.value()
        return f"{limit / MiB:g} MiB" if self.unit == "bytes" else f"{limit:,} pixels"


#: Text files hookcli parses: --config TOML, --baseline JSON reports.
TEXT_BYTES = Limit("max_text_bytes", 64 * MiB, "bytes")
#: Tensor input files (--input x.pt/.npy/.npz/.safetensors): bytes read, or bytes an .npz expands to.
TENSOR_BYTES = Limit("max_tensor_bytes", 4096 * MiB, "bytes")
#: Decoded pixels of one input image (width x height), read from its header before decoding.
IMAGE_PIXELS = Limit("max_image_pixels", 100_000_000, "pixels")


def special_kind(mode: int) -> str | None:
    """What a file of ``mode`` is when it is none of a regular file and a directory: a FIFO, a
    device, a socket (reading one blocks forever or never ends); None for a file or a folder."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def refuse_special(path: str | os.PathLike[str], what: str, error: type[UsageError] = InputError) -> None:
    """``error`` (exit 2) when ``path`` (symlinks followed) is a FIFO, a device or a socket: every file
    hookcli reads (``--input``, ``--data``, ``--weights``, ``--config``, a baseline) must be a regular
    file or a folder, refused up front, before anything blocks on it or reads it to a limit. A path
    that is not there is left to the caller to say so."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    kind = special_kind(mode)
    if kind is not None:
        raise error(f"{what} {os.fspath(path)} is {kind}, not a regular file",
                    hint="give a file saved on disk: hookcli does not read pipes, devices or sockets")


def read_capped(path: Path, limit: Limit, what: str) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit``: a larger file stops at the limit with
    InputError, nothing past it read. A FIFO, device or socket is refused (InputError) as it is opened,
    without waiting for a writer (``O_NONBLOCK``) or reading any of it."""
    cap = limit.value()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as fh:
        kind = special_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise InputError(f"{what} is {kind}, not a regular file",
                             hint="give a file saved on disk: hookcli does not read pipes, devices or sockets")
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise limit.exceeded(what, f"more than {cap:,} bytes")
    return data


def check_size(path: Path, limit: Limit, what: str) -> None:
    """InputError when ``path`` is over ``limit`` bytes, or is not a regular file (``refuse_special``)."""
    refuse_special(path, what)
    size = path.stat().st_size
    if size > limit.value():
        raise limit.exceeded(what, f"{size:,} bytes")


__all__ = ["IMAGE_PIXELS", "TENSOR_BYTES", "TEXT_BYTES", "Limit", "check_size", "read_capped", "refuse_special",
           "special_kind"]
