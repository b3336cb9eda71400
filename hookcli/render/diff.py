"""Rendering a DiffReport (``hookcli diff``): one column spec for table, Markdown and CSV.

Never imports torch. One row per output tensor: both shapes and dtypes, max |a-b|, relative L2 error,
cosine similarity, SQNR and the status; a header naming both runs, a footer with the counts, the
tolerances, the first divergence and the verdict on the model's final outputs.
"""

from __future__ import annotations

import math

from hookcli.records import DiffReport, DiffRow, Errors, Tolerance
from hookcli.render import summary
from hookcli.render.columns import BOLD_RED, DIM, RED, YELLOW, Cell, Column, csv_shape, indent
from hookcli.render.formats import format_number, format_shape, plain

STATUS_WORDS = {"ok": "ok", "diverged": "DIVERGED", "shape": "SHAPE", "only_a": "only in A",
                "only_b": "only in B", "not_called": "not called", "no_tensor": "no tensor", "missing": "MISSING"}
STATUS_STYLES = {"diverged": BOLD_RED, "shape": BOLD_RED, "only_a": RED, "only_b": RED, "missing": RED,
                 "not_called": DIM, "no_tensor": DIM}


def _shape(row: DiffRow) -> str:
    if row.a_shape == row.b_shape or row.status in ("only_a", "only_b"):
        return format_shape(row.a_shape if row.status != "only_b" else row.b_shape)
    return f"{format_shape(row.a_shape)} -> {format_shape(row.b_shape)}"


def _type(row: DiffRow) -> str:
    return row.type if row.b_type in (None, row.type) else f"{row.type} -> {row.b_type}"


def _dtype(row: DiffRow) -> str:
    if row.a_dtype == row.b_dtype or row.a_dtype is None or row.b_dtype is None:
        return row.a_dtype or row.b_dtype or "-"
    return f"{row.a_dtype} -> {row.b_dtype}"


def format_db(value: float | None) -> str:
    """SQNR in dB with one decimal; ``inf`` for identical tensors."""
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return format_number(value)
    return f"{value:.1f}"


def _err(attr: str, fmt=format_number, grad: bool = False):  # noqa: ANN001, ANN202 - small getters
    def display(row: DiffRow) -> Cell:
        errors: Errors | None = row.grad if grad else row.errors
        return Cell(fmt(getattr(errors, attr)) if errors else "-")

    def raw(row: DiffRow) -> float | None:
        errors = row.grad if grad else row.errors
        return getattr(errors, attr) if errors else None

    return display, raw


def _status_cell(status: str | None) -> Cell:
    if status is None:
        return Cell("-", DIM)
    return Cell(STATUS_WORDS.get(status, status), STATUS_STYLES.get(status))


def diff_columns(report: DiffReport) -> list[Column[DiffRow]]:
    """Layer, Type, Shape, Dtype, Max abs, Rel L2, Cosine, SQNR dB, Status (+ gradient columns)."""
    cols: list[Column[DiffRow]] = [
        Column("name", "Layer", lambda r: Cell(indent(r.label, r.depth)), lambda r: r.name,
               no_wrap=True, squeeze=2, min_width=16),
        Column("call", "", lambda r: Cell(str(r.call)), lambda r: r.call, table=False),
        Column("output", "", lambda r: Cell(r.output), lambda r: r.output, table=False),
        Column("final", "", lambda r: Cell(str(r.final)), lambda r: r.final, table=False),
        Column("type", "Type", lambda r: Cell(_type(r)), lambda r: r.type, squeeze=1, min_width=8),
        Column("b_type", "", lambda r: Cell(""), lambda r: r.b_type, table=False),
        Column("shape", "Shape", lambda r: Cell(_shape(r)), lambda r: None, no_wrap=True, csv=False),
        Column("a_shape", "", lambda r: Cell(""), lambda r: csv_shape(r.a_shape), table=False),
        Column("b_shape", "", lambda r: Cell(""), lambda r: csv_shape(r.b_shape), table=False),
        Column("dtype", "Dtype", lambda r: Cell(_dtype(r)), lambda r: None, csv=False),
        Column("a_dtype", "", lambda r: Cell(""), lambda r: r.a_dtype, table=False),
        Column("b_dtype", "", lambda r: Cell(""), lambda r: r.b_dtype, table=False),
    ]
    for key, header, fmt in (("max_abs", "Max abs", format_number), ("rel_l2", "Rel L2", format_number),
                             ("cosine", "Cosine", _format_cosine), ("sqnr_db", "SQNR dB", format_db)):
        display, raw = _err(key, fmt)
        cols.append(Column(key, header, display, raw, justify="right"))
    cols.append(Column("status", "Status", lambda r: _status_cell(r.status), lambda r: r.status))
    if report.grads:
        for key, header, fmt in (("max_abs", "Grad max abs", format_number), ("rel_l2", "Grad rel L2", format_number),
                                 ("cosine", "Grad cosine", _format_cosine)):
            display, raw = _err(key, fmt, grad=True)
            cols.append(Column(f"grad_{key}", header, display, raw, justify="right"))
        display, raw = _err("sqnr_db", format_db, grad=True)
        cols.append(Column("grad_sqnr_db", "", display, raw, table=False))
        cols.append(Column("grad_status", "Grad status", lambda r: _status_cell(r.grad_status),
                           lambda r: r.grad_status))
    return cols


