"""The command line: one API call per command, rendering, and errors mapped to exit codes at the edge.

Option bundles and config defaults live in ``hookcli.cli_options``. No torch at import time
(``hookcli --help`` stays fast): commands import the API inside their bodies.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from typing import Any

import click

from hookcli._version import __version__
from hookcli.errors import CheckFailedError, HookcliError, ModelRaisedError, one_line

from hookcli.cli_options import (
    META_DEBUG,
    META_OUTPUT,
    apply_config,
    check_options,
    file_output_options,
    fmap_options,
    grad_options,
    input_options,
    model_options,
    output_options,
    prepare_output,
    run_options,
    run_options_from,
    selection_options,
)

class OneLineUsageError(click.UsageError):
    """Click's own usage errors (a bad --fill choice, --seed -1, an unknown option) in hookcli's
    format: one ``Error:`` line and one ``  hint:`` line, not Click's usage block."""

    def __init__(self, exc: click.UsageError) -> None:
        super().__init__(exc.format_message(), exc.ctx)
        self.exit_code = exc.exit_code

    def show(self, file: Any = None) -> None:
        command = self.ctx.command_path if self.ctx is not None else "hookcli"
        click.echo(f"Error: {one_line(self.format_message())}", err=True)
        click.echo(f"  hint: run '{command} --help' for the options and their values", err=True)


class HookcliGroup(click.Group):
    """Translate HookcliError into a message and exit code, in one place."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise OneLineUsageError(exc) from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            if isinstance(exc, OneLineUsageError):
                raise
            raise OneLineUsageError(exc) from exc
        except HookcliError as exc:
            _report_error(ctx, exc)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as exc:  # a bug in hookcli (or torch): say so, exit 1
            if ctx.meta.get(META_DEBUG):
                raise
            click.echo(one_line(f"Error: internal error: {type(exc).__name__}: {exc}"), err=True)
            click.echo("  hint: run again with --debug for the traceback, and please report it", err=True)
            ctx.exit(1)


def _report_error(ctx: click.Context, exc: HookcliError) -> None:
    output = ctx.meta.get(META_OUTPUT)
    if isinstance(exc, ModelRaisedError) and exc.report is not None and output is not None:
        _emit(exc.report, **output)  # every row gathered before the failure
    if ctx.meta.get(META_DEBUG):
        cause = exc.__cause__ or exc
        click.echo("".join(traceback.format_exception(cause)), err=True, nl=False)
    click.secho(f"Error: {one_line(exc.message)}", err=True, fg="red")
    if exc.hint:
        click.echo(f"  hint: {one_line(exc.hint)}", err=True)


def _emit(report: Any, *, fmt: str, output: str | None) -> None:
    """Render a report and write it to stdout or, atomically, to a file."""
    from hookcli.render import render

    to_terminal = output is None and sys.stdout.isatty()
    color = fmt == "table" and to_terminal and "NO_COLOR" not in os.environ
    text = render(report, fmt, width=_width(to_terminal), color=color)
    if output is None:
        click.echo(text, nl=not text.endswith("\n"))
    else:
        from hookcli.output import write_atomic

        path = write_atomic(output, text)
        click.echo(f"wrote {path}", err=True)


def _width(to_terminal: bool) -> int:
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    return shutil.get_terminal_size((160, 24)).columns if to_terminal else 160


def _start(values: dict[str, Any]) -> tuple[click.Context, dict[str, Any]]:
    ctx = click.get_current_context()
    values = apply_config(ctx, values)
    prepare_output(ctx, values)
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
    from hookcli import kernel

    click.echo(f"hookcli {__version__} (C statistics kernel: {kernel.status()})")
    ctx.exit()


@click.group(cls=HookcliGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", "-V", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and whether the C statistics kernel is built, and exit.")
def main() -> None:
    """Inspect PyTorch models from the command line: per-layer shapes, activation statistics and
    gradients through hooks, as tables (or JSON, CSV, Markdown).

    \b
    MODEL is a torchvision name (resnet50), an import path (pkg.mod:Net) or a file (path/net.py:build);
    without it: --config FILE, then [tool.hookcli] in ./pyproject.toml, then resnet50.

    \b
    Exit codes: 0 ok, 1 the model raised (or a check failed), 2 bad usage or input.
    """


@main.command()
@model_options
@input_options
@selection_options
@run_options
@click.option("--flops", is_flag=True, help="Forward FLOPs per call and in total (torch.utils.flop_counter).")
@output_options
def shapes(**values: Any) -> None:
    """Input and output shapes, dtypes and parameters of each selected module call.

    Without --device, --input or --weights the model is built and run on the meta device: no memory
    for weights or activations, so models of any size work (a real run is the fallback).
    """
    ctx, values = _start(values)
    from hookcli import api

    _emit(api.shapes_report(run_options_from(ctx, values)), fmt=values["fmt"], output=values["output"])


@main.command()
@model_options
@input_options
@selection_options
@run_options
@output_options
def stats(**values: Any) -> None:
    """Activation statistics of each selected module call: mean, std, min, max, norm, zeros, NaN/Inf."""
    ctx, values = _start(values)
    from hookcli import api

    _emit(api.forward_report(api.prepare(run_options_from(ctx, values)), "stats", stats=True),
          fmt=values["fmt"], output=values["output"])


@main.command()
@model_options
@input_options
@selection_options
@run_options
@grad_options
@click.option("--flops", is_flag=True, help="Forward FLOPs per call, and forward/backward totals.")
@output_options
def grads(**values: Any) -> None:
    """Gradients of the loss with respect to each selected output, and per-parameter gradients."""
    ctx, values = _start(values)
    from hookcli import api
    from hookcli.gradients import backward_report

    opts = run_options_from(ctx, values)
    prep = api.prepare(opts, default_batch=2 if opts.train else None)
    _emit(backward_report(prep, "grads"), fmt=values["fmt"], output=values["output"])


@main.command()
@model_options
@input_options
@selection_options
@run_options
@grad_options
@check_options
@output_options
def check(**values: Any) -> None:
    """The CI gate: forward and backward once, then the [checks] rules; exit 1 when an error rule fails.

    \b
    Rules (finite, output_shape, max_abs_activation, max_zero_fraction, dead_channels, grad_norm,
    params_change, baseline) and thresholds come from [checks] in --config FILE or [tool.hookcli.checks]
    in ./pyproject.toml. Every module is hooked and every parameter checked unless --layers, --types,
    --depth or --params narrow it; the model runs in train mode (as in training) unless --eval.
    """
    ctx, values = _start(values)
    from hookcli import api, ci
    from hookcli.output import ensure_writable

    rules = api.check_rules(values["_config"], baseline=values["baseline"])
    if values["junit"]:
        ensure_writable(values["junit"])
    result = api.run_check(run_options_from(ctx, values), rules)
    _emit(result, fmt=values["fmt"], output=values["output"])
    ci.publish(result, junit=values["junit"], github=values["github"])
    if not result.ok:
        raise CheckFailedError(result.headline(), result=result) from result.cause


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


@main.command()
@model_options
@output_options
def modules(**values: Any) -> None:
    """The model's module tree (names, types, parameters) to choose --layers from."""
    ctx, values = _start(values)
    from hookcli import api

    opts = run_options_from(ctx, values)
    tree = api.modules(opts.model, model_args=dict(opts.model_args), weights=opts.weights,
                       model_source=opts.model_source, trust_pickle=opts.trust_pickle)
    _emit(tree, fmt=values["fmt"], output=values["output"])


