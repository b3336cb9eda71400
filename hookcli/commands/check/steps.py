"""``check --steps N``: N optimiser steps on a copy of the model, measured for the training rules.

The user's model is never stepped: each run trains a fresh ``copy.deepcopy`` through the engine's run
loop (``OptimiserSteps``, no hooks), seeded with ``--seed`` like every run (``engine.running``: the
caller's RNG states are restored after), on the same fixed batch (the dummy input, the files, or the
first batch of ``--data``). The optimiser is yours when given (``optimizer=``: an optimiser of your
model, remade over the copy's parameters with the same groups and settings, or a factory
``params -> Optimizer``), else Adam at the learning rate of ``overfit_batch.lrs`` whose 5-step run
(``SWEEP_STEPS``) reaches the lowest loss (ties: the smaller rate). The loss is yours when given
(``loss_fn(output, *args, **kwargs)``), else the one ``grads`` picks (``build_loss``). Then:

- the loss before each step (``init_loss`` reads the first, ``overfit_batch`` all);
- each parameter's gradients and change over the N steps (``params_update``);
- a second run seeded alike, compared step by step (``determinism``): the sweep's run at the chosen
  rate (or, with your optimiser, a 5-step run); when they differ, two seeded forward passes name the
  first module whose output differs.

Everything measured is handed to the rules as plain values (``rules.Training``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from hookcli.commands.check.between import StepWatch, fresh_losses
from hookcli.commands.check.rules import ParamTrace, Training
from hookcli.commands.check.schema import MAX_STEPS, SPEC, CheckRules
from hookcli.engine import run as engine
from hookcli.engine.losses import LOSS_NAMES, build_loss, pick_output
from hookcli.engine.collectors import Observed
from hookcli.engine.session import CompletionOrder, RunObserver, widened
from hookcli.engine.state import copy_model
from hookcli.engine.stats import to_host
from hookcli.errors import HookcliError, InternalError, UnsupportedError, UsageError, describe_exception, exit_status
from hookcli.options import Loss

#: Steps of each learning rate of the sweep (and of the determinism run with your optimiser).
SWEEP_STEPS = 5
OPTIMIZER_HINT = ("give optimizer=torch.optim.Adam(model.parameters(), lr=1e-3) (an optimiser of the model you pass) "
                  "or a factory, e.g. optimizer=lambda params: torch.optim.SGD(params, lr=0.1)")


@dataclass
class StepOptions:
    """``check``'s training run: ``steps`` optimiser steps (0: none, the one-step check), with your
    ``optimizer`` and ``loss_fn`` where given."""

    steps: int = 0
    optimizer: Any = None
    loss_fn: Callable[..., torch.Tensor] | None = None


def step_options(steps: Any = 0, optimizer: Any = None, loss_fn: Any = None) -> StepOptions:
    """Validated ``StepOptions``; UsageError (exit 2) for a bad count, an optimiser that is not one,
    a loss that is not callable, or either without steps."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_STEPS:
        raise UsageError(f"--steps must be an integer from 0 to {MAX_STEPS}, got {steps!r}",
                         hint="--steps 30 trains a copy of the model for 30 steps; 0 (the default) is the one-step check")
    if optimizer is not None and not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise UsageError(f"optimizer must be a torch.optim.Optimizer or a callable params -> Optimizer, got "
                         f"{type(optimizer).__name__}", hint=OPTIMIZER_HINT)
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn must be callable (output, *inputs) -> scalar tensor, got {type(loss_fn).__name__}",
                         hint="e.g. loss_fn=lambda out, x: out.pow(2).mean()")
    if steps == 0 and (optimizer is not None or loss_fn is not None):
        raise UsageError("optimizer and loss_fn are used by the training run of steps=N (N > 0)",
                         hint="e.g. hookcli.check(model, steps=30, optimizer=opt)")
    return StepOptions(steps, optimizer, loss_fn)


