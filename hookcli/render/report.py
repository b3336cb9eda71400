"""Rendering a WatchReport (``hookcli report``): the terminal view, and the facts the HTML shares.

Never imports torch. The terminal view (``hookcli.render.table.report_table``): a header, a layer x logged-step heatmap of one statistic (the
loss on top, on its own scale), a sparkline per row (its own scale: the row's shape), the last value,
a legend saying the scale, then the findings and the verdict. ``scale`` decides linear or log once,
for the terminal and the HTML alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rich.cells import cell_len
from rich.text import Text

from hookcli.records import PARAM_KEYS, Finding, ReportSeries, WatchReport
from hookcli.render import summary
from hookcli.render.columns import BOLD_RED, DIM, Cell, Column
from hookcli.render.formats import format_number, plain

#: Eight levels, low to high: the heatmap's cells and the sparklines (readable without colour).
LEVELS = "▁▂▃▄▅▆▇█"
#: The heatmap's colours for the eight levels (256-colour terminal palette, dark blue to yellow).
PALETTE = ("color(17)", "color(19)", "color(25)", "color(31)", "color(37)", "color(71)", "color(149)",
           "color(226)")
MISSING = " "  # the row was not logged at that step (a module not called, a gradient that did not reach)
NON_FINITE = "!"  # a NaN or Inf among the values
#: Values that span this factor or more (all of them above 0) are drawn on a log scale.
LOG_SPAN = 100.0
SPARK_WIDTH = 12
LAST_WIDTH = 10
#: The names' column: this wide at most at 100 columns, and wider by every column a wider view adds.
NAME_WIDTH = 32
OTHER_WIDTH = 100 - NAME_WIDTH


def scale(values: Sequence[float | None]) -> str:
    """``"log"`` when every finite value is above 0 and the largest is ``LOG_SPAN`` times the smallest
    or more (RMS of gradients across depth, update ratios), else ``"linear"``."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite or min(finite) <= 0:
        return "linear"
    return "log" if max(finite) >= LOG_SPAN * min(finite) else "linear"


def what(report: WatchReport) -> str:
    """What the statistic describes: ``rms of each layer's output``, ``grad.rms of each output's gradient``."""
    if report.stat.startswith("param.grad.") :
        return f"{report.stat.removeprefix('param.grad.')} of each parameter's gradient"
    if report.stat in PARAM_KEYS:
        return f"{report.stat} of each parameter"
    if report.stat.startswith("grad."):
        return f"{report.stat.removeprefix('grad.')} of the gradient of each layer's output"
    return f"{report.stat} of each layer's output"


