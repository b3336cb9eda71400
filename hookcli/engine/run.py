"""One run of a model: load it, build its inputs, select modules, run it with hooks, say who failed.

Everything a command needs to run a model (``prepare`` -> ``running`` -> ``run_step``, THE run loop:
forward, loss, backward or optimiser steps, under the hooks, returning a ``RunResult``;
``forward_report`` for forward-only reports), and the failure attribution (``blame``: the model
raised, or hookcli did). Commands build on this; the public API (``hookcli.api``) calls the commands.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli import progress
from hookcli.errors import (
    INTERRUPTS, DataError, HookcliError, ModelRaisedError, RanksFailed, UnsupportedError, UsageError, exit_status,
    internal_error, safe_str,
)
from hookcli.engine import distributed, rank_stats, reduction, sharding, weight_guard
from hookcli.engine.collectors import Collector, FlopCount, LossValue, Merged, RunResult, Step, entered
from hookcli.engine.hooks import attach
from hookcli.engine.session import HookSession
from hookcli.engine.taps import Gradients, InputGradients, Keep, KeepFn, Statistics, Tap
from hookcli.engine.batches import DataBatches, MergedRows, batch_size_of, batches_text, open_data
from hookcli.engine.build_inputs import DATA_SIGNATURE_HOW, ModelInputs, check_signature, make_inputs, with_note
from hookcli.engine.input_hints import default_input_hint
from hookcli.engine.loading import LoadedModel, from_instance, load_model, refuse_torchscript
from hookcli.engine.quiet import quiet
from hookcli.engine.meta_values import meta_values
from hookcli.options import RunOptions, Shard, model_is_instance
from hookcli.engine.stats import Transfer, iter_tensors, map_tensors, shape_of
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
    #: for hookcli's own default inputs: forward's arguments and the flags that fit them (``forward_hint``)
    input_hint: str | None = None

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

    Under a process group the ranks agree first (``sharding.agreement``): on their options, then on the
    model and batch they hold, and a rank that fails on its own here (its --data unreadable) stops every rank.
    """
    with sharding.agreement() as agreement:
        return _prepare(options, agreement, default_batch=default_batch, meta=meta, batched=batched)


def _prepare(options: RunOptions, agreement: sharding.Agreement, *, default_batch: int | None, meta: bool,
             batched: bool) -> Prepared:
    opts = options.validate()  # a fresh copy: safe to adjust
    agreement.start(lambda: sharding.options_fingerprint(opts))
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
                             trust_pickle=opts.trust_pickle, dtype=opts.torch_dtype(), own_code=opts.data_roots)
        inputs = data.first
        if opts.shard is not None:  # each rank its part of every batch
            data = dataclasses.replace(data, rest=(sharding.rank_slice(b, opts.shard) for b in data.rest))
    else:
        batch = opts.batch_size if opts.batch_size is not None else (default_batch if not opts.specs else None)
        train_batch = opts.train and batch is None and not opts.specs and not opts.inputs
        if train_batch:
            batch = TRAIN_BATCH
        inputs = make_inputs(
            loaded, shapes=opts.specs, files=opts.inputs, batch_size=batch, fill=opts.fill, seed=opts.seed,
            trust_pickle=opts.trust_pickle, seq_len=opts.seq_len, meta=opts.device == "meta",
            dtype=opts.torch_dtype(), train=opts.train,
        )
        if train_batch:
            inputs = with_note(inputs, TRAIN_BATCH_NOTE)
    defaults = data is None and not opts.specs and not opts.inputs and loaded.family is None
    hint = default_input_hint(loaded.model, inputs, batch or 1) if defaults else None
    check_signature(loaded.model, inputs, how=(data.how or DATA_SIGNATURE_HOW) if data is not None else None,
                    where="batch 0: " if data is not None else "", hint=hint)  # too many / too few: exit 2, before running
    agreement.ready(lambda: sharding.ready_fingerprint(loaded.model, inputs, opts.shard is not None, index))
    if opts.shard is not None:
        inputs = sharding.rank_slice(inputs, opts.shard)
        if data is not None:
            data = dataclasses.replace(data, first=inputs)
    info = model_info(loaded, opts.model_source, opts.model_args, index=index)
    raised = default_input_hint(loaded.model, inputs, batch or 1, raised=True) if defaults else None
    return Prepared(opts, loaded, inputs, selection, info, index, data, raised)


