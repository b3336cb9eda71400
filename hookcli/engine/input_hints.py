"""What to say when hookcli's own default input does not fit a model: the arguments its forward
requires, and for each the ``--input-shape NAME=SHAPE`` that fits where the model's config (a
transformers model's ``context_length``, ``num_time_features``, ``image_size``...) or its first layer
says the shape, else which argument needs a shape hookcli cannot know.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from hookcli.engine.build_inputs import DEFAULT_SEQ_LEN, EXAMPLE_ATTRS, _guess_user_shape, position_limit
from hookcli.engine.input_types import ModelInputs

#: forward's parameters that take no input: ``*args`` / ``**kwargs``.
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def required_arguments(model: nn.Module) -> list[str] | None:
    """The names of the parameters ``model.forward`` requires, in order; None when unreadable."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.kind not in _VARIADIC and p.default is inspect.Parameter.empty]


def _int(config: Any, *fields: str) -> tuple[int, str] | None:
    """The first of ``fields`` that ``config`` sets to a non-negative int, with its name."""
    for field in fields:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value, field
    return None


def _series_shape(config: Any, b: int, name: str) -> tuple[tuple[int, ...], str] | None:
    """A time-series model's ``past_*`` / ``future_*`` input: ``[batch, length(, channels)]``; the
    past is ``context_length`` plus the largest of ``lags_sequence`` (the lags look further back)."""
    future = name.startswith("future_")
    length = _int(config, "prediction_length" if future else "context_length")
    if length is None:
        return None
    lags = getattr(config, "lags_sequence", None)
    steps, why = length[0], length[1]
    if not future and isinstance(lags, (list, tuple)) and lags:
        steps, why = steps + max(lags), f"{why} + max(lags_sequence)"
    if name.endswith("_time_features"):
        features = _int(config, "num_time_features")
        return ((b, steps, features[0]), f"{why}, num_time_features") if features is not None else None
    channels = _int(config, "num_input_channels", "input_size")
    if channels is None:
        return None
    if channels == (1, "input_size"):  # a univariate series is [batch, length]
        return (b, steps), why
    return (b, steps, channels[0]), f"{why}, {channels[1]}"


def _config_shape(config: Any, b: int, name: str) -> tuple[tuple[int, ...], str] | None:
    """The shape a transformers ``config`` says the keyword input ``name`` has, and the fields that
    say it; None when it says nothing about it."""
    if name.startswith(("past_", "future_")):
        return _series_shape(config, b, name)
    if name.endswith("_ids") or name.endswith("attention_mask"):
        limit = position_limit(config)
        length = min(DEFAULT_SEQ_LEN, limit[0]) if limit is not None else DEFAULT_SEQ_LEN
        return (b, length), f"length {length}"
    if name == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size, channels = _int(vision, "image_size"), _int(vision, "num_channels")
        if size is not None:
            return (b, channels[0] if channels else 3, size[0], size[0]), "image_size, num_channels"
    if name == "input_values":
        rate, audio = _int(config, "sampling_rate"), _int(config, "audio_channels")
        hz = rate[0] if rate else 16000
        return ((b, audio[0], hz) if audio else (b, hz)), f"one second at {hz} Hz"
    if name == "input_features":
        mels, positions = _int(config, "num_mel_bins"), _int(config, "max_source_positions")
        if mels is not None and positions is not None:
            return (b, mels[0], 2 * positions[0]), "num_mel_bins, 2 x max_source_positions"
    return None


def argument_shapes(model: nn.Module, b: int = 1) -> list[tuple[str, tuple[int, ...] | None, str]] | None:
    """``(name, shape or None, what says it)`` for each argument ``model.forward`` requires: from a
    transformers config where it says the shape, else (the first arguments) the shape guessed from the
    model's first layer; None when forward's signature cannot be read."""
    names = required_arguments(model)
    if names is None:
        return None
    config = getattr(model, "config", None)
    hf = config is not None and hasattr(config, "model_type")
    shape, _, note, count = _guess_user_shape(model, b)
    found: list[tuple[str, tuple[int, ...] | None, str]] = []
    for position, name in enumerate(names):
        said = _config_shape(config, b, name) if hf else None
        if said is not None:
            found.append((name, said[0], f"the config's {said[1]}"))
        elif not hf and position < count and "guessed from" in note:
            found.append((name, shape, f"{name}'s {note.removeprefix('shape ')}"))
        else:
            found.append((name, None, ""))
    return found


def _tried(model: nn.Module, inputs: ModelInputs) -> dict[str, tuple[int, ...]]:
    """The shape of each generated tensor in ``inputs``, by the name of forward's parameter it binds."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*inputs.args, **inputs.kwargs).arguments
    except (TypeError, ValueError):
        return {}
    shapes = {id(v): info.shape for v, info in zip([*inputs.args, *inputs.kwargs.values()], inputs.infos)}
    return {name: tuple(shapes[id(v)]) for name, v in bound.items() if shapes.get(id(v)) is not None}


def forward_hint(model: nn.Module, b: int = 1, tried: dict[str, tuple[int, ...]] | None = None) -> str | None:
    """One hint naming forward's required arguments and the ``--input-shape`` flags that fit them
    (``argument_shapes``); an argument whose shape hookcli cannot know, or whose only guess is the one
    in ``tried`` (the input the model raised on), is named as needing one."""
    shapes = argument_shapes(model, b)
    if not shapes:
        return None
    tried = tried or {}
    failed = [f"{name} {'x'.join(map(str, shape))}" for name, shape, _ in shapes if shape and tried.get(name) == shape]
    shapes = [(name, None if shape and tried.get(name) == shape else shape, why) for name, shape, why in shapes]
    flags = " ".join(f"--input-shape {name}={'x'.join(map(str, shape)) if shape else 'SHAPE'}"
                     for name, shape, _ in shapes)
    whys = list(dict.fromkeys(why for _, shape, why in shapes if shape is not None and not why.startswith("the config")))
    fields = list(dict.fromkeys(f for _, shape, why in shapes if shape is not None and why.startswith("the config's ")
                                for f in why.removeprefix("the config's ").split(", ")))
    whys = ([f"the config's {', '.join(fields)}"] if fields else []) + whys
    unknown = [name for name, shape, _ in shapes if shape is None]
    tail = [f"shapes from {'; '.join(whys)}"] if whys else []
    if failed:
        tail.append(f"the guess {', '.join(failed)} did not fit")
    if unknown:
        tail.append(f"hookcli cannot tell the shape of {', '.join(unknown)}: give the one forward expects")
    return f"forward takes ({', '.join(name for name, _, _ in shapes)}): try {flags} ({'; '.join(tail)})"


def default_input_hint(model: nn.Module, inputs: ModelInputs, b: int = 1, *, raised: bool = False) -> str | None:
    """``forward_hint`` for inputs hookcli made itself (not the model's own ``example_inputs``);
    ``raised``: for the model raising on them (a suggestion equal to what it raised on is no help)."""
    if any(info.source in EXAMPLE_ATTRS for info in inputs.infos):
        return None
    return forward_hint(model, b, _tried(model, inputs) if raised else None)
