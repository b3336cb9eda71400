"""Plain-data results of ``hookcli check`` (no tensors; see core.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookcli.records.core import SCHEMA, ModelInfo, Report


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
    #: Wall-clock seconds this rule took (``runs``: the model run); JUnit's ``time``. Not in JSON.
    seconds: float | None = field(default=None, compare=False)

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
    #: Wall-clock seconds of the whole check (build, run, rules); JUnit's ``time``. Not in JSON.
    seconds: float | None = field(default=None, compare=False)

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
            "partial": self.report.partial,
            "model": self.report.model.to_dict(),
            "config": self.config,
            "summary": self.counts(),
            "rules": [r.to_dict() for r in self.rules],
            "notes": list(self.notes),
            "report": self.report.to_dict(),
        }
