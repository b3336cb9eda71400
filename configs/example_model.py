"""An example user model for ``configs/user_model.toml`` (loaded as ``example_model.py:build``).

A small image classifier with a frozen, pretrained-style stem: ``stem`` has requires_grad=False,
so the params_change and grad_norm rules (which only cover trainable parameters) leave it alone.
"""

from __future__ import annotations

import torch
from torch import nn


class SmallNet(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stem.requires_grad_(False)  # frozen: legitimately never changes
        self.block = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.block(self.stem(x)))
        return self.head(self.dropout(torch.flatten(x, 1)))


def build(num_classes: int = 10, width: int = 16) -> SmallNet:
    """The factory the config names; ``model_args`` in the config are its keyword arguments."""
    return SmallNet(num_classes=num_classes, width=width)
