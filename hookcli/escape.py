"""Text from the model is data, never control: escapes for every human-facing output.

Module names (any string, through ``add_module``), output keys, class names and exception messages
come from the user's model. Printed raw, an ESC or OSC sequence recolours or rewrites the terminal
(or hides a link in it), a CR or bidi control (U+202E) makes a name read as another, a newline
forges a line of a log or a GitHub workflow command. Every renderer for people (table, Markdown,
the stderr error line, progress, GitHub annotations, JUnit XML) passes such text through
:func:`escape_control`; CSV cells through :func:`csv_cell`. JSON keeps the exact text
(``json.dumps`` escapes control characters itself).

Nothing here imports torch (or anything else): the CLI's error path imports it lazily.
"""

from __future__ import annotations

import re
from typing import Any

_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape_char(ch: str) -> str:
    short = _SHORT.get(ch)
    if short is not None:
        return short
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_control(text: Any) -> str:
    """``text`` with every non-printable character written as a visible Python-style escape.

    Non-printable is :meth:`str.isprintable`'s sense: C0/C1 controls (ESC, BEL, CR, LF, TAB, NUL,
    DEL), format characters (bidi overrides U+202E, zero-width joiners), separators other than the
    space (U+2028, NBSP), surrogates, private-use and unassigned code points. They become ``\\x1b``,
    ``\\u202e``, ``\\n``, ``\\t``, ... Printable text (any script, emoji, backslashes) is unchanged,
    so the result is one line with no escape sequence in it, and escaping twice changes nothing.
    """
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():  # the common case, in C
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


#: What a spreadsheet may read as the start of a formula (OWASP "CSV injection"), ASCII and full-width.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20")


#: Strings that start with ``-`` but are only a number or shapes (``-1x10``, ``2x3;-1``): no formula.
_NUMERIC = re.compile(r"-?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|inf|nan)(?:[x;]-?\d+)*", re.ASCII)


def csv_cell(value: Any) -> Any:
    """A CSV cell: a string is escaped (:func:`escape_control`) and, when a spreadsheet would read
    it as a formula (it starts with ``=``, ``+``, ``-``, ``@``, a tab or CR, or their full-width
    forms), prefixed with ``'`` (OWASP's advice).

    Only strings are guarded: an int or float (``-0.5``, ``-inf``) stays a number, and so does a
    string that is only a number or shapes (``-1x10``: a check limit with any batch size).
    """
    if not isinstance(value, str):
        return value
    # OWASP's list, on the raw text (a leading tab or CR is then also escaped)
    if value.startswith(FORMULA_STARTS) and not _NUMERIC.fullmatch(value):
        return "'" + escape_control(value)
    return escape_control(value)


__all__ = ["FORMULA_STARTS", "csv_cell", "escape_control"]
