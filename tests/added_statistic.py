"""A statistic added through the table of statistics at run time (not a test module itself): mean |x|,
from an accumulator no backend had, the sum of |x| over the finite values. tests/test_add_statistic.py
registers it in its own process; its torchrun worker (added_statistic_worker.py) in each rank."""

from __future__ import annotations

import torch
from torch import nn

from hookcli.records import statistics

ACCUMULATOR = statistics.Accumulator("abs_sum", "abs")  # torch.abs, by name
STATISTIC = statistics.Statistic(
    "mean_abs", lambda s: s.acc["abs_sum"] / s.acc["count"] if s.acc["count"] else s.missing, "Mean |x|",
    frozenset({statistics.ACTIVATION, statistics.GRADIENT, statistics.WATCH}))


def register() -> None:
    statistics.register_accumulator(ACCUMULATOR)
    statistics.register(STATISTIC, after="std")


def unregister() -> None:
    statistics.unregister(STATISTIC.name)
    statistics.unregister(ACCUMULATOR.name)


class Model(nn.Sequential):
    """Linear, ReLU, Linear with the same weights in every process (seeded here, not by the caller)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5 + 0.1)


def batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch (5 rows, an offset so that mean |x| is not mean x)."""
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 + rank)) - 0.3


def outputs(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each module's output for ``x``, by name, in plain torch."""
    model = Model()
    found: dict[str, torch.Tensor] = {}
    h = model[0](x)
    found["0"] = h
    found["1"] = model[1](h)
    found["2"] = model[2](found["1"])
    return {k: v.detach() for k, v in found.items()}
