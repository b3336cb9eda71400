"""``hookcli.watch``: what a watch over the user's own training loop is to the user (docs/watch.md).

The engine (``hookcli.engine.watch.StepWatcher``) hooks the model and the optimizer and hands each
logged step's record here; this module keeps the latest and appends it to the log as one JSON line
(the record's own ``to_json_line``: the log is written during the loop, with no renderer in between).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Self

import torch
from torch import nn

from hookcli.engine import distributed
from hookcli.engine.selection import owners_and_activations, select_modules
from hookcli.commands.watch_rules import Rules, needed, rule_settings
from hookcli.commands.watch_tensorboard import TensorBoardLog
from hookcli.engine.watch import SIGNALS, StepWatcher, compiled_inner
from hookcli.errors import (CheckFailedError, OutputError, StepOrderWarning, UsageError, WatchWarning,
                            describe_exception, user_stacklevel)
from hookcli.escape import escape_control
from hookcli.output import LineLog
from hookcli.records import Finding, WatchStep

ON_FINDING = ("print", "warn", "raise")


class Watch:
    """A watch over a training loop; a context manager (``with hookcli.watch(...) as w:``).

    ``w.step(loss=...)`` ends a step (optional: ``optimizer.step()`` ends steps too); ``w.last`` is
    the latest logged step's record; ``w.findings`` every finding of the rules so far (each also on
    its step's log line). ``on_finding="raise"``: a finding raises ``CheckFailedError`` once its
    step's line is written. ``flight=K``: the flight recorder (``hookcli.engine.flight``);
    ``tensorboard_dir``: the logged steps as TensorBoard scalars too (``watch_tensorboard``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, every: int,
                 out: str | os.PathLike[str] | None, layers: Sequence[str] | str | None,
                 types: Sequence[str] | str | None, rules: Mapping[str, Any] | None = None,
                 on_finding: str = "print", flight: int | None = None,
                 tensorboard_dir: str | os.PathLike[str] | None = None) -> None:
        check_arguments(model, optimizer, every)
        if flight is not None and (isinstance(flight, bool) or not isinstance(flight, int) or flight < 1):
            raise UsageError(f"flight must be a whole number of steps, 1 or more, got {flight!r}",
                             hint="flight=100 keeps every step's statistics of the last 100 steps")
        check_path("out", out)
        check_path("tensorboard_dir", tensorboard_dir)
        if on_finding not in ON_FINDING:
            raise UsageError(f"on_finding must be 'print', 'warn' or 'raise', got {on_finding!r}",
                             hint="'print' (the default) also prints each on stderr; 'warn' keeps the findings "
                                  "in w.findings and the log, silently; 'raise' stops the loop")
        self._rules = Rules(rule_settings(rules))
        self.on_finding = on_finding
        inner = compiled_inner(model)  # torch.compile(model), (D)DP(model): the modules are named as in the model
        selection = (select_modules(inner, layers=layers, types=types) if layers or types
                     else owners_and_activations(inner))
        self._aliases = module_aliases(inner, selection)
        # under torchrun only rank 0 writes (every rank gets the same record: docs/distributed.md)
        self.log = LineLog(out) if out is not None and distributed.rank() == 0 else None  # the path is checked now
        self.tensorboard = (TensorBoardLog(tensorboard_dir) if tensorboard_dir is not None and distributed.rank() == 0
                            else None)
        self.last: WatchStep | None = None
        self.findings: list[Finding] = []
        self._untold: list[str] = []  # WatchWarnings not issued yet (``_tell``)
        self._watcher = StepWatcher(model, optimizer, selection, every, self._logged, flight=flight,
                                    histograms=tensorboard_dir is not None,  # under torchrun: on every rank
                                    channels=needed(self._rules.settings, "channels"),
                                    gather=[what for what in SIGNALS if needed(self._rules.settings, what)],
                                    attention=needed(self._rules.settings, "attention"),
                                    on_failure=lambda why, step: self._tell(
                                        f"hookcli.watch stopped at step {step}: {why}; nothing from step {step} "
                                        "on is logged, and the loop runs on unchanged"))
        self._open = self._used = False
        self._notes_said = 0

    def __enter__(self) -> Self:
        if self._used:
            raise UsageError("this watch has run already: a watch serves one with block",
                             hint="make a new hookcli.watch(...) for another loop")
        self._used = True
        self._watcher.start()
        self._open = True
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._open = False
        try:
            self._watcher.close(raised=exc_type is not None)
        except Exception:
            if exc_type is None:
                raise
            # the loop's own exception goes on; what writing the last line raised would hide it
        finally:
            if self.log is not None:
                self.log.close()
            if self.tensorboard is not None:
                try:
                    self.tensorboard.close()
                except Exception as exc:
                    self._tell(f"hookcli.watch could not finish its TensorBoard scalars: {_why(exc)}")
        if exc_type is None:
            self._warn_misuse()
            self._tell(raising=True)
            self._watcher.raise_error()

    def step(self, loss: Any = None) -> None:
        """End the step in progress (call it after ``optimizer.step()``); ``loss``: the step's loss, a
        number or a one-element tensor, read only when the step is logged."""
        if not self._open:
            raise UsageError("watch.step() outside its with block", hint="call it inside `with hookcli.watch(...) as w:`")
        self._watcher.user_step(loss)
        self._warn_misuse()
        self._tell(raising=True)

    def _tell(self, message: str | None = None, *, raising: bool = False) -> None:
        """Warn (``WatchWarning``) that part of the watch stopped (``message``), and any message not told
        yet. Never raises into the loop's forward or ``optimizer.step()``: a warning turned into an
        error there waits for ``raising``, at the user's ``w.step()`` or the ``with`` block's end."""
        if message is not None:
            self._untold.append(message)
        while self._untold:
            try:
                warnings.warn(self._untold[0], WatchWarning, stacklevel=user_stacklevel())
            except Exception:
                if raising:
                    self._untold.pop(0)
                    raise
                return
            self._untold.pop(0)

    @property
    def notes(self) -> list[str]:
        """What the watch said about the loop (each once): a ``backward()`` on a tensor that is not one value."""
        return list(self._watcher.roots.notes)

    def _print(self, findings: list[Finding]) -> None:
        """``on_finding="print"``: each finding (and each new note) as one line on stderr, as it is found
        (under torchrun by rank 0, as ``hookcli watch`` says them)."""
        notes = self._watcher.roots.notes[self._notes_said:]
        self._notes_said += len(notes)
        if distributed.rank() != 0:
            return
        for text in [*notes, *(f.line() for f in findings)]:
            print(f"hookcli.watch: {escape_control(text)}", file=sys.stderr, flush=True)

    def _warn_misuse(self) -> None:
        """Warn (once, ``StepOrderWarning``, at the user's ``w.step()`` or ``with`` line) when the loop calls
        ``w.step()`` where it shifts the log's steps: seen in the optimizer's hooks, never warned there."""
        if (message := self._watcher.take_misuse()) is not None:
            warnings.warn(message, StepOrderWarning, stacklevel=3)

    def _logged(self, record: WatchStep) -> None:
        """A logged step's record, or a flight recorder's (``record.flight``: only its NaN/Inf is looked for).
        The engine's own findings (under torchrun: which rank) come first."""
        if record.flight:
            record.findings = record.findings + self._rules.observe_flight(record)
        else:
            record.findings = record.findings + self._rules.observe(record)
            self.last = record
        for layer in record.layers:
            layer.aliases = self._aliases.get(layer.name)
        self._write(record)
        self.findings.extend(record.findings)
        if self.on_finding == "print":
            self._print(record.findings)
        if record.findings and self.on_finding == "raise":
            first = record.findings[0]
            raise CheckFailedError(f"hookcli.watch: {first.rule}: {first.message}", result=first,
                                   hint="w.findings and the log's findings say more; "
                                        "rules={...} sets the thresholds, on_finding='warn' only records them")

    def _write(self, record: WatchStep) -> None:
        """The record's log line and TensorBoard scalars. A writer that fails (no space left, its folder
        removed or read-only) stops, said once; the loop, the rules and the other writer go on."""
        if self.log is not None:
            try:
                self.log.write_line(record.to_json_line())
            except Exception as exc:
                log, self.log = self.log, None
                log.close()
                self._tell(f"hookcli.watch stopped writing its log at step {record.step}: {_why(exc)}; "
                           "the loop runs on unchanged (w.last and w.findings still follow it)")
        if self.tensorboard is not None and not record.flight:
            try:
                self.tensorboard.write(record)
            except Exception as exc:
                board, self.tensorboard = self.tensorboard, None
                with contextlib.suppress(Exception):  # (what failed again)
                    board.close()
                self._tell(f"hookcli.watch stopped writing TensorBoard scalars at step {record.step}: "
                           f"{_why(exc)}; the loop runs on unchanged")