def _copy(model: nn.Module) -> nn.Module:
    try:
        clone = copy_model(model)
    except Exception as exc:  # noqa: BLE001 - any failure to copy
        raise _no_copy(describe_exception(exc)) from exc
    if type(clone) is not type(model):
        raise _no_copy(f"copy.deepcopy gave a {type(clone).__name__}, not a {type(model).__name__}")
    return clone


def _no_copy(why: str) -> UnsupportedError:
    return UnsupportedError(f"check --steps trains a copy of the model (so that yours is never modified), and the "
                            f"model cannot be deep-copied: {why}",
                            hint="make the model copyable with copy.deepcopy, or run check without --steps")


class _Optimiser:
    """Makes the optimiser of one run over a copy's parameters: yours (remade, same groups and
    settings; or your factory's), or Adam at ``lr``."""

    def __init__(self, given: Any, model: nn.Module) -> None:
        self.given = given
        #: id of a parameter of your model -> its name (to remake your optimiser's groups on a copy)
        self.names = {id(p): n for n, p in model.named_parameters()}

    def describe(self, lr: float | None) -> str:
        if self.given is None:
            return f"Adam, lr {lr:g}"
        kind = type(self.given).__name__ if isinstance(self.given, torch.optim.Optimizer) else getattr(
            self.given, "__name__", type(self.given).__name__)
        return f"your optimiser ({kind})"

    def make(self, clone: nn.Module, lr: float | None) -> Callable[[], torch.optim.Optimizer]:
        params = dict(clone.named_parameters())
        given = self.given

        def build() -> torch.optim.Optimizer:
            if given is None:
                return torch.optim.Adam([p for p in params.values() if p.requires_grad], lr=lr or 1e-3)
            if isinstance(given, torch.optim.Optimizer):
                groups = []
                for group in given.param_groups:
                    names = [self.names.get(id(p)) for p in group["params"]]
                    if any(n is None for n in names):
                        raise UsageError("optimizer holds parameters that are not the model's",
                                         hint="give an optimiser of the model you check, or a factory params -> Optimizer")
                    groups.append({**{k: v for k, v in group.items() if k != "params"},
                                   "params": [params[n] for n in names]})
                try:
                    return type(given)(groups, **given.defaults)
                except TypeError:
                    try:
                        return type(given)(groups)
                    except Exception as exc:  # noqa: BLE001 - a custom optimiser's constructor
                        raise UsageError(f"cannot remake your {type(given).__name__} over a copy of the model: "
                                         f"{describe_exception(exc)}", hint=OPTIMIZER_HINT) from None
            try:
                made = given([p for p in params.values() if p.requires_grad])
            except HookcliError:
                raise
            except Exception as exc:  # noqa: BLE001 - the user's factory
                raise UsageError(f"optimizer(params) raised {describe_exception(exc)}", hint=OPTIMIZER_HINT) from None
            if not isinstance(made, torch.optim.Optimizer):
                raise UsageError(f"optimizer(params) returned a {type(made).__name__}, not a torch.optim.Optimizer",
                                 hint=OPTIMIZER_HINT)
            return made

        return build


@dataclass
class _Run:
    losses: list[float]
    params: dict[str, ParamTrace]
    error: str | None = None
    where: str | None = None
    between: dict[str, Any] | None = None


