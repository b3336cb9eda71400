"""``hookcli fmaps``: draw one module's output channels as a grid image (PNG).

The seeds' feature-map capture, through the hook engine: ``attach`` with a ``keep`` callback on the
one selected module keeps only the wanted call's output for the wanted sample (copied to CPU).

- A (batch, channels, height, width) output: one tile per channel, each channel min-max normalised
  to [0, 1] on its own (a constant channel becomes 0), laid out with ``torchvision.utils.make_grid``
  (``nrow = ceil(sqrt(n))``, 2 px padding of mid grey). Small maps are upscaled (nearest neighbour)
  so a tile is at least 32 px, or by ``scale``.
- A (batch, features) output (a Linear layer), or maps of 1x1: a bar strip, one bar per feature,
  heights min-max normalised over the shown features.
- Pixels are quantised as ``torchvision.utils.save_image`` does (``x * 255 + 0.5``, clamped) and
  written as a greyscale PNG, atomically. ``save_image`` itself writes RGB: three times the bytes
  for the same grey picture.

Per channel of the sample, min / max / mean and a status: ``dead`` (all zero), ``constant`` (one
non-zero value), ``nonfinite`` (NaN/Inf), else ``ok``.
"""

from __future__ import annotations

import io
import math
import operator
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hookcli._version import __version__
from hookcli.engine.run import Prepared, forward_report, prepare, require_values
from hookcli.errors import OutputError, UsageError
from hookcli.options import MAX_FMAP_SCALE, RunOptions, output_key_path
from hookcli.engine.state import exclusive
from hookcli.engine.stats import dtype_name, shape_of
from hookcli.records import ChannelRecord, FeatureMaps, LayerRecord, Report

DEFAULT_CHANNELS = 64
MIN_TILE = 32  # px: smaller maps are upscaled so each tile is at least this big
PADDING = 2  # px between tiles (make_grid's default)
PAD_VALUE = 0.5  # mid grey, so black (min) and white (max) tiles stay distinct
BAR_HEIGHT, BAR_WIDTH = 64, 8  # px of one bar before scaling
#: The largest image fmaps draws (a side of 65535 px is the limit of most image tools; 2**28
#: pixels, 256 MiB of grey, is past what a viewer opens): bigger is refused before drawing.
MAX_SIDE, MAX_PIXELS = 65535, 2**28
#: The most channel indices --channels may list (no layer has more channels than this).
MAX_CHANNEL_INDICES = 2**20
CHANNELS_HINT = "a count (16), indices (0,5,7), ranges (0-3,8), a single index (5,) or all"