def _format_cosine(value: float | None) -> str:
    """Cosine similarity with six decimals (1.000000 is identical; 4 digits would hide the drift)."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.6f}"


def row_style(row: DiffRow) -> str | None:
    """The first divergence and every diverged row stand out; rows of no comparison are dim."""
    if row.status in ("diverged", "shape", "only_a", "only_b"):
        return YELLOW if not row.final else RED
    return DIM if row.status in ("not_called", "no_tensor") else None


def header_lines(report: DiffReport) -> list[list[str]]:
    """Run A (model, inputs, device, mode) and run B (its changes and model)."""
    lines = [summary.run_line(report.model, report.inputs, report.device, report.mode)]
    changes = ", ".join(report.changes) if report.changes else "no change"
    b_parts = [f"vs: {changes}"]
    if report.vs_model.spec != report.model.spec or report.vs_model.class_name != report.model.class_name:
        b_parts.append(f"{report.vs_model.spec} ({report.vs_model.class_name})")
    b_parts.append(report.vs_device)
    lines.append(b_parts)
    if report.loss is not None:
        extra = [str(report.loss.get("kind"))] + ([f"target={report.loss['target']}"]
                                                  if report.loss.get("target") is not None else [])
        lines.append([f"loss A: {format_number(report.loss.get('a'))}",
                      f"loss B: {format_number(report.loss.get('b'))} ({', '.join(extra)})"])
    return lines


def tolerance_text(t: Tolerance) -> str:
    """``rtol 1e-05, atol 1e-05`` or ``rel L2 <= 0.05, cosine distance <= 0.001``: the limits that are set."""
    parts = []
    if t.rtol is not None:
        parts.append(f"rtol {format_number(t.rtol)}, atol {format_number(t.atol)}")
    if t.rel_l2 is not None:
        parts.append(f"rel L2 <= {format_number(t.rel_l2)}")
    if t.cosine_distance is not None:
        parts.append(f"cosine distance <= {format_number(t.cosine_distance)}")
    return ", ".join(parts)


def tolerance_line(report: DiffReport) -> list[str]:
    """``tolerance float32 vs bfloat16: rel L2 <= 0.05, cosine distance <= 0.001 (default)``, one part per
    dtype pair."""
    if not report.tolerances:
        return ["tolerance: nothing compared"]
    return [f"tolerance {t.a_dtype} vs {t.b_dtype}: {tolerance_text(t)} ({t.source})" for t in report.tolerances]


def footer_lines(report: DiffReport) -> list[list[str]]:
    """Counts per status, the tolerances, and the first divergence (of outputs, and of gradients)."""
    counts = report.counts()
    parts = [f"{len(report.rows)} rows", f"{counts['ok']} within tolerance", f"{counts['diverged']} beyond",
             f"{counts['shape']} shape mismatch", f"{counts['only_a']} only in A", f"{counts['only_b']} only in B"]
    if counts["not_called"]:
        parts.append(f"{counts['not_called']} not called")
    lines = [parts, tolerance_line(report)]
    first = report.first_divergence
    lines.append([f"first divergence: {first.label} ({_type(first)}, {STATUS_WORDS[first.status]})",
                  *_errors_parts(first.errors)] if first else ["first divergence: none"])
    if report.grads:
        g = report.first_grad_divergence
        lines.append([f"first gradient divergence (in backward order): {g.label} "
                      f"({STATUS_WORDS[g.grad_status or '']})", *_errors_parts(g.grad)]
                     if g else ["first gradient divergence: none"])
    return lines


def _errors_parts(errors: Errors | None) -> list[str]:
    if errors is None:
        return []
    return [f"max abs {format_number(errors.max_abs)}", f"rel L2 {format_number(errors.rel_l2)}",
            f"cosine {_format_cosine(errors.cosine)}", f"SQNR {format_db(errors.sqnr_db)} dB"]


def verdict(report: DiffReport) -> str:
    """``PASSED: the final outputs agree within tolerance`` or ``FAILED: ...``."""
    if report.ok:
        return "PASSED: the model's final outputs agree within tolerance"
    return "FAILED: the model's final outputs differ beyond tolerance"


def notes(report: DiffReport) -> list[str]:
    return [plain(n) for n in report.notes]


__all__ = ["diff_columns", "footer_lines", "header_lines", "notes", "row_style", "tolerance_line", "verdict"]
