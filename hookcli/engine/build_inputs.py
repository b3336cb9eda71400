"""Build the inputs a model is run on (``make_inputs``, the one entry): generated from shapes or a
per-model default (torchvision metadata, ``example_inputs``, or guessed from the first layer), or read
from files by ``read_inputs``.

Everything is built on CPU (the caller moves it to a device and dtype). Random fills use their own
seeded ``torch.Generator`` so runs are reproducible and the global RNG is never touched. Each input
gets an ``InputInfo`` that says where it came from, including when its shape was only a guess.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import math

from hookcli import limits
from hookcli.errors import InputError, UsageError, describe_exception
from hookcli.options import (
    MAX_NUMEL, Fill, InputSpec, MemoryInputs, member,
)
from hookcli.engine.image_tokens import image_token_count, image_token_id
from hookcli.engine.loading import LoadedModel
from hookcli.engine.input_types import (
    ModelInputs, pack_inputs, plural, transform_size,
)

def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gb(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_input_size(shape: Sequence[int], dtype: torch.dtype) -> None:
    """Refuse (InputError, exit 2) a generated input that cannot fit in memory, before allocating it
    (with memory overcommit a huge allocation can succeed and the filling then kills the process)."""
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    memory = limits.memory_bytes()
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
          model: nn.Module | None = None, name: str | None = None) -> tuple[torch.Tensor, str]:
    """One tensor of ``fill`` kind and its source text. Integer dtypes get randint in [0, high):
    2 for bool, the vocabulary size for token ids (see ``_integer_high``), else 10; an integer
    keyword input whose name says it is a mask (``attention_mask``) is all ones."""
    check_input_size(shape, dtype)
    try:
        return _fill_unchecked(shape, dtype, fill, gen, seed, model, name)
    except RuntimeError as exc:  # allocation failed (the size check passed: memory is in use)
        dims = "x".join(map(str, shape))
        raise InputError(f"cannot make an input of shape {_short(dims)}: {describe_exception(exc)}",
                         hint="use a smaller --input-shape or --batch-size") from exc


def _integer_high(model: nn.Module | None, name: str | None) -> int:
    """The exclusive upper bound of random integer inputs: the matching vocabulary size of a
    transformers config (``input_ids``: vocab_size, ``token_type_ids``: type_vocab_size; the smallest
    of the config's and its text model's), the
    ``num_embeddings`` of an embedding the input goes into, else 10."""
    if model is None:
        return 10
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "model_type"):
        field = "type_vocab_size" if name == "token_type_ids" else "vocab_size"
        highs = [getattr(where, field, None) for where in
                 (config, getattr(config, "text_config", None), getattr(config, "decoder", None)) if where is not None]
        highs = [high for high in highs if isinstance(high, int) and high > 0]
        if highs:  # the smallest: a vision-language config's own vocab_size can be larger than its text model's
            return min(highs)
    leaf = _input_module(model)
    if leaf is not None and isinstance(leaf[1], (nn.Embedding, nn.EmbeddingBag)):
        return int(leaf[1].num_embeddings)
    return 10


def _fill_unchecked(shape: Sequence[int], dtype: torch.dtype, fill: str, gen: torch.Generator, seed: int,
                    model: nn.Module | None = None, name: str | None = None) -> tuple[torch.Tensor, str]:
    if fill in (Fill.ones, Fill.zeros):
        return (torch.ones if fill == Fill.ones else torch.zeros)(tuple(shape), dtype=dtype), str(fill)
    if not (dtype.is_floating_point or dtype.is_complex) and name is not None and "mask" in name:
        return torch.ones(tuple(shape), dtype=dtype), "ones (a mask)"
    if not (dtype.is_floating_point or dtype.is_complex):
        high = 2 if dtype == torch.bool else _integer_high(model, name)
        t = torch.randint(0, high, tuple(shape), generator=gen, dtype=torch.int64).to(dtype)
        return t, f"randint(0, {high}, seed={seed})"
    make = torch.randn if fill == Fill.randn else torch.rand
    base = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    return make(tuple(shape), generator=gen, dtype=base).to(dtype), f"{fill}(seed={seed})"


#: First layer type -> guessed input shape (given the layer, the batch size and the sequence length).
_GUESSES: list[tuple[tuple[type, ...], Callable[[Any, int, int], tuple[int, ...]]]] = [
    ((nn.Embedding, nn.EmbeddingBag), lambda m, b, t: (b, t)),
    ((nn.Linear,), lambda m, b, t: (b, m.in_features)),
    ((nn.Conv1d, nn.ConvTranspose1d), lambda m, b, t: (b, m.in_channels, 64)),
    ((nn.Conv2d, nn.ConvTranspose2d), lambda m, b, t: (b, m.in_channels, 224, 224)),
    ((nn.Conv3d, nn.ConvTranspose3d), lambda m, b, t: (b, m.in_channels, 16, 112, 112)),
    ((nn.RNNBase,), lambda m, b, t: (b, t, m.input_size) if m.batch_first else (t, b, m.input_size)),
    ((nn.BatchNorm1d,), lambda m, b, t: (b, m.num_features)),
    ((nn.BatchNorm2d,), lambda m, b, t: (b, m.num_features, 224, 224)),
    ((nn.LayerNorm,), lambda m, b, t: (b, *m.normalized_shape)),
]

#: Containers that take a ``[batch, seq, features]`` sequence (``[seq, batch, features]`` unless
#: batch_first): their leaves (attention projections) would give a wrong 2-D guess.
_SEQUENCE_TYPES: tuple[type, ...] = (
    nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer, nn.MultiheadAttention,
)
DEFAULT_SEQ_LEN = 128


def _sequence_layout(m: nn.Module) -> tuple[int, bool] | None:
    """(feature size, batch_first) of a Transformer-family module or MultiheadAttention."""
    attn = m if isinstance(m, nn.MultiheadAttention) else None
    if isinstance(m, nn.Transformer):
        layer = m.encoder.layers[0] if len(m.encoder.layers) else None
        attn = layer.self_attn if layer is not None else None
        return (int(m.d_model), bool(getattr(m, "batch_first", False))) if attn is None else (
            int(m.d_model), bool(attn.batch_first))
    if isinstance(m, (nn.TransformerEncoder, nn.TransformerDecoder)):
        attn = m.layers[0].self_attn if len(m.layers) else None
    elif isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        attn = m.self_attn
    if attn is None:
        return None
    return int(attn.embed_dim), bool(attn.batch_first)


def _required_positional(model: nn.Module) -> int | None:
    """How many positional parameters ``model.forward`` requires, or None when unreadable."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def _input_module(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The module that receives the input: the first Transformer-family module met before the first
    parametrised leaf (``named_modules`` order, the model itself included), else that leaf."""
    for name, module in model.named_modules():
        if isinstance(module, _SEQUENCE_TYPES):
            return name, module
        if next(module.children(), None) is None and next(module.parameters(False), None) is not None:
            return name, module
    return None


def _guess_user_shape(model: nn.Module, b: int,
                      seq_len: int = DEFAULT_SEQ_LEN) -> tuple[tuple[int, ...], torch.dtype, str, int]:
    """Guess one input shape from the module that receives the input; the note says what it was.
    The last item is how many inputs of that shape the model takes (nn.Transformer: src and tgt)."""
    leaf = _input_module(model)
    if leaf is None:
        return (b, 3, 224, 224), torch.float32, "shape guessed (no layer with parameters)", 1
    name, m = leaf
    where = f"shape guessed from {name or '(model)'} ({type(m).__name__})"
    if isinstance(m, _SEQUENCE_TYPES) and (layout := _sequence_layout(m)) is not None:
        features, batch_first = layout
        shape = (b, seq_len, features) if batch_first else (seq_len, b, features)
        wants = {nn.Transformer: 2, nn.TransformerDecoder: 2, nn.TransformerDecoderLayer: 2,
                 nn.MultiheadAttention: 3}.get(type(m), 1)
        required = _required_positional(model)
        count = max(1, min(wants, required)) if required is not None else wants
        return shape, torch.float32, where, count
    if not isinstance(m, nn.modules.lazy.LazyModuleMixin):  # lazy: sizes unknown until called
        for types, guess in _GUESSES:
            if isinstance(m, types):
                dtype = torch.int64 if types[0] is nn.Embedding else torch.float32
                return guess(m, b, seq_len), dtype, where, 1
    note = f"shape guessed (default; first layer {name} is {type(m).__name__})"
    return (b, 3, 224, 224), torch.float32, note, 1


EXAMPLE_ATTRS = ("example_inputs", "example_input")


def _example_inputs(model: nn.Module) -> ModelInputs | None:
    """Inputs from a model's own ``example_inputs`` / ``example_input`` attribute, if any."""
    for attr in EXAMPLE_ATTRS:
        value = getattr(model, attr, None)
        if value is None or isinstance(value, nn.Module):
            continue
        if callable(value) and not isinstance(value, torch.Tensor):
            try:
                value = value()
            except Exception as exc:
                raise InputError(f"model.{attr}() raised {describe_exception(exc)}",
                                 hint=f"fix the model's {attr}, or give inputs with --input-shape / --input") from exc
            if value is None:  # a catch-all __getattr__ answers every name with a function: no examples
                continue

        def clone(v: Any) -> Any:  # in-place layers must not change the model's own examples
            return v.clone() if isinstance(v, torch.Tensor) else v
        if isinstance(value, dict):
            return pack_inputs([], [(str(k), clone(v), attr) for k, v in value.items()])
        return pack_inputs([(clone(v), attr) for v in (value if isinstance(value, (tuple, list)) else (value,))])
    return None


