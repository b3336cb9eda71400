"""The hook engine's recording of one run: what the forward pre-hooks and forward hooks on the selected
modules do with every call (``engine.hooks`` puts them on the model and takes them off).

Rules (docs/how-it-works.md): a pre-hook sees the inputs before an in-place module changes them; an
``always_call`` forward hook sees the outputs and still fires when forward raises; one record per
call, in execution order; every tensor of any output structure; statistics reduced on the device;
gradients through tensor hooks registered on output (and input) tensors, never module backward hooks
(they break on in-place ops).
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookcli.errors import HookcliError, internal_error
from hookcli.records import LayerRecord, ParamRecord
from hookcli.engine.stats import (
    activation_stats,
    dtype_name,
    gradient_stats,
    iter_tensors,
    Reducer,
    Transfer,
    Vector,
    shape_of,
)
from hookcli.engine import distributed
from hookcli.engine.selection import module_depth
from hookcli.engine.taps import Tap, overrides

#: (module name, call index) -> position of that call in the order in which calls *finished*.
CompletionOrder = dict[tuple[str, int], int]


class RunObserver:
    """What a command measures during one run beyond the report (``check``: completion order, dead
    channels, the model's output), without hooks of its own: the engine calls it.

    ``tensor`` is called from the session's forward hook with every selected output tensor (only
    when ``wants_tensors``: commands that do not need it pay nothing per call), ``output`` by the
    run with the model's output right after forward, ``finished`` after the run (also when the
    model raised) with the session's completion order. What they raise is hookcli's failure:
    stored during the run, InternalError after it, never raised into the model.
    """

    wants_tensors: bool = False
    #: Whether the run notes which trainable parameters the forward reads (``ParamReads``): a
    #: parameter without a gradient is then told apart as unused rather than cut off.
    wants_param_reads: bool = False
    #: Whether ``input`` is called with each selected call's first input tensor.
    wants_inputs: bool = False

    def tensor(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        """One output tensor of a selected call, as the module returned it (detach before use)."""

    def input(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        """The first input tensor of a selected call (only when ``wants_inputs``; detach before use)."""

    def output(self, output: Any) -> None:
        """The model's output (any structure)."""

    def finished(self, order: CompletionOrder) -> None:
        """The run ended: ``order`` says in which order the selected calls returned."""


@dataclass(slots=True)
class OutputEntry:
    """One output tensor of a call as the session keeps it: where it is in the output, its shape and dtype,
    and what the taps measured of it (on the device)."""

    path: str
    shape: list[int]
    dtype: str
    #: a floating (or complex) tensor: one with statistics and gradients
    floating: bool = False
    stats: Vector | None = None
    grad: Vector | None = None
    wants_grad: bool = False
    #: With ``ChannelCounts``: the nonzero values in each channel (``channel_nonzeros``), on the device
    nonzeros: torch.Tensor | None = None


@dataclass(slots=True)
class Call:
    """One call of a selected module in the step: its inputs' shapes, its outputs (``OutputEntry``), and
    how it ended. The taps get it with each event (``engine.taps``)."""

    name: str
    call: int
    type: str
    input_shapes: list[list[int] | None]
    outputs: list[OutputEntry] = field(default_factory=list)
    input_grads: list[Vector | None] | None = None
    raised: bool = False
    finished: bool = False
    flops: int = 0
    #: Position in the order in which calls returned (-1: not returned, or raised).
    done: int = -1


#: -1 unless autograd's engine runs a backward pass in this thread. A forward there is a
#: recomputation, not a call of the model's forward: activation checkpointing (``torch.utils.checkpoint``,
#: either flavour) runs the checkpointed modules again during backward, and the non-reentrant one stops
#: that rerun early by raising an exception through them. Counting those would add calls the forward
#: never made, marked as raised.
_graph_task_id = torch._C._current_graph_task_id
#: Not None inside a ``torch.func`` transform (vmap, grad, jacrev, ...).
_functorch_level = torch._C._functorch.maybe_current_level
#: ``runs``: how many one-shot runs (``attach``) this thread is inside; a watch leaves their calls out.
_one_shot = threading.local()


