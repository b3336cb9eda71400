"""The command line: option bundles, config defaults, one API call per command, errors at the edge.

No torch at import time (``hookcli --help`` stays fast): commands import the API inside their bodies.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from hookcli._version import __version__
from hookcli.config import FORMATS
from hookcli.errors import CheckFailedError, HookcliError, ModelRaisedError, UsageError

_META_OUTPUT = "hookcli.output"
_META_DEBUG = "hookcli.debug"

F = Callable[..., Any]


def _compose(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta[_META_DEBUG] = bool(value) or os.environ.get("HOOKCLI_DEBUG", "") not in ("", "0")
    return value


model_options = _compose(
    click.argument("model", required=False),
    click.option("--model-arg", "model_arg", multiple=True, metavar="KEY=VALUE",
                 help="Argument for the model class/factory (Python literal); repeatable."),
    click.option("--weights", metavar="FILE|NAME",
                 help="State dict file (.pt/.pth/.safetensors) or torchvision weights name (DEFAULT; downloads)."),
    click.option("--config", "config_path", type=click.Path(dir_okay=False), metavar="FILE",
                 help="TOML config giving defaults for any option (else [tool.hookcli] in ./pyproject.toml)."),
)
"""MODEL argument and how to build it."""

input_options = _compose(
    click.option("--input-shape", "input_shape", multiple=True, metavar="SHAPE[:DTYPE]",
                 help="Dummy input shape, e.g. 2x3x224x224 or 1x16:int64; repeat for several inputs."),
    click.option("--input", "input_files", multiple=True, metavar="FILE",
                 help="Image(s), a folder of images, or a .pt/.npy/.npz/.safetensors tensor file; repeatable."),
    click.option("--batch-size", type=click.IntRange(min=1),
                 help="Batch size of the dummy input (features: images per batch from --input, default 32)."),
    click.option("--fill", type=click.Choice(["randn", "rand", "ones", "zeros"]), default="randn",
                 show_default=True, help="How the dummy input is filled."),
    click.option("--seed", type=int, default=0, show_default=True, help="Random seed of the dummy input."),
)
"""What goes into the model."""

selection_options = _compose(
    click.option("--layers", "-l", multiple=True, metavar="NAMES",
                 help="Module names or globs, comma-separated or repeated (layer4, 'layer1.*')."),
    click.option("--types", "-t", multiple=True, metavar="TYPES", help="Module class names, e.g. Conv2d,ReLU."),
    click.option("--depth", "-d", type=click.IntRange(min=0), help="Every module down to this depth."),
    click.option("--all", "all_modules", is_flag=True, help="Every module of the model."),
)
"""Which modules get hooks (default: the model's direct children)."""

run_options = _compose(
    click.option("--device", help="cpu (default), cuda, cuda:N, mps; `shapes` uses meta when none is given."),
    click.option("--dtype", help="Cast the model and float inputs: float32, float16, bfloat16, float64."),
    click.option("--train/--eval", "train", default=False, help="Run in training or eval mode (default eval)."),
)
"""Where and how the model runs."""

output_options = _compose(
    click.option("--format", "-f", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                 help="Output format (with --output, .json/.csv/.md imply it)."),
    click.option("--output", "-o", "output", type=click.Path(dir_okay=False), metavar="FILE",
                 help="Write the output to FILE (atomically) instead of stdout."),
    click.option("--debug", is_flag=True, expose_value=False, callback=_set_debug, is_eager=True,
                 help="Show tracebacks of errors."),
)
"""How the result is written."""

grad_options = _compose(
    click.option("--loss", type=click.Choice(["auto", "ce", "nll", "sum", "mean"]), default="auto", show_default=True,
                 help="Loss to backpropagate; auto: cross-entropy for (batch, classes) output, else sum."),
    click.option("--target", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Class index for ce/nll."),
    click.option("--output-key", metavar="KEY", help="Which tensor of a tuple/dict output the loss uses."),
    click.option("--params", "params", type=click.Choice(["selected", "all", "none"]), default="selected",
                 show_default=True, help="Parameters to report: of the selected modules, all, or none."),
    click.option("--clip", type=click.FloatRange(min=0, min_open=True), metavar="VALUE",
                 help="Clamp every parameter gradient to [-VALUE, VALUE] with tensor hooks."),
    click.option("--input-grads", is_flag=True, help="Also report gradients w.r.t. each module's inputs."),
)
"""How the loss and the backward pass are made."""

check_options = _compose(
    click.option("--junit", metavar="FILE", type=click.Path(dir_okay=False),
                 help="Also write a JUnit XML report (one testcase per rule) to FILE, atomically."),
    click.option("--github/--no-github", "github", default=None,
                 help="GitHub Actions annotations on stderr (default: on when GITHUB_ACTIONS=true)."),
    click.option("--baseline", metavar="FILE", type=click.Path(dir_okay=False),
                 help="Compare with a saved JSON report (hookcli shapes MODEL -f json -o FILE)."),
)
"""CI outputs of ``check`` (rules and thresholds come from the config's [checks] table)."""


def file_output_options(help_text: str) -> Callable[[F], F]:
    """``--output FILE`` (required) for commands that write a file of their own (features, fmaps);
    their result table goes to stdout in ``--format``."""
    return _compose(
        click.option("--output", "-o", "save_to", required=True, type=click.Path(dir_okay=False),
                     metavar="FILE", help=help_text),
        click.option("--format", "-f", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
                     help="Format of the summary printed to stdout."),
        click.option("--debug", is_flag=True, expose_value=False, callback=_set_debug, is_eager=True,
                     help="Show tracebacks of errors."),
    )


fmap_options = _compose(
    click.option("--layer", required=True, metavar="NAME", help="The module whose output is drawn, e.g. conv1."),
    click.option("--channels", metavar="N|LIST", default="64", show_default=True,
                 help="The first N channels, 'all', or indices like 0,5,7 or 0-15 (one index: '5,')."),
    click.option("--sample", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Which item of the batch."),
    click.option("--call", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Which call of a module the forward pass calls more than once."),
    click.option("--output-key", "tensor_key", metavar="KEY",
                 help="Which tensor of a tuple/dict output, e.g. 0 or out."),
    click.option("--scale", type=click.IntRange(min=1), metavar="N",
                 help="Upscale each tile N times (default: so tiles are at least 32 px)."),
)
"""Which output of which module ``fmaps`` draws, and how."""

# Config keys that do not share their CLI parameter's name.
_CONFIG_TO_PARAM = {"input": "input_files", "all": "all_modules", "format": "fmt"}
_CONFIG_LATE = {"model", "model_args", "mode"}


class HookcliGroup(click.Group):
    """Translate HookcliError into a message and exit code, in one place."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HookcliError as exc:
            _report_error(ctx, exc)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as exc:  # a bug in hookcli (or torch): say so, exit 1
            if ctx.meta.get(_META_DEBUG):
                raise
            click.echo(f"Error: internal error: {type(exc).__name__}: {exc}", err=True)
            click.echo("  hint: run again with --debug for the traceback, and please report it", err=True)
            ctx.exit(1)


def _report_error(ctx: click.Context, exc: HookcliError) -> None:
    output = ctx.meta.get(_META_OUTPUT)
    if isinstance(exc, ModelRaisedError) and exc.report is not None and output is not None:
        _emit(exc.report, **output)  # every row gathered before the failure
    if ctx.meta.get(_META_DEBUG):
        cause = exc.__cause__ or exc
        click.echo("".join(traceback.format_exception(cause)), err=True, nl=False)
    click.secho(f"Error: {exc.message}", err=True, fg="red")
    if exc.hint:
        click.echo(f"  hint: {exc.hint}", err=True)


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


def _prepare_output(ctx: click.Context, values: dict[str, Any]) -> None:
    """Check the output target up front and remember how to write reports (also partial ones)."""
    if values.get("output"):
        from hookcli.output import ensure_writable
        from hookcli.render.formats import format_for_path

        ensure_writable(values["output"])
        implied = format_for_path(values["output"])
        if implied is not None and ctx.get_parameter_source("fmt") == ParameterSource.DEFAULT:
            values["fmt"] = implied.value
    ctx.meta[_META_OUTPUT] = {"fmt": values["fmt"], "output": values.get("output")}


def _apply_config(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """Fill options the user did not give from --config FILE or [tool.hookcli] in ./pyproject.toml."""
    from hookcli.config import load_config

    config = load_config(values.get("config_path"))
    values = dict(values)
    values["_config"] = config
    params = {p.name: p for p in ctx.command.params}
    for key, raw in config.values.items():
        name = _CONFIG_TO_PARAM.get(key, key)
        if key in _CONFIG_LATE or name not in params:
            continue
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None):
            continue  # the command line wins
        param = params[name]
        if param.multiple and isinstance(raw, str):
            raw = [raw]
        try:
            values[name] = param.type_cast_value(ctx, raw)
        except click.BadParameter as exc:
            raise UsageError(f"{config.path}: bad value for {key!r}: {exc.message}") from None
    if "train" in params and ctx.get_parameter_source("train") == ParameterSource.DEFAULT and "mode" in config.values:
        values["train"] = config.values["mode"] == "train"
    return values


def _run_options(ctx: click.Context, values: dict[str, Any]) -> Any:
    """Build the API's RunOptions from the command line and the config (validated by the API)."""
    from hookcli.loading import parse_model_args
    from hookcli.options import RunOptions

    config = values["_config"]
    model, source = values.get("model"), "argument"
    if model is None and "model" in config.values:
        model, source = config.values["model"], config.origin
    model_args: dict[str, Any] = {}
    if not values.get("model_arg") and "model_args" in config.values:
        config_args = config.values["model_args"]
        model_args = parse_model_args(config_args) if isinstance(config_args, list) else dict(config_args)
    else:
        model_args = parse_model_args(values.get("model_arg", ()))
    fields = dict(
        model=model,
        model_source=source if model is not None else "default",
        model_args=model_args,
        weights=values.get("weights"),
        input_shapes=values.get("input_shape", ()),
        inputs=values.get("input_files", ()),
        batch_size=values.get("batch_size"),
        fill=values.get("fill", "randn"),
        seed=values.get("seed", 0),
        layers=values.get("layers") or None,
        types=values.get("types") or None,
        depth=values.get("depth"),
        all_modules=values.get("all_modules", False),
        device=values.get("device"),
        dtype=values.get("dtype"),
        train=values.get("train", False),
    )
    for extra in ("loss", "target", "output_key", "params", "clip", "input_grads", "flops"):
        if extra in values and values[extra] is not None:
            fields[extra] = values[extra]
    return RunOptions(**fields).validate()


def _start(values: dict[str, Any]) -> tuple[click.Context, dict[str, Any]]:
    ctx = click.get_current_context()
    values = _apply_config(ctx, values)
    _prepare_output(ctx, values)
    from hookcli import progress

    progress.enable()  # spinners on stderr for slow phases, only on a terminal
    return ctx, values


@click.group(cls=HookcliGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", "-V", prog_name="hookcli")
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

    _emit(api.shapes_report(_run_options(ctx, values)), fmt=values["fmt"], output=values["output"])


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

    _emit(api.forward_report(api.prepare(_run_options(ctx, values)), "stats", stats=True),
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
    """Gradients of the loss w.r.t. each selected output, and per-parameter gradient statistics."""
    ctx, values = _start(values)
    from hookcli import api
    from hookcli.gradients import backward_report

    opts = _run_options(ctx, values)
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
    result = api.run_check(_run_options(ctx, values), rules)
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

    opts = _run_options(ctx, values)
    tree = api.modules(opts.model, model_args=dict(opts.model_args), weights=opts.weights,
                       model_source=opts.model_source)
    _emit(tree, fmt=values["fmt"], output=values["output"])


@main.command()
@click.argument("pattern", required=False)
@output_options
def models(pattern: str | None, **values: Any) -> None:
    """torchvision model names, optionally filtered by a glob (e.g. 'resnet*')."""
    ctx = click.get_current_context()
    _prepare_output(ctx, values)
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

    _emit(run_features(_run_options(ctx, values), output=values["save_to"]), fmt=values["fmt"], output=None)


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
    _emit(run_fmaps(_run_options(ctx, values), fmap, output=values["save_to"]), fmt=values["fmt"], output=None)


if __name__ == "__main__":  # pragma: no cover
    main()
