"""The inputs of one run (``ModelInputs``) and what both input builders share.

``build_inputs`` generates them from shapes and per-model defaults, ``read_inputs`` reads them from
images and tensor files; both pack their tensors here, so neither imports the other at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hookcli.engine.loading import LoadedModel
from hookcli.records import InputInfo


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TENSOR_SUFFIXES = (".pt", ".pth", ".npy", ".npz", ".safetensors")


@dataclass
class ModelInputs:
    """Positional and keyword inputs, plus one InputInfo per input for the report."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    infos: list[InputInfo]


def info_of(name: str, value: Any, source: str) -> InputInfo:
    """InputInfo of a tensor, a list of same-dtype tensors (shape as if stacked), or a value."""
    if isinstance(value, torch.Tensor):
        return InputInfo(name, list(value.shape), str(value.dtype).removeprefix("torch."), source)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        same = all(v.shape == value[0].shape for v in value)
        return InputInfo(name, [len(value), *value[0].shape] if same else None,
                         str(value[0].dtype).removeprefix("torch."), source)
    return InputInfo(name, None, type(value).__name__, source)


def pack_inputs(args: Sequence[tuple[Any, str]], kwargs: Sequence[tuple[str, Any, str]] = ()
          ) -> ModelInputs:
    """ModelInputs from (value, source) positional and (name, value, source) keyword entries."""
    infos = [info_of(str(i), v, src) for i, (v, src) in enumerate(args)]
    infos += [info_of(k, v, src) for k, v, src in kwargs]
    return ModelInputs(tuple(v for v, _ in args), {k: v for k, v, _ in kwargs}, infos)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def transform_size(loaded: LoadedModel, attr: str, fallback: int) -> int:
    """The model's own ``image_size`` (ViT: vit_h_14 without weights is 224, its weights 518), else
    ``crop_size``/``resize_size`` of the weights' preset transforms, else ``fallback``."""
    own = getattr(loaded.model, "image_size", None)
    if isinstance(own, int) and attr == "crop_size":
        return own
    enum = loaded.weights_enum
    try:
        value = getattr(enum.transforms(), attr, None) if enum is not None else None
    except Exception:  # preset transforms that cannot be built: fall back
        return fallback
    return int(value[0]) if value else fallback
