"""The public Python API: one function per command, and the CLI calls nothing else.

>>> import hookcli
>>> report = hookcli.stats("resnet18", input_shapes=["1x3x64x64"])
>>> report.to_dict()["layers"][0]["stats"]["mean"]

Every function takes the model (a spec such as ``"resnet50"``, ``"pkg.mod:Net"``,
``"path/to/file.py:build"``, or an ``nn.Module``) and keyword options named like the fields of
:class:`hookcli.options.RunOptions`. The model you pass is handed back exactly as it came. Importing
this module does not import torch (``hookcli --help`` stays fast): each function imports what it runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from hookcli.options import RunOptions, check_option_names, model_is_instance

if TYPE_CHECKING:
    from hookcli.commands.check.schema import CheckRules
    from hookcli.config import Config
    import torch

    from hookcli.commands.watch import Watch
    from hookcli.records import Finding, WatchRun
    from hookcli.records import CheckResult, DiffReport, FeatureExport, FeatureMaps, ModelList, ModuleTree, Report
    from hookcli.records import WatchReport

__all__ = ["shapes", "stats", "grads", "inspect", "modules", "models", "features", "fmaps", "check",
           "check_rules", "run_check", "diff", "watch", "watch_model", "watch_script", "watch_rules", "report",
           "kernel_status"]


def _options(model: Any, kwargs: dict[str, Any]) -> RunOptions:
    """RunOptions from a model and keyword options (a misspelt option is a UsageError with close matches)."""
    kwargs = dict(kwargs)
    source = kwargs.pop("model_source", None) or ("python" if model_is_instance(model) else "argument")
    check_option_names(kwargs)
    return RunOptions(model=model, model_source=source, **kwargs)


def shapes(model: Any = None, **options: Any) -> Report:
    """Input and output shapes, dtypes and parameter counts of the selected modules.

    ``options`` are the fields of ``RunOptions`` (``input_shapes``, ``layers``, ``device``, ``flops``,
    ...). A model given by spec, with no device, input files or weights, runs on the meta device.
    ``trust_pickle=True`` lets torch.load unpickle arbitrary objects from ``weights``/``inputs``
    .pt/.pth files (it runs code from them; only for files you trust); the other functions take it too.
    """
    from hookcli.commands.shapes import shapes_report

    return shapes_report(_options(model, options))


def stats(model: Any = None, **options: Any) -> Report:
    """Activation statistics (mean, std, min, max, norm, zero fraction, NaN/Inf counts) per call.

    ``data``: a data set run in batches (``batches``: at most N; ``batch_size``: images or rows per
    batch), each row's statistics merged over all of them: a folder of images or a tensor file (a
    path), ``"pkg.mod:attr"`` / ``"path/file.py:attr"`` naming an iterable of batches, any iterable of
    batches (a DataLoader; each item a tensor, a tuple of positional inputs or a dict of keyword
    inputs), or a tensor / tuple of tensors / dict of tensors sliced along its first dimension."""
    from hookcli.commands.stats import stats_report

    return stats_report(_options(model, options))


def inspect(model: Any = None, *, with_stats: bool = True, **options: Any) -> Report:
    """The general entry point: ``stats`` (default) or, with ``with_stats=False``, ``shapes``."""
    return stats(model, **options) if with_stats else shapes(model, **options)


def grads(model: Any = None, *, top: int | None = None, sort: str | None = None, **options: Any) -> Report:
    """Gradients of the loss w.r.t. each selected output tensor, and per-parameter gradients.

    Options beyond ``shapes``: ``loss`` (auto|ce|nll|mean_square|sum|mean), ``target``, ``output_key``,
    ``params`` (selected|all|none), ``clip``, ``input_grads``. With ``train=True`` the dummy batch
    defaults to 2 (BatchNorm needs more than one value per channel; as for every command). ``sort`` (norm|max|name) orders the
    layer and parameter rows (largest gradient first), ``top`` keeps the first N of each (by norm
    unless ``sort`` says otherwise); ``report.notes`` says what was left out. ``data`` / ``batches``
    as for ``stats``: each layer's output-gradient statistics merged over the batches (each of its
    batch's loss), each parameter's gradient that of the mean loss over the batches.
    """
    from hookcli.commands.grads import check_order, grads_report

    check_order(sort, top)
    return grads_report(_options(model, options), sort=sort, top=top)


def modules(model: Any = None, *, model_args: dict[str, Any] | None = None, weights: str | None = None,
            model_source: str | None = None, trust_pickle: bool = False, depth: int | None = None,
            model_roots: tuple[str, ...] = (), trust_remote_code: bool = False) -> ModuleTree:
    """The model's module tree (names, types, parameter counts), to choose ``--layers`` from;
    ``depth``: only modules down to that depth (0: the model, 1: its children, ...)."""
    from hookcli.commands.modules import module_tree
    from hookcli.options import _check_int

    depth = _check_int("--depth", depth, 0, optional=True, hint="--depth N lists modules down to depth N")
    return module_tree(_options(model, {"model_args": model_args or {}, "weights": weights,
                                        "model_source": model_source, "trust_pickle": trust_pickle,
                                        "model_roots": model_roots, "trust_remote_code": trust_remote_code}),
                       depth)


def models(pattern: str | None = None, source: str = "torchvision") -> ModelList:
    """Model names filtered by a glob like ``resnet*``: torchvision's (with their family), or with
    ``source="timm"`` timm's (``timm:NAME``), ``source="hf"`` transformers' model types (``hf:TYPE``)."""
    from hookcli.commands.modules import model_list

    return model_list(pattern, source)


def check(model: Any = None, *, checks: dict[str, Any] | None = None, config: str | os.PathLike[str] | None = None,
          baseline: str | os.PathLike[str] | None = None, steps: int = 0, optimizer: Any = None,
          loss_fn: Callable[..., Any] | None = None, **options: Any) -> CheckResult:
    """The CI sanity gate: forward and backward once, then the rules of ``[checks]``; a CheckResult.

    ``config``: a hookcli TOML file (or a pyproject.toml with ``[tool.hookcli]``) giving option
    defaults and the ``[checks]`` table (the API never reads ./pyproject.toml on its own);
    ``checks``: rule entries as a dict, e.g. ``{"output_shape": [2, 10], "grad_norm": {"max": 1e3}}``,
    replacing the config's entries of the same rules; ``baseline``: a saved JSON report to compare
    with; ``options``: ``RunOptions`` fields (``input_shapes``, ``layers``, ``device``, ``params``...;
    ``data``: the rules on statistics see every batch of a data set, see ``stats``).
    Every module is hooked and every parameter checked unless options narrow it; the model runs in
    train mode (``train=False`` for eval), seeded with ``seed``. The model raising
    is a failed ``runs`` rule (``result.ok`` is False), never an exception; bad rules or options raise
    ConfigError/UsageError. The model you pass is handed back unchanged (params_change steps a copy).
    ``steps=N`` (N > 0) also trains a copy for N steps and turns on the training rules (init_loss,
    overfit_batch, params_update, determinism: docs/check.md), with your ``optimizer`` (an optimiser
    of ``model``, or a factory ``params -> Optimizer``) and ``loss_fn(output, *inputs)`` where given.
    Under torchrun: every rule over every rank's batch, the same result on every rank, plus
    ``replica_desync``; ``steps=N`` refused; the model raising on another rank raises RanksFailed
    (docs/distributed.md).

    >>> result = hookcli.check(model, input_shapes=["2x3x32x32"], checks={"output_shape": [2, 10]})
    >>> assert result.ok, result
    """
    from hookcli.commands.check.run import api_check
    from hookcli.commands.check.steps import step_options
    from hookcli.config import load_config

    training = step_options(steps, optimizer, loss_fn)
    cfg = load_config(config) if config is not None else None  # config files are read at the edges only
    return api_check(model, checks=checks, config=cfg, baseline=baseline, options=options, training=training)


def check_rules(config: Config | None, *, baseline: str | os.PathLike[str] | None = None) -> CheckRules:
    """The validated rules of a loaded Config (its ``[checks]`` table) plus a ``baseline`` file."""
    from hookcli.commands.check.run import check_rules as rules

    return rules(config, baseline=baseline)


def run_check(rules: CheckRules, model: Any = None, *, steps: int = 0, **options: Any) -> CheckResult:
    """``check`` with rules already validated (``check_rules``) and options as ``RunOptions`` fields;
    ``steps``: the training run of ``check --steps N``."""
    from hookcli.commands.check.run import run_check as run
    from hookcli.commands.check.steps import step_options

    training = step_options(steps)  # checked before anything is built
    return run(_options(model, options), rules, training)


def features(model: Any = None, *, output: str | os.PathLike[str] | None = None, progress: bool | None = None,
             **options: Any) -> FeatureExport:
    """Keep the outputs of the selected modules: one entry per call and output tensor.

    Entries are named like the report's rows (``layer4``, ``layer1.0.relu#1``, ``split[0]``; module
    names that could be misread are percent-encoded). With ``output`` (``.safetensors``,
    ``.pt``/``.pth`` or ``.npz``; checked before the model is built) they are saved there, atomically,
    with metadata. The result lists them; ``result.tensors`` holds the tensors themselves (CPU), also
    without ``output``. A folder of images runs in batches of ``batch_size`` (default 32), with a
    progress bar on stderr when ``progress`` (default: stderr is a terminal).

    >>> hookcli.features("resnet18", layers="layer4,avgpool", output="feats.safetensors")
    """
    from hookcli.commands.features import run_features

    return run_features(_options(model, options), output=output, progress=progress)


def fmaps(model: Any = None, *, layer: str, output: str | os.PathLike[str] | None = None,
          channels: int | str | Sequence[int] | None = None, sample: int = 0, call: int = 0,
          output_key: str | None = None, scale: int | None = None, channel_dim: int | None = None,
          **options: Any) -> FeatureMaps:
    """Draw one module's output channels as a grid (a bar strip for a (batch, features) output).

    ``channels``: the first N (default 64), ``"all"``, or indices (``[0, 5, 7]``, ``"0-15"``);
    ``sample``: the batch item; ``call``: which call of a reused module; ``output_key``: which tensor
    of a tuple/dict output; ``scale``: tile upscaling (default: tiles of at least 32 px). With
    ``output`` (``.png``) the image is written atomically; ``result.image`` is the uint8 (1, H, W)
    tensor. The result has per-channel min/max/mean and a status (``dead``, ``constant``, ...).

    >>> hookcli.fmaps("resnet18", layer="conv1", inputs=["photo.jpg"], output="conv1.png")
    """
    from hookcli.commands.fmaps import FmapOptions, run_fmaps

    spec = FmapOptions(layer=layer, channels=channels, sample=sample, call=call, output_key=output_key,
                       scale=scale, channel_dim=channel_dim)
    return run_fmaps(_options(model, options), spec, output=output)


def diff(model: Any = None, *, vs_weights: str | os.PathLike[str] | None = None, vs_dtype: str | None = None,
         vs_device: str | None = None, vs_model: Any = None, vs_compile: bool = False, rtol: float | None = None,
         atol: float | None = None, grads: bool = False, **options: Any) -> DiffReport:
    """Run the model twice on the same input, A as ``options`` say and B with the ``vs_*`` changes,
    and compare every selected output tensor (and the model's own output) call by call.

    ``vs_model``: another spec (or module) with the same module names; it gets A's weights where
    names and shapes match, unless ``vs_weights``. ``rtol``/``atol``: ``|a - b| <= atol + rtol |a|``
    elementwise, replacing the dtypes' default limits (bfloat16's are on rel L2 and cosine distance). ``grads``: also compare the gradient of the loss
    (``loss``, ``target``, ``output_key`` options) w.r.t. each output. ``report.ok`` is whether the
    model's final outputs agree; ``report.first_divergence`` the first row beyond tolerance.

    >>> report = hookcli.diff("resnet18", input_shapes=["1x3x32x32"], vs_dtype="bfloat16", all_modules=True)
    >>> report.first_divergence.label
    """
    from hookcli.commands.diff import VsOptions, run_diff

    vs = VsOptions(weights=os.fspath(vs_weights) if vs_weights is not None else None, dtype=vs_dtype,
                   device=vs_device, model=vs_model, compile=vs_compile, rtol=rtol, atol=atol, grads=grads)
    return run_diff(_options(model, options), vs)


def watch(model: Any, optimizer: torch.optim.Optimizer | None = None, *, every: int = 1,
          out: str | os.PathLike[str] | None = None, layers: Sequence[str] | str | None = None,
          types: Sequence[str] | str | None = None, rules: Mapping[str, Any] | None = None,
          on_finding: str = "print", flight: int | None = None,
          tensorboard_dir: str | os.PathLike[str] | None = None) -> Watch:
    """Watch your own training loop: every ``every``-th step (0, every, 2 * every, ...) the selected
    modules' activation and output-gradient statistics, each parameter's norm, gradient and update,
    and the loss, as one JSON line appended to ``out`` (docs/watch.md: the schema, what a step is).

    ``model``: the ``nn.Module`` you train; ``optimizer``: its optimizer (steps end at its
    ``step()``; None: only ``w.step()`` ends them); ``layers``/``types``: as elsewhere (default: every
    module that owns parameters directly, and the activation functions). Unlogged steps cost nothing
    measurable; the run's numbers and RNG are untouched; every hook is gone after the block. A forward
    made with ``model`` in eval mode and autograd off (a validation inside the loop) is not counted.
    ``rules``: the rules' thresholds over their defaults (``{"loss_spike": {"ratio": 3.0}}``, a rule's
    name to False switches it off); their findings are in ``w.findings`` and on the log's lines;
    ``on_finding``: ``"print"`` (the default) prints each on stderr as it is found, ``"warn"`` only
    records them, ``"raise"`` raises ``CheckFailedError`` at the first (docs/watch.md#rules).
    ``flight=K``: every step's output statistics kept in a ring of the last K steps, written to the log
    when a NaN/Inf appears or the loop raises (docs/watch.md#flight-recorder). ``tensorboard_dir``:
    the logged steps as TensorBoard scalars too (needs ``pip install 'hookcli[tensorboard]'``).

    >>> with hookcli.watch(model, optimizer, every=50, out="runs/exp.jsonl") as w:
    ...     for x, y in loader:
    ...         loss = loss_fn(model(x), y)
    ...         loss.backward(); optimizer.step(); optimizer.zero_grad()
    ...         w.step(loss=loss)
    """
    from hookcli.commands.watch import Watch

    return Watch(model, optimizer, every=every, out=out, layers=layers, types=types, rules=rules,
                 on_finding=on_finding, flight=flight, tensorboard_dir=tensorboard_dir)


def report(path: str | os.PathLike[str], *, stat: str = "rms", layers: Sequence[str] | str | None = None) -> WatchReport:
    """Read a ``hookcli.watch`` log: one statistic per layer (or parameter) per logged step, the loss,
    and every finding in the log (``report.ok`` is False when one is an error). Does not import torch.

    ``stat``: a layer output's statistic (``rms``, ``abs_max``, ``zero_fraction``, ``kurtosis``, ...),
    its gradient's (``grad.rms``), a parameter's (``norm``, ``update_norm``, ``update_ratio``) or its
    gradient's (``param.grad.rms``); ``layers``: names or globs (``"blocks.*"``) of the rows to keep.
    ``path`` ``"-"`` reads the log from stdin.

    >>> report = hookcli.report("runs/exp.jsonl", stat="grad.rms", layers="blocks.*")
    >>> assert report.ok, report.errors
    """
    from hookcli.commands.report import watch_report

    return watch_report(path, stat=stat, layers=layers)


def watch_model(model: Any = None, *, steps: int, lr: float | None = None, optimizer: str = "sgd", every: int = 1,
                out: str | os.PathLike[str] | None = None, rules: Mapping[str, Any] | None = None,
                on_found: Callable[[Finding], None] | None = None, flight: int | None = None,
                **options: Any) -> WatchRun:
    """``hookcli watch MODEL --steps N``: train the model ``steps`` optimizer steps (``optimizer``: sgd,
    adam or adamw; ``lr``: default 0.01 for sgd, 0.001 otherwise) on the input and loss ``grads``
    uses, under ``hookcli.watch(every=, out=, rules=)``; the WatchRun lists what the rules found
    (``run.errors``: the error findings). ``options``: ``RunOptions`` fields (``input_shapes``,
    ``data``, ``loss``, ``layers``, ...); train mode unless ``train=False``. A model you pass is
    copied and the copy trained: yours is never changed. ``on_found`` gets each finding as it occurs.

    >>> run = hookcli.watch_model("resnet18", steps=20, lr=0.1, out="runs/r18.jsonl", input_shapes=["4x3x64x64"])
    """
    from hookcli.commands.watch_model import watch_model as run

    options.setdefault("train", True)
    return run(_options(model, options), steps=steps, lr=lr, optimizer=optimizer, every=every, out=out,
               rules=rules, on_found=on_found, flight=flight)


def watch_script(command: Sequence[str], *, every: int = 10, out: str | os.PathLike[str] | None = None,
                 layers: Sequence[str] | str | None = None, types: Sequence[str] | str | None = None,
                 flight: int | None = None,
                 rules: Mapping[str, Any] | None = None, on_found: Callable[[Finding], None] | None = None,
                 on_note: Callable[[str], None] | None = None) -> WatchRun:
    """``hookcli watch -- CMD``: run ``command`` (``["python", "train.py", "--lr", "3e-4"]``, ``["python",
    "-m", "pkg.train"]``, ``["train.py"]``) in this process, unchanged, under a watch of the model its
    first ``optimizer.step()`` trains (docs/watch.md#from-the-command-line). ``run.exit_code`` is the
    script's exit status (an uncaught exception: 1, its traceback in ``run.traceback``); ``on_found``
    gets each finding as its step is logged, ``on_note`` what the watch tells (which model it watches)."""
    from hookcli.commands.watch_script import run_script

    return run_script(command, every=every, out=out, layers=layers, types=types, rules=rules, on_found=on_found,
                      on_note=on_note, flight=flight)


def watch_rules(config: Config | None) -> dict[str, Any] | None:
    """The ``[watch.rules]`` of a loaded Config, checked (ConfigError naming the file), as ``rules=`` takes them."""
    from hookcli.commands.watch_rules import config_rules

    return config_rules(config)


def kernel_status() -> str:
    """Whether the optional C statistics kernel is built, stale or switched off (``--version``).

    Torch-free: the kernel (and its OpenMP runtime) is only inspected, never loaded before torch.
    """
    from hookcli.commands.stats import kernel_status as status

    return status()


# The command line's own helpers under torchrun (not in ``__all__``: a Python caller under torchrun makes
# its own process group, and its exit code is its own).


def torchrun_group(device: str | None = None) -> AbstractContextManager[bool]:
    """The command line under ``torchrun``: the default process group for one command (gloo, or nccl
    when ``device`` is CUDA, each rank on ``cuda:LOCAL_RANK``), destroyed when the block ends, also on
    errors; yields whether one is there (False outside torchrun). docs/distributed.md."""
    from hookcli.commands.ranks import torchrun_group as group

    return group(device)


def agree_exit(code: int, own: bool, failure: BaseException | None = None) -> tuple[int, bool]:
    """Under a process group: the exit code every rank exits with (an error of a rank's own wins over
    the ``RanksFailed`` of the others; ``own``: this rank's is its own) and whether rank 0 had one.
    ``failure``: this rank's error, told to the ranks still waiting for its run to start."""
    from hookcli.commands.ranks import agree_exit as agree

    return agree(code, own, failure)
