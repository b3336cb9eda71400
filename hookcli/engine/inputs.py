"""Build the inputs a model is run on: from shapes, from files, or a per-model default.

Everything is built on CPU (the caller moves it to a device and dtype). Random fills use their own
seeded ``torch.Generator`` so runs are reproducible and the global RNG is never touched. Each input
gets an ``InputInfo`` that says where it came from, including when its shape was only a guess.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import math

from hookcli.errors import InputError, UsageError, describe_exception, did_you_mean
from hookcli.options import (
    DTYPE_ALIASES, FILLS, INPUT_DTYPES, MAX_NUMEL, SHAPE_EXAMPLE, Fill, InputSpec, member, parse_input_shape,
)
from hookcli.engine.loading import LoadedModel
from hookcli.engine.model_inputs import (
    IMAGE_SUFFIXES, TENSOR_SUFFIXES, ModelInputs, info_of, pack_inputs, plural, transform_size,
)
from hookcli.records import InputInfo

def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _gb(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_input_size(shape: Sequence[int], dtype: torch.dtype) -> None:
    """Refuse (InputError, exit 2) a generated input that cannot fit in memory, before allocating it
    (with memory overcommit a huge allocation can succeed and the filling then kills the process)."""
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    memory = _memory_bytes()
    if numel > MAX_NUMEL or (memory is not None and size > memory):
        dims = "x".join(map(str, shape))
        have = f"this machine has {_gb(memory)}" if memory is not None else "more than a tensor can hold"
        raise InputError(f"input shape {_short(dims)} ({str(dtype).removeprefix('torch.')}) needs {_gb(size)}; {have}",
                         hint="use a smaller --input-shape or --batch-size")


# --------------------------------------------------------------------------- generated inputs


def _first_leaf(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first leaf module (in ``named_modules`` order) that has parameters of its own."""
    for name, module in model.named_modules():
        if next(module.children(), None) is None and next(module.parameters(False), None) is not None:
            return name, module
    return None


def _fill(shape: Sequence[int], dtype: torch.dtype, fill: str, gen: torch.Generator, seed: int,
          model: nn.Module | None = None) -> tuple[torch.Tensor, str]:
    """One tensor of ``fill`` kind and its source text. Integer dtypes get randint in [0, high):
    2 for bool, the vocabulary size when ``model`` starts with an embedding, else 10."""
    check_input_size(shape, dtype)
    try:
        return _fill_unchecked(shape, dtype, fill, gen, seed, model)
    except RuntimeError as exc:  # allocation failed (the size check passed: memory is in use)
        dims = "x".join(map(str, shape))
        raise InputError(f"cannot make an input of shape {_short(dims)}: {describe_exception(exc)}",
                         hint="use a smaller --input-shape or --batch-size") from exc


def _fill_unchecked(shape: Sequence[int], dtype: torch.dtype, fill: str, gen: torch.Generator, seed: int,
                    model: nn.Module | None = None) -> tuple[torch.Tensor, str]:
    if fill in (Fill.ones, Fill.zeros):
        return (torch.ones if fill == Fill.ones else torch.zeros)(tuple(shape), dtype=dtype), str(fill)
    if not (dtype.is_floating_point or dtype.is_complex):
        leaf = _first_leaf(model) if model is not None else None
        high = 2 if dtype == torch.bool else 10
        if leaf is not None and isinstance(leaf[1], (nn.Embedding, nn.EmbeddingBag)) and high == 10:
            high = int(leaf[1].num_embeddings)
        t = torch.randint(0, high, tuple(shape), generator=gen, dtype=torch.int64).to(dtype)
        return t, f"randint(0, {high}, seed={seed})"
    make = torch.randn if fill == Fill.randn else torch.rand
    base = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return make(tuple(shape), generator=gen, dtype=base).to(dtype), f"{fill}(seed={seed})"


#: First layer type -> guessed input shape (given the layer and the batch size).
_GUESSES: list[tuple[tuple[type, ...], Callable[[Any, int], tuple[int, ...]]]] = [
    ((nn.Embedding, nn.EmbeddingBag), lambda m, b: (b, 16)),
    ((nn.Linear,), lambda m, b: (b, m.in_features)),
    ((nn.Conv1d, nn.ConvTranspose1d), lambda m, b: (b, m.in_channels, 64)),
    ((nn.Conv2d, nn.ConvTranspose2d), lambda m, b: (b, m.in_channels, 224, 224)),
    ((nn.Conv3d, nn.ConvTranspose3d), lambda m, b: (b, m.in_channels, 16, 112, 112)),
    ((nn.RNNBase,), lambda m, b: (b, 8, m.input_size) if m.batch_first else (8, b, m.input_size)),
    ((nn.BatchNorm1d,), lambda m, b: (b, m.num_features)),
    ((nn.BatchNorm2d,), lambda m, b: (b, m.num_features, 224, 224)),
    ((nn.LayerNorm,), lambda m, b: (b, *m.normalized_shape)),
]