@dataclass
class FmapOptions:
    """What to draw: which module, call, tensor, sample and channels, and how big.

    ``channels``: a count (the first N; default 64), ``"all"``, or indices as a list or a string
    like ``"0,5,7"`` / ``"0-3,8"`` (a single index needs a comma: ``"5,"``).
    """

    layer: str
    channels: int | str | Sequence[int] | None = None
    sample: int = 0
    call: int = 0
    output_key: str | None = None
    scale: int | None = None
    #: Which dimension of a 4-D output holds the channels: 1 ([B, C, H, W]) or 3 / -1 ([B, H, W, C], Swin's
    #: and ConvNeXt-block's channels-last); None: 1, unless dims 1 and 2 are equal and 3 is not (channels-last).
    channel_dim: int | None = None

    def validate(self) -> FmapOptions:
        opts = replace(self)
        if opts.channel_dim is not None and (isinstance(opts.channel_dim, bool) or not isinstance(opts.channel_dim, int)
                                             or opts.channel_dim not in (1, 3, -1)):
            raise UsageError(f"--channel-dim must be 1 (channels first) or 3 / -1 (channels last), got "
                             f"{_short(repr(opts.channel_dim))}", hint="e.g. --channel-dim -1 for [B, H, W, C] outputs")
        if not isinstance(opts.layer, str) or not opts.layer.strip():
            raise UsageError("fmaps needs a module: --layer NAME", hint="list them with: hookcli modules MODEL")
        opts.layer = opts.layer.strip()
        if "," in opts.layer:
            raise UsageError(f"--layer {opts.layer!r}: fmaps draws one module at a time",
                             hint="run it once per module")
        opts.channels = parse_channels(opts.channels)
        for name in ("sample", "call"):
            value = getattr(opts, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UsageError(f"--{name} must be an integer >= 0, got {_short(repr(value))}",
                                 hint=f"e.g. --{name} 0")
        if opts.scale is not None and (not isinstance(opts.scale, int) or isinstance(opts.scale, bool)
                                       or not 1 <= opts.scale <= MAX_FMAP_SCALE):
            raise UsageError(f"--scale must be an integer from 1 to {MAX_FMAP_SCALE}, got {_short(repr(opts.scale))}",
                             hint="leave --scale out: tiles are then scaled to at least 32 px")
        return opts


def parse_channels(value: int | str | Sequence[int] | None) -> int | list[int] | None:
    """A count (``int``), explicit indices (``list``) or None for every channel."""
    if value is None:
        return DEFAULT_CHANNELS
    if isinstance(value, bool):
        raise UsageError(f"bad --channels {value!r}", hint=CHANNELS_HINT)
    if isinstance(value, int):
        if value < 1:
            raise UsageError(f"--channels must be at least 1, got {value}", hint=CHANNELS_HINT)
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return None
        if text.isdigit() and len(text) <= 19:
            return parse_channels(int(text))
        indices: list[int] = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            match = re.fullmatch(r"(\d{1,19})(?:-(\d{1,19}))?", part)
            if match is None or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
                raise UsageError(f"bad --channels {_short(value)!r}", hint=CHANNELS_HINT)
            lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
            if len(indices) + hi - lo + 1 > MAX_CHANNEL_INDICES:
                raise UsageError(f"--channels {_short(value)!r} lists more than {MAX_CHANNEL_INDICES} channels",
                                 hint="give the channels the layer has (hookcli shapes MODEL shows them), or all")
            indices.extend(range(lo, hi + 1))
        if not indices:
            raise UsageError(f"bad --channels {_short(value)!r}: no channel given", hint=CHANNELS_HINT)
        return indices
    try:
        indices = [operator.index(i) for i in value]
    except TypeError:
        raise UsageError(f"bad --channels {_short(repr(value))}: give integer indices", hint=CHANNELS_HINT) from None
    if not indices or any(i < 0 for i in indices) or len(indices) > MAX_CHANNEL_INDICES:
        raise UsageError(f"bad --channels {_short(repr(value))}: give 1 to {MAX_CHANNEL_INDICES} indices >= 0",
                         hint=CHANNELS_HINT)
    return indices


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def compact_ranges(indices: Sequence[int], limit: int = 8) -> str:
    """``[1, 2, 3, 7, 9, 10]`` -> ``"1-3,7,9-10"``, at most ``limit`` runs (then ``...``): error
    messages name any number of channels in one short line."""
    runs: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    parts = [f"{a}-{b}" if b > a else str(a) for a, b in runs[:limit]]
    return ",".join(parts) + (",..." if len(runs) > limit else "")


def check_png(path: str | os.PathLike[str]) -> Path:
    """Validate the image path up front: ``.png`` and a writable directory (OutputError)."""
    from hookcli.output import ensure_writable

    text = os.fspath(path)
    if Path(text).suffix.lower() != ".png":
        raise OutputError(f"cannot write the feature maps to {text}: fmaps writes PNG images",
                          hint="give a file name ending in .png")
    return ensure_writable(text)


# --------------------------------------------------------------------------- images


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """Per channel (dim 0) of ``x``: finite min, finite max, mean, and a status each."""
    flat = x.detach().float().reshape(x.shape[0], -1)
    finite = torch.isfinite(flat)
    inf = torch.tensor(math.inf)
    lo = torch.where(finite, flat, inf).amin(1)
    hi = torch.where(finite, flat, -inf).amax(1)
    mean = flat.mean(1)
    dead = (flat == 0).all(1)
    nonfinite = ~finite.all(1)
    statuses = []
    for i in range(flat.shape[0]):
        if nonfinite[i]:
            statuses.append("nonfinite")
        elif dead[i]:
            statuses.append("dead")
        elif flat.shape[1] > 1 and lo[i] == hi[i]:
            statuses.append("constant")
        else:
            statuses.append("ok")
    return lo, hi, mean, statuses


def normalize_maps(maps: torch.Tensor) -> torch.Tensor:
    """Each map (dim 0) min-max scaled to [0, 1] in float32; a constant map becomes 0.

    Min and max are over finite values; NaN becomes 0, +Inf 1, -Inf 0.
    """
    x = maps.detach().float()
    lo, hi, _, _ = channel_stats(x)
    shape = (-1,) + (1,) * (x.dim() - 1)
    span = (hi - lo).reshape(shape)
    out = (x - lo.reshape(shape)) / span
    out = torch.where(span > 0, out, torch.zeros_like(out))
    return torch.nan_to_num(out, nan=0.0, posinf=1.0, neginf=0.0).clamp_(0.0, 1.0)


def auto_scale(height: int, width: int) -> int:
    """The smallest integer factor that makes a ``height`` x ``width`` tile at least MIN_TILE px."""
    return max(1, math.ceil(MIN_TILE / max(1, min(height, width))))


def quantize(grid: torch.Tensor) -> torch.Tensor:
    """[0, 1] floats -> uint8 exactly as ``torchvision.utils.save_image`` does."""
    return grid.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)


