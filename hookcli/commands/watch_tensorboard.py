"""``hookcli.watch(tensorboard_dir=...)``: each logged step's record as TensorBoard scalars
(docs/watch.md#tensorboard; the extra ``hookcli[tensorboard]``).

The values are the record's, the log line's numbers (and its parameters' histograms, which the engine
measured at the logged step): nothing is measured again here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from hookcli.errors import OutputError, UsageError
from hookcli.output import describe
from hookcli.records import WatchStep

#: The statistics of each layer written as scalars (tag ``layers/<name>/<key>``; ``grad_rms``: its gradient's).
LAYER_SCALARS = ("rms", "abs_max", "zero_fraction")


class TensorBoardLog:
    """A TensorBoard event file in ``directory`` (made now, with missing folders), one set of scalars per
    logged step, flushed at each: ``loss``; ``layers/<name>/rms``, ``abs_max``, ``zero_fraction``,
    ``grad_rms``; ``params/<name>/grad_norm``, ``update_ratio``; histograms ``params/<name>/values`` and
    ``grad`` (the record's, measured on the device at the logged step before the update). UsageError without the tensorboard
    package, OutputError for a directory that cannot be made."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("tensorboard_dir= needs the tensorboard package, which is not installed",
                             hint="pip install 'hookcli[tensorboard]' (or pip install tensorboard)") from None
        self.path = path = Path(directory)
        try:
            path.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=os.fspath(path))
        except OSError as exc:
            message, hint = describe(path, exc, path.parent)
            raise OutputError(message, hint=hint) from None
        self._file = _GuardedFile.around(self.writer)

    def write(self, record: WatchStep) -> None:
        """The scalars of one logged step (a value that is None, such as no loss given, is left out).
        OutputError when the folder was removed (the event file's lines would go nowhere)."""
        if not self.path.is_dir():
            raise OutputError(f"cannot write {self.path}: the folder was removed during the run",
                              hint="keep the TensorBoard folder until the run ends")
        step, add = record.step, self.writer.add_scalar
        if record.loss is not None:
            add("loss", record.loss, step)
        for layer in record.layers:
            name = layer.name + layer.output
            for key in LAYER_SCALARS:
                if layer.stats is not None and layer.stats[key] is not None:
                    add(f"layers/{name}/{key}", layer.stats[key], step)
            if layer.grad is not None and layer.grad["rms"] is not None:
                add(f"layers/{name}/grad_rms", layer.grad["rms"], step)
        for param in record.params:
            if param.grad is not None and param.grad["rms"] is not None:
                add(f"params/{param.name}/grad_norm", param.grad["rms"] * math.sqrt(param.grad["count"]), step)
            if param.update_ratio is not None:
                add(f"params/{param.name}/update_ratio", param.update_ratio, step)
            for kind, hist in (("values", param.values_histogram), ("grad", param.grad_histogram)):
                if hist is not None:
                    self.writer.add_histogram_raw(f"params/{param.name}/{kind}", hist.min, hist.max, hist.num,
                                                  hist.sum, hist.sum_squares, hist.limits, hist.counts, step)
        self.writer.flush()
        self._raise_failure()

    def close(self) -> None:
        """Flush and close the event file. Safe to call twice; OutputError when the file could not be
        written."""
        self.writer.close()
        self._raise_failure()

    def _raise_failure(self) -> None:
        """OutputError for what writing the event file raised in TensorBoard's writer thread."""
        exc = self._file.failure if self._file is not None else None
        if exc is not None:
            message, hint = describe(self.path, exc, self.path)
            raise OutputError(message, hint=hint) from exc


class _GuardedFile:
    """The event file's record writer, as TensorBoard's writer thread calls it: an OSError (no space
    left, the folder gone) is kept in ``failure`` and later records are dropped, instead of killing the
    thread with a traceback on stderr and raising at some later call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failure: OSError | None = None

    @classmethod
    def around(cls, writer: Any) -> _GuardedFile | None:
        """Put a guard around ``writer``'s record writer (None where TensorBoard's writer is built otherwise)."""
        queue = getattr(getattr(getattr(writer, "file_writer", None), "event_writer", None), "_async_writer", None)
        worker = getattr(queue, "_worker", None)
        if queue is None or getattr(worker, "_record_writer", None) is not getattr(queue, "_writer", False):
            return None
        guard = cls(queue._writer)
        queue._writer = worker._record_writer = guard
        return guard

    def _guarded(self, what: str, *args: Any) -> None:
        if self.failure is None:
            try:
                getattr(self.inner, what)(*args)
            except OSError as exc:
                self.failure = exc

    def write(self, data: bytes) -> None:
        self._guarded("write", data)

    def flush(self) -> None:
        self._guarded("flush")

    def close(self) -> None:
        try:
            self.inner.close()  # (also after a failure: the file is closed)
        except OSError as exc:
            self.failure = self.failure or exc
