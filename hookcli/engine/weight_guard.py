"""A caller's weights, handed back as they came, without copying them on every run.

A forward may write a weight in place: ``nn.Embedding(max_norm=)`` renormalises the rows it looks up
under ``no_grad``, a hook clamps a weight through ``.data``. ``preserved`` must undo that on a model
the caller gave. Copying every weight before each run and back after it is exact but costs two passes
over the weights and their memory again (8% of a resnet50 batch-8 forward on a CPU; for an accelerator's
weights, a copy to host memory several times a forward's time). So the copy is a speculation checked
after every run:

- **A model's first run** copies its weights (an accelerator's to host memory) and puts back every one
  the run changed. A model whose first run changed none (same values, no version counter moved) is
  remembered, weakly and with its parameter objects, as one whose forward *keeps its weights*.
- **A later run of such a model** copies nothing up front. While it runs, ``torch.Tensor.data`` copies
  the parameter it is read from (or from a view of: ``w[0].data``, ``w.T.data``) on its first read (a
  write through ``.data`` bumps no version counter, so it is caught here) and the copy is put back after
  the run. Every other in-place write to a parameter
  or a view of it (under ``no_grad``: ``clamp_``, ``embedding_renorm_``, an init function) bumps the
  parameter's version counter: after the run a moved counter means a write made with no copy to put
  back. It is said (``WeightsChangedWarning``: which parameters) and the model is copied on every
  later run.
- A model whose parameters changed (a layer swapped) since it was remembered is treated as new.
- A parameter whose ``.data`` a run set (legacy tying in a forward, ``head.weight.data = emb.weight.data``)
  gets its own memory back before its values are put back (``Guard.memory``).

What no guard sees: a write through memory torch does not track (``.numpy()``, ``untyped_storage()``,
a C extension's pointer) in a later run of a model whose first run wrote nothing.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from hookcli.engine.model_index import ModelIndex
from hookcli.errors import WeightsChangedWarning, user_stacklevel

#: torch's own ``.data`` (get and set), which the run-time property calls.
_DATA = torch._C.TensorBase.data

#: Models seen to keep their weights: model -> their parameters (weakly) when it was seen.
_KEEPS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[torch.Tensor], ...]] = \
    weakref.WeakKeyDictionary()
#: Models seen to write a weight in a forward: copied on every run.
_WRITES: weakref.WeakSet[nn.Module] = weakref.WeakSet()

_LOCK = threading.Lock()
#: id(model) -> its guarded run going on
_RUNS: dict[int, Guard] = {}
#: id(parameter) -> the guard watching it, while guarded runs are going on (``.data`` installed).
_WATCHED: dict[int, Guard] = {}


def _plain(p: torch.Tensor) -> bool:
    """A parameter whose values a copy can hold (not a tensor subclass's wrapper, not meta)."""
    return type(p.detach()) is torch.Tensor and not p.is_meta


def _version(p: torch.Tensor) -> int:
    """``p``'s version counter; 0 for an inference tensor, which keeps none (such a model is copied on
    every run: its writes could not be seen)."""
    return 0 if p.is_inference() else p._version


def _copy(p: torch.Tensor) -> torch.Tensor:
    """``p``'s values, outside autograd; an accelerator's in host memory (the run's device memory
    stays its own)."""
    with torch.no_grad():
        return p.clone() if p.is_cpu else p.detach().to("cpu", copy=True)


@dataclass
class Guard:
    """One guarded run of ``model``: what was copied, and each parameter's version counter before."""

    model: nn.Module
    params: list[torch.Tensor]
    #: (parameter, its values before the run): every weight on a first run, those read through
    #: ``.data`` on a later one
    kept: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    speculating: bool = False
    #: the model raised during the run (``ran_partly``): what it did not reach shows nothing
    partly: bool = False
    #: ids of the parameters a later run has seen through ``.data``
    covered: set[int] = field(default_factory=set)
    #: id -> (parameter, its ``.data`` before the run): every weight on a first run, those whose ``.data``
    #: a later one set. A forward that sets it (``head.weight.data = emb.weight.data``) gets its own
    #: memory back before its values: else they would be copied into the memory it was given.
    memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    #: positions in ``params`` a run changed with no copy to undo it (a later run), or changed (a first)
    changed: list[int] = field(default_factory=list)

    def keep(self, p: torch.Tensor) -> None:
        """Copy ``p`` before a first read of its ``.data`` (idempotent). A copy taken after an earlier
        write of this run (its version counter moved) holds no values to undo it with: not kept."""
        with _LOCK:
            if id(p) in self.covered:
                return
            self.covered.add(id(p))
            if _version(p) == self.versions[next(i for i, q in enumerate(self.params) if q is p)]:
                self.kept.append((p, _copy(p)))

    def to_put_back(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """After the run, the (parameter, values) pairs to copy back: on a first run those whose values
        or version counter changed; on a later one each parameter read through ``.data``. Notes in
        ``changed`` the positions a first run changed, and those a later run changed with no copy."""
        for p, data in self.memory.values():
            if not p.is_set_to(data):
                _DATA.__set__(p, data)
        if not self.speculating:
            self.changed = [i for i, (p, v) in enumerate(self.kept)
                            if _version(p) != self.versions[i] or not _same(p, v)]
            return [self.kept[i] for i in self.changed]
        kept = {id(p) for p, _ in self.kept}
        self.changed = [i for i, p in enumerate(self.params) if _version(p) != self.versions[i] and id(p) not in kept]
        return self.kept

    def settle(self, completed: bool) -> None:
        """After the values are put back: remember what the run showed of the model's forward (a run
        that raised shows nothing of what it did not reach), and say which weights a later run changed
        with no copy to undo it."""
        model = self.model
        with contextlib.suppress(TypeError):  # (an unhashable module: never remembered)
            if self.changed:
                _WRITES.add(model)
                _KEEPS.pop(model, None)
            elif completed and not self.partly and not self.speculating and model not in _WRITES:
                _KEEPS[model] = tuple(weakref.ref(p) for p in self.params)
        if not (self.speculating and self.changed):
            return
        names = _names(model, [self.params[i] for i in self.changed])
        warnings.warn(
            f"the model's forward changed {len(names)} weight(s) in place ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) where its earlier runs changed none, so no copy was kept "
            "to put them back; hookcli copies this model's weights on every run from now on",
            WeightsChangedWarning, stacklevel=user_stacklevel())


def _same(p: torch.Tensor, values: torch.Tensor) -> bool:
    """``p`` holds ``values`` bit for bit (NaN where NaN was, -0.0 where -0.0 was: compared as integers when
    the widths match; a same-width dtype view takes any strides, a transposed weight's too)."""
    now = p.detach() if p.is_cpu else p.detach().cpu()
    if now.dtype == values.dtype and now.dtype.is_floating_point and now.dtype.itemsize in _INTS:
        now, values = now.view(_INTS[now.dtype.itemsize]), values.view(_INTS[now.dtype.itemsize])
    return torch.equal(now, values)


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _remembered(model: nn.Module, params: list[torch.Tensor]) -> bool:
    """True when ``model`` was seen to keep its weights, with these very parameters. (A module class
    that defines ``__eq__`` without ``__hash__`` cannot be remembered: copied on every run.)"""
    try:
        refs = None if model in _WRITES else _KEEPS.get(model)
    except TypeError:
        return False
    return refs is not None and len(refs) == len(params) and all(r() is p for r, p in zip(refs, params))


@contextmanager
def guarded(model: nn.Module, params: list[torch.Tensor]) -> Iterator[Guard]:
    """Run the block with ``model``'s weights guarded. After the block the caller copies back
    ``guard.to_put_back()`` (with the buffers, once the parameters are the indexed ones again), then
    calls ``guard.settle``."""
    params = [p for p in params if _plain(p)]
    guard = Guard(model, params, speculating=_speculates(model, params))
    if not guard.speculating:
        guard.kept = [(p, _copy(p)) for p in params]
        guard.memory = {id(p): (p, _DATA.__get__(p)) for p in params}
    guard.versions = [_version(p) for p in params]
    outer = _RUNS.get(id(model))
    _RUNS[id(model)] = guard
    try:
        with _watching(guard):
            yield guard
    finally:
        if outer is None:
            _RUNS.pop(id(model), None)
        else:
            _RUNS[id(model)] = outer


def ran_partly(model: nn.Module) -> None:
    """The model raised in the guarded run going on: its run proves nothing about the forward's writes."""
    guard = _RUNS.get(id(model))
    if guard is not None:
        guard.partly = True


def copying(model: nn.Module) -> bool:
    """True when the next run of ``model`` copies its weights up front (not seen to keep them)."""
    return not _speculates(model, [p for p in ModelIndex.of(model).params if _plain(p)])


def _speculates(model: nn.Module, params: list[torch.Tensor]) -> bool:
    """A run of ``model`` copies nothing up front: it was seen to keep these weights, and each keeps a
    version counter (an inference tensor keeps none: such a model is copied on every run)."""
    return _remembered(model, params) and not any(p.is_inference() for p in params)


def _names(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    wanted = {id(p) for p in params}
    return [name for name, p in model.named_parameters(remove_duplicate=True) if id(p) in wanted]


# --------------------------------------------------------------------------- .data, while runs go on


def _watch_read(t: torch.Tensor) -> None:
    """Copy the watched parameter ``t`` is, or is a view of (``_base``: the parameter itself), before
    its ``.data`` is read: ``.data`` of a view shares the weight's memory and not its version counter."""
    guard = _WATCHED.get(id(t))
    if guard is None and t._base is not None:
        t = t._base
        guard = _WATCHED.get(id(t))
    if guard is not None:
        guard.keep(t)


def _get_data(self: torch.Tensor) -> torch.Tensor:
    _watch_read(self)
    return _DATA.__get__(self)


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    _watch_read(self)
    guard = _WATCHED.get(id(self))
    if guard is not None:
        guard.memory.setdefault(id(self), (self, _DATA.__get__(self)))
    _DATA.__set__(self, value)


_DATA_PROPERTY = property(_get_data, _set_data, doc=_DATA.__doc__)


@contextmanager
def _watching(guard: Guard) -> Iterator[None]:
    """While the block runs, ``guard``'s parameters are copied on their first ``.data`` read (a later
    run's only copy). ``torch.Tensor.data`` is this module's property while any guard watches; nested
    runs (another model from inside a forward) share it."""
    if not guard.speculating:
        yield
        return
    with _LOCK:
        if not _WATCHED and torch.Tensor.__dict__.get("data") is not _DATA_PROPERTY:
            torch.Tensor.data = _DATA_PROPERTY  # type: ignore[assignment,method-assign]
        mine = [id(p) for p in guard.params if id(p) not in _WATCHED]
        for key in mine:
            _WATCHED[key] = guard
    try:
        yield
    finally:
        with _LOCK:
            for key in mine:
                _WATCHED.pop(key, None)
            if not _WATCHED and torch.Tensor.__dict__.get("data") is _DATA_PROPERTY:
                del torch.Tensor.data
