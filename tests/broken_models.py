"""Tiny broken models for ``hookcli check`` (importable as ``broken_models:Name``).

Each breaks exactly one thing a CI sanity gate should catch; the tests compute the expected
offender independently with plain torch.
"""

from __future__ import annotations

import torch
from torch import nn


class Healthy(nn.Module):
    """A small conv net that passes every default rule (the control). ``classes`` changes the
    classifier's shape (for baseline differences)."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.relu(self.conv(x))), 1))


class NestedNaN(nn.Module):
    """NaN first appears in ``block.log`` (log of negative numbers), inside the container ``block``.

    ``block`` starts before ``block.log`` but finishes after it: the first layer *in execution
    order* to output NaN is ``block.log``, not ``block`` (the order calls start in).
    """

    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), NestedNaN.Log())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


class DeadLayer(nn.Module):
    """``act`` (a ReLU after ``hidden``, whose bias is -100) outputs only zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 16)
        with torch.no_grad():
            self.hidden.bias.fill_(-100.0)
        self.act = nn.ReLU()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.hidden(x)))


class DeadChannels(nn.Module):
    """6 of the 8 channels of ``conv`` have bias -100: after ``relu`` they are zero everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        with torch.no_grad():
            self.conv.bias[2:] = -100.0
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.relu(self.conv(x))), 1))


class DeadChannels1d(nn.Module):
    """A 1-D convolution over [B, 4, L]: 6 of the 8 channels of ``conv`` (dim 1) have bias -100, so after
    ``relu`` they are zero everywhere; no position (the last dim) is."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        with torch.no_grad():
            self.conv.bias[2:] = -100.0
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.relu(self.conv(x))), 1))


class UnusedParam(nn.Module):
    """``unused`` is never called; ``frozen`` is used but has requires_grad=False (legitimately still)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.frozen(x)))


class Explodes(nn.Module):
    """``big`` has weights of 1e4: activations and gradients blow up (but stay finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(4, 8)
        self.big = nn.Linear(8, 8)
        with torch.no_grad():
            self.big.weight.fill_(1e4)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.small(x)) * 1.0 + self.big(self.small(x)))


class DetachedBranch(UnusedParam):
    """``unused`` now runs, but its output is detached before it reaches the loss: cut off (a bug)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.frozen(x))
        return self.head(h) + 0 * self.unused(h).detach()