#: Config fields that bound the positions a transformers model can embed (its sub-configs' too).
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions",
                   "max_source_positions", "max_seq_len", "max_sequence_length")


def position_limit(config: Any) -> tuple[int, str] | None:
    """The smallest position limit a transformers config declares, itself or in a sub-config
    (``text_config``, ``vision_config``, ``encoder``, ``decoder``...), with the field that says it;
    None when it declares none. Generated sequences longer than that would make the model raise."""
    found: list[tuple[int, str]] = []
    seen: set[int] = set()

    def walk(where: Any, prefix: str) -> None:
        if id(where) in seen:
            return
        seen.add(id(where))
        for field in POSITION_LIMITS:
            value = getattr(where, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append((value, prefix + field))
        for key, value in vars(where).items():
            if hasattr(value, "model_type") and hasattr(value, "to_dict"):  # a nested PretrainedConfig
                walk(value, f"{prefix}{key}.")

    walk(config, "")
    return min(found) if found else None


def _hf_seq_len(config: Any, seq_len: int | None) -> tuple[int, str]:
    """The length of generated token inputs: ``seq_len`` when given, else the default capped at the
    config's position limit; and a note for the input's source when it was capped."""
    if seq_len is not None:
        return seq_len, ""
    limit = position_limit(config)
    if limit is not None and limit[0] < DEFAULT_SEQ_LEN:
        return limit[0], f", length {limit[0]} (the config's {limit[1]})"
    return DEFAULT_SEQ_LEN, ""


def _hf_inputs(model: nn.Module, config: Any, b: int, seq_len: int | None, fill: str, gen: torch.Generator,
               seed: int, meta: bool = False) -> ModelInputs | None:
    """Keyword inputs for a transformers model, from its forward's parameter names and its config:
    ``input_ids`` (+ ``attention_mask``) below the vocabulary size, ``pixel_values`` at the config's
    image size, ``input_features`` (mel frames) / ``input_values`` (one second at the config's
    ``sampling_rate``, else 16 kHz; ``[batch, audio_channels, time]`` for a codec) for audio models,
    ``past_values`` (``[batch, context_length, num_input_channels]``) for a time-series forecaster,
    ``decoder_input_ids`` for encoder-decoders, ``seq_len`` long (default: 128, or less where the
    config's position limits say so: ``_hf_seq_len``). None when forward takes none of these.
    ``meta``: no ``attention_mask`` (all ones means the same as none, and transformers reads a mask's
    values, which the meta device does not have)."""
    seq_len, capped = _hf_seq_len(config, seq_len)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    vision = getattr(config, "vision_config", None) or config
    named: list[tuple[str, Any, str]] = []
    if "pixel_values" in params and (size := getattr(vision, "image_size", None)) is not None:
        h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        channels = int(getattr(vision, "num_channels", 3) or 3)
        t, src = _fill((b, channels, int(h), int(w)), model_float_dtype(model), fill, gen, seed)
        named.append(("pixel_values", t, src))
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if "input_features" in params and isinstance(mels, int) and isinstance(positions, int):  # whisper-style audio
        t, src = _fill((b, mels, 2 * positions), model_float_dtype(model), fill, gen, seed)
        named.append(("input_features", t, src))
    elif "input_values" in params and not named:  # raw audio: one second at the config's rate (else 16 kHz)
        rate = getattr(config, "sampling_rate", None)
        rate = rate if isinstance(rate, int) and rate > 0 else 16000
        channels = getattr(config, "audio_channels", None)  # a codec's (encodec): [batch, channels, time]
        shape = (b, channels, rate) if isinstance(channels, int) and channels > 0 else (b, rate)
        t, src = _fill(shape, model_float_dtype(model), fill, gen, seed)
        named.append(("input_values", t, f"{src}, one second at {rate} Hz"))
    context, series = getattr(config, "context_length", None), getattr(config, "num_input_channels", None)
    if "past_values" in params and isinstance(context, int) and isinstance(series, int):  # a forecaster (patchtst)
        t, src = _fill((b, context, series), model_float_dtype(model), fill, gen, seed)
        named.append(("past_values", t, f"{src}, the config's context_length x num_input_channels"))
    if "input_ids" in params and (_integer_high(model, "input_ids") != 10 or not named):
        images = _image_placeholders(model, config, named)
        for key in ("input_ids",) if meta else ("input_ids", "attention_mask"):
            if key in params:
                t, src = _fill((b, seq_len), torch.int64, "randn", gen, seed, model, key)
                if images is not None:
                    t, src = _with_placeholders(t, key, *images), f"{src}{capped}, {images[1]} image tokens first"
                named.append((key, t, src + capped if images is None else src))
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params and named:
        t, src = _fill((b, seq_len), torch.int64, "randn", gen, seed, model, "decoder_input_ids")
        named.append(("decoder_input_ids", t, src + capped))
    return pack_inputs([], named) if named else None


def _image_placeholders(model: nn.Module, config: Any, named: list[tuple[str, Any, str]]) -> tuple[int, int] | None:
    """(placeholder token id, count per sample) when ``model`` is a vision-language model given
    ``pixel_values``: its ``input_ids`` need as many placeholders as its image features have rows
    (``image_token_count``, which may put the pixels in the layout the model takes, in ``named``);
    None otherwise."""
    token = image_token_id(config)
    pixels = next((t for key, t, _ in named if key == "pixel_values"), None)
    if token is None or pixels is None:
        return None
    found = image_token_count(model, pixels)
    if found is None or not found[0]:
        return None
    if found[1] is not pixels:  # one image per sample in its own dimension (idefics3's layout)
        named[:] = [(k, found[1] if k == "pixel_values" else t, src) for k, t, src in named]
    return token, found[0]


def _with_placeholders(t: torch.Tensor, key: str, token: int, count: int) -> torch.Tensor:
    """``count`` image placeholders before the text of generated ``input_ids`` (the text's own draws of
    ``token`` made 0); an attention mask as long, all ones."""
    if key != "input_ids":
        return torch.ones((t.shape[0], count + t.shape[1]), dtype=t.dtype)
    text = torch.where(t == token, torch.zeros_like(t), t)
    return torch.cat([torch.full((t.shape[0], count), token, dtype=t.dtype), text], dim=1)


#: The side of a segmentation model's default input in train mode (check, watch MODEL), instead of its
#: preset's resize (520): a CI gate's training step in seconds rather than minutes on a CPU.
TRAIN_SEGMENTATION_SIZE = 128
TRAIN_SEGMENTATION_NOTE = (f"{TRAIN_SEGMENTATION_SIZE}x{TRAIN_SEGMENTATION_SIZE} in train mode, for speed "
                           "(--input-shape for the preset's size)")


#: The sides of the synthetic boxes in each image, as fractions of the image's: every scale of anchors
#: (SSD's feature levels, an FPN's) gets a box to match, so no head is left without a gradient.
TARGET_BOX_SCALES = (0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)


def detection_targets(model: nn.Module, size: int, b: int, gen: torch.Generator, seed: int) -> tuple[Any, str]:
    """Synthetic targets for ``b`` images of ``size`` x ``size`` that a torchvision detection model takes in
    train mode: a box of each of ``TARGET_BOX_SCALES`` per image (``boxes`` [N, 4] in pixels, placed by
    ``gen``; ``labels`` 1, a class every detection model has), and for Mask R-CNN each box filled as its
    ``masks`` [N, H, W], for Keypoint R-CNN ``keypoints`` [N, K, 3] inside the boxes (all visible)."""
    heads = getattr(model, "roi_heads", None)
    masks = heads is not None and heads.has_mask()
    keypoints = heads.keypoint_predictor.kps_score_lowres.out_channels if (
        heads is not None and heads.has_keypoint()) else 0
    sides = torch.tensor([max(2, round(f * size)) for f in TARGET_BOX_SCALES])
    n = len(sides)
    targets = []
    for _ in range(b):
        corner = (torch.rand((n, 2), generator=gen) * (size - sides).unsqueeze(1)).floor()
        boxes = torch.cat([corner, corner + sides.unsqueeze(1)], dim=1)
        target = {"boxes": boxes, "labels": torch.ones(n, dtype=torch.int64)}
        if masks:
            target["masks"] = torch.zeros((n, size, size), dtype=torch.uint8)
            for i, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
                target["masks"][i, y0:y1, x0:x1] = 1
        if keypoints:
            xy = torch.rand((n, keypoints, 2), generator=gen) * sides.view(n, 1, 1) + corner.unsqueeze(1)
            target["keypoints"] = torch.cat([xy, torch.ones((n, keypoints, 1))], dim=2)
        targets.append(target)
    kinds = ", ".join(["boxes", "labels"] + ["masks"] * masks + ["keypoints"] * bool(keypoints))
    return targets, f"targets: {n} boxes per image ({kinds}), seed={seed}"


def _default_inputs(loaded: LoadedModel, b: int, fill: str, gen: torch.Generator,
                    seed: int, seq_len: int | None = None, meta: bool = False, train: bool = False) -> ModelInputs:
    """Per-model default inputs when neither shapes nor files are given (``seq_len`` None: the default).
    ``train``: for a run in train mode (a detection model's targets, a smaller segmentation input)."""
    found = _example_inputs(loaded.model)
    if found is not None:
        return found
    family, name, f32 = loaded.family, loaded.tv_name or "", model_float_dtype(loaded.model)
    config = getattr(loaded.model, "config", None)
    if family is None and config is not None and hasattr(config, "model_type"):  # transformers
        made = _hf_inputs(loaded.model, config, b, seq_len, fill, gen, seed, meta)
        if made is not None:
            return made
    if family is None and loaded.input_config is not None:  # timm: its pretrained_cfg's input size
        t, src = _fill((b, *loaded.input_config["input_size"]), f32, fill, gen, seed)
        return pack_inputs([(t, f"{src}, size from the model's pretrained_cfg")])
    if family is None:
        shape, dtype, note, count = _guess_user_shape(loaded.model, b, seq_len or DEFAULT_SEQ_LEN)
        dtype = f32 if dtype.is_floating_point else dtype
        made_inputs = [_fill(shape, dtype, fill, gen, seed, loaded.model) for _ in range(count)]
        return pack_inputs([(t, f"{src}, {note}") for t, src in made_inputs])
    if family == "detection":  # a list of CHW images, as torchvision detection models take
        s = 300 if name.startswith("ssd300") else 320
        t, src = _fill((b, 3, s, s), f32, fill, gen, seed)
        images = (list(t.unbind(0)), f"{src}, list of {plural(b, 'image')}")
        if train:  # in train mode it returns its losses, computed against targets
            return pack_inputs([images, detection_targets(loaded.model, s, b, gen, seed)])
        return pack_inputs([images])
    if family == "optical_flow":  # two frames; RAFT needs H, W divisible by 8 (224 runs)
        return pack_inputs([_fill((b, 3, 224, 224), f32, fill, gen, seed) for _ in range(2)])
    if family == "segmentation" and train:  # a training step at 520x520 takes minutes on a CPU
        t, src = _fill((b, 3, TRAIN_SEGMENTATION_SIZE, TRAIN_SEGMENTATION_SIZE), f32, fill, gen, seed)
        return pack_inputs([(t, f"{src}, {TRAIN_SEGMENTATION_NOTE}")])
    # classification / quantization: the preset crop; segmentation: its resize; video: 16 frames
    where = {"segmentation": ("resize_size", 520), "video": ("crop_size", 112)}
    s = transform_size(loaded, *where.get(family, ("crop_size", 224)))
    shape = (b, 3, 16, s, s) if family == "video" else (b, 3, s, s)
    return pack_inputs([_fill(shape, f32, fill, gen, seed)])


# --------------------------------------------------------------------------- entry point


def make_inputs(loaded: LoadedModel, *, shapes: Sequence[InputSpec] = (),
                files: Sequence[str | os.PathLike[str]] = (), batch_size: int | None = None,
                fill: Fill | str = Fill.randn, seed: int = 0, trust_pickle: bool = False,
                seq_len: int | None = None, meta: bool = False, dtype: torch.dtype | None = None,
                train: bool = False) -> ModelInputs:
    """Build CPU inputs for ``loaded.model`` (``meta``: for a run on the meta device).

    ``shapes``: one positional input per spec (``batch_size`` replaces dim 0; no dtype: int64 ids
    for a model that starts with an embedding and takes one input, refused with several (``_spec_dtypes``),
    else float32). ``files``: images or folders of
    images (one preprocessed batch; detection: a list of images; video: the frames of one clip;
    optical flow: two frames) or tensor files (.pt/.pth/.npy/.npz/.safetensors); files decide the
    batch, so ``batch_size`` is ignored with them. Neither: the model's ``example_inputs``, else a
    per-family torchvision default, else a shape guessed from the model's first layer. ``fill``
    and ``seed`` apply to generated tensors only. ``trust_pickle`` lets torch.load unpickle
    arbitrary objects from .pt/.pth files (it runs code from them); else weights_only loading.
    A spec with a name (``input_ids=1x128:int64``) is a keyword input. ``seq_len``: the sequence
    length of generated token / sequence inputs (default 128; for a transformers model at most the
    smallest position limit its config declares, see ``position_limit``). ``dtype``: the floating
    dtype the run computes in (``--dtype``), which the floating tensors of tensor files are cast to
    (``file_floats``); None: the model's own. ``train``: the inputs of a run in train mode (a
    torchvision detection model's images, default or one ``--input-shape``, come with targets, ``detection_targets``; a
    segmentation model's are ``TRAIN_SEGMENTATION_SIZE`` on a side).
    """
    fill = member(Fill, fill, "fill")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"batch size must be a positive integer, got {batch_size}", hint="e.g. --batch-size 2")
    if shapes and files:
        raise UsageError("give input shapes or input files, not both",
                         hint="--input-shape makes random tensors; --input reads files")
    gen = torch.Generator().manual_seed(seed)
    if files:
        return _file_inputs(loaded, files, trust_pickle, dtype)
    if not shapes:
        return _default_inputs(loaded, batch_size or 1, fill, gen, seed, seq_len, meta, train)
    made = _shape_inputs(loaded, shapes, batch_size, fill, gen, seed)
    return _with_targets(loaded, made, gen, seed) if train else made


