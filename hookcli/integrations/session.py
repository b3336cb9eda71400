"""What both callbacks share: one ``hookcli.watch`` over the trainer's model and optimizer, started by
the trainer's first hook and closed by its last, each finding said on stderr as its step's line is
written, and the summary line of ``hookcli watch -- CMD`` at the end.

Only the public API (``hookcli.api.watch``) is used: the callbacks add no hook of their own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hookcli import api
from hookcli.escape import escape_control
from hookcli.records import WatchRun
from hookcli.render.watch import finding_line, summary_line


def missing(package: str, extra: str) -> ImportError:
    """The ImportError of a callback whose training library is not installed."""
    return ImportError(f"hookcli.integrations needs the {package!r} package for this callback: "
                       f"pip install 'hookcli[{extra}]' (or pip install {package})")


def _say_on_stderr(text: str) -> None:
    print(f"hookcli watch: {escape_control(text)}", file=sys.stderr, flush=True)


class WatchSession:
    """A ``hookcli.watch(model, optimizer, ...)`` opened and closed by a trainer's callbacks.

    The options are ``hookcli.watch``'s, checked when the callback is made (a ``UsageError`` or
    ``ConfigError`` before the trainer starts); ``quiet``: nothing said on stderr.
    """

    def __init__(self, *, every: int = 1, out: str | os.PathLike[str] | None = None,
                 layers: Sequence[str] | str | None = None, types: Sequence[str] | str | None = None,
                 rules: Mapping[str, Any] | None = None, on_finding: str = "warn", flight: int | None = None,
                 tensorboard_dir: str | os.PathLike[str] | None = None,
                 quiet: bool = False) -> None:
        import torch

        self.options: dict[str, Any] = {"every": every, "out": out, "layers": layers, "types": types,
                                        "rules": rules, "on_finding": on_finding, "flight": flight,
                                        "tensorboard_dir": tensorboard_dir}
        # checked now, on an empty module: every option but layers/types (they need the model) and
        # tensorboard_dir (its writer makes a file): those when the watch starts
        api.watch(torch.nn.Module(), None, **{**self.options, "layers": None, "types": None, "tensorboard_dir": None})
        self.say: Callable[[str], None] = (lambda _text: None) if quiet else _say_on_stderr
        self.watch: Any = None
        self.run: WatchRun | None = None
        self.steps = 0
        self._shown = 0

    @property
    def open(self) -> bool:
        return self.watch is not None

    @property
    def findings(self) -> list[Any]:
        """Every finding of the rules so far (of the last run, once it has ended)."""
        if self.watch is not None:
            return list(self.watch.findings)
        return list(self.run.findings) if self.run is not None else []

    def start(self, model: Any, optimizer: Any) -> None:
        """Watch ``model`` stepped by ``optimizer`` (None: steps end at ``step()`` alone)."""
        if self.watch is not None:  # the trainer's previous run raised past its end hook
            self.close(RuntimeError("the previous training run did not end"))
        watch = api.watch(model, optimizer, **self.options)
        self.watch = watch.__enter__()
        self.steps = self._shown = 0
        stepped = f"stepped by {type(optimizer).__name__}" if optimizer is not None else "with no optimizer hooked"
        params = sum(p.numel() for p in model.parameters())
        self.say(f"watching {type(model).__name__} ({params:,} parameters) {stepped}")
        self.run = WatchRun("script", type(model).__name__, type(optimizer).__name__ if optimizer is not None
                            else None, 0, self.options["every"],
                            os.fspath(self.options["out"]) if self.options["out"] is not None else None)

    def step(self, loss: Any = None) -> None:
        """End the step in progress with its loss (a number, a one-element tensor or None)."""
        if self.watch is None:
            return
        self.steps += 1
        try:
            self.watch.step(loss=loss)
        finally:
            self._report(self.watch)

    def close(self, error: BaseException | None = None) -> WatchRun | None:
        """End the watch (its last line is written; ``error``: the run raised it, the flight recorder
        writes its ring), say what it found since and the summary line."""
        watch, self.watch = self.watch, None
        if watch is None:
            return self.run
        try:
            watch.__exit__(type(error) if error is not None else None, error, None)
        finally:
            self._report(watch)
        run = self.run
        assert run is not None
        run.steps, run.findings = self.steps, list(watch.findings)
        self.say(summary_line(run))
        return run

    def _report(self, watch: Any) -> None:
        new = watch.findings[self._shown:]
        self._shown += len(new)
        for finding in new:
            self.say(finding_line(finding))