def _guess_user_shape(model: nn.Module, b: int) -> tuple[tuple[int, ...], torch.dtype, str]:
    """Guess one input shape from the first parametrised leaf; the note says what it was."""
    leaf = _first_leaf(model)
    if leaf is None:
        return (b, 3, 224, 224), torch.float32, "shape guessed (no layer with parameters)"
    name, m = leaf
    if not isinstance(m, nn.modules.lazy.LazyModuleMixin):  # lazy: sizes unknown until called
        for types, guess in _GUESSES:
            if isinstance(m, types):
                dtype = torch.int64 if types[0] is nn.Embedding else torch.float32
                return guess(m, b), dtype, f"shape guessed from {name} ({type(m).__name__})"
    note = f"shape guessed (default; first layer {name} is {type(m).__name__})"
    return (b, 3, 224, 224), torch.float32, note


def _example_inputs(model: nn.Module) -> ModelInputs | None:
    """Inputs from a model's own ``example_inputs`` / ``example_input`` attribute, if any."""
    for attr in ("example_inputs", "example_input"):
        value = getattr(model, attr, None)
        if value is None or isinstance(value, nn.Module):
            continue
        if callable(value) and not isinstance(value, torch.Tensor):
            try:
                value = value()
            except Exception as exc:
                raise InputError(f"model.{attr}() raised {describe_exception(exc)}",
                                 hint=f"fix the model's {attr}, or give inputs with --input-shape / --input") from exc

        def clone(v: Any) -> Any:  # in-place layers must not change the model's own examples
            return v.clone() if isinstance(v, torch.Tensor) else v
        if isinstance(value, dict):
            return pack_inputs([], [(str(k), clone(v), attr) for k, v in value.items()])
        return pack_inputs([(clone(v), attr) for v in (value if isinstance(value, (tuple, list)) else (value,))])
    return None


def _default_inputs(loaded: LoadedModel, b: int, fill: str, gen: torch.Generator,
                    seed: int) -> ModelInputs:
    """Per-model default inputs when neither shapes nor files are given."""
    found = _example_inputs(loaded.model)
    if found is not None:
        return found
    family, name, f32 = loaded.family, loaded.tv_name or "", model_float_dtype(loaded.model)
    if family is None:
        shape, dtype, note = _guess_user_shape(loaded.model, b)
        dtype = f32 if dtype.is_floating_point else dtype
        t, src = _fill(shape, dtype, fill, gen, seed, loaded.model)
        return pack_inputs([(t, f"{src}, {note}")])
    if family == "detection":  # a list of CHW images, as torchvision detection models take
        s = 300 if name.startswith("ssd300") else 320
        t, src = _fill((b, 3, s, s), f32, fill, gen, seed)
        return pack_inputs([(list(t.unbind(0)), f"{src}, list of {plural(b, 'image')}")])
    if family == "optical_flow":  # two frames; RAFT needs H, W divisible by 8 (224 runs)
        return pack_inputs([_fill((b, 3, 224, 224), f32, fill, gen, seed) for _ in range(2)])
    # classification / quantization: the preset crop; segmentation: its resize; video: 16 frames
    where = {"segmentation": ("resize_size", 520), "video": ("crop_size", 112)}
    s = transform_size(loaded, *where.get(family, ("crop_size", 224)))
    shape = (b, 3, 16, s, s) if family == "video" else (b, 3, s, s)
    return pack_inputs([_fill(shape, f32, fill, gen, seed)])


# --------------------------------------------------------------------------- entry point


