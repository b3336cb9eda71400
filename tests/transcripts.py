"""Console transcripts: run the ``$ hookcli ...`` commands shown in the docs and in golden files.

A transcript is a list of commands, each a line ``$ hookcli ARGS`` followed by the output it prints.
README.md and docs/*.md hold them in fenced ``console`` blocks; tests/golden/*.txt are bare
transcripts. ``tests/test_docs.py`` runs every command in-process through Click's CliRunner and
compares (or, with ``pytest --update-docs``, rewrites) the output shown, like cog.

What a command may be, shell-compatibly, so a reader can paste it:

    $ hookcli ARGS                     output as on a terminal: stdout and stderr interleaved
    $ hookcli ARGS | head -n N         stderr, then the first N lines of stdout; also tail -n N
    $ hookcli ARGS; echo $?            the output, then the exit code on a line of its own

Every run is made the same: width 100 (``COLUMNS``), no colour, no GitHub or debug environment, torch
on one thread (``one_thread``), in a sandbox folder (``Sandbox``) where the paths the docs use
(``configs/``, ``docs/images/``, ``tests/``) exist and files the commands write do not touch the
repository. The one place where output is normalised is ``normalise``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 100
PROMPT = "$ "
ENV: dict[str, str | None] = {
    "COLUMNS": str(WIDTH),
    "NO_COLOR": "1",
    "HOOKCLI_DEBUG": None,
    "GITHUB_ACTIONS": None,
    "GITHUB_STEP_SUMMARY": None,
}
"""The environment of every documented run (None: unset)."""


# --------------------------------------------------------------------------- markdown fences

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)(?P<info>.*)$")


@dataclass
class Fence:
    """A fenced code block: ``lines[start:end]`` of its file are the body (the fences excluded)."""

    lang: str
    indent: str
    start: int
    end: int
    body: list[str]  # with the block's indentation removed
    info: str = ""  # the rest of the opening fence's line: ``rel=0.1`` (``tolerance``)

    @property
    def tolerance(self) -> Tolerance:
        """The tolerance a console block declares (``rel=0.1 abs=1e-6``), else none."""
        return tolerance(self.info)

    @property
    def line_no(self) -> int:
        """1-based line number of the opening fence, for messages."""
        return self.start


def fences(lines: list[str]) -> list[Fence]:
    """Every fenced code block of a markdown file (given as lines without newlines)."""
    found: list[Fence] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, mark, lang = m["indent"], m["fence"], m["lang"]
        j = i + 1
        while j < len(lines) and not _closes(lines[j], mark):
            j += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:j]]
        found.append(Fence(lang=lang, indent=indent, start=i + 1, end=j, body=body, info=m["info"].strip()))
        i = j + 1
    return found


@dataclass(frozen=True)
class Tolerance:
    """How far a console block's printed decimals may be from the text shown, beyond one unit in their
    last digit: ``rel`` of the larger of the two, or ``abs`` (``rel=0.1 abs=1e-6`` on the fence line)."""

    rel: float = 0.0
    abs: float = 0.0


#: No tolerance beyond one unit in the last printed digit: every block but a training run's.
EXACT = Tolerance()


def tolerance(info: str) -> Tolerance:
    """The tolerance of a console block's numbers, from its fence's info: ``rel=0.1 abs=1e-6``.

    Only a block of a training run declares one: its numbers went through many steps of kernels that
    round differently on another CPU (its vector width, its thread count), which the steps amplify;
    ``abs`` covers a value that is rounding noise far below its limit (a check's grad_accumulation).
    Its integers (steps, counts, shapes) and words still compare exactly. Every other block, and every
    golden file, allows one unit in the last printed digit only."""
    found: dict[str, float] = {}
    for word in info.split():
        key, _, value = word.partition("=")
        if key not in ("rel", "abs") or not value:
            raise ValueError(f"unknown console block option {word!r} (there are: rel=FRACTION, abs=NUMBER)")
        found[key] = float(value)
    if not 0 <= found.get("rel", 0) < 1 or found.get("abs", 0) < 0:
        raise ValueError(f"a console block's tolerance must be rel in [0, 1) and abs >= 0: {info!r}")
    return Tolerance(**found)


def _closes(line: str, mark: str) -> bool:
    text = line.strip()
    return text.startswith(mark) and set(text) == {mark[0]}


# --------------------------------------------------------------------------- transcripts


@dataclass
class Command:
    """One ``$ ...`` line and the output shown under it."""

    line: str  # without the prompt
    expected: list[str] = field(default_factory=list)


def parse_transcript(body: list[str]) -> tuple[list[str], list[Command]]:
    """Split a transcript into its leading comment lines and its commands."""
    head: list[str] = []
    commands: list[Command] = []
    for line in body:
        if line.startswith(PROMPT):
            commands.append(Command(line[len(PROMPT):].strip()))
        elif commands:
            commands[-1].expected.append(line)
        else:
            head.append(line)
    for command in commands:
        command.expected = _trim(command.expected)
    return head, commands


def format_transcript(head: list[str], commands: list[Command], outputs: list[list[str]]) -> list[str]:
    """The transcript's lines: each command, its output, a blank line between commands."""
    lines = list(head)
    for k, (command, output) in enumerate(zip(commands, outputs)):
        if k:
            lines.append("")
        lines.append(PROMPT + command.line)
        lines.extend(output)
    return lines


def _trim(lines: list[str]) -> list[str]:
    lines = [line.rstrip() for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@dataclass
class Pipeline:
    """A documented command line: hookcli's arguments and what the shell does with its output."""

    args: list[str]
    head: int | None = None
    tail: int | None = None
    echo_status: bool = False


def parse_command(line: str) -> Pipeline:
    """Parse ``hookcli ARGS [| head -n N] [| tail -n N] [; echo $?]``; anything else is an error."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="|;")
    lexer.whitespace_split = True
    tokens = list(lexer)
    if not tokens or tokens[0] != "hookcli":
        raise ValueError(f"a documented command must start with 'hookcli': {line!r}")
    stages: list[list[str]] = [[]]
    seps: list[str] = []
    for tok in tokens[1:]:
        if tok in ("|", ";"):
            seps.append(tok)
            stages.append([])
        else:
            stages[-1].append(tok)
    pipe = Pipeline(args=stages[0])
    for sep, stage in zip(seps, stages[1:]):
        if sep == ";" and stage == ["echo", "$?"]:
            pipe.echo_status = True
        elif sep == "|" and len(stage) == 3 and stage[0] in ("head", "tail") and stage[1] == "-n" \
                and stage[2].isdigit():
            setattr(pipe, stage[0], int(stage[2]))
        else:
            raise ValueError(f"unsupported shell in a documented command: {' '.join(stage)!r} in {line!r}")
    return pipe


# --------------------------------------------------------------------------- running


class Sandbox:
    """A working folder that looks like the repository root to the documented commands.

    ``configs/`` and ``docs/images/`` are copies (a command may write there, e.g. fmaps' PNG, without
    touching the repository); ``tests/`` is a link (the tiny models are imported from it).
    """

    COPIED = ("configs", "docs/images")
    LINKED = ("tests",)

    def __init__(self, path: Path) -> None:
        self.path = path
        for rel in self.COPIED:
            shutil.copytree(ROOT / rel, path / rel)
        for rel in self.LINKED:
            (path / rel).symlink_to(ROOT / rel, target_is_directory=True)

    @contextlib.contextmanager
    def cwd(self) -> Iterator[Path]:
        """Run inside the sandbox; the previous working directory comes back afterwards."""
        before = os.getcwd()
        os.chdir(self.path)
        try:
            yield self.path
        finally:
            os.chdir(before)

    def changed_files(self, under: str = "docs/images") -> list[str]:
        """Files under ``under`` that the commands wrote and that differ from the repository's."""
        changed = []
        for path in sorted((self.path / under).rglob("*")):
            rel = path.relative_to(self.path)
            if path.is_file() and (not (ROOT / rel).exists() or (ROOT / rel).read_bytes() != path.read_bytes()):
                changed.append(str(rel))
        return changed


#: Runs the documented commands on this many torch threads instead of one: a check that the docs' outputs
#: do not depend on the machine (``HOOKCLI_DOCS_THREADS=2 python -m pytest tests/test_docs.py``).
THREADS_ENV = "HOOKCLI_DOCS_THREADS"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one CPU thread: the docs' numbers then do not depend on the machine's core count
    (parallel reductions may round differently), and the runs are fast on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def normalise(text: str, sandbox: Path) -> str:
    """The ONE place where output is made reproducible: the sandbox's absolute path reads as the
    repository root (a relative path), and trailing spaces go. Nothing else is rewritten."""
    for prefix in {str(sandbox), os.path.realpath(sandbox)}:
        text = text.replace(prefix + os.sep, "").replace(prefix, ".")
    return "\n".join(line.rstrip() for line in text.splitlines())


# --------------------------------------------------------------------------- comparing

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])", re.IGNORECASE)


