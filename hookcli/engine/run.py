"""One run of a model: load it, build its inputs, select modules, run it with hooks, say who failed.

Everything a command needs to run a model once (``prepare`` -> ``running`` -> ``forward_report``), and
the failure attribution (``blame``: the model raised, or hookcli did). Commands build on this; the
public API (``hookcli.api``) calls the commands.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli import progress
from hookcli.errors import (
    INTERRUPTS, HookcliError, InputError, ModelRaisedError, UnsupportedError, UsageError, exit_status, internal_error,
    safe_str,
)
from hookcli.engine.session import HookOptions, KeepFn, attach
from hookcli.engine.batches import DataBatches, MergedRows, batch_size_of, batches_text, open_data
from hookcli.engine.inputs import ModelInputs, check_signature, make_inputs, with_note
from hookcli.engine.loading import LoadedModel, from_instance, load_model, refuse_torchscript
from hookcli.engine.quiet import quiet
from hookcli.options import RunOptions, model_is_instance
from hookcli.engine.stats import Vector, iter_tensors, shape_of
from hookcli.records import (
    LayerRecord,
    FailureInfo,
    ModelInfo,
    Report,
)
from hookcli.engine.selection import select_modules
from hookcli.engine.model_index import ModelIndex
from hookcli.engine.state import (
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
    #: ``index`` as made for the model at hand (a copy of a Prepared with another model remakes it).
    model_index: ModelIndex | None = None
    #: ``--data``: the data set's batches (``inputs`` is its first batch), else None
    data: DataBatches | None = None

    @property
    def index(self) -> ModelIndex:
        """The model's modules, parameters and buffers, walked once (``ModelIndex``)."""
        if self.model_index is None or self.model_index.model is not self.loaded.model:
            self.model_index = ModelIndex.of(self.loaded.model)
        return self.model_index


#: The dummy batch of a train-mode run without --batch-size or inputs: BatchNorm in train mode needs
#: more than one value per channel (a batch of 1 makes it raise on a (batch, features) input).
TRAIN_BATCH = 2
TRAIN_BATCH_NOTE = f"batch of {TRAIN_BATCH} in train mode"


def prepare(options: RunOptions, *, default_batch: int | None = None, meta: bool = False,
            batched: bool = False) -> Prepared:
    """Validate options, load the model, select modules, build inputs (no forward pass yet).

    Generated inputs get batch ``--batch-size``, else ``default_batch``, else in train mode
    ``TRAIN_BATCH`` (said in the inputs' source), else the model's default (1).

    ``meta=True`` builds the model on the meta device (no memory for weights or activations; shapes
    only) and runs it there. A model instance the caller passed in is never moved to meta (its
    weights could not come back): it runs as ``meta_copy``, a copy without weights.

    ``batched``: the caller runs every batch of ``--data`` (``data``; its first batch is ``inputs``);
    other callers refuse ``--data`` (UsageError) before the model is built.
    """
    opts = options.validate()  # a fresh copy: safe to adjust
    if opts.data is not None and not batched:
        raise UsageError("--data (a data set run in batches) is taken by stats, grads and check only",
                         hint="give this command one batch with --input or --input-shape")
    if meta:
        opts.device = "meta"
    loaded = load(opts, meta=meta)
    index = ModelIndex.of(loaded.model)
    lazy = index.lazy_tensor
    if lazy is not None:
        raise UnsupportedError(
            f"the model's {lazy} is an uninitialised lazy parameter: a run would initialise it, changing the model",
            hint="initialise the lazy modules with one forward pass (model(example_input)) before hookcli runs it",
        )
    if opts.device == "meta" and loaded.kind == "instance" and needs_meta_copy(loaded.model):
        loaded = dataclasses.replace(loaded, model=meta_copy(loaded.model))
        index = ModelIndex.of(loaded.model)
    selection = select_modules(
        loaded.model, layers=opts.layers, types=opts.types, depth=opts.depth, all_modules=opts.all_modules,
        named=index.named,
    )
    data = None
    if opts.data is not None:
        with seeded_rng(opts.seed):  # a DataLoader draws from torch's RNG (its seed, a shuffle): not the caller's
            data = open_data(loaded, opts.data, batch_size=opts.batch_size, batches=opts.batches,
                             trust_pickle=opts.trust_pickle)
        inputs = data.first
    else:
        batch = opts.batch_size if opts.batch_size is not None else (default_batch if not opts.specs else None)
        train_batch = opts.train and batch is None and not opts.specs and not opts.inputs
        if train_batch:
            batch = TRAIN_BATCH
        inputs = make_inputs(
            loaded, shapes=opts.specs, files=opts.inputs, batch_size=batch, fill=opts.fill, seed=opts.seed,
            trust_pickle=opts.trust_pickle, seq_len=opts.seq_len, meta=opts.device == "meta",
        )
        if train_batch:
            inputs = with_note(inputs, TRAIN_BATCH_NOTE)
    check_signature(loaded.model, inputs)  # too many / too few inputs: exit 2, before running
    info = model_info(loaded, opts.model_source, opts.model_args, index=index)
    return Prepared(opts, loaded, inputs, selection, info, index, data)


