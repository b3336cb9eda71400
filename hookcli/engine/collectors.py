"""What a run records beyond the hooked activations: collectors, called by the run loop at its phases.

``engine.run.run_step`` runs the phases (forward, the loss, backward or optimiser steps) under the hook
session's hooks; each ``Collector`` it is given sees them as events on one ``Step``:

- ``input`` / ``output``: a collector is a tap (``engine.taps``): the session hands it each selected call's
  input and output tensors, when it defines those events;
- ``begin``: the step begins, the hooks attached (it may enter contexts that last the run);
- ``forward`` / ``backward``: a context around each forward / ``torch.autograd.grad`` backward pass;
  ``forward_end`` gets the model's output, inside the forward context;
- ``optimiser_step``: with optimiser steps, after each ``loss.backward()``, before ``optimizer.step()``;
- ``ran``: every phase ran without the model raising (what the collector stored may raise now);
- ``end``: the step ends (also when the model raised);
- ``vectors`` then ``records``: the vectors it wants on the run's one host transfer, then their host
  values, to write into the step's ``RunResult``.

What a collector raises is hookcli's failure, never the model's: raised during the phases, the run's
blame finds it in hookcli's own code (InternalError: collectors live in ``hookcli/``); stored with
``Step.session.call`` (as the observer's calls are), it is raised once the model has run, and the
model's run goes on meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookcli.engine import distributed
from hookcli.engine.hooks import ParamReads, is_compiled
from hookcli.engine.session import HookSession, RunObserver, Call, OutputEntry, clipped_gradients, param_record
from hookcli.engine.taps import Tap, reducible
from hookcli.engine.stats import Vector, device_float
from hookcli.records import FailureInfo, LayerRecord, ParamRecord


@dataclass
class RunResult:
    """What one run gathered (``run_step``): plain data, read after the hooks are gone.

    ``layers``: one record per call of a selected module, also when the model raised (then ``failure``
    says where, ``cause`` is the exception). With a loss: ``loss`` is the loss function's second value,
    ``loss_value`` the loss, ``params`` the reported parameters' gradient statistics (``other_outputs``
    left for the caller), ``reached`` whether backward reached any parameter or input at all, and
    ``unreached`` the reported trainable parameters no gradient reached (name -> parameter).
    """

    layers: list[LayerRecord]
    failure: FailureInfo | None = None
    cause: BaseException | None = None
    flops: dict[str, Any] | None = None
    loss: Any = None
    loss_value: float | None = None
    params: list[ParamRecord] = field(default_factory=list)
    reached: bool = True
    unreached: dict[str, nn.Parameter] = field(default_factory=dict)
    #: With ``Merged``: each output tensor's (statistics, gradient) vectors (``HookSession.vectors``) and each
    #: of its parameters' gradient tensor (None where backward did not reach it), to merge over batches
    vectors: dict[tuple[str, int, str], tuple[Vector | None, Vector | None]] | None = None
    gradients: dict[str, torch.Tensor | None] | None = None


@dataclass
class Step:
    """One run of the loop as its collectors see it: the placed model, its selection and every named
    parameter, the attached hook session, the result being filled, and what the phases made."""

    model: nn.Module
    selection: Sequence[tuple[str, nn.Module]]
    #: every named parameter of the model (tied ones once)
    params: Sequence[tuple[str, nn.Parameter]]
    session: HookSession
    #: a loss is differentiated: gradients are enabled (``torch.autograd.grad``, or optimiser steps)
    training: bool
    result: RunResult = field(default_factory=lambda: RunResult([]))
    #: the last loss the phases computed (a device scalar) and what the loss function kept of it
    loss: torch.Tensor | None = None
    choice: Any = None
    #: ``torch.autograd.grad``'s gradients: leaf id -> gradient, None where backward did not reach it
    grads: dict[int, torch.Tensor | None] = field(default_factory=dict)
    #: the phase running now ("forward", then "backward" once the loss is made): where a failure is blamed
    phase: str = "forward"


class Collector(Tap):
    """One thing a run records, called at the run's events (see the module's docstring); every event
    does nothing by default. A collector holds one run's state: make a new one for each run."""

    def begin(self, step: Step, stack: ExitStack) -> None:
        """The step begins (hooks attached); contexts entered on ``stack`` last until its records are read."""

    def forward(self, step: Step) -> AbstractContextManager[Any]:
        """A context around each forward pass."""
        return nullcontext()

    def forward_end(self, step: Step, output: Any) -> None:
        """The model's output, right after forward (inside ``forward``'s context)."""

    def backward(self, step: Step) -> AbstractContextManager[Any]:
        """A context around each ``torch.autograd.grad`` backward pass."""
        return nullcontext()

    def optimiser_step(self, step: Step) -> None:
        """After each backward of optimiser steps, before ``optimizer.step()`` (under ``torch.no_grad``)."""

    def ran(self, step: Step) -> None:
        """Every phase ran and the model raised nothing: raise what the collector stored, if anything."""

    def end(self, step: Step) -> None:
        """The step ends (also when the model raised), before its records are read."""

    def vectors(self, step: Step) -> list[Vector]:
        """The vectors to bring to the host in the run's one transfer."""
        return []

    def records(self, step: Step, values: list[list[float]]) -> None:
        """``vectors``' host values (in order): write what they mean into ``step.result``."""


@contextlib.contextmanager
def entered(contexts: Iterator[AbstractContextManager[Any]]) -> Iterator[None]:
    """Every context of ``contexts`` entered in order for the block (left in reverse)."""
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


