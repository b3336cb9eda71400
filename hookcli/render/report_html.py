"""``hookcli report --html FILE``: one self-contained HTML page of a WatchReport, drawn by matplotlib.

The figures are inline SVG (static: no JavaScript, no fonts or images to fetch; the heatmap's pixels
are an inline ``data:`` PNG inside the SVG), so the page opens offline. matplotlib is an optional
dependency (``pip install 'hookcli[report]'``), imported only here and only when a page is drawn; it
draws on its own Figure objects with the SVG backend, under a temporary ``rc_context``: the user's
pyplot backend and global rcParams are left as they were. Never imports torch.
"""

from __future__ import annotations

import html
import io
import math
import re
from typing import Any

from hookcli.errors import UnsupportedError
from hookcli.escape import escape_control
from hookcli.records import WatchReport
from hookcli.render.report import LOG_SPAN, finding_parts, header, scale, summary_columns, verdict, what
from hookcli.render.table import distinct_crops

INSTALL_HINT = "pip install 'hookcli[report]' (matplotlib draws the HTML report)"
#: Small multiples of the per-row curves: this many per line.
CURVES_PER_LINE = 4


def check_matplotlib() -> None:
    """UnsupportedError (exit 2) when matplotlib, the HTML report's plotting library, is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UnsupportedError("--html needs matplotlib, which is not installed", hint=INSTALL_HINT) from None


def _label(text: str) -> str:
    """A name as matplotlib text: control characters escaped, ``$`` not read as mathtext."""
    return escape_control(text).replace("$", r"\$")


#: A name in a figure is at most this long (the table below the figures has every name whole).
FIGURE_NAME_WIDTH = 60


def figure_names(report: WatchReport) -> list[str]:
    """The rows' names as the figures label them: shortened in the middle, two names never alike
    (matplotlib lays a megabyte-long label out for minutes)."""
    return distinct_crops([escape_control(s.name) for s in report.series], FIGURE_NAME_WIDTH,
                          [s.name for s in report.series])


def _svg(figure: Any) -> str:
    """``figure`` as an inline ``<svg>`` element (no XML prolog, no DOCTYPE, no metadata, no comments)."""
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "hookcli"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None,
                                                                            "Format": None, "Type": None})
    text = buffer.getvalue()
    return re.sub(r"<!--.*?-->", "", text[text.index("<svg"):], flags=re.DOTALL)  # its comments repeat the labels


def _values(values: list[float | None]) -> list[float]:
    """None (not logged) as NaN, which matplotlib leaves out."""
    return [math.nan if v is None else float(v) for v in values]


def heatmap_svg(report: WatchReport) -> str:
    """The layers x logged steps heatmap (log colour scale when ``scale`` says so)."""
    from matplotlib.colors import ListedColormap, LogNorm, Normalize
    from matplotlib.figure import Figure

    grid = [[v if math.isfinite(v) else math.nan for v in _values(s.values)] for s in report.series]
    finite = [v for row in grid for v in row if math.isfinite(v)]
    kind = scale(finite)
    norm = (LogNorm(min(finite), max(finite)) if kind == "log"
            else Normalize(min(finite), max(finite)) if finite else Normalize(0, 1))
    figure = Figure(figsize=(10, 1.2 + 0.25 * max(1, len(grid))))
    axes = figure.add_subplot()
    image = axes.imshow(grid or [[math.nan]], aspect="auto", interpolation="nearest", norm=norm, cmap="viridis")
    bad = [[1.0 if v is not None and not math.isfinite(v) else math.nan for v in s.values] for s in report.series]
    if any(v == 1.0 for row in bad for v in row):  # NaN/Inf in red over the blank of "not logged"
        axes.imshow(bad, aspect="auto", interpolation="nearest", cmap=ListedColormap(["#d62728"]))
    axes.set_yticks(range(len(report.series)), [_label(n) for n in figure_names(report)])
    ticks = sorted({round(i * (len(report.steps) - 1) / 5) for i in range(6)}) if len(report.steps) > 1 else [0]
    axes.set_xticks(ticks, [str(report.steps[i]) for i in ticks])
    axes.set_xlabel("step")
    axes.set_title(_label(f"{what(report)} ({kind} scale)"))
    figure.colorbar(image, ax=axes, label=_label(report.stat))
    return _svg(figure)


def curves_svg(report: WatchReport) -> str:
    """The loss and one curve per row, small multiples (each with its own y axis)."""
    from matplotlib.figure import Figure

    panels = [("loss", report.losses), *zip(figure_names(report), (s.values for s in report.series))]
    lines = math.ceil(len(panels) / CURVES_PER_LINE)
    figure = Figure(figsize=(3 * CURVES_PER_LINE, 2.2 * lines), layout="constrained")
    for i, (name, values) in enumerate(panels):
        axes = figure.add_subplot(lines, CURVES_PER_LINE, i + 1)
        axes.plot(report.steps, _values(values), marker="." if len(values) < 50 else None, linewidth=1)
        if scale(values) == "log":
            axes.set_yscale("log")
        axes.set_title(_label(name), fontsize=9)
        axes.tick_params(labelsize=7)
    return _svg(figure)


def esc(text: object) -> str:
    """Any text as HTML, in an element or a quoted attribute alike: control characters escaped, then
    ``& < > " '`` as entities. Every value the page shows goes through here (text from the log is data)."""
    return html.escape(escape_control(text), quote=True)


#: The class a finding's line gets, by its severity (a severity from the log is text, never a class name).
SEVERITY_CLASS = {"error": "error", "warning": "warning"}


def render_html(report: WatchReport) -> str:
    """The report as one HTML page: header, verdict, findings, heatmap, curves, and a table of each
    row's first, last, smallest and largest values. Every value goes through ``esc``; attributes are quoted."""
    check_matplotlib()
    columns = summary_columns()
    number = ' class="n"'
    rows = ["<tr>" + "".join(f"<td{number if c.justify == 'right' else ''}>{esc(c.display(s).text)}</td>"
                             for c in columns) + "</tr>" for s in report.series]
    findings = "".join(f'<li class="{esc(SEVERITY_CLASS.get(f.severity, "other"))}">'
                       f"{esc(' · '.join(finding_parts(f)))}</li>" for f in report.findings)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{esc(f"hookcli report {report.path}")}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; }}
.error {{ color: #b00; }} .warning {{ color: #a60; }} .ok {{ color: #070; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 8px; border-bottom: 1px solid #ddd; }}
td.n {{ text-align: right; font-family: monospace; }} svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h1>hookcli report</h1>
<p>{esc(' · '.join(header(report)))}</p>
<p class="{esc('ok' if report.ok else 'error')}"><b>{esc(verdict(report))}</b></p>
{"".join(f"<p>note: {esc(n)}</p>" for n in report.notes)}
<h2>Findings</h2>
{f"<ul>{findings}</ul>" if findings else "<p>none</p>"}
<h2>Heatmap: {esc(report.stat)}</h2>
<p>Log colour scale when every value is above 0 and they span {esc(f"{LOG_SPAN:g}")}x or more; red: NaN/Inf; blank: not logged.</p>
<figure id="heatmap">{heatmap_svg(report)}</figure>
<h2>Curves</h2>
<figure id="curves">{curves_svg(report)}</figure>
<h2>Values</h2>
<table><tr>{"".join(f"<th>{esc(c.header)}</th>" for c in columns)}</tr>
{"".join(rows)}
</table>
</body></html>
"""
