"""Rendering ``hookcli watch``: a finding as one line (stderr, as it occurs), the run's summary line,
and a WatchRun as a table (``watch MODEL --steps N``). Never imports torch."""

from __future__ import annotations

from hookcli.records import Finding, WatchRun
from hookcli.render.checks import format_value
from hookcli.render.columns import Cell, Column
from hookcli.render.formats import plain

SEVERITY_STYLES = {"error": "bold red", "warning": "yellow"}


def finding_line(finding: Finding) -> str:
    """``step 2: warning frozen (2.weight): 2.weight requires grad but ...``: one line."""
    return finding.line()


def summary_line(run: WatchRun) -> str:
    """What was watched, how many steps and where the log went, and how many findings."""
    if run.model is None:  # the last note says why
        return "nothing was watched" + (f": {plain(run.notes[-1])}" if run.notes else "")
    log = f"{run.logged} logged to {run.out}" if run.out else f"{run.logged} logged (no --out: no log written)"
    errors = len(run.errors)
    found = f"{len(run.findings)} finding{'s' * (len(run.findings) != 1)}" + (f" ({errors} error{'s' * (errors != 1)})"
                                                                             if errors else "")
    return f"{plain(run.model)}, {run.optimizer}: {run.steps} steps, {log}; {found}"


def finding_columns() -> list[Column[Finding]]:
    """Step, Severity, Rule, Where, Value, Limit, Message."""
    return [
        Column("step", "Step", lambda f: Cell(str(f.step)), lambda f: f.step, justify="right"),
        Column("severity", "Severity", lambda f: Cell(f.severity, SEVERITY_STYLES.get(f.severity)),
               lambda f: f.severity),
        Column("rule", "Rule", lambda f: Cell(f.rule), lambda f: f.rule, no_wrap=True),
        Column("layer", "Where", lambda f: Cell(plain(f.layer) if f.layer else "-"), lambda f: f.layer or "",
               no_wrap=True),
        Column("direction", "Direction", lambda f: Cell(f.direction), lambda f: f.direction),
        Column("value", "Value", lambda f: Cell(format_value(f.value)), lambda f: f.value, justify="right"),
        Column("limit", "Limit", lambda f: Cell(format_value(f.limit)), lambda f: f.limit, justify="right"),
        Column("message", "Message", lambda f: Cell(plain(f.message)), lambda f: f.message),
    ]


def verdict(run: WatchRun) -> str:
    """``PASSED`` (no error finding: warnings are told, not failed) or ``FAILED: ...``."""
    if run.errors:
        first = run.errors[0]
        return f"FAILED: {first.rule} at step {first.step}" + (f" ({plain(first.layer)})" if first.layer else "")
    return "PASSED" + (f" with {len(run.findings)} warning{'s' * (len(run.findings) != 1)}" if run.findings else "")


__all__ = ["finding_columns", "finding_line", "summary_line", "verdict"]
