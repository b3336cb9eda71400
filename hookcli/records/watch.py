"""Plain data of ``hookcli.watch``: one logged training step (``WatchStep``), whose ``to_dict()`` *is*
one line of the JSON Lines log (docs/watch.md). Keys may be added; none renamed or removed without
bumping ``WATCH_SCHEMA``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from hookcli.records import statistics
from hookcli.records.attention import AttentionLayer, OutputLogits
from hookcli.records.core import sanitize

WATCH_SCHEMA = 1

#: The statistics of one tensor (activation or gradient) in the log, in this order (``records.statistics``'
#: built-in ``WATCH`` ones).
WATCH_STAT_KEYS: tuple[str, ...] = statistics.keys(statistics.WATCH)

WatchStats = dict[str, float | int | None]


@dataclass
class WatchLayer:
    """One output tensor of one selected module over one step: its calls in the step merged."""

    name: str
    type: str
    output: str  # path of the tensor inside the module's output: "", "[0]", "['logits']"
    calls: int  # how many calls of the module in the step are merged here
    shape: list[int] | None  # the first call's
    dtype: str
    stats: WatchStats | None
    grad: WatchStats | None  # of the gradient w.r.t. this output, over every backward of the step
    #: under tensor parallelism (docs/distributed.md): "sharded" (the TP ranks' parts, summed) or
    #: "replicated" (their copies, counted once); None otherwise (and left out of the dict)
    placement: str | None = None
    #: The output's channels (its channel dimension's size; None: no channel dimension, or not counted:
    #: a flight line, a tensor-parallel "sharded" output) and how many of them were all zeros in the
    #: step's calls (under torchrun: on every rank)
    channels: int | None = None
    dead_channels: int | None = None
    #: Each channel's zero fraction over the step's calls (for the dead_units rule; not in the log)
    channel_zero_fraction: list[float] | None = field(default=None, repr=False)
    #: The module's other names (a module reached along two paths: a tied ``lm_head``); None: it has one
    aliases: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "output": self.output, "type": self.type, "calls": self.calls,
               "shape": self.shape, "dtype": self.dtype, "stats": self.stats, "grad": self.grad}
        if self.placement is not None:
            out["placement"] = self.placement
        if self.channels is not None:
            out["dead_channels"], out["channels"] = self.dead_channels, self.channels
        if self.aliases:
            out["aliases"] = self.aliases
        return out


@dataclass
class Histogram:
    """The values of one tensor at one logged step in equal buckets from ``min`` to ``max`` (TensorBoard's
    histogram: ``limits`` are the buckets' right edges, ``counts`` how many values fell in each). The
    buckets of a constant tensor (``min == max``) span ``min - 1`` to ``max + 1``, as ``torch.histc``'s
    (``engine.stats.histogram`` counts them so); ``min`` and ``max`` stay the values' own, as TensorBoard's
    ``add_histogram`` writes them."""

    min: float
    max: float
    num: int
    sum: float
    sum_squares: float
    limits: list[float]
    counts: list[float]

    @classmethod
    def from_values(cls, values: list[float]) -> Histogram | None:
        """From ``engine.stats.histogram``'s vector on the host; None when its min or max is not finite."""
        lo, hi, num, total, squares, *counts = values
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return None
        bins = len(counts)
        left, right = (lo - 1.0, hi + 1.0) if lo == hi else (lo, hi)
        return cls(lo, hi, int(num), total, squares, [left + (right - left) * (k + 1) / bins for k in range(bins)],
                   counts)


@dataclass
class WatchParam:
    """One parameter over one step: its norm and gradient before the update, and the update's size."""

    name: str
    shape: list[int]
    norm: float
    grad: WatchStats | None  # of the accumulated .grad; None when no backward of the step reached it
    update_norm: float | None = None  # ||w_after - w_before|| of the optimizer's step; None without one
    update_ratio: float | None = None  # update_norm / norm; None without an update or when norm is 0
    #: Its dtype ("float32", "bfloat16"; None: not known): the rules read it, the log does not hold it
    dtype: str | None = field(default=None, repr=False)
    #: Its param group's learning rate over the one a torch LR scheduler started it from (the group's
    #: ``initial_lr``): below 1 in a warmup or an annealed tail (None: no scheduler); not in the log
    lr_scale: float | None = field(default=None, repr=False)
    #: Whether it required grad when the step ended (a layer frozen mid-run does not); not in the log
    requires_grad: bool = field(default=True, repr=False)
    #: With ``tensorboard_dir=``: the weights' and the gradient's histograms at the logged step, before
    #: the update (None: not asked, empty, or a value not finite); not in the log
    values_histogram: Histogram | None = field(default=None, repr=False)
    grad_histogram: Histogram | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": self.shape, "norm": self.norm, "grad": self.grad,
                "update_norm": self.update_norm, "update_ratio": self.update_ratio}