def require_values(prep: Prepared, command: str) -> None:
    """UsageError when ``prep`` would run on the meta device: ``command`` needs values it has none of."""
    if run_device(prep).type == "meta":
        raise UsageError(f"{command} needs values, and the meta device has none (it gives shapes only)",
                         hint="run on a real device: --device cpu (or cuda), or use shapes for shapes only")


def run_device(prep: Prepared) -> torch.device:
    """The device a run of ``prep`` uses: ``--device``, else the one the model's parameters are on."""
    return torch.device(prep.options.device) if prep.options.device else model_device(prep.loaded.model)


def place_inputs(prep: Prepared, inputs: ModelInputs) -> tuple[Any, Any]:
    """``inputs`` as a run of ``prep`` passes them: (args, kwargs) on the run's device, floating
    tensors cast to ``--dtype``."""
    opts = prep.options
    device = run_device(prep)
    return to_device(inputs.args, device, opts.torch_dtype()), to_device(inputs.kwargs, device, opts.torch_dtype())


def load(opts: RunOptions, *, meta: bool = False) -> LoadedModel:
    """Load the model an (already validated) RunOptions names (on the meta device with ``meta``).

    Random initialisation is seeded with ``opts.seed`` (``seeded_rng``: the caller's RNG states,
    CUDA's included, are untouched): the same command gives the same numbers on every run, which
    baselines rely on.
    """
    if model_is_instance(opts.model):
        return from_instance(opts.model)
    with progress.phase(f"building {opts.model}"), seeded_rng(opts.seed), quiet():
        with torch.device("meta") if meta else nullcontext():
            return load_model(str(opts.model), model_args=dict(opts.model_args), weights=opts.weights,
                              trust_pickle=opts.trust_pickle, own_code=opts.model_roots,
                              trust_remote_code=opts.trust_remote_code)


def model_info(loaded: LoadedModel, source: str, model_args: Mapping[str, Any] | None = None, *,
               index: ModelIndex | None = None) -> ModelInfo:
    """Where the model came from (spec, source, weights, ``model_args``) and its size: each parameter
    tensor counted once, also when shared or tied (read from ``index`` when given)."""
    model = loaded.model
    index = index if index is not None else ModelIndex.of(model)
    params = index.params
    buffers = index.buffers
    return ModelInfo(
        spec=loaded.spec,
        source="python" if loaded.kind == "instance" else source,
        class_name=type(model).__name__,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        weights=loaded.weights,
        model_args=dict(model_args or {}),
    )


def params_by_module(prep: Prepared) -> dict[str, int]:
    """Parameters in each selected module's subtree, each tensor counted once."""
    return prep.index.subtree_params(prep.selection)


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
    text = f"exited with {exit_status(exc.code)}" if isinstance(exc, SystemExit) else safe_str(exc).strip()
    return FailureInfo(
        phase=phase,
        module=module_name,
        module_type=module_type,
        input_shapes=input_shapes,
        exception=type(exc).__name__,
        message=text.splitlines()[0] if text else "",
    )


def failure_message(failure: FailureInfo) -> str:
    """One line: where the model raised (or exited) and why (``FailureInfo.sentence``)."""
    return failure.sentence()


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # hookcli/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _is_library(filename: str) -> bool:
    """torch or the standard library: code that raises on behalf of its caller, never the culprit."""
    return filename.startswith(_TORCH_DIR) or (filename.startswith(_STDLIB_DIR) and "-packages" not in filename)


