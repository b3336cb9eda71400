"""The loss of a loop that does not hand it to the watch (``watch -- CMD``, ``w.step()`` without
``loss=``): the tensors ``backward()`` is called on (docs/watch.md#the-loss-without-wstep).

While a watch runs, ``torch.autograd.backward`` (which ``Tensor.backward`` calls) is wrapped: the
wrapper notes its roots, then calls torch's own with the same arguments, so nothing of the computation
changes. A step's loss is the **sum** of its roots' values: one ``backward()`` a step gives the loss
itself, bit for bit; gradient accumulation gives the sum of the micro-batches' roots, which is the mean
loss when the script divides each micro-batch's loss by their count (as the gradients it accumulates
are), the sum when it does not. Each root is a 0-d ``detach().clone()``, added on its device: no host
synchronisation. A root that is not one value (``y.backward(gradient)``) leaves the step without a
loss; several roots in one call are summed; each is said once (``notes``). A root made by
``GradScaler.scale(loss)`` (wrapped too, while the watch runs) counts as ``loss``, unscaled: the scaled
value overflows by design.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

#: -1 unless autograd's engine runs a backward pass in this thread (a reentrant checkpoint calls
#: ``torch.autograd.backward`` inside the backward: not a root of the step)
_graph_task_id = torch._C._current_graph_task_id


class BackwardRoots:
    """Notes the roots of every ``torch.autograd.backward`` that reaches the watched model while installed
    (``install`` / ``remove``): ``reached()`` counts the accumulations into its parameters' gradients,
    so another model's backward in the same process (a GAN's other half, an unwatched twin) is not its
    loss."""

    def __init__(self, reached: Callable[[], int]) -> None:
        self.reached = reached
        self.total: torch.Tensor | None = None
        self.unusable = False  # a root of the step was not one value: the step has no loss
        #: what was said about the script's roots (each once): a non-scalar root, several roots in a call
        self.notes: list[str] = []
        self._original: Callable[..., Any] | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._scale: Callable[..., Any] | None = None
        #: what GradScaler.scale returned (by id, with a weak reference) -> the loss it scaled
        self._unscaled: dict[int, tuple[Any, torch.Tensor]] = {}

    def install(self) -> None:
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self._wrapper is not backward or _graph_task_id() != -1:
                return original(tensors, *args, **kwargs)
            try:
                values, before = self._values(tensors), self.reached()
            except Exception:  # hookcli's failure to note a loss: the backward runs as ever
                values, before = None, None
            result = original(tensors, *args, **kwargs)
            if before is not None and self.reached() != before:
                self._add(values)
            return result

        self._original, self._wrapper = original, backward
        torch.autograd.backward = backward  # type: ignore[assignment]
        scale = torch.amp.GradScaler.scale

        @functools.wraps(scale)
        def scaled(scaler: Any, outputs: Any) -> Any:
            result = scale(scaler, outputs)
            if self._wrapper is not None and isinstance(outputs, torch.Tensor) and outputs.numel() == 1 \
                    and isinstance(result, torch.Tensor) and result is not outputs:
                self._unscaled = {id(result): (weakref.ref(result), outputs.detach().reshape(()).clone())}
            return result

        self._scale = scale
        torch.amp.GradScaler.scale = scaled  # type: ignore[method-assign]

    def remove(self) -> None:
        """Put torch's function back (when another wrapper came after ours, ours only stops noting)."""
        if self._wrapper is not None and torch.autograd.backward is self._wrapper:
            torch.autograd.backward = self._original  # type: ignore[assignment]
        if self._scale is not None and getattr(torch.amp.GradScaler.scale, "__wrapped__", None) is self._scale:
            torch.amp.GradScaler.scale = self._scale  # type: ignore[method-assign]
        self._wrapper, self._scale, self._unscaled = None, None, {}

    def _values(self, tensors: Any) -> list[torch.Tensor | str]:
        """Each root's value (a 0-d copy), or what it is when it is not one value."""
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors) \
            if isinstance(tensors, (list, tuple)) else [tensors]
        return [self._unscaled[id(root)][1] if id(root) in self._unscaled and self._unscaled[id(root)][0]() is root
                else root.detach().reshape(()).clone()
                if isinstance(root, torch.Tensor) and root.numel() == 1 and not root.is_complex()
                else f"a tensor of shape {list(root.shape)}" if isinstance(root, torch.Tensor) else "no tensor"
                for root in roots]

    def _add(self, values: list[torch.Tensor | str] | None) -> None:
        """A backward that reached the model: its roots join the step's loss."""
        if values is None:
            self.unusable = True
            return
        if len(values) != 1:
            self._say(f"backward() was called on {len(values)} tensors at once: the step's loss is their sum")
        for value in values:
            if isinstance(value, str):
                self._say(f"backward() was called on {value}: steps with it have no loss (pass "
                          "w.step(loss=...) in the script)")
                self.unusable = True
                continue
            self.total = value if self.total is None else self.total + value.to(self.total.device)

    def _say(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def take(self) -> torch.Tensor | None:
        """The step's loss (the sum of its roots; None: no backward, or a root that was not one value);
        the next step starts empty."""
        total, unusable = self.total, self.unusable
        self.total, self.unusable = None, False
        return None if unusable else total
