"""JSON renderer: ``Report.to_dict()`` as strict JSON.

Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``: the output stays
valid JSON (``allow_nan=False``; bare ``NaN`` is not JSON) and keeps what a NaN check needs.
"""

from __future__ import annotations

import json

from hookcli.records.core import sanitize  # the JSON format's non-finite numbers, with the records
from hookcli.render.formats import Renderable

__all__ = ["JsonRenderer", "sanitize", "to_json"]


def to_json(report: Renderable) -> str:
    """The report's dict as indented JSON text ending with a newline."""
    return json.dumps(sanitize(report.to_dict()), indent=2, allow_nan=False) + "\n"


class JsonRenderer:
    """``--format json``: the report's ``to_dict()`` (width and color are ignored)."""

    def render(
        self, report: Renderable, *, width: int | None = None, color: bool = False
    ) -> str:
        """The report as JSON text."""
        return to_json(report)