class LossValue(Collector):
    """The loss: the loss function's kept value (``RunResult.loss``) and the loss (``loss_value``)."""

    def vectors(self, step: Step) -> list[Vector]:
        return [step.loss.detach().reshape(1)] if step.loss is not None else []

    def records(self, step: Step, values: list[list[float]]) -> None:
        if step.loss is not None:
            step.result.loss, step.result.loss_value = step.choice, values[0][0]


class FlopCount(Collector):
    """FLOPs per selected call (forward, and backward with a loss; ``torch.utils.flop_counter``'s
    formulas; each called layer's ``flops``) and the run's total (``RunResult.flops``)."""

    def __init__(self) -> None:
        self.forward_counter: Any = None
        self.backward_counter: Any = None

    def begin(self, step: Step, stack: ExitStack) -> None:
        from hookcli.engine.flops import FlopCounter  # (imported only when counting: 0.15 s)

        self.forward_counter = FlopCounter(step.session.add_flops)
        self.backward_counter = FlopCounter() if step.training else None

    def forward(self, step: Step) -> AbstractContextManager[Any]:
        return self.forward_counter

    def backward(self, step: Step) -> AbstractContextManager[Any]:
        return self.backward_counter or nullcontext()

    def ran(self, step: Step) -> None:
        for counter in (self.forward_counter, self.backward_counter):
            if counter is not None:
                counter.raise_error()

    def records(self, step: Step, values: list[list[float]]) -> None:
        per_call = {(call.name, call.call): call.flops for call in step.session.calls}
        for layer in step.result.layers:
            if layer.called:
                layer.flops = per_call.get((layer.name, layer.call))
        forward, backward = self.forward_counter, self.backward_counter
        if backward is None:
            step.result.flops = forward.summary()
            return
        step.result.flops = forward.summary(backward=backward.total)
        step.result.flops["partial"] = forward.partial or backward.partial
        step.result.flops["missing_ops"] = sorted(forward.missing | backward.missing)


class ParamStats(Collector):
    """The gradient statistics and norm of each of ``params`` (of the placed model; ``RunResult.params``,
    with ``unreached``), and with ``clip`` every parameter gradient clamped to [-clip, clip] by tensor
    hooks (``clipped_gradients``), each parameter's clipped count in its record."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], clip: float | None = None) -> None:
        self.params, self.clip = list(params), clip
        self.clipped: dict[str, torch.Tensor] = {}
        self.slots: list[tuple[str, nn.Parameter, int | None, int, int | None]] = []

    def begin(self, step: Step, stack: ExitStack) -> None:
        self.clipped = stack.enter_context(clipped_gradients(step.params if step.training else [], self.clip))

    def vectors(self, step: Step) -> list[Vector]:
        out: list[Vector] = []
        for name, p in self.params:
            g = step.grads.get(id(p))
            g_slot = None
            if g is not None:  # a DTensor's: this rank's part (merged over the ranks by the caller)
                out.append(step.session.reducer.reduce(reducible(distributed.local(g)), zeros=False))
                g_slot = len(out) - 1
            out.append(torch.linalg.vector_norm(reducible(distributed.local(p.detach())), dtype=device_float(p.device))
                       .reshape(1))
            n_slot = len(out) - 1
            c_slot = None
            if name in self.clipped:
                out.append(self.clipped[name].reshape(1))
                c_slot = len(out) - 1
            self.slots.append((name, p, g_slot, n_slot, c_slot))
        return out

    def records(self, step: Step, values: list[list[float]]) -> None:
        result = step.result
        for name, p, g_slot, n_slot, c_slot in self.slots:
            result.params.append(param_record(
                name, p, values[n_slot][0], values[g_slot] if g_slot is not None else None,
                clipped=int(values[c_slot][0]) if c_slot is not None
                else (0 if self.clip and p.requires_grad else None),
            ))
            if result.failure is None and p.requires_grad and g_slot is None:
                result.unreached[name] = p


class Observed(Collector):
    """A command's ``RunObserver`` (``check``): every selected output or first input when it wants them,
    the model's output, the completion order; and (``wants_param_reads``, with a loss, not compiled)
    which trainable parameters forward read: a reported parameter (``ParamStats``, before this one)
    no gradient reached and forward never read is marked ``unused``."""

    def __init__(self, observer: RunObserver) -> None:
        self.observer = observer
        self.reads: ParamReads | None = None

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        if self.observer.wants_tensors:
            self.observer.tensor(call.name, call.call, entry.path, tensor)

    def input(self, session: HookSession, call: Call, inputs: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.observer.wants_inputs and inputs:
            self.observer.input(call.name, call.call, inputs[0][0], inputs[0][1])

    def begin(self, step: Step, stack: ExitStack) -> None:
        if step.training and self.observer.wants_param_reads and not is_compiled(step.model, step.selection):
            self.reads = ParamReads([p for _, p in step.params if p.requires_grad])

    def forward(self, step: Step) -> AbstractContextManager[Any]:
        return self.reads or nullcontext()

    def forward_end(self, step: Step, output: Any) -> None:
        step.session.call(self.observer.output, output, where="observer of the model output")

    def end(self, step: Step) -> None:
        self.observer.finished(step.session.completion_order())

    def records(self, step: Step, values: list[list[float]]) -> None:
        if self.reads is None:
            return
        for record in step.result.params:
            p = step.result.unreached.get(record.name)
            if p is not None and id(p) not in self.reads.read:
                record.unused = True


class Merged(Collector):
    """What a run over many batches (or ranks) merges: each output tensor's statistics and gradient
    vectors (``RunResult.vectors``) and each of ``params``' gradient tensor (``RunResult.gradients``)."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]] = ()) -> None:
        self.params = list(params)

    def end(self, step: Step) -> None:
        step.result.vectors = step.session.vectors()
        step.result.gradients = {name: step.grads.get(id(p)) for name, p in self.params}
