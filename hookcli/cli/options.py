"""Command-line plumbing: shared option bundles, config defaults, and RunOptions from the command line.

The option bundles (``model_options``, ``input_options``, ``selection_options``, ``run_options``,
``output_options``, ...) decorate the commands in ``hookcli.cli``. A parameter that sets a
``RunOptions`` field has the field's name (``--input-shape`` -> ``input_shapes``), so ``run_fields``
hands the values to the API as they are. ``--config`` (eager) reads ``--config FILE`` or
``[tool.hookcli]`` into Click's ``default_map`` before any other parameter is processed: a config value
is parsed and validated by the same Click type as the flag, and the command line wins. No torch at
import time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click
from click.core import ParameterSource

from hookcli.errors import ConfigError, OutputError
from hookcli.options import (
    MAX_FMAP_SCALE, MAX_SEED, Fill, Loss, OutputFormat, ParamScope, Shard, option_flags, option_help, parse_model_args,
    values_of,
)

META_OUTPUT = "hookcli.output"
META_DEBUG = "hookcli.debug"
META_CONFIG = "hookcli.config"
META_CONFIG_KEYS = "hookcli.config_keys"
META_HELP = "hookcli.help"

#: Parameters a config never sets: unpickling and running a model's own code are the user's own opt-ins (load_config refuses the key),
#: a config does not name a config, and the file ``features``/``fmaps`` write (their ``--output``) is
#: not the report file a config's ``output`` names.
NEVER_FROM_CONFIG = frozenset({"trust_pickle", "trust_remote_code", "config_path", "save_to"})

F = Callable[..., Any]


def _compose(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _choice(vocabulary: type[Any]) -> click.Choice:
    """A Click choice of a closed vocabulary's values (the value stays a plain string)."""
    return click.Choice(values_of(vocabulary))


class _ModelArg(click.ParamType):
    """One ``KEY=VALUE`` (parsed with the others by ``parse_model_args``); a ``(key, value)`` pair from
    a config's ``model_args`` table is taken as it is."""

    name = "KEY=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if isinstance(value, tuple) else str(value)


def _model_args(ctx: click.Context, param: click.Parameter, value: tuple[Any, ...]) -> dict[str, Any]:
    """The model's keyword arguments: a config's ``model_args``, each ``--model-arg`` given on the
    command line overriding its key (Click alone would replace the whole config table)."""
    given = parse_model_args(value)
    from_config = (ctx.default_map or {}).get(param.name or "")
    if from_config and ctx.get_parameter_source(param.name or "") == ParameterSource.COMMANDLINE:
        return {**parse_model_args(from_config), **given}
    return given


