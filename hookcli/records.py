"""Plain data that hookcli computes and renderers read.

Records hold only Python values (ints, floats, strings, tuples/lists of ints, dicts of floats),
never tensors, so renderers never need torch. ``Report.to_dict()`` *is* the JSON format (schema 1,
documented in the README); keys may be added, none renamed or removed without bumping ``SCHEMA``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEMA = 1

Shape = list[int]
#: Activation statistics of one tensor: mean, std, min, max, norm, zero_fraction, nan_count, inf_count.
Stats = dict[str, float | int | None]
#: Gradient statistics of one tensor: mean, std, min, max, norm, nan_count, inf_count (+ abs_max for params).
GradStats = dict[str, float | int | None]

STAT_KEYS: tuple[str, ...] = (
    "mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count",
)
GRAD_KEYS: tuple[str, ...] = ("mean", "std", "min", "max", "norm", "nan_count", "inf_count")


@dataclass
class ModelInfo:
    """Where the model came from and how big it is."""

    spec: str
    source: str  # "argument", "config", "pyproject", "default", "python"
    class_name: str
    params: int = 0
    trainable_params: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    weights: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "source": self.source,
            "class": self.class_name,
            "params": self.params,
            "trainable_params": self.trainable_params,
            "param_bytes": self.param_bytes,
            "buffer_bytes": self.buffer_bytes,
            "weights": self.weights,
        }


@dataclass
class InputInfo:
    """One model input: positional ("0", "1", ...) or keyword (its name)."""

    name: str
    shape: Shape | None
    dtype: str
    source: str  # "randn(seed=0)", "image: cat.png", "file: x.pt", ...

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": self.shape, "dtype": self.dtype, "source": self.source}


@dataclass
class LayerRecord:
    """One tensor of one call of one selected module (or one 'not called' row)."""

    name: str
    call: int
    type: str
    output: str = ""  # path of the tensor inside the module's output: "", "[0]", "['out']", ".logits"
    called: bool = True
    depth: int = 1
    calls: int = 1  # how many times the module was called in the run
    input_shapes: list[Shape | None] = field(default_factory=list)
    shape: Shape | None = None
    dtype: str | None = None
    params: int = 0
    stats: Stats | None = None
    grad: GradStats | None = None
    grad_input: list[GradStats | None] | None = None
    raised: bool = False  # the module's forward raised (this is the failing call or one of its parents)
    flops: int | None = None

    @property
    def label(self) -> str:
        """Display name: ``name``, ``name#call`` for reused modules, plus the output path."""
        base = self.name or "(model)"
        if self.calls > 1:
            base = f"{base}#{self.call}"
        return base + self.output

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "call": self.call,
            "type": self.type,
            "output": self.output,
            "called": self.called,
            "depth": self.depth,
            "input_shapes": self.input_shapes,
            "shape": self.shape,
            "dtype": self.dtype,
            "params": self.params,
        }
        if self.raised:
            data["raised"] = True
        if self.stats is not None:
            data["stats"] = self.stats
        if self.grad is not None or self.grad_input is not None:
            data["grad"] = self.grad
        if self.grad_input is not None:
            data["grad_input"] = self.grad_input
        if self.flops is not None:
            data["flops"] = self.flops
        return data


@dataclass
class ParamRecord:
    """One parameter tensor: its gradient statistics after backward."""

    name: str
    shape: Shape
    requires_grad: bool
    norm: float | None
    grad: GradStats | None = None
    clipped: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "shape": self.shape,
            "requires_grad": self.requires_grad,
            "norm": self.norm,
            "grad": self.grad,
        }
        if self.clipped is not None:
            data["clipped"] = self.clipped
        return data


@dataclass
class FailureInfo:
    """What went wrong when the model raised: the innermost module and its input shapes."""

    phase: str  # "forward" or "backward"
    module: str | None
    module_type: str | None
    input_shapes: list[Shape | None]
    exception: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "module": self.module,
            "module_type": self.module_type,
            "input_shapes": self.input_shapes,
            "exception": self.exception,
            "message": self.message,
        }


@dataclass
class Report:
    """The result of one inspection run (shapes, stats, grads, ...)."""

    command: str
    model: ModelInfo
    inputs: list[InputInfo] = field(default_factory=list)
    device: str = "cpu"
    mode: str = "eval"
    layers: list[LayerRecord] = field(default_factory=list)
    params: list[ParamRecord] | None = None
    loss: dict[str, Any] | None = None
    failure: FailureInfo | None = None
    notes: list[str] = field(default_factory=list)
    version: str = ""
    #: {"forward": int, "backward": int | None, "partial": bool, "missing_ops": [...]} with --flops
    flops: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "hookcli": self.version,
            "command": self.command,
            "model": self.model.to_dict(),
            "inputs": [i.to_dict() for i in self.inputs],
            "device": self.device,
            "mode": self.mode,
            "layers": [r.to_dict() for r in self.layers],
        }
        if self.params is not None:
            data["params"] = [p.to_dict() for p in self.params]
        if self.loss is not None:
            data["loss"] = self.loss
        if self.flops is not None:
            data["flops"] = self.flops
        data["notes"] = list(self.notes)
        data["failure"] = self.failure.to_dict() if self.failure else None
        return data


