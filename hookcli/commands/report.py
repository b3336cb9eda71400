"""``hookcli report``: read a watch log (JSON Lines, schema 1: docs/watch.md) into a ``WatchReport``.

Torch-free (a report reads a file: importing torch would cost seconds for nothing). One statistic is
picked (``STATS``: how they are named), the rows are filtered by ``--layers`` globs, and
every finding of the log is kept (the gate counts them all, whatever ``--layers`` shows).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import stat as stat_mode
import sys
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from typing import IO, Any

from hookcli.errors import InputError, LayerNotFoundError, UsageError, close_matches
from hookcli.escape import escape_control
from hookcli.options import layer_matches, split_patterns
from hookcli.records import LAYER_KEYS, PARAM_KEYS, WATCH_SCHEMA, Finding, ReportSeries, WatchReport, statistics

#: Every name ``--stat`` takes: a layer output's statistic (``rms``), its gradient's (``grad.rms``),
#: the layer's own count (``dead_channels``), a parameter's own (``update_ratio``) or its gradient's
#: (``param.grad.rms``).
def stat_names() -> tuple[str, ...]:
    """Every name ``--stat`` takes, from the table of statistics (``records.statistics``, ``WATCH``)."""
    keys = statistics.keys(statistics.WATCH)
    return (*keys, *(f"grad.{k}" for k in keys), *LAYER_KEYS, *PARAM_KEYS, *(f"param.grad.{k}" for k in keys))


STATS: tuple[str, ...] = stat_names()  # the built-in ones

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

#: The start of a JSON token a cut line can end in (``-``, ``1.``, ``1e-``, ``tr``, ``nul``; nothing).
_TOKEN_START = re.compile(r"-?\d*(\.\d*)?([eE][-+]?\d*)?|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?")


def _number(value: Any) -> float | None:
    """A number of the log: JSON numbers, and the strings hookcli writes for NaN and Inf; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # a whole number beyond float's range (JSON has no limit)
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    return None


def check_stat(stat: str) -> str:
    """``stat`` when it is one ``--stat`` takes, else a UsageError naming close ones."""
    if isinstance(stat, str) and stat in stat_names():
        return stat
    if not isinstance(stat, str):
        raise UsageError(f"stat must be a name such as 'rms', got {type(stat).__name__}",
                         hint="e.g. hookcli.report(path, stat='grad.rms')")
    near = close_matches(stat, stat_names())
    raise UsageError(f"--stat: unknown statistic {stat!r}",
                     hint=(f"did you mean: {', '.join(near)}? " if near else "")
                     + "e.g. rms, grad.rms, zero_fraction, update_ratio (hookcli report --help lists them)")


#: A log's longest line, in bytes: hookcli.watch writes a line per logged step, well under this for a model
#: of a hundred thousand modules. A longer line is left out (with a note) without being held in memory.
MAX_LINE_BYTES = 64 * 2**20

#: The range of a step: a 64-bit integer (a larger JSON integer is not a step count hookcli wrote).
STEP_RANGE = range(-2**63, 2**63)

_LOG_HINT = ("a watch log has one JSON object per line, as hookcli.watch(out=...) writes it "
             "(docs/watch.md#the-log-schema-1)")


class _BadLine(Exception):
    """Why one line of a log is not a logged step (``why``: ``is not JSON``), and a hint."""

    def __init__(self, why: str, hint: str = _LOG_HINT, torn: bool = False) -> None:
        super().__init__(why)
        self.why, self.hint, self.torn = why, hint, torn  # torn: by a crash mid-write


def _whole_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in STEP_RANGE


def _parse_line(raw: bytes) -> dict[str, Any]:
    """One line of the log as a dict of schema 1, or _BadLine saying why not."""
    try:
        line = json.loads(raw.decode("utf-8"))  # NaN, Infinity and -Infinity read as floats
    except UnicodeDecodeError:
        raise _BadLine("is not UTF-8 text") from None
    except (ValueError, RecursionError):  # RecursionError: nested too deep for the parser
        raise _BadLine("is not JSON") from None
    if not isinstance(line, dict):
        raise _BadLine("is not a JSON object")
    if line.get("schema") != WATCH_SCHEMA:
        raise _BadLine(f"has schema {escape_control(repr(line.get('schema')))[:40]}, not {WATCH_SCHEMA}",
                       hint="hookcli report reads the logs of hookcli.watch, schema 1 (docs/watch.md)")
    if not _whole_step(line.get("step")):
        raise _BadLine("has no whole-number 'step' (a 64-bit integer)")
    for key in ("layers", "params", "findings"):
        if not isinstance(line.get(key, []), list) or not all(isinstance(x, dict) for x in line.get(key, [])):
            raise _BadLine(f"has a {key!r} that is not a list of objects")
    return line


