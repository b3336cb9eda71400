"""Command-line plumbing: shared option bundles, config defaults, and RunOptions from the command line.

The option bundles (``model_options``, ``input_options``, ``selection_options``, ``run_options``,
``output_options``, ...) decorate the commands in ``hookcli.cli``; ``apply_config`` fills options the
user did not give from ``--config FILE`` or ``[tool.hookcli]``; ``run_fields`` gives the API's keyword
options. No torch at import time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from hookcli.config import CLI_ONLY_KEYS, FORMATS
from hookcli.errors import OutputError, UsageError
from hookcli.options import MAX_FMAP_SCALE, MAX_SEED

META_OUTPUT = "hookcli.output"
META_DEBUG = "hookcli.debug"

F = Callable[..., Any]


def _compose(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _set_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta[META_DEBUG] = bool(value) or os.environ.get("HOOKCLI_DEBUG", "") not in ("", "0")
    return value


#: ``ctx.meta`` key: the table width ``--width N`` asks for, or 0 for ``--no-truncate``.
META_WIDTH = "hookcli.width"
#: ``--no-truncate``: a table this wide never crops a cell.
UNLIMITED_WIDTH = 100_000


def _set_width(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if param.name == "no_truncate" and value:
        ctx.meta[META_WIDTH] = UNLIMITED_WIDTH
    elif param.name == "width" and value is not None and ctx.meta.get(META_WIDTH) != UNLIMITED_WIDTH:
        ctx.meta[META_WIDTH] = int(value)
    return value


model_options = _compose(
    click.argument("model", required=False),
    click.option("--model-arg", "model_arg", multiple=True, metavar="KEY=VALUE",
                 help="Argument for the model class/factory: a Python literal (10, 0.2, True, 'a b', [1, 2]) "
                 "or a plain word taken as a string (relu); repeatable."),
    click.option("--weights", metavar="FILE|NAME",
                 help="State dict file (.pt/.pth/.safetensors) or torchvision weights name (DEFAULT; downloads)."),
    click.option("--trust-pickle", "trust_pickle", is_flag=True,
                 help="Let torch.load unpickle arbitrary Python objects from --weights/--input files. "
                 "Unpickling runs code from the file: use it only for files you trust (never from a config)."),
    click.option("--config", "config_path", type=click.Path(dir_okay=False), metavar="FILE",
                 help="TOML config giving defaults for any option (else [tool.hookcli] in ./pyproject.toml)."),
)
"""MODEL argument, how to build it, and whether its files may be unpickled."""

input_options = _compose(
    click.option("--input-shape", "input_shape", multiple=True, metavar="SHAPE[:DTYPE]",
                 help="Dummy input shape, e.g. 2x3x224x224 or 1x16:int64; repeat for several inputs."),
    click.option("--input", "input_files", multiple=True, metavar="FILE",
                 help="Image(s), a folder of images, or a .pt/.npy/.npz/.safetensors tensor file; repeatable."),
    click.option("--batch-size", type=click.IntRange(min=1),
                 help="Batch size of the dummy input (features: images per batch from --input, default 32)."),
    click.option("--fill", type=click.Choice(["randn", "rand", "ones", "zeros"]), default="randn",
                 show_default=True, help="How the dummy input is filled."),
    click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
                 help="Random seed of the dummy input (0 to 2**64-1)."),
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
                 help="Write the output to FILE (atomically; missing directories are created) instead of stdout."),
    click.option("--debug", is_flag=True, expose_value=False, callback=_set_debug, is_eager=True,
                 help="Show tracebacks of errors."),
    click.option("--width", type=click.IntRange(min=40), metavar="N", expose_value=False, callback=_set_width,
                 help="Table width in columns (default: the terminal's, or $COLUMNS)."),
    click.option("--no-truncate", "no_truncate", is_flag=True, expose_value=False, callback=_set_width,
                 help="Never shorten names, shapes or other cells in tables (lines get as long as needed)."),
)
"""How the result is written."""

grad_options = _compose(
    click.option("--loss", type=click.Choice(["auto", "ce", "nll", "mean_square", "sum", "mean"]), default="auto",
                 show_default=True,
                 help="Loss to backpropagate; auto: the model's own loss output, else per-token cross-entropy for "
                 "[batch, seq, vocab] logits, cross-entropy for [batch, classes], else mean(x**2)."),
    click.option("--target", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Class index for ce/nll on [batch, classes] output."),
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
                 help="Also write a JUnit XML report (one testcase per rule, with its time) to FILE, atomically; "
                 "missing directories are created."),
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
    click.option("--scale", type=click.IntRange(1, MAX_FMAP_SCALE), metavar="N",
                 help=f"Upscale each tile N times, 1 to {MAX_FMAP_SCALE} (default: so tiles are at least 32 px)."),
)
"""Which output of which module ``fmaps`` draws, and how."""

# Config keys that do not share their CLI parameter's name.
_CONFIG_TO_PARAM = {"input": "input_files", "all": "all_modules", "format": "fmt"}
_CONFIG_LATE = {"model", "model_args", "mode"}


def prepare_output(ctx: click.Context, values: dict[str, Any]) -> None:
    """Check the output target up front and remember how to write reports (also partial ones)."""
    if values.get("output"):
        from hookcli.output import ensure_writable
        from hookcli.render.formats import format_for_path

        ensure_writable(values["output"])
        implied = format_for_path(values["output"])
        if implied is not None and ctx.get_parameter_source("fmt") == ParameterSource.DEFAULT:
            values["fmt"] = implied.value
        elif implied is not None and implied.value != values["fmt"]:
            raise OutputError(f"--output {values['output']} names a {implied.value} file but --format is {values['fmt']}",
                              hint=f"drop --format (the extension chooses {implied.value}), or give the file "
                              "the extension of the format: .json, .csv, .md or .txt")
    ctx.meta[META_OUTPUT] = {"fmt": values["fmt"], "output": values.get("output")}


def apply_config(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """Fill options the user did not give from --config FILE or [tool.hookcli] in ./pyproject.toml."""
    from hookcli.config import load_config

    config = load_config(values.get("config_path"))
    values = dict(values)
    values["_config"] = config
    params = {p.name: p for p in ctx.command.params}
    for key, raw in config.values.items():
        name = _CONFIG_TO_PARAM.get(key, key)
        if key in _CONFIG_LATE or key in CLI_ONLY_KEYS or name not in params:
            continue  # used later, never from a config (load_config refuses those), or not for this command
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None):
            continue  # the command line wins
        param = params[name]
        if param.multiple and isinstance(raw, str):
            raw = [raw]
        try:
            values[name] = param.type_cast_value(ctx, raw)
        except click.BadParameter as exc:
            raise UsageError(f"{config.path}: bad value for {key!r}: {exc.message}",
                             hint=f"fix {key} in the config, or override it on the command line") from None
    if "train" in params and ctx.get_parameter_source("train") == ParameterSource.DEFAULT and "mode" in config.values:
        values["train"] = config.values["mode"] == "train"
    return values


def run_fields(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The API's keyword options (``RunOptions`` fields) from the command line and the config.

    Not validated here: the API validates them, one way for the command line and for Python.
    """
    from hookcli.options import parse_model_args

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
        trust_pickle=values.get("trust_pickle", False),
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
    return fields
