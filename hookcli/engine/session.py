"""The hook engine: attach forward pre-hooks and forward hooks to selected modules, record every call.

Rules (docs/how-it-works.md): a pre-hook sees the inputs before an in-place module changes them; an
``always_call`` forward hook sees the outputs and still fires when forward raises; one record per
call, in execution order; every tensor of any output structure; statistics reduced on the device;
gradients through tensor hooks registered on output (and input) tensors, never module backward hooks
(they break on in-place ops). ``attach`` removes every handle in ``finally``.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from hookcli.errors import HookcliError, UnsupportedError, UsageError, internal_error
from hookcli.records import LayerRecord, ParamRecord
from hookcli.engine.stats import (
    activation_stats,
    dtype_name,
    gradient_stats,
    is_float,
    iter_tensors,
    Reducer,
    Vector,
    shape_of,
    to_host,
)
from hookcli.engine import distributed, reduction
from hookcli.engine.channels import ChannelDims, has_channels
from hookcli.engine.selection import module_depth
from hookcli.engine.state import run_lock

#: Called with (record name, call index, output path, tensor) for every selected output tensor.
TensorFn = Callable[[str, int, str, torch.Tensor], None]
#: A ``TensorFn`` that keeps tensors (features, fmaps): it gets them densified, never nested.
KeepFn = TensorFn
#: (module name, call index) -> position of that call in the order in which calls *finished*.
CompletionOrder = dict[tuple[str, int], int]


@dataclass
class HookOptions:
    """What the hooks compute.

    ``keep`` gets every selected output tensor to keep (a sparse one densified, a nested one
    refused); ``observe`` gets every selected output tensor as the module returned it, to measure
    it on the device (``check``'s dead channels). Both run inside the session's forward hook:
    what they raise is stored and raised after the run (``raise_error``), never into the model.
    """

    stats: bool = False
    grads: bool = False
    input_grads: bool = False
    keep: KeepFn | None = None
    flops: bool = False
    observe: TensorFn | None = None
    #: With ``grads``: called with (record name, call index, output path, gradient) as each selected
    #: output's gradient arrives in backward (``diff --grads`` compares them).
    keep_grad: KeepFn | None = None
    #: Count the zeros of gradients too (``hookcli.watch``; the commands' gradient tables show none).
    grad_zeros: bool = False
    #: Count each selected output's nonzero values per channel (``hookcli.watch``'s dead units; the
    #: channel dimension as ``ChannelDims`` finds it), in the steps its ``begin_step`` counts them.
    channel_zeros: bool = False
    #: Called from the forward pre-hook with each selected call's first input tensor (name, call,
    #: "[0]", tensor): what a parent's forward hands a module (a residual stream) is no module's output.
    observe_input: TensorFn | None = None


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
class _Tensor:
    path: str
    shape: list[int]
    dtype: str
    stats: Vector | None = None
    grad: Vector | None = None
    wants_grad: bool = False
    #: With ``channel_zeros``: the nonzero values in each channel (``channel_nonzeros``), on the device
    nonzeros: torch.Tensor | None = None


@dataclass(slots=True)
class _Call:
    name: str
    call: int
    type: str
    input_shapes: list[list[int] | None]
    outputs: list[_Tensor] = field(default_factory=list)
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

    def __init__(self, selection: Sequence[tuple[str, nn.Module]], options: HookOptions, *,
                 training_root: nn.Module | None = None) -> None:
        self.selection = list(selection)
        self.options = options
        self.calls: list[_Call] = []
        self._open: dict[str, list[_Call]] = {}
        self._counts: dict[str, int] = {}
        #: The call whose output gradient arrived last: when backward raises, it ran that call's backward.
        self.last_grad_call: _Call | None = None
        #: Calls whose forward is running now, outermost first (for FLOP attribution).
        self.active: list[_Call] = []
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
        #: With ``channel_zeros``: whether outputs are counted per channel now (a watch's logged steps
        #: only; its flight recorder's unlogged steps are not). Switched by ``begin_step`` only.
        self._count_channels = options.channel_zeros
        self.channel_dims = ChannelDims(dict(self.selection)) if options.channel_zeros else None
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

    def begin_step(self, *, recording: bool = True, count_channels: bool = True) -> None:
        """How the step that begins now is recorded (called between steps only): ``recording`` False makes
        the session idle (a watch's unlogged step: every hook returns at once); ``count_channels``: each
        output is counted per channel in it (with ``HookOptions.channel_zeros``: a watch's logged steps)."""
        self._idle = not recording
        self._count_channels = count_channels and self.options.channel_zeros

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
        call = _Call(name, index, type_name, input_shapes)
        if self.options.observe_input is not None and inputs:
            self.options.observe_input(name, index, inputs[0][0], inputs[0][1])
        if self.options.input_grads:
            call.input_grads = [None] * len(inputs)
            for position, (_, tensor) in enumerate(inputs):
                if tensor.requires_grad and is_float(tensor):
                    self._hook_grad(tensor, self._input_grad_hook(call, position))
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

    def _record_outputs(self, call: _Call, output: Any) -> None:
        options = self.options
        tensors = (("", output),) if type(output) is torch.Tensor else iter_tensors(output)
        for path, tensor in tensors:
            entry = _Tensor(path, shape_of(tensor) if tensor.is_nested else list(tensor.shape), dtype_name(tensor.dtype))
            floating = tensor.is_floating_point() or tensor.is_complex()  # (inline: once per output tensor)
            if options.stats and floating and not tensor.is_meta:
                entry.stats = self.reducer.reduce(reducible(distributed.local(tensor)))  # a DTensor: this rank's part
            if self._count_channels and self.channel_dims is not None and has_channels(tensor):
                part = distributed.local(tensor)  # a DTensor: this rank's part (engine.distributed sums the parts)
                entry.nonzeros = reduction.channel_counts([(part, self.channel_dims(call.name, part))])[0]
            if options.grads and floating and tensor.requires_grad:
                entry.wants_grad = True
                self._hook_grad(tensor, self._output_grad_hook(call, entry))
            if options.observe is not None:
                options.observe(call.name, call.call, path, tensor)
            if options.keep is not None:
                options.keep(call.name, call.call, path, _keepable(call, path, tensor))
            call.outputs.append(entry)

    def _hook_grad(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        handle = tensor.register_hook(hook)
        if tensor.grad_fn is None:
            self.leaf_hooks.append(handle)

    def _output_grad_hook(self, call: _Call, entry: _Tensor) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor | None) -> None:
            if grad is None:  # no gradient reached it (an op without a backward, e.g. a quantized one)
                return
            try:
                entry.grad = self.reducer.reduce(reducible(distributed.local(grad)), zeros=self.options.grad_zeros)
                if self.options.keep_grad is not None:
                    self.options.keep_grad(call.name, call.call, entry.path, grad)
            except Exception as exc:
                self.failed(exc, f"gradient hook on an output of {call.name or '(model)'}")
            self.last_grad_call = call

        return hook

    def _input_grad_hook(self, call: _Call, position: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor | None) -> None:
            if grad is None or call.input_grads is None:
                return
            try:
                call.input_grads[position] = self.reducer.reduce(reducible(grad), zeros=False)
            except Exception as exc:
                self.failed(exc, f"gradient hook on an input of {call.name or '(model)'}")

        return hook

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

    def records(
        self,
        params_by_name: dict[str, int] | None = None,
        extra: Sequence[Vector] = (),
    ) -> tuple[list[LayerRecord], list[list[float]]]:
        """Turn the recorded calls into plain records, with one host transfer for all statistics.

        ``extra`` vectors (parameter gradients, the loss, ...) travel in the same transfer; their host
        values come back as the second item.
        """
        with gc_paused():
            return self._records(params_by_name or {}, extra)

    def _records(
        self, params_by_name: dict[str, int], extra: Sequence[Vector],
    ) -> tuple[list[LayerRecord], list[list[float]]]:
        pending: list[Vector] = list(extra)

        def slot(vec: Vector | None) -> int | None:
            if vec is None:
                return None
            pending.append(vec)
            return len(pending) - 1

        layout: list[tuple[_Call, list[tuple[_Tensor, int | None, int | None]], list[int | None]]] = []
        for call in self.calls:
            outs = [(t, slot(t.stats), slot(t.grad)) for t in call.outputs]
            ins = [slot(g) for g in (call.input_grads or [])]
            layout.append((call, outs, ins))
        values = to_host(pending)
        extra_values = values[: len(extra)]

        records: list[LayerRecord] = []
        flops = self.options.flops
        depths: dict[str, int] = {}
        for call, outs, ins in layout:
            name = call.name
            depth = depths.get(name)
            if depth is None:
                depth = depths[name] = module_depth(name)
            calls = self._counts.get(name, 1)
            params = params_by_name.get(name, 0)
            call_flops = call.flops if flops else None
            grad_input = None
            if call.input_grads is not None:
                grad_input = [gradient_stats(values[i]) if i is not None else None for i in ins]
            if call.raised or not call.finished or not outs:
                records.append(LayerRecord(name, call.call, call.type, depth=depth, calls=calls,
                                           input_shapes=call.input_shapes, params=params, flops=call_flops,
                                           raised=call.raised or not call.finished, grad_input=grad_input))
                continue
            for entry, stats_i, grad_i in outs:
                records.append(LayerRecord(
                    name, call.call, call.type, output=entry.path, depth=depth, calls=calls,
                    input_shapes=call.input_shapes, shape=entry.shape, dtype=entry.dtype, params=params,
                    stats=activation_stats(values[stats_i]) if stats_i is not None else None,
                    grad=gradient_stats(values[grad_i]) if grad_i is not None else None,
                    grad_input=grad_input, flops=call_flops,
                ))
        called = set(self._counts)
        for name, module in self.selection:
            if name not in called:
                records.append(LayerRecord(
                    name=name, call=0, type=distributed.type_name(module), called=False,
                    depth=module_depth(name), calls=0, params=params_by_name.get(name, 0),
                    container=is_container(module),
                ))
        return records, extra_values


def param_record(name: str, p: torch.Tensor, norm: float | None, grad: Sequence[float] | None,
                 **more: Any) -> ParamRecord:
    """A parameter's row from host values (a run's ``ParamStats``, a hook set's step, ``grads`` over
    batches): its norm and its gradient's statistics (``gradient_stats`` of a parameter; ``grad`` None:
    it has none); ``more``: the row's other fields (``clipped``)."""
    return ParamRecord(name=name, shape=shape_of(p), requires_grad=p.requires_grad, norm=norm,
                       grad=gradient_stats(grad, abs_max=True) if grad is not None else None, **more)


def reducible(t: torch.Tensor) -> torch.Tensor:
    """The real tensor whose statistics stand for ``t``: a complex tensor's magnitude ``|z|`` (its mean,
    spread and extremes of size; the L2 norm of ``|z|`` is that of ``z``), anything else as it is. The
    one place a complex tensor (an FNO's spectrum, a complex parameter and its gradient) is turned into
    something the reducers take; its record keeps its complex dtype, which marks the row."""
    return t.abs() if t.is_complex() else t


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


def _keepable(call: _Call, path: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a ``keep`` callback gets: a sparse one densified; a nested (ragged) one refused."""
    if tensor.is_nested:
        raise UnsupportedError(
            f"{call.name or '(model)'}{path} returned a nested (ragged) tensor, which cannot be kept as one array",
            hint="select other modules with --layers (hookcli stats shows which return nested tensors)")
    return tensor if tensor.layout == torch.strided else tensor.to_dense()


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


#: A selection of at least this many modules, and of this share of the model's, is hooked process-wide
#: (``HookSession.global_hooks``): registering and removing two hooks per module costs ~5 us a module,
#: a tenth of a small model's forward pass, while every call of an unselected module pays torch's
#: slower hooked call path (~3 us) then.
GLOBAL_MIN_MODULES = 32
GLOBAL_MIN_SHARE = 0.75


def hooked_globally(selected: int, model_modules: int | None, options: HookOptions) -> bool:
    """Whether ``attach`` hooks ``selected`` modules of a model of ``model_modules`` process-wide.

    Never for input gradients (their tensor hooks need the keyword inputs the process-wide
    pre-hook does not get) nor when the caller did not say how many modules the model has.
    """
    return (model_modules is not None and not options.input_grads and selected >= GLOBAL_MIN_MODULES
            and selected >= GLOBAL_MIN_SHARE * model_modules)


def is_compiled(model: nn.Module, selection: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether ``model`` is ``torch.compile(module)``'s wrapper, or it or a selected module was compiled
    in place (``module.compile()``).

    Dynamo is looked up in ``sys.modules``, never imported: nothing was compiled in a process that has
    not imported it, and ``torch._dynamo`` (an attribute torch imports lazily on first access) brings
    sympy and the inductor with it: about 1.4 s and 55 MB on the first run of every process."""
    optimized = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(optimized, "OptimizedModule", None)
    if wrapper is not None and isinstance(model, wrapper):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in (model, *(m for _, m in selection)))


def _as_is(fn: Callable[..., None]) -> Callable[..., None]:
    return fn


#: The hook functions hookcli registered on modules and has not dropped yet (held weakly: a hook goes
#: with its handle's removal).
_OURS: weakref.WeakSet[Callable[..., None]] = weakref.WeakSet()


def _ours(hook: Callable[..., None]) -> Callable[..., None]:
    """Mark ``hook`` as hookcli's: a copy of its module leaves it out (``_NotCopied``)."""
    _OURS.add(hook)
    return hook


def _is_ours(hook: Any) -> bool:
    try:
        return hook in _OURS
    except TypeError:  # a hook of the user's that cannot be weakly referenced (a callable object) is theirs
        return False


#: A module's hook tables and the tables of marks keyed by the same hook ids.
_HOOK_TABLES = (("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
                ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")))


def _state_without_hooks(module: nn.Module) -> Any:
    """``module.__getstate__()`` (what pickle, ``torch.save`` and ``copy.deepcopy`` copy) without
    hookcli's hooks: a checkpoint saved during a run holds none (and loads without hookcli), and a
    copy (an EMA, a ``deepcopy(model).half()``) is never recorded. The user's own hooks are copied as
    torch copies them."""
    state = type(module).__getstate__(module)
    if not isinstance(state, dict):
        return state
    state.pop("__getstate__", None)
    for key, marks in _HOOK_TABLES:
        hooks = state.get(key)
        gone = {hook_id for hook_id, hook in hooks.items() if _is_ours(hook)} if hooks else set()
        for table in (key, *marks) if gone else ():
            if isinstance(state.get(table), dict):
                state[table] = type(state[table])((k, v) for k, v in state[table].items() if k not in gone)
    return state


class _NotCopied:
    """Copies of a hooked module leave hookcli's hooks out while they are on it: the module's own
    ``__getstate__`` (an instance attribute, which pickle and deepcopy look up before the class's) is
    ``_state_without_hooks``. ``remove`` takes it away once no hook of hookcli's is left on the module."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @classmethod
    def on(cls, module: nn.Module) -> _NotCopied:
        if "__getstate__" not in vars(module):
            vars(module)["__getstate__"] = functools.partial(_state_without_hooks, module)
        return cls(module)

    def remove(self) -> None:
        module, state = self.module, vars(self.module)
        getstate = state.get("__getstate__")
        if not (isinstance(getstate, functools.partial) and getstate.func is _state_without_hooks):
            return
        if not any(_is_ours(hook) for key, _ in _HOOK_TABLES for hook in getattr(module, key, {}).values()):
            del state["__getstate__"]


class _ForgetKwargsMark:
    """Removes what ``register_module_forward_hook(with_kwargs=True)`` leaves after its handle's
    ``remove()``: the hook's entry in torch's process-wide with-kwargs table."""

    def __init__(self, hook_id: int) -> None:
        self.hook_id = hook_id

    def remove(self) -> None:
        from torch.nn.modules import module as torch_module

        marks = getattr(torch_module, "_global_forward_hooks_with_kwargs", None)
        if marks is not None:
            marks.pop(self.hook_id, None)


@dataclass
class ParamVectors:
    """One watched parameter's statistics vectors at one moment (``HookSet.param_vectors``): its
    ``.grad``'s (None: no backward of the step reached it) and its L2 norm, on its device."""

    name: str
    param: nn.Parameter
    grad: Vector | None
    norm: Vector


@dataclass
class StepRecords:
    """What a hook set recorded in one step, handed back at the step boundary (``HookSet.step_records``).

    ``layers``: one record per call of a selected module in the step (a module called in two
    accumulation micro-steps has calls 0 and 1), as a one-shot run gives them. ``params``: each
    watched parameter's ``.grad`` as it stands at the boundary, i.e. summed over every backward of the
    step (``grad`` None when no backward of this step accumulated into it). ``accumulations``: how
    many times each parameter's ``.grad`` was accumulated into during the step. ``extra``: the host
    values of the caller's ``extra`` vectors.
    """

    step: int
    layers: list[LayerRecord]
    params: list[ParamRecord] = field(default_factory=list)
    accumulations: dict[str, int] = field(default_factory=dict)
    extra: list[list[float]] = field(default_factory=list)


class HookSet:
    """The engine's hooks on one model, installed once and kept over many steps (a training loop).

    >>> with HookSet().install(model, select_modules(model), HookOptions(stats=True, grads=True),
    ...                        params=list(model.named_parameters())) as hooks:
    ...     for batch in data:
    ...         loss_fn(model(batch)).backward()      # any number of backward() per step
    ...         step = hooks.step_records()            # before optimizer.zero_grad()
    ...         optimizer.step(); optimizer.zero_grad()

    A step is what lies between two ``step_records`` calls (the first starts at ``install``).
    ``step_records`` hands back that step's records and empties every per-step container (calls,
    counts, the reducer's caches, gradient hooks on leaf tensors): between steps the set holds no
    lock, pauses no garbage collection and grows nothing. Parameter gradients come from
    ``Tensor.register_post_accumulate_grad_hook``, so the user's own ``backward()`` is seen; the
    statistics are those of the accumulated ``.grad`` at the boundary. ``remove`` (also the ``with``
    block's exit, whatever it raised) takes every hook away; the records of the last step stay readable
    through ``session``. One-shot runs use it through ``attach``.
    """

    def __init__(self) -> None:
        self.session: HookSession | None = None
        self.step = 0
        self._handles: list[RemovableHandle | _ForgetKwargsMark | _NotCopied] = []
        self._params: list[tuple[str, nn.Parameter]] = []
        self._accumulated: dict[str, int] = {}
        #: accumulations into a watched parameter's ``.grad`` so far, idle steps included (a backward
        #: that reached the model: ``engine.roots`` tells the model's loss from another model's)
        self.accumulations = 0
        #: under a process group: each parameter's ``.grad`` as the (logged) step began (``mark_grads``)
        self._marks: dict[str, tuple[weakref.ref[torch.Tensor], int] | None] = {}
        #: The hooks run eagerly under torch.compile (set by ``install``: asked for, or ``is_compiled``).
        self.compiled = False

    def install(
        self,
        model: nn.Module,
        selection: Sequence[tuple[str, nn.Module]],
        options: HookOptions | None = None,
        *,
        params: Sequence[tuple[str, nn.Parameter]] = (),
        model_modules: int | None = None,
        compiled: bool = False,
        training_root: nn.Module | None = None,
    ) -> HookSet:
        """Hook the selected modules (and the ``params``' gradient accumulation) until ``remove``.

        ``model_modules`` and ``compiled`` as for ``attach``; ``training_root``: the module a watch names
        layers from, whose validation forwards are left out (``HookSession.training_root``). UsageError
        when installed already; what registration raises leaves nothing hooked."""
        if self.session is not None:
            raise UsageError("this hook set is installed already", hint="make a new HookSet for another model")
        self.session = HookSession(selection, options or HookOptions(), training_root=training_root)
        try:
            self.compiled = compiled or is_compiled(model, selection)
            self._hook_modules(selection, model_modules, self.compiled)
            seen: set[int] = set()
            for name, p in params:
                if id(p) not in seen:  # a tied parameter: counted once, under its first name
                    seen.add(id(p))
                    self._params.append((name, p))
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(self._accumulate_hook(name)))
        except BaseException:
            self.remove()
            raise
        return self

    def _hook_modules(self, selection: Sequence[tuple[str, nn.Module]], model_modules: int | None,
                      compiled: bool) -> None:
        """The forward pre-hooks and forward hooks: process-wide or per module (see ``attach``)."""
        session, handles = self.session, self._handles
        assert session is not None
        names: dict[int, str] = {}
        for name, module in selection:
            names.setdefault(id(module), name)  # the same module object under two names: hooked once, as the first
        per_module = selection
        if not compiled and hooked_globally(len(names), model_modules, session.options):
            # torch runs process-wide hooks before a module's own: a module with hooks of its own (the
            # user's, a library's) keeps per-module hooks, run after theirs, to see the inputs and
            # output its own hooks replaced (what the model goes on with), as with a small selection
            own = {id(m) for _, m in selection if m._forward_hooks or m._forward_pre_hooks}
            pre_hook, forward_hook = session.global_hooks(
                {key: name for key, name in names.items() if key not in own} if own else names)
            handles.append(register_module_forward_pre_hook(pre_hook))
            handles.append(register_module_forward_hook(forward_hook, with_kwargs=True, always_call=True))
            # torch's handle forgets the with_kwargs mark of a process-wide hook: removing the hook
            # leaves it behind, and torch.compile'd modules then warn about hooks that are gone
            handles.append(_ForgetKwargsMark(handles[-1].id))
            per_module = [(name, module) for name, module in selection if id(module) in own]
        # under torch.compile the hooks run as Python, outside the graph (Dynamo would trace them)
        eager = torch.compiler.disable if compiled else _as_is
        for name, module in per_module:
            if names[id(module)] != name:
                continue
            handles.append(module.register_forward_pre_hook(_ours(eager(session.pre_hook(name))), with_kwargs=True))
            handles.append(module.register_forward_hook(
                _ours(eager(session.forward_hook(name))), with_kwargs=True, always_call=True,
            ))
            handles.append(_NotCopied.on(module))

    def _accumulate_hook(self, name: str) -> Callable[[nn.Parameter], None]:
        def hook(_param: nn.Parameter) -> None:  # after each accumulation into .grad (one per backward)
            if getattr(_one_shot, "runs", 0):
                return  # a one-shot hookcli run inside the watched loop: not the training's gradients
            self.accumulations += 1
            if self.session is not None and not self.session.idle:
                self._accumulated[name] = self._accumulated.get(name, 0) + 1

        return hook

    def mark_grads(self) -> None:
        """Under a process group, each parameter's ``.grad`` (which tensor, its version) as a step whose
        gradients will be read begins: ``_written`` tells a gradient written in the step without this
        rank's backward from a stale one. Called by the watch at each logged step's start (not at the
        unlogged ones': a dict of weak references per step is kept off their path)."""
        if distributed.process_group() is not None:
            self._marks = {name: None if p.grad is None else (weakref.ref(p.grad), p.grad._version)
                           for name, p in self._params}

    def _written(self, name: str, p: nn.Parameter) -> bool:
        """Whether ``p.grad`` was written in this step though no backward of this rank accumulated into
        it: DDP (``find_unused_parameters=True``) gives a parameter only other ranks used the ranks'
        mean gradient. Only under a process group."""
        if name not in self._marks or p.grad is None:
            return False
        mark = self._marks[name]
        return mark is None or mark[0]() is not p.grad or mark[1] != p.grad._version

    def param_vectors(self) -> list[ParamVectors]:
        """Each watched parameter's statistics vectors as they stand now, on its device (no transfer):
        its ``.grad``'s when a backward of this step accumulated into it, and its norm. A watch takes
        them at the optimizer's pre-step, before the update, and reads them when the step ends."""
        session = self.session
        if session is None:
            raise UsageError("this hook set is not installed", hint="call install(model, selection) first")
        reached = [(self._accumulated.get(name) or self._written(name, p)) and p.grad is not None
                   for name, p in self._params]
        grads = iter(reduction.reduce_many(  # a DTensor's: its local shard's
            [reducible(distributed.local(p.grad)) for (_, p), r in zip(self._params, reached) if r],
            zeros=session.options.grad_zeros, reducer=session.reducer))
        norms = reduction.norms([reducible(distributed.local(p.detach())) for _, p in self._params])
        return [ParamVectors(name, p, next(grads) if r else None, norm)
                for (name, p), r, norm in zip(self._params, reached, norms)]

    def step_records(self, params_by_name: dict[str, int] | None = None,
                     extra: Sequence[Vector] = ()) -> StepRecords:
        """This step's records (one host transfer, ``extra`` vectors included); then the per-step state
        is emptied and the next step begins (``end_step``). Raises what a hook raised during the step
        (as ``HookSession.raise_error``), after emptying it too."""
        session = self.session
        if session is None:
            raise UsageError("this hook set is not installed", hint="call install(model, selection) first")
        try:
            session.raise_error()
            plan: list[tuple[ParamVectors, int | None, int]] = []
            vectors: list[Vector] = list(extra)
            for entry in self.param_vectors():
                g_slot = None
                if entry.grad is not None:
                    vectors.append(entry.grad)
                    g_slot = len(vectors) - 1
                vectors.append(entry.norm)
                plan.append((entry, g_slot, len(vectors) - 1))
            layers, values = session.records(params_by_name, vectors)
            records = [param_record(e.name, e.param, values[n_slot][0], values[g_slot] if g_slot is not None else None)
                       for e, g_slot, n_slot in plan]
            return StepRecords(self.step, layers, records, dict(self._accumulated), values[: len(extra)])
        finally:
            self.end_step()

    @property
    def backward_reached(self) -> bool:
        """Whether a backward of the step in progress accumulated into a watched parameter's ``.grad``
        (counted only while the session is not idle)."""
        return bool(self._accumulated)

    def end_step(self) -> None:
        """The step boundary: empty the per-step state (``HookSession.reset``, the accumulation counts)
        and count the step."""
        if self.session is not None:
            self.session.reset()
        self._accumulated.clear()
        self.step += 1

    def hook_optimizer(self, optimizer: torch.optim.Optimizer, pre: Callable[..., None],
                       post: Callable[..., None]) -> None:
        """Call ``pre`` and ``post`` (with torch's ``(optimizer, args, kwargs)``) around each
        ``optimizer.step()`` until ``remove``: the optimizer's own step hooks, on that optimizer only;
        once a step, however deep its ``super().step()`` chain (``OuterStep``)."""
        outer = OuterStep(pre, post)
        self._handles.append(optimizer.register_step_pre_hook(outer.pre))
        self._handles.append(optimizer.register_step_post_hook(outer.post))

    def observe_closures(self, optimizer: torch.optim.Optimizer, wanted: Callable[[], bool],
                         returned: Callable[[], None]) -> None:
        """Until ``remove``, call ``returned()`` each time the closure of ``optimizer.step(closure)``
        returns, in the steps where ``wanted()`` says so at the pre-step (a pre-step hook hands the step
        a wrapper: the closure's result and exceptions stay the loop's own; ``returned`` must not
        raise). Where a closure runs the step's backward (LBFGS, Lightning's automatic optimisation,
        whose closure adds gradient accumulation's last micro-batch), the gradients the step applies
        exist only once it has returned: not at the pre-step, and the optimizer may change or free
        ``.grad`` before its post-step."""

        def pre(_optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
            # (args[0] is the optimizer; a subclass's super().step() gets the closure already wrapped)
            closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
            if not callable(closure) or isinstance(closure, ObservedClosure) or not wanted():
                return None
            observed = ObservedClosure(closure, returned)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": observed}
            return (args[0], observed, *args[2:]), kwargs

        self._handles.append(optimizer.register_step_pre_hook(pre))

    def remove(self) -> None:
        """Take every hook of the set away (module, process-wide, parameter and leaf-tensor hooks);
        the session's records of the step in progress stay readable. Safe to call twice."""
        handles, self._handles = self._handles, []
        if self.session is not None:
            handles += self.session.leaf_hooks
            self.session.leaf_hooks = []
        for handle in handles:
            handle.remove()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


@contextmanager
def attach(
    model: nn.Module,
    selection: Sequence[tuple[str, nn.Module]],
    options: HookOptions | None = None,
    *,
    model_modules: int | None = None,
    compiled: bool = False,
) -> Iterator[HookSession]:
    """Hook the selected modules for the duration of the ``with`` block; always remove the hooks.

    >>> with attach(model, select_modules(model), HookOptions(stats=True)) as session:
    ...     model(x)
    >>> records, _ = session.records()

    The one-shot run of the commands: a ``HookSet`` used for one step, whose records the caller reads
    from the session after the block. Only here, around that one run and never around a user's loop,
    the process-wide run lock (``state.run_lock``) is held, so hooks of two runs are never on a model
    at once and rows never mix (the API takes the lock first, for the whole run), and the garbage
    collector is paused (``gc_paused``: its full passes make a run over a large model quadratic).
    ``model_modules``: how many modules the model has; with it, a selection of most of them is
    hooked with two process-wide hooks instead of two per module (``hooked_globally``).
    ``compiled``: the model runs under ``torch.compile`` (also found by ``is_compiled``): its hooks
    are per module and run eagerly (``torch.compiler.disable``), never traced into the graph.
    """
    hooks = HookSet()
    _one_shot.runs = getattr(_one_shot, "runs", 0) + 1  # a watch around it leaves its calls out
    try:
        with run_lock(), gc_paused(), hooks.install(model, selection, options, model_modules=model_modules,
                                                    compiled=compiled):
            assert hooks.session is not None
            yield hooks.session
    finally:
        _one_shot.runs -= 1
    session = hooks.session
    # the model (or the module torch.compile wraps) runs whenever the model does: when it is selected
    # and its hook never fired, torch ran a stale graph (a selection of unused modules alone is fine)
    inner = getattr(model, "_orig_mod", model)
    must_run = {name for name, module in selection if module is model or module is inner}
    if hooks.compiled and must_run and not must_run & set(session._counts) and session.error is None:
        raise stale_graph_error()


def hook_calls(modules: Sequence[nn.Module], pre: Callable[..., None], post: Callable[..., None]
               ) -> list[RemovableHandle | _NotCopied]:
    """A forward pre-hook and an always-called forward hook (both with keyword arguments) on each of
    ``modules``, for a tracer of the engine's own (``engine.cause``): the handles, to remove."""
    handles = []
    try:
        for module in modules:  # (marked as hookcli's: a copy of the module, a pickle, carries none)
            handles.append(module.register_forward_pre_hook(_ours(functools.partial(pre)), with_kwargs=True))
            handles.append(module.register_forward_hook(_ours(functools.partial(post)), with_kwargs=True,
                                                        always_call=True))
            handles.append(_NotCopied.on(module))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


def hook_tensor(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """A gradient hook on a non-leaf ``tensor`` (it goes with the autograd graph: nothing to remove)."""
    tensor.register_hook(hook)


def stale_graph_error() -> UnsupportedError:
    """A torch.compile'd model ran without firing hookcli's hooks: Dynamo reused a graph compiled before
    they were added (it does not guard on module hooks), so nothing of the model would be recorded."""
    return UnsupportedError(
        "no hook fired in the torch.compile'd model: it ran a graph compiled before hookcli attached its "
        "hooks (torch does not recompile when hooks are added)",
        hint="run hookcli in a fresh process, call torch.compiler.reset() first, or pass the module "
        "without torch.compile")


class ParamReads:
    """Which of ``params`` the code run inside ``with ParamReads(...)`` passes to a torch function
    (``F.linear(x, self.weight)``, ``p.detach()``, an RNN's flat weight list): a parameter that gets no
    gradient yet was read is cut off from the loss; one never read is unused by this forward (a
    training-only masking embedding in eval mode). Attribute reads (``p.dtype``) do not count; ``p.data``
    (its values, cut off from autograd) does.

    A ``TorchFunctionMode`` (no hooks): it sees every op, so only ``check`` pays for it."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        from torch.overrides import TorchFunctionMode

        ids = {id(p) for p in params}
        read: set[int] = set()
        self.read = read

        def note(value: Any) -> None:
            if id(value) in ids:
                read.add(id(value))
            elif type(value) in (list, tuple):
                for item in value:
                    if id(item) in ids:
                        read.add(id(item))

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if getattr(func, "__name__", "") != "__get__" or getattr(func.__self__, "__name__", "") == "data":
                    for value in args:
                        note(value)
                    for value in (kwargs or {}).values():
                        note(value)
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()

    def __enter__(self) -> ParamReads:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


class ObservedClosure:
    """A closure handed to ``optimizer.step()`` (``HookSet.observe_closures``), called as it is;
    ``returned()`` is called each time it has returned (not when it raised)."""

    def __init__(self, closure: Callable[[], Any], returned: Callable[[], None]) -> None:
        self.closure, self.returned = closure, returned

    def __call__(self) -> Any:
        out = self.closure()
        self.returned()
        return out


class OuterStep:
    """Optimizer step hooks ``pre`` and ``post`` called for the outermost ``optimizer.step()`` only.

    torch wraps each optimizer class's ``step`` in its hook runner, so a subclass whose ``step`` calls
    ``super().step()`` runs the step hooks once per class in the chain: one step would count as two.
    The runner's frame of the outermost call is kept from its pre-step to its post-step; a pre-step
    while that frame is still on the stack is a nested one, skipped, as is a post-step from any other
    frame. A step that raised (no post-step) is not on the stack at the next one, which counts."""

    def __init__(self, pre: Callable[..., None], post: Callable[..., None]) -> None:
        self._pre, self._post = pre, post
        self._frame: Any = None  # torch's hook runner of the outermost step in progress

    def pre(self, *args: Any) -> None:
        runner = sys._getframe(1)
        outer, frame = self._frame, runner.f_back
        while outer is not None and frame is not None:
            if frame is outer:
                return  # a super().step() inside the step in progress
            frame = frame.f_back
        self._frame = runner
        self._pre(*args)

    def post(self, *args: Any) -> None:
        if sys._getframe(1) is not self._frame:
            return
        self._frame = None
        self._post(*args)


class ProcessHooks:
    """Process-wide hooks for a script hookcli runs as it is (``hookcli watch -- CMD``), which hands
    hookcli neither its model nor its optimizer.

    ``install`` registers torch's global optimizer step hooks (``pre(optimizer)`` before every
    optimizer's ``step()``, ``post(optimizer)`` after it, after the optimizer's own post hooks) and a
    process-wide forward pre-hook and forward hook that note the *roots*: the modules called from
    outside any module's forward (the script's ``model(x)``, its loss module), in order of first call.
    ``stop_roots`` takes the module hooks away (a watch hooks the model itself from then on; they cost
    every module call of the process the hooked call path); ``remove`` takes everything away. What
    ``pre`` and ``post`` raise reaches ``optimizer.step()``: they catch their own errors.
    """

    def __init__(self, pre: Callable[[torch.optim.Optimizer], None],
                 post: Callable[[torch.optim.Optimizer], None]) -> None:
        self._pre, self._post = pre, post
        #: the roots, by id, in the order of their first call (held until ``stop_roots``)
        self.roots: dict[int, nn.Module] = {}
        self._depth = 0
        self._module_handles: list[RemovableHandle | _ForgetKwargsMark] = []
        self._handles: list[RemovableHandle] = []

    def install(self) -> Self:
        """Register the hooks; what registration raises leaves nothing registered."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        try:
            outer = OuterStep(lambda opt, _a, _k: self._pre(opt), lambda opt, _a, _k: self._post(opt))
            self._handles.append(register_optimizer_step_pre_hook(outer.pre))
            self._handles.append(register_optimizer_step_post_hook(outer.post))
            self._module_handles.append(register_module_forward_pre_hook(self._enter))
            self._module_handles.append(register_module_forward_hook(self._leave, always_call=True))
        except BaseException:
            self.remove()
            raise
        return self

    def _enter(self, module: nn.Module, _args: Any) -> None:
        if self._depth == 0 and id(module) not in self.roots:
            self.roots[id(module)] = module
        self._depth += 1

    def _leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._depth = max(0, self._depth - 1)

    def stop_roots(self) -> None:
        """Take the process-wide module hooks away and forget the roots (safe inside a step hook)."""
        handles, self._module_handles = self._module_handles, []
        for handle in handles:
            handle.remove()
        self.roots = {}

    def remove(self) -> None:
        """Take every hook away (never from inside an optimizer step hook: torch is iterating them)."""
        self.stop_roots()
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