@main.command()
@click.argument("pattern", required=False)
@output_options
def models(pattern: str | None, **values: Any) -> None:
    """torchvision model names, optionally filtered by a glob such as 'resnet*'."""
    ctx = click.get_current_context()
    prepare_output(ctx, values)
    from hookcli import api

    _emit(api.models(pattern), fmt=values["fmt"], output=values["output"])


@main.command()
@model_options
@input_options
@selection_options
@run_options
@file_output_options("File to save the tensors to: .safetensors, .pt or .npz (by extension).")
def features(**values: Any) -> None:
    """Save the outputs of the selected modules (every call, every tensor) to a tensor file."""
    ctx, values = _start(values)
    from hookcli.feature_export import run_features

    _emit(run_features(run_options_from(ctx, values), output=values["save_to"]), fmt=values["fmt"], output=None)


@main.command()
@model_options
@input_options
@fmap_options
@run_options
@file_output_options("PNG file to draw the feature maps to.")
def fmaps(**values: Any) -> None:
    """Draw one module's output channels as a grid of feature maps (PNG)."""
    ctx, values = _start(values)
    from hookcli.feature_maps import FmapOptions, run_fmaps

    fmap = FmapOptions(layer=values["layer"], channels=values["channels"], sample=values["sample"],
                       call=values["call"], output_key=values["tensor_key"], scale=values["scale"])
    _emit(run_fmaps(run_options_from(ctx, values), fmap, output=values["save_to"]), fmt=values["fmt"], output=None)


if __name__ == "__main__":  # pragma: no cover
    main()
