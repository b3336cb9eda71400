"""Seeded training bugs for ``hookcli check --steps N`` (importable as ``training_bugs:Name``).

Each model trains wrongly in exactly one way that the one-step check cannot see (or sees only in
part); the tests say which training rule must catch it and which module or parameter it must name.
``Classifier`` is the healthy control they all derive from.
"""

from __future__ import annotations

from typing import Any

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


class ResidualBlock(nn.Module):
    """A pre-norm residual block: it returns ``x + f(x)`` itself."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.norm(x)))


class Residual(nn.Module):
    """A stack of residual blocks, a final norm and a head (the healthy control of ``DoubledResidual``)."""

    def __init__(self, depth: int = 6, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class DoubledResidual(Residual):
    """Adds the residual twice (``x = x + block(x)`` around a block that already returns ``x + f(x)``):
    the stream doubles at every block, and it is only ever a module's input (residual_growth)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


class FunctionalReLU(Classifier):
    """``F.relu`` after ``body`` (the healthy control of ``DeadFunctionalReLU``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.relu(self.body(x)))


class DeadFunctionalReLU(FunctionalReLU):
    """12 of body's 16 units have a bias of -100: dead behind a functional relu, which no module
    outputs, so dead_channels cannot see them (dead_units)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__(classes)
        with torch.no_grad():
            self.body.bias[:12] = -100.0


class TokenModel(nn.Module):
    """A tiny causal token model with its own loss (labels are its input ids, shifted inside, as
    Hugging Face language models do): position t sees its token and the mean of those before."""

    def __init__(self, vocab: int = 32, width: int = 64) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype)[None, :, None]
        return self.head(torch.tanh(self.mix(torch.cat([h, h.cumsum(1) / steps], -1))))

    def targets(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits[:, :-1], input_ids[:, 1:]  # position t predicts token t + 1

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.logits(input_ids)
        scores, labels = self.targets(logits, input_ids)
        loss = torch.nn.functional.cross_entropy(scores.reshape(-1, self.vocab), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


class UnshiftedTargets(TokenModel):
    """Its targets are not shifted: position t is trained to predict token t, which it sees; one batch
    overfits as far either way, fresh batches tell (target_leak)."""

    def targets(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits, input_ids


class NanGrad(torch.autograd.Function):
    """The identity forward; a NaN gradient backward (a custom backward with a bug)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")
