"""Output formats, the renderer protocol and the small formatting helpers every renderer shares.

Nothing here (or anywhere under ``hookcli.render``) imports torch: renderers read plain records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeAlias, Union

from hookcli.options import OutputFormat  # the closed vocabulary lives in a leaf (config.py reads it too)
from hookcli.records import (
    CheckResult,
    DiffReport,
    FeatureExport,
    FeatureMaps,
    InputInfo,
    LayerRecord,
    ModelList,
    ModuleTree,
    Report,
    WatchReport,
)

#: Anything a renderer accepts.
Renderable: TypeAlias = Union[Report, ModuleTree, ModelList, FeatureExport, FeatureMaps, CheckResult, DiffReport, WatchReport]  # noqa: UP007


_SUFFIX_FORMATS = {
    ".json": OutputFormat.JSON,
    ".csv": OutputFormat.CSV,
    ".md": OutputFormat.MARKDOWN,
    ".markdown": OutputFormat.MARKDOWN,
    ".txt": OutputFormat.TABLE,
}


def format_for_path(path: str | os.PathLike[str]) -> OutputFormat | None:
    """The format a file extension implies (``.json``, ``.csv``, ``.md``, ``.txt``), or None."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    return _SUFFIX_FORMATS.get(suffix)


class Renderer(Protocol):
    """Turns a report into text; ``width``: table line width; ``color``: ANSI styles."""

    def render(
        self, report: Renderable, *, width: int | None = None, color: bool = False
    ) -> str: ...


# --------------------------------------------------------------------------- helpers


def format_shape(shape: Sequence[int] | None) -> str:
    """``[1, 64, 56, 56]``; ``-`` for None (no tensor)."""
    if shape is None:
        return "-"
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def format_shapes(shapes: Iterable[Sequence[int] | None]) -> str:
    """Several shapes joined by ``", "``; ``-`` when there are none."""
    parts = [format_shape(s) for s in shapes]
    return ", ".join(parts) if parts else "-"


def format_number(x: float | int | None) -> str:
    """Four significant digits (``f"{x:.4g}"``); ``nan``/``inf``/``-inf``; ``-`` for None."""
    if x is None:
        return "-"
    value = float(x)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"  # never "-0"
    return f"{value:.4g}"


def format_count(n: int | float | None) -> str:
    """An integer with thousands separators (``1,234,567``); ``-`` for None."""
    if n is None:
        return "-"
    if isinstance(n, float) and not n.is_integer():
        return format_number(n)
    return f"{int(n):,}"


def format_percent(fraction: float | None) -> str:
    """A fraction as a percentage with one decimal (``0.5`` -> ``50.0``); ``-`` for None."""
    if fraction is None:
        return "-"
    value = float(fraction) * 100
    if not math.isfinite(value):
        return format_number(value)
    return f"{value:.1f}"


#: Bytes per element by dtype name (``torch.`` prefix ignored); unknown dtypes count as 0 bytes.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "complex128": 16, "cdouble": 16, "complex64": 8, "cfloat": 8, "complex32": 4,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}


def dtype_bytes(dtype: str | None) -> int | None:
    """Bytes per element of a dtype name, or None when unknown."""
    if not dtype:
        return None
    name = dtype.removeprefix("torch.")
    return DTYPE_BYTES.get(name)


def tensor_bytes(shape: Sequence[int] | None, dtype: str | None) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` (0 when either is unknown)."""
    size = dtype_bytes(dtype)
    if shape is None or size is None:
        return 0
    return math.prod(int(d) for d in shape) * size


def input_bytes(inputs: Iterable[InputInfo]) -> int:
    """Total bytes of the model inputs."""
    return sum(tensor_bytes(i.shape, i.dtype) for i in inputs)


def output_bytes(layers: Iterable[LayerRecord]) -> int:
    """Total bytes of the recorded output tensors (every call, every output path)."""
    return sum(tensor_bytes(r.shape, r.dtype) for r in layers if r.called)


def format_mb(nbytes: int | float) -> str:
    """Bytes as megabytes with two decimals. MB means 10**6 bytes (as torchinfo prints them)."""
    return f"{nbytes / 1e6:,.2f} MB"


def plain(value: Any) -> str:
    """A one-line string for free text (newlines folded to spaces)."""
    return " ".join(str(value).split())
