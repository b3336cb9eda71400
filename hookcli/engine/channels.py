"""Which dimension of a module's output holds its channels, and the per-channel count of its nonzero
values: ``check``'s ``dead_channels`` rule and ``hookcli.watch``'s per-channel ``dead_units`` share them."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

#: Modules whose output keeps its channels in dim 1 ([B, C, ...]: convolutions and the norms over them)
#: and modules that work on the last dimension ([..., C]: linear layers, layer norms, embeddings).
_CHANNELS_FIRST = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
                   nn.GroupNorm, nn.LocalResponseNorm)
_CHANNELS_LAST = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.RMSNorm, nn.Embedding, nn.EmbeddingBag,
                  nn.MultiheadAttention)


class ChannelDims:
    """The channel dimension of each output (``dead_channels``' ``dim = "auto"``, the watch's channels).

    A module that fixes the layout says it: convolutions and batch/instance/group norms put channels in
    dim 1 ([B, C, L], [B, C, H, W]); linear layers, layer norms, embeddings and attention in the last
    ([B, T, C], Swin's [B, H, W, C]). Any other module (an activation, dropout, a container, a block of
    a library) inherits the layout of the latest such output of the same shape in this run (outputs
    arrive as calls finish, so a container's children come first); otherwise a 3-D output is taken as
    a sequence [B, T, C] (last) and any other as [B, C, ...] (dim 1)."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.modules = modules
        self.seen: dict[tuple[int, ...], int] = {}

    def __call__(self, name: str, t: torch.Tensor) -> int:
        module = self.modules.get(name)
        shape = tuple(t.shape)
        if isinstance(module, _CHANNELS_FIRST):
            dim = 1
        elif isinstance(module, _CHANNELS_LAST):
            dim = t.dim() - 1
        else:
            return self.seen.get(shape, t.dim() - 1 if t.dim() == 3 else 1)
        self.seen[shape] = dim
        return dim


def has_channels(t: torch.Tensor) -> bool:
    """Whether ``t`` is a float output with a channel dimension to count over (2-D or more, not empty,
    dense, on a real device)."""
    return (t.is_floating_point() and not t.is_nested and t.layout == torch.strided and t.dim() >= 2
            and t.numel() > 0 and t.device.type != "meta")


def channel_nonzeros(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The count of nonzero values (NaN counts as nonzero) in each channel along ``dim`` of ``t``: one
    reduction on the device, a vector of ``t.shape[dim]`` int64 (each channel holds ``numel // C`` values)."""
    others = [i for i in range(t.dim()) if i != dim % t.dim()]
    return torch.count_nonzero(t.detach(), dim=others)


def channel_abs_max(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The largest magnitude in each channel along ``dim`` of ``t`` (NaN where a channel holds one): two
    reductions on the device (max and min: no full-size ``abs`` temporary), a float vector of ``t.shape[dim]``."""
    others = [i for i in range(t.dim()) if i != dim % t.dim()]
    t = t.detach()
    return torch.maximum(torch.amax(t, dim=others), torch.amin(t, dim=others).neg()).float()
