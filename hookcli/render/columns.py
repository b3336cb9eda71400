"""The one column definition per report kind that table, markdown and CSV all read.

A :class:`Column` carries a display getter (styled text for the table and markdown) and a raw getter
(the machine value for CSV), so the three formats never disagree. Columns flagged ``table=False``
are CSV-only (call index, depth, ...); ``csv=False`` ones are derived display values (ratios).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from hookcli.records import LayerRecord, ModuleRow, ParamRecord, Report, statistics
from hookcli.render.formats import (
    format_count,
    format_number,
    format_percent,
    format_shape,
    format_shapes,
)

R = TypeVar("R")
Justify = Literal["left", "center", "right"]
ReportKind = Literal["shapes", "stats", "grads"]

DIM = "dim"
RED = "red"
BOLD_RED = "bold red"
YELLOW = "yellow"


@dataclass(frozen=True)
class Cell:
    """A display string and an optional Rich style (ignored by markdown)."""

    text: str
    style: str | None = None


@dataclass(frozen=True)
class Column(Generic[R]):
    """One column: CSV ``key``, display ``header``, display and raw getters, justification."""

    key: str
    header: str
    display: Callable[[R], Cell]
    raw: Callable[[R], Any]
    justify: Justify = "left"
    no_wrap: bool = False
    table: bool = True
    csv: bool = True
    squeeze: int = 0  # table too wide: 0 never crop, else crop in this order (1 first; 2+ after
    #                   the gap between columns narrowed)
    min_width: int = 0  # narrowest width a squeezed column is cropped to
    drop: int = 0  # table too narrow for the names: 0 never left out, else left out in this order (1 first)


def report_kind(report: Report) -> ReportKind:
    """``shapes`` (also ``features`` and ``fmaps``), ``grads``, or ``stats`` for every other command."""
    if report.command in ("shapes", "features", "fmaps"):
        return "shapes"
    if report.command == "grads":
        return "grads"
    return "stats"


def indent(label: str, depth: int) -> str:
    """``label`` indented by two spaces per level below the first."""
    return "  " * max(0, depth - 1) + label


def csv_shape(shape: Sequence[int] | None) -> str:
    """``1x64x56x56`` for CSV; ``()`` for a scalar, empty for None."""
    if shape is None:
        return ""
    return "x".join(str(int(d)) for d in shape) if len(shape) else "()"


def _text(value: str, style: str | None = None) -> Cell:
    return Cell(value, style)


def _num(value: float | int | None) -> Cell:
    return Cell(format_number(value))


def _count(value: int | float | None) -> Cell:
    return Cell(format_count(value))


def _get(data: dict[str, Any] | None, key: str) -> Any:
    return None if data is None else data.get(key)


def _field(attr: str, key: str) -> Callable[[Any], Any]:
    """Raw getter: ``record.<attr>[key]`` (None when the dict is missing)."""
    return lambda record: _get(getattr(record, attr), key)


# --------------------------------------------------------------------------- layer rows


def _shape_cell(rec: LayerRecord) -> Cell:
    if rec.raised:
        return Cell("raised", RED)
    if not rec.called:
        return Cell("container" if rec.container else "not called", DIM)
    return Cell(format_shape(rec.shape))


def _grad_cell(stat: statistics.Statistic, first: bool) -> Callable[[LayerRecord], Cell]:
    def display(rec: LayerRecord) -> Cell:
        if rec.grad is None:
            if first and rec.called and not rec.raised:
                return Cell("no grad", DIM)
            return Cell("-", DIM)
        return _cell(rec.grad.get(stat.name), stat.format)

    return display


def _input_grad_norms(rec: LayerRecord, sep: str, fmt: Callable[[Any], str]) -> str:
    if not rec.grad_input:
        return ""
    return sep.join(fmt(_get(g, "norm")) for g in rec.grad_input)


def _cell(value: Any, fmt: str) -> Cell:
    """A statistic's value as its table format shows it (``records.statistics.Statistic.format``)."""
    if fmt == "percent":
        return Cell(format_percent(value))
    return _count(value) if fmt == "count" else _num(value)


def _stat_display(stat: statistics.Statistic) -> Callable[[LayerRecord], Cell]:
    def display(rec: LayerRecord) -> Cell:
        return _cell(_get(rec.stats, stat.name), stat.format)

    return display