class _ParamTracker:
    """What a training run measures of each parameter of its copy: the steps with a gradient, the
    largest |gradient|, whether its values went NaN/Inf before its gradient did (the update did it),
    and its largest change over the run; device flags and maxima, on the host once (``finished``)."""

    def __init__(self, clone: nn.Module, watcher: StepWatch | None) -> None:
        self.watcher = watcher
        self.named = list(clone.named_parameters())
        self.before = [p.detach().clone() for _, p in self.named]
        self.gmax: dict[str, torch.Tensor] = {}
        #: the values were NaN/Inf at a backward before any gradient of theirs was (the update did it)
        self.values_first: dict[str, torch.Tensor] = {}
        self.grad_bad: dict[str, torch.Tensor] = {}
        self.grad_steps = {n: 0 for n, _ in self.named}
        self.host: list[list[float]] = []

    def after_backward(self) -> None:
        if self.watcher is not None:
            self.watcher.gradients()
        gmax, values_first, grad_bad = self.gmax, self.values_first, self.grad_bad
        for n, p in self.named:
            if p.grad is not None:
                self.grad_steps[n] += 1
                g = p.grad.detach().abs().max().float() if p.grad.numel() else torch.zeros(())
                gmax[n] = torch.maximum(gmax[n], g) if n in gmax else g
                with torch.no_grad():  # device flags: no host synchronisation per step
                    earlier = grad_bad.get(n, torch.zeros((), dtype=torch.bool, device=g.device))
                    values = ~torch.isfinite(p.detach()).all() if p.numel() else torch.zeros_like(earlier)
                    values_first[n] = values_first.get(n, torch.zeros_like(earlier)) | (values & ~earlier)
                    grad_bad[n] = earlier | ~torch.isfinite(g)

    def finished(self) -> None:
        with torch.no_grad():
            deltas = [(widened(p.detach()) - widened(b)).abs().max().reshape(1) if p.numel() else torch.zeros(1)
                      for (_, p), b in zip(self.named, self.before)]
        self.host.extend(to_host(deltas + [self.gmax[n].reshape(1) for n in self.gmax]
                                 + [self.values_first[n].float().reshape(1) for n in self.values_first]))

    def traces(self, made: list[torch.optim.Optimizer]) -> dict[str, ParamTrace]:
        """Each parameter's ``ParamTrace`` (``made``: the optimisers the run built; the first one's
        parameters are the ones it trains)."""
        named, gmax, host = self.named, self.gmax, self.host
        in_opt = {id(p) for group in made[0].param_groups for p in group["params"]} if made else set()
        changes = host[:len(named)]
        maxima = dict(zip(gmax, (v[0] for v in host[len(named):len(named) + len(gmax)])))
        overflowed = {n for n, v in zip(self.values_first, host[len(named) + len(gmax):]) if v[0]}
        return {n: ParamTrace(p.requires_grad, id(p) in in_opt, self.grad_steps[n], maxima.get(n, 0.0), c[0],
                              str(p.dtype).removeprefix("torch."), n in overflowed)
                for (n, p), c in zip(named, changes)}