def buckets(count: int, width: int) -> list[range]:
    """``count`` logged steps as at most ``width`` contiguous groups, as even as can be."""
    n = max(1, min(count, width))
    return [range(i * count // n, (i + 1) * count // n) for i in range(n)]


def bucket_value(values: Sequence[float | None], group: range) -> float | None:
    """A group's value: NaN when any value in it is NaN or Inf, else the largest (a spike is never
    averaged away), None when none was logged."""
    seen = [values[i] for i in group if values[i] is not None]
    if any(not math.isfinite(v) for v in seen):  # type: ignore[arg-type]
        return math.nan
    return max(seen) if seen else None  # type: ignore[type-var]


class Scale:
    """Maps values onto the eight ``LEVELS`` between the finite ``low`` and ``high`` of ``values``."""

    def __init__(self, values: Sequence[float | None], kind: str | None = None) -> None:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        self.kind = kind or scale(finite)
        self.low = min(finite) if finite else 0.0
        self.high = max(finite) if finite else 0.0

    def _position(self, value: float) -> float:
        if self.kind == "log":
            low, high = math.log10(self.low), math.log10(self.high)
            value = math.log10(value) if value > 0 else low
        else:
            low, high = self.low, self.high
        return 0.0 if high <= low else (value - low) / (high - low)

    def level(self, value: float) -> int:
        return min(len(LEVELS) - 1, max(0, int(self._position(value) * len(LEVELS))))

    def cell(self, value: float | None) -> tuple[str, int | None]:
        """The character for ``value`` and its level (None: missing or not finite)."""
        if value is None:
            return MISSING, None
        if not math.isfinite(value):
            return NON_FINITE, None
        level = self.level(value)
        return LEVELS[level], level


def _strip(values: Sequence[float | None], groups: list[range], scale_: Scale, color: bool) -> Text:
    text = Text()
    for group in groups:
        char, level = scale_.cell(bucket_value(values, group))
        style = (PALETTE[level] if level is not None else BOLD_RED if char == NON_FINITE else "") if color else ""
        text.append(char, style=style)
    return text


def _last(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    return format_number(known[-1]) if known else "-"


def heatmap_lines(report: WatchReport, width: int, color: bool,
                  fit: Callable[[Sequence[str], int, Sequence[object]], list[str]]) -> list[Text]:
    """The heatmap block: a header, the loss row, a row per series (heatmap, sparkline, last value), an
    axis line and the legend; ``width`` cells wide. ``fit`` shortens names to a width, two different
    names never alike (the table's ``distinct_crops``: a name's start and end say the most). Names get
    up to ``NAME_WIDTH`` cells, and every cell of ``width`` past ``NAME_WIDTH + OTHER_WIDTH``
    (``--width``; ``--no-truncate``: all they need)."""
    from hookcli.escape import escape_control

    def _fit(text: str, width: int) -> str:
        return fit([text], width, [None])[0].ljust(width) if width > 0 else ""

    names = [escape_control(s.name) for s in report.series]
    types = [escape_control(s.type) for s in report.series]
    params = bool(report.series) and report.series[0].type == "parameter"
    name_w = min(max([cell_len(n) for n in names] + [9 if params else 5]), max(NAME_WIDTH, width - OTHER_WIDTH))
    type_w = 0 if params else min(max([cell_len(t) for t in types] + [4]), 14)
    spark_w = SPARK_WIDTH

    def room() -> int:
        return width - name_w - (type_w + 2 if type_w else 0) - (spark_w + 2 if spark_w else 0) - LAST_WIDTH - 4

    heat_w = room()
    if heat_w < 8 and type_w:  # narrow: drop the type column, then shorten the names, then the Trend
        type_w = 0
        heat_w = room()
    if heat_w < 8:
        name_w = max(8, name_w - (8 - heat_w))
        heat_w = room()
    if heat_w < 8:
        spark_w = 0
        heat_w = max(5, room())
    count = len(report.steps)
    groups = buckets(count, heat_w)
    sparks = buckets(count, max(spark_w, 1))
    heat_w = max(len(groups), len("Steps"))
    every = [v for s in report.series for v in s.values]
    heat = Scale(every)
    gap = "  "

    def row(name: str, kind: str, strip: Text, spark: Text, last: str, style: str = "") -> Text:
        line = Text(_fit(name, name_w) + gap, style=style)
        if type_w:
            line.append(_fit(kind, type_w) + gap, style=DIM if color else "")
        line.append_text(strip)
        line.append(" " * (heat_w - len(strip)) + gap)
        if spark_w:
            line.append_text(spark)
            line.append(" " * (spark_w - len(spark)) + gap)
        line.append(last.rjust(LAST_WIDTH))
        return line

    head = row("Parameter" if params else "Layer", "Type" if type_w else "", Text("Steps"), Text("Trend"), "Last",
               style="bold")
    lines = [head]
    loss_scale = Scale(report.losses)
    lines.append(row("loss", "", _strip(report.losses, groups, loss_scale, color),
                     _strip(report.losses, sparks, Scale(report.losses), False), _last(report.losses)))
    shown = fit(["loss", *names], name_w, [None, *(s.name for s in report.series)])[1:]
    for name, kind, series in zip(shown, types, report.series):
        lines.append(row(name, kind, _strip(series.values, groups, heat, color),
                         _strip(series.values, sparks, Scale(series.values, heat.kind), False), _last(series.values)))
    first, last = str(report.steps[0]), str(report.steps[-1])
    width_ = len(groups)
    axis = first + last.rjust(width_ - len(first)) if width_ > len(first) + len(last) else \
        first if count == 1 else f"{first}…{last}"
    axis = axis.ljust(heat_w)
    lines.append(Text(" " * (name_w + len(gap) + (type_w + len(gap) if type_w else 0)) + axis
                      + gap + "(step)", style=DIM if color else ""))
    per = math.ceil(count / len(groups))
    lines.append(Text(""))
    range_ = (f"{LEVELS[0]} {format_number(heat.low)} to {LEVELS[-1]} {format_number(heat.high)}, {heat.kind} scale "
              f"(log when every value is above 0 and they span {LOG_SPAN:g}x or more)"
              if any(v is not None and math.isfinite(v) for v in every) else "no finite value logged")
    legend = [f"{report.stat}: {range_}",
              f"a column: {'one logged step' if per == 1 else f'the largest value of up to {per} logged steps'}",
              f"'{NON_FINITE}': NaN/Inf", "blank: not logged", "loss and Trend: each row on its own scale"]
    for part in summary.pack(legend, width):
        lines.append(Text(part, style=DIM if color else ""))
    return lines


def finding_parts(finding: Finding) -> list[str]:
    """One finding as a line's parts: where, what, and its message whole (it is the finding)."""
    return [f"step {finding.step}", finding.severity, finding.rule, plain(finding.message)]


def header(report: WatchReport) -> list[str]:
    """The header line's parts."""
    steps = report.steps
    count = f"{len(steps)} logged step{'s' if len(steps) != 1 else ''}"
    span = f"step {steps[0]}" if len(steps) == 1 else f"{steps[0]} to {steps[-1]}"
    return [f"report {report.path}", f"{count} ({span})", what(report),
            f"{len(report.series)} row{'s' if len(report.series) != 1 else ''}"]


def verdict(report: WatchReport) -> str:
    """The last line: the gate's answer."""
    errors, warnings = len(report.errors), len(report.findings) - len(report.errors)
    counts = f"{len(report.findings)} finding{'s' if len(report.findings) != 1 else ''} " \
             f"({errors} error{'s' if errors != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''})"
    return f"FAILED: {counts}" if errors else f"ok: {counts}"


def summary_columns() -> list[Column[ReportSeries]]:
    """Name, Type, First, Last, Min, Max of each row (Markdown and HTML; Min and Max of the finite values)."""
    def known(s: ReportSeries) -> list[float]:
        return [v for v in s.values if v is not None]

    def finite(s: ReportSeries) -> list[float]:
        return [v for v in known(s) if math.isfinite(v)]

    def number(get):  # noqa: ANN001, ANN202 - a small getter pair
        return (lambda s: Cell(format_number(get(s))), get)

    return [
        Column("name", "Name", lambda s: Cell(s.name), lambda s: s.name),
        Column("type", "Type", lambda s: Cell(s.type), lambda s: s.type),
        Column("first", "First", *number(lambda s: known(s)[0] if known(s) else None), justify="right"),
        Column("last", "Last", *number(lambda s: known(s)[-1] if known(s) else None), justify="right"),
        Column("min", "Min", *number(lambda s: min(finite(s)) if finite(s) else None), justify="right"),
        Column("max", "Max", *number(lambda s: max(finite(s)) if finite(s) else None), justify="right"),
    ]


def csv_records(report: WatchReport) -> list[dict[str, object]]:
    """``--format csv``: one row per row and logged step (long format, as pandas likes it), the loss as
    the row ``(loss)``; a value not logged is empty."""
    rows: list[dict[str, object]] = [{"step": step, "name": "(loss)", "type": "loss", "stat": "loss", "value": loss}
                                     for step, loss in zip(report.steps, report.losses)]
    for series in report.series:
        rows += [{"step": step, "name": series.name, "type": series.type, "stat": report.stat, "value": value}
                 for step, value in zip(report.steps, series.values)]
    return rows
