"""Errors raised by the hookcli library.

The library raises these; the CLI maps them to an exit code and a one-line message (plus hint) at the
edge, in one place (``hookcli.cli``). ``exit_code`` follows the CLI contract: 2 for usage or input
errors, 1 when the model itself failed or a check failed.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hookcli.records import Report

#: The CLI's exit codes besides 0, in one place (docs/options.md "Errors and exit codes" documents them).
EXIT_FAILED = 1  # the model raised or exited, or a check failed
EXIT_USAGE = 2  # bad usage or input, or something hookcli does not support
EXIT_INTERNAL = 3  # a bug in hookcli


class HookcliError(Exception):
    """Base class of every error hookcli raises on purpose.

    Every error carries a hint (what to do next): the one given where it is raised, else its
    class's ``default_hint``, so no message reaches the user without one.
    """

    exit_code: int = EXIT_USAGE
    default_hint: str = "run the command with --help to see its options"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint

    def __str__(self) -> str:
        return self.message


class UsageError(HookcliError):
    """A bad option value or combination (exit 2)."""

    default_hint = 'run the command with --help to see its options and their values'


class ModelNotFoundError(UsageError):
    """The model spec names no known torchvision model or importable attribute."""

    default_hint = "a MODEL is a torchvision name ('hookcli models' lists them), package.module:attr or path/to/file.py:attr"


class ModelImportError(UsageError):
    """A user model's module or file failed to import or build."""

    default_hint = "run again with --debug to see the traceback from the model's code"


class WeightsError(UsageError):
    """Weights could not be loaded (missing file, mismatched keys, download impossible)."""

    default_hint = 'pass a state dict saved with torch.save(model.state_dict(), PATH), or leave --weights out for random weights'


class LayerNotFoundError(UsageError):
    """A --layers pattern or --types name matches no module of the model."""

    default_hint = "run 'hookcli modules MODEL' to list the module names and types"


class InputError(UsageError):
    """An input file or input option could not be turned into tensors."""

    default_hint = "check --input / --input-shape (see the command's --help)"