def _with_targets(loaded: LoadedModel, inputs: ModelInputs, gen: torch.Generator, seed: int) -> ModelInputs:
    """A detection model's ``--input-shape`` batch in train mode as its default one: a list of images and
    ``detection_targets`` for them (in train mode it refuses to run without targets). Anything else as given."""
    if loaded.family != "detection" or inputs.kwargs or len(inputs.args) != 1 or inputs.args[0].dim() != 4:
        return inputs
    t = inputs.args[0]
    images = (list(t.unbind(0)), f"{inputs.infos[0].source}, list of {plural(t.shape[0], 'image')}")
    return pack_inputs([images, detection_targets(loaded.model, min(t.shape[-2:]), t.shape[0], gen, seed)])


def _file_inputs(loaded: LoadedModel, files: Sequence[Any], trust_pickle: bool,
                 dtype: torch.dtype | None = None) -> ModelInputs:
    """``make_inputs`` from in-memory inputs, image files or folders, or tensor files (they decide the batch)."""
    if isinstance(files[0], MemoryInputs):
        from hookcli.engine.read_inputs import memory_inputs

        return memory_inputs(loaded, files[0].value)
    from hookcli.engine.read_inputs import expand_files, image_inputs, tensor_inputs  # decoders only when needed

    kind, paths, label = expand_files(files)
    if kind == "images":
        return _cast_floats(image_inputs(loaded, paths, label), model_float_dtype(loaded.model))
    return file_floats(tensor_inputs(loaded, files, trust_pickle=trust_pickle), dtype or model_float_dtype(loaded.model))