def make_inputs(loaded: LoadedModel, *, shapes: Sequence[InputSpec] = (),
                files: Sequence[str | os.PathLike[str]] = (), batch_size: int | None = None,
                fill: Fill | str = Fill.randn, seed: int = 0, trust_pickle: bool = False) -> ModelInputs:
    """Build CPU inputs for ``loaded.model``.

    ``shapes``: one positional input per spec (``batch_size`` replaces dim 0; no dtype: int64 ids
    for a model that starts with an embedding, else float32). ``files``: images or folders of
    images (one preprocessed batch; detection: a list of images; video: the frames of one clip;
    optical flow: two frames) or tensor files (.pt/.pth/.npy/.npz/.safetensors); files decide the
    batch, so ``batch_size`` is ignored with them. Neither: the model's ``example_inputs``, else a
    per-family torchvision default, else a shape guessed from the model's first layer. ``fill``
    and ``seed`` apply to generated tensors only. ``trust_pickle`` lets torch.load unpickle
    arbitrary objects from .pt/.pth files (it runs code from them); else weights_only loading.
    """
    fill = member(Fill, fill, "fill")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"batch size must be a positive integer, got {batch_size}", hint="e.g. --batch-size 2")
    if shapes and files:
        raise UsageError("give input shapes or input files, not both",
                         hint="--input-shape makes random tensors; --input reads files")
    gen = torch.Generator().manual_seed(seed)
    if files:
        from hookcli.engine.input_files import expand_files, image_inputs, tensor_inputs  # decoders only when needed

        kind, paths, label = expand_files(files)
        if kind == "images":
            made = image_inputs(loaded, paths, label)
            made = _cast_floats(made, model_float_dtype(loaded.model))
        else:
            made = tensor_inputs(loaded, files, trust_pickle=trust_pickle)
    elif not shapes:
        made = _default_inputs(loaded, batch_size or 1, fill, gen, seed)
    else:
        fdt = model_float_dtype(loaded.model)
        guessed = _guess_user_shape(loaded.model, 1)[1] if loaded.family is None else fdt
        guessed = fdt if guessed.is_floating_point else guessed
        made = pack_inputs([
            _fill((batch_size, *spec.shape[1:]) if batch_size is not None else spec.shape,
                  getattr(torch, spec.dtype) if spec.dtype else guessed, fill, gen, seed, loaded.model)
            for spec in shapes])
    return made


def model_float_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype the model computes in: that of the first parametrised leaf's first
    floating parameter (the layer that receives the input), else any floating parameter or
    buffer, else float32. Generated float inputs get it, so a float16/bfloat16 model runs."""
    leaf = _first_leaf(model)
    tensors = list(leaf[1].parameters(False)) if leaf is not None else []
    tensors += list(model.parameters()) + list(model.buffers())
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def _cast_floats(inputs: ModelInputs, dtype: torch.dtype) -> ModelInputs:
    """Cast the floating tensors of generated inputs (decoded images) to the model's dtype."""
    if dtype == torch.float32:
        return inputs

    def cast(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(dtype) if v.is_floating_point() else v
        if isinstance(v, list):
            return [cast(x) for x in v]
        return v

    return pack_inputs([(cast(v), info.source) for v, info in zip(inputs.args, inputs.infos)],
                       [(k, cast(v), info.source) for (k, v), info in
                        zip(inputs.kwargs.items(), inputs.infos[len(inputs.args):])])


def _describe_inputs(inputs: ModelInputs) -> str:
    shown = [("x".join(map(str, i.shape)) if i.shape is not None else i.dtype) for i in inputs.infos]
    positional = ", ".join(shown[: len(inputs.args)])
    named = ", ".join(f"{k}={v}" for k, v in zip(inputs.kwargs, shown[len(inputs.args):]))
    return _short(", ".join(p for p in (positional, named) if p), 200)


def check_signature(model: nn.Module, inputs: ModelInputs) -> None:
    """Bind the inputs to ``model.forward``'s signature before running: too many, too few or
    unknown keyword inputs are a usage error (exit 2) with the signature, never "the model raised".

    Skipped where the signature cannot be read (TorchScript, builtins) or a forward pre-hook may
    rewrite the arguments.
    """
    if model._forward_pre_hooks or getattr(nn.modules.module, "_global_forward_pre_hooks", None):
        return
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*inputs.args, **inputs.kwargs)
    except TypeError as exc:
        count = len(inputs.args) + len(inputs.kwargs)
        raise InputError(
            f"{type(model).__name__}.forward cannot take the {plural(count, 'input')} given "
            f"({_describe_inputs(inputs)}): {exc}",
            hint=f"forward{_short(str(signature), 160)}: give one --input-shape (or tensor of an --input "
            "file) per argument; keyword arguments by name in an .npz/.safetensors/.pt dict") from None
