"""The command line: one API call per command, rendering, and errors mapped to exit codes at the edge.

Option bundles and config defaults live in ``hookcli.cli.options``. No torch at import time
(``hookcli --help`` stays fast): commands import the API inside their bodies.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import click

from hookcli import api
from hookcli._version import __version__
from hookcli.errors import (
    EXIT_FAILED, EXIT_INTERNAL, INTERNAL_HINT, INTERRUPTS, CheckFailedError, DataError, HookcliError, ModelRaisedError,
    OutputError, RanksFailed, Terminated, UsageError, exit_status, one_line, safe_str,
)

from hookcli.records import WATCH_STAT_KEYS
from hookcli.options import (
    DEFAULT_MODEL, LISTED_SOURCES, GradSort, model_sources_text, torchrun_env, torchrun_rank, values_of,
)
from hookcli.cli.options import (
    META_COMMAND,
    META_CONFIG,
    META_DEBUG,
    META_OUTPUT,
    HookcliCommand,
    WatchCommand,
    check_options,
    data_options,
    diff_options,
    file_output_options,
    fmap_options,
    grad_options,
    input_options,
    loss_options,
    model_options,
    model_run_options,
    output_options,
    prepare_output,
    run_options,
    run_fields,
    shard_options,
    watch_options,
)

#: The exit code of a run stopped by SIGTERM: 128 + the signal number, as shells report it
#: (SIGINT: 130, from ``HookcliGroup.invoke``).
EXIT_SIGTERM = 128 + signal.SIGTERM

#: The exit code when the reader of stdout went away (``hookcli ... | head -1``): 128 + SIGPIPE, what a
#: shell reports for a Unix tool that SIGPIPE ended; quiet, as ``head`` users expect.
EXIT_SIGPIPE = 128 + 13


class ReaderGone(Exception):
    """The reader of stdout or stderr is gone (EPIPE): the run ends quietly with :data:`EXIT_SIGPIPE`
    (not click's own EPIPE handling, which exits 1: a code that reads as "the model failed")."""


def _stdout_failure(exc: OSError) -> Exception:
    """What a failed write to stdout means: the reader left (EPIPE, EBADF, EINVAL of a closed
    descriptor: quiet end), or the device cannot take it (a full disk: exit 2 with a message)."""
    if exc.errno in (errno.EPIPE, errno.EBADF, errno.EINVAL) or isinstance(exc, BrokenPipeError):
        return ReaderGone()
    detail = exc.strerror or safe_str(exc)
    return OutputError(f"cannot write the report to stdout: {detail}",
                       hint="free space on the device stdout goes to, or write the report with -o FILE elsewhere")


def _write_stdout(text: str) -> None:
    """The report to stdout, flushed here so that a full device or a gone reader is seen now."""
    if sys.stdout is None:  # started with stdout closed (>&-): nowhere to write the report
        raise OutputError("stdout is closed: the report has nowhere to go",
                          hint="run without closing stdout (>&-), or write the report with -o FILE")
    try:  # sys.stdout itself, not click's strict re-wrapping of it: its errors="backslashreplace" holds
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except OSError as exc:
        raise _stdout_failure(exc) from exc


def _quiet_streams() -> None:
    """Point stdout and stderr at /dev/null so that the interpreter's last flush cannot fail again
    (Python's documented SIGPIPE recipe, docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass


def _tolerant_streams() -> None:
    """stdout and stderr never fail on a character their encoding lacks (``PYTHONIOENCODING=ascii``,
    a latin-1 terminal): it is written as a backslash escape instead of raising UnicodeEncodeError.

    A standard descriptor the shell closed (``>&-``, ``2>&-``) is held open on /dev/null first, so
    that no file hookcli opens can take its number (and receive stray prints); a closed stderr
    leaves the diagnostics nowhere (the exit code still tells), a closed stdout refuses the report
    (``_write_stdout``)."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")  # EBADF: closed, or a file the interpreter's start-up opened read-only there
        except OSError as exc:
            if exc.errno != errno.EBADF:
                continue  # a full device (/dev/full) is open: the write of the report says so
            devnull = os.open(os.devnull, os.O_WRONLY)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            if fd == 1:
                sys.stdout = None  # type: ignore[assignment] - the report is refused, not lost silently
            else:
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - /dev/null, for the process's life
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", "strict") == "strict":
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