class DataError(InputError):
    """A batch of ``--data`` that could not be read or passed to the model (exit 2: bad input), met
    after earlier batches ran. Carries their partial report (``report``), as ModelRaisedError does."""

    def __init__(self, message: str, *, report: Report | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.report = report


class ConfigError(UsageError):
    """A config file is unreadable or has unknown keys / wrong types."""

    default_hint = 'fix the config file; docs/options.md (Config files) lists every key it may set'


class OutputError(UsageError):
    """An output file cannot be written (bad extension, unwritable path)."""

    default_hint = 'choose another output file, in a directory you can write to'


class UnsupportedError(UsageError):
    """Something hookcli does not support (exit 2): the message says what, the hint what to do instead.

    Never "the model raised": the model may be fine, hookcli cannot inspect it this way.
    """

    default_hint = 'run again with --debug for details, and see the README for what hookcli supports'


class RanksFailed(HookcliError):
    """Under torchrun, the run (the model or hookcli's hooks) failed on another rank (exit 2): every rank
    stops there, since one that raised alone would leave the others waiting in the step's collectives;
    the rank that failed raises its own error instead."""

    default_hint = "the failed rank's error says what went wrong (docs/distributed.md)"


class ModelRaisedError(HookcliError):
    """The model raised during forward or backward (exit 1).

    Carries the partial report (every row gathered before the failure), the dotted name of the
    innermost module that was running and that module's input shapes, so nothing is lost.
    """

    default_hint = "run again with --debug for the model's traceback"

    exit_code = EXIT_FAILED

    def __init__(
        self,
        message: str,
        *,
        report: Report | None = None,
        module: str | None = None,
        input_shapes: list[Any] | None = None,
        phase: str = "forward",
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.report = report
        self.module = module
        self.input_shapes = input_shapes
        self.phase = phase


class CheckFailedError(HookcliError):
    """One or more sanity-check rules failed (exit 1)."""

    default_hint = 'see the FAIL rows above; thresholds come from [checks] in the config'

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, result: Any = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.result = result


class InternalError(HookcliError):
    """A bug in hookcli itself (exit 3): never blamed on the model or the user's input."""

    default_hint = 'run again with --debug for the traceback, and please report it'

    exit_code = EXIT_INTERNAL


class StepOrderWarning(UserWarning):
    """``hookcli.watch``: ``w.step()`` and ``optimizer.step()`` are called in an order that shifts the
    log's steps against the optimizer's (docs/watch.md "What a step is"). A warning, issued once per
    watch: the loop's numbers are never changed."""


class WatchWarning(UserWarning):
    """``hookcli.watch``: part of the watch stopped (writing its log or TensorBoard scalars: no space
    left, its folder gone; recording: hookcli's own failure inside a hook), said once, with why. The
    loop goes on, its numbers unchanged: a monitor never takes down the run it watches."""


class WeightsChangedWarning(UserWarning):
    """A run of a caller's model changed a weight in place where earlier runs of the model changed none,
    so no copy was kept to put it back (docs/python-api.md, "So are the weights' values"). Said once per
    such run, naming the weights; the model's weights are copied on every later run."""


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first frame outside hookcli, torch and ``contextlib``: the
    caller's line that was running when hookcli had something to say. Call it as warn's argument."""
    torch = sys.modules.get("torch")
    roots = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep if m is not contextlib
                  else os.path.abspath(m.__file__) for m in (sys.modules[__package__], torch, contextlib)
                  if m is not None and m.__file__)
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(roots):
        frame, level = frame.f_back, level + 1
    return level


class Terminated(BaseException):
    """SIGTERM turned into an exception (like KeyboardInterrupt for SIGINT), so that it unwinds
    through every ``finally``: temporary files are removed, the user's model is handed back, an
    output file is left as it was. Not an Exception: nothing that catches errors may swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: What stops a run from outside (Ctrl-C, SIGTERM): never the model's failure, always passed on. Any
#: other BaseException raised by the model's code is the model's failure (a forward that raises
#: GeneratorExit too: hookcli's runs are no generators that could be closed there).
INTERRUPTS: tuple[type[BaseException], ...] = (KeyboardInterrupt, Terminated)


def safe_str(value: object) -> str:
    """``str(value)``, or a description when its own ``__str__`` raises (the model's code can define
    any exception, any ``sys.exit`` argument): reporting a failure must never fail."""
    try:
        return str(value)
    except Exception as inner:  # noqa: BLE001 - any failure of a foreign __str__
        return f"<{type(value).__name__} whose __str__ raised {type(inner).__name__}>"


def exit_status(code: object) -> str:
    """How a ``SystemExit`` code reads in a message: ``code 3``, ``code 0`` (``sys.exit()``), or the
    message that ``sys.exit("text")`` would print (Python exits 1 then)."""
    if code is None:
        return "code 0"
    if isinstance(code, int):
        return f"code {code}"
    text = safe_str(code).strip()
    return f"code 1 ({text.splitlines()[0] if text else ''!r})"


#: The hint every internal error carries.
INTERNAL_HINT = "run again with --debug for the traceback, and please report it"


def internal_error(exc: BaseException, where: str) -> InternalError:
    """An InternalError saying that hookcli's own code ``where`` raised ``exc`` (chain it: ``from exc``)."""
    text = safe_str(exc).strip()
    detail = f": {text.splitlines()[0]}" if text else ""
    return InternalError(f"internal error: {where} raised {type(exc).__name__}{detail}", hint=INTERNAL_HINT)


def close_matches(word: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """Return up to ``n`` candidates that look like ``word`` (for 'did you mean' hints)."""
    pool = list(dict.fromkeys(candidates))
    matches = difflib.get_close_matches(word, pool, n=n, cutoff=0.6)
    if not matches:
        lowered = word.lower()
        matches = [c for c in pool if lowered in c.lower()][:n]
    return matches


def did_you_mean(word: str, candidates: Iterable[str], n: int = 5) -> str | None:
    """A 'did you mean ...?' hint, or None when nothing is close."""
    matches = close_matches(word, candidates, n=n)
    if not matches:
        return None
    return "did you mean: " + ", ".join(matches) + "?"


#: The longest message or hint the CLI prints (a message must never flood a terminal).
MAX_MESSAGE = 500


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` as one line of at most ``limit`` characters: line breaks and runs of whitespace
    become one space, and a long text is cut with ``...`` (errors are one line on stderr)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."


def describe_exception(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, short: for errors that quote a library's exception
    (torch's C++ errors carry stack dumps and ``[enforce fail at ...]`` prefixes)."""
    text = safe_str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if first.startswith("[enforce fail at") and "] " in first:
        first = first.split("] ", 1)[1].removeprefix("err == 0. ")
    return one_line(f"{type(exc).__name__}: {first}" if first else type(exc).__name__, limit)
