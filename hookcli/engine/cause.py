"""Where a step's first NaN/Inf was made (docs/watch.md#where-a-naninf-was-made).

On a measured step (a logged one, or every step with the flight recorder) every module call of the
model, containers included, notes one device-side flag per event, in the order the events happen:
its inputs hold a non-finite value (``IN``, at its forward pre-hook), its output does (``OUT``, at its
forward hook); in backward, the gradient with respect to its output (``GRAD_OUT``) and to its inputs
(``GRAD_IN``, tensor hooks on non-leaf tensors). The flags stay on the device (no host
synchronisation); they are read only for a step known to hold a NaN/Inf, and ``locate`` names the
earliest event that was not finite:

- a call's ``OUT`` (its inputs were finite, and so were its children's outputs, which came before):
  the call made it, by its own code: ``made by lin`` for a module without children, ``made in
  block's own forward (after block.act)`` for one with;
- a call's ``IN`` (the value was finite as every earlier module returned it): made between modules,
  in the parent's own forward, between the sibling that returned last and this call;
- in backward, the last of the events that one tensor's gradient fires at once (hooks fire in
  registration order: a parent's before its child's on an input, a producer's output before its
  consumer's input): ``GRAD_IN`` of a call: its backward made it; ``GRAD_OUT``: the code after it in
  its parent's forward (for the model itself: the loss).
"""

from __future__ import annotations

from collections.abc import Callable
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookcli.engine.hooks import hook_calls, hook_tensor
from hookcli.engine.stats import iter_tensors, to_host
from hookcli.records import NonfiniteCause, WatchStep

IN, OUT, GRAD_OUT, GRAD_IN = range(4)

#: -1 unless autograd's engine runs a backward pass in this thread (a checkpoint's recomputation)
_graph_task_id = torch._C._current_graph_task_id


def _floats(value: Any) -> list[torch.Tensor]:
    if type(value) is torch.Tensor:
        found = [value]
    else:
        found = [t for _, t in iter_tensors(value)]
    return [t for t in found if t.is_floating_point() and t.layout == torch.strided and not t.is_meta
            and not t.is_nested and type(t) is torch.Tensor and t.numel()]


class CauseTrace:
    """One step's module calls (name, parent call or -1) and events (kind, call, group); each group of
    events shares one tensor's extremes (``torch.aminmax``: one pass, NaN propagates) on its device;
    ``seal`` turns them into one flag vector per device and dtype (non-finite: 1)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.events: list[tuple[int, int, int]] = []
        self._extremes: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (events, min, max)
        self.stacked: list[tuple[torch.Tensor, list[list[int]]]] = []
        #: the tensors seen in this step's forward, by id: (a weak reference, its version, its events'
        #: group); a tensor seen again unchanged adds no event (an earlier one told its values)
        self.seen: dict[int, tuple[Any, int, list[tuple[int, int]]]] = {}

    def add(self, group: list[tuple[int, int]], key: int, tensor: torch.Tensor) -> None:
        """Events (kind, call) for the values of ``tensor``: one ``aminmax`` of it, no synchronisation."""
        with torch.no_grad():  # nothing for autograd to record (a checkpoint counts what forward saves)
            low, high = torch.aminmax(tensor.detach())
        first = len(self.events)
        self.events.extend((kind, call, key) for kind, call in group)
        self._extremes.append((list(range(first, len(self.events))), low, high))

    def seal(self) -> None:
        """The step's extremes stacked per device and dtype, as flags (a few ops a step, not one an event)."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, (_, low, _) in enumerate(self._extremes):
            by_kind.setdefault((low.device, low.dtype), []).append(index)
        with torch.no_grad():
            for where in by_kind.values():
                values = torch.stack([self._extremes[i][1] for i in where] + [self._extremes[i][2] for i in where])
                flags = torch.isfinite(values).view(2, -1).all(0).logical_not().to(torch.float32)
                self.stacked.append((flags, [self._extremes[i][0] for i in where]))
        self._extremes, self.seen = [], {}

    def vectors(self) -> list[torch.Tensor]:
        """The flags, for a host transfer (``to_host``, ``Transfer.slot``)."""
        return [flags for flags, _ in self.stacked]

    def cause(self, values: list[list[float]] | None = None) -> NonfiniteCause | None:
        """Where the step's first NaN/Inf was made, from the host values of ``vectors()`` (read here,
        one transfer, when not given); None when every flag is finite."""
        if values is None:
            values = to_host(self.vectors()) if self.stacked else []
        bad = [False] * len(self.events)
        for (_, groups), row in zip(self.stacked, values):
            for events, value in zip(groups, row):
                for index in events:
                    bad[index] = value != 0
        return locate(self.calls, self.events, bad)


def _name(name: str) -> str:
    return name or "(model)"


