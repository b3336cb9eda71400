"""Hand the user's model back exactly as it came: mode, device, dtype, requires_grad, .grad, buffers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def preserved(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    train: bool = False,
) -> Iterator[nn.Module]:
    """Put ``model`` on ``device``/``dtype`` in train or eval mode for the block, then restore it.

    Restored in ``finally`` (also when the block raises): each module's ``training`` flag, each
    parameter's storage (device and dtype), ``requires_grad`` and ``.grad`` (object and data), and each
    buffer (object, and its values when train mode may have updated running statistics in place).
    """
    modules = list(model.modules())
    training = [(m, m.training) for m in modules]
    params = [p for m in modules for p in m._parameters.values() if p is not None]
    params = list({id(p): p for p in params}.values())
    param_state = [(p, p.data, p.requires_grad, p.grad, p.grad.data if p.grad is not None else None) for p in params]
    buffer_state = [
        (m, name, buf, buf.detach().clone() if train else None)
        for m in modules for name, buf in m._buffers.items() if buf is not None
    ]
    try:
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        model.train(train)
        yield model
    finally:
        for p, data, requires_grad, grad, grad_data in param_state:
            p.data = data
            if grad is not None and grad_data is not None:
                grad.data = grad_data
            p.grad = grad
            if p.requires_grad != requires_grad:  # (an inference tensor refuses even a no-op set)
                p.requires_grad_(requires_grad)
        for m, name, buf, snapshot in buffer_state:
            m._buffers[name] = buf
            if snapshot is not None:
                with torch.no_grad():
                    buf.copy_(snapshot)
        for m, was_training in training:
            m.training = was_training


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU for a model with neither)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")