def read_log(path: str | os.PathLike[str], notes: list[str]) -> Iterator[dict[str, Any]]:
    """The lines of a watch log, one at a time (a long run's log need not fit in memory twice).

    A line torn by a crash mid-write (hookcli.watch writes each line whole, newline included) is left
    out, with a note added to ``notes``: a last line without its newline that is not JSON, or a JSON
    object cut short (a resumed run's lines follow it, ``LineLog`` starts them on a new line). Any
    other bad line is an InputError naming it; so is a log with no whole line. ``-`` is stdin (the
    Unix convention: ``zcat log.jsonl.gz | hookcli report -``), read to its end and left open."""
    shown = shown_path(path)
    if os.fspath(path) == STDIN:
        yield from _read_lines(shown, _stdin(), notes, close=False)
        return
    try:
        if stat_mode.S_ISCHR(mode := os.stat(path).st_mode) or stat_mode.S_ISBLK(mode):
            raise InputError(f"{shown} is a device, not a log file",
                             hint="give the .jsonl file hookcli.watch(out=...) wrote, or pipe a log in: hookcli report -")
        file = open(path, "rb")  # noqa: SIM115 - closed below, also when a bad line stops the reading
    except FileNotFoundError:
        raise InputError(f"no such log file: {shown}",
                         hint="give the file hookcli.watch(out=...) wrote, e.g. hookcli report runs/exp.jsonl") from None
    except IsADirectoryError:
        raise InputError(f"{shown} is a directory, not a log file",
                         hint="give the .jsonl file hookcli.watch(out=...) wrote") from None
    except OSError as exc:
        raise InputError(f"cannot read {shown}: {exc.strerror or exc}", hint="check the file's permissions") from None
    yield from _read_lines(shown, file, notes, close=True)


def shown_path(path: str | os.PathLike[str]) -> str:
    """How messages name the log: its path as given, ``stdin`` for ``-``."""
    shown = os.fspath(path)
    return "stdin" if shown == STDIN else shown


#: The log path that means stdin.
STDIN = "-"


def _stdin() -> IO[bytes]:
    """stdin's bytes for ``report -``; an InputError when it is closed or a terminal (nothing piped in:
    reading would wait for typed JSON)."""
    stream = sys.stdin
    if stream is None or getattr(stream, "buffer", None) is None:
        raise InputError("report -: stdin is closed, there is no log to read",
                         hint="pipe a log in (cat runs/exp.jsonl | hookcli report -) or give its path")
    if stream.isatty():
        raise InputError("report -: stdin is a terminal, not a log",
                         hint="pipe a log in (cat runs/exp.jsonl | hookcli report -) or give its path")
    return stream.buffer


def _read_lines(shown: str, file: IO[bytes], notes: list[str], close: bool) -> Iterator[dict[str, Any]]:
    """``read_log``'s reading of an open log (``close``: closed at the end, also by an error; stdin is not).

    A line that is not a logged step (garbage, a line too long, one torn by a crash) is left out with
    a note; a log with no good line at all is an InputError naming its first bad line."""
    found = False
    left_out: list[tuple[int, _BadLine]] = []
    with file if close else nullcontext():
        for number, raw in _raw_lines(file):
            if number == 1 and raw is not None and raw.startswith(_GZIP_MAGIC):  # JSON lines only
                raise InputError(f"{shown} is gzip-compressed, not a log's JSON lines",
                                 hint=f"decompress it on the way in: gunzip -c {shlex.quote(shown) if close else 'LOG.gz'}"
                                      " | hookcli report -")
            if raw is not None and not raw.strip():
                continue
            try:
                if raw is None:
                    raise _BadLine(f"is longer than {MAX_LINE_BYTES // 2**20} MB (not a line hookcli.watch writes)")
                line = _parse_line(raw)
            except _BadLine as bad:
                left_out.append((number, _torn(raw) or bad))
                continue
            found = True
            yield line
    if not found and left_out:
        number, bad = left_out[0]
        torn = all(b.torn for _, b in left_out)
        raise InputError(f"{shown} has no whole line: what it holds is cut short (a run that stopped mid-write)"
                         if torn else f"{shown}: line {number} {bad.why}"
                         + (f" (and {len(left_out) - 1} more line(s) are not logged steps)" if len(left_out) > 1 else ""),
                         hint="the run stopped while it wrote its first line; run it again (the log is appended to)"
                         if torn else bad.hint)
    if not found:
        raise InputError(f"{shown} has no logged steps (empty log)",
                         hint="a watch writes its first line at the first logged step (step 0)")
    notes += [f"line {number} left out: it {bad.why}" for number, bad in left_out[:_NOTE_LINES]]
    if len(left_out) > _NOTE_LINES:
        notes.append(f"{len(left_out) - _NOTE_LINES} more lines left out (not logged steps)")


