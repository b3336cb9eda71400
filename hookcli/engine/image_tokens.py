"""How many image placeholder tokens a vision-language model wants in ``input_ids`` for its images.

A vision-language model (transformers' llava, paligemma, gemma3, ...) replaces each image placeholder
token (its config's ``image_token_id``) of ``input_ids`` with one row of the image features, and refuses
``input_ids`` whose count of placeholders differs from the number of feature rows its vision tower gives
for ``pixel_values``. That number depends on the config (image and patch size, the projector's pooling),
so it is measured: the model's ``get_image_features`` runs without computing anything (on the meta device
for a model built there, else on fake tensors), and its rows are counted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hookcli.engine.meta_values import MetaValues


def image_token_id(config: Any) -> int | None:
    """The placeholder token id of a vision-language config (``image_token_id``/``image_token_index``)."""
    for field in ("image_token_id", "image_token_index"):
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _features(out: Any) -> list[torch.Tensor]:
    """The image feature tensors in what ``get_image_features`` returned (a tensor, a list of them per
    image, or a ModelOutput whose ``pooler_output`` holds the projected features)."""
    pooled = getattr(out, "pooler_output", None)
    if pooled is not None:
        out = pooled
    elif hasattr(out, "to_tuple"):
        out = out.to_tuple()[0]
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def image_token_count(model: nn.Module, pixel_values: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """Placeholder tokens per sample that ``model`` wants for ``pixel_values`` (batch first), with the
    pixel values as it takes them: ``[batch, channels, height, width]``, else one image per sample
    (``[batch, 1, channels, height, width]``, idefics3's); None when it has no ``get_image_features``
    or that cannot run without values."""
    get = getattr(model, "get_image_features", None)
    param = next(model.parameters(), None)
    if get is None or param is None:
        return None
    for pixels in (pixel_values, pixel_values.unsqueeze(1)):
        try:
            features = _features(_run_shapes_only(get, pixels, param))
        except Exception:  # the vision tower needs values or other pixels: try the next layout
            continue
        rows = sum(t.numel() // t.shape[-1] for t in features if t.dim() >= 1 and t.shape[-1] > 0)
        batch = pixel_values.shape[0]
        return (rows // batch, pixels) if rows and rows % batch == 0 else None
    return None


def _run_shapes_only(get: Any, pixels: torch.Tensor, param: torch.Tensor) -> Any:
    """``get(pixel_values=pixels)`` computing shapes only: on meta for a model built there, else on fake tensors."""
    if param.device.type == "meta":
        with MetaValues():
            return get(pixel_values=pixels.to(device="meta", dtype=param.dtype))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        return get(pixel_values=mode.from_tensor(pixels.to(device=param.device, dtype=param.dtype)))