class HookSession:
    """Collects the calls of the selected modules during one run (one step of a ``HookSet``)."""

    def __init__(self, selection: Sequence[tuple[str, nn.Module]], taps: Sequence[Tap] = (), *,
                 training_root: nn.Module | None = None) -> None:
        self.selection = list(selection)
        #: what the hooks record of each call's tensors (``engine.taps``), in order
        self.taps = list(taps)
        self._input_taps = [tap.input for tap in self.taps if overrides(tap, "input")]
        self._output_taps = [tap.output for tap in self.taps if overrides(tap, "output")]
        self._step_taps = [tap.step_begins for tap in self.taps if overrides(tap, "step_begins")]
        self.calls: list[Call] = []
        self._open: dict[str, list[Call]] = {}
        self._counts: dict[str, int] = {}
        #: The call whose output gradient arrived last: when backward raises, it ran that call's backward.
        self.last_grad_call: Call | None = None
        #: Calls whose forward is running now, outermost first (for FLOP attribution).
        self.active: list[Call] = []
        self.reducer = Reducer()
        #: The first exception hookcli's own hook code raised (the hooks catch their own exceptions, so
        #: the model's run is never aborted or blamed for them); ``raise_error`` raises it after the run.
        self.error: Exception | None = None
        self.error_where = ""
        self._done = 0
        #: Gradient hooks on leaf tensors (a parameter a module returned or took as input): they outlive
        #: the run with the tensor, so ``reset`` (each step boundary) and ``HookSet.remove`` remove them
        #: (hooks on activations go with the graph).
        self.leaf_hooks: list[RemovableHandle] = []
        #: While True every hook returns at once: no record, no statistics, no tensor hook, no host
        #: synchronisation (a watch's unlogged steps). Switched by ``begin_step`` and ``go_idle`` only.
        self._idle = False
        #: A watch's model (the module it names layers from). A call made while it is in eval mode
        #: (``training`` False) with autograd off (``torch.no_grad()``, ``torch.inference_mode()``) is a
        #: validation forward inside the training loop: every hook returns at once, as when idle. Either
        #: alone is training: a frozen backbone run under ``no_grad`` in a model in train mode, a frozen
        #: BatchNorm in eval mode, a loop that trains with the model in eval mode (no dropout). None:
        #: every call is recorded (the commands' one-shot runs). Given at construction (``HookSet.install``).
        self.training_root = training_root

    @property
    def idle(self) -> bool:
        """Whether every hook returns at once in the step in progress (``begin_step``, ``go_idle``)."""
        return self._idle

    def begin_step(self, *, recording: bool = True, full: bool = True) -> None:
        """How the step that begins now is recorded (called between steps only): ``recording`` False makes
        the session idle (a watch's unlogged step: every hook returns at once); ``full``: the taps measure
        everything in it (a watch's logged step; ``Tap.step_begins``), else statistics only."""
        self._idle = not recording
        for begins in self._step_taps:
            begins(recording and full)

    def go_idle(self) -> None:
        """Every hook returns at once from now on, in the step in progress too (a watch that stopped)."""
        self._idle = True

    def reset(self) -> None:
        """Empty the per-step state (a hook set's step boundary): the calls, their counts, the stored
        hook error, the reducer's caches, and the gradient hooks on leaf tensors."""
        for handle in self.leaf_hooks:
            handle.remove()
        self.leaf_hooks = []
        self.calls = []
        self._open = {}
        self._counts = {}
        self.active = []
        self.last_grad_call = None
        self.error, self.error_where = None, ""
        self._done = 0
        self.reducer.clear()

    def validating(self) -> bool:
        """Whether the calls made now are left out of a watch's step (``training_root``): a validation
        forward, a forward of a one-shot hookcli run inside the loop (``hookcli.stats(model)``: not
        training), or one inside a ``torch.func`` transform (``vmap(grad(...))``'s per-sample gradients:
        batched tensors without storage, not the step's forward)."""
        root = self.training_root
        return root is not None and ((not root.training and not torch.is_grad_enabled())
                                     or getattr(_one_shot, "runs", 0) > 0 or _functorch_level() is not None)

    def sizes(self) -> dict[str, int]:
        """How many entries each per-step container holds (the reducer's included): all 0 after ``reset``."""
        return {"calls": len(self.calls), "open": sum(len(s) for s in self._open.values()),
                "counts": len(self._counts), "active": len(self.active), "leaf_hooks": len(self.leaf_hooks),
                "reducer_seen": len(self.reducer._seen), "reducer_scratch": len(self.reducer._scratch)}

    def failed(self, exc: Exception, where: str) -> None:
        """Remember the first exception of hookcli's hook code (``where``: which hook, on what)."""
        if self.error is None:
            self.error, self.error_where = exc, where

    def call(self, fn: Callable[..., None], *args: Any, where: str) -> None:
        """Run hookcli's ``fn`` during the model's run like a hook body: what it raises is stored
        (``failed``) and raised after the run, never into the model."""
        try:
            fn(*args)
        except Exception as exc:
            self.failed(exc, where)

    def raise_error(self) -> None:
        """Raise what a hook raised during the run: a HookcliError as it is (an unsupported output,
        say), anything else as an InternalError. Nothing when the hooks ran cleanly."""
        exc = self.error
        if exc is None:
            return
        if isinstance(exc, HookcliError):
            raise exc
        raise internal_error(exc, f"hookcli's {self.error_where}") from exc

    def add_flops(self, flops: int) -> None:
        """Attribute ``flops`` to every selected call that is running (parents include children)."""
        for call in self.active:
            call.flops += flops

    # -- hooks -----------------------------------------------------------------------------------
    def pre_hook(self, name: str) -> Callable[..., None]:
        type_name_cache: dict[str, str] = {}

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._idle or _graph_task_id() != -1 or self.validating():  # idle, a recomputation, validation
                return
            try:
                self._pre(name, module, args, kwargs, type_name_cache)
            except Exception as exc:  # hookcli's own failure: stored, never the model's
                self.failed(exc, f"forward pre-hook on {name or '(model)'}")

        return hook

    def global_hooks(self, names: dict[int, str]) -> tuple[Callable[..., None], Callable[..., None]]:
        """A process-wide forward pre-hook and forward hook for the modules in ``names`` (``id`` ->
        name; the selected modules are alive for the session, so their ids are theirs alone).

        Used for a large selection (``attach``): two registrations instead of two per module. They
        see every module call in the process and ignore all but the selected. One difference from
        module hooks: the pre-hook gets no keyword arguments (their shapes join the call's input
        shapes in the forward hook, so a call that raised lists its positional inputs only). Torch
        runs them before a module's own hooks, so ``attach`` leaves modules with hooks out of ``names``.
        """
        type_names: dict[str, str] = {}

        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            name = names.get(id(module))
            if name is None or self._idle or _graph_task_id() != -1 or self.validating():
                return
            try:
                self._pre(name, module, args, {}, type_names)
            except Exception as exc:  # hookcli's own failure: stored, never the model's
                self.failed(exc, f"forward pre-hook on {name or '(model)'}")

        def forward_hook(module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
            # (kwargs, output); torch passes (output) alone when forward raised
            name = names.get(id(module))
            if name is None or self._idle or _graph_task_id() != -1 or self.validating():
                return
            try:
                if len(rest) == 2 and rest[0] and (stack := self._open.get(name)):
                    stack[-1].input_shapes += [shape_of(t) for _, t in iter_tensors(rest[0])]
                self._post(name, rest[-1])
            except Exception as exc:
                self.failed(exc, f"forward hook on {name or '(model)'}")

        return pre_hook, forward_hook

    def _pre(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             type_name_cache: dict[str, str]) -> None:
        index = self._counts.get(name, 0)
        self._counts[name] = index + 1
        type_name = type_name_cache.get(name)
        if type_name is None:
            type_name = type_name_cache[name] = distributed.type_name(module)
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor and not args[0].is_nested:
            inputs = [("[0]", args[0])]  # the common case, without the generic walk
            input_shapes: list[list[int] | None] = [list(args[0].shape)]
        else:
            inputs = list(iter_tensors(args)) + list(iter_tensors(kwargs))
            input_shapes = [shape_of(t) for _, t in inputs]
        call = Call(name, index, type_name, input_shapes)
        for tap in self._input_taps:
            tap(self, call, inputs)
        self.calls.append(call)
        stack = self._open.get(name)
        if stack is None:
            self._open[name] = [call]
        else:
            stack.append(call)
        self.active.append(call)

    def forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._idle or _graph_task_id() != -1 or self.validating():  # paired with the pre-hook's skip
                return
            try:
                self._post(name, output)
            except Exception as exc:  # hookcli's own failure (a reducer, a keep callback): stored
                self.failed(exc, f"forward hook on {name or '(model)'}")

        return hook

    def _post(self, name: str, output: Any) -> None:
        stack = self._open.get(name)
        if not stack:  # hooks attached mid-call; nothing to pair with
            return
        call = stack.pop()
        call.finished = True
        if self.active and self.active[-1] is call:
            self.active.pop()
        elif call in self.active:
            self.active.remove(call)
        if output is None and sys.exc_info()[1] is not None:
            call.raised = True  # always_call path: forward raised
            return
        call.done = self._done
        self._done += 1
        self._record_outputs(call, output)

    def _record_outputs(self, call: Call, output: Any) -> None:
        tensors = (("", output),) if type(output) is torch.Tensor else iter_tensors(output)
        taps = self._output_taps
        for path, tensor in tensors:
            entry = OutputEntry(path, shape_of(tensor) if tensor.is_nested else list(tensor.shape), dtype_name(tensor.dtype),
                            tensor.is_floating_point() or tensor.is_complex())  # (inline: once per output tensor)
            for tap in taps:
                tap(self, call, entry, tensor)
            call.outputs.append(entry)

    def hook_grad(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        """Register a tap's gradient ``hook`` on ``tensor``; one on a leaf tensor (a parameter a module
        returned or took as input) is removed at the step's end (``reset``), as it outlives the graph."""
        handle = tensor.register_hook(hook)
        if tensor.grad_fn is None:
            self.leaf_hooks.append(handle)

    # -- results ---------------------------------------------------------------------------------
    def vectors(self) -> dict[tuple[str, int, str], tuple[Vector | None, Vector | None]]:
        """The statistics and gradient vectors of each recorded output tensor, by (module name, call
        index, output path): what a run over many batches merges (``engine.batches.MergedRows``)."""
        return {(call.name, call.call, t.path): (t.stats, t.grad) for call in self.calls for t in call.outputs
                if t.stats is not None or t.grad is not None}

    def completion_order(self) -> CompletionOrder:
        """Where each call that returned stands in the order calls *finished* (children before
        their parents): the finite rule names the first layer that made a NaN by it."""
        return {(call.name, call.call): call.done for call in self.calls if call.done >= 0}

    def records(self, params_by_name: dict[str, int] | None = None,
                extra: Sequence[Vector] = ()) -> tuple[list[LayerRecord], list[list[float]]]:
        """The recorded calls as plain records, with one host transfer for all statistics; ``extra``
        vectors travel in the same transfer, their host values come back as the second item (``rows``
        with a ``Transfer`` of one's own)."""
        transfer = Transfer()
        extra_slots = [transfer.slot(v) for v in extra]
        rows = self.rows(transfer, params_by_name)
        transfer.run()
        return rows(), [transfer.values[i] for i in extra_slots if i is not None]

    def rows(self, transfer: Transfer, params_by_name: dict[str, int] | None = None) -> Callable[[], list[LayerRecord]]:
        """The recorded calls' statistics vectors, put into the caller's ``transfer`` (with whatever else
        the run brings to the host: the one transfer of a run); once it has run, the returned function
        makes one plain record per call and output (calls that raised and selected modules never called
        included), in the order the calls began. ``params_by_name``: each module's parameter count."""
        slot, by_name = transfer.slot, params_by_name or {}
        layout = [(call, [(t, slot(t.stats), slot(t.grad)) for t in call.outputs],
                   [slot(g) for g in call.input_grads] if call.input_grads is not None else None)
                  for call in self.calls]

        def made() -> list[LayerRecord]:
            with gc_paused():
                return self._records(layout, transfer.row, by_name)

        return made

    def _records(self, layout: Sequence[tuple[Call, list[tuple[OutputEntry, int | None, int | None]], list[int | None] | None]],
                 row: Callable[[int | None], list[float] | None], params_by_name: dict[str, int]) -> list[LayerRecord]:
        records: list[LayerRecord] = []
        depths: dict[str, int] = {}
        for call, outs, ins in layout:
            name = call.name
            depth = depths.get(name)
            if depth is None:
                depth = depths[name] = module_depth(name)
            calls = self._counts.get(name, 1)
            params = params_by_name.get(name, 0)
            grad_input = None
            if ins is not None:
                grad_input = [gradient_stats(values) if (values := row(i)) is not None else None for i in ins]
            if call.raised or not call.finished or not outs:
                records.append(LayerRecord(name, call.call, call.type, depth=depth, calls=calls,
                                           input_shapes=call.input_shapes, params=params,
                                           raised=call.raised or not call.finished, grad_input=grad_input))
                continue
            for entry, stats_i, grad_i in outs:
                stats, grad = row(stats_i), row(grad_i)
                records.append(LayerRecord(
                    name, call.call, call.type, output=entry.path, depth=depth, calls=calls,
                    input_shapes=call.input_shapes, shape=entry.shape, dtype=entry.dtype, params=params,
                    stats=activation_stats(stats) if stats is not None else None,
                    grad=gradient_stats(grad) if grad is not None else None,
                    grad_input=grad_input,
                ))
        called = set(self._counts)
        for name, module in self.selection:
            if name not in called:
                records.append(LayerRecord(
                    name=name, call=0, type=distributed.type_name(module), called=False,
                    depth=module_depth(name), calls=0, params=params_by_name.get(name, 0),
                    container=is_container(module),
                ))
        return records


def param_record(name: str, p: torch.Tensor, norm: float | None, grad: Sequence[float] | None,
                 **more: Any) -> ParamRecord:
    """A parameter's row from host values (a run's ``ParamStats``, a hook set's step, ``grads`` over
    batches): its norm and its gradient's statistics (``gradient_stats`` of a parameter; ``grad`` None:
    it has none); ``more``: the row's other fields (``clipped``)."""
    return ParamRecord(name=name, shape=shape_of(p), requires_grad=p.requires_grad, norm=norm,
                       grad=gradient_stats(grad, abs_max=True) if grad is not None else None, **more)


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` to subtract from in float32 (a float16/bfloat16 change is not rounded away); a complex tensor
    as it is (``.float()`` would drop its imaginary part)."""
    return t if t.is_complex() else t.float()


def exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached in float64, a complex tensor in complex128 (``.double()`` would drop its imaginary part)."""
    return t.detach().to(torch.complex128 if t.is_complex() else torch.float64)


def is_container(module: nn.Module) -> bool:
    """A module without a forward of its own (ModuleList, ModuleDict, ParameterList, ...): it holds
    modules and is never called itself, so "not called" says nothing about it."""
    return getattr(type(module), "forward", None) is nn.Module.forward


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, then restore its previous state.

    A run allocates a few small objects per call; with tens of thousands of modules alive, the
    collector's full passes rescan them all and make a run quadratic in model size (measured: 1.85x
    time per module at 10k vs 1k modules). Runs create no cycles worth collecting meanwhile.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def clipped_gradients(params: Sequence[tuple[str, nn.Parameter]], clip: float | None,
                      ) -> Iterator[dict[str, torch.Tensor]]:
    """Clamp every parameter gradient to [-clip, clip] with tensor hooks (the seeds' gradient
    clipper) for the ``with`` block; the yielded dict fills with each parameter's count of
    clipped elements (a device tensor). Nothing is hooked when ``clip`` is None. What a hook
    raises is stored (the backward pass goes on unclipped there) and raised as InternalError
    after the block; the hooks are always removed.
    """
    counts: dict[str, torch.Tensor] = {}
    handles: list[RemovableHandle] = []
    errors: list[Exception] = []

    def hook_for(name: str) -> Callable[[torch.Tensor | None], torch.Tensor | None]:
        def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
            if grad is None or clip is None:
                return None
            try:
                counts[name] = (grad.abs() > clip).sum()
                return grad.clamp(-clip, clip)
            except Exception as exc:  # hookcli's own failure: stored, raised after the run
                errors.append(exc)
                return None

        return hook

    try:
        if clip is not None:
            for name, p in params:
                if p.requires_grad:
                    handles.append(p.register_hook(hook_for(name)))
        yield counts
    finally:
        for handle in handles:
            handle.remove()
    if errors:
        raise internal_error(errors[0], "hookcli's --clip gradient hook") from errors[0]