def locate(calls: list[tuple[str, int]], events: list[tuple[int, int, int]], bad: list[bool]
           ) -> NonfiniteCause | None:
    """The cause the earliest non-finite event names (module docstring)."""
    first = next((i for i, b in enumerate(bad) if b), None)
    if first is None:
        return None
    kind, call, key = events[first]
    if kind in (GRAD_OUT, GRAD_IN):  # the hooks of one tensor's gradient fire together: the last decides
        while first + 1 < len(events) and events[first + 1][0] in (GRAD_OUT, GRAD_IN) and events[first + 1][2] == key:
            first += 1
        kind, call, _ = events[first]
    name, parent = calls[call]
    children = [c for c, (_, p) in enumerate(calls) if p == call]
    if kind == OUT:
        if not children:
            return NonfiniteCause(name, "forward", f"made by {_name(name)}")
        last = calls[children[-1]][0]
        return NonfiniteCause(name, "forward", f"made in {_name(name)}'s own forward (after {_name(last)})")
    if kind == IN:
        if parent < 0:
            return NonfiniteCause(None, "forward", "already in the model's input")
        before = [c for c, (_, p) in enumerate(calls) if p == parent and c < call]
        where = f"between {_name(calls[before[-1]][0])} and {_name(name)}" if before else f"before {_name(name)}"
        return NonfiniteCause(calls[parent][0], "forward",
                              f"made in {_name(calls[parent][0])}'s own forward ({where})")
    if kind == GRAD_IN:
        own = f"made in {_name(name)}'s own backward" if children else f"made by {_name(name)}'s backward"
        return NonfiniteCause(name, "backward", f"{own} (the gradient of its input)")
    if parent < 0:
        return NonfiniteCause(None, "backward", "made in the loss's backward (the gradient of the model's output)")
    return NonfiniteCause(calls[parent][0], "backward", f"made in {_name(calls[parent][0])}'s own backward "
                                                        f"(the gradient of {_name(name)}'s output)")


def compiled_cause(record: WatchStep) -> NonfiniteCause | None:
    """Under ``torch.compile`` (no ``CauseTracer``: its hooks on every module would break the graph at
    each), what the selected outputs of ``record`` tell of its first forward NaN/Inf without blaming
    the module that first holds it: that module made it, or code that ran before it (between modules,
    in a parent's forward, or the batch); the outputs before it in execution order were finite. None
    when every output is."""
    bad = [bool(layer.stats and (layer.stats.get("nan_count") or layer.stats.get("inf_count")))
           for layer in record.layers]
    if True not in bad:
        return None
    first = bad.index(True)
    name = _name(record.layers[first].name + record.layers[first].output)
    before = (f" (every output before it is finite, the last {_name(record.layers[first - 1].name)}'s)"
              if first else " (the first selected output)")
    return NonfiniteCause(None, "forward", f"not traced under torch.compile: made by {name} or by code that ran "
                                           f"before it{before}")


class CauseTracer:
    """Hooks on every module of ``model`` (containers included) while ``armed``: each call's events go
    into ``trace``. Installed only for measured steps (``arm``): an unlogged step without the flight
    recorder has none of these hooks. What its hooks raise is kept in ``error`` (never raised into
    the model); a step whose tracing failed has no trace."""

    def __init__(self, model: nn.Module, skip: Callable[[], bool]) -> None:
        self.names: dict[int, str] = {}
        for name, module in model.named_modules():
            self.names.setdefault(id(module), name)
        self.modules = [m for _, m in model.named_modules()]
        self.skip = skip  # a validation forward: not traced (as the session's hooks)
        self.trace: CauseTrace | None = None
        self.error: Exception | None = None
        self._stack: list[int] = []
        self._handles: list[RemovableHandle] = []

    def arm(self, on: bool) -> None:
        """A step begins: trace it (``on``) or not; the hooks are installed or removed accordingly."""
        self.trace, self._stack = (CauseTrace() if on else None), []
        if on and not self._handles:
            self._handles = hook_calls(self.modules, self._pre, self._post)
        elif not on:
            self.remove()

    def take(self) -> CauseTrace | None:
        """The step's trace, sealed (None when the step was not traced or tracing failed)."""
        trace, self.trace = self.trace, None
        if trace is None or self.error is not None:
            self.error = None
            return None
        trace.seal()
        return trace

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        trace = self.trace
        if trace is None or _graph_task_id() != -1 or self.skip():
            return
        try:
            index = len(trace.calls)
            trace.calls.append((self.names.get(id(module), "?"), self._stack[-1] if self._stack else -1))
            self._stack.append(index)
            for t in _floats(args) + (_floats(kwargs) if kwargs else []):
                self._note(trace, IN, GRAD_IN, index, t)
        except Exception as exc:  # hookcli's failure: the step has no trace, the model runs on
            self.error = self.error or exc

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any = None) -> None:
        trace = self.trace
        if trace is None or _graph_task_id() != -1 or self.skip() or not self._stack:
            return
        try:
            index = self._stack.pop()
            for t in _floats(output):
                self._note(trace, OUT, GRAD_OUT, index, t)
        except Exception as exc:
            self.error = self.error or exc

    def _note(self, trace: CauseTrace, kind: int, grad_kind: int, index: int, t: torch.Tensor) -> None:
        """A forward event for ``t`` (unless the step saw it already, unchanged), and its gradient's
        event in backward: one hook per tensor, whose group lists every call that saw it, in order."""
        try:
            version = t._version
        except RuntimeError:  # an inference tensor: no version counter, seen anew each time
            version = -1
        seen = trace.seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == version and version >= 0:
            seen[2].append((grad_kind, index))
            return
        trace.add([(kind, index)], 0, t)
        group = [(grad_kind, index)]
        trace.seen[id(t)] = (weakref.ref(t), version, group)
        if t.requires_grad and t.grad_fn is not None:  # not a leaf: its hook goes with the graph
            key = len(trace.events)

            def hook(grad: torch.Tensor) -> None:
                if grad is None or self.trace is not trace or not grad.numel():
                    return
                try:
                    trace.add(group, key, grad)
                except Exception as exc:
                    self.error = self.error or exc

            hook_tensor(t, hook)