def grid_image(maps: torch.Tensor, scale: int = 1) -> torch.Tensor:
    """(n, H, W) maps in [0, 1] -> a uint8 (1, rows*, cols*) grid, ``nrow = ceil(sqrt(n))``."""
    from torchvision.utils import make_grid

    tiles = maps.float()
    if scale > 1:
        tiles = tiles.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    nrow = math.ceil(math.sqrt(tiles.shape[0]))
    grid = make_grid(tiles.unsqueeze(1), nrow=nrow, padding=PADDING, pad_value=PAD_VALUE)
    return quantize(grid[:1])


def bar_tiles(values: torch.Tensor, scale: int = 1) -> torch.Tensor:
    """(n,) values -> (n, BAR_HEIGHT*s, BAR_WIDTH*s) bars, heights min-max normalised over the values."""
    norm = normalize_maps(values.float().reshape(1, -1))[0]
    height, width = BAR_HEIGHT * scale, BAR_WIDTH * scale
    filled = torch.round(norm * height).to(torch.int64)
    rows = torch.arange(height).reshape(1, height, 1)
    return (rows >= height - filled.reshape(-1, 1, 1)).float().expand(-1, -1, width)


def bar_image(values: torch.Tensor, scale: int = 1) -> torch.Tensor:
    """(n,) values -> a uint8 (1, H, W) strip of bars, one per value, in one row."""
    from torchvision.utils import make_grid

    tiles = bar_tiles(values, scale)
    grid = make_grid(tiles.unsqueeze(1), nrow=tiles.shape[0], padding=PADDING, pad_value=PAD_VALUE)
    return quantize(grid[:1])