def _read_config(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """``--config`` (eager): read the config (or ``[tool.hookcli]``) into Click's ``default_map``
    before the other parameters are processed."""
    if ctx.resilient_parsing or ctx.meta.get(META_HELP):
        return value
    from hookcli.config import config_options, load_config, option_keys

    config = load_config(value)
    ctx.meta[META_CONFIG] = config
    flags = {p.name: [o for o in (*p.opts, *p.secondary_opts) if not o.startswith("-") or o.startswith("--")]
             for p in ctx.command.params if p.name and p.name not in NEVER_FROM_CONFIG}
    defaults = config_options(config, flags)
    ctx.meta[META_CONFIG_KEYS] = option_keys(config, flags)
    if ctx.command.name == "watch":  # its own [watch] table, over the top-level keys
        watch = {key: value for key, value in config.watch.items() if key != "rules"}
        defaults.update(watch)
        ctx.meta[META_CONFIG_KEYS].update({key: f"watch.{key}" for key in watch})
    if isinstance(defaults.get("model_args"), dict):  # a table: its items, for the repeatable --model-arg
        defaults["model_args"] = tuple(defaults["model_args"].items())
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _end_of_options(args: list[str]) -> int:
    return args.index("--") if "--" in args else len(args)


class HookcliCommand(click.Command):
    """A command whose bad config values are said as such: the file and the key, exit 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # --help shows the help whatever the config holds (Click runs the eager --config first when
        # it comes first on the line)
        ctx.meta[META_HELP] = any(arg in ctx.help_option_names for arg in args[: _end_of_options(args)])
        try:
            return super().parse_args(ctx, args)
        except click.BadParameter as exc:
            param = exc.param
            config = ctx.meta.get(META_CONFIG)
            if param is None or config is None or ctx.get_parameter_source(param.name) != ParameterSource.DEFAULT_MAP:
                raise
            key = ctx.meta.get(META_CONFIG_KEYS, {}).get(param.name, param.name)
            raise ConfigError(f"{config.path}: bad value for {key!r}: {exc.message}",
                              hint=f"fix {key} in the config, or override it on the command line") from None


#: ``ctx.meta`` key: the command after ``--`` of ``hookcli watch -- CMD`` (None: no ``--``).
META_COMMAND = "hookcli.command"


class WatchCommand(HookcliCommand):
    """``hookcli watch``: what follows the first ``--`` is the user's command (``META_COMMAND``), never
    hookcli's options or MODEL."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        end = _end_of_options(args)
        ctx.meta[META_COMMAND] = args[end + 1:] if end < len(args) else None
        return super().parse_args(ctx, args[:end])

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- CMD...]"]


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
    click.option("--model-arg", "model_args", multiple=True, type=_ModelArg(), callback=_model_args,
                 metavar="KEY=VALUE",
                 help=option_help("model_args")),
    click.option("--weights", metavar="FILE|NAME",
                 help=option_help("weights")),
    click.option("--trust-pickle", "trust_pickle", is_flag=True,
                 help="Let torch.load unpickle arbitrary Python objects from --weights/--input files. "
                 "Unpickling runs code from the file: use it only for files you trust (never from a config)."),
    click.option("--trust-remote-code", "trust_remote_code", is_flag=True,
                 help="Let an hf: model run the Python code that comes with it (auto_map in its config.json). "
                 "Use it only for code you trust (never from a config; hookcli never asks on stdin)."),
    click.option("--config", "config_path", type=click.Path(dir_okay=False), metavar="FILE", is_eager=True,
                 callback=_read_config,
                 help="TOML config giving defaults for the options (docs/options.md#config-files; else "
                 "[tool.hookcli] in ./pyproject.toml)."),
)
"""MODEL argument, how to build it, and whether its files may be unpickled."""

input_options = _compose(
    click.option("--input-shape", "input_shapes", multiple=True, metavar="[NAME=]SHAPE[:DTYPE]",
                 help=option_help("input_shapes")),
    click.option("--input", "inputs", multiple=True, metavar="FILE",
                 help=option_help("inputs")),
    click.option("--batch-size", type=click.IntRange(min=1),
                 help=option_help("batch_size")),
    click.option("--fill", type=_choice(Fill), default=Fill.randn.value,
                 show_default=True, help=option_help("fill")),
    click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True,
                 help=option_help("seed")),
    click.option("--seq-len", "seq_len", type=click.IntRange(min=1), metavar="N",
                 help=option_help("seq_len")),
)
"""What goes into the model."""

selection_options = _compose(
    click.option("--layers", "-l", multiple=True, metavar="NAMES",
                 help=option_help("layers")),
    click.option("--types", "-t", multiple=True, metavar="TYPES", help=option_help("types")),
    click.option("--depth", "-d", type=click.IntRange(min=0), help=option_help("depth")),
    click.option("--all", "all_modules", is_flag=True, help=option_help("all_modules")),
)
"""Which modules get hooks (default: the model's direct children)."""

run_options = _compose(
    click.option("--device", help=option_help("device")),
    click.option("--dtype", help=option_help("dtype")),
    click.option("--train/--eval", "train", default=False, help=option_help("train")),
)
"""Where and how the model runs."""

data_options = _compose(
    click.option("--data", metavar="DIR|FILE|SPEC",
                 help=option_help("data")),
    click.option("--batches", type=click.IntRange(min=1), metavar="N",
                 help=option_help("batches")),
)
"""A data set run in batches (stats, grads, check); ``--batch-size`` sets images or rows per batch."""

