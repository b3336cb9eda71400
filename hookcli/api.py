"""The Python API: every command is one call here, and the CLI is a thin layer over it.

>>> import hookcli
>>> report = hookcli.stats("resnet18", input_shapes=["1x3x64x64"])
>>> report.to_dict()["layers"][0]["stats"]["mean"]
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli import progress
from hookcli.errors import HookcliError, ModelRaisedError, UnsupportedError, UsageError, exit_status, internal_error
from hookcli.engine.session import HookOptions, KeepFn, attach
from hookcli.engine.inputs import ModelInputs, check_signature, make_inputs
from hookcli.engine.loading import LoadedModel, from_instance, list_torchvision_models, load_model, refuse_torchscript
from hookcli.options import RunOptions, check_option_names, model_is_instance
from hookcli.engine.stats import iter_tensors, shape_of
from hookcli.records import (
    CheckResult,
    FailureInfo,
    FeatureExport,
    FeatureMaps,
    ModelInfo,
    ModelList,
    ModuleRow,
    ModuleTree,
    Report,
)
from hookcli.engine.selection import module_depth, select_modules
from hookcli.engine.state import (
    exclusive,
    lazy_tensor,
    meta_copy,
    model_device,
    needs_meta_copy,
    preserved,
    seeded_rng,
)


@dataclass
class Prepared:
    """A loaded model, its inputs and the modules to hook: everything a run needs."""

    options: RunOptions
    loaded: LoadedModel
    inputs: ModelInputs
    selection: list[tuple[str, nn.Module]]
    info: ModelInfo


def prepare(options: RunOptions, *, default_batch: int | None = None, meta: bool = False) -> Prepared:
    """Validate options, load the model, select modules, build inputs (no forward pass yet).

    ``meta=True`` builds the model on the meta device (no memory for weights or activations; shapes
    only) and runs it there. A model instance the caller passed in is never moved to meta (its
    weights could not come back): it runs as ``meta_copy``, a copy without weights.
    """
    opts = options.validate()  # a fresh copy: safe to adjust
    if meta:
        opts.device = "meta"
    loaded = load(opts, meta=meta)
    lazy = lazy_tensor(loaded.model)
    if lazy is not None:
        raise UnsupportedError(
            f"the model's {lazy} is an uninitialised lazy parameter: a run would initialise it, changing the model",
            hint="initialise the lazy modules with one forward pass (model(example_input)) before hookcli runs it",
        )
    if opts.device == "meta" and loaded.kind == "instance" and needs_meta_copy(loaded.model):
        loaded = dataclasses.replace(loaded, model=meta_copy(loaded.model))
    selection = select_modules(
        loaded.model, layers=opts.layers, types=opts.types, depth=opts.depth, all_modules=opts.all_modules,
    )
    batch = opts.batch_size if opts.batch_size is not None else (default_batch if not opts.specs else None)
    inputs = make_inputs(
        loaded, shapes=opts.specs, files=opts.inputs, batch_size=batch, fill=opts.fill, seed=opts.seed,
        trust_pickle=opts.trust_pickle,
    )
    check_signature(loaded.model, inputs)  # too many / too few inputs: exit 2, before running
    return Prepared(opts, loaded, inputs, selection, model_info(loaded, opts.model_source))


def require_values(prep: Prepared, command: str) -> None:
    """UsageError when ``prep`` would run on the meta device: ``command`` needs values it has none of."""
    device = torch.device(prep.options.device) if prep.options.device else model_device(prep.loaded.model)
    if device.type == "meta":
        raise UsageError(f"{command} needs values, and the meta device has none (it gives shapes only)",
                         hint="run on a real device: --device cpu (or cuda), or use shapes for shapes only")


def load(opts: RunOptions, *, meta: bool = False) -> LoadedModel:
    """Load the model an (already validated) RunOptions names (on the meta device with ``meta``).

    Random initialisation is seeded with ``opts.seed`` (``seeded_rng``: the caller's RNG states,
    CUDA's included, are untouched): the same command gives the same numbers on every run, which
    baselines rely on.
    """
    if model_is_instance(opts.model):
        return from_instance(opts.model)
    with progress.phase(f"building {opts.model}"), seeded_rng(opts.seed):
        with torch.device("meta") if meta else nullcontext():
            return load_model(str(opts.model), model_args=dict(opts.model_args), weights=opts.weights,
                              trust_pickle=opts.trust_pickle)


def model_info(loaded: LoadedModel, source: str) -> ModelInfo:
    """Size of the model: each parameter tensor counted once, also when shared or tied."""
    model = loaded.model
    params = list(model.parameters())
    buffers = list(model.buffers())
    return ModelInfo(
        spec=loaded.spec,
        source="python" if loaded.kind == "instance" else source,
        class_name=type(model).__name__,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        weights=loaded.weights,
    )


def params_by_module(selection: list[tuple[str, nn.Module]]) -> dict[str, int]:
    """Parameters in each selected module's subtree, each tensor counted once."""
    return {name: sum(p.numel() for p in module.parameters()) for name, module in selection}


def to_device(obj: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Move every tensor in a nested input to ``device``; cast floating ones to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point():
            return obj.to(device=device, dtype=dtype)
        return obj.to(device=device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(v, device, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, dtype) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, dtype) for k, v in obj.items()}
    return obj


def locate_failure(exc: BaseException, model: nn.Module, phase: str) -> FailureInfo:
    """Name the innermost module of ``model`` that was running when ``exc`` was raised.

    Read from the traceback (``Module._call_impl`` frames), so it costs nothing when nothing fails
    and finds the failing module even when it was not selected for hooks. A ``SystemExit`` (the
    model called ``sys.exit``) is recorded with its exit status as the message.
    """
    names = {id(m): n for n, m in model.named_modules()}
    module_name: str | None = None
    module_type: str | None = None
    input_shapes: list[list[int] | None] = []
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "_call_impl":
            candidate = frame.f_locals.get("self")
            if candidate is not None and id(candidate) in names:
                module_name = names[id(candidate)]
                module_type = type(candidate).__name__
                args = frame.f_locals.get("args", ())
                kwargs = frame.f_locals.get("kwargs", {})
                input_shapes = [shape_of(t) for _, t in iter_tensors((args, kwargs))]
        tb = tb.tb_next
    text = f"exited with {exit_status(exc.code)}" if isinstance(exc, SystemExit) else str(exc).strip()
    return FailureInfo(
        phase=phase,
        module=module_name,
        module_type=module_type,
        input_shapes=input_shapes,
        exception=type(exc).__name__,
        message=text.splitlines()[0] if text else "",
    )


def failure_message(failure: FailureInfo) -> str:
    """One line: where the model raised (or exited) and why."""
    where = f" at {failure.module or '(model)'} ({failure.module_type})" if failure.module_type else ""
    shapes = ", ".join("x".join(map(str, s)) if s is not None else "?" for s in failure.input_shapes)
    with_inputs = f" with input shape(s) {shapes}" if failure.input_shapes else ""
    if failure.exception == "SystemExit":  # message: "exited with code N"
        return f"the model {failure.message} in {failure.phase}{where}{with_inputs} (it called sys.exit)"
    return f"the model raised in {failure.phase}{where}{with_inputs}: {failure.exception}: {failure.message}"


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _is_library(filename: str) -> bool:
    """torch or the standard library: code that raises on behalf of its caller, never the culprit."""
    return filename.startswith(_TORCH_DIR) or (filename.startswith(_STDLIB_DIR) and "-packages" not in filename)


def raised_in_hookcli(exc: BaseException) -> str | None:
    """The function of hookcli's own code that raised ``exc`` during a run, or None (the model's).

    The traceback below the call into the model decides: its innermost frame that is neither
    library code (torch, the standard library) nor a ``__torch_dispatch__`` mode running the
    model's op (FLOP counting) is the code that failed. A hook or reducer of hookcli there is
    hookcli's failure, not the model's; the user's forward (or torchvision's, timm's...) there, or
    only torch, is the model's. Every frame in hookcli: hookcli raised before or after the model ran.
    """
    frames = []
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    start = 0
    while start < len(frames) and frames[start].f_code.co_filename.startswith(_PACKAGE_DIR):
        start += 1  # the run itself, down to the call into the model
    if frames and start == len(frames):
        return frames[-1].f_code.co_name  # raised by hookcli before (or after) the model ran
    for frame in reversed(frames[start:]):
        filename = frame.f_code.co_filename
        if _is_library(filename) or frame.f_code.co_name == "__torch_dispatch__":
            continue
        return frame.f_code.co_name if filename.startswith(_PACKAGE_DIR) else None
    return None


def blame(exc: BaseException, model: nn.Module, phase: str) -> FailureInfo:
    """The model's failure in ``phase`` (see ``locate_failure``), or, when hookcli's own code raised
    ``exc`` (``raised_in_hookcli``), an InternalError: hookcli never blames the model for itself."""
    if not isinstance(exc, SystemExit) and (where := raised_in_hookcli(exc)) is not None:
        raise internal_error(exc, f"hookcli's {where} (during the model's {phase})") from exc
    return locate_failure(exc, model, phase)


@contextmanager
def running(prep: Prepared) -> Iterator[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]:
    """Put the model on the requested device/dtype/mode, move the inputs there, restore afterwards.

    The run's RNGs start from ``opts.seed`` (Dropout masks are the same on every run with the same
    seed) and the caller's RNG states are restored after (``preserved``).
    """
    opts = prep.options
    model = prep.loaded.model
    device = torch.device(opts.device) if opts.device else model_device(model)
    with preserved(model, device=opts.device, dtype=opts.torch_dtype(), train=opts.train, seed=opts.seed):
        args = to_device(prep.inputs.args, device, opts.torch_dtype())
        kwargs = to_device(prep.inputs.kwargs, device, opts.torch_dtype())
        yield model, args, kwargs


def new_report(prep: Prepared, command: str) -> Report:
    """An empty report of ``command`` for a prepared run (inputs shown as they run: --dtype applied)."""
    opts = prep.options
    model = prep.loaded.model
    device = opts.device or str(model_device(model))
    inputs = [
        dataclasses.replace(info, dtype=opts.dtype)
        if opts.dtype and info.dtype.startswith(("float", "bfloat")) else info
        for info in prep.inputs.infos
    ]
    return Report(
        command=command,
        model=prep.info,
        inputs=inputs,
        device=device,
        mode="train" if opts.train else "eval",
        version=__version__,
    )


def forward_report(prep: Prepared, command: str, *, stats: bool, flops: bool = False,
                   keep: KeepFn | None = None) -> Report:
    """Run one forward pass with hooks on the selected modules and return the report.

    ``flops`` counts forward FLOPs per call (``torch.utils.flop_counter`` formulas); ``keep`` is
    called with every selected output tensor (features, fmaps; a sparse one densified). Raises
    ModelRaisedError (carrying the partial report) when the model raises or calls ``sys.exit``,
    InternalError when hookcli's own hook code fails, UnsupportedError for a TorchScript model.
    """
    from hookcli.engine.flops import FlopCounter

    refuse_torchscript(prep.loaded.model, prep.selection)
    report = new_report(prep, command)
    failure: FailureInfo | None = None
    counter: FlopCounter | None = None
    with running(prep) as (model, args, kwargs):
        with attach(model, prep.selection, HookOptions(stats=stats, flops=flops, keep=keep)) as session:
            counter = FlopCounter(session.add_flops) if flops else None
            try:
                with torch.no_grad(), counter or nullcontext(), progress.phase("forward"):
                    model(*args, **kwargs)
            except (Exception, SystemExit) as exc:  # the user's model raised or exited: keep what we have
                session.raise_error()  # unless one of hookcli's hooks failed first
                failure = blame(exc, model, "forward")
                cause: BaseException | None = exc
            else:
                cause = None
            session.raise_error()
            if counter is not None:
                counter.raise_error()
        report.layers, _ = session.records(params_by_module(prep.selection))
    if counter is not None:
        report.flops = counter.summary()
    if failure is not None:
        report.failure = failure
        raise ModelRaisedError(
            failure_message(failure), report=report, module=failure.module, input_shapes=failure.input_shapes,
        ) from cause
    return report


def _options(model: Any, kwargs: dict[str, Any]) -> RunOptions:
    source = kwargs.pop("model_source", None) or ("python" if model_is_instance(model) else "argument")
    check_option_names(kwargs)
    return RunOptions(model=model, model_source=source, **kwargs)


META_NOTE = "ran on the meta device: shapes only, no memory for weights or activations (--device cpu: a real run)"


def wants_meta(opts: RunOptions) -> bool:
    """Shapes need no values: run on meta unless a device, input files or weights ask for real data."""
    if opts.meta is not None:
        return opts.meta
    return opts.device is None and not opts.inputs and opts.weights is None and not model_is_instance(opts.model)


def shapes_report(options: RunOptions) -> Report:
    """``shapes``: on the meta device when possible, else (or when the model cannot run there) for real."""
    opts = options.validate()
    fallback: str | None = None
    if wants_meta(opts):
        try:
            report = forward_report(prepare(opts, meta=True), "shapes", stats=False, flops=opts.flops)
            report.notes.append(META_NOTE)
            return report
        except HookcliError as exc:
            if not isinstance(exc, ModelRaisedError):
                raise  # a usage error (unknown layer, bad input) is the same on any device
            fallback = f"{exc.report.failure.exception}: {exc.report.failure.message}" if exc.report and \
                exc.report.failure else str(exc)
        except Exception as exc:  # building on meta failed (an init that reads values)
            fallback = f"{type(exc).__name__}: {exc}"
    report = forward_report(prepare(opts), "shapes", stats=False, flops=opts.flops)
    if fallback is not None:
        report.notes.append(f"ran on cpu: the model cannot run on the meta device ({fallback[:160]})")
    return report


def shapes(model: Any = None, **options: Any) -> Report:
    """Input and output shapes, dtypes and parameter counts of the selected modules.

    ``model`` is a spec (``"resnet50"``, ``"pkg.mod:Net"``, ``"file.py:build"``) or an ``nn.Module``;
    ``options`` are the fields of ``RunOptions`` (``input_shapes``, ``layers``, ``device``, ``flops``,
    ...). A model given by spec, with no device, input files or weights, runs on the meta device.
    ``trust_pickle=True`` lets torch.load unpickle arbitrary objects from ``weights``/``inputs``
    .pt/.pth files (it runs code from them; only for files you trust); the other functions take it too.
    """
    with exclusive(model):
        return shapes_report(_options(model, options))


def stats(model: Any = None, **options: Any) -> Report:
    """Activation statistics (mean, std, min, max, norm, zero fraction, NaN/Inf counts) per call."""
    with exclusive(model):
        return forward_report(prepare(_options(model, options)), "stats", stats=True)


def inspect(model: Any = None, *, with_stats: bool = True, **options: Any) -> Report:
    """The general entry point: ``stats`` (default) or, with ``with_stats=False``, ``shapes``."""
    return stats(model, **options) if with_stats else shapes(model, **options)


def modules(model: Any = None, *, model_args: dict[str, Any] | None = None, weights: str | None = None,
            model_source: str | None = None, trust_pickle: bool = False) -> ModuleTree:
    """The model's module tree (names, types, parameter counts), to choose ``--layers`` from."""
    opts = _options(model, {"model_args": model_args or {}, "weights": weights, "model_source": model_source,
                            "trust_pickle": trust_pickle})
    opts = opts.validate()
    loaded = load(opts)
    rows: list[ModuleRow] = []
    for name, module in loaded.model.named_modules():
        rows.append(ModuleRow(
            name=name,
            type=type(module).__name__,
            depth=module_depth(name),
            params=sum(p.numel() for p in module.parameters()),
            own_params=sum(p.numel() for p in module.parameters(recurse=False)),
            children=len(module._modules),
        ))
    return ModuleTree(model=model_info(loaded, opts.model_source), modules=rows, version=__version__)


def models(pattern: str | None = None) -> ModelList:
    """torchvision's model names (with their family), filtered by a glob like ``resnet*``."""
    listed = list_torchvision_models(pattern)
    return ModelList(pattern=pattern, models=[{"name": n, "family": f} for n, f in listed], version=__version__)


__all__ = ["shapes", "stats", "grads", "inspect", "modules", "models", "features", "fmaps", "prepare",
           "forward_report", "check", "run_check", "check_rules"]


def grads(model: Any = None, **options: Any) -> Report:
    """Gradients of the loss w.r.t. each selected output tensor, and per-parameter gradients.

    Options beyond ``shapes``: ``loss`` (auto|ce|nll|sum|mean), ``target``, ``output_key``,
    ``params`` (selected|all|none), ``clip``, ``input_grads``. With ``train=True`` the dummy batch
    defaults to 2 (BatchNorm needs more than one value per channel).
    """
    from hookcli.commands.grads import backward_report

    opts = _options(model, options)
    # inference_mode(False): a model hookcli builds gets normal tensors, also under the caller's
    with exclusive(model), torch.inference_mode(False):
        return backward_report(prepare(opts, default_batch=2 if opts.train else None), "grads")


def check(model: Any = None, *, checks: dict[str, Any] | None = None, config: str | os.PathLike[str] | None = None,
          baseline: str | os.PathLike[str] | None = None, **options: Any) -> CheckResult:
    """The CI sanity gate: forward and backward once, then the rules of ``[checks]``; a CheckResult.

    ``config``: a hookcli TOML file (or a pyproject.toml with ``[tool.hookcli]``) giving option
    defaults and the ``[checks]`` table (the API never reads ./pyproject.toml on its own);
    ``checks``: rule entries as a dict, e.g. ``{"output_shape": [2, 10], "grad_norm": {"max": 1e3}}``,
    replacing the config's entries of the same rules; ``baseline``: a saved JSON report to compare
    with; ``options``: ``RunOptions`` fields (``input_shapes``, ``layers``, ``device``, ``params``...).
    Every module is hooked and every parameter checked unless options narrow it; the model runs in
    train mode (``train=False`` for eval), seeded with ``seed``. The model raising
    is a failed ``runs`` rule (``result.ok`` is False), never an exception; bad rules or options raise
    ConfigError/UsageError. The model you pass is handed back unchanged (params_change steps a copy).

    >>> result = hookcli.check(model, input_shapes=["2x3x32x32"], checks={"output_shape": [2, 10]})
    >>> assert result.ok, result
    """
    from hookcli.commands.check.run import api_check

    return api_check(model, checks=checks, config=config, baseline=baseline, options=options)


def run_check(options: RunOptions, rules: Any) -> CheckResult:
    """``check`` with validated pieces (the CLI): RunOptions and ``hookcli.commands.check.run.check_rules(...)``."""
    from hookcli.commands.check.run import run_check as run

    return run(options, rules)


def check_rules(config: Any, *, baseline: str | os.PathLike[str] | None = None) -> Any:
    """The validated rules of a loaded Config (its ``[checks]`` table) plus a ``baseline`` file."""
    from hookcli.commands.check.run import check_rules as rules

    return rules(config, baseline=baseline)


def features(model: Any = None, *, output: str | os.PathLike[str] | None = None, progress: bool | None = None,
             **options: Any) -> FeatureExport:
    """Keep the outputs of the selected modules: one entry per call and output tensor.

    Entries are named like the report's rows (``layer4``, ``layer1.0.relu#1``, ``split[0]``). With
    ``output`` (``.safetensors``, ``.pt``/``.pth`` or ``.npz``; checked before the model is built) they
    are saved there, atomically, with metadata. The result lists them; ``result.tensors`` holds the
    tensors themselves (CPU), also without ``output``. A folder of images runs in batches of
    ``batch_size`` (default 32), with a progress bar on stderr when ``progress`` (default: stderr is
    a terminal).

    >>> hookcli.features("resnet18", layers="layer4,avgpool", output="feats.safetensors")
    """
    from hookcli.commands.features import run_features

    with exclusive(model):
        return run_features(_options(model, options), output=output, progress=progress)


def fmaps(model: Any = None, *, layer: str, output: str | os.PathLike[str] | None = None,
          channels: int | str | Sequence[int] | None = None, sample: int = 0, call: int = 0,
          output_key: str | None = None, scale: int | None = None, **options: Any) -> FeatureMaps:
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
                       scale=scale)
    with exclusive(model):
        return run_fmaps(_options(model, options), spec, output=output)