def encode_png(image: torch.Tensor) -> bytes:
    """A uint8 (1, H, W) tensor as greyscale PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image[0].numpy()).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


# --------------------------------------------------------------------------- running


@dataclass
class _Captured:
    shape: list[int]
    dtype: torch.dtype
    sample: torch.Tensor | None  # the wanted sample, on CPU; None when there is none to take


def _pick(captured: dict[str, _Captured], key: str | None, label: str) -> tuple[str, _Captured]:
    """The output tensor to draw: the only one, or the one ``key`` names."""
    paths = list(captured)
    shown = ", ".join(p or "(output)" for p in paths)
    if key is None:
        if len(paths) == 1:
            return paths[0], captured[paths[0]]
        raise UsageError(f"{label} returns {len(paths)} tensors ({shown})",
                         hint="choose one with --output-key, e.g. --output-key "
                         + paths[0].strip("[].'\""))
    path = output_key_path(key, paths)
    if path is not None:
        return path, captured[path]
    raise UsageError(f"--output-key {key!r} is not in the output of {label}", hint=f"its tensors: {shown}")


def _channel_list(spec: int | list[int] | None, count: int, label: str, unit: str) -> list[int]:
    if spec is None:
        return list(range(count))
    if isinstance(spec, int):
        return list(range(min(spec, count)))
    bad = [i for i in spec if i >= count]
    if bad:
        raise UsageError(f"--channels {compact_ranges(bad)}: {label} has {count} {unit}s (0-{count - 1})",
                         hint=f"give indices from 0 to {count - 1}, a count, or all")
    return list(dict.fromkeys(spec))


def run_fmaps(options: RunOptions, fmap: FmapOptions, *, output: str | os.PathLike[str] | None = None
              ) -> FeatureMaps:
    """Run the model, capture ``fmap.layer``'s output and draw it; write the PNG to ``output``.

    Options are checked (and ``output``: ``.png``, writable) before the model is built. Raises
    UsageError (exit 2) for an output that cannot be drawn, ModelRaisedError when the model raises.
    Holds the run lock (``exclusive``) throughout.
    """
    with exclusive(options.model):
        return _run_fmaps(options, fmap, output=output)


def _run_fmaps(options: RunOptions, fmap: FmapOptions, *, output: str | os.PathLike[str] | None) -> FeatureMaps:
    spec = fmap.validate()
    opts = replace(options, layers=[spec.layer], types=None, depth=None, all_modules=False).validate()
    target = check_png(output) if output is not None else None
    prep = prepare(opts)
    require_values(prep, "fmaps")
    if len(prep.selection) != 1:
        names = ", ".join(n for n, _ in prep.selection[:5]) + (", ..." if len(prep.selection) > 5 else "")
        raise UsageError(f"--layer {spec.layer!r} matches {len(prep.selection)} modules ({names})",
                         hint="fmaps draws one module: give its exact name")
    name, module = prep.selection[0]
    report, captured = _capture(prep, spec)
    label = name or "(model)"
    calls = _called(report.layers, captured, spec, label)
    path, got = _pick(captured, spec.output_key, label)
    shown_label = (f"{label}#{spec.call}" if calls > 1 else label) + path
    result = FeatureMaps(model=prep.info, layer=name, type=type(module).__name__, inputs=list(prep.inputs.infos),
                         device=report.device, mode=report.mode, call=spec.call, calls=calls, output=path,
                         shape=got.shape, dtype=dtype_name(got.dtype), sample=spec.sample, version=__version__)
    x = _maps(got, shown_label, spec, result)
    kind = "bars" if x.dim() == 1 else "grid"
    unit = "feature" if kind == "bars" else "channel"
    count = x.shape[0]
    wanted_channels = parse_channels(spec.channels)  # already parsed by validate(): for the type
    chosen = _channel_list(wanted_channels, count, shown_label, unit)
    if wanted_channels == DEFAULT_CHANNELS and count > DEFAULT_CHANNELS:
        result.notes.append(f"showing the first {len(chosen)} of {count} {unit}s (choose with --channels)")
    lo, hi, mean, statuses = channel_stats(x.reshape(count, -1))
    wanted = set(chosen)
    result.channels = [
        ChannelRecord(index=i, min=_finite(lo[i]), max=_finite(hi[i]), mean=float(mean[i]), status=statuses[i],
                      shown=i in wanted)
        for i in range(count)
    ]
    _check_image_size(kind, x.shape, len(chosen), spec.scale)
    _draw(result, kind, x, chosen, spec.scale)
    if target is not None:
        from hookcli.output import write_atomic

        data = encode_png(result.image)
        write_atomic(target, data)
        result.path, result.file_bytes = os.fspath(output), len(data)  # type: ignore[arg-type]
    return result


def _capture(prep: Prepared, spec: FmapOptions) -> tuple[Report, dict[str, _Captured]]:
    """The forward report of the one selected module, and each output tensor of its call ``spec.call``
    by output path (the wanted sample copied to the CPU); ModelRaisedError when the model raises."""
    captured: dict[str, _Captured] = {}

    def keep(_name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        if call != spec.call:
            return
        take = tensor.dim() >= 1 and tensor.shape[0] > spec.sample and tensor.is_floating_point()
        sample = tensor.detach()[spec.sample].to("cpu", copy=True) if take else None
        captured[path] = _Captured(shape_of(tensor), tensor.dtype, sample)

    report = forward_report(prep, "fmaps", stats=False, keep=keep)  # raises ModelRaisedError
    return report, captured


def _called(records: Sequence[LayerRecord], captured: dict[str, _Captured], spec: FmapOptions, label: str) -> int:
    """How many times the module ran; UsageError when it never ran, ran fewer times than ``--call``
    asks, or returned no tensor on that call."""
    calls = max((r.calls for r in records), default=0)
    if calls == 0 or not any(r.called for r in records):
        raise UsageError(f"{label} was not called by the model's forward", hint="choose a module that runs")
    if spec.call >= calls:
        raise UsageError(f"--call {spec.call}: {label} was called {calls} time{'s' if calls > 1 else ''}"
                         f" (calls 0-{calls - 1})", hint=f"give --call 0 to {calls - 1}")
    if not captured:
        raise UsageError(f"{label} returned no tensor on call {spec.call}",
                         hint="choose a module that returns a tensor (hookcli shapes MODEL --all shows them)")
    return calls


def _maps(got: _Captured, shown_label: str, spec: FmapOptions, result: FeatureMaps) -> torch.Tensor:
    """The sample as maps to draw, (C, H, W), or as features drawn as bars, (C,): a channels-last
    output permuted and maps of 1x1 flattened, each with its note in ``result``."""
    x = _drawable(got, shown_label, spec.sample)
    if x.dim() == 3 and _channels_last(got.shape, spec.channel_dim):
        x = x.permute(2, 0, 1)  # (H, W, C) -> (C, H, W)
        how = "--channel-dim" if spec.channel_dim is not None else "its dims 1 and 2 are equal; --channel-dim 1 says otherwise"
        result.notes.append(f"{shown_label}: [{', '.join(map(str, got.shape))}] drawn as channels-last "
                            f"[batch, height, width, channels] ({how})")
    if x.dim() == 3 and x.shape[1] * x.shape[2] == 1:
        x = x.reshape(-1)
        result.notes.append(f"{shown_label}: maps of 1x1 drawn as bars")
    return x


def _draw(result: FeatureMaps, kind: str, x: torch.Tensor, chosen: list[int], scale: int | None) -> None:
    """The image of the ``chosen`` channels of ``x`` (``kind``: "bars" or "grid") and its layout, into
    ``result``; ``scale``: the one asked for, else the automatic one."""
    selected = x[chosen]
    if kind == "bars":
        scale = scale or 1
        image = bar_image(selected, scale)
        tile = [BAR_HEIGHT * scale, BAR_WIDTH * scale]
        grid = [1, len(chosen)]
    else:
        scale = scale or auto_scale(int(x.shape[1]), int(x.shape[2]))
        image = grid_image(normalize_maps(selected), scale)
        tile = [int(x.shape[1]) * scale, int(x.shape[2]) * scale]
        cols = min(math.ceil(math.sqrt(len(chosen))), len(chosen))
        grid = [math.ceil(len(chosen) / cols), cols]
    result.kind, result.scale, result.tile, result.grid = kind, scale, tile, grid
    result.image_size = [int(image.shape[2]), int(image.shape[1])]
    result.image = image


def _channels_last(shape: Sequence[int], channel_dim: int | None) -> bool:
    """Whether a 4-D output is [batch, height, width, channels]: as ``channel_dim`` says, else when its
    dims 1 and 2 are equal (square maps) and dim 3 differs (Swin's [B, 7, 7, 768])."""
    if len(shape) != 4:
        return False
    if channel_dim is not None:
        return channel_dim in (3, -1)
    return shape[1] == shape[2] and shape[2] != shape[3]


def _image_size(kind: str, shape: Sequence[int], n: int, scale: int) -> tuple[int, int]:
    """(height, width) in px of the image fmaps would draw (as make_grid lays it out)."""
    if kind == "bars":
        return BAR_HEIGHT * scale + 2 * PADDING, n * (BAR_WIDTH * scale + PADDING) + PADDING
    cols = min(math.ceil(math.sqrt(n)), n)
    rows = math.ceil(n / cols)
    return (rows * (shape[1] * scale + PADDING) + PADDING, cols * (shape[2] * scale + PADDING) + PADDING)


def _check_image_size(kind: str, shape: Sequence[int], n: int, scale: int | None) -> None:
    """Refuse an image too big to draw or open, before drawing it (UsageError, exit 2)."""
    used = scale or (1 if kind == "bars" else auto_scale(int(shape[1]), int(shape[2])))
    height, width = _image_size(kind, shape, n, used)
    if max(height, width) > MAX_SIDE or height * width > MAX_PIXELS:
        fits = [s for s in range(1, used) if (lambda h, w: max(h, w) <= MAX_SIDE and h * w <= MAX_PIXELS)(
            *_image_size(kind, shape, n, s))]
        what = f"--scale {fits[-1]} or less" if fits else "fewer --channels"
        raise UsageError(f"the image would be {width}x{height} px ({n} tiles at scale {used}); "
                         f"fmaps draws at most {MAX_SIDE} px a side and {MAX_PIXELS:,} px in all",
                         hint=f"use {what}")


def _finite(value: torch.Tensor) -> float | None:
    v = float(value)
    return v if math.isfinite(v) else None


def _drawable(got: _Captured, label: str, sample: int) -> torch.Tensor:
    """The sample's (C, H, W) maps or (F,) vector; UsageError for anything else."""
    shape = "x".join(map(str, got.shape)) or "()"
    if not got.dtype.is_floating_point:
        raise UsageError(f"{label} output is {dtype_name(got.dtype)} [{shape}]: fmaps draws floating-point outputs",
                         hint="choose a layer that returns activations")
    if len(got.shape) not in (2, 4):
        raise UsageError(
            f"{label} output has shape [{shape}]: fmaps draws (batch, channels, height, width) maps or "
            "(batch, features) vectors",
            hint="see each module's output shape with: hookcli shapes MODEL --all")
    if got.sample is None:
        raise UsageError(f"--sample {sample}: the batch has {got.shape[0]} item{'s' if got.shape[0] != 1 else ''}",
                         hint=f"give --sample 0 to {got.shape[0] - 1}, or a larger --batch-size")
    return got.sample


__all__ = [
    "FmapOptions",
    "auto_scale",
    "bar_image",
    "channel_stats",
    "check_png",
    "grid_image",
    "normalize_maps",
    "parse_channels",
    "run_fmaps",
]
