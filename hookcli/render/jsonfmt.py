"""JSON renderer: ``Report.to_dict()`` as strict JSON.

Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``: the output stays
valid JSON (``allow_nan=False``; bare ``NaN`` is not JSON) and keeps what a NaN check needs.
"""

from __future__ import annotations

import json
import math
from typing import Any

from hookcli.records import WatchStep
from hookcli.render.formats import Renderable


def sanitize(value: Any) -> Any:
    """A copy of ``value`` with non-finite floats replaced by ``"nan"``/``"inf"``/``"-inf"``."""
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


def to_json_line(record: WatchStep) -> str:
    """The record's dict as one line of JSON Lines (compact, non-finite floats as strings), ending with
    a newline."""
    return json.dumps(sanitize(record.to_dict()), allow_nan=False, separators=(",", ":")) + "\n"