class _Trainer:
    """Runs of ``count`` steps on fresh copies, the first one also telling the task (``init_loss``)."""

    def __init__(self, prep: engine.Prepared, given: StepOptions) -> None:
        self.prep, self.given = prep, given
        self.optimiser = _Optimiser(given.optimizer, prep.loaded.model)
        self.task: tuple[str | None, float | None, str | None, bool, list[int] | None] | None = None
        self.trained: nn.Module | None = None

    def prepared(self, clone: nn.Module, *, hooked: bool = False) -> engine.Prepared:
        modules = dict(clone.named_modules(remove_duplicate=False))
        selection = [(name, modules[name]) for name, _ in self.prep.selection if name in modules] if hooked else []
        return replace(self.prep, loaded=replace(self.prep.loaded, model=clone), selection=selection)

    def _learn_task(self, output: Any, choice: Any) -> None:
        opts = self.prep.options
        if self.given.loss_fn is not None:
            self.task = (None, None, "the loss is yours (loss_fn): hookcli does not know its chance level", False, None)
            return
        if choice.kind != LOSS_NAMES[Loss.ce]:
            why = {"model_loss": "the model computes its own loss"}.get(
                choice.kind, f"the loss is {choice.kind}, not a cross-entropy over class logits")
            self.task = (None, None, why, False, None)
            return
        _, out = pick_output(output, opts.output_key, skip_loss=Loss(opts.loss) != Loss.auto)
        dim = out.dim() - 1 if out.dim() == 3 else 1
        classes = int(out.shape[dim])
        task = (f"per-token cross-entropy over {classes} tokens ({choice.targets})" if out.dim() == 3
                else f"{classes}-class cross-entropy")
        x = out.detach().float()
        probabilities = bool(x.numel() and (x >= 0).all() and torch.allclose(x.sum(dim), torch.ones(()), atol=1e-3))
        self.task = (task, math.log(classes) if classes > 1 else None,
                     None if classes > 1 else "one class: no chance level", probabilities, list(out.shape))

    def _step_loss(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module
                   ) -> torch.Tensor:
        """The loss of one training step: yours (``loss_fn``, checked to be a scalar float tensor) or
        ``build_loss``'s; the first one also tells the task (``_learn_task``)."""
        opts = self.prep.options
        if self.given.loss_fn is not None:
            value = self.given.loss_fn(output, *args, **kwargs)
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
                raise UsageError(f"loss_fn must return a scalar float tensor, got "
                                 f"{type(value).__name__}{list(value.shape) if isinstance(value, torch.Tensor) else ''}",
                                 hint="e.g. loss_fn=lambda out, x: out.pow(2).mean()")
            value = value.reshape(())
            if self.task is None:
                self._learn_task(output, None)
            return value
        choice = build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key,
                            inputs=(args, kwargs), model=model, seed=opts.seed)
        if self.task is None:
            self._learn_task(output, choice)
        return choice.value

    def run(self, count: int, lr: float | None, watch: bool = False) -> _Run:
        clone = _copy(self.prep.loaded.model)
        watcher = StepWatch(clone) if watch else None
        self.trained = clone
        tracker = _ParamTracker(clone, watcher)
        made: list[torch.optim.Optimizer] = []
        build = self.optimiser.make(clone, lr)
        losses: list[torch.Tensor] = []

        def optimizer() -> torch.optim.Optimizer:
            made.append(build())
            return made[-1]

        def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module) -> tuple[torch.Tensor, None]:
            value = self._step_loss(output, args, kwargs, model)
            losses.append(value.detach().float().reshape(1))
            return value, None

        plan = engine.OptimiserSteps(optimizer, count, tracker.after_backward, tracker.finished)
        try:
            prepared = self.prepared(clone)
            if watcher is not None:
                prepared = replace(prepared, selection=watcher.selection)
            result = engine.run_model(prepared, [], engine.RunPlan(
                loss=loss, steps=plan, collectors=[Observed(watcher)] if watcher is not None else [], show_phase=False))
        except UsageError:
            raise
        except HookcliError as exc:
            cause = exc.__cause__ if isinstance(exc, InternalError) and isinstance(exc.__cause__, Exception) else exc
            return _Run([], {}, f"the training run on a copy raised {describe_exception(cause)}")
        if isinstance(result.cause, SystemExit):
            return _Run([], {}, f"the model exited with {exit_status(result.cause.code)} in the training run")
        if result.cause is not None:
            where = result.failure.module if result.failure is not None else None
            return _Run([], {}, f"the training run on a copy raised {describe_exception(result.cause)}"
                        + (f" in {where}" if where else ""), where)
        return _Run([row[0] for row in to_host(losses)] if losses else [], tracker.traces(made),
                    between=watcher.host() if watcher is not None else None)

    def first_difference(self) -> str | None:
        """The first selected module (completion order) whose output differs between two forward
        passes of fresh copies seeded alike, or None when they agree."""
        sums = []
        for _ in range(2):
            watch = _Checksums()
            engine.run_model(self.prepared(_copy(self.prep.loaded.model), hooked=True), [],
                             engine.RunPlan(collectors=[Observed(watch)], show_phase=False))
            sums.append(watch.host())
        a, b = sums
        for key in sorted(a, key=lambda k: a[k][0]):
            if key in b and a[key][1] != b[key][1]:
                name, call = key
                return (name or "(model)") + (f"#{call}" if call else "")
        return None