def fresh_inputs(prep: Prepared, seed: int) -> ModelInputs | None:
    """``prep``'s generated inputs made again by the same builder with another ``seed`` (same shapes and
    fill); None when they were not generated (files, ``--data``, inputs the caller passed, the model's own
    example inputs)."""
    opts = prep.options
    if prep.data is not None or opts.inputs or opts.shard is not None:
        return None
    batch = opts.batch_size if opts.specs else batch_size_of(prep.inputs)
    made = make_inputs(prep.loaded, shapes=opts.specs, batch_size=batch, fill=opts.fill, seed=seed,
                       seq_len=opts.seq_len, dtype=opts.torch_dtype())
    before = list(iter_tensors((prep.inputs.args, prep.inputs.kwargs)))
    after = list(iter_tensors((made.args, made.kwargs)))
    if [(p, shape_of(t)) for p, t in after] != [(p, shape_of(t)) for p, t in before]:
        return None
    # the model's own example inputs (``example_inputs``) do not change with the seed: nothing fresh
    return None if all(torch.equal(a, b) for (_, a), (_, b) in zip(after, before)) else made


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

    def build(on_meta: bool) -> LoadedModel:
        with progress.phase(f"building {opts.model}"), seeded_rng(opts.seed), quiet():
            with torch.device("meta") if on_meta else nullcontext():
                return load_model(str(opts.model), model_args=dict(opts.model_args), weights=opts.weights,
                                  trust_pickle=opts.trust_pickle, own_code=opts.model_roots,
                                  trust_remote_code=opts.trust_remote_code)

    if opts.shard is not None and not meta:  # under torchrun: built on meta, sharded, filled from rank 0
        if distributed.process_group() is None:
            raise UsageError(f"--shard {opts.shard} needs the process group of two or more torchrun ranks",
                             hint="torchrun --nproc-per-node N (N >= 2) -m hookcli ...; from Python, call "
                                  "torch.distributed.init_process_group() first")
        return sharding.load_sharded(Shard(opts.shard), opts.device, build)
    return build(meta)


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
        class_name=distributed.type_name(model),
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
    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        return t.to(device=device)

    return map_tensors(move, obj)


def locate_failure(exc: BaseException, model: nn.Module, phase: str) -> FailureInfo:
    """Name the innermost module of ``model`` that was running when ``exc`` was raised.

    Read from the traceback (``Module._call_impl`` frames), so it costs nothing when nothing fails
    and finds the failing module even when it was not selected for hooks. A ``SystemExit`` (the
    model called ``sys.exit``) is recorded with its exit status as the message.
    """
    weight_guard.ran_partly(model)
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
def running(prep: Prepared, *, keep_params: bool = True) -> Iterator[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]:
    """Put the model on the requested device/dtype/mode, move the inputs there, restore afterwards.
    On the meta device the values that follow from the inputs are kept (``meta_values``).

    The run's RNGs start from ``opts.seed`` (Dropout masks are the same on every run with the same
    seed) and the caller's RNG states are restored after (``preserved``). Third-party logging and
    progress bars are off meanwhile (``quiet``), as while the model is built. ``keep_params=False``: the
    weights' values stay as the run leaves them (optimiser steps, whose updates are the run's purpose).
    """
    opts = prep.options
    model = prep.loaded.model
    # a caller's own model keeps its weights' values whatever the forward does to them; one hookcli built
    # is seen by no one after the run (its copy would cost the weights' memory again)
    with preserved(model, device=opts.device, dtype=opts.torch_dtype(), train=opts.train, seed=opts.seed,
                   index=prep.index, keep_params=keep_params and prep.loaded.kind == "instance"), quiet(), \
            meta_values(run_device(prep)):
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
    report = Report(
        command=command,
        model=prep.info,
        inputs=inputs,
        device=device,
        mode="train" if opts.train else "eval",
        version=__version__,
        reduction=reduction.name_for(device) if command != "shapes" and device != "meta" else None,  # shapes: none
    )
    if opts.shard is not None:
        report.notes.append(SHARD_NOTE.format(ranks=distributed.world_size(), shard=opts.shard))
    if any(p.is_complex() for p in prep.index.params):
        report.notes.append(COMPLEX_NOTE)
    return report


