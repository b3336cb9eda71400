"""Plain-data results of ``hookcli diff``: one row per matched output tensor of two runs (no tensors).

Run A is the reference (MODEL with the usual options), run B the same with the ``--vs-*`` changes.
A row's errors compare B's tensor with A's: ``max_abs`` = max |a - b|, ``rel_l2`` = ||a - b|| / ||a||,
``cosine`` = <a, b> / (||a|| ||b||), ``sqnr_db`` = 10 log10(||a||^2 / ||a - b||^2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookcli.records.core import InputInfo, ModelInfo, Shape, call_label, envelope

#: Row statuses. ``ok``: within tolerance; ``diverged``: beyond it; ``shape``: the shapes differ;
#: ``only_a`` / ``only_b``: the call (or output tensor) happened in one run only; ``not_called``:
#: selected but called in neither run; ``no_tensor``: the call returned no tensor to compare.
STATUSES: tuple[str, ...] = ("ok", "diverged", "shape", "only_a", "only_b", "not_called", "no_tensor")
#: The statuses that are divergences (the first of them in execution order is named in the summary).
DIVERGED: tuple[str, ...] = ("diverged", "shape", "only_a", "only_b")
ERROR_KEYS: tuple[str, ...] = ("max_abs", "rel_l2", "cosine", "sqnr_db")


@dataclass
class Errors:
    """How far run B's tensor is from run A's, and whether that is within tolerance."""

    max_abs: float
    rel_l2: float
    cosine: float
    sqnr_db: float
    within: bool

    def to_dict(self) -> dict[str, Any]:
        return {"max_abs": self.max_abs, "rel_l2": self.rel_l2, "cosine": self.cosine,
                "sqnr_db": self.sqnr_db, "within": self.within}


@dataclass
class Tolerance:
    """What counts as within tolerance for tensors of these two dtypes: every limit that is set holds.

    ``rtol``/``atol``: ``|a - b| <= atol + rtol * |a|`` elementwise (a = run A); ``rel_l2``: at most this
    ``||a - b|| / ||a||``; ``cosine_distance``: at most this ``1 - cos(a, b)``. None: not checked.
    """

    a_dtype: str
    b_dtype: str
    rtol: float | None
    atol: float | None
    source: str  # "default" (from the dtypes), "given" (--rtol/--atol) or "exact" (integers, bool)
    rel_l2: float | None = None
    cosine_distance: float | None = None

    def accepts(self, errors: Errors) -> bool:
        """Whether ``errors`` (whose ``within`` is the elementwise check) meet every limit that is set.
        NaN errors never do."""
        if self.rtol is not None and not errors.within:
            return False
        if self.rel_l2 is not None and not errors.rel_l2 <= self.rel_l2:
            return False
        return self.cosine_distance is None or 1.0 - errors.cosine <= self.cosine_distance

    def to_dict(self) -> dict[str, Any]:
        return {"a_dtype": self.a_dtype, "b_dtype": self.b_dtype, "rtol": self.rtol, "atol": self.atol,
                "rel_l2": self.rel_l2, "cosine_distance": self.cosine_distance, "source": self.source}


@dataclass
class DiffRow:
    """One output tensor of one call of one selected module, as run A and run B produced it."""

    name: str
    call: int
    type: str
    output: str = ""
    status: str = "ok"
    depth: int = 1
    calls: int = 1
    final: bool = False  # a tensor of the model's own output (the exit code is decided on these)
    a_shape: Shape | None = None
    b_shape: Shape | None = None
    a_dtype: str | None = None
    b_dtype: str | None = None
    b_type: str | None = None  # run B's module class (``type`` is run A's, or B's for B-only rows)
    errors: Errors | None = None
    grad: Errors | None = None  # --grads: the gradient of the loss w.r.t. this output, B vs A
    grad_status: str | None = None  # --grads: ok | diverged | shape | missing (in one run only)
    #: When the output was produced (its forward hook ran; parents finish after their children), and
    #: when its gradient arrived in backward: the first divergence is the earliest of these.
    order: int = field(default=-1, compare=False)
    grad_order: int = field(default=-1, compare=False)

    @property
    def label(self) -> str:
        """``name``, ``name#call`` for reused modules, plus the output path (as report rows)."""
        return call_label(self.name, self.call, self.calls, self.output)

    @property
    def diverged(self) -> bool:
        return self.status in DIVERGED

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "call": self.call,
            "type": self.type,
            "output": self.output,
            "status": self.status,
            "final": self.final,
            "depth": self.depth,
            "a": {"shape": self.a_shape, "dtype": self.a_dtype,
                  "type": None if self.status in ("only_b", "not_called") else self.type},
            "b": {"shape": self.b_shape, "dtype": self.b_dtype, "type": self.b_type},
            "errors": self.errors.to_dict() if self.errors else None,
        }
        if self.grad is not None or self.grad_status is not None:
            data["grad"] = self.grad.to_dict() if self.grad else None
            data["grad_status"] = self.grad_status
        return data


