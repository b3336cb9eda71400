"""Seeded training bugs for ``hookcli check --steps N`` (importable as ``training_bugs:Name``).

Each model trains wrongly in exactly one way that the one-step check cannot see (or sees only in
part); the tests say which training rule must catch it and which module or parameter it must name.
``Classifier`` is the healthy control they all derive from.
"""

from __future__ import annotations

import torch
from torch import nn


class Classifier(nn.Module):
    """A tiny MLP classifier of 8 features into ``classes`` classes (the healthy control)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body(x)))


class SoftmaxBeforeCE(Classifier):
    """Returns probabilities (``nn.Softmax``) to a loss that is a cross-entropy, which applies
    log-softmax itself: the loss at init looks like chance, but it cannot fall far."""

    def __init__(self) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.softmax(super().forward(x))


class HotLogits(Classifier):
    """Logits scaled up 100x (a temperature applied the wrong way round): the loss at init is far
    above chance."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale(100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(super().forward(x))


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class DetachedMiddle(Classifier):
    """A ``.detach()`` between ``body`` and ``head``: ``body`` never learns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body(x)).detach())


class UnseededDropout(Classifier):
    """Dropout from its own generator, seeded from the OS on each call: ``--seed`` cannot make two
    runs alike (``noise`` is the module that makes the difference)."""

    def __init__(self) -> None:
        super().__init__()
        self.noise = OwnDropout()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.noise(self.act(self.body(x))))


class OwnDropout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator()
        gen.seed()  # a fresh seed from the OS: not the run's RNG
        keep = torch.rand(x.shape, generator=gen) > 0.5
        return x * keep / 0.5


class WritesFrozen(Classifier):
    """A parameter that does not require grad (``offset``) but that forward moves in place (a
    running statistic kept as a Parameter instead of a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.body(x))
        with torch.no_grad():
            self.offset.mul_(0.9).add_(0.1 * h.mean(0))
        return self.head(h - self.offset)


class RaisesInTraining(Classifier):
    """Runs the one-step check, then raises from its 7th forward on (in the training run): a failure
    of the model (exit 1), not of hookcli. The count is kept on the class, shared by every copy."""

    calls = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        if type(self).calls > 6:
            raise RuntimeError("boom in training")
        return super().forward(x)
