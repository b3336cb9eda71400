"""Plain data that hookcli computes and renderers read.

Records hold only Python values (ints, floats, strings, tuples/lists of ints, dicts of floats),
never tensors, so renderers never need torch. ``Report.to_dict()`` *is* the JSON format (schema 1,
documented in the README); keys may be added, none renamed or removed without bumping ``SCHEMA``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hookcli.records import statistics

SCHEMA = 1

Shape = list[int]
#: Activation statistics of one tensor: mean, std, min, max, norm, zero_fraction, nan_count, inf_count.
Stats = dict[str, float | int | None]
#: Gradient statistics of one tensor: mean, std, min, max, norm, nan_count, inf_count (+ abs_max for params).
GradStats = dict[str, float | int | None]

#: The built-in statistics' keys, from ``records.statistics`` (the table: statistics added there at run time
#: are in the dicts and tables too; these names are what hookcli itself declares).
STAT_KEYS: tuple[str, ...] = statistics.keys(statistics.ACTIVATION, extra=False)
#: Activation statistics beyond the table's columns: in JSON and the Python API only (docs/json-format.md).
STAT_EXTRA_KEYS: tuple[str, ...] = statistics.keys(statistics.ACTIVATION)[len(STAT_KEYS):]
GRAD_KEYS: tuple[str, ...] = statistics.keys(statistics.GRADIENT)


def envelope(version: str, command: str, model: ModelInfo, inputs: list[InputInfo], device: str,
             mode: str, partial: bool = False) -> dict[str, Any]:
    """The keys every JSON report of a model run starts with (schema 1).

    ``partial`` is true when the run failed and the report holds only what was gathered before.
    """
    return {
        "schema": SCHEMA,
        "hookcli": version,
        "command": command,
        "model": model.to_dict(),
        "inputs": [i.to_dict() for i in inputs],
        "device": device,
        "mode": mode,
        "partial": partial,
    }


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
    #: the keyword arguments the model was built with (``--model-arg``, a config's ``model_args``)
    model_args: dict[str, Any] = field(default_factory=dict)

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
            "model_args": {str(k): plain_value(v) for k, v in self.model_args.items()},
        }


def plain_value(value: Any) -> Any:
    """``value`` as JSON holds it: numbers, strings, booleans, None, lists and string-keyed dicts kept,
    tuples and sets as lists, anything else (bytes, complex, objects) as its ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain_value(v) for v in value]
    return repr(value)


def sanitize(value: Any) -> Any:
    """A copy of ``value`` with non-finite floats replaced by ``"nan"``/``"inf"``/``"-inf"``: how every
    hookcli JSON writes them (strict JSON has no NaN; the strings keep what a NaN check needs)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    return value


@dataclass
class InputInfo:
    """One model input: positional ("0", "1", ...) or keyword (its name)."""

    name: str
    shape: Shape | None
    dtype: str
    source: str  # "randn(seed=0)", "image: cat.png", "file: x.pt", ...

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": self.shape, "dtype": self.dtype, "source": self.source}



def call_label(name: str, call: int, calls: int, output: str = "") -> str:
    """How a row names one output of one call: ``name``, ``name#call`` for a module called more than
    once, plus the output path (``layer1.0.relu#1``, ``split[0]``); ``(model)`` for the root."""
    base = name or "(model)"
    if calls > 1:
        base = f"{base}#{call}"
    return base + output

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
    #: a module without a forward of its own (ModuleList, ModuleDict): never called by design
    container: bool = False
    #: under tensor parallelism, merged over the ranks (docs/distributed.md): "sharded" (the TP ranks'
    #: parts, summed) or "replicated" (their copies, counted once); None otherwise
    placement: str | None = None

    @property
    def label(self) -> str:
        """Display name: ``name``, ``name#call`` for reused modules, plus the output path."""
        return call_label(self.name, self.call, self.calls, self.output)

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
        if self.container:
            data["container"] = True
        if self.stats is not None:
            data["stats"] = self.stats
        if self.grad is not None or self.grad_input is not None:
            data["grad"] = self.grad
        if self.grad_input is not None:
            data["grad_input"] = self.grad_input
        if self.flops is not None:
            data["flops"] = self.flops
        if self.placement is not None:
            data["placement"] = self.placement
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
    #: For a trainable parameter the loss gave no gradient: the other model outputs (paths) that
    #: still depend on it, e.g. ``['pooler_output']``; ``[]`` when none does (cut off). None otherwise.
    other_outputs: list[str] | None = None
    #: True for a trainable parameter without a gradient that the forward never read (``check`` only:
    #: unused in this mode, not cut off); None when not known or not the case.
    unused: bool | None = None

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
        if self.other_outputs is not None:
            data["other_outputs"] = self.other_outputs
        if self.unused is not None:
            data["unused"] = self.unused
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

    def sentence(self) -> str:
        """The one sentence every output says a failed run with: where the model raised (or exited)
        and why, e.g. ``the model raised in forward at fc (Linear) with input shape(s) 2x6: ...``."""
        where = f" at {self.module or '(model)'} ({self.module_type})" if self.module_type else ""
        shapes = ", ".join("x".join(map(str, s)) if s is not None else "?" for s in self.input_shapes)
        with_inputs = f" with input shape(s) {shapes}" if self.input_shapes else ""
        if self.phase == "data":  # a bad batch of --data (message: "batch N: ..."), not the model
            return f"bad data: {self.message}"
        if self.exception == "SystemExit":  # message: "exited with code N"
            return f"the model {self.message} in {self.phase}{where}{with_inputs} (it called sys.exit)"
        return f"the model raised in {self.phase}{where}{with_inputs}: {self.exception}: {self.message}"

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
    #: the reduction backend that computed the statistics (``engine.reduction``: kernel, torch, device)
    reduction: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def partial(self) -> bool:
        """The model raised: the report holds only the rows gathered before the failure."""
        return self.failure is not None

    def to_dict(self) -> dict[str, Any]:
        data = envelope(self.version, self.command, self.model, self.inputs, self.device, self.mode,
                        self.partial)
        if self.reduction is not None:
            data["reduction"] = self.reduction
        data["layers"] = [r.to_dict() for r in self.layers]
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
            "partial": False,
        }


@dataclass
class ModelList:
    """torchvision model names (``hookcli models``)."""

    pattern: str | None
    models: list[dict[str, str]]  # {"name": ..., "family": ...}
    version: str = ""
    command: str = "models"
    source: str = "torchvision"  # "torchvision" | "timm" | "hf"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "hookcli": self.version,
            "command": self.command,
            "pattern": self.pattern,
            "source": self.source,
            "models": self.models,
            "partial": False,
        }


# --------------------------------------------------------------------------- kept activations
#
# ``hookcli features`` and ``hookcli fmaps`` are the two commands that keep activations. Their results
# are plain data like every record, with one exception for Python callers: ``tensors`` / ``image``
# hold the kept CPU tensors. Neither is part of ``to_dict()``, and renderers never read them.