def _why(exc: Exception) -> str:
    return exc.message if isinstance(exc, OutputError) else describe_exception(exc)


def module_aliases(model: nn.Module, selection: Sequence[tuple[str, nn.Module]]) -> dict[str, list[str]]:
    """Each selected module's other names (``lm_head`` of a module tied to ``embed``, recorded under the
    name ``named_modules()`` gives it first), for the log: ``hookcli report --layers`` matches any of them."""
    chosen = {id(module): name for name, module in selection}
    found: dict[str, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        first = chosen.get(id(module))
        if first is not None and name != first and name not in found.get(first, []):
            found.setdefault(first, []).append(name)
    return found


def check_path(what: str, path: Any) -> None:
    """UsageError for an ``out=``/``tensorboard_dir=`` that is neither None nor a path (an int, bytes)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"{what} must be a path (a str or a pathlib.Path), got {type(path).__name__}",
                         hint=f'e.g. {what}="runs/exp.jsonl"' if what == "out" else f'e.g. {what}="runs/tb"')


def check_arguments(model: Any, optimizer: Any, every: Any) -> None:
    """UsageError for a model that is not an ``nn.Module``, an optimizer that is not a torch optimizer,
    or an ``every`` that is not a positive whole number."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"hookcli.watch takes the nn.Module you train, got {type(model).__name__}",
                         hint="pass the model object itself (hookcli.watch(model, optimizer))")
    if isinstance(optimizer, (list, tuple)) and optimizer and all(
            isinstance(o, torch.optim.Optimizer) for o in optimizer):
        raise UsageError(f"hookcli.watch takes one optimizer, got a {type(optimizer).__name__} of {len(optimizer)}",
                         hint="for several (a GAN's, Muon with AdamW): optimizer=None and w.step() after they all "
                              "step, before zero_grad() (norms and gradients are logged, not the updates); or "
                              "watch each model with its own optimizer")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"hookcli.watch's optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}",
                         hint="pass the optimizer you call step() on, or None to count steps by watch.step()")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UsageError(f"every must be a whole number of steps, 1 or more, got {every!r}",
                         hint="every=50 logs steps 0, 50, 100, ...")
