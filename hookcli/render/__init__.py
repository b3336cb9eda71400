"""Renderers: Report / ModuleTree / ModelList -> Rich table, JSON, CSV or Markdown text.

Never imports torch. ``render(report, fmt)`` is the one entry point; ``RENDERERS`` maps every
:class:`OutputFormat` to its renderer object.
"""

from __future__ import annotations

from hookcli.render.formats import (
    OutputFormat,
    Renderable,
    Renderer,
    format_count,
    format_for_path,
    format_mb,
    format_number,
    format_shape,
)
from hookcli.render.jsonfmt import JsonRenderer
from hookcli.render.table import TableRenderer
from hookcli.render.text import CsvRenderer, MarkdownRenderer

RENDERERS: dict[OutputFormat, Renderer] = {
    OutputFormat.TABLE: TableRenderer(),
    OutputFormat.JSON: JsonRenderer(),
    OutputFormat.CSV: CsvRenderer(),
    OutputFormat.MARKDOWN: MarkdownRenderer(),
}


def render(
    report: Renderable,
    fmt: OutputFormat | str = OutputFormat.TABLE,
    *,
    width: int | None = None,
    color: bool = False,
) -> str:
    """Render ``report`` in format ``fmt`` (an OutputFormat or its name; OutputError if unknown)."""
    return RENDERERS[OutputFormat.parse(fmt)].render(report, width=width, color=color)


__all__ = [
    "RENDERERS",
    "CsvRenderer",
    "JsonRenderer",
    "MarkdownRenderer",
    "OutputFormat",
    "Renderable",
    "Renderer",
    "TableRenderer",
    "format_count",
    "format_for_path",
    "format_mb",
    "format_number",
    "format_shape",
    "render",
]