shard_options = _compose(
    click.option("--shard", type=_choice(Shard), help=option_help("shard")),
)
"""Under torchrun, the model sharded over the ranks (stats, grads, check)."""

model_run_options = _compose(model_options, input_options, selection_options, run_options)
"""The model, its input, the modules to hook and how it runs: what every command that runs a model takes."""

output_options = _compose(
    click.option("--format", "-f", "format", type=_choice(OutputFormat), default=OutputFormat.TABLE.value,
                 show_default=True,
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

loss_options = _compose(
    click.option("--loss", type=_choice(Loss), default=Loss.auto.value, show_default=True,
                 help="Loss to backpropagate; auto: the model's own loss output, else per-token cross-entropy for "
                 "[batch, seq, vocab] logits, cross-entropy for [batch, classes], else mean(x**2)."),
    click.option("--target", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Class index for ce/nll on [batch, classes] output."),
    click.option("--output-key", metavar="KEY", help="Which tensor of a tuple/dict output the loss uses."),
)
"""Which loss the backward pass starts from (grads, check, diff --grads)."""

grad_options = _compose(
    loss_options,
    click.option("--params", "params", type=_choice(ParamScope), default=ParamScope.selected.value,
                 show_default=True, help="Parameters to report: of the selected modules, all, or none."),
    click.option("--clip", type=click.FloatRange(min=0, min_open=True), metavar="VALUE",
                 help="Clamp every parameter gradient to [-VALUE, VALUE] with tensor hooks."),
    click.option("--input-grads", is_flag=True, help="Also report gradients w.r.t. each module's inputs."),
)
"""How the loss and the backward pass are made."""

watch_options = _compose(
    click.option("--layers", "-l", multiple=True, metavar="NAMES",
                 help=option_help("layers")),
    click.option("--types", "-t", multiple=True, metavar="TYPES", help=option_help("types")),
    click.option("--every", type=click.IntRange(min=1), metavar="N",
                 help="Log steps 0, N, 2N, ... (steps count from 0; default: 10 with -- CMD, 1 for MODEL)."),
    click.option("--flight", type=click.IntRange(min=1), metavar="K",
                 help="The flight recorder: every step's statistics of the last K steps, written with the one "
                      "that holds the first NaN/Inf, whose maker it names (docs/watch.md#flight-recorder)."),
    click.option("--out", metavar="FILE", type=click.Path(dir_okay=False),
                 help="The log, one JSON line per logged step (docs/watch.md); appended to, created with its folders."),
    click.option("--steps", type=click.IntRange(min=1), metavar="N", help="watch MODEL: train N steps."),
    click.option("--lr", type=click.FloatRange(min=0, min_open=True), metavar="X",
                 help="watch MODEL: the learning rate (default: 0.01 for sgd, 0.001 for adam and adamw)."),
    click.option("--optimizer", type=click.Choice(["sgd", "adam", "adamw"]), default="sgd", show_default=True,
                 help="watch MODEL: the optimizer."),
)
"""``hookcli watch``'s own options: the watch (``--layers``, ``--types``, ``--every``, ``--out``) and hookcli's
training loop (``--steps``, ``--lr``, ``--optimizer``)."""

check_options = _compose(
    click.option("--junit", metavar="FILE", type=click.Path(dir_okay=False),
                 help="Also write a JUnit XML report (one testcase per rule, with its time) to FILE, atomically; "
                 "missing directories are created."),
    click.option("--github/--no-github", "github", default=None,
                 help="GitHub Actions annotations on stderr (default: on when GITHUB_ACTIONS=true)."),
    click.option("--baseline", metavar="FILE", type=click.Path(dir_okay=False),
                 help="Compare with a saved JSON report (hookcli shapes MODEL -f json -o FILE)."),
    click.option("--steps", type=int, default=0, metavar="N",
                 help="Also train a copy of the model for N steps on the same batch and check it learns: init_loss, "
                      "overfit_batch, params_update, determinism (default 0: the one-step check)."),
)
"""CI outputs of ``check`` (rules and thresholds come from the config's [checks] table)."""


diff_options = _compose(
    click.option("--vs-weights", "vs_weights", metavar="FILE", type=click.Path(dir_okay=False),
                 help="Run B loads this state-dict file (.pt/.pth/.safetensors) instead."),
    click.option("--vs-dtype", "vs_dtype", help="Run B casts the model and float inputs to this dtype."),
    click.option("--vs-device", "vs_device", help="Run B runs on this device (cpu, cuda, cuda:N, mps)."),
    click.option("--vs-model", "vs_model", metavar="SPEC",
                 help="Run B builds this model instead (same module names; it gets A's weights where "
                 "names and shapes match, unless --vs-weights)."),
    click.option("--vs-compile", "vs_compile", is_flag=True, help="Run B runs the model through torch.compile."),
    click.option("--rtol", type=click.FloatRange(min=0), metavar="R",
                 help="Relative tolerance: |a-b| <= atol + rtol*|a| elementwise, instead of the dtypes' default "
                 "limits (bfloat16's are rel L2 and cosine distance: docs/diff.md)."),
    click.option("--atol", type=click.FloatRange(min=0), metavar="A",
                 help="Absolute tolerance (default: from the dtypes)."),
    click.option("--grads", is_flag=True, help="Also compare the gradient of the loss w.r.t. each selected output."),
)
"""What run B of ``diff`` changes, and how its outputs are compared with run A's."""


def file_output_options(help_text: str) -> Callable[[F], F]:
    """``--output FILE`` (required) for commands that write a file of their own (features, fmaps);
    their result table goes to stdout in ``--format``."""
    return _compose(
        click.option("--output", "-o", "save_to", required=True, type=click.Path(dir_okay=False),
                     metavar="FILE", help=help_text),
        click.option("--format", "-f", "format", type=_choice(OutputFormat), default=OutputFormat.TABLE.value,
                     show_default=True, help="Format of the summary printed to stdout."),
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
    click.option("--output-key", "output_key", metavar="KEY",
                 help="Which tensor of a tuple/dict output, e.g. 0 or out."),
    click.option("--scale", type=click.IntRange(1, MAX_FMAP_SCALE), metavar="N",
                 help=f"Upscale each tile N times, 1 to {MAX_FMAP_SCALE} (default: so tiles are at least 32 px)."),
)
"""Which output of which module ``fmaps`` draws, and how."""

#: A --format that the user did not give on the command line (its default, or a config's format).
_NOT_GIVEN = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)


def prepare_output(ctx: click.Context, values: dict[str, Any]) -> None:
    """Check the output target up front and remember how to write reports (also partial ones)."""
    if values.get("output"):
        from hookcli.output import ensure_writable
        from hookcli.render.formats import format_for_path

        ensure_writable(values["output"])
        implied = format_for_path(values["output"])
        if implied is not None and ctx.get_parameter_source("format") in _NOT_GIVEN:
            values["format"] = implied.value  # (a config's format yields to the file's extension too)
        elif implied is not None and implied.value != values["format"]:
            raise OutputError(f"--output {values['output']} names a {implied.value} file but --format is "
                              f"{values['format']}",
                              hint=f"drop --format (the extension chooses {implied.value}), or give the file "
                              "the extension of the format: .json, .csv, .md or .txt")
    ctx.meta[META_OUTPUT] = {"fmt": values["format"], "output": values.get("output")}


def run_fields(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The API's keyword options: the values of the parameters named like ``RunOptions`` fields,
    those given (an option left empty keeps the field's default), and where the model came from.

    Not validated here: the API validates them, one way for the command line and for Python.
    """
    fields = {name: value for name, value in values.items()
              if name in option_flags() and value is not None and value != ()}
    config = ctx.meta.get(META_CONFIG)
    if "model" not in fields:
        fields["model_source"] = "default"
    elif ctx.get_parameter_source("model") == ParameterSource.DEFAULT_MAP and config is not None:
        fields["model_source"] = config.origin
        fields["model_roots"] = config.roots()
    else:
        fields["model_source"] = "argument"
    if "data" in fields and ctx.get_parameter_source("data") == ParameterSource.DEFAULT_MAP and config is not None:
        fields["data_roots"] = config.roots()
    return fields