#: Whether the command line is running in this process now: hookcli's own entry point called again
#: from code it runs (MODEL hookcli.cli.main:main, a model's forward) is refused, not recursed into.
_cli_running = False


def _raise_terminated(signum: int, _frame: Any) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    """While the CLI runs, SIGTERM raises :class:`Terminated` (where SIGTERM has its default action,
    in the main thread); the previous handler is put back afterwards."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
class OneLineUsageError(click.UsageError):
    """Click's own usage errors (a bad --fill choice, --seed -1, an unknown option) in hookcli's
    format: one ``Error:`` line and one ``  hint:`` line, not Click's usage block."""

    def __init__(self, exc: click.UsageError) -> None:
        super().__init__(exc.format_message(), exc.ctx)
        self.exit_code = exc.exit_code

    def show(self, file: Any = None) -> None:
        if torchrun_rank() != 0:  # under torchrun every rank parsed the same line: rank 0 says it
            return
        command = self.ctx.command_path if self.ctx is not None else "hookcli"
        click.echo(f"Error: {one_line(self.format_message())}", err=True)
        click.echo(f"  hint: run '{command} --help' for the options and their values", err=True)


class HookcliGroup(click.Group):
    """Translate HookcliError into a message and exit code, in one place.

    Anything else is hookcli's own bug (exit 3, "internal error"), never the model's: the model's
    failures reach here as ModelRaisedError. A ``sys.exit`` from code hookcli ran for the model that
    no run caught is said as such (exit 1), never a silent end.
    """

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """The entry point: as click's, with SIGTERM turned into :class:`Terminated` (exit 143), a
        gone reader of stdout or stderr ending the run quietly (exit 141), and re-entry refused."""
        global _cli_running
        if _cli_running:
            raise UsageError("hookcli's command line was called again from code it is running (a MODEL such "
                             "as hookcli.cli.main:main, or a model that runs hookcli)",
                             hint="a MODEL names your nn.Module class or factory; from Python, call the "
                                  "hookcli API (hookcli.stats(model)) instead of its command line")
        _cli_running = True
        _tolerant_streams()
        try:
            with _sigterm_as_exception():
                return super().main(*args, **kwargs)
        except SystemExit as exc:
            own_process = (args[0] if args else kwargs.get("args")) is None  # its command line: sys.argv
            if _group_used and own_process and kwargs.get("standalone_mode", True) is not False:
                _end_rank(exc.code)
            raise
        except Terminated:
            if kwargs.get("standalone_mode", True) is False:
                raise
            click.echo("terminated (SIGTERM)", err=True)
            sys.exit(EXIT_SIGTERM)
        except (ReaderGone, BrokenPipeError):  # the reader of stdout or of stderr left (also of an error's lines)
            if kwargs.get("standalone_mode", True) is False:
                raise
            _quiet_streams()
            sys.exit(EXIT_SIGPIPE)
        finally:
            _cli_running = False

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            _refuse_nul(args)
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise OneLineUsageError(exc) from exc
        except BrokenPipeError as exc:  # --help or --version written to a reader that left
            raise ReaderGone() from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return self._invoke_reporting(ctx)
        except BrokenPipeError as exc:  # writing a report or a message: the reader left
            raise ReaderGone() from exc
        finally:
            group = ctx.meta.pop(META_GROUP, None)
            if group is not None:  # torchrun's process group of this command (``_start``), also on errors
                group.close()

    def _invoke_reporting(self, ctx: click.Context) -> Any:
        """The command, its errors turned into a message and an exit code."""
        try:
            result = super().invoke(ctx)
            code, _ = _agree(ctx, 0, own=False)  # under torchrun: did another rank fail?
            if code:
                ctx.exit(code)
            return result
        except click.UsageError as exc:
            if isinstance(exc, OneLineUsageError):
                raise
            raise OneLineUsageError(exc) from exc
        except HookcliError as exc:
            code, rank0_own = _agree(ctx, exc.exit_code, own=not isinstance(exc, RanksFailed), failure=exc)
            if _says(ctx, exc, rank0_own):
                _report_error(ctx, exc)
            ctx.exit(code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, ReaderGone, BrokenPipeError,
                *INTERRUPTS):
            raise
        except SystemExit as exc:  # the model's code (or code it ran) called sys.exit outside a run
            _report_error(ctx, ModelRaisedError(f"the model exited with {exit_status(exc.code)} (it called sys.exit)",
                                                hint="the model's code ended the process; remove the sys.exit call"))
            ctx.exit(EXIT_FAILED)
        except Exception as exc:  # a bug in hookcli: say so, exit 3
            code, rank0_own = _agree(ctx, EXIT_INTERNAL, own=True, failure=exc)
            if ctx.meta.get(META_DEBUG):
                raise
            if not _says(ctx, None, rank0_own):
                ctx.exit(code)
            from hookcli.escape import escape_control

            click.echo(one_line(f"Error: internal error: {type(exc).__name__}: {escape_control(safe_str(exc))}"),
                       err=True)
            click.echo(f"  hint: {INTERNAL_HINT}", err=True)
            ctx.exit(code)
        except BaseException as exc:  # a BaseException subclass of the model's own code (hookcli raises none)
            if ctx.meta.get(META_DEBUG):
                raise
            _report_error(ctx, ModelRaisedError(
                f"the model's code raised {type(exc).__name__} (a BaseException): {safe_str(exc)}",
                hint="the model's code raised outside any run; run again with --debug for its traceback"))
            ctx.exit(EXIT_FAILED)


