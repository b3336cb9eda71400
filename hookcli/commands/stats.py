"""``stats``: one forward pass with activation statistics of every selected module call.

Torch-free at import (``kernel_status`` serves ``hookcli --version``): ``stats_report`` imports the
engine's run when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookcli.engine import kernel

if TYPE_CHECKING:
    from hookcli.options import RunOptions
    from hookcli.records import Report


def stats_report(options: RunOptions) -> Report:
    """``stats``: the engine's forward report with statistics, under the run lock."""
    from hookcli.engine.run import forward_report, prepare, require_values
    from hookcli.engine.state import exclusive

    with exclusive(options.model):
        prep = prepare(options, batched=True)
        require_values(prep, "stats")  # statistics of meta tensors would be a table of dashes
        return forward_report(prep, "stats", stats=True)


def kernel_status() -> str:
    """Whether the optional C statistics kernel is built, stale or switched off (inspected, never loaded)."""
    return kernel.status()


__all__ = ["kernel_status", "stats_report"]
