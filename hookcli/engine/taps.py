"""What the hooks record of each selected call's tensors: taps, the per-tensor events of a hook session.

A ``HookSession`` (``engine.session``) pairs each selected module's forward pre-hook and forward hook
into one call record and hands the call's tensors to the taps it was given, in their order:

- ``input``: the call's input tensors (positional, then keyword), in the forward pre-hook, before an
  in-place module changes them (a tap with ``all_inputs`` needs the keyword ones too: its modules are
  hooked one by one, never process-wide);
- ``output``: each output tensor of the call (any structure), with its entry (``OutputEntry``: path, shape,
  dtype, whether it is floating) where the tap writes what it measured, in the forward hook;
- ``step_begins``: a step of a hook set kept over a loop begins (``HookSet.begin_step``), and whether it
  is measured in ``full`` (a watch's logged step) or only statistics are (its flight recorder's others).

What a run records per tensor is one tap each: ``Statistics`` (the activation statistics), ``Gradients``
(the output gradients' statistics, through tensor hooks), ``InputGradients``, ``ChannelCounts``
(per-channel nonzero counts), ``Keep`` (the tensors themselves: features, fmaps, diff), ``Observe`` and
``ObserveInputs`` (a command measuring them on the device). A command or a watch picks the taps; the
session has no per-feature switch. ``engine.collectors.Collector`` is a tap too: a collector of a run
(``run_step``) may take the per-tensor events besides the run's phases.

Every event runs inside the model's forward or backward: what a tap raises is stored by the session
(``HookSession.failed``) and raised after the run, never into the model. Only the events a tap defines
(overrides) are called: a tap costs nothing on the events it leaves alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from hookcli.engine import distributed, reduction
from hookcli.engine.channels import ChannelDims, has_channels
from hookcli.engine.stats import is_float
from hookcli.errors import UnsupportedError

if TYPE_CHECKING:
    from hookcli.engine.session import HookSession, Call, OutputEntry

#: Called with (record name, call index, output path, tensor) for every selected output tensor.
TensorFn = Callable[[str, int, str, torch.Tensor], None]
#: A ``TensorFn`` that keeps tensors (features, fmaps): it gets them densified, never nested.
KeepFn = TensorFn


class Tap:
    """One thing the hooks record of each call's tensors (see the module's docstring); every event does
    nothing by default, and the session calls only the events a tap overrides."""

    #: ``input`` needs every input of a call, its keyword ones too (per-module hooks, never process-wide)
    all_inputs: bool = False

    def input(self, session: HookSession, call: Call, inputs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """The call's input tensors as (path, tensor), before its forward runs."""

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        """One output tensor of the call as the module returned it, and its entry in the call's record."""

    def step_begins(self, full: bool) -> None:
        """A step begins (between steps only); ``full``: everything is measured in it."""


def overrides(tap: Tap, event: str) -> bool:
    """Whether ``tap`` defines its own ``event`` (the session calls only those)."""
    return getattr(type(tap), event) is not getattr(Tap, event)


class Statistics(Tap):
    """Each floating output's activation statistics (``Reducer.reduce``; a DTensor: this rank's part)."""

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        if entry.floating and not tensor.is_meta:
            entry.stats = session.reducer.reduce(reducible(distributed.local(tensor)))


class Gradients(Tap):
    """Each floating output's gradient statistics, from a tensor hook as backward reaches it; ``zeros``:
    count the gradient's zeros too (a watch; the commands' gradient tables show none); ``keep``: called
    with (record name, call index, output path, gradient) as each arrives (``diff --grads``)."""

    def __init__(self, *, zeros: bool = False, keep: KeepFn | None = None) -> None:
        self.zeros, self.keep = zeros, keep

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        if entry.floating and tensor.requires_grad:
            entry.wants_grad = True
            session.hook_grad(tensor, self._hook(session, call, entry))

    def _hook(self, session: HookSession, call: Call, entry: OutputEntry) -> Callable[[torch.Tensor | None], None]:
        def hook(grad: torch.Tensor | None) -> None:
            if grad is None:  # no gradient reached it (an op without a backward, e.g. a quantized one)
                return
            try:
                entry.grad = session.reducer.reduce(reducible(distributed.local(grad)), zeros=self.zeros)
                if self.keep is not None:
                    self.keep(call.name, call.call, entry.path, grad)
            except Exception as exc:
                session.failed(exc, f"gradient hook on an output of {call.name or '(model)'}")
            session.last_grad_call = call

        return hook


