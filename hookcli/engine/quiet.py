"""Third-party chatter off while hookcli builds and runs a model; the caller's settings back after.

transformers logs warnings ("Model config: bos_token_id must be ...") and draws progress bars
("Loading weights", "Loading checkpoint shards"); huggingface_hub draws download bars; torch.hub writes
``Downloading: "URL" to PATH`` before fetching torchvision weights (on stdout in torch 2.14: inside a
JSON report). None of it is hookcli's output. ``quiet()`` sets transformers' verbosity to errors and
switches both libraries' progress bars off for the block, for a library already imported and for one
imported inside the block (``quiet_imported``, called by the code that imports it), and drops torch.hub's
download line from stdout and stderr; on exit each setting is restored, so a Python caller's own
verbosity and bars are as they were. Errors still arrive: as exceptions, which hookcli reports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

#: The line torch.hub writes on stderr before a download (torchvision weights).
_DOWNLOAD_LINE = 'Downloading: "'


def _quiet_transformers() -> Callable[[], None]:
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()

    def restore() -> None:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    return restore


def _quiet_hub() -> Callable[[], None]:
    from huggingface_hub import utils

    disabled = utils.are_progress_bars_disabled()
    utils.disable_progress_bars()
    return (lambda: None) if disabled else utils.enable_progress_bars


#: Library (as in sys.modules) -> a function that quiets it and returns how to undo that.
_QUIETERS: dict[str, Callable[[], Callable[[], None]]] = {
    "transformers": _quiet_transformers,
    "huggingface_hub": _quiet_hub,
}


class _Quiet:
    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.done: set[str] = set()

    def apply(self) -> None:
        for name, quieter in _QUIETERS.items():
            if name in sys.modules and name not in self.done:
                self.done.add(name)
                self.undo.append(quieter())


_active: list[_Quiet] = []


class _DropDownloadLine:
    """``stream`` without torch.hub's ``Downloading: "..."`` lines (written whole, in one call)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return len(text) if text.startswith(_DOWNLOAD_LINE) else self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def quiet_imported() -> None:
    """Quiet the libraries imported since the innermost ``quiet()`` block started (call after
    importing one inside such a block)."""
    if _active:
        _active[-1].apply()


@contextmanager
def quiet() -> Iterator[None]:
    """transformers' warnings and progress bars, huggingface_hub's bars and torch.hub's download line
    (stdout and stderr) off for the block; restored after (nested blocks restore in order)."""
    state = _Quiet()
    stdout, stderr = sys.stdout, sys.stderr
    _active.append(state)
    sys.stdout, sys.stderr = _DropDownloadLine(stdout), _DropDownloadLine(stderr)  # type: ignore[assignment]
    try:
        state.apply()
        yield
    finally:
        for name, stream in (("stdout", stdout), ("stderr", stderr)):
            now = getattr(sys, name)
            if isinstance(now, _DropDownloadLine) and now.stream is stream:  # not replaced meanwhile
                setattr(sys, name, stream)
        _active.remove(state)
        for undo in reversed(state.undo):
            undo()


__all__ = ["quiet", "quiet_imported"]