@dataclass
class DiffReport:
    """The result of ``hookcli diff``: run A (the reference) against run B (A with ``changes``)."""

    model: ModelInfo
    vs_model: ModelInfo
    changes: list[str]  # what run B changes: "weights: b.pt", "dtype: bfloat16", ...
    inputs: list[InputInfo] = field(default_factory=list)
    device: str = "cpu"
    vs_device: str = "cpu"
    mode: str = "eval"
    rows: list[DiffRow] = field(default_factory=list)
    tolerances: list[Tolerance] = field(default_factory=list)
    grads: bool = False
    loss: dict[str, Any] | None = None  # {"kind", "output", "target", "a": value, "b": value}
    notes: list[str] = field(default_factory=list)
    version: str = ""
    command: str = "diff"
    #: the reduction backend in force for run A's device (``engine.reduction``), as every report names it
    reduction: str | None = None

    @property
    def first_divergence(self) -> DiffRow | None:
        """The diverged row whose output was produced first (a module finishes after its children)."""
        return min((r for r in self.rows if r.diverged), key=lambda r: r.order, default=None)

    @property
    def first_grad_divergence(self) -> DiffRow | None:
        """The first gradient to diverge as backward runs (in the order gradients arrived)."""
        return min((r for r in self.rows if r.grad_status not in (None, "ok")), key=lambda r: r.grad_order,
                   default=None)

    @property
    def ok(self) -> bool:
        """The model's final outputs agree within tolerance (the exit code: 0 when True, else 1)."""
        finals = [r for r in self.rows if r.final]
        return bool(finals) and not any(r.diverged for r in finals)

    def counts(self) -> dict[str, int]:
        """Rows per status."""
        counts = dict.fromkeys(STATUSES, 0)
        for r in self.rows:
            counts[r.status] += 1
        return counts

    def headline(self) -> str:
        """One line: whether the final outputs agree, and the first divergence."""
        first = self.first_divergence
        where = f"; first divergence: {first.label} ({first.status})" if first else ""
        verdict = "final outputs agree within tolerance" if self.ok else "final outputs differ beyond tolerance"
        return verdict + where

    def to_dict(self) -> dict[str, Any]:
        data = envelope(self.version, self.command, self.model, self.inputs, self.device, self.mode)
        if self.reduction is not None:
            data["reduction"] = self.reduction
        first = self.first_divergence
        first_grad = self.first_grad_divergence
        data.update({
            "ok": self.ok,
            "vs": {"model": self.vs_model.to_dict(), "device": self.vs_device, "changes": list(self.changes)},
            "tolerances": [t.to_dict() for t in self.tolerances],
            "summary": self.counts(),
            "first_divergence": _where(first),
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
        })
        if self.grads:
            data["first_grad_divergence"] = _where(first_grad)
            data["loss"] = self.loss
        return data


def _where(row: DiffRow | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {"name": row.name, "call": row.call, "output": row.output, "status": row.status}


__all__ = ["DIVERGED", "ERROR_KEYS", "STATUSES", "DiffReport", "DiffRow", "Errors", "Tolerance"]
