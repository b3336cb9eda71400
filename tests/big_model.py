"""A 7B-parameter language model (32 transformer blocks of width 4096, a 32k vocabulary), for ``shapes``
on the meta device: tests/test_scale.py checks its weights are never allocated, and
benchmarks/bench.py times it. Importing this file allocates nothing; building ``Big()`` on CPU would
take 26 GB."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 32, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Big(nn.Module):
    """About 7B parameters: 32 transformer blocks of width 4096 and a 32k vocabulary."""

    example_inputs = (torch.zeros(1, 16, dtype=torch.long),)

    def __init__(self, d=4096, layers=32, vocab=32000):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))