def _last_digit_unit(token: str) -> Decimal:
    """One unit in the last digit a number is printed with: ``0.008655`` -> 1e-6, ``4.2e-05`` -> 1e-6."""
    exponent = Decimal(token).as_tuple().exponent
    return Decimal(1).scaleb(int(exponent)) if isinstance(exponent, int) else Decimal(0)


def _numbers_agree(shown: str, actual: str, within: Tolerance = EXACT) -> bool:
    """Integers (shapes, counts) exactly; a decimal within one unit of the finer of the two last digits
    (0.009999 and 0.01 agree, 0.01 and 0.019 do not), or within the block's ``Tolerance``."""
    if shown == actual:
        return True
    if not any(c in shown + actual for c in ".eE"):
        return False
    try:
        a, b = Decimal(shown), Decimal(actual)
        unit = min(_last_digit_unit(shown), _last_digit_unit(actual))
        return abs(a - b) <= max(unit, Decimal(str(within.rel)) * max(abs(a), abs(b)), Decimal(str(within.abs)))
    except InvalidOperation:
        return False


def same_output(shown: list[str], actual: list[str], within: Tolerance = EXACT) -> bool:
    """Whether a command printed what the docs show: the same text, where each printed decimal number
    may differ from the one shown by one unit in its last digit (and column padding change with it).

    Floating-point kernels round differently between torch releases (a bfloat16 matmul gave
    0.008655 in one and 0.008656 in the next), and the docs must pass with whatever torch the
    install brings. The numbers themselves are checked against float64 torch by the other tests;
    transcripts pin the words, the layout and the values to their printed precision. ``within``: a
    training run's block's tolerance (``tolerance``)."""
    if shown == actual:
        return True
    if len(shown) != len(actual):
        return False
    for a, b in zip(shown, actual):
        if a == b:
            continue
        text_a, text_b = NUMBER.split(a), NUMBER.split(b)
        nums_a, nums_b = NUMBER.findall(a), NUMBER.findall(b)
        if len(nums_a) != len(nums_b) or [" ".join(t.split()) for t in text_a] != [" ".join(t.split()) for t in text_b]:
            return False
        if not all(_numbers_agree(x, y, within) for x, y in zip(nums_a, nums_b)):
            return False
    return True


def run(line: str, sandbox: Path) -> list[str]:
    """Run one documented command in-process, as a terminal of WIDTH columns would show it."""
    from click.testing import CliRunner

    from hookcli.cli import main

    pipe = parse_command(line)
    result = CliRunner().invoke(main, pipe.args, env=ENV, catch_exceptions=False, prog_name="hookcli")
    if pipe.head is None and pipe.tail is None:
        text = result.output  # stdout and stderr, interleaved as written
    else:
        out = result.stdout.splitlines()
        out = out[: pipe.head] if pipe.head is not None else out
        out = out[-pipe.tail:] if pipe.tail is not None else out
        text = result.stderr + "\n".join(out)  # a pipe's reader prints after the writer's stderr
    lines = _trim(normalise(text, sandbox).splitlines())
    if pipe.echo_status:
        lines.append(str(result.exit_code))
    return lines
