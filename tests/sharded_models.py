"""Tiny models for tests/test_distributed_cli.py (``tests/sharded_models.py:NAME`` as a hookcli MODEL)."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear -> Tanh -> Linear with a random persistent buffer and a
    random non-persistent one (a state dict leaves it out), both used in forward; BatchNorm's running
    statistics drawn at random too, so materialising from rank 0 must carry every buffer. Widths 10, 5
    and 3 split unevenly over 2 ranks (FSDP2 shards dim 0: 5 rows as 3 + 2, 3 as 2 + 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.bn = nn.BatchNorm1d(10)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(10, 5)
        self.tanh = nn.Tanh()
        self.head = nn.Linear(5, 3)
        self.register_buffer("shift", torch.randn(10))
        self.register_buffer("scale", torch.rand(5) + 0.5, persistent=False)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tanh(self.fc2(self.act(self.bn(self.fc1(x)) + self.shift)) * self.scale))


def build() -> nn.Module:
    return Net()


class Picky(nn.Module):
    """Raises when it gets fewer than 3 samples: under ``--shard ddp`` on 2 ranks with a batch of 5,
    rank 1 (2 samples) fails and rank 0 (3) does not."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 3:
            raise ValueError(f"picky: needs 3 samples, got {x.shape[0]}")
        return self.fc(x)


def picky() -> nn.Module:
    return Picky()


def no_linear() -> nn.Module:
    """Nothing tensor parallelism could split (``--shard tp`` refuses it)."""
    return nn.Sequential(nn.Conv1d(2, 3, 1), nn.ReLU())


class Tied(nn.Module):
    """A language model's embedding tied to its output head (as ``hf:gpt2``'s wte and lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def tied() -> nn.Module:
    return Tied()


class HostFails(nn.Module):
    """Raises when built on the host, not on the meta device: under ``--shard`` rank 0 alone builds the
    full model on the host (to fill every rank's part from it), so rank 0 alone fails."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        if self.fc.weight.device.type != "meta":
            raise MemoryError("host-fails: out of host memory")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def host_fails() -> nn.Module:
    return HostFails()


def rank1_fails() -> nn.Module:
    """Raises on rank 1 only (its meta build), rank 0 builds it on the host and on meta alike."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
        raise ValueError("rank1-fails: no model here")
    return nn.Sequential(nn.Linear(6, 4))


class ReadsValues(nn.Module):
    """Reads a value its ``__init__`` computed with torch (``.item()``, as torchvision's RegNet reads its
    widths with ``.tolist()``): its code cannot run on the meta device. A random buffer too."""

    def __init__(self) -> None:
        super().__init__()
        width = int(torch.tensor([2.0]).pow(3).item())  # 8
        self.fc1 = nn.Linear(6, width)
        self.fc2 = nn.Linear(width, 3)
        self.register_buffer("shift", torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x) + self.shift))


def reads_values() -> nn.Module:
    return ReadsValues()


def attention() -> nn.Module:
    """A transformer encoder layer (no dropout): its ``MultiheadAttention`` reads ``out_proj.weight``
    without calling ``out_proj``, so ``--shard tp`` must leave that Linear whole."""
    return nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
