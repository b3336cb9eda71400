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

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

#: (module, key in its ``_parameters`` or ``_buffers``, tensor): one entry per place a tensor is held.
Slot = tuple[nn.Module, str, torch.Tensor]


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
    _subtree: dict[int, int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, model: nn.Module) -> ModelIndex:
        """Index ``model`` with one walk of its module tree."""
        named = list(model.named_modules())
        param_slots: list[Slot] = []
        buffer_slots: list[Slot] = []
        edges = 0
        lazy: str | None = None
        for prefix, module in named:
            for key, p in module._parameters.items():
                if p is not None:
                    param_slots.append((module, key, p))
                    if lazy is None and isinstance(p, UninitializedTensorMixin):
                        lazy = f"{prefix}.{key}" if prefix else key
            for key, b in module._buffers.items():
                if b is not None:
                    buffer_slots.append((module, key, b))
                    if lazy is None and isinstance(b, UninitializedTensorMixin):
                        lazy = f"{prefix}.{key}" if prefix else key
            children = module._modules
            edges += len(children) - (list(children.values()).count(None) if None in children.values() else 0)
        unique = {id(p) for _, _, p in param_slots}
        shared = edges != len(named) - 1 or len(unique) != len(param_slots)
        return cls(model, named, param_slots, buffer_slots, shared, lazy)

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
