"""CSV and Markdown renderers, reading the same columns as the table."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any, TypeVar

from hookcli.records import (
    CheckResult, DiffReport, FeatureExport, FeatureMaps, ModelList, ModuleTree, Report, WatchReport, WatchRun,
)
from hookcli.render import checks, diff, exports, summary, watch
from hookcli.render import report as watch_report
from hookcli.render.columns import (
    Column,
    csv_columns,
    layer_columns,
    model_list_columns,
    module_columns,
    param_columns,
    table_columns,
)
from hookcli.escape import csv_cell, escape_control
from hookcli.render.formats import Renderable

R = TypeVar("R")


def csv_value(value: Any) -> Any:
    """A raw value for CSV: empty for None, ``true``/``false`` for booleans, floats in repr,
    strings escaped and guarded against spreadsheet formulas (:func:`~hookcli.escape.csv_cell`)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return csv_cell(value)


def _union(*groups: Sequence[Column[Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for group in groups:
        for col in csv_columns(group):
            keys.setdefault(col.key, None)
    return list(keys)


def _rows(columns: Sequence[Column[R]], records: Sequence[R]) -> list[dict[str, Any]]:
    shown = csv_columns(columns)
    return [{c.key: csv_value(c.raw(r)) for c in shown} for r in records]


class CsvRenderer:
    """``--format csv``: a header row and one row per record (layers, then parameters).

    The report of a failed run (rows gathered before the model raised) has a last column
    ``partial`` holding ``true`` on every row.

    Lines end with ``\\n``. Shapes are written ``1x3x224x224`` (several joined by ``;``), numbers at
    full precision, None as an empty cell. A grads report's parameter rows (``kind=param``)
    share the file under the union of columns.
    """

    def render(
        self, report: Renderable, *, width: int | None = None, color: bool = False
    ) -> str:
        """The report as CSV text."""
        if isinstance(report, WatchReport):
            records = watch_report.csv_records(report)
            return self._write(["step", "name", "type", "stat", "value"],
                               [{k: csv_value(v) for k, v in row.items()} for row in records])
        if isinstance(report, CheckResult):
            return check_csv(report)
        if isinstance(report, DiffReport):
            cols = diff.diff_columns(report)
            return self._write(_union(cols), _rows(cols, report.rows))
        if isinstance(report, WatchRun):  # the findings, one row each
            cols = watch.finding_columns()
            return self._write(_union(cols), _rows(cols, report.findings))
        if isinstance(report, ModelList):
            cols: Sequence[Column[Any]] = model_list_columns()
            return self._write(_union(cols), _rows(cols, report.models))
        if isinstance(report, ModuleTree):
            cols = module_columns()
            return self._write(_union(cols), _rows(cols, report.modules))
        if isinstance(report, (FeatureExport, FeatureMaps)):
            cols, records = exports.csv_section(report)
            return self._write(_union(cols), _rows(cols, records))
        layer_cols = layer_columns(report)
        rows = _rows(layer_cols, report.layers)
        fields = _union(layer_cols)
        if report.params:
            param_cols = param_columns(report)
            fields = _union(layer_cols, param_cols)
            rows += _rows(param_cols, report.params)
        if report.partial:  # a failed run: a last column says so on every row
            fields.append("partial")
            rows = [{**row, "partial": "true"} for row in rows]
        return self._write(fields, rows)

    @staticmethod
    def _write(fieldnames: list[str], rows: list[dict[str, Any]]) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fieldnames, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()


#: Markdown that text from the model must not start: HTML tags, entities (``&#x202e;``), code spans,
#: inline links and images (``](``), table cells (``|``); backslashes first.
_MD_ESCAPES = (("\\", "\\\\"), ("|", "\\|"), ("<", "\\<"), (">", "\\>"), ("&", "\\&"),
               ("`", "\\`"), ("](", "]\\("))


def md_inline(text: str) -> str:
    """Free text for Markdown: control characters escaped (one line), and the characters that
    would start HTML, an entity, a code span, a link or a table cell backslash-escaped."""
    text = escape_control(text)
    for char, escaped in _MD_ESCAPES:
        text = text.replace(char, escaped)
    return text


def md_escape(text: str) -> str:
    """A table cell: as :func:`md_inline`, indentation kept as non-breaking spaces."""
    stripped = text.lstrip(" ")
    return "\u00a0" * (len(text) - len(stripped)) + md_inline(stripped)


_ALIGN = {"left": ":---", "right": "---:", "center": ":---:"}


def md_table(columns: Sequence[Column[R]], records: Sequence[R]) -> list[str]:
    """A GitHub pipe table (same headers and display strings as the Rich table)."""
    shown = table_columns(columns)
    lines = ["| " + " | ".join(md_escape(c.header) for c in shown) + " |",
             "| " + " | ".join(_ALIGN[c.justify] for c in shown) + " |"]
    for rec in records:
        lines.append("| " + " | ".join(md_escape(c.display(rec).text) for c in shown) + " |")
    return lines


class MarkdownRenderer:
    """``--format markdown``: a heading, the header lines, pipe tables and the footer."""

    def render(
        self, report: Renderable, *, width: int | None = None, color: bool = False
    ) -> str:
        """The report as GitHub-flavoured Markdown."""
        if isinstance(report, WatchReport):
            return report_markdown(report)
        if isinstance(report, CheckResult):
            return check_markdown(report)
        if isinstance(report, DiffReport):
            return diff_markdown(report)
        if isinstance(report, WatchRun):
            return watch_markdown(report)
        blocks: list[list[str]] = [[f"### {md_inline(summary.heading(report))}"]]
        blocks += [[md_inline(summary.SEP.join(line))] for line in summary.header_lines(report)]
        note_lines = summary.notes(report)
        if note_lines:
            blocks.append([f"- {md_inline(n)}" for n in note_lines])
        if isinstance(report, ModelList):
            blocks.append(md_table(model_list_columns(), report.models))
        elif isinstance(report, ModuleTree):
            blocks.append(md_table(module_columns(), report.modules))
        elif isinstance(report, (FeatureExport, FeatureMaps)):
            for title, cols, records in exports.table_sections(report):
                if title != report.command:
                    blocks.append([f"#### {md_inline(title)}"])
                blocks.append(md_table(cols, records))
        else:
            blocks.append(md_table(layer_columns(report), report.layers))
            if report.params:
                blocks.append(["#### Parameters"])
                blocks.append(md_table(param_columns(report), report.params))
        blocks += [[md_inline(summary.SEP.join(line))] for line in summary.footer_lines(report)]
        if isinstance(report, Report):
            failure = summary.failure_line(report.failure)
            if failure:
                blocks.append([f"**{md_inline(failure)}**"])
        return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def check_markdown(result: CheckResult) -> str:
    """A heading with the verdict, the header lines, the rules as a pipe table, then the details."""
    mark = "PASSED" if result.ok else "FAILED"
    blocks: list[list[str]] = [[f"### hookcli check: {md_inline(result.model.spec)}: {mark}"]]
    blocks += [[md_inline(summary.SEP.join(line))] for line in checks.header_lines(result)]
    if checks.notes(result):
        blocks.append([f"- {md_inline(n)}" for n in checks.notes(result)])
    blocks.append(md_table(checks.check_columns(), result.rules))
    blocks.append([md_inline(summary.SEP.join(checks.footer(result)))])
    blocks.append([f"**{md_inline(checks.verdict(result))}**"])
    if checks.details(result):
        blocks.append([f"  - {md_inline(line[4:])}" if line.startswith("  - ") else f"- {md_inline(line)}"
                       for line in checks.details(result)])
    text = "\n\n".join("\n".join(b) for b in blocks) + "\n"
    if result.report.failure is not None:  # the rows gathered before the model raised
        text += "\n#### Partial report\n\n" + MarkdownRenderer().render(result.report).split("\n", 2)[2]
    return text


def report_markdown(report: WatchReport) -> str:
    """``hookcli report`` as Markdown: heading with the verdict, header, findings, each row's first,
    last, smallest and largest value (the heatmap is the terminal's and the HTML's)."""
    blocks: list[list[str]] = [[f"### hookcli report: {md_inline(report.path)}"]]
    blocks.append([md_inline(summary.SEP.join(watch_report.header(report)))])
    if report.findings:
        blocks.append([f"- {md_inline(summary.SEP.join(watch_report.finding_parts(f)))}" for f in report.findings])
    blocks.append(md_table(watch_report.summary_columns(), report.series))
    blocks.append([f"**{md_inline(watch_report.verdict(report))}**"])
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def check_csv(result: CheckResult) -> str:
    """One row per rule: rule, status, severity, offender, value, limit, message."""
    import csv
    import io

    from hookcli.render.columns import csv_columns

    cols = csv_columns(checks.check_columns())
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[c.key for c in cols], lineterminator="\n")
    writer.writeheader()
    for rule in result.rules:
        writer.writerow({c.key: "" if c.raw(rule) is None else csv_cell(c.raw(rule)) for c in cols})
    return buf.getvalue()


def diff_markdown(report: DiffReport) -> str:
    """A heading with the verdict, the runs, the rows as a pipe table, then counts and divergences."""
    mark = "PASSED" if report.ok else "FAILED"
    blocks: list[list[str]] = [[f"### hookcli diff: {md_inline(report.model.spec)}: {mark}"]]
    blocks += [[md_inline(summary.SEP.join(line))] for line in diff.header_lines(report)]
    if report.notes:
        blocks.append([f"- {md_inline(n)}" for n in diff.notes(report)])
    blocks.append(md_table(diff.diff_columns(report), report.rows))
    blocks += [[md_inline(summary.SEP.join(line))] for line in diff.footer_lines(report)]
    blocks.append([f"**{md_inline(diff.verdict(report))}**"])
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"


def watch_markdown(run: WatchRun) -> str:
    """``watch MODEL``: a heading, what was watched and where the log went, the findings, the verdict."""
    blocks = [["### watch"], [md_inline(watch.summary_line(run))]]
    if run.notes:
        blocks.append([f"- {md_inline(n)}" for n in run.notes])
    if run.findings:
        blocks.append(md_table(watch.finding_columns(), run.findings))
    blocks.append([f"**{md_inline(watch.verdict(run))}**"])
    return "\n\n".join("\n".join(b) for b in blocks) + "\n"
