"""Columns and footer lines of the two results that keep activations: ``features`` and ``fmaps``.

Table, markdown and CSV read the same columns (as for reports). ``features``: one row per saved
tensor. ``fmaps``: one row per channel in CSV; the table and markdown list only the channels worth
a look (dead, constant, NaN/Inf), the footer says how many and where the image went.
"""

from __future__ import annotations

from typing import Any

from hookcli.records import ChannelRecord, FeatureExport, FeatureMaps, SavedTensor
from hookcli.render.columns import DIM, RED, YELLOW, Cell, Column, csv_shape
from hookcli.render.formats import format_count, format_number, format_shape

ExportResult = FeatureExport | FeatureMaps
#: Channel statuses the table lists, in the order the footer counts them.
FLAGS: tuple[str, ...] = ("dead", "constant", "nonfinite")
_FLAG_WORDS = {"dead": "dead", "constant": "constant", "nonfinite": "with NaN/Inf"}
_FLAG_STYLES = {"dead": YELLOW, "constant": DIM, "nonfinite": RED}


def format_size(nbytes: int | None) -> str:
    """Bytes in B, kB, MB or GB (powers of 1000, as ``format_mb``); ``-`` for None."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# --------------------------------------------------------------------------- features


def saved_columns() -> list[Column[SavedTensor]]:
    """One row per saved tensor: its name in the file, module type, shape, dtype, size."""
    return [
        Column("label", "Name", lambda t: Cell(t.label), lambda t: t.label, no_wrap=True, squeeze=2,
               min_width=16),
        Column("name", "", lambda t: Cell(t.name), lambda t: t.name, table=False),
        Column("call", "", lambda t: Cell(format_count(t.call)), lambda t: t.call, table=False),
        Column("output", "", lambda t: Cell(t.output), lambda t: t.output, table=False),
        Column("type", "Type", lambda t: Cell(t.type), lambda t: t.type, squeeze=1, min_width=8),
        Column("shape", "Shape", lambda t: Cell(format_shape(t.shape)), lambda t: csv_shape(t.shape),
               no_wrap=True),
        Column("dtype", "Dtype", lambda t: Cell(t.dtype), lambda t: t.dtype),
        Column("bytes", "Size", lambda t: Cell(format_size(t.nbytes)), lambda t: t.nbytes,
               justify="right"),
    ]


def _features_footer(result: FeatureExport) -> list[list[str]]:
    total = sum(t.nbytes for t in result.entries)
    parts = [_plural(len(result.entries), "tensor"), format_size(total)]
    if result.batch_size is not None:
        batches = f"{result.batches} batch" + ("" if result.batches == 1 else "es")
        parts.append(f"{batches} of {result.batch_size}")
    if result.not_called:
        parts.append(f"{len(result.not_called)} not called")
    if result.path is None:
        saved = "not saved (no output file)"
    else:
        saved = f"saved to {result.path} ({result.format}, {format_size(result.file_bytes)})"
    return [parts, [saved]]


# --------------------------------------------------------------------------- fmaps


def _value(attr: str) -> Any:
    return lambda c: getattr(c, attr)


def channel_columns(result: FeatureMaps) -> list[Column[ChannelRecord]]:
    """One row per channel (per feature of a vector output)."""
    word = "Feature" if result.kind == "bars" else "Channel"
    return [
        Column("index", word, lambda c: Cell(str(c.index)), _value("index"), justify="right"),
        Column("status", "Status", lambda c: Cell(c.status, _FLAG_STYLES.get(c.status)), _value("status")),
        Column("min", "Min", lambda c: Cell(format_number(c.min)), _value("min"), justify="right"),
        Column("max", "Max", lambda c: Cell(format_number(c.max)), _value("max"), justify="right"),
        Column("mean", "Mean", lambda c: Cell(format_number(c.mean)), _value("mean"), justify="right"),
        Column("shown", "Shown", lambda c: Cell("yes" if c.shown else "no", None if c.shown else DIM),
               _value("shown")),
    ]


def flagged_channels(result: FeatureMaps) -> list[ChannelRecord]:
    """The channels the table lists: dead, constant or with NaN/Inf."""
    return [c for c in result.channels if c.status in FLAGS]


def _fmaps_footer(result: FeatureMaps) -> list[list[str]]:
    unit = "feature" if result.kind == "bars" else "channel"
    what = [f"{result.label} ({result.type})", f"output {format_shape(result.shape)} {result.dtype}",
            f"sample {result.sample}",
            f"{len(result.shown)} of {_plural(len(result.channels), unit)} shown"]
    counts = {flag: sum(c.status == flag for c in result.channels) for flag in FLAGS}
    if any(counts.values()):
        flags = [f"{n} {_FLAG_WORDS[flag]}" for flag, n in counts.items()]
    else:
        flags = [f"no dead or constant {unit}s"]
    rows, cols = result.grid or [0, 0]
    th, tw = result.tile or [0, 0]
    width, height = result.image_size or [0, 0]
    if result.kind == "bars":
        layout = f"{_plural(cols, 'bar')} of {tw}x{th} px"
    else:
        layout = f"{_plural(rows, 'row')} x {_plural(cols, 'column')} of {tw}x{th} px tiles"
    image = [layout + (f" (scale {result.scale})" if result.scale != 1 else ""),
             f"image {width}x{height} px"]
    image.append(f"saved to {result.path} ({format_size(result.file_bytes)})" if result.path
                 else "not saved (no output file)")
    return [what, flags, image]


# --------------------------------------------------------------------------- shared entry points


def table_sections(result: ExportResult) -> list[tuple[str, list[Column[Any]], list[Any]]]:
    """(title, columns, rows) of each table the table and markdown renderers draw."""
    if isinstance(result, FeatureExport):
        return [(result.command, list(saved_columns()), list(result.entries))] if result.entries else []
    rows = flagged_channels(result)
    title = "dead or constant " + ("features" if result.kind == "bars" else "channels")
    return [(title, list(channel_columns(result)), rows)] if rows else []


def csv_section(result: ExportResult) -> tuple[list[Column[Any]], list[Any]]:
    """The columns and rows CSV writes: every saved tensor, or every channel."""
    if isinstance(result, FeatureExport):
        return list(saved_columns()), list(result.entries)
    return list(channel_columns(result)), list(result.channels)


def footer_lines(result: ExportResult) -> list[list[str]]:
    """Lines under the table: totals and where the file went."""
    if isinstance(result, FeatureExport):
        return _features_footer(result)
    return _fmaps_footer(result)


__all__ = [
    "FLAGS",
    "ExportResult",
    "channel_columns",
    "csv_section",
    "flagged_channels",
    "footer_lines",
    "format_size",
    "saved_columns",
    "table_sections",
]