def _shape_inputs(loaded: LoadedModel, shapes: Sequence[InputSpec], batch_size: int | None, fill: Fill,
                  gen: torch.Generator, seed: int) -> ModelInputs:
    """``make_inputs`` from ``--input-shape`` specs: one generated tensor each, positional or by name."""
    fdt = model_float_dtype(loaded.model)
    guessed = _guess_user_shape(loaded.model, 1)[1] if loaded.family is None else fdt
    guessed = fdt if guessed.is_floating_point else guessed
    names = [getattr(spec, "name", None) for spec in shapes]
    if twice := sorted({n for n in names if n is not None and names.count(n) > 1}):
        raise UsageError(f"keyword input {twice[0]!r} given twice", hint="give each --input-shape NAME=... once")
    dtypes = _spec_dtypes(loaded.model, shapes, guessed)
    made_specs = [
        (getattr(spec, "name", None), *_fill(
            (batch_size, *spec.shape[1:]) if batch_size is not None else spec.shape,
            dtype, fill, gen, seed, loaded.model, getattr(spec, "name", None)))
        for spec, dtype in zip(shapes, dtypes)]
    return pack_inputs([(t, src) for n, t, src in made_specs if n is None],
                       [(n, t, src) for n, t, src in made_specs if n is not None])


def _spec_dtypes(model: nn.Module, shapes: Sequence[InputSpec], guessed: torch.dtype) -> list[torch.dtype]:
    """The dtype of each ``--input-shape``: its own ``:dtype``, else what its name implies (``_named_dtype``),
    else ``guessed`` from the model's first layer. That guess is about the one input the first layer
    takes: with several inputs an integer guess (an Embedding first) cannot say which of them are
    token ids (an image input beside them is float), so an input it would decide is refused (exit 2)."""
    dtypes: list[torch.dtype | None] = [
        getattr(torch, spec.dtype) if spec.dtype else _named_dtype(getattr(spec, "name", None), None)
        for spec in shapes]
    undecided = [i for i, d in enumerate(dtypes) if d is None]
    if len(shapes) > 1 and undecided and not guessed.is_floating_point:
        leaf = _input_module(model)
        first = f"{leaf[0] or '(model)'} ({type(leaf[1]).__name__})" if leaf is not None else "an embedding"
        shown = " ".join(f"--input-shape {_spec_text(shapes[i])}" for i in undecided[:3])
        raise InputError(
            f"cannot tell the dtype of {plural(len(undecided), 'input')} without one ({shown}): the model's first "
            f"layer {first} takes integer ids, but with {len(shapes)} inputs it is not known which of them it takes",
            hint="give each --input-shape its dtype, e.g. --input-shape 1x16:int64 --input-shape 1x3x32x32:float32")
    return [d if d is not None else guessed for d in dtypes]


