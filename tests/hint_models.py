"""Models whose forward hookcli's default input does not fit (tests/test_input_hints.py)."""

from __future__ import annotations

import torch
from torch import nn


class Masked(nn.Module):
    """forward(x, mask): hookcli can guess x from the first Linear, never mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * mask.unsqueeze(-1)


class DictBatch(nn.Module):
    """forward(batch) reads batch.get("x"): the guessed tensor binds, and the model raises on it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.proj(batch.get("x"))