#: The note of a report with complex parameters or outputs (``session.reducible``).
COMPLEX_NOTE = ("complex tensors (dtype complex*): their statistics, gradients' and norms are of the magnitude |z| "
                "(the L2 norm of |z| is that of z)")


def note_complex(report: Report) -> None:
    """``COMPLEX_NOTE`` once, when a row of ``report`` is a complex output."""
    if COMPLEX_NOTE not in report.notes and any(r.dtype.startswith("complex") for r in report.layers if r.dtype):
        report.notes.append(COMPLEX_NOTE)


#: The note of a ``--shard`` run's report (``new_report``), until this rank leaves the group (``note_ranks``).
SHARD_NOTE = ("the model was sharded over {ranks} ranks (--shard {shard}, torchrun): the report is that of one "
              "process over the whole batch")


def note_ranks(report: Report, tp: list[list[int]] | None) -> None:
    """Add to a report merged over the ranks what it is (``distributed.ranks_note``; ``tp``: the model's
    tensor-parallel groups). On a rank that left the group (``distributed.desert``) its rows are its own
    part's: ``SHARD_NOTE``'s "one process over the whole batch" is no longer true, and goes."""
    if distributed.deserted():
        start = SHARD_NOTE.split("{", 1)[0]
        report.notes = [note for note in report.notes if not note.startswith(start)]
    report.notes.append(distributed.ranks_note(tp))


def _slice_and_batch(prep: Prepared) -> tuple[int, int] | None:
    """This rank's slice size and the whole batch's under ``--shard ddp|fsdp2``; None otherwise."""
    if prep.options.shard not in (Shard.ddp, Shard.fsdp2) or not prep.inputs.infos:
        return None
    shape = prep.inputs.infos[0].shape
    return (batch_size_of(prep.inputs), shape[0]) if shape else None


def global_shape_of(prep: Prepared, shape: list[int] | None) -> list[int] | None:
    """A shape this rank saw as one process over the whole batch shows it under ``--shard ddp|fsdp2``
    (``sharding.global_shape``: check's ``output_shape`` judges it); as it is otherwise."""
    sizes = _slice_and_batch(prep)
    return sharding.global_shape(shape, *sizes) if sizes is not None else shape


def global_rows(prep: Prepared, layers: list[LayerRecord]) -> list[LayerRecord]:
    """Rows of a ``--shard ddp|fsdp2`` run with the shapes one process over the whole batch shows (a
    leading dimension of this rank's slice size is the batch's: ``sharding.global_shape``); others as
    they are."""
    sizes = _slice_and_batch(prep)
    if sizes is None:
        return layers
    local, whole = sizes
    return [dataclasses.replace(
        rec, shape=sharding.global_shape(rec.shape, local, whole),
        input_shapes=[sharding.global_shape(s, local, whole) if isinstance(s, list) and all(isinstance(d, int) for d in s)
                      else s for s in rec.input_shapes] if rec.input_shapes is not None else None)
        for rec in layers]


#: The loss a gradient run differentiates: (model output, args, kwargs, model) -> (the scalar loss, what
#: the caller keeps of it, handed back as ``RunResult.loss``). It runs after forward, before backward; what
#: it raises is passed on as it is (the caller's own refusal: UsageError, UnsupportedError).
LossFn = Callable[[Any, tuple[Any, ...], dict[str, Any], nn.Module], tuple[torch.Tensor, Any]]


@dataclass
class OptimiserSteps(Collector):
    """Training steps instead of one ``autograd.grad`` (``run_step``): ``count`` times forward, loss,
    ``loss.backward()`` into ``.grad`` and ``optimizer.step()``. ``optimizer`` makes the optimiser once
    the model is placed; ``after_backward`` runs under ``torch.no_grad`` after each backward (to read
    ``.grad``: the ``optimiser_step`` event); ``finished`` once after the last step (none failed), while
    the model is still placed (to read what the steps changed: the ``end`` event, before the other
    collectors'). What ``after_backward`` raises is blamed like the model's code (``blame``), what
    ``finished`` raises is passed on."""

    optimizer: Callable[[], torch.optim.Optimizer]
    count: int = 1
    after_backward: Callable[[], None] | None = None
    finished: Callable[[], None] | None = None

    def optimiser_step(self, step: Step) -> None:
        if self.after_backward is not None:
            self.after_backward()

    def end(self, step: Step) -> None:
        if self.finished is not None and step.result.failure is None:
            self.finished()