def _spec_text(spec: InputSpec) -> str:
    name = getattr(spec, "name", None)
    return f"{name + '=' if name else ''}{'x'.join(map(str, spec.shape))}"


def _named_dtype(name: str | None, guessed: torch.dtype | None) -> torch.dtype | None:
    """The dtype of an input given without one: int64 for token ids and masks by their keyword
    (``input_ids``, ``attention_mask``), else what the model's first layer suggests."""
    if name is not None and (name.endswith("_ids") or name == "ids" or "mask" in name):
        return torch.int64
    return guessed


def model_float_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype the model computes in: that of the first parametrised leaf's first
    floating parameter (the layer that receives the input), else any floating parameter or
    buffer, else float32. Generated float inputs get it, so a float16/bfloat16 model runs."""
    leaf = _first_leaf(model)
    tensors = itertools.chain(leaf[1].parameters(False) if leaf is not None else (), model.parameters(),
                              model.buffers())  # lazily: the first floating one ends the walk
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


def cast_note(source: torch.dtype, target: torch.dtype) -> str | None:
    """``"float64 cast to float32"`` when casting a floating tensor of ``source`` dtype to ``target``
    can change its values (``target`` cannot hold every ``source`` value); None when it is exact."""
    if not source.is_floating_point or torch.promote_types(source, target) == target:
        return None
    return f"{str(source).removeprefix('torch.')} cast to {str(target).removeprefix('torch.')}"


def file_floats(inputs: ModelInputs, dtype: torch.dtype) -> ModelInputs:
    """The floating tensors of inputs read from tensor files (``--input``, a ``--data`` file) cast to
    ``dtype``, the one the model computes in, as decoded images are: a file's dtype is how it was saved
    (numpy saves float64), not a request, and a model cannot take another dtype than its weights'.
    Integer and bool tensors (token ids, masks) keep theirs. An input whose cast can change values
    says so in its source (``cast_note``)."""
    def cast(v: Any) -> tuple[Any, set[str]]:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            note = cast_note(v.dtype, dtype)
            return v.to(dtype), {note} if note else set()
        if isinstance(v, list):
            pairs = [cast(x) for x in v]
            return [x for x, _ in pairs], set().union(*(n for _, n in pairs))
        return v, set()

    def entry(v: Any, source: str) -> tuple[Any, str]:
        value, notes = cast(v)
        return value, ", ".join([source, *sorted(notes)])

    args = [entry(v, info.source) for v, info in zip(inputs.args, inputs.infos)]
    kwargs = [(k, *entry(v, info.source)) for (k, v), info in
              zip(inputs.kwargs.items(), inputs.infos[len(inputs.args):])]
    return pack_inputs(args, kwargs)


def with_note(inputs: ModelInputs, note: str) -> ModelInputs:
    """``inputs`` with ``note`` added to the source of each generated tensor input (the report header
    shows it); a model's own ``example_inputs`` keep theirs (the batch size does not apply to them)."""
    infos = [dataclasses.replace(i, source=f"{i.source}, {note}")
             if i.shape is not None and i.source not in EXAMPLE_ATTRS else i for i in inputs.infos]
    return ModelInputs(inputs.args, inputs.kwargs, infos)