def _refuse_nul(args: list[str]) -> None:
    """A command-line argument holding a NUL byte (no OS passes one, a caller of ``main(args)`` can) is a
    usage error: every path option would fail on it deep in a run."""
    for arg in args:
        if isinstance(arg, str) and "\0" in arg:
            raise click.BadArgumentUsage(f"argument {arg!r} holds a NUL byte (\\x00), which no option value or file name "
                                   "can hold")


#: ``ctx.meta`` key of the root context: the ExitStack holding torchrun's process group (``_start``).
META_GROUP = "hookcli.group"
#: Whether this process opened torchrun's process group for its command (``_start``).
_group_used = False


def _end_rank(code: object) -> None:
    """End a torchrun rank whose command is done (its output written and flushed, its process group
    destroyed) without the interpreter's teardown: after a tensor-parallel backward, torch's gloo
    threads can abort that teardown (``terminate called without an active exception``, exit -6: one
    ``grads --shard tp`` run in four on torch 2.14), which torchrun would report as a failed rank."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else EXIT_FAILED))


def _agree(ctx: click.Context, code: int, *, own: bool, failure: BaseException | None = None) -> tuple[int, bool]:
    """Under a process group this command opened: the exit code of every rank (``api.agree_exit``; a
    ``failure`` before the run started is voted first, where the other ranks wait) and whether rank 0
    failed with its own error; else ``code`` as it is."""
    if ctx.find_root().meta.get(META_GROUP) is None:
        return code, own and torchrun_rank() == 0
    return api.agree_exit(code, own, failure)


def _says(ctx: click.Context, exc: HookcliError | None, rank0_own: bool) -> bool:
    """Whether this rank prints its error: rank 0 always; another rank only its own error (not the echo
    ``RanksFailed``), and only when rank 0 had none of its own (before the process group is up, or in a
    command without one, every rank met the same error on the same command line: rank 0 says it)."""
    if torchrun_rank() == 0:
        return True
    grouped = ctx.find_root().meta.get(META_GROUP) is not None
    return grouped and not isinstance(exc, RanksFailed) and not rank0_own


def _report_error(ctx: click.Context, exc: HookcliError) -> None:
    output = ctx.meta.get(META_OUTPUT)
    if isinstance(exc, (ModelRaisedError, DataError)) and exc.report is not None and output is not None:
        _emit_partial(exc.report, **output)  # every row gathered before the failure, marked partial
    if ctx.meta.get(META_DEBUG):
        cause = exc.__cause__ or exc
        click.echo("".join(traceback.format_exception(cause)), err=True, nl=False)
    from hookcli.escape import escape_control  # names and messages from the model are data

    where = f"rank {torchrun_rank()}: " if torchrun_env() else ""  # torchrun interleaves the ranks' stderr
    click.secho(f"Error: {where}{one_line(escape_control(exc.message))}", err=True, fg="red")
    if exc.hint:
        click.echo(f"  hint: {one_line(escape_control(exc.hint))}", err=True)


def _emit_partial(report: Any, *, fmt: str, output: str | None) -> None:
    """The partial report of a failed run goes to stdout; an ``-o`` FILE is never replaced by it (under
    torchrun only rank 0's).

    A failed run must not destroy a good report from an earlier run, and a partial report in FILE
    could pass for a complete one; stderr says the file was left as it was. A FIFO or device
    (``-o /dev/stdout``, a named pipe a reader waits on) has nothing to lose: it gets the partial
    report, marked partial, where the user sent the output.
    """
    if torchrun_rank() != 0:
        return
    if output is not None and _streams_in_place(output):
        _emit(report, fmt=fmt, output=output)
        click.echo(f"the run failed: {output} got its partial report", err=True)
        return
    _emit(report, fmt=fmt, output=None)
    if output is not None:
        state = "left unchanged" if os.path.lexists(output) else "not written"
        click.echo(f"{output} {state}: the run failed, so its partial report went to stdout", err=True)


def _streams_in_place(output: str) -> bool:
    from hookcli.errors import OutputError
    from hookcli.output import resolve_target

    try:
        return resolve_target(output).in_place
    except OutputError:
        return False


def _emit(report: Any, *, fmt: str, output: str | None) -> None:
    """Render a report and write it to stdout or to a file (see hookcli.output for how); under
    torchrun only rank 0 writes it (every rank has the same report)."""
    if torchrun_rank() != 0:
        return
    from hookcli.render import render

    to_terminal = output is None and sys.stdout is not None and sys.stdout.isatty()
    color = fmt == "table" and to_terminal and "NO_COLOR" not in os.environ
    text = render(report, fmt, width=_width(to_terminal), color=color)
    if output is None:
        _write_stdout(text)
    else:
        from hookcli.output import write_atomic

        path = write_atomic(output, text)
        click.echo(f"wrote {path}", err=True)


def _width(to_terminal: bool) -> int:
    from hookcli.cli.options import META_WIDTH

    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().meta.get(META_WIDTH):
        return int(ctx.find_root().meta[META_WIDTH])
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    return shutil.get_terminal_size((160, 24)).columns if to_terminal else 160


#: Commands that refuse to run under torchrun: one process's run, with files every rank would write.
_ONE_PROCESS = {"diff", "features", "fmaps"}
#: Commands that run on every rank under torchrun, their numbers merged over the ranks (the others run
#: the same on every rank, without a process group; rank 0 prints).
_RANKED = {"stats", "grads", "check"}


def _start(values: dict[str, Any]) -> tuple[click.Context, dict[str, Any]]:
    ctx = click.get_current_context()
    prepare_output(ctx, values)
    if torchrun_env():
        name = ctx.command.name
        if name in _ONE_PROCESS:
            raise UsageError(f"hookcli {name} does not run under torchrun (it is one process's run)",
                             hint=f"run hookcli {name} without torchrun; stats, grads and check run on every rank")
        if name in _RANKED:  # one process group for the command, closed by HookcliGroup.invoke
            global _group_used
            _group_used = True
            group = contextlib.ExitStack()
            ctx.find_root().meta[META_GROUP] = group
            group.enter_context(api.torchrun_group(values.get("device")))
    from hookcli import progress

    progress.enable()  # spinners on stderr for slow phases, only on a terminal
    return ctx, values


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--version``: the version and whether the optional C statistics kernel is usable.

    The kernel is inspected only here (importing it loads an OpenMP runtime, which a real run must
    leave to torch to load first).
    """
    if not value or ctx.resilient_parsing:
        return
    click.echo(f"hookcli {__version__} (C statistics kernel: {api.kernel_status()})")
    ctx.exit()


@click.group(cls=HookcliGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", "-V", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and whether the C statistics kernel is built, and exit.")
def main() -> None:
    """Inspect PyTorch models from the command line: per-layer shapes, activation statistics and
    gradients through hooks, as tables (or JSON, CSV, Markdown).

    MODEL is {sources}; without it: --config FILE, then [tool.hookcli] in ./pyproject.toml, then {default}.

    \b
    Exit codes: 0 ok, 1 the model raised or exited (or a check failed), 2 bad usage or input or
    something hookcli does not support, 3 a bug in hookcli.
    """


main.help = (main.help or "").format(sources=model_sources_text(), default=DEFAULT_MODEL)


main.command_class = HookcliCommand


@main.command()
@model_run_options
@click.option("--flops", is_flag=True, help="Forward FLOPs per call and in total (torch.utils.flop_counter).")
@output_options
def shapes(**values: Any) -> None:
    """Input and output shapes, dtypes and parameters of each selected module call.

    Without --device, --input or --weights the model is built and run on the meta device: no memory
    for weights or activations, so models of any size work (a real run is the fallback).
    """
    ctx, values = _start(values)
    _emit(api.shapes(**run_fields(ctx, values)), fmt=values["format"], output=values["output"])


@main.command()
@model_run_options
@data_options
@shard_options
@output_options
def stats(**values: Any) -> None:
    """Activation statistics of each selected module call: mean, std, min, max, norm, zeros, NaN/Inf."""
    ctx, values = _start(values)
    _emit(api.stats(**run_fields(ctx, values)), fmt=values["format"], output=values["output"])


@main.command()
@model_run_options
@data_options
@shard_options
@grad_options
@click.option("--flops", is_flag=True, help="Forward FLOPs per call, and forward/backward totals.")
@click.option("--sort", type=click.Choice(values_of(GradSort)),
              help="Order layer and parameter rows: gradient norm or largest |gradient| (descending), or name "
                   "(numbers by value: blocks.9 before blocks.10).")
@click.option("--top", type=click.IntRange(min=1), metavar="N",
              help="Show only the first N layer rows and parameters (by gradient norm unless --sort).")
@output_options
def grads(**values: Any) -> None:
    """Gradients of the loss with respect to each selected output, and per-parameter gradients."""
    ctx, values = _start(values)
    _emit(api.grads(top=values["top"], sort=values["sort"], **run_fields(ctx, values)), fmt=values["format"],
          output=values["output"])


@main.command()
@model_run_options
@data_options
@shard_options
@grad_options
@check_options
@output_options
def check(**values: Any) -> None:
    """The CI gate: forward and backward once, then the [checks] rules; exit 1 when an error rule fails.

    \b
    Rules (docs/check.md) and thresholds come from [checks] in --config FILE or [tool.hookcli.checks]
    in ./pyproject.toml; --steps N adds the training rules. Every module is hooked and every parameter checked unless --layers, --types,
    --depth or --params narrow it; the model runs in train mode (as in training) unless --eval.
    """
    ctx, values = _start(values)
    from hookcli.cli.ci import publish
    from hookcli.output import ensure_writable

    rules = api.check_rules(ctx.meta[META_CONFIG], baseline=values["baseline"])
    if values["junit"]:
        ensure_writable(values["junit"])
    result = api.run_check(rules, steps=values["steps"], **run_fields(ctx, values))
    _emit(result, fmt=values["format"], output=values["output"])
    if torchrun_rank() == 0:  # under torchrun: rank 0 writes the CI outputs
        publish(result, junit=values["junit"], github=values["github"])
    if not result.ok:
        raise CheckFailedError(result.headline(), result=result) from result.cause


@main.command()
@model_run_options
@diff_options
@loss_options
@output_options
def diff(**values: Any) -> None:
    """Run MODEL twice, A as given and B with the --vs-* changes, on the same input; compare each
    selected output (and the model's output) call by call and name the first layer that diverges.

    \b
    Exit 0 when the model's final outputs agree within tolerance, 1 when they do not.
    """
    ctx, values = _start(values)
    vs = {k: values[k] for k in ("vs_weights", "vs_dtype", "vs_device", "vs_model", "vs_compile", "rtol", "atol",
                                 "grads")}
    report = api.diff(**vs, **run_fields(ctx, values))
    _emit(report, fmt=values["format"], output=values["output"])
    if not report.ok:
        raise CheckFailedError(f"diff: {report.headline()}",
                               hint="see the first divergence above; --rtol/--atol set the tolerance")


def _command_defaults(command: click.Command, defaults: dict[str, tuple[Any, str]]) -> None:
    """Give one command its own defaults (and help) for options of a shared bundle; every command
    owns its Option objects, so the other commands keep theirs."""
    for param in command.params:
        if param.name in defaults and isinstance(param, click.Option):
            param.default, param.help = defaults[param.name]


# The gate sees every parameter, and the model as its first training step sees it (BatchNorm batch
# statistics); a config's ``mode`` and the command line still win.
_command_defaults(check, {
    "params": ("all", "Parameters the rules check: all, of the selected modules, or none."),
    "train": (True, "Run in training (default for check) or eval mode."),
})


#: The options ``watch -- CMD`` takes; the others are for ``watch MODEL --steps N`` (the script builds its own).
_SCRIPT_OPTIONS = {"every", "out", "flight", "layers", "types", "config_path"}
#: ``watch -- CMD``'s default ``--every``: a logged step costs a few times a bare one (docs/watch.md#costs)
SCRIPT_EVERY = 10


@main.command(cls=WatchCommand)
@model_options
@input_options
@run_options
@data_options
@loss_options
@watch_options
@output_options
def watch(**values: Any) -> None:
    """Watch a training run: per-layer activation and gradient statistics, parameter norms and
    updates, one JSON line every --every steps to --out, and the rules' findings (docs/watch.md).

    \b
    hookcli watch [OPTIONS] -- python train.py ARGS  your script, unchanged, run in this process;
                                                     its exit code is passed through
    hookcli watch MODEL --steps N [--lr X]           hookcli's own short loop on MODEL's input;
                                                     exit 1 when an error finding (NaN/Inf) occurred

    \b
    Findings go to stderr as they occur (-- CMD) or to a table (MODEL). [watch] in the config sets
    every, out, layers, types and [watch.rules.<rule>] thresholds.
    """
    ctx, values = _start(values)
    from hookcli.escape import escape_control
    from hookcli.render.watch import finding_line, summary_line

    rules = api.watch_rules(ctx.meta.get(META_CONFIG))
    command = ctx.meta.get(META_COMMAND)
    layers, types = list(values["layers"]) or None, list(values["types"]) or None
    if command is None:
        if values["model"] is None:
            raise UsageError("watch needs -- CMD (your training script) or MODEL --steps N",
                             hint="hookcli watch --every 50 --out runs/exp.jsonl -- python train.py, or "
                                  "hookcli watch resnet18 --steps 20")
        if values["steps"] is None:
            raise UsageError("watch MODEL needs --steps N: how many training steps hookcli runs",
                             hint=f"e.g. hookcli watch {values['model'] or 'MODEL'} --steps 20")
        run = api.watch_model(steps=values["steps"], lr=values["lr"], optimizer=values["optimizer"],
                              every=values["every"] or 1, out=values["out"], rules=rules, flight=values["flight"],
                              **run_fields(ctx, values))
        _emit(run, fmt=values["format"], output=values["output"])
        if run.errors:
            raise CheckFailedError(f"watch: {finding_line(run.errors[0])}",
                                   hint="the log's lines say more; [watch.rules.<rule>] in the config sets the "
                                        "thresholds")
        return
    for param in ctx.command.params:
        if param.name not in _SCRIPT_OPTIONS and ctx.get_parameter_source(param.name) == \
                click.core.ParameterSource.COMMANDLINE and param.expose_value:
            flag = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
            raise UsageError(f"watch -- CMD does not take {flag}: it is for watch MODEL --steps N (the script "
                             "builds its own model, data and optimizer)",
                             hint="with -- CMD: --every, --out, --flight, --layers, --types and --config")

    def say(text: str) -> None:
        if torchrun_rank() == 0:  # under torchrun the findings are every rank's (global numbers): rank 0 says them
            click.echo(f"hookcli watch: {escape_control(text)}", err=True)

    run = api.watch_script(command, every=values["every"] or SCRIPT_EVERY, out=values["out"], layers=layers,
                           types=types, flight=values["flight"], rules=rules, on_found=lambda finding: say(finding_line(finding)), on_note=say)
    if run.traceback:
        click.echo(run.traceback, err=True, nl=False)
    say(summary_line(run))
    ctx.exit(run.exit_code or 0)


_command_defaults(watch, {"train": (True, "watch MODEL: run in training (default) or eval mode.")})


@main.command()
@model_options
@click.option("--depth", "-d", "tree_depth", type=click.IntRange(min=0), metavar="N",
              help="Only modules down to depth N (0: the model itself, 1: its children, ...).")
@output_options
def modules(**values: Any) -> None:
    """The model's module tree (names, types, parameters) to choose --layers from."""
    ctx, values = _start(values)
    tree = api.modules(depth=values["tree_depth"], **run_fields(ctx, values))
    _emit(tree, fmt=values["format"], output=values["output"])


@main.command()
@click.argument("pattern", required=False)
@click.option("--source", type=click.Choice(LISTED_SOURCES), default="torchvision", show_default=True,
              help="Whose names: torchvision's, timm's (timm:NAME) or transformers' model types (hf:TYPE).")
@output_options
def models(pattern: str | None, source: str, **values: Any) -> None:
    """Model names, optionally filtered by a glob such as 'resnet*' (torchvision's unless --source)."""
    ctx = click.get_current_context()
    prepare_output(ctx, values)
    _emit(api.models(pattern, source), fmt=values["format"], output=values["output"])


@main.command()
@model_run_options
@file_output_options("File to save the tensors to: .safetensors, .pt or .npz (by extension).")
def features(**values: Any) -> None:
    """Save the outputs of the selected modules (every call, every tensor) to a tensor file."""
    ctx, values = _start(values)
    _emit(api.features(output=values["save_to"], **run_fields(ctx, values)), fmt=values["format"], output=None)


@main.command()
@model_options
@input_options
@fmap_options
@click.option("--channel-dim", "channel_dim", type=click.Choice(["1", "3", "-1"]), metavar="1|3|-1",
              help="Where a 4-D output keeps its channels: 1 [B, C, H, W] or 3/-1 channels-last [B, H, W, C] "
              "(Swin); default: 1 unless dims 1 and 2 are equal and dim 3 is not.")
@run_options
@file_output_options("PNG file to draw the feature maps to.")
def fmaps(**values: Any) -> None:
    """Draw one module's output channels as a grid of feature maps (PNG)."""
    ctx, values = _start(values)
    channel_dim = int(values["channel_dim"]) if values["channel_dim"] is not None else None
    result = api.fmaps(layer=values["layer"], channels=values["channels"], sample=values["sample"],
                       call=values["call"], scale=values["scale"], channel_dim=channel_dim,
                       output=values["save_to"], **run_fields(ctx, values))
    _emit(result, fmt=values["format"], output=None)


@main.command()
@click.argument("log", type=click.Path(dir_okay=True))
@click.option("--stat", default="rms", show_default=True, metavar="NAME",
              help="The statistic shown: of each layer's output (" + ", ".join(WATCH_STAT_KEYS) + "), of its "
                   "gradient (grad.rms, grad.abs_max, ...), its dead_channels, or of each parameter (norm, update_norm, "
                   "update_ratio, param.grad.rms, ...).")
@click.option("--layers", "-l", "row_patterns", multiple=True, metavar="NAMES",
              help="Only these rows: names or globs, comma-separated ('blocks.*'); a parameter also matches by "
                   "its module's name.")
@click.option("--html", metavar="FILE", type=click.Path(dir_okay=False),
              help="Also write one self-contained HTML file (heatmap, curves, findings; no network) to FILE; "
                   "needs pip install 'hookcli[report]'.")
@output_options
def report(log: str, stat: str, row_patterns: tuple[str, ...], html: str | None, **values: Any) -> None:
    """Read a hookcli.watch log (JSON Lines; - reads it from stdin): a layer x step heatmap of one
    statistic, a sparkline per layer, the loss and the findings.

    \b
    Exit 1 when the log holds an error finding (NaN/Inf: a CI gate), 0 otherwise, 2 for a bad log.
    """
    ctx = click.get_current_context()
    prepare_output(ctx, values)
    if html is not None:
        from hookcli.output import ensure_writable
        from hookcli.render.report_html import check_matplotlib

        check_matplotlib()
        ensure_writable(html)
    result = api.report(log, stat=stat, layers=row_patterns or None)
    for note in result.notes if torchrun_rank() == 0 else ():
        click.echo(f"note: {note}", err=True)
    if html is not None:  # first: a reader of stdout that leaves early (| head -1) does not cost the page
        from hookcli.output import write_atomic
        from hookcli.render.report_html import render_html

        click.echo(f"wrote {write_atomic(html, render_html(result))}", err=True)
    _emit(result, fmt=values["format"], output=values["output"])
    if not result.ok:
        first = result.errors[0]
        raise CheckFailedError(f"report: {len(result.errors)} error finding(s) in {log}: step {first.step}: "
                               f"{first.message}", hint="the findings above say where; docs/watch.md#rules")


if __name__ == "__main__":  # pragma: no cover
    main()
