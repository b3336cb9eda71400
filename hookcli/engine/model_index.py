"""One traversal of a model's module tree, shared by every step of a run.

Selecting modules, counting parameters (the model's and each selected module's), checking for lazy
parameters and saving the state a run must restore all need the modules, parameters and buffers of
the model. Walking the tree for each of them (``module.parameters()`` per selected module walks its
subtree again) made a run's setup O(modules x depth) and cost more than the forward pass of a small
model. ``ModelIndex.of`` walks it once; everything else reads the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from hookcli.errors import UnsupportedError

#: (module, key in its ``_parameters`` or ``_buffers``, tensor): one entry per place a tensor is held.
Slot = tuple[nn.Module, str, torch.Tensor]
_MISSING = object()


def _entry(held: Any, key: str) -> Any:
    """``held[key]``, or ``_MISSING``: the dicts of a TorchScript module are mappings without ``get``."""
    return held[key] if key in held else _MISSING


@dataclass(eq=False)
class ModelIndex:
    """The modules of ``model`` in ``named_modules()`` order, and every parameter and buffer slot."""

    model: nn.Module
    #: ``(name, module)`` as ``model.named_modules()`` lists them: each module object once.
    named: list[tuple[str, nn.Module]]
    param_slots: list[Slot]
    buffer_slots: list[Slot]
    #: True when a module or a parameter is reachable along two paths (weight tying, a reused
    #: block): subtree parameter counts are then not additive.
    shared: bool
    #: The name of the first uninitialised lazy parameter or buffer (``nn.LazyLinear`` & co.), or None:
    #: a run would initialise it, changing the model.
    lazy_tensor: str | None = None
    #: The rest of the tree's structure, for ``preserved`` to put back what a forward changed: every
    #: ``_modules`` entry ``(parent, key, child or None)``, every parameter or buffer key that holds
    #: None ``(module, "_parameters" or "_buffers", key)``, and each module's number of entries in its
    #: three dicts (aligned with ``named``).
    child_slots: list[tuple[nn.Module, str, nn.Module | None]] = field(default_factory=list, repr=False)
    empty_slots: list[tuple[nn.Module, str, str]] = field(default_factory=list, repr=False)
    sizes: list[int] = field(default_factory=list, repr=False)
    _subtree: dict[int, int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, model: nn.Module) -> ModelIndex:
        """Index ``model`` with one walk of its module tree. UnsupportedError for a tree torch cannot walk:
        a module class that defines ``__eq__`` without ``__hash__`` (``named_modules`` keeps a set)."""
        named = _named_modules(model)
        param_slots: list[Slot] = []
        buffer_slots: list[Slot] = []
        child_slots: list[tuple[nn.Module, str, nn.Module | None]] = []
        empty_slots: list[tuple[nn.Module, str, str]] = []
        sizes: list[int] = []
        edges = 0
        lazy: str | None = None
        for prefix, module in named:
            parameters, buffers, children = module._parameters, module._buffers, module._modules
            for kind, held, slots in (("_parameters", parameters, param_slots), ("_buffers", buffers, buffer_slots)):
                for key, tensor in held.items():
                    if tensor is None:
                        empty_slots.append((module, kind, key))
                        continue
                    slots.append((module, key, tensor))
                    if lazy is None and isinstance(tensor, UninitializedTensorMixin):
                        lazy = f"{prefix}.{key}" if prefix else key
            for key, child in children.items():
                child_slots.append((module, key, child))
                edges += child is not None
            sizes.append(len(parameters) + len(buffers) + len(children))
        unique = {id(p) for _, _, p in param_slots}
        shared = edges != len(named) - 1 or len(unique) != len(param_slots)
        return cls(model, named, param_slots, buffer_slots, shared, lazy, child_slots, empty_slots, sizes)

    def restore_structure(self) -> None:
        """Put back the tree as indexed, where a run changed it: submodules replaced or removed come
        back, None entries become None again, and what a forward *added* (a submodule, parameter or
        buffer made on first call: lazy initialisation, a cache) is removed, so the model is as before
        the run, not one initialised by hookcli's seeded run in its ``--dtype`` and ``--device``.
        Call it after the parameter and buffer slots are put back (``preserved`` does, and restores
        their data): an entry count above the indexed one then means an added entry."""
        for parent, key, child in self.child_slots:
            if _entry(parent._modules, key) is not child:
                parent._modules[key] = child
        for module, kind, key in self.empty_slots:
            held = getattr(module, kind)
            if _entry(held, key) is not None:
                held[key] = None
        for (_, module), size in zip(self.named, self.sizes):
            if len(module._parameters) + len(module._buffers) + len(module._modules) != size:
                self._drop_added(module)

    def _drop_added(self, module: nn.Module) -> None:
        """Remove ``module``'s entries that were not there when it was indexed (the rare path)."""
        kept: dict[str, set[str]] = {"_parameters": set(), "_buffers": set(), "_modules": set()}
        for kind, slots in (("_parameters", self.param_slots), ("_buffers", self.buffer_slots)):
            kept[kind].update(key for owner, key, _ in slots if owner is module)
        kept["_modules"].update(key for owner, key, _ in self.child_slots if owner is module)
        for owner, kind, key in self.empty_slots:
            if owner is module:
                kept[kind].add(key)
        for kind, keys in kept.items():
            held = getattr(module, kind)
            for key in [k for k in held if k not in keys]:
                del held[key]

    @property
    def modules(self) -> list[nn.Module]:
        """Every module once, in ``named_modules()`` order."""
        return [module for _, module in self.named]

    @property
    def params(self) -> list[torch.Tensor]:
        """Every parameter tensor once (a tied one is held in two slots), in ``parameters()`` order."""
        return list({id(p): p for _, _, p in self.param_slots}.values())

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer tensor once, in ``buffers()`` order."""
        return list({id(b): b for _, _, b in self.buffer_slots}.values())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``model.named_parameters()``, read now from the indexed modules (a run may have replaced
        parameter objects since the index was made: ``.to`` does under torch's swap-tensors mode)."""
        return self._named_tensors("_parameters")

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``model.named_buffers()``, read now from the indexed modules."""
        return self._named_tensors("_buffers")

    def _named_tensors(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        out: list[tuple[str, torch.Tensor]] = []
        for prefix, module in self.named:
            for key, tensor in getattr(module, kind).items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    out.append((f"{prefix}.{key}" if prefix else key, tensor))
        return out

    def subtree_modules(self, roots: Sequence[nn.Module]) -> set[int]:
        """The ids of ``roots`` and every module below them, each module visited once in all."""
        covered: set[int] = set()
        stack = list(roots)
        while stack:
            module = stack.pop()
            if id(module) in covered:
                continue
            covered.add(id(module))
            stack.extend(child for child in module._modules.values() if child is not None)
        return covered

    def subtree_params(self, selection: Sequence[tuple[str, nn.Module]]) -> dict[str, int]:
        """Parameters in each selected module's subtree, each tensor counted once (as
        ``sum(p.numel() for p in module.parameters())``).

        A tree without shared modules or parameters adds its children's counts up, children before
        parents, in one pass; a model with sharing (tied weights) counts each selected subtree.
        """
        if not self.shared and self._subtree is None:
            self._subtree = self._added_up()
        if self._subtree is None:  # sharing, or the tree changed since it was indexed
            return {name: sum(p.numel() for p in module.parameters()) for name, module in selection}
        return {name: self._subtree[id(module)] for name, module in selection}

    def _added_up(self) -> dict[int, int] | None:
        """Each indexed module's subtree parameter count, children added into parents; None when a
        module now has a child the index does not hold (its forward added one: ``self.proj = ...``)."""
        total = {id(module): 0 for _, module in self.named}
        for module, _, p in self.param_slots:
            total[id(module)] += p.numel()
        for _, module in reversed(self.named):  # pre-order reversed: every child before its parent
            for child in module._modules.values():
                if child is not None:
                    if id(child) not in total:
                        return None
                    total[id(module)] += total[id(child)]
        return total


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()``, or UnsupportedError naming the first module torch cannot hash (its class
    defines ``__eq__`` and so, in Python, loses ``__hash__``: ``named_modules`` and ``parameters`` fail)."""
    try:
        return list(model.named_modules())
    except TypeError:
        stack: list[tuple[str, nn.Module]] = [("", model)]
        while stack:
            name, module = stack.pop()
            try:
                hash(module)
            except TypeError:
                kind = type(module).__name__
                raise UnsupportedError(
                    f"{name or '(model)'} ({kind}) cannot be hashed (its class defines __eq__ without __hash__), "
                    "so torch cannot walk the model's modules (named_modules, parameters)",
                    hint=f"add `__hash__ = nn.Module.__hash__` to class {kind}") from None
            stack.extend((f"{name}.{key}" if name else key, child)
                         for key, child in module._modules.items() if child is not None)
        raise
