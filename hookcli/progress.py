"""Progress for slow phases (building a big model, forward, backward, saving), on stderr.

The library marks phases with ``with phase("forward"):``; nothing is shown unless the CLI called
``enable()`` and stderr is a terminal, and a phase shows a transient spinner only once it has run for
about a second, so quick commands print nothing extra and pipes and CI logs stay clean.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

_DELAY_S = 1.0
_enabled = False


def enable(on: bool = True) -> None:
    """Show progress (the CLI calls this when stderr is a terminal)."""
    global _enabled
    _enabled = bool(on) and sys.stderr.isatty()


@contextmanager
def phase(description: str) -> Iterator[None]:
    """Mark a phase; shows ``description`` with a spinner on stderr if it lasts over a second."""
    if not _enabled:
        yield
        return
    from rich.console import Console
    from rich.text import Text

    from hookcli.escape import escape_control  # "building <spec>": text from the user

    console = Console(stderr=True)
    status: list[Any] = []
    done = threading.Event()
    lock = threading.Lock()

    def start() -> None:
        with lock:
            if not done.is_set():
                live = console.status(Text(f"{escape_control(description)}…"), spinner="dots")
                live.start()
                status.append(live)

    timer = threading.Timer(_DELAY_S, start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            done.set()
            for live in status:
                live.stop()
            status.clear()


def bar(description: str, total: int | None, unit: str, *,
        enabled: bool | None = None) -> tuple[AbstractContextManager[Any], Callable[[int], None]]:
    """A Rich progress bar on stderr counting ``unit`` (``images``, ``batches``) up to ``total`` (None:
    not known up front), and its ``advance(n)``. Shown when ``enabled``, by default when the CLI
    ``enable``d progress (stderr is a terminal); else a no-op context and advance."""
    show = enabled if enabled is not None else _enabled
    if not show or (total is not None and total <= 0):
        return nullcontext(), lambda n: None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(file=sys.stderr)
    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                        TimeRemainingColumn(), console=console, transient=console.is_terminal)
    task = progress.add_task(description, total=total)
    return progress, lambda n: progress.advance(task, n)