@dataclass
class ModuleRow:
    """One module of the model tree (``hookcli modules``)."""

    name: str
    type: str
    depth: int
    params: int  # parameters in this module's subtree, each tensor counted once
    own_params: int  # parameters registered directly on this module
    children: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "depth": self.depth,
            "params": self.params,
            "own_params": self.own_params,
            "children": self.children,
        }


@dataclass
class ModuleTree:
    """The module tree of a model (``hookcli modules``)."""

    model: ModelInfo
    modules: list[ModuleRow]
    version: str = ""
    command: str = "modules"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "hookcli": self.version,
            "command": self.command,
            "model": self.model.to_dict(),
            "modules": [m.to_dict() for m in self.modules],
        }


@dataclass
class ModelList:
    """torchvision model names (``hookcli models``)."""

    pattern: str | None
    models: list[dict[str, str]]  # {"name": ..., "family": ...}
    version: str = ""
    command: str = "models"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "hookcli": self.version,
            "command": self.command,
            "pattern": self.pattern,
            "models": self.models,
        }


# --------------------------------------------------------------------------- kept activations
#
# ``hookcli features`` and ``hookcli fmaps`` are the two commands that keep activations. Their results
# are plain data like every record, with one exception for Python callers: ``tensors`` / ``image``
# hold the kept CPU tensors. Neither is part of ``to_dict()``, and renderers never read them.


@dataclass
class SavedTensor:
    """One saved output tensor of one call of one selected module (``hookcli features``)."""

    label: str  # the entry's name in the file: LayerRecord.label (``layer1.0.relu#1``, ``split[0]``)
    name: str
    call: int
    output: str
    type: str
    shape: Shape
    dtype: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "name": self.name,
            "call": self.call,
            "output": self.output,
            "type": self.type,
            "shape": self.shape,
            "dtype": self.dtype,
            "bytes": self.nbytes,
        }


@dataclass
class FeatureExport:
    """What ``hookcli features`` saved: one entry per call and output tensor of the selected modules."""

    model: ModelInfo
    inputs: list[InputInfo] = field(default_factory=list)
    device: str = "cpu"
    mode: str = "eval"
    entries: list[SavedTensor] = field(default_factory=list)
    not_called: list[str] = field(default_factory=list)  # selected modules that never ran
    path: str | None = None  # the file written; None when only returned (Python API)
    format: str | None = None  # "safetensors" | "torch" | "numpy"
    file_bytes: int | None = None
    batches: int = 1
    batch_size: int | None = None  # images per batch when a folder ran in batches
    notes: list[str] = field(default_factory=list)
    version: str = ""
    command: str = "features"
    #: label -> CPU tensor, for Python callers (not serialised, never rendered).
    tensors: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "hookcli": self.version,
            "command": self.command,
            "model": self.model.to_dict(),
            "inputs": [i.to_dict() for i in self.inputs],
            "device": self.device,
            "mode": self.mode,
            "file": {"path": self.path, "format": self.format, "bytes": self.file_bytes},
            "batches": self.batches,
            "batch_size": self.batch_size,
            "tensors": [t.to_dict() for t in self.entries],
            "not_called": list(self.not_called),
            "notes": list(self.notes),
        }


@dataclass
class ChannelRecord:
    """One channel of a captured feature map (one feature of a vector output), for one sample."""

    index: int
    min: float | None
    max: float | None
    mean: float | None
    status: str = "ok"  # "ok" | "dead" (all zero) | "constant" | "nonfinite" (NaN/Inf)
    shown: bool = False  # drawn in the image

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "min": self.min, "max": self.max, "mean": self.mean,
                "status": self.status, "shown": self.shown}