class InputGradients(Tap):
    """The statistics of the gradient of each floating input of a call that requires grad
    (``grads --input-grads``, ``check``'s input probe)."""

    all_inputs = True

    def input(self, session: HookSession, call: Call, inputs: Sequence[tuple[str, torch.Tensor]]) -> None:
        call.input_grads = [None] * len(inputs)
        for position, (_, tensor) in enumerate(inputs):
            if tensor.requires_grad and is_float(tensor):
                session.hook_grad(tensor, self._hook(session, call, position))

    @staticmethod
    def _hook(session: HookSession, call: Call, position: int) -> Callable[[torch.Tensor | None], None]:
        def hook(grad: torch.Tensor | None) -> None:
            if grad is None or call.input_grads is None:
                return
            try:
                call.input_grads[position] = session.reducer.reduce(reducible(grad), zeros=False)
            except Exception as exc:
                session.failed(exc, f"gradient hook on an input of {call.name or '(model)'}")

        return hook


class ChannelCounts(Tap):
    """Each output's nonzero values per channel (the channel dimension as ``ChannelDims`` finds it), on
    the device, in every step measured in full (a watch's logged steps, not its flight recorder's others)."""

    def __init__(self, selection: Sequence[tuple[str, nn.Module]]) -> None:
        self.dims = ChannelDims(dict(selection))
        self.counting = True

    def step_begins(self, full: bool) -> None:
        self.counting = full

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        if self.counting and has_channels(tensor):
            part = distributed.local(tensor)  # a DTensor: this rank's part (engine.rank_stats sums the parts)
            entry.nonzeros = reduction.channel_counts([(part, self.dims(call.name, part))])[0]


class Observe(Tap):
    """``fn`` gets every selected output tensor as the module returned it (to measure it on the device:
    ``check``'s dead channels, a watch's channel peaks)."""

    def __init__(self, fn: TensorFn) -> None:
        self.fn = fn

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        self.fn(call.name, call.call, entry.path, tensor)


class ObserveInputs(Tap):
    """``fn`` gets each selected call's first input tensor: what a parent's forward hands a module (a
    residual stream) is no module's output."""

    def __init__(self, fn: TensorFn) -> None:
        self.fn = fn

    def input(self, session: HookSession, call: Call, inputs: Sequence[tuple[str, torch.Tensor]]) -> None:
        if inputs:
            self.fn(call.name, call.call, inputs[0][0], inputs[0][1])


class Keep(Tap):
    """``fn`` gets every selected output tensor to keep (features, fmaps, diff): a sparse one densified,
    a nested (ragged) one refused."""

    def __init__(self, fn: KeepFn) -> None:
        self.fn = fn

    def output(self, session: HookSession, call: Call, entry: OutputEntry, tensor: torch.Tensor) -> None:
        if tensor.is_nested:
            raise UnsupportedError(
                f"{call.name or '(model)'}{entry.path} returned a nested (ragged) tensor, which cannot be kept as one "
                "array", hint="select other modules with --layers (hookcli stats shows which return nested tensors)")
        self.fn(call.name, call.call, entry.path, tensor if tensor.layout == torch.strided else tensor.to_dense())


def reducible(t: torch.Tensor) -> torch.Tensor:
    """The real tensor whose statistics stand for ``t``: a complex tensor's magnitude ``|z|`` (its mean,
    spread and extremes of size; the L2 norm of ``|z|`` is that of ``z``), anything else as it is. The
    one place a complex tensor (an FNO's spectrum, a complex parameter and its gradient) is turned into
    something the reducers take; its record keeps its complex dtype, which marks the row."""
    return t.abs() if t.is_complex() else t
