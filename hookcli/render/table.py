"""Rich table renderer: header lines, one table per record kind, footer and failure lines."""

from __future__ import annotations

import io
import os
import textwrap
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from rich import box
from rich.cells import cell_len, get_character_cell_size, set_cell_size
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hookcli.records import (
    CheckResult, DiffReport, FeatureExport, FeatureMaps, ModelList, ModuleTree, Report, WatchReport, WatchRun,
)
from hookcli.render import checks, diff, exports, summary, watch
from hookcli.render import report as watch_report
from hookcli.render.columns import (
    Cell,
    Column,
    layer_columns,
    layer_row_style,
    model_list_columns,
    module_columns,
    param_columns,
    param_row_style,
    table_columns,
)
from hookcli.escape import escape_control
from hookcli.render.formats import Renderable

R = TypeVar("R")

DEFAULT_WIDTH = 120


def make_console(width: int | None = None, color: bool = False, colors: str = "standard") -> Console:
    """A Console writing to a string buffer; with ``color=False`` it emits no escape codes; ``colors``:
    Rich's colour system with colour on (``"256"`` for the report's heatmap palette)."""
    return Console(
        file=io.StringIO(),
        width=width or DEFAULT_WIDTH,
        force_terminal=color,
        force_jupyter=False,
        force_interactive=False,
        color_system=colors if color else None,  # type: ignore[arg-type]
        no_color=not color,
        highlight=False,
        markup=False,
        emoji=False,
        legacy_windows=False,
        soft_wrap=False,
    )


GAP = 2  # columns are separated by one space of padding and one of box


def crop(text: str, width: int, *, keep_end: bool = False) -> str:
    """``text`` cut to ``width`` cells with an ellipsis; ``keep_end`` keeps indent and tail."""
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return "…" if width == 1 else ""
    if not keep_end:
        return set_cell_size(text, width - 1) + "…"
    body = text.lstrip(" ")
    lead = text[: len(text) - len(body)]
    if len(lead) + 2 > width:
        lead = ""
    return lead + "…" + last_cells(body, width - len(lead) - 1)


def distinct_crops(texts: Sequence[str], width: int, keys: Sequence[object] | None = None) -> list[str]:
    """Each of ``texts`` shortened to ``width`` cells (``crop_middle``), two different texts never shown
    the same: where two crops would read alike (``bert.enc…attention.self.query`` for layer 0 and
    layer 1), each shows the part around where it departs from the others (``bert…layer.1.atte…query``);
    texts that still read alike (``a\\nb`` escaped as ``a\nb``, a width too small) get ``~2``, ``~3``
    after the first. ``keys``: what makes two texts different (default the texts; the raw names when
    ``texts`` are their escapes). The first of a clash keeps its crop."""
    keys = list(texts) if keys is None else list(keys)
    shown = [crop_middle(t, width) for t in texts]
    for clash in _clashes(keys, shown):
        for i in clash:
            shown[i] = _around_difference(texts[i], [texts[j] for j in clash if j != i], width)
    for _ in range(len(texts)):
        clashes = _clashes(keys, shown)
        if not clashes:
            break
        taken = set(shown)
        for clash in clashes:
            for k, i in enumerate(clash[1:], start=2):
                candidate = crop(texts[i], max(0, width - len(f"~{k}"))) + f"~{k}"
                while candidate in taken:
                    k += len(clash)
                    candidate = crop(texts[i], max(0, width - len(f"~{k}"))) + f"~{k}"
                shown[i] = candidate
                taken.add(candidate)
    return shown


def _clashes(keys: Sequence[object], shown: Sequence[str]) -> list[list[int]]:
    """Groups of indexes whose different keys are shown alike."""
    groups: dict[str, list[int]] = {}
    for i, text in enumerate(shown):
        groups.setdefault(text, []).append(i)
    return [g for g in groups.values() if len({keys[i] for i in g}) > 1]


