"""Plain data of ``hookcli report``: one statistic of a watch log (docs/watch.md) per layer (or
parameter) per logged step, the loss, and the log's findings. ``to_dict()`` *is* ``--format json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookcli.records.watch import Finding


@dataclass
class ReportSeries:
    """One row of the report: a module's output (``name`` with its output path, as the findings name
    it) or a parameter, and the statistic's value at each logged step (None: not logged there)."""

    name: str
    type: str  # the module's class, or "parameter"
    values: list[float | None]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "values": self.values}


@dataclass
class WatchReport:
    """One statistic (``stat``, e.g. ``rms``, ``grad.rms``, ``update_ratio``) of a watch log over its
    logged steps (``steps``, in the log's order), the loss at each, and every finding in the log.

    ``notes`` say what the reader left out (a torn last line, outputs that are not floating point). ``ok`` is False when a finding of
    severity ``error`` is in the log: ``hookcli report`` then exits 1 (a CI gate)."""

    path: str
    stat: str
    steps: list[int]
    losses: list[float | None]
    series: list[ReportSeries] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        """The findings of severity ``error``."""
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {"command": "report", "path": self.path, "stat": self.stat, "steps": self.steps,
                "losses": self.losses, "series": [s.to_dict() for s in self.series],
                "findings": [f.to_dict() for f in self.findings], "notes": self.notes, "ok": self.ok}
