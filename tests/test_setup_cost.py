"""A run walks the module tree once, whatever the selection (issue 14: setup is O(modules)).

Counts, not timings: every ``nn.Module.named_modules`` walk (``modules()``, ``parameters()``,
``buffers()`` and their named forms all go through it) is wrapped to count the modules it hands out,
and a run of a model of N blocks may visit about 2N of them, for every selection and both sizes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import hookcli
from timeouts import scaled_timeout


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Deep(nn.Module):
    """``blocks`` blocks, nested four levels deep (depth multiplies the cost of per-module walks)."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 1)
        self.body = nn.Sequential(*(nn.Sequential(nn.Sequential(Block())) for _ in range(blocks)))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


class VisitCounter:
    """Counts the modules handed out by outermost ``named_modules`` walks (nested ones re-yield)."""

    def __init__(self) -> None:
        self.visits = 0
        self._inside = threading.local()

    def wrap(self, original: Any) -> Any:
        counter = self

        def named_modules(module: nn.Module, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
            if getattr(counter._inside, "on", False):
                yield from original(module, *args, **kwargs)
                return
            counter._inside.on = True
            try:
                for item in original(module, *args, **kwargs):
                    counter.visits += 1
                    counter._inside.on = False  # the caller's own loop may start another walk
                    yield item
                    counter._inside.on = True
            finally:
                counter._inside.on = False

        return named_modules


SELECTIONS: list[dict[str, Any]] = [
    {}, {"all_modules": True}, {"depth": 3}, {"layers": "body.*"}, {"types": "Conv2d"},
    {"layers": "body", "types": "ReLU"},
]


def visits_per_module(monkeypatch: pytest.MonkeyPatch, blocks: int, command: Any, options: dict[str, Any]) -> float:
    model = Deep(blocks).eval()
    count = len(list(model.modules()))
    counter = VisitCounter()
    monkeypatch.setattr(nn.Module, "named_modules", counter.wrap(nn.Module.named_modules))
    try:
        command(model, input_shapes=["1x3x8x8"], **options)
    finally:
        monkeypatch.undo()
    return counter.visits / count


@pytest.mark.parametrize("options", SELECTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("command", [hookcli.stats, hookcli.shapes, hookcli.grads], ids=lambda c: c.__name__)
def test_a_run_visits_each_module_a_constant_number_of_times(monkeypatch: pytest.MonkeyPatch, command: Any,
                                                              options: dict[str, Any]) -> None:
    small = visits_per_module(monkeypatch, 4, command, options)
    large = visits_per_module(monkeypatch, 40, command, options)
    assert large <= 3.0, f"{large:.1f} visits per module"
    assert large <= small * 1.1 + 0.1, (small, large)  # flat in the model's size, not O(modules x depth)


HEAVY_IMPORTS = """
import sys

import torch
from torch import nn

import hookcli

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
hookcli.stats(model, input_shapes=["2x8"], all_modules=True)
hookcli.shapes(model, input_shapes=["2x8"])
hookcli.grads(model, input_shapes=["2x8"])
print(sorted(name for name in ("torch._dynamo", "torch.utils.flop_counter", "sympy") if name in sys.modules))
hookcli.shapes(model, input_shapes=["2x8"], flops=True)
print("torch.utils.flop_counter" in sys.modules)
"""


def test_a_run_imports_neither_dynamo_nor_the_flop_counter_it_does_not_use() -> None:
    """Checking whether a model is compiled must not import ``torch._dynamo`` (torch imports it lazily
    on first attribute access, and it brings sympy and the inductor: ~1.4 s and ~55 MB in every
    process whose model never imported it), and only ``--flops`` needs ``torch.utils.flop_counter``."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", HEAVY_IMPORTS], capture_output=True, text=True, timeout=scaled_timeout(300))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"]