class _Checksums(RunObserver):
    """Sum and absolute sum of each selected output, per call, and the order calls finish."""

    wants_tensors = True

    def __init__(self) -> None:
        self.sums: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.order: CompletionOrder = {}

    def tensor(self, name: str, call: int, path: str, t: torch.Tensor) -> None:
        if t.is_floating_point() and t.layout == torch.strided and not t.is_nested and t.device.type != "meta":
            x = t.detach().double()
            self.sums.setdefault((name, call), []).extend([x.sum().reshape(1), x.abs().sum().reshape(1)])

    def finished(self, order: CompletionOrder) -> None:
        self.order = order

    def host(self) -> dict[tuple[str, int], tuple[int, list[float]]]:
        keys = list(self.sums)
        values = to_host([torch.cat(self.sums[k]) for k in keys]) if keys else []
        return {k: (self.order.get(k, len(self.order)), list(v)) for k, v in zip(keys, values)}


def _producer(report: Any, order: dict[tuple[str, int], int], shape: list[int] | None) -> str | None:
    """The module whose output is the model output the loss reads: the last to finish with its shape."""
    if shape is None:
        return None
    rows = [r for r in report.layers if r.name and r.called and r.shape == shape]
    if not rows:
        return None
    last = max(rows, key=lambda r: order.get((r.name, r.call), -1))
    return last.label


def _failed(n: int, described: str, run: _Run, rules: CheckRules) -> Training:
    """The training run failed: the first enabled training rule reports it, the others SKIP."""
    first = next((r.name for r in rules.enabled() if SPEC[r.name].needs_steps), None)
    return Training(n, described, error=run.error, error_where=run.where, error_rule=first)


def train(prep: engine.Prepared, rules: CheckRules, given: StepOptions, report: Any,
          order: dict[tuple[str, int], int]) -> Training:
    """The training run of ``check --steps N`` and what the training rules read."""
    n = given.steps
    if given.optimizer is None and not any(p.requires_grad for p in prep.loaded.model.parameters()):
        return Training(n, "Adam", skip="no trainable parameter: nothing to train")
    trainer = _Trainer(prep, given)
    k = min(n, SWEEP_STEPS)
    sweep: list[tuple[float, float]] = []
    repeat: _Run | None = None
    lr: float | None = None
    if given.optimizer is None:
        runs = []
        for candidate in rules.rules["overfit_batch"]["lrs"]:
            run = trainer.run(k, candidate)
            if run.error is not None:
                return _failed(n, trainer.optimiser.describe(candidate), run, rules)
            finite = [x for x in run.losses if math.isfinite(x)]
            best = min(finite) if finite else math.inf
            sweep.append((candidate, best))
            runs.append((best, candidate, run))
        best, lr, repeat = min(runs, key=lambda r: (r[0], r[1]))
        described = (f"Adam, lr {lr:g} (lowest loss of a {k}-step sweep over "
                     f"{', '.join(f'{c:g}' for c, _ in sweep)})" if len(sweep) > 1 else f"Adam, lr {lr:g}")
    else:
        described = trainer.optimiser.describe(None)
    main = trainer.run(n, lr, watch=True)
    trained = trainer.trained
    if main.error is not None:
        return _failed(n, described, main, rules)
    if repeat is None:
        repeat = trainer.run(k, lr)
        if repeat.error is not None:
            return _failed(n, described, repeat, rules)
    task, chance, no_task, probabilities, shape = trainer.task or (None, None, "the loss never ran", False, None)
    training = Training(n, described, losses=main.losses, sweep=sweep, repeat=repeat.losses[:k], task=task,
                        chance=chance, no_task=no_task, probabilities=probabilities,
                        producer=_producer(report, order, shape), params=main.params, between=main.between)
    leak = rules.get("target_leak")
    if leak is not None and training.between is not None and trained is not None:
        training.between["leak"] = ({"skip": "the loss is yours (loss_fn): hookcli does not know its targets"}
                                    if given.loss_fn is not None else fresh_losses(prep, trained, leak["batches"]))
    if main.losses[:k] != training.repeat and rules.get("determinism") is not None:
        training.differs = trainer.first_difference()
    return training
