"""Models the benchmark builds: the torchvision cases of issue 14, and a GPT-2-style user model.

The user model is written the way a user writes one (plain ``nn.Module``s, ``nn.Linear`` projections,
``F.scaled_dot_product_attention``), not taken from a library, so the benchmark also covers code that no
library's hooks were tuned for. Random init only: nothing here downloads weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one ``qkv`` projection, SDPA with ``is_causal``, one output projection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 50257
    width: int = 768
    heads: int = 12
    layers: int = 4
    max_len: int = 1024


class GPT(nn.Module):
    """A GPT-2-style decoder: token embedding + learned positions, pre-LN blocks, final LayerNorm, and an
    output head tied to the token embedding. Input: int64 token ids ``(batch, seq)``; output: logits."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Embedding(config.max_len, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of the residual projections
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


#: The ~1B-parameter decoder of the GPU rows: width 2048, 16 heads, 20 layers (1.11B with the tied head).
GPT_1B = GPTConfig(width=2048, heads=16, layers=20)


#: The training model of the watch rows (issue 22): width 512, 4 layers, 8 heads, positions up to 128. The
#: vocabulary is 8192, not GPT-2's 50257: at 50257 the output head and its cross-entropy, which the watch
#: does not touch, would be most of the step and flatter the ratios.
WATCH_GPT = GPTConfig(vocab=8192, width=512, heads=8, layers=4, max_len=128)


@dataclass(frozen=True)
class Case:
    """One benchmark case: a model, its input, and the ``input_shapes`` spec the API is given for it."""

    name: str  # as printed, e.g. "resnet50 b8 224"
    model: nn.Module
    x: torch.Tensor
    spec: str  # e.g. "8x3x224x224" or "1x128:int64"


def torchvision_case(arch: str, batch: int, size: int = 224, *, seed: int = 0) -> Case:
    """A torchvision classifier with random init, in eval mode, and a randn image batch."""
    from torchvision import models

    torch.manual_seed(seed)
    model = getattr(models, arch)(weights=None).eval()
    x = torch.randn(batch, 3, size, size)
    return Case(f"{arch} b{batch}" + (f" {size}" if size != 224 or batch > 1 else ""), model, x,
                f"{batch}x3x{size}x{size}")


def gpt_case(config: GPTConfig = GPTConfig(), batch: int = 1, seq: int = 128, *, seed: int = 0,
             name: str | None = None) -> Case:
    """The GPT-2-style user model (random init, eval mode) and random int64 token ids below the vocabulary."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    x = torch.randint(0, config.vocab, (batch, seq), dtype=torch.int64)
    return Case(name or f"gpt2-style user {config.layers}L b{batch} s{seq}", model, x, f"{batch}x{seq}:int64")


#: The table of issue 14: (builder, arguments), built one at a time so only one model is in memory.
TABLE: list[tuple[str, Any, tuple[Any, ...]]] = [
    ("resnet50 b8 224", torchvision_case, ("resnet50", 8)),
    ("mobilenet_v3_small b1", torchvision_case, ("mobilenet_v3_small", 1)),
    ("efficientnet_b0 b1", torchvision_case, ("efficientnet_b0", 1)),
    ("vit_b_16 b1", torchvision_case, ("vit_b_16", 1)),
    ("convnext_tiny b1", torchvision_case, ("convnext_tiny", 1)),
    ("gpt2-style user 4L b1 s128", gpt_case, ()),
]


def build(name: str) -> Case:
    """The case of TABLE called ``name``, freshly built."""
    for label, builder, args in TABLE:
        if label == name:
            case = builder(*args)
            return Case(label, case.model, case.x, case.spec)
    raise KeyError(name)