def _describe_inputs(inputs: ModelInputs) -> str:
    shown = [("x".join(map(str, i.shape)) if i.shape is not None else i.dtype) for i in inputs.infos]
    positional = ", ".join(shown[: len(inputs.args)])
    named = ", ".join(f"{k}={v}" for k, v in zip(inputs.kwargs, shown[len(inputs.args):]))
    return _short(", ".join(p for p in (positional, named) if p), 200)


#: What to do when a batch of ``--data`` does not fit forward (``check_signature``'s ``how``).
DATA_SIGNATURE_HOW = ("each batch of --data goes to forward whole: a tensor is one input, a tuple or list positional "
                      "inputs, a dict keyword inputs; a DataLoader of (inputs, labels) passes the labels too: give "
                      "one whose batches are the inputs alone")


def check_signature(model: nn.Module, inputs: ModelInputs, *, how: str | None = None, where: str = "",
                    hint: str | None = None) -> None:
    """Bind the inputs to ``model.forward``'s signature before running: too many, too few or
    unknown keyword inputs are a usage error (exit 2) with the signature, never "the model raised".
    ``how``: the hint after the signature (default: one ``--input-shape`` or file tensor per
    argument); ``where``: the message's prefix (``"batch 3: "``); ``hint``: the whole hint instead
    (for hookcli's own default inputs: the flags that fit, ``input_hints.forward_hint``).

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
        how = how or ("give one --input-shape (or tensor of an --input file) per argument; keyword arguments by "
                      "name in an .npz/.safetensors/.pt dict")
        raise InputError(
            f"{where}{type(model).__name__}.forward cannot take the {plural(count, 'input')} given "
            f"({_describe_inputs(inputs)}): {exc}",
            hint=hint or f"forward{_short(str(signature), 160)}: {how}") from None
