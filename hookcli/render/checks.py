"""Rendering a CheckResult (``hookcli check``): one column spec for table, Markdown and CSV.

Never imports torch. The table lists each rule with PASS (green) / FAIL (red) / WARN (yellow) /
SKIP (dim), where the worst offender is, its value and the limit; below it a verdict and, for every
rule that did not pass, its full message and offenders.
"""

from __future__ import annotations

import json
from typing import Any

from hookcli.records import CheckResult, RuleResult
from hookcli.render import summary
from hookcli.render.columns import Cell, Column
from hookcli.render.formats import format_number, format_shape, plain

STATUS_STYLES = {"PASS": "green", "FAIL": "bold red", "WARN": "yellow", "SKIP": "dim"}
#: How many offenders the details list shows per rule (JSON has them all).
MAX_DETAILS = 5


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def format_value(value: Any) -> str:
    """A rule value or limit for display: numbers (4 digits), shapes, ``[min, max]`` ranges."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if _is_int(value):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    if isinstance(value, float):
        return format_number(value)
    if isinstance(value, list):
        if all(_is_int(v) for v in value):
            return format_shape(value)
        if all(isinstance(v, list) for v in value):
            return "; ".join(format_value(v) for v in value)
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {format_value(v)}" for k, v in value.items())
    return plain(value)


def csv_value(value: Any) -> Any:
    """Raw CSV value: numbers as they are, shapes ``1x1000``, other structures as JSON."""
    if value is None:
        return ""
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return "x".join(str(v) for v in value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value


def _cell(text: str, style: str | None = None) -> Cell:
    return Cell(text, style)


def check_columns() -> list[Column[RuleResult]]:
    """Rule, Status, Severity, Where, Value, Limit, Message."""
    return [
        Column("rule", "Rule", lambda r: _cell(r.rule), lambda r: r.rule, no_wrap=True),
        Column("status", "Status", lambda r: _cell(r.status, STATUS_STYLES.get(r.status)), lambda r: r.status),
        Column("severity", "Severity", lambda r: _cell(r.severity), lambda r: r.severity),
        Column("offender", "Where", lambda r: _cell(r.offender or "-"), lambda r: r.offender or "",
               no_wrap=True),
        Column("value", "Value", lambda r: _cell(format_value(r.value)), lambda r: csv_value(r.value),
               justify="right"),
        Column("limit", "Limit", lambda r: _cell(format_value(r.limit)), lambda r: csv_value(r.limit),
               justify="right"),
        Column("message", "Message", lambda r: _cell(plain(r.message)), lambda r: r.message),
    ]


def _shown_path(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it (display only)."""
    import os

    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def header_lines(result: CheckResult) -> list[list[str]]:
    lines = summary.header_lines(result.report)
    if result.config:
        lines.append([f"config: {_shown_path(result.config)}"])
    return lines


def footer(result: CheckResult) -> list[str]:
    c = result.counts()
    return [f"{len(result.rules)} rules", f"{c['passed']} passed", f"{c['failed']} failed",
            f"{c['warned']} warned", f"{c['skipped']} skipped"]


def verdict(result: CheckResult) -> str:
    """``PASSED`` or ``FAILED: finite at log, ...`` (the headline in capitals)."""
    text = result.headline()
    return "PASSED" + text.removeprefix("check passed") if result.ok else "FAILED" + text.removeprefix("check failed")


def details(result: CheckResult) -> list[str]:
    """For every FAIL/WARN rule: its message, then up to MAX_DETAILS offenders."""
    lines: list[str] = []
    for r in result.rules:
        if r.status not in ("FAIL", "WARN"):
            continue
        lines.append(f"{r.status} {r.rule}: {plain(r.message)}")
        shown = r.violations[:MAX_DETAILS] if len(r.violations) > 1 else []
        lines += [f"  - {plain(v.get('message') or v.get('where'))}" for v in shown]
        if len(r.violations) > MAX_DETAILS:
            lines.append(f"  - ... {len(r.violations) - MAX_DETAILS} more (--format json lists all)")
    return lines


def notes(result: CheckResult) -> list[str]:
    return summary.notes(result.report) + [plain(n) for n in result.notes]


__all__ = ["check_columns", "csv_value", "details", "footer", "format_value", "header_lines", "notes", "verdict"]
