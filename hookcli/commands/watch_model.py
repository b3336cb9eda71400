"""``hookcli watch MODEL --steps N``: hookcli's own short training loop, watched.

The engine's run loop (``run_step`` with ``OptimiserSteps``, one step per call, no hooks of its own)
trains the model on the same inputs ``grads`` and ``check`` use (dummy, ``--input`` files, or one
batch of ``--data`` per step) with their loss (``--loss``, ``--target``, ``--output-key``), and a
``hookcli.watch`` on (model, optimizer) logs it: its one hook set, installed once, records every step.
A model passed in from Python is never changed: a copy is trained.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hookcli.commands.grads import no_gradients
from hookcli.commands.watch import Watch, check_arguments, check_path
from hookcli.commands.watch_rules import rule_settings
from hookcli.engine import run as engine
from hookcli.engine.loading import refuse_torchscript
from hookcli.engine.losses import loss_for
from hookcli.engine.state import copy_model
from hookcli.errors import ModelRaisedError, UnsupportedError, UsageError
from hookcli.options import RunOptions
from hookcli.output import LineLog
from hookcli.records import Finding, WatchRun

#: ``--optimizer`` -> (the torch optimizer, its default learning rate)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], float]] = {
    "sgd": (torch.optim.SGD, 1e-2), "adam": (torch.optim.Adam, 1e-3), "adamw": (torch.optim.AdamW, 1e-3)}


def check_loop(steps: Any, lr: Any, optimizer: Any) -> None:
    """UsageError for ``steps`` that is not a whole number from 1, an unknown optimizer, or a learning
    rate that is not a finite number above 0."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be a whole number of training steps, 1 or more, got {steps!r}",
                         hint="e.g. hookcli watch resnet18 --steps 20")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"watch_model makes its own optimizer: give its name, got a {type(optimizer).__name__} object",
                         hint="optimizer='sgd', 'adam' or 'adamw' with lr=...; to train with yours, call "
                              "hookcli.watch(model, optimizer) around your own loop")
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {optimizer!r}", hint="one of: " + ", ".join(OPTIMIZERS))
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)
                           or lr <= 0):
        raise UsageError(f"the learning rate must be a finite number above 0, got {lr!r}", hint="e.g. --lr 0.01")


def watch_model(options: RunOptions, *, steps: int, lr: float | None = None, optimizer: str = "sgd",
                every: int = 1, out: str | os.PathLike[str] | None = None, rules: Mapping[str, Any] | None = None,
                on_found: Callable[[Finding], None] | None = None, flight: int | None = None) -> WatchRun:
    """Train the model of ``options`` for ``steps`` optimizer steps under ``hookcli.watch``; a WatchRun.

    ``options.layers``/``types`` choose the watched modules (default: the watch's own); the model
    raising is ModelRaisedError naming the step (exit 1), bad arguments are UsageError/ConfigError,
    checked before the model is built."""
    check_loop(steps, lr, optimizer)
    check_arguments(nn.Module(), None, every)  # (the model is not built yet)
    check_path("out", out)
    rule_settings(rules)
    if out is not None:
        LineLog(out)  # the path is checked now
    prep = engine.prepare(options, batched=True)
    engine.require_values(prep, "watch")
    refuse_torchscript(prep.loaded.model, prep.selection)
    if prep.loaded.kind == "instance":  # the caller's model is read only: a copy is trained
        try:
            clone = copy_model(prep.loaded.model)
        except Exception as exc:  # noqa: BLE001 - any failure to copy
            raise UnsupportedError(f"watch trains a copy of the model you pass, and it cannot be deep-copied: "
                                   f"{type(exc).__name__}: {exc}",
                                   hint="make the model copyable, or watch your own loop with hookcli.watch") from exc
        prep = replace(prep, loaded=replace(prep.loaded, model=clone), model_index=None)
    prep = replace(prep, selection=[])  # the watch hooks its own selection; the run loop hooks nothing
    opts = prep.options
    factory, rate = OPTIMIZERS[optimizer]
    rate = float(lr) if lr is not None else rate
    run = WatchRun("model", prep.info.spec, factory.__name__, 0, every, os.fspath(out) if out is not None else None)
    notes: list[str] = []

    def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module) -> tuple[torch.Tensor, Any]:
        choice = loss_for(output, opts, (args, kwargs), model)
        if not choice.value.requires_grad:
            raise no_gradients(prep)
        if not notes:
            notes.append(f"loss: {choice.kind}" + (f" of output {choice.output}" if choice.output else "")
                         + (f" against class {choice.target}" if choice.target is not None else "")
                         + (f" ({choice.targets})" if choice.targets else ""))
        return choice.value, None

    # (keep_params=False: the training's updates are what it leaves, as an unwatched loop's would)
    with torch.inference_mode(False), engine.running(prep, keep_params=False) as (model, first_args, first_kwargs), \
            ExitStack() as stack:
        made: list[tuple[torch.optim.Optimizer, Watch]] = []

        def make() -> torch.optim.Optimizer:
            if not made:
                trained = [p for p in model.parameters() if p.requires_grad]
                if not trained:
                    raise no_gradients(prep)
                opt = factory(trained, lr=rate)
                watch = Watch(model, opt, every=every, out=out, layers=opts.layers or None, flight=flight,
                              types=opts.types or None, rules=rules, on_finding="warn")  # (its own table says them)
                made.append((opt, stack.enter_context(watch)))
            return made[0][0]

        shown = 0
        for step, args, kwargs in _batches(prep, first_args, first_kwargs, steps):
            result = engine.run_step(prep, model, args, kwargs, None,  # (no hooks but the watch's own)
                                     engine.RunPlan(loss=loss, steps=engine.OptimiserSteps(make, 1), show_phase=False))
            if result.failure is not None:
                raise ModelRaisedError(f"step {step}: {engine.failure_message(result.failure)}",
                                       module=result.failure.module, input_shapes=result.failure.input_shapes,
                                       phase=result.failure.phase) from result.cause
            watch = made[0][1]
            watch.step(loss=result.loss_value)
            run.steps += 1
            for finding in watch.findings[shown:]:
                if on_found is not None:
                    on_found(finding)
            shown = len(watch.findings)
    if made:
        run.findings = list(made[0][1].findings)
    if run.steps < steps:
        notes.append(f"the data set ended after {run.steps} batches: {run.steps} steps, not {steps}")
    run.notes = notes
    return run


def _batches(prep: engine.Prepared, args: tuple[Any, ...], kwargs: dict[str, Any], steps: int
             ) -> Iterator[tuple[int, tuple[Any, ...], dict[str, Any]]]:
    """The inputs of each step: the same batch every step, or the next batch of ``--data``."""
    if prep.data is None:
        for step in range(steps):
            yield step, args, kwargs
        return
    for index, _batch, batch_args, batch_kwargs in engine.data_batches(prep, args, kwargs):
        if index >= steps:
            return
        yield index, batch_args, batch_kwargs