@dataclass
class FeatureMaps:
    """What ``hookcli fmaps`` drew: one module output's channels as a grid (or a bar strip)."""

    model: ModelInfo
    layer: str
    type: str
    inputs: list[InputInfo] = field(default_factory=list)
    device: str = "cpu"
    mode: str = "eval"
    call: int = 0
    calls: int = 1
    output: str = ""  # path of the tensor inside the module's output
    shape: Shape = field(default_factory=list)  # the whole output tensor (batch included)
    dtype: str = ""
    sample: int = 0
    kind: str = "grid"  # "grid": one tile per channel; "bars": one bar per feature
    channels: list[ChannelRecord] = field(default_factory=list)  # every channel of the sample
    scale: int = 1
    tile: list[int] = field(default_factory=list)  # [height, width] of one tile in pixels
    grid: list[int] = field(default_factory=list)  # [rows, columns] of tiles
    image_size: list[int] = field(default_factory=list)  # [width, height] in pixels
    path: str | None = None
    file_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    version: str = ""
    command: str = "fmaps"
    #: The grid as a uint8 (1, H, W) CPU tensor, for Python callers (not serialised, never rendered).
    image: Any = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        """``name``, ``name#call`` for a reused module, plus the output path (as LayerRecord.label)."""
        base = self.layer or "(model)"
        return (f"{base}#{self.call}" if self.calls > 1 else base) + self.output

    @property
    def shown(self) -> list[int]:
        return [c.index for c in self.channels if c.shown]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "hookcli": self.version,
            "command": self.command,
            "model": self.model.to_dict(),
            "inputs": [i.to_dict() for i in self.inputs],
            "device": self.device,
            "mode": self.mode,
            "layer": {"name": self.layer, "type": self.type, "call": self.call, "calls": self.calls,
                      "output": self.output, "label": self.label, "shape": self.shape,
                      "dtype": self.dtype},
            "sample": self.sample,
            "kind": self.kind,
            "shown": self.shown,
            "scale": self.scale,
            "tile": self.tile,
            "grid": self.grid,
            "image_size": self.image_size,
            "file": {"path": self.path, "format": "png" if self.path else None,
                     "bytes": self.file_bytes},
            "channels": [c.to_dict() for c in self.channels],
            "notes": list(self.notes),
        }


#: Rule statuses of ``hookcli check``: PASS, FAIL (an ``error`` rule is violated), WARN (a ``warn``
#: rule is violated), SKIP (the rule could not be evaluated, e.g. the model raised).
CHECK_STATUSES: tuple[str, ...] = ("PASS", "FAIL", "WARN", "SKIP")


@dataclass
class RuleResult:
    """The outcome of one check rule: the worst offender (layer or parameter) and its value.

    ``value``/``limit`` are plain JSON values (a number, a shape list, a ``[min, max]`` range or
    None); ``violations`` lists every offender as ``{"where", "value", "limit", "message"}``.
    """

    rule: str
    status: str
    severity: str  # "error" | "warn"
    message: str = ""
    offender: str | None = None
    value: Any = None
    limit: Any = None
    violations: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "status": self.status,
            "severity": self.severity,
            "offender": self.offender,
            "value": self.value,
            "limit": self.limit,
            "message": self.message,
            "violations": self.violations,
        }


@dataclass
class CheckResult:
    """The result of ``hookcli check``: one RuleResult per enabled rule plus the run's Report.

    ``ok`` is False when any rule FAILed (an ``error`` rule was violated or the model raised);
    WARN rows never fail a run. ``str(result)`` is a readable summary for ``assert result.ok, result``.
    """

    report: Report
    rules: list[RuleResult]
    config: str | None = None
    notes: list[str] = field(default_factory=list)
    version: str = ""
    command: str = "check"
    #: The exception the model raised (for ``--debug`` tracebacks); never serialised.
    cause: BaseException | None = field(default=None, repr=False, compare=False)

    @property
    def model(self) -> ModelInfo:
        return self.report.model

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[RuleResult]:
        return [r for r in self.rules if r.status == "FAIL"]

    @property
    def warnings(self) -> list[RuleResult]:
        return [r for r in self.rules if r.status == "WARN"]

    def counts(self) -> dict[str, int]:
        """``{"passed": n, "failed": n, "warned": n, "skipped": n}``."""
        by = {"PASS": "passed", "FAIL": "failed", "WARN": "warned", "SKIP": "skipped"}
        counts = dict.fromkeys(by.values(), 0)
        for r in self.rules:
            counts[by[r.status]] += 1
        return counts

    def rule(self, name: str) -> RuleResult:
        """The result of rule ``name`` (KeyError when that rule did not run)."""
        for r in self.rules:
            if r.rule == name:
                return r
        raise KeyError(name)

    def headline(self) -> str:
        """One line: ``check passed`` or ``check failed: finite at log, grad_norm at fc.weight``."""
        if self.ok:
            return "check passed" + (f" ({len(self.warnings)} warning(s))" if self.warnings else "")
        parts = [r.message if r.rule == "runs" else f"{r.rule} at {r.offender}" if r.offender else r.rule
                 for r in self.failures]
        return "check failed: " + ", ".join(parts)

    def __str__(self) -> str:
        lines = [self.headline()]
        for r in self.rules:
            if r.status in ("FAIL", "WARN"):
                lines.append(f"  {r.status} {r.rule}: {r.message}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "hookcli": self.version,
            "command": self.command,
            "ok": self.ok,
            "model": self.report.model.to_dict(),
            "config": self.config,
            "summary": self.counts(),
            "rules": [r.to_dict() for r in self.rules],
            "notes": list(self.notes),
            "report": self.report.to_dict(),
        }
