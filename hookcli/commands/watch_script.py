"""``hookcli watch -- CMD``: the user's training script, run unchanged in this process, watched.

The script runs as ``python SCRIPT`` or ``python -m MODULE`` would run it (``runpy``; ``sys.argv``,
``sys.path[0]`` and ``__main__`` set as python sets them, and put back after). Until its first
``optimizer.step()`` the engine's process-wide hooks (``ProcessHooks``) note the modules the script
calls from outside any module's forward (its roots); at that step the root holding most of that
optimizer's parameters becomes the model, and a ``hookcli.watch`` on (model, optimizer) starts inside
the step (it sees that step from its ``optimizer.step()`` on: norms and updates, no activations or
gradients) and runs to the script's end. docs/watch.md#from-the-command-line says what is seen.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import signal
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hookcli.commands.watch import Watch, check_arguments
from hookcli.commands.watch_rules import rule_settings
from hookcli.engine import distributed
from hookcli.engine.hooks import ProcessHooks
from hookcli.errors import INTERRUPTS, HookcliError, Terminated, UsageError, internal_error
from hookcli.options import torchrun_env, torchrun_rank
from hookcli.output import LineLog
from hookcli.records import Finding, WatchRun

#: ``python``, ``python3``, ``python3.11``: the interpreter named before the script (this one runs it).
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
#: The exit status of a script stopped by a signal (128 + its number, as shells give it), and its name.
_SIGNALLED = {128 + signal.SIGINT: "SIGINT", 128 + signal.SIGTERM: "SIGTERM"}
#: Where python's own modules and the installed packages are (a frame there is a library's).
_LIBRARY_DIRS = tuple(sorted({os.path.join(sysconfig.get_path(name), "") for name in ("stdlib", "purelib", "platlib")}))
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
COMMAND_HINT = "e.g. hookcli watch --every 50 -- python train.py --lr 3e-4 (or -- python -m pkg.train ...)"


@dataclass
class Script:
    """What ``watch -- CMD`` runs: a file (``path``) or a module (``module``), with its arguments."""

    path: str | None
    module: str | None
    args: list[str]


def parse_command(command: Sequence[str]) -> Script:
    """``python SCRIPT ARGS``, ``SCRIPT.py ARGS``, ``python -m MODULE ARGS`` or ``-m MODULE ARGS``;
    UsageError for anything else (no command, another program, python's own options, a missing file)."""
    argv = [str(a) for a in command]
    via_python = bool(argv) and (bool(_PYTHON.match(os.path.basename(argv[0]))) or argv[0] == sys.executable)
    if via_python:
        argv = argv[1:]
        if not argv:
            raise UsageError("watch -- python: no script or -m MODULE after python", hint=COMMAND_HINT)
    if not argv:
        raise UsageError("watch --: no command after --", hint=COMMAND_HINT)
    if argv[0] == "-m":
        if len(argv) < 2 or not argv[1] or argv[1].startswith("-"):
            raise UsageError("watch -- -m: no module name after -m", hint=COMMAND_HINT)
        return Script(None, argv[1], argv[2:])
    if argv[0].startswith("-"):
        raise UsageError(f"watch --: python's own option {argv[0]!r} is not taken (the script runs in hookcli's "
                         "process)", hint="set it in the environment (PYTHONWARNINGS=..., PYTHONUNBUFFERED=1), "
                         "or drop it; " + COMMAND_HINT)
    if not via_python and not argv[0].endswith(".py"):
        raise UsageError(f"watch -- runs a Python script in hookcli's own process, not {argv[0]!r}",
                         hint="torchrun, accelerate launch and shell commands are not supported; " + COMMAND_HINT)
    path = argv[0]
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise UsageError(f"watch --: the script {path} {what}", hint="give the path of your training script "
                         "(relative to the working directory); " + COMMAND_HINT)
    return Script(path, None, argv[1:])


class _Stop(BaseException):
    """hookcli's own error at the script's first step (a bad --layers for the model found): it unwinds
    the script (whose ``except Exception`` does not catch it) and is raised when the script is gone."""

    def __init__(self, error: HookcliError) -> None:
        super().__init__(error.message)
        self.error = error


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class ScriptWatch:
    """The optimizer step hooks of ``watch -- CMD``: find the model at the first ``optimizer.step()``,
    watch it from there with ``Watch``, and hand each new finding to ``on_found`` as its step's log
    line is written (the global post-step hook runs after the watch's own)."""

    def __init__(self, watch_args: dict[str, Any], on_found: Callable[[Finding], None],
                 on_note: Callable[[str], None]) -> None:
        self.watch_args, self.on_found, self.on_note = watch_args, on_found, on_note
        self.hooks = ProcessHooks(self.pre, self.post)
        self.watch: Watch | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.started = False
        self.steps = 0
        self.notes: list[str] = []
        self._others: set[int] = set()
        self._shown = self._notes_shown = 0
        #: what reporting a finding raised inside the step hook; raised when the script has ended
        self.error: Exception | None = None

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.on_note(text)

    def pre(self, optimizer: torch.optim.Optimizer) -> None:
        if self.started:
            if optimizer is not self.optimizer and id(optimizer) not in self._others and self.optimizer is not None:
                self._others.add(id(optimizer))
                self.note(f"another optimizer ({type(optimizer).__name__}) steps too; only the first "
                          f"({type(self.optimizer).__name__}) is watched")
            return
        self.started = True
        try:
            self._start(optimizer)
        except HookcliError as exc:
            raise _Stop(exc) from exc
        except Exception as exc:  # hookcli's own bug: stop the script rather than watch nothing silently
            raise _Stop(internal_error(exc, "hookcli watch's first optimizer step")) from exc

    def _start(self, optimizer: torch.optim.Optimizer) -> None:
        roots = list(self.hooks.roots.values())
        self.hooks.stop_roots()
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [(sum(p.numel() for p in m.parameters() if id(p) in held), -i, m) for i, m in enumerate(roots)]
        owners = [entry for entry in owners if entry[0] > 0]
        if not owners:
            self.notes.append(f"no module the script called holds the parameters of its {type(optimizer).__name__}")
            return
        owners.sort(key=lambda entry: entry[:2], reverse=True)
        model = owners[0][2]
        watch_args = self.watch_args
        if torchrun_env() and distributed.process_group() is None:
            # ranks that never made a process group are independent runs: one log written by all of them
            # would interleave their lines; rank 0's is its own run's
            if torchrun_rank() != 0:
                watch_args = {**watch_args, "out": None}
            elif watch_args.get("out") is not None:
                self.note("under torchrun with no process group at the first optimizer.step(): the log is "
                          "rank 0's own run (the other ranks' are not written)")
        watch = Watch(model, optimizer, **watch_args, on_finding="warn")
        self.watch = watch.__enter__()  # (kept only once its hooks are installed)
        self.model, self.optimizer = model, optimizer
        self.note(f"watching {type(model).__name__} ({_params(model):,} parameters) stepped by "
                  f"{type(optimizer).__name__}, from step 0's optimizer.step()")
        for _, _, other in owners[1:]:
            self.note(f"{type(other).__name__} also holds parameters of that optimizer; only "
                      f"{type(model).__name__}, which holds the most, is watched")

    def post(self, optimizer: torch.optim.Optimizer) -> None:
        if self.watch is None or optimizer is not self.optimizer:
            return
        self.steps += 1
        if self.error is None:
            try:
                self._report()
            except Exception as exc:  # writing a finding failed (stderr gone): never raised into optimizer.step()
                self.error = exc

    def _report(self) -> None:
        if self.watch is not None:
            notes = self.watch.notes[self._notes_shown:]
            self._notes_shown += len(notes)
            for text in notes:
                self.note(text)
            new = self.watch.findings[self._shown:]
            self._shown += len(new)
            for finding in new:
                self.on_found(finding)

    def close(self) -> None:
        """End the watch (its last line is written) and report what it found since."""
        if self.watch is not None:
            self.watch.__exit__(None, None, None)
            if self.error is not None:
                raise self.error
            self._report()


def _exit_code(exc: SystemExit) -> tuple[int, str | None]:
    """The process's exit status for ``sys.exit(code)`` as python gives it, and what it prints."""
    code = exc.code
    if code is None:
        return 0, None
    if isinstance(code, int):
        return code, None
    return 1, str(code)


def _script_traceback(exc: BaseException) -> str:
    """The traceback python would print for the script's uncaught exception: from the script's own
    frames on (hookcli's and runpy's frames above them left out). A Ctrl-C's leaves out hookcli's frames
    below the script's too: it may land inside hookcli's hooks of the script's step, as it would have
    landed in the script's (or torch's) code unwatched -- no failure of hookcli's to show."""
    shown = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen: set[int] = set()
    pending: list[tuple[traceback.TracebackException, BaseException]] = [(shown, exc)]
    while pending:  # (and the exceptions chained to it)
        current, raised = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        frames = list(current.stack)
        while frames and _hidden(frames[0].filename):
            frames.pop(0)
        if isinstance(raised, INTERRUPTS):
            frames = _outside_hookcli(frames)
        current.stack = traceback.StackSummary.from_list(frames)
        for chained, cause in ((current.__cause__, raised.__cause__), (current.__context__, raised.__context__)):
            if chained is not None and cause is not None:
                pending.append((chained, cause))
    return "".join(shown.format())


def _outside_hookcli(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames of a Ctrl-C's traceback less hookcli's and those of the libraries hookcli called (a
    library frame -- python's own or an installed package's -- whose nearest caller outside the libraries
    is hookcli's): where the script's frames and its libraries' end, the Ctrl-C is shown to land."""
    kept: list[traceback.FrameSummary] = []
    in_hookcli = False
    for frame in frames:
        if _hidden(frame.filename):
            in_hookcli = True
        elif not frame.filename.startswith(_LIBRARY_DIRS):
            in_hookcli = False  # (the script's own code, called back by hookcli: a closure)
        if not in_hookcli:
            kept.append(frame)
    return kept


def _hidden(filename: str) -> bool:
    """Whether a frame is runpy's or hookcli's own."""
    return filename in (runpy.__file__, "<frozen runpy>") or filename.startswith(_PACKAGE_DIR)


def run_script(command: Sequence[str], *, every: int = 1, out: str | os.PathLike[str] | None = None,
               layers: Sequence[str] | str | None = None, types: Sequence[str] | str | None = None,
               rules: Mapping[str, Any] | None = None, on_found: Callable[[Finding], None] | None = None,
               on_note: Callable[[str], None] | None = None, flight: int | None = None) -> WatchRun:
    """Run ``command`` (``python SCRIPT ARGS`` ...: ``parse_command``) in this process under a watch; its
    exit status, traceback text (an uncaught exception: status 1) and the watch's findings in a WatchRun.

    Everything the command line can check is checked before the script starts (UsageError,
    ConfigError, OutputError); a bad ``layers`` for the model found stops the script at its first step.
    """
    script = parse_command(command)
    check_arguments(nn.Module(), None, every)  # (the model is not known yet: every is checked now)
    rule_settings(rules)
    if out is not None:
        LineLog(out)  # the path is checked now, before the script runs
    if script.module is not None and not _module_found(script.module):
        raise UsageError(f"watch -- -m: no module named {script.module!r}",
                         hint="run from the folder the module is importable from; " + COMMAND_HINT)
    # the log is opened at the first step: against the working directory of now, not the script's then
    log = os.path.abspath(out) if out is not None else None
    spy = ScriptWatch({"every": every, "out": log, "layers": layers, "types": types, "rules": rules, "flight": flight},
                      on_found or (lambda _f: None), on_note or (lambda _t: None))
    run = WatchRun("script", None, None, 0, every, os.fspath(out) if out is not None else None)
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        spy.hooks.install()
        try:
            run.exit_code, run.traceback, signalled = _run(script)
            if signalled:  # (not a script's own sys.exit(143))
                spy.note(f"the script was stopped by {_SIGNALLED[run.exit_code]} after {spy.steps} steps")
        finally:
            sys.argv = saved_argv
            sys.path[:] = saved_path
            try:
                spy.close()
            except HookcliError as exc:
                if not run.exit_code:
                    raise
                spy.note(f"the watch failed too: {exc.message}")
    except _Stop as stop:
        raise stop.error from stop.__cause__
    finally:
        spy.hooks.remove()
    if not spy.started:
        spy.notes.append("the script never called optimizer.step()")
    run.model = type(spy.model).__name__ if spy.model is not None else None
    run.optimizer = type(spy.optimizer).__name__ if spy.optimizer is not None else None
    run.steps, run.notes = spy.steps, spy.notes
    run.findings = list(spy.watch.findings) if spy.watch is not None else []
    return run


def _module_found(name: str) -> bool:
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def _run(script: Script) -> tuple[int, str | None, bool]:
    """Run the script as python would; (exit status, the text python prints to stderr at the end, whether
    a signal stopped it)."""
    try:
        if script.path is not None:
            sys.argv = [script.path, *script.args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script.path)))
            runpy.run_path(script.path, run_name="__main__")
        else:
            assert script.module is not None
            sys.argv = ["-m", *script.args]  # runpy puts the module's file in argv[0], as python -m does
            sys.path.insert(0, os.getcwd())
            runpy.run_module(script.module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code, text = _exit_code(exc)
        return code, None if text is None else text + "\n", False
    except _Stop:
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C: python prints the script's traceback, and the shell sees 130
        return 128 + signal.SIGINT, _script_traceback(exc), True
    except Terminated as exc:  # SIGTERM: python dies of it without a word, and the shell sees 143
        return 128 + exc.signum, None, True
    except BaseException as exc:  # the script's own failure: its traceback, exit status 1
        return 1, _script_traceback(exc), False
    finally:
        _flush()  # what the script printed comes before hookcli's summary, as at the end of a process
    return 0, None, False


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: the CLI's own writes say so
            pass