def raised_in_hookcli(exc: BaseException) -> str | None:
    """The function of hookcli's own code that raised ``exc`` during a run, or None (the model's).

    The traceback below the call into the model decides: its innermost frame that is neither
    library code (torch, the standard library) nor a ``__torch_dispatch__`` / ``__torch_function__``
    mode running the model's op (FLOP counting, ``ParamReads``) is the code that failed. A hook or
    reducer of hookcli there is hookcli's failure, not the model's; the user's forward (or
    torchvision's, timm's...) there, or only torch, is the model's. Every frame in hookcli: hookcli raised before or after the model ran.
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
        if _is_library(filename) or frame.f_code.co_name in ("__torch_dispatch__", "__torch_function__"):
            continue
        return frame.f_code.co_name if filename.startswith(_PACKAGE_DIR) else None
    return None


def blame(exc: BaseException, model: nn.Module, phase: str) -> FailureInfo:
    """The model's failure in ``phase`` (see ``locate_failure``), or, when hookcli's own code raised
    ``exc`` (``raised_in_hookcli``), an InternalError: hookcli never blames the model for itself.
    A HookcliError is passed on as it is: the model called hookcli, and that call was refused
    (re-entry on a model being run) or failed on its own terms."""
    if isinstance(exc, HookcliError):
        raise exc
    if not isinstance(exc, SystemExit) and (where := raised_in_hookcli(exc)) is not None:
        raise internal_error(exc, f"hookcli's {where} (during the model's {phase})") from exc
    return locate_failure(exc, model, phase)


@contextmanager
def running(prep: Prepared) -> Iterator[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]:
    """Put the model on the requested device/dtype/mode, move the inputs there, restore afterwards.

    The run's RNGs start from ``opts.seed`` (Dropout masks are the same on every run with the same
    seed) and the caller's RNG states are restored after (``preserved``). Third-party logging and
    progress bars are off meanwhile (``quiet``), as while the model is built.
    """
    opts = prep.options
    model = prep.loaded.model
    with preserved(model, device=opts.device, dtype=opts.torch_dtype(), train=opts.train, seed=opts.seed,
                   index=prep.index), quiet():
        args, kwargs = place_inputs(prep, prep.inputs)
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


@dataclass
class ForwardPass:
    """What one hooked forward pass gathered: the rows, and the model's failure (if it raised)."""

    layers: list[LayerRecord]
    failure: FailureInfo | None = None
    cause: BaseException | None = None
    flops: dict[str, Any] | None = None
    #: With ``vectors``: each output tensor's (statistics, gradient) vectors (``HookSession.vectors``)
    vectors: dict[tuple[str, int, str], tuple[Vector | None, Vector | None]] | None = None


def hooked_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   selection: Sequence[tuple[str, nn.Module]], hooks: HookOptions,
                   params: dict[str, int], *, show_phase: bool = True,
                   model_modules: int | None = None, vectors: bool = False) -> ForwardPass:
    """One forward pass of an already placed model (``running``) under ``torch.no_grad``, with the
    session's hooks on ``selection``; the rows of every call, also when the model raised.

    A model that raises or exits gives ``failure`` (``blame``) and the rows gathered up to it;
    hookcli's own hook failures raise (InternalError, or the HookcliError a hook raised) after the
    run. ``hooks.flops`` counts forward FLOPs per call (``flops``: the counter's summary).
    ``show_phase``: the "forward" spinner (off where the command shows its own progress bar);
    ``model_modules``: the model's module count (``attach`` hooks a large selection process-wide);
    ``vectors``: also hand back the statistics vectors, to merge over batches (``MergedRows``).
    """
    failure: FailureInfo | None = None
    cause: BaseException | None = None
    with attach(model, selection, hooks, model_modules=model_modules) as session:
        counter = None
        if hooks.flops:  # (torch.utils.flop_counter is imported only when counting: 0.15 s)
            from hookcli.engine.flops import FlopCounter

            counter = FlopCounter(session.add_flops)
        try:
            with torch.no_grad(), counter or nullcontext(), progress.phase("forward") if show_phase else nullcontext():
                model(*args, **kwargs)
        except BaseException as exc:  # the user's model raised or exited: keep what we have
            if isinstance(exc, INTERRUPTS):
                raise
            session.raise_error()  # unless one of hookcli's hooks failed first
            failure, cause = blame(exc, model, "forward"), exc
        session.raise_error()
        if counter is not None:
            counter.raise_error()
    layers, _ = session.records(params)
    return ForwardPass(layers, failure, cause, counter.summary() if counter is not None else None,
                       session.vectors() if vectors else None)