def _around_difference(text: str, others: Sequence[str], width: int) -> str:
    """``text`` in ``width`` cells as its start, the part around where it first departs from the
    nearest of ``others``, and its end, with ``…`` between them."""
    if cell_len(text) <= width:
        return text
    depart = max(len(os.path.commonprefix([text, other])) for other in others)
    room = width - 2
    if room < 6:
        return crop_middle(text, width)
    head_len, tail_len = room // 4, room // 4
    mid_len = room - head_len - tail_len
    start = max(head_len, min(depart - mid_len // 2, len(text) - tail_len - mid_len))
    parts = (text[:head_len], text[start:start + mid_len], text[len(text) - tail_len:])
    shown = "…".join(parts)
    return shown if cell_len(shown) <= width else crop_middle(text, width)


def last_cells(text: str, width: int) -> str:
    """The longest end of ``text`` that fits ``width`` cells (one pass: a name may be megabytes long)."""
    start, used = len(text), 0
    while start > 0 and used + (size := get_character_cell_size(text[start - 1])) <= width:
        used += size
        start -= 1
    return text[start:]


def crop_middle(text: str, width: int) -> str:
    """``text`` shortened in the middle to ``width`` cells (``layer1.…downsample.0``), keeping its indent,
    its start and, longer, its end (a name's last parts say the most)."""
    if cell_len(text) <= width:
        return text
    body = text.lstrip(" ")
    lead = text[: len(text) - len(body)]
    if len(lead) + 4 > width:
        lead = ""
    room = width - len(lead) - 1
    if room < 3:
        return crop(text, width, keep_end=True)
    head_len = room // 3
    head = set_cell_size(body, head_len) if head_len else ""
    return lead + head + "…" + last_cells(body, room - cell_len(head))


def fold(text: str, width: int) -> tuple[str, bool]:
    """``text`` broken into lines of ``width`` after ``, `` (a shape ``[2, 197, 768]`` over two lines):
    nothing is lost; a part longer than ``width`` alone is cropped (then the flag is True)."""
    if cell_len(text) <= width:
        return text, False
    parts = text.split(", ")
    lines, current, cut = [], "", False
    for i, part in enumerate(parts):
        piece = part + ("," if i < len(parts) - 1 else "")
        candidate = f"{current} {piece}" if current else piece
        if current and cell_len(candidate) > width:
            lines.append(current)
            candidate = " " + piece if lines else piece
        current = candidate
    lines.append(current)
    out = []
    for line in lines:
        if cell_len(line) > width:
            line, cut = crop(line, width), True
        out.append(line)
    return "\n".join(out), cut


#: Columns whose cells fold onto more lines instead of being cropped.
FOLDED = ("shape", "input_shapes")


def wrap_header(header: str, width: int) -> str:
    """A header broken into lines of ``width`` between words (long words cropped)."""
    if cell_len(header) <= width:
        return header
    lines = textwrap.wrap(header, width=max(1, width), break_long_words=False) or [""]
    return "\n".join(crop(line, width) for line in lines)


def fit_widths(
    columns: Sequence[Column[R]], cells: list[list[Cell]], width: int
) -> tuple[list[int], int]:
    """Column widths and the gap between columns that fit ``width`` (see :func:`build_table`)."""
    body = [0] * len(columns)
    for row in cells:
        body = [max(w, cell_len(cell.text)) for w, cell in zip(body, row, strict=True)]
    widths = [max(w, cell_len(c.header)) for w, c in zip(body, columns, strict=True)]
    gap = GAP

    def excess() -> int:
        return sum(widths) + gap * max(0, len(widths) - 1) - width

    def cut(i: int, floor: int) -> None:
        widths[i] -= min(max(0, excess()), max(0, widths[i] - floor))

    def water_fill(pool: list[int], floor: int) -> None:
        while excess() > 0:
            widest = max(pool, key=lambda i: widths[i], default=None)
            if widest is None or widths[widest] <= floor:
                return
            widths[widest] -= 1

    for i, col in enumerate(columns):  # wrap headers wider than their cells ("Grad / mean")
        cut(i, max([body[i], 1] + [cell_len(word) for word in col.header.split()]))
    for priority, i in sorted((c.squeeze, i) for i, c in enumerate(columns) if c.squeeze):
        if priority > 1 and excess() > 0:
            gap = 1  # narrower gaps before cropping names
        cut(i, max(columns[i].min_width, cell_len(columns[i].header)))
    if excess() > 0:
        gap = 1
    names = [i for i, c in enumerate(columns) if c.key == "name"]
    shapes = [i for i, c in enumerate(columns) if c.key in FOLDED]
    text = [i for i, c in enumerate(columns) if c.justify != "right" and i not in names and i not in shapes]
    numbers = [i for i, c in enumerate(columns) if c.justify == "right" and i not in names + shapes]
    # text first, then names (shortened in the middle), shapes (folded onto more lines), numbers
    # (rounded to fewer digits, never cropped while that is enough), then everything further
    for pool, floor in ((text, 6), (names, 14), (shapes, 10), (numbers, 8), (names, 8), (shapes, 6),
                        (text, 4), (names, 6)):
        water_fill(pool, floor)
    water_fill(list(range(len(columns))), 3)
    return widths, gap


def _names_squeezed(columns: Sequence[Column[Any]], cells: list[list[Cell]], widths: list[int]) -> bool:
    """True when a name column is narrower than its names and than its floor (``min_width``, or 16),
    or a shape column than its shapes and 14 (it would fold onto more than two lines)."""
    for i, col in enumerate(columns):
        if col.key == "name" or col.key in FOLDED:
            longest = max((cell_len(row[i].text) for row in cells), default=0)
            floor = (col.min_width or 16) if col.key == "name" else 14
            if widths[i] < min(longest, floor):
                return True
    return False


def shorten_number(text: str, width: int) -> str:
    """A number cell in ``width`` cells: rounded to fewer significant digits (``-0.0005701`` ->
    ``-0.00057``), cropped with … only when even one digit does not fit."""
    if cell_len(text) <= width:
        return text
    try:
        value = float(text)
    except ValueError:
        return crop(text, width)
    for digits in (3, 2, 1):
        short = f"{value:.{digits}g}"
        if cell_len(short) <= width:
            return short
    return crop(text, width)


def _escaped(cell: Cell) -> Cell:
    """``cell`` with control characters made visible (names come from the model)."""
    text = escape_control(cell.text)
    return cell if text is cell.text else Cell(text, cell.style)


def line_text(text: str, style: str = "") -> Text:
    """A line outside the tables (header, notes, footer, failure), control characters escaped."""
    return Text(escape_control(text), style=style)


def print_lines(console: Console, lines: Iterable[Sequence[str]], style: str = "") -> None:
    """Print lines made of parts (header, footer), each packed to the console's width."""
    for parts in lines:
        for line in summary.pack(parts, console.width):
            console.print(line_text(line, style))


def console_text(console: Console) -> str:
    """What was printed to a ``make_console`` console, trailing spaces cut."""
    out = console.file
    assert isinstance(out, io.StringIO)
    return "\n".join(line.rstrip(" ") for line in out.getvalue().split("\n"))


def build_table(
    title: str,
    columns: Sequence[Column[R]],
    rows: Sequence[R],
    row_style: Callable[[R], str | None] | None = None,
    width: int = DEFAULT_WIDTH,
    cropped: set[str] | None = None,
) -> Table:
    """A ``rich.table.Table`` of ``rows`` under the table ``columns``, fitted to ``width``.

    When the table is too wide: long headers wrap; Type is cropped to its ``min_width``; the gap
    between columns narrows to one space; names are shortened in the middle to theirs
    (``layer1.…downsample.0``); then text columns (types), names, and only as the very last resort
    numbers are cropped, widest first. Shapes fold onto more lines instead. The headers of the
    columns where a cell was shortened are added to ``cropped`` (the renderer says so: never silently).
    """
    shown = table_columns(columns)
    all_cells = [[_escaped(col.display(row)) for col in shown] for row in rows]
    keep = list(range(len(shown)))
    while True:  # leave out optional columns (Grad std, ...) while names would be cut short
        cols = [shown[i] for i in keep]
        cells = [[row[i] for i in keep] for row in all_cells]
        widths, gap = fit_widths(cols, cells, width)
        if not _names_squeezed(cols, cells, widths):
            break
        optional = [i for i in keep if shown[i].drop]
        if not optional:
            break
        victim = min(optional, key=lambda i: shown[i].drop)
        keep.remove(victim)
        if cropped is not None:
            cropped.add(f"{shown[victim].header} (left out)")
    shown = cols
    table = Table(
        title=line_text(title, "bold"),
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        padding=(0, 1) if gap == GAP else (0, 0),
        header_style="bold",
    )
    for col, w in zip(shown, widths, strict=True):
        table.add_column(Text(wrap_header(col.header, w)), justify=col.justify, no_wrap=True,
                         overflow="ellipsis", max_width=w, vertical="bottom")
    for row, row_cells in zip(rows, cells, strict=True):
        texts = []
        for col, cell, w in zip(shown, row_cells, widths, strict=True):
            if col.key in FOLDED:
                text, cut = fold(cell.text, w)
            else:
                if col.key == "name":
                    text = crop_middle(cell.text, w)
                elif col.justify == "right":
                    text = shorten_number(cell.text, w)
                else:
                    text = crop(cell.text, w)
                cut = "…" in text and text != cell.text
            if cut and cropped is not None:
                cropped.add(col.header)
            texts.append(Text(text, style=cell.style or ""))
        table.add_row(*texts, style=row_style(row) if row_style else None)
    return table


def cropped_note(cropped: set[str], width: int) -> str | None:
    """The line that says cells were shortened to fit, and how to see them whole."""
    if not cropped:
        return None
    left = sorted(c.removesuffix(" (left out)") for c in cropped if c.endswith(" (left out)"))
    cut = sorted(c for c in cropped if not c.endswith(" (left out)"))
    parts = ([f"left out {', '.join(left)}"] if left else []) + ([f"shortened {', '.join(cut)} with …"] if cut else [])
    return (f"to fit {width} columns: {'; '.join(parts)}; --width N or --no-truncate shows everything "
            "(JSON always has it)")


class TableRenderer:
    """Renders any report as Rich tables (``--format table``, the default)."""

    def render(
        self, report: Renderable, *, width: int | None = None, color: bool = False
    ) -> str:
        """The report as text, ``width`` columns wide (default 120)."""
        if isinstance(report, CheckResult):
            return check_table(report, width=width, color=color)
        if isinstance(report, DiffReport):
            return diff_table(report, width=width, color=color)
        if isinstance(report, WatchReport):
            return report_table(report, width=width, color=color)
        if isinstance(report, WatchRun):
            return watch_table(report, width=width, color=color)
        console = make_console(width, color)
        print_lines(console, summary.header_lines(report))
        for note in summary.notes(report):
            console.print(line_text(note, "dim"))
        console.print()
        cropped: set[str] = set()
        for table in self._tables(report, console.width, cropped):
            console.print(table)
            console.print()
        note = cropped_note(cropped, console.width)
        if note:
            print_lines(console, [[note]], "dim")
        print_lines(console, summary.footer_lines(report))
        if isinstance(report, Report):
            failure = summary.failure_line(report.failure)
            if failure:
                console.print(line_text(failure, "bold red"))
        return console_text(console)

    def _tables(self, report: Renderable, width: int, cropped: set[str] | None = None) -> list[Table]:
        name = summary.title(report)
        if isinstance(report, ModelList):
            return [build_table(name, model_list_columns(), report.models, width=width, cropped=cropped)]
        if isinstance(report, ModuleTree):
            return [build_table(name, module_columns(), report.modules, width=width, cropped=cropped)]
        if isinstance(report, (FeatureExport, FeatureMaps)):
            return [build_table(title, cols, rows, width=width, cropped=cropped)
                    for title, cols, rows in exports.table_sections(report)]
        tables = [build_table(name, layer_columns(report), report.layers,
                              lambda r: layer_row_style(report, r), width, cropped)]
        if report.params:
            tables.append(build_table("Parameters", param_columns(report), report.params,
                                      param_row_style, width, cropped))
        return tables


def check_table(result: CheckResult, *, width: int | None = None, color: bool = False) -> str:
    """Header, the rules table, counts, the verdict and the details of every FAIL/WARN rule."""
    console = make_console(width, color)
    print_lines(console, checks.header_lines(result))
    for note in checks.notes(result):
        console.print(line_text(note, "dim"))
    console.print()
    cropped: set[str] = set()
    console.print(build_table("check", checks.check_columns(), result.rules, width=console.width, cropped=cropped))
    console.print()
    note = cropped_note(cropped - {"Message"}, console.width)  # FAIL/WARN messages are shown whole below
    if note:
        print_lines(console, [[note]], "dim")
    console.print(line_text(summary.SEP.join(checks.footer(result))))
    console.print(line_text(checks.verdict(result), "bold green" if result.ok else "bold red"))
    for line in checks.details(result):
        console.print(line_text(line, checks.STATUS_STYLES.get(line.split(" ", 1)[0]) or ""))
    text = console_text(console)
    if result.report.failure is not None:  # the rows gathered before the model raised
        text += "\npartial report:\n" + TableRenderer().render(result.report, width=width, color=color)
    return text


def diff_table(report: DiffReport, *, width: int | None = None, color: bool = False) -> str:
    """Header (run A, run B), the rows, counts, tolerances, the first divergence and the verdict."""
    console = make_console(width, color)
    print_lines(console, diff.header_lines(report))
    for note in diff.notes(report):
        console.print(line_text(note, "dim"))
    console.print()
    console.print(build_table("diff", diff.diff_columns(report), report.rows, diff.row_style, console.width))
    console.print()
    print_lines(console, diff.footer_lines(report))
    console.print(line_text(diff.verdict(report), "bold green" if report.ok else "bold red"))
    return console_text(console)


def report_table(report: WatchReport, *, width: int | None = None, color: bool = False) -> str:
    """``hookcli report``'s terminal view: header, heatmap with sparklines, legend, findings, verdict."""
    console = make_console(width, color, colors="256")
    print_lines(console, [watch_report.header(report)])  # report.notes go to stderr (hookcli.cli)
    console.print()
    for line in watch_report.heatmap_lines(report, console.width, color, distinct_crops):
        console.print(line)
    console.print()
    if report.findings:
        console.print(line_text("Findings", "bold"))
        for finding in report.findings:
            print_lines(console, [watch_report.finding_parts(finding)],
                        "red" if finding.severity == "error" else "yellow")
        console.print()
    console.print(line_text(watch_report.verdict(report), "bold green" if report.ok else "bold red"))
    return console_text(console)


def watch_table(run: WatchRun, *, width: int | None = None, color: bool = False) -> str:
    """``watch MODEL``: what was watched and where the log went, the findings, the verdict."""
    console = make_console(width, color)
    print_lines(console, [[f"watch: {watch.summary_line(run)}"]])
    for note in run.notes:
        console.print(line_text(note, "dim"))
    console.print()
    if run.findings:
        cropped: set[str] = set()
        console.print(build_table("findings", watch.finding_columns(), run.findings, width=console.width,
                                  cropped=cropped))
        console.print()
        note = cropped_note(cropped, console.width)
        if note:
            print_lines(console, [[note]], "dim")
    console.print(line_text(watch.verdict(run), "bold red" if run.errors else "bold green"))
    return console_text(console)