#: How many left-out lines get a note of their own (the rest are counted in one more note).
_NOTE_LINES = 5


def _raw_lines(file: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """The numbered lines of ``file``, each at most ``MAX_LINE_BYTES`` long: a longer line is None, read
    past in bounded pieces (never held whole: ``/dev/zero`` piped in is one endless line)."""
    number = 0
    while raw := file.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            while raw and not raw.endswith(b"\n"):
                raw = file.readline(2**20)
            yield number, None
        else:
            yield number, raw


def _torn(raw: bytes | None) -> _BadLine | None:
    """Why a line torn by a crash mid-write is one (None for a line damaged otherwise)."""
    if raw is None:
        return None
    if not raw.endswith(b"\n"):
        return _BadLine("ends without a newline and is not a whole line (a run that stopped mid-write)", torn=True)
    if _cut_short(raw):
        return _BadLine("is cut short (a run that stopped mid-write; a resumed run's lines follow)", torn=True)
    return None


#: The first bytes of a gzip file.
_GZIP_MAGIC = b"\x1f\x8b"


def _cut_short(raw: bytes) -> bool:
    """Whether a line that is not JSON is the start of a JSON object cut short (a line torn by a crash,
    which a resumed run's lines follow), not a line damaged otherwise: the parser ran out of text."""
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
        json.loads(text)
    except json.JSONDecodeError as exc:
        # out of text: in a string never closed, or what is left is the start of a value's last token
        return text.startswith("{") and (exc.msg.startswith("Unterminated string")
                                         or _TOKEN_START.fullmatch(text, exc.pos) is not None)
    except (ValueError, RecursionError):  # not UTF-8, nested too deep
        return False
    return False


def _label(entry: dict[str, Any]) -> str:
    """A layer's row name, as the findings name it (``attn[0]``); ``(model)`` for the root module."""
    name = str(entry.get("name", "")) + str(entry.get("output", "") or "")
    return name or "(model)"


def _value(entry: dict[str, Any], stat: str) -> float | None:
    """The ``stat`` of one layer or parameter entry (``stat`` without its ``param.`` prefix)."""
    if stat in PARAM_KEYS or stat in LAYER_KEYS:
        return _number(entry.get(stat))
    where, _, key = stat.rpartition(".")
    stats = entry.get(where or "stats")
    return _number(stats.get(key)) if isinstance(stats, dict) else None


def _finding(raw: dict[str, Any], step: int) -> Finding:
    """A finding of the log (``step``: its line's, when the finding has none)."""
    layer = raw.get("layer")
    own = raw.get("step")
    return Finding(rule=str(raw.get("rule", "?")), severity=str(raw.get("severity", "warning")),
                   step=own if _whole_step(own) else step,
                   layer=str(layer) if layer is not None else None, direction=str(raw.get("direction", "")),
                   value=_number(raw.get("value")), limit=_number(raw.get("limit")),
                   message=str(raw.get("message", "")))


def _matches(patterns: list[str], name: str, modules: Sequence[str]) -> bool:
    """Whether a row matches a ``--layers`` name or glob: its own name (``lstm[0].data``, ``lstm*``), or
    its module's names (``modules``: its name, and the others of a module reached along two paths, a
    tied ``lm_head``) as ``--layers`` matches modules in every command (``options.layer_matches``): a
    module's name keeps all its output rows (``lstm``: ``lstm[0].data``, ``lstm[1][0]``) and a
    parameter's module its parameters (``head``: ``head.weight``)."""
    return any(p == name or layer_matches(p, name) or any(layer_matches(p, m) for m in modules) for p in patterns)


def _unmeasured_note(rows: list[str]) -> str:
    """The note for the layer rows left out of a report: outputs that are not floating point (integer
    or bool: a PackedSequence's ``batch_sizes``, an argmax), of which the watch logs no statistics."""
    shown = ", ".join(rows[:_NOTE_ROWS]) + (f" and {len(rows) - _NOTE_ROWS} more" if len(rows) > _NOTE_ROWS else "")
    return (f"{len(rows)} output{'s' if len(rows) > 1 else ''} left out, not floating point: {shown} "
            "(the watch logs their shape and dtype only: no statistics)")


#: How many rows ``_unmeasured_note`` names (a note is one line).
_NOTE_ROWS = 4


def _add_aliases(line: dict[str, Any], aliases: dict[str, set[str]]) -> None:
    """The other names of the modules a line's layer entries name (``aliases``: a tied ``lm_head``)."""
    for entry in line.get("layers", []):
        names = entry.get("aliases")
        if isinstance(names, list):
            aliases.setdefault(str(entry.get("name", "")), set()).update(str(n) for n in names)


def _select(series: list[ReportSeries], patterns: list[str], modules: dict[str, list[str]], noun: str, shown: str,
            notes: list[str]) -> list[ReportSeries]:
    """The rows ``--layers`` matches. A pattern that matches no row gets a note (a log holds the rows
    its run logged: another run's names are not a typo of this one's); a LayerNotFoundError (exit 2)
    when no pattern matches any row."""
    def near(pattern: str) -> str:
        found = close_matches(pattern, [s.name for s in series])
        return f"did you mean: {', '.join(found)}? " if found else ""

    missed = [p for p in patterns if not any(_matches([p], s.name, modules[s.name]) for s in series)]
    if len(missed) == len(patterns):
        raise LayerNotFoundError(f"--layers: {', '.join(map(repr, missed))} match{'es' if len(missed) == 1 else ''} "
                                 f"no {noun} in {shown}",
                                 hint=near(missed[0]) + "names as in the log; globs like 'blocks.*' work")
    notes += [f"--layers: {p!r} matches no {noun} in {shown} ({near(p)}names as in the log)" for p in missed]
    return [s for s in series if _matches(patterns, s.name, modules[s.name])]


def watch_report(path: str | os.PathLike[str], stat: str = "rms",
                 layers: Sequence[str] | str | None = None) -> WatchReport:
    """The ``WatchReport`` of the log at ``path``: ``stat`` per layer (or parameter) per logged step,
    the rows whose names match ``layers`` (names or globs, comma-separated), the loss and every finding.

    UsageError for an unknown ``stat`` or when no pattern matches a row (one that does not is noted);
    InputError (exit 2) for a missing or empty log, or one with no good line (a bad line is noted)."""
    stat = check_stat(stat)
    is_param = stat in PARAM_KEYS or stat.startswith("param.")
    key = stat.removeprefix("param.")
    notes: list[str] = []
    steps: list[int] = []
    losses: list[float | None] = []
    findings: list[Finding] = []
    rows: dict[str, ReportSeries] = {}
    modules: dict[str, str] = {}  # a row's name -> its module's
    unmeasured: dict[str, str] = {}  # a layer row's name -> its dtype, until an entry of it has statistics
    aliases: dict[str, set[str]] = {}  # a module's name -> its other names
    for column, line in enumerate(read_log(path, notes)):
        _add_aliases(line, aliases)
        steps.append(line["step"])
        losses.append(_number(line.get("loss")))
        findings += [_finding(f, line["step"]) for f in line.get("findings", [])]
        for entry in line.get("params" if is_param else "layers", []):
            name = str(entry.get("name", "")) if is_param else _label(entry)
            row = rows.get(name)
            if row is None:
                row = rows[name] = ReportSeries(name, "parameter" if is_param else str(entry.get("type", "?")), [])
                modules[name] = (name.rpartition(".")[0] if is_param else str(entry.get("name", "")))
                if not is_param:
                    unmeasured[name] = str(entry.get("dtype", "?"))
            if isinstance(entry.get("stats"), dict):
                unmeasured.pop(name, None)
            row.values += [None] * (column - len(row.values)) + [_value(entry, key)]
    for row in rows.values():
        row.values += [None] * (len(steps) - len(row.values))
    patterns = split_patterns(layers)
    series = list(rows.values())
    if patterns:
        names = {row: [module, *sorted(aliases.get(module, ()))] for row, module in modules.items()}
        series = _select(series, patterns, names, f"{'parameter' if is_param else 'layer'}", shown_path(path), notes)
    if left_out := [s for s in series if s.name in unmeasured]:
        series = [s for s in series if s.name not in unmeasured]
        notes.append(_unmeasured_note([f"{s.name} ({unmeasured[s.name]})" for s in left_out]))
    back = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
    if back is not None:
        notes.append(f"the steps go back at logged step {back + 1} (step {steps[back]} after {steps[back - 1]}): "
                     "more than one run appended to this log; shown in the log's order")
    return WatchReport(path=os.fspath(path), stat=stat, steps=steps, losses=losses, series=series,
                       findings=findings, notes=notes)