def raise_failure(report: Report, failure: FailureInfo, cause: BaseException | None, *, where: str = "") -> None:
    """Raise ModelRaisedError for the model's ``failure``, carrying the partial ``report``; ``where``
    (``batch 3``) starts the message."""
    report.failure = failure
    raise ModelRaisedError(f"{where}: {failure_message(failure)}" if where else failure_message(failure),
                           report=report, module=failure.module, input_shapes=failure.input_shapes,
                           phase=failure.phase) from cause


def forward_report(prep: Prepared, command: str, *, stats: bool, flops: bool = False,
                   keep: KeepFn | None = None) -> Report:
    """Run one forward pass with hooks on the selected modules and return the report.

    ``flops`` counts forward FLOPs per call (``torch.utils.flop_counter`` formulas); ``keep`` is
    called with every selected output tensor (features, fmaps; a sparse one densified). Raises
    ModelRaisedError (carrying the partial report) when the model raises or calls ``sys.exit``,
    InternalError when hookcli's own hook code fails, UnsupportedError for a TorchScript model.
    """
    refuse_torchscript(prep.loaded.model, prep.selection)
    if prep.data is not None:
        return data_forward_report(prep, command)
    report = new_report(prep, command)
    with running(prep) as (model, args, kwargs):
        run = hooked_forward(model, args, kwargs, prep.selection, HookOptions(stats=stats, flops=flops, keep=keep),
                             params_by_module(prep), model_modules=len(prep.index.named))
    report.layers = run.layers
    if run.flops is not None:
        report.flops = run.flops
    if run.failure is not None:
        raise_failure(report, run.failure, run.cause)
    return report


def data_batches(prep: Prepared, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> Iterator[tuple[int, ModelInputs, tuple[Any, ...], dict[str, Any]]]:
    """Every batch of ``prep.data`` as (index, CPU inputs, placed args, placed kwargs), the first from
    ``args``/``kwargs`` (``running`` placed it), each later one checked against forward's signature
    and placed on the run's device in its dtype as it comes: one batch is held at a time."""
    assert prep.data is not None
    yield 0, prep.inputs, args, kwargs
    for index, batch in enumerate(prep.data.rest, start=1):
        try:
            check_signature(prep.loaded.model, batch)
        except InputError as exc:
            raise InputError(f"batch {index}: {exc.message}", hint=exc.hint) from None
        yield index, batch, *place_inputs(prep, batch)


def data_source(prep: Prepared, report: Report, rows: MergedRows) -> None:
    """Say in ``report`` where the batches came from and how many batches and samples were seen:
    each input row's source (its shape and dtype are the first batch's), and the merged rows' notes."""
    assert prep.data is not None
    seen = f"{prep.data.label}, {batches_text(rows.batches)}, {rows.samples} samples"
    report.inputs = [dataclasses.replace(info, source=seen) for info in report.inputs]
    report.notes += rows.notes


def data_forward_report(prep: Prepared, command: str) -> Report:
    """``forward_report`` over every batch of ``--data``: one row per (module, call, output path) with
    statistics merged over the batches (``MergedRows``), a progress bar on stderr counting batches.

    The model raising on a batch is ModelRaisedError naming the batch, carrying the rows merged so far
    (that batch's included); a batch the model's forward cannot take, or an item of another type than
    a tensor, tuple or dict, is InputError naming the batch (exit 2)."""
    assert prep.data is not None
    report = new_report(prep, command)
    rows = MergedRows()
    params = params_by_module(prep)
    bar, advance = progress.bar(command, prep.data.total, "batches")
    with bar, running(prep) as (model, first_args, first_kwargs):
        for index, batch, args, kwargs in data_batches(prep, first_args, first_kwargs):
            run = hooked_forward(model, args, kwargs, prep.selection, HookOptions(stats=True), params,
                                 show_phase=False, model_modules=len(prep.index.named), vectors=True)
            rows.add(run.layers, run.vectors or {}, batch_size_of(batch))
            if run.failure is not None:
                report.layers = rows.records()
                data_source(prep, report, rows)
                raise_failure(report, run.failure, run.cause, where=f"batch {index}")
            advance(1)
    report.layers = rows.records()
    data_source(prep, report, rows)
    return report
