"""Forward (and backward) FLOPs per module call, from torch's own formulas.

``FlopCounter`` is a ``TorchDispatchMode`` that counts each aten op with
``torch.utils.flop_counter.flop_registry`` (the formulas ``FlopCounterMode`` uses, so totals agree with
it) and adds the count to every selected module call that is running at that moment (a parent
includes its children). It works on the meta device. Ops that are compute-heavy but have no formula
(e.g. a custom RNN kernel) make the count *partial*; they are listed so the report can say so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from hookcli.errors import internal_error

#: Op names with real arithmetic that FlopCounterMode has no formula for mark a count as partial.
_HEAVY_HINTS = ("conv", "mm", "matmul", "linear", "lstm", "gru", "rnn", "attention", "einsum", "bilinear")


class FlopCounter(TorchDispatchMode):
    """Count FLOPs of every op run inside it; ``on_flops(n)`` attributes them (e.g. to open calls)."""

    def __init__(self, on_flops: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.total = 0
        self.on_flops = on_flops
        self.missing: set[str] = set()
        self.error: Exception | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # the model's op: what it raises is the model's
        try:
            self._count(func, args, kwargs, out)
        except Exception as exc:  # hookcli's counting failed: stored (raise_error), never the model's
            if self.error is None:
                self.error = exc
        return out

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: Any, out: Any) -> None:
        packet = func._overloadpacket
        formula = flop_registry.get(packet)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.total += flops
            if self.on_flops is not None and flops:
                self.on_flops(flops)
        else:
            name = str(packet).removeprefix("aten.")
            if any(hint in name for hint in _HEAVY_HINTS):
                self.missing.add(name)

    def raise_error(self) -> None:
        """Raise an InternalError for what the counting code raised during the run, if anything."""
        if self.error is not None:
            raise internal_error(self.error, "hookcli's FLOP counter") from self.error

    @property
    def partial(self) -> bool:
        return bool(self.missing)

    def summary(self, backward: int | None = None) -> dict[str, Any]:
        """The report's ``flops`` entry."""
        return {"forward": self.total, "backward": backward, "partial": self.partial,
                "missing_ops": sorted(self.missing)}
