"""Putting hookcli's hooks on a model and on the process, and taking every one of them off again.

``engine.session`` records one run (what each hook does with a call); this module registers the hooks
and removes them: ``HookSet`` (installed once and kept over a training loop's steps: the session's
forward pre-hooks and always-called forward hooks, per module or process-wide, parameter accumulation
hooks, an optimizer's step hooks) and ``attach`` (the commands' one-shot run: a ``HookSet`` for one
step, every handle removed in ``finally``); the engine tracers' module and tensor hooks (``hook_calls``,
``hook_tensor``); ``ProcessHooks`` for a script hookcli runs as it is; ``ParamReads`` (which parameters
a forward reads). A copy of a hooked module (pickle, ``deepcopy``) carries none of hookcli's hooks
(``_NotCopied``). With ``engine.session``, the only module that registers hooks.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from hookcli.errors import UnsupportedError, UsageError
from hookcli.records import LayerRecord, ParamRecord
from hookcli.engine.stats import Transfer, Vector
from hookcli.engine import distributed, reduction
from hookcli.engine.session import HookSession, _one_shot, gc_paused, param_record
from hookcli.engine.taps import Tap, reducible
from hookcli.engine.state import run_lock


#: A selection of at least this many modules, and of this share of the model's, is hooked process-wide
#: (``HookSession.global_hooks``): registering and removing two hooks per module costs ~5 us a module,
#: a tenth of a small model's forward pass, while every call of an unselected module pays torch's
#: slower hooked call path (~3 us) then.
GLOBAL_MIN_MODULES = 32
GLOBAL_MIN_SHARE = 0.75


def hooked_globally(selected: int, model_modules: int | None, taps: Sequence[Tap] = ()) -> bool:
    """Whether ``attach`` hooks ``selected`` modules of a model of ``model_modules`` process-wide.

    Never for a tap that needs every input (input gradients: their tensor hooks need the keyword inputs
    the process-wide pre-hook does not get) nor when the caller did not say how many modules the model has.
    """
    return (model_modules is not None and not any(tap.all_inputs for tap in taps) and selected >= GLOBAL_MIN_MODULES
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

    >>> with HookSet().install(model, select_modules(model), [Statistics(), Gradients()],
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
        taps: Sequence[Tap] = (),
        *,
        params: Sequence[tuple[str, nn.Parameter]] = (),
        model_modules: int | None = None,
        compiled: bool = False,
        training_root: nn.Module | None = None,
    ) -> HookSet:
        """Hook the selected modules (and the ``params``' gradient accumulation) until ``remove``; ``taps``:
        what the hooks record of each call's tensors (``engine.taps``).

        ``model_modules`` and ``compiled`` as for ``attach``; ``training_root``: the module a watch names
        layers from, whose validation forwards are left out (``HookSession.training_root``). UsageError
        when installed already; what registration raises leaves nothing hooked."""
        if self.session is not None:
            raise UsageError("this hook set is installed already", hint="make a new HookSet for another model")
        self.session = HookSession(selection, taps, training_root=training_root)
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
        if not compiled and hooked_globally(len(names), model_modules, session.taps):
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

    def param_vectors(self, *, zeros: bool = False) -> list[ParamVectors]:
        """Each watched parameter's statistics vectors as they stand now, on its device (no transfer):
        its ``.grad``'s when a backward of this step accumulated into it (``zeros``: its zeros counted
        too), and its norm. A watch takes them at the optimizer's pre-step, before the update, and reads
        them when the step ends."""
        session = self.session
        if session is None:
            raise UsageError("this hook set is not installed", hint="call install(model, selection) first")
        reached = [(self._accumulated.get(name) or self._written(name, p)) and p.grad is not None
                   for name, p in self._params]
        grads = iter(reduction.reduce_many(  # a DTensor's: its local shard's
            [reducible(distributed.local(p.grad)) for (_, p), r in zip(self._params, reached) if r],
            zeros=zeros, reducer=session.reducer))
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
            transfer = Transfer()
            row = transfer.row
            extra_slots = [transfer.slot(v) for v in extra]
            plan = [(e, transfer.slot(e.grad), transfer.slot(e.norm)) for e in self.param_vectors()]
            rows = session.rows(transfer, params_by_name)
            transfer.run()
            records = [param_record(e.name, e.param, row(n)[0], row(g)) for e, g, n in plan]  # type: ignore[index]
            return StepRecords(self.step, rows(), records, dict(self._accumulated), [row(i) for i in extra_slots])  # type: ignore[misc]
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
    taps: Sequence[Tap] = (),
    *,
    model_modules: int | None = None,
    compiled: bool = False,
) -> Iterator[HookSession]:
    """Hook the selected modules for the duration of the ``with`` block; always remove the hooks.

    >>> with attach(model, select_modules(model), [Statistics()]) as session:
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
        with run_lock(), gc_paused(), hooks.install(model, selection, taps, model_modules=model_modules,
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
