"""Header, footer and failure lines shared by the table and markdown renderers."""

from __future__ import annotations

from typing import Any

from hookcli.records import (
    FailureInfo,
    FeatureExport,
    FeatureMaps,
    InputInfo,
    ModelInfo,
    ModelList,
    ModuleTree,
    Report,
)
from hookcli.render import exports
from hookcli.render.columns import report_kind
from hookcli.escape import escape_control
from hookcli.render.formats import (
    Renderable,
    format_count,
    format_mb,
    format_number,
    format_shape,
    input_bytes,
    output_bytes,
    plain,
)

SEP = " · "


def partial_mark(report: Renderable) -> str:
    """`` (PARTIAL: ...)`` for a report of a failed run (rows gathered before the failure), else ""."""
    if not isinstance(report, Report) or report.failure is None:
        return ""
    if report.failure.phase == "data":
        return " (PARTIAL: bad data; rows of the batches before it)"
    return f" (PARTIAL: the model raised in {report.failure.phase}; rows up to the failure)"


def title(report: Renderable) -> str:
    """The table title: the command name (and PARTIAL for a failed run)."""
    return report.command + partial_mark(report)


def heading(report: Renderable) -> str:
    """``<command>: <spec>`` (markdown heading; and PARTIAL for a failed run)."""
    if isinstance(report, ModelList):
        return f"{report.command}: {report.pattern}" if report.pattern else report.command
    return f"{report.command}: {report.model.spec}{partial_mark(report)}"


def _model_parts(model: ModelInfo) -> list[str]:
    parts = [model.spec, model.class_name, f"from {model.source}"]
    if model.model_args:
        parts.append("args: " + ", ".join(f"{k}={v!r}" for k, v in model.model_args.items()))
    if model.weights:
        parts.append(f"weights: {model.weights}")
    return parts


def _input_part(info: InputInfo) -> str:
    return f"input {info.name}: {format_shape(info.shape)} {info.dtype} {info.source}".rstrip()


def format_loss(loss: dict[str, Any]) -> str:
    """``loss: 6.9 (cross_entropy, target=0)``."""
    extra = [str(loss["kind"])] if loss.get("kind") is not None else []
    extra += [f"{k}={v}" for k, v in loss.items()
              if k not in ("kind", "value") and v is not None and v != ""]
    text = f"loss: {format_number(loss.get('value'))}"
    return f"{text} ({', '.join(extra)})" if extra else text


#: A line of text as its parts; renderers join them with :data:`SEP` (and may break between them).
Line = list[str]


def run_line(model: ModelInfo, inputs: list[InputInfo], device: str, mode: str) -> Line:
    """The parts of the line describing a run: model, inputs, device, mode."""
    parts = _model_parts(model) + [_input_part(i) for i in inputs]
    return [p for p in [*parts, device, mode] if p]


def header_lines(report: Renderable) -> list[Line]:
    """The line describing the run (model, inputs, device, mode), then the loss if any."""
    if isinstance(report, ModelList):
        return [[f"pattern: {report.pattern}"]] if report.pattern else []
    if isinstance(report, ModuleTree):
        return [_model_parts(report.model)]
    lines = [run_line(report.model, report.inputs, report.device, report.mode)]
    if isinstance(report, (FeatureExport, FeatureMaps)):
        return lines
    if report.loss is not None:
        lines.append([format_loss(report.loss)])
    return lines


def notes(report: Renderable) -> list[str]:
    """The report's notes (printed dim under the header)."""
    return [plain(n) for n in report.notes] if isinstance(report, (Report, FeatureExport, FeatureMaps)) else []


def pack(parts: Line, width: int) -> list[str]:
    """``parts`` joined by :data:`SEP`, broken between parts into lines of at most ``width``.

    Continuation lines are indented by two spaces; a part longer than a line is left whole.
    """
    lines: list[str] = []
    current = ""
    for part in map(escape_control, parts):  # escaped first: the width is the width shown
        candidate = f"{current}{SEP}{part}" if current else part
        if current and len(candidate) > width:
            lines.append(current)
            current = "  " + part
        else:
            current = candidate
    if current:
        lines.append(current)
    return lines


def _shapes_footer(report: Report) -> Line:
    model = report.model
    return [
        f"Total params: {format_count(model.params)}",
        f"Trainable: {format_count(model.trainable_params)}",
        f"Params size: {format_mb(model.param_bytes)}",
        f"Buffers: {format_mb(model.buffer_bytes)}",
        f"Input size: {format_mb(input_bytes(report.inputs))}",
        f"Output size (selected layers): {format_mb(output_bytes(report.layers))}",
    ] + _flops_footer(report)


def _flops_footer(report: Report) -> Line:
    flops = report.flops
    if not flops:
        return []
    parts = [f"Forward FLOPs: {format_count(flops.get('forward'))}"]
    if flops.get("backward") is not None:
        parts.append(f"Backward FLOPs: {format_count(flops['backward'])}")
    if flops.get("partial"):
        parts.append("partial: no formula for " + ", ".join(flops.get("missing_ops", [])))
    return parts


def _count_rows(report: Report) -> dict[str, int]:
    kind = report_kind(report)
    counts = {"rows": len(report.layers), "not_called": 0, "containers": 0, "nonfinite": 0, "zero": 0,
              "no_grad": 0}
    for rec in report.layers:
        if not rec.called:
            counts["containers" if rec.container else "not_called"] += 1
            continue
        data = rec.grad if kind == "grads" else rec.stats
        if data and ((data.get("nan_count") or 0) > 0 or (data.get("inf_count") or 0) > 0):
            counts["nonfinite"] += 1
        if kind == "stats" and rec.stats and rec.stats.get("zero_fraction") == 1.0:
            counts["zero"] += 1
        if kind == "grads" and rec.grad is None and not rec.raised:
            counts["no_grad"] += 1
    return counts


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def footer_lines(report: Renderable) -> list[Line]:
    """Totals under the table (the table caption / the lines after the markdown table)."""
    if isinstance(report, ModelList):
        return [[_plural(len(report.models), "model")]]
    if isinstance(report, ModuleTree):
        return [[f"Total params: {format_count(report.model.params)}",
                 f"Trainable: {format_count(report.model.trainable_params)}",
                 _plural(len(report.modules), "module")]]
    if isinstance(report, (FeatureExport, FeatureMaps)):
        return exports.footer_lines(report)
    kind = report_kind(report)
    if kind == "shapes":
        return [_shapes_footer(report)]
    c = _count_rows(report)
    parts = [_plural(c["rows"], "row"), f"{c['nonfinite']} with NaN/Inf"]
    if kind == "stats":
        parts.append(f"{c['zero']} all zero")
    else:
        parts.append(f"{c['no_grad']} without grad")
    parts.append(f"{c['not_called']} not called")
    if c["containers"]:
        parts.append(_plural(c["containers"], "container"))
    return [parts] + ([_flops_footer(report)] if report.flops else [])


def failure_line(failure: FailureInfo | None) -> str | None:
    """The failure's one sentence (``FailureInfo.sentence``), on one line."""
    if failure is None:
        return None
    return plain(failure.sentence())
