"""Seeded bugs for the probe rules of ``hookcli check`` (issue #23) and a layer-scale model for grad_norm.

Each bug sits in one named module, so a test can assert that the rule names it.
"""

from __future__ import annotations

import torch
from torch import nn


class ToTokens(nn.Module):
    """[B, C, H, W] -> [B, H*W, C]; ``wrong``: a view with the batch and channels swapped (mixes samples)."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        if self.wrong:
            return x.view(c, b, h * w).permute(1, 2, 0)
        return x.view(b, c, h * w).transpose(1, 2)


class ConvTokens(nn.Module):
    """A convolution, then tokens, then a linear head on the mean token."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.to_tokens = ToTokens(wrong)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.to_tokens(self.conv(x)).mean(1))


class Attention(nn.Module):
    """Multi-head self-attention; ``wrong``: heads split with reshape(heads, B, T, d) across the batch."""

    def __init__(self, dim: int = 16, heads: int = 2, wrong: bool = False) -> None:
        super().__init__()
        self.heads, self.wrong = heads, wrong
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.wrong:
            q, k, v = (z.reshape(self.heads, b, t, c // self.heads).transpose(0, 1) for z in (q, k, v))
        else:
            q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        out = torch.softmax(q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, t, c)


class TinyTransformer(nn.Module):
    """Token embedding, one attention block, a vocabulary head (next-token logits)."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.attn = Attention(wrong=wrong)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(self.norm(h + self.attn(h)))


class Center(nn.Module):
    """Subtracts the batch mean: normalisation without BatchNorm that mixes the samples (also in eval)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)


class Centered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.center = Center()
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.center(self.fc1(x))))


class IgnoresInput(nn.Module):
    """Its head reads a learned query instead of the encoded input (``h`` is computed, then unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 12)
        self.query = nn.Parameter(torch.randn(12))
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)  # noqa: F841 - the bug
        return self.head(self.query.expand(x.shape[0], -1) + 0 * h.detach())


class SquaredMeanLoss(nn.Module):
    """Returns its own loss: the squared batch mean of the outputs (a mean over the micro-batch done
    wrong: the mean of per-sample losses would accumulate; this does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out.mean(0).pow(2).sum()


class MeanLoss(SquaredMeanLoss):
    """The same model with a per-sample loss averaged over the batch (accumulates)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out.pow(2).sum(1).mean()


class SumOverBatchSquared(SquaredMeanLoss):
    """A batch-size-dependent term: the sum of squares divided by the batch size squared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out.pow(2).sum() / x.shape[0] ** 2


class LayerScaleNet(nn.Module):
    """A residual MLP block behind a layer scale of 1e-6 whose attention-like temperature gets a
    gradient far below 1e-12 at init. ``dead``: the block's hidden ReLU is dead (bias -100), so the
    layers before it get no gradient however large the layer scale: still vanishing."""

    def __init__(self, dead: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.fc1 = nn.Linear(16, 16)
        self.temperature = nn.Parameter(torch.ones(1))
        self.fc2 = nn.Linear(16, 16)
        self.gamma = nn.Parameter(1e-6 * torch.ones(16))
        self.head = nn.Linear(16, 4)
        if dead:
            with torch.no_grad():
                self.fc1.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        z = torch.relu(self.fc1(h)) * self.temperature * 1e-6
        return self.head(h + self.gamma * self.fc2(z))


class FunctionalDropout(MeanLoss):
    """A mean loss (accumulates) with ``F.dropout`` in forward: no dropout module to see."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.tanh(self.fc1(x)), p=0.5, training=self.training)
        return self.fc2(h).pow(2).sum(1).mean()