def require_grad(obj: Any) -> Any:
    """Fresh leaf copies of the floating tensors in a nested input, with ``requires_grad`` (an
    inference tensor, made under the caller's ``torch.inference_mode``, is copied out of it)."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        if t.is_inference():
            t = t.clone()  # outside inference mode (the gradient commands'), a normal tensor
        return t.detach().requires_grad_(True) if t.is_floating_point() else t

    return map_tensors(leaf, obj)


def inputs_for_backward(args: Any, kwargs: Any, model: nn.Module, input_grads: bool) -> tuple[Any, Any]:
    """The run's inputs for a backward pass: as training passes them (not requiring grad), unless
    gradients w.r.t. them are asked for (``input_grads``) or are the only ones (no parameter of
    ``model`` requires grad). A model may set ``requires_grad`` on a tensor it makes from its input
    (wav2vec2's feature encoder in train mode), which raises when that input requires grad."""
    if input_grads or not any(p.requires_grad for p in model.parameters()):
        return require_grad(args), require_grad(kwargs)
    return args, kwargs


def _reentrant_checkpoint(exc: BaseException) -> bool:
    """Whether ``exc`` is reentrant ``torch.utils.checkpoint`` refusing ``autograd.grad``: raised by its
    own backward (a failure of the checkpointed code itself is raised from that code's frames)."""
    tb = exc.__traceback__
    if not isinstance(exc, RuntimeError) or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return code.co_name == "backward" and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py")


def _no_reentrant_checkpoint() -> UnsupportedError:
    return UnsupportedError(
        "the model uses reentrant activation checkpointing (torch.utils.checkpoint with "
        "use_reentrant=True), which refuses torch.autograd.grad: hookcli reads gradients "
        "without touching .grad",
        hint="checkpoint with use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
             "gradient_checkpointing_kwargs={'use_reentrant': False})), or run without checkpointing",
    )


def _gradients(value: torch.Tensor, params: Sequence[tuple[str, nn.Parameter]], inputs: Any,
               around: AbstractContextManager[Any], *, fsdp2: bool = False) -> dict[int, torch.Tensor | None]:
    """``torch.autograd.grad`` of ``value`` w.r.t. every trainable parameter and input (``.grad``
    untouched), inside ``around``: leaf id -> gradient, None where backward did not reach it. ``fsdp2``: an
    FSDP2 model under torchrun, whose gradients only its own backward makes (``distributed.fsdp2_gradients``;
    ``.grad`` put back as it was)."""
    leaves = [p for _, p in params if p.requires_grad]
    leaves += [t for _, t in iter_tensors(inputs) if t.requires_grad]
    with around, warnings.catch_warnings():
        # ops without a backward (quantized ones) give no gradient: said by the report
        # (a note, or UnsupportedError when nothing got one), not by torch's warning
        warnings.filterwarnings("ignore", message=".*an autograd kernel was not registered")
        results = distributed.fsdp2_gradients(value, leaves) if fsdp2 else \
            torch.autograd.grad(value, leaves, allow_unused=True)
    return {id(leaf): g for leaf, g in zip(leaves, results)}


@dataclass
class RunPlan:
    """How ``run_step`` runs, beyond the hooks: ``loss`` (differentiated once with ``torch.autograd.grad``,
    or with ``steps`` by optimiser steps), what it records beyond the hooked activations (``collectors``:
    parameter statistics, FLOPs, the observer, merged vectors...; the loss value comes from ``loss``),
    ``compiled``: run ``torch.compile(model)``, and ``show_phase``: the forward/backward spinners (off where
    a command shows its own progress)."""

    loss: LossFn | None = None
    steps: OptimiserSteps | None = None
    collectors: Sequence[Collector] = ()
    compiled: bool = False
    show_phase: bool = True

    def all_collectors(self) -> list[Collector]:
        """The collectors of the run: the optimiser steps, the loss, then the plan's own."""
        return [*([self.steps] if self.steps is not None else []),
                *([LossValue()] if self.loss is not None else []), *self.collectors]


def run_model(prep: Prepared, taps: Sequence[Tap], plan: RunPlan | None = None) -> RunResult:
    """``run_step`` on ``prep``'s model and inputs, placed for the run (``running``) and restored after
    (the weights as the plan's optimiser ``steps`` leave them, when given: a copy's training is kept)."""
    with running(prep, keep_params=plan is None or plan.steps is None) as (model, args, kwargs):
        return run_step(prep, model, args, kwargs, taps, plan)


def run_step(prep: Prepared, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             taps: Sequence[Tap] | None, plan: RunPlan | None = None) -> RunResult:
    """THE run loop: one forward pass of an already placed model (``running``) with the session's
    hooks on ``prep.selection`` and, with the plan's ``loss``, the loss and one backward pass; failures
    blamed. ``taps`` (``engine.taps``) record each selected call's tensors; the plan's collectors
    (``engine.collectors``, taps too) see each phase and fill the result.

    Without a loss forward runs under ``torch.no_grad``. With it, gradients are enabled, floating
    inputs require grad where needed (``inputs_for_backward``), and ``torch.autograd.grad`` takes the
    gradients of every trainable parameter and input (the model's ``.grad`` is never written). With the
    plan's ``steps``: optimiser steps with ``loss.backward()`` instead (``OptimiserSteps``; the inputs as
    they are, no gradients to collect): the output gradients' statistics are taken with a loss even when
    ``taps`` has no ``Gradients``. ``taps`` None: the run attaches no hooks of its own (a loop a watch's
    own hook set records, ``watch MODEL``: no one-shot run inside it).

    The model raising or exiting gives ``failure`` (``blame``; in backward, the module whose gradient
    arrived last) and the rows gathered up to it; hookcli's own failures (hooks, collectors) raise after
    the run: InternalError, or the HookcliError raised. UnsupportedError for reentrant checkpointing
    (it refuses ``autograd.grad``). One host transfer for every number.
    """
    plan = plan or RunPlan()
    hooked, collectors = taps is not None, plan.all_collectors()
    taps = [*(taps or ()), *collectors]
    if plan.loss is not None and plan.steps is None:
        if not any(isinstance(tap, Gradients) for tap in taps):
            taps.insert(0, Gradients())
        args, kwargs = inputs_for_backward(args, kwargs, model, any(isinstance(tap, InputGradients) for tap in taps))
    with attach(model, prep.selection, taps, model_modules=len(prep.index.named), compiled=plan.compiled) \
            if hooked else nullcontext(HookSession(prep.selection)) as session, ExitStack() as stack:
        step = Step(model, prep.selection, prep.index.named_parameters(), session, plan.loss is not None)
        for collector in collectors:
            collector.begin(step, stack)
        _phases(plan, step, collectors, args, kwargs)
        for collector in collectors:
            collector.end(step)
        transfer = Transfer()  # the run's one host transfer: the rows' vectors and the collectors'
        slots = [[transfer.slot(v) for v in collector.vectors(step)] for collector in collectors]
        rows = session.rows(transfer, params_by_module(prep))
        transfer.run()
        step.result.layers = rows()
        for collector, taken in zip(collectors, slots):
            collector.records(step, [transfer.values[i] for i in taken if i is not None])
    return step.result


def _phases(plan: RunPlan, step: Step, collectors: Sequence[Collector], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> None:
    """The run's phases, ``plan.steps.count`` times (once without steps): forward, the loss, backward or
    the optimiser's step. The model raising is blamed into ``step.result``; hookcli's failures raise."""
    steps, session = plan.steps, step.session
    fn: Callable[..., Any] = torch.compile(step.model) if plan.compiled else step.model
    optimizer = steps.optimizer() if steps is not None else None
    try:
        for _ in range(steps.count if steps is not None else 1):
            step.phase = "forward"
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            _forward_backward(plan, step, collectors, fn, (args, kwargs), optimizer is not None)
            if optimizer is not None:
                with torch.no_grad():
                    for collector in collectors:
                        collector.optimiser_step(step)
                optimizer.step()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        session.raise_error()
        for collector in collectors:
            collector.ran(step)
    except HookcliError:
        raise
    except BaseException as exc:  # the user's model raised or exited: keep what we have
        if isinstance(exc, INTERRUPTS):
            raise
        session.raise_error()  # unless one of hookcli's hooks failed first
        if step.phase == "backward" and optimizer is None and _reentrant_checkpoint(exc):
            raise _no_reentrant_checkpoint() from None
        result = step.result
        result.failure, result.cause = blame(exc, step.model, step.phase), exc
        last = session.last_grad_call if step.phase == "backward" else None
        if last is not None:  # backward raised: the module whose gradient arrived last
            result.failure.module = last.name or None
            result.failure.module_type = last.type
            result.failure.input_shapes = last.input_shapes


def _forward_backward(plan: RunPlan, step: Step, collectors: Sequence[Collector], fn: Callable[..., Any],
                      inputs: tuple[tuple[Any, ...], dict[str, Any]], optimised: bool) -> None:
    """One forward pass (inside the collectors' ``forward`` contexts), then with the plan's loss the loss
    and backward: ``loss.backward()`` when ``optimised`` (optimiser steps), else ``torch.autograd.grad``
    into ``step.grads`` (inside their ``backward`` contexts)."""
    spin = progress.phase if plan.show_phase else (lambda _name: nullcontext())
    args, kwargs = inputs
    with torch.enable_grad() if plan.loss is not None else torch.no_grad():
        with entered(collector.forward(step) for collector in collectors), spin("forward"):
            output = fn(*args, **kwargs)
            for collector in collectors:
                collector.forward_end(step, output)
        if plan.loss is None:
            return
        step.session.raise_error()
        step.loss, step.choice = plan.loss(output, args, kwargs, step.model)
        del output
        step.phase = "backward"
        if optimised:
            step.loss.backward()
            return
        around = entered(itertools.chain((collector.backward(step) for collector in collectors), [spin("backward")]))
        step.grads = _gradients(step.loss, step.params, inputs, around, fsdp2=distributed.uses_fsdp2(step.model))
        step.result.reached = any(g is not None for g in step.grads.values())


def raise_failure(report: Report, failure: FailureInfo, cause: BaseException | None, *, where: str = "",
                  input_hint: str | None = None) -> None:
    """Raise ModelRaisedError for the model's ``failure``, carrying the partial ``report``; ``where``
    (``batch 3``) starts the message. ``input_hint``: the run's input was hookcli's own default
    (``Prepared.input_hint``), which may not be what the model takes: the hint names what would be."""
    report.failure = failure
    hint = f"the input was hookcli's default; {input_hint}; --debug for the model's traceback" if input_hint else None
    raise ModelRaisedError(f"{where}: {failure_message(failure)}" if where else failure_message(failure),
                           report=report, module=failure.module, input_shapes=failure.input_shapes,
                           phase=failure.phase, hint=hint) from cause


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
    ranks = stats and distributed.process_group() is not None  # under torchrun: over every rank's batch
    tp = distributed.supported_tp_groups(prep.loaded.model) if ranks else None
    run = run_model(prep, [*([Statistics()] if stats else []), *([Keep(keep)] if keep is not None else [])],
                    RunPlan(collectors=[*([FlopCount()] if flops else []), *([Merged()] if ranks else [])]))
    report.layers = run.layers
    if ranks:
        rows = MergedRows()
        rows.add(run.layers, run.vectors or {}, batch_size_of(prep.inputs))
        report.layers = ranked_records(rows, failed=run.failure is not None, tp=tp, model=prep.loaded.model)
        note_ranks(report, tp)
    report.layers = global_rows(prep, report.layers)
    note_complex(report)
    if run.flops is not None:
        report.flops = run.flops
    if run.failure is not None:
        raise_failure(report, run.failure, run.cause, input_hint=prep.input_hint)
    return report


def ranked_records(rows: MergedRows, *, failed: bool, tp: list[list[int]] | None = None,
                   model: nn.Module | None = None) -> list[LayerRecord]:
    """``rows`` merged over every rank (under ``torchrun``; ``tp``: the model's tensor-parallel groups,
    ``distributed.supported_tp_groups``). A rank whose run ``failed`` tells the others (they raise
    ``RanksFailed``) and gets its own rows back, to raise its own failure; when ``model`` runs
    collectives of its own (FSDP2, TP) the others may wait in one of those instead: the failed rank
    deserts the group (``distributed.desert``) and raises without a collective."""
    if failed and model is not None and distributed.runs_collectives(model):
        distributed.desert()
        return rows.records()
    try:
        return rows.records(ranks=True, failed=failed, tp=tp)
    except RanksFailed:
        if not failed:
            raise
        return rows.records()


def data_batches(prep: Prepared, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> Iterator[tuple[int, ModelInputs, tuple[Any, ...], dict[str, Any]]]:
    """Every batch of ``prep.data`` as (index, CPU inputs, placed args, placed kwargs), the first from
    ``args``/``kwargs`` (``running`` placed it), each later one checked against forward's signature
    and placed on the run's device in its dtype as it comes: one batch is held at a time."""
    assert prep.data is not None
    yield 0, prep.inputs, args, kwargs
    rest, index = iter(prep.data.rest), 1
    while True:
        try:  # reading, checking and placing a later batch: DataError naming it (``keep_rows`` adds the rows)
            batch = next(rest, None)
            if batch is None:
                return
            check_signature(prep.loaded.model, batch, how=DATA_SIGNATURE_HOW, where=f"batch {index}: ")
            placed = place_inputs(prep, batch)
        except UsageError as exc:
            named = exc.message if f"batch {index}" in exc.message else f"batch {index}: {exc.message}"
            raise DataError(named, hint=exc.hint) from exc
        yield index, batch, *placed
        index += 1


@contextmanager
def keep_rows(prep: Prepared, report: Report, rows: MergedRows, *, ranks: bool,
              tp: list[list[int]] | None) -> Iterator[None]:
    """Around a run over ``data_batches``: a bad batch (DataError, exit 2) carries the report of the
    batches before it, marked partial (``failure.phase`` "data"), as the model raising carries its rows."""
    try:
        yield
    except DataError as exc:
        report.layers = (ranked_records(rows, failed=True, tp=tp, model=prep.loaded.model) if ranks
                         else rows.records())
        report.failure = FailureInfo("data", None, None, [], type(exc.__cause__ or exc).__name__, exc.message)
        data_source(prep, report, rows)
        exc.report = report
        raise


def add_batch(prep: Prepared, report: Report, rows: MergedRows, run: RunResult, batch: Any, index: int, *,
              ranks: bool, tp: list[list[int]] | None) -> None:
    """Merge batch ``index``'s rows into ``rows``; where the model raised on it, raise the failure with
    the report of the batches so far (that one's included) under ``report``."""
    rows.add(run.layers, run.vectors or {}, batch_size_of(batch))
    if run.failure is not None:
        report.layers = (ranked_records(rows, failed=True, tp=tp, model=prep.loaded.model) if ranks
                         else rows.records())
        data_source(prep, report, rows)
        raise_failure(report, run.failure, run.cause, where=f"batch {index}")


def data_source(prep: Prepared, report: Report, rows: MergedRows, *, done: bool = False) -> None:
    """Say in ``report`` where the batches came from and how many batches and samples were seen:
    each input row's source (its shape and dtype are the first batch's), and the merged rows' notes.
    ``done``: every batch ran on every rank; under ``--shard ddp|fsdp2`` the samples are then counted
    over the ranks' slices (one collective, which a failed run must not wait in)."""
    assert prep.data is not None
    samples = rows.samples
    if done and prep.options.shard in (Shard.ddp, Shard.fsdp2):
        samples = round(rank_stats.rank_mean(float(samples)) * distributed.world_size())
    seen = f"{prep.data.label}, {batches_text(rows.batches)}, {samples} samples"
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
    ranks = distributed.process_group() is not None  # under torchrun: over every rank's batches
    tp = distributed.supported_tp_groups(prep.loaded.model) if ranks else None
    bar, advance = progress.bar(command, prep.data.total, "batches")
    with bar, running(prep) as (model, first_args, first_kwargs), keep_rows(prep, report, rows, ranks=ranks, tp=tp):
        for index, batch, args, kwargs in data_batches(prep, first_args, first_kwargs):
            run = run_step(prep, model, args, kwargs, [Statistics()],
                           RunPlan(collectors=[Merged()], show_phase=False))
            add_batch(prep, report, rows, run, batch, index, ranks=ranks, tp=tp)
            advance(1)
    report.layers = global_rows(prep, rows.records(ranks=ranks, tp=tp))
    data_source(prep, report, rows, done=True)
    if ranks:
        note_ranks(report, tp)
    return report
