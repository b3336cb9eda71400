"""Hand-written sequence models for tests/test_model_sources.py (``seq_models:EmbedLSTM`` ...)."""

from __future__ import annotations

import torch
from torch import nn


class EmbedLSTM(nn.Module):
    """Token ids -> Embedding -> LSTM (batch_first) -> per-step logits: the first module is an Embedding."""

    def __init__(self, vocab: int = 50, dim: int = 8, hidden: int = 12, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


class GRUFirst(nn.Module):
    """[seq, batch, features] (batch_first=False) into a GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(6, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[-1])


class EncoderFirst(nn.Module):
    """A TransformerEncoder (batch_first) as the first module, then a linear head per token."""

    def __init__(self, d_model: int = 16) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def tiny_transformer() -> nn.Transformer:
    """An nn.Transformer (seq-first): forward(src, tgt)."""
    return nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                          dim_feedforward=16, dropout=0.0)


from dataclasses import dataclass
from typing import NamedTuple


@dataclass
class Out:
    """A dataclass output (not a mapping): walked by field, ``.logits``."""

    hidden: torch.Tensor
    logits: torch.Tensor


class Pair(NamedTuple):
    hidden: torch.Tensor
    logits: torch.Tensor


class StructuredOut(nn.Module):
    """Returns a dataclass (``as_tuple=False``) or a named tuple of (hidden, logits)."""

    def __init__(self, as_tuple: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)
        self.as_tuple = as_tuple

    def forward(self, x: torch.Tensor) -> Out | Pair:
        hidden = torch.tanh(self.fc(x))
        return (Pair if self.as_tuple else Out)(hidden, self.head(hidden))
