"""The size limits of the inputs hookcli reads, in one place, and the capped reads that apply them.

A file on the command line can be anything: ``/dev/zero`` as ``--baseline``, a 30000x30000 PNG that
decodes to gigabytes, a small ``.npz`` whose members expand a thousandfold. Each read is checked
against its limit BEFORE the data is decoded or expanded (a header, a zip directory, the bytes read
so far), and a file over it is an input error (exit 2) that names the limit and the environment
variable that raises it. Torch-free (the config reader uses it).
"""

from __future__ import annotations

import os
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


def read_capped(path: Path, limit: Limit, what: str) -> bytes:
    """The bytes of ``path``, at most ``limit``: a larger file, or an endless one (a device, a FIFO
    that never closes), stops at the limit with InputError; nothing past it is read."""
    cap = limit.value()
    with open(path, "rb") as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise limit.exceeded(what, f"more than {cap:,} bytes")
    return data


def check_size(path: Path, limit: Limit, what: str) -> None:
    """InputError when the regular file ``path`` is over ``limit`` bytes (a device or FIFO is
    read with :func:`read_capped` instead)."""
    size = path.stat().st_size
    if size > limit.value():
        raise limit.exceeded(what, f"{size:,} bytes")


__all__ = ["IMAGE_PIXELS", "TENSOR_BYTES", "TEXT_BYTES", "Limit", "check_size", "read_capped"]