def layer_columns(report: Report) -> list[Column[LayerRecord]]:
    """All columns of a report's layer rows: ``table`` flags follow the command, ``csv`` data."""
    kind = report_kind(report)
    layers = report.layers
    shapes, stats, grads = kind == "shapes", kind == "stats", kind == "grads"
    any_stats = stats or any(r.stats is not None for r in layers)
    any_grad = grads or any(r.grad is not None for r in layers)
    any_grad_input = any(r.grad_input for r in layers)
    cols: list[Column[LayerRecord]] = [
        Column("kind", "", lambda r: _text("layer"), lambda r: "layer", table=False),
        Column("name", "Layer", lambda r: _text(indent(r.label, r.depth)), lambda r: r.name,
               no_wrap=True, squeeze=2, min_width=16),
        Column("call", "", lambda r: _count(r.call), lambda r: r.call, table=False),
        Column("output", "", lambda r: _text(r.output), lambda r: r.output, table=False),
        Column("type", "Type", lambda r: _text(r.type), lambda r: r.type, squeeze=1,
               min_width=8),
        Column("called", "", lambda r: _text(str(r.called)), lambda r: r.called, table=False),
    ]
    if any(r.raised for r in layers):
        cols.append(Column("raised", "", lambda r: _text(str(r.raised)), lambda r: r.raised,
                           table=False))
    cols += [
        Column("depth", "", lambda r: _count(r.depth), lambda r: r.depth, table=False),
        Column("input_shapes", "Input shape", lambda r: _text(format_shapes(r.input_shapes)),
               lambda r: ";".join(csv_shape(s) for s in r.input_shapes), no_wrap=True,
               table=shapes, squeeze=3, min_width=16),
        Column("shape", "Output shape" if shapes else "Shape", _shape_cell,
               lambda r: csv_shape(r.shape), no_wrap=True),
        Column("dtype", "Dtype", lambda r: _text(r.dtype or "-"), lambda r: r.dtype,
               table=shapes),
        Column("params", "Params", lambda r: _count(r.params), lambda r: r.params,
               justify="right", table=shapes),
    ]
    if any(r.flops is not None for r in layers):
        cols.append(Column("flops", "FLOPs", lambda r: _count(r.flops), lambda r: r.flops,
                           justify="right", table=shapes))
    if any_stats:
        for stat in statistics.statistics_for(statistics.ACTIVATION, extra=False):
            cols.append(Column(f"stat_{stat.name}", stat.header_in(statistics.ACTIVATION), _stat_display(stat),
                               _field("stats", stat.name), justify="right", table=stats,
                               drop={"norm": 1, "std": 2}.get(stat.name, 0)))
    if any_grad:
        for i, stat in enumerate(statistics.statistics_for(statistics.GRADIENT, extra=False)):
            cols.append(Column(f"grad_{stat.name}", stat.header_in(statistics.GRADIENT), _grad_cell(stat, i == 0),
                               _field("grad", stat.name), justify="right", table=grads,
                               drop={"std": 1, "mean": 2}.get(stat.name, 0)))
    if any_grad_input:
        cols.append(Column(
            "grad_input_norm", "Input grad norm",
            lambda r: _text(_input_grad_norms(r, ", ", format_number) or "-"),
            lambda r: _input_grad_norms(r, ";", lambda v: "" if v is None else repr(v)),
            justify="right", table=grads))
    return cols


def layer_row_style(report: Report, rec: LayerRecord) -> str | None:
    """Row style for anomalies: NaN/Inf bold red, all-zero yellow, raised red, not called dim."""
    if rec.raised:
        return RED
    if not rec.called:
        return DIM
    kind = report_kind(report)
    data = rec.grad if kind == "grads" else rec.stats
    if (_get(data, "nan_count") or 0) > 0 or (_get(data, "inf_count") or 0) > 0:
        return BOLD_RED
    if kind == "stats" and _get(rec.stats, "zero_fraction") == 1.0:
        return YELLOW
    return None


# --------------------------------------------------------------------------- parameter rows


def grad_ratio(p: ParamRecord) -> float | None:
    """Gradient norm / weight norm; None when either is missing or the weight is all zero
    (zero-initialised biases would otherwise show a meaningless ``inf``)."""
    grad_norm = _get(p.grad, "norm")
    if grad_norm is None or not p.norm:
        return None
    return float(grad_norm) / float(p.norm)