@dataclass
class Finding:
    """What one of the watch's rules found at one logged step: where (a layer's output or a parameter),
    in which direction (``forward``: an output; ``backward``: a gradient; ``update``: the optimizer's
    step; ``loss``: the loss), the value measured and the limit it crossed."""

    rule: str
    severity: str  # "error" (the run is broken: NaN/Inf) or "warning"
    step: int
    layer: str | None  # the module's name or the parameter's; None for the loss
    direction: str  # "forward" | "backward" | "update" | "loss"
    value: float | None
    limit: float | None
    message: str

    def line(self) -> str:
        """``step 2: warning frozen (2.weight): 2.weight requires grad but ...``: one line (as
        ``hookcli watch`` and ``hookcli.watch`` print it on stderr)."""
        where = f" ({' '.join(self.layer.split())})" if self.layer else ""
        return f"step {self.step}: {self.severity} {self.rule}{where}: {' '.join(self.message.split())}"

    def to_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "severity": self.severity, "step": self.step, "layer": self.layer,
                "direction": self.direction, "value": self.value, "limit": self.limit, "message": self.message}


@dataclass
class NonfiniteCause:
    """Where a step's first NaN/Inf was made (``hookcli.engine.cause``): the module whose code made it
    (its name, "" for the model; None: no module's, the batch or the loss), ``forward`` or ``backward``,
    and the words (``made by blocks.2.lin``, ``made in blocks.2's own forward (after blocks.2.act)``)."""

    layer: str | None
    direction: str
    text: str


@dataclass
class WatchStep:
    """One logged step: the loss (None when not given), the selected modules' outputs, the parameters,
    and what the rules found at this step. ``flight``: an unlogged step from the flight recorder's ring
    (``flight=K``): its outputs and loss only, no parameters. ``skipped``: an optimizer was watched but
    did not step in this step (a GradScaler skipping an overflow, a micro-batch ending at ``w.step()``)."""

    step: int
    loss: float | None = None
    layers: list[WatchLayer] = field(default_factory=list)
    params: list[WatchParam] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    flight: bool = False
    skipped: bool = False
    #: the reduction backend that computed the statistics (``engine.reduction``: kernel, torch, device)
    reduction: str | None = None
    #: where the step's first NaN/Inf was made, when the step was traced and held one (not in the log:
    #: the nonfinite finding tells it)
    cause: NonfiniteCause | None = field(default=None, repr=False)
    #: the first step whose loss was not finite, when known by this step (the watch's device flag on
    #: every step's loss); not in the log
    loss_nonfinite_at: int | None = field(default=None, repr=False)
    #: the transformer signals of a logged step (``engine.attention``): each attention module's heads, and
    #: the model's output logits (in the log only when there are any)
    attention: list[AttentionLayer] = field(default_factory=list)
    output_logits: OutputLogits | None = None

    def to_dict(self) -> dict[str, Any]:
        line = {"schema": WATCH_SCHEMA, "step": self.step, "loss": self.loss,
                "layers": [layer.to_dict() for layer in self.layers],
                "params": [param.to_dict() for param in self.params],
                "findings": [finding.to_dict() for finding in self.findings]}
        if self.flight:  # only on the flight recorder's lines: a logged step's line is as before
            line["flight"] = True
        if self.skipped:  # only where the optimizer did not step
            line["skipped"] = True
        if self.reduction is not None:
            line["reduction"] = self.reduction
        if self.attention:
            line["attention"] = [layer.to_dict() for layer in self.attention]
        if self.output_logits is not None:
            line["output_logits"] = self.output_logits.to_dict()
        return line

    def to_json_line(self) -> str:
        """``to_dict()`` as one line of JSON Lines (compact; non-finite numbers as ``sanitize`` writes
        them), ending with a newline."""
        return json.dumps(sanitize(self.to_dict()), allow_nan=False, separators=(",", ":")) + "\n"


@dataclass
class WatchRun:
    """What ``hookcli watch`` did: the model and optimizer watched, how many steps ran, where the log
    went and what the rules found. ``exit_code``: the script's (``watch -- CMD``), else None."""

    command: str  # "script" (watch -- CMD) | "model" (watch MODEL --steps N)
    model: str | None  # the watched model's class (or spec); None: nothing was watched
    optimizer: str | None
    steps: int  # optimizer steps the watch saw
    every: int
    out: str | None
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exit_code: int | None = None
    #: what the script's end printed to stderr: its uncaught exception's traceback, or sys.exit's message
    traceback: str | None = None

    @property
    def logged(self) -> int:
        """How many steps were logged: 0, every, 2 * every, ... below ``steps``."""
        return -(-self.steps // self.every)

    @property
    def errors(self) -> list[Finding]:
        """The findings of severity ``error`` (a broken run: NaN/Inf)."""
        return [f for f in self.findings if f.severity == "error"]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": WATCH_SCHEMA, "command": self.command, "model": self.model, "optimizer": self.optimizer,
                "steps": self.steps, "every": self.every, "logged": self.logged, "out": self.out,
                "exit_code": self.exit_code, "notes": list(self.notes),
                "findings": [f.to_dict() for f in self.findings]}