def _param_grad_cell(stat: statistics.Statistic, first: bool) -> Callable[[ParamRecord], Cell]:
    def display(p: ParamRecord) -> Cell:
        if p.grad is None:
            if first:
                return Cell("no grad" if p.requires_grad else "frozen", DIM)
            return Cell("-", DIM)
        return _cell(p.grad.get(stat.name), stat.format)

    return display


def _param_grad_statistics() -> list[statistics.Statistic]:
    """The parameter table's gradient columns before the weight's: its statistics in table order but the
    counts (NaN, Inf: columns after the ratio)."""
    return [s for s in statistics.statistics() if s.format != "count"
            and statistics.PARAM_GRADIENT in s.directions | s.extra_in]


def param_columns(report: Report) -> list[Column[ParamRecord]]:
    """Columns of the ``Parameters`` table of a grads report (``Clipped`` only when recorded)."""
    cols: list[Column[ParamRecord]] = [
        Column("kind", "", lambda p: _text("param"), lambda p: "param", table=False),
        # names are what people read: crop shapes first, names only to a wide floor
        Column("name", "Parameter", lambda p: _text(p.name), lambda p: p.name, no_wrap=True,
               squeeze=3, min_width=28),
        Column("requires_grad", "", lambda p: _text(str(p.requires_grad)),
               lambda p: p.requires_grad, table=False),
        Column("shape", "Shape", lambda p: _text(format_shape(p.shape)),
               lambda p: csv_shape(p.shape), no_wrap=True, squeeze=1, min_width=8),
    ]
    for i, stat in enumerate(_param_grad_statistics()):
        cols.append(Column(f"grad_{stat.name}", stat.header_in(statistics.PARAM_GRADIENT),
                           _param_grad_cell(stat, i == 0), _field("grad", stat.name), justify="right",
                           drop={"std": 1, "mean": 2, "min": 3, "max": 4}.get(stat.name, 0)))
    cols += [
        Column("norm", "Weight norm", lambda p: _num(p.norm), lambda p: p.norm, justify="right"),
        Column("ratio", "Ratio", lambda p: _num(grad_ratio(p)), grad_ratio, justify="right",
               csv=False),
    ]
    cols += [Column(f"grad_{stat.name}", stat.header_in(statistics.PARAM_GRADIENT), _param_grad_cell(stat, False),
                    _field("grad", stat.name), justify="right")
             for stat in statistics.statistics_for(statistics.PARAM_GRADIENT) if stat.format == "count"]
    if any(p.clipped is not None for p in report.params or []):
        cols.append(Column("clipped", "Clipped", lambda p: _count(p.clipped), lambda p: p.clipped,
                           justify="right"))
    return cols


def param_row_style(p: ParamRecord) -> str | None:
    """NaN/Inf gradients bold red; parameters without a gradient dim."""
    if (_get(p.grad, "nan_count") or 0) > 0 or (_get(p.grad, "inf_count") or 0) > 0:
        return BOLD_RED
    if p.grad is None:
        return DIM
    return None


# --------------------------------------------------------------------------- modules / models


def module_columns() -> list[Column[ModuleRow]]:
    """Columns of ``hookcli modules``: the tree indented by depth, subtree and own parameters."""
    return [
        Column("name", "Module", lambda m: _text(indent(m.name or "(model)", m.depth + 1)),
               lambda m: m.name, no_wrap=True, squeeze=2, min_width=16),
        Column("type", "Type", lambda m: _text(m.type), lambda m: m.type, squeeze=1,
               min_width=8),
        Column("depth", "", lambda m: _count(m.depth), lambda m: m.depth, table=False),
        Column("params", "Params", lambda m: _count(m.params), lambda m: m.params,
               justify="right"),
        Column("own_params", "Own params", lambda m: _count(m.own_params),
               lambda m: m.own_params, justify="right"),
        Column("children", "", lambda m: _count(m.children), lambda m: m.children, table=False),
    ]


def model_list_columns() -> list[Column[dict[str, str]]]:
    """Columns of ``hookcli models``."""
    return [
        Column("name", "Name", lambda m: _text(m.get("name", "")), lambda m: m.get("name", ""),
               no_wrap=True),
        Column("family", "Family", lambda m: _text(m.get("family", "")),
               lambda m: m.get("family", "")),
    ]


def table_columns(columns: Sequence[Column[R]]) -> list[Column[R]]:
    """The columns a table or markdown shows."""
    return [c for c in columns if c.table]


def csv_columns(columns: Sequence[Column[R]]) -> list[Column[R]]:
    """The columns CSV writes."""
    return [c for c in columns if c.csv]
