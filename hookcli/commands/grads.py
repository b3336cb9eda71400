"""Backward through the model: the loss, output/input gradients per call, parameter gradients.

The engine's run loop (``engine.run.run_step``) runs forward, the loss (``engine.losses``) and backward:
gradients come from ``torch.autograd.grad`` (so no parameter's ``.grad`` is touched) and from tensor
hooks on every selected output tensor; ``--clip`` clamps each parameter gradient to [-clip, clip]
there. This module picks the parameters to report and orders the rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hookcli.errors import UnsupportedError, UsageError
from hookcli.engine.losses import LossChoice, loss_for
from hookcli.engine.model_index import ModelIndex
from hookcli.engine.session import RunObserver, param_record
from hookcli.engine.taps import InputGradients, Statistics, Tap
from hookcli.options import GradSort, RunOptions, Shard, values_of
from hookcli.records import ParamRecord, Report
from hookcli.engine.stats import gradient_stats, iter_tensors

#: Modules of these packages compute on quantized tensors: no backward.
_QUANTIZED_PACKAGES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized",
                       "torch.nn.intrinsic.quantized")


def reached_from(roots: list[tuple[str, Any]], wanted: set[int]) -> dict[int, list[str]]:
    """For each parameter id in ``wanted``: the paths of the ``roots`` (output path, ``grad_fn``) whose
    autograd graph reaches it. Walks the graph's nodes only (no computation; works after backward)."""
    found: dict[int, list[str]] = {}
    for path, root in roots:
        seen: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf tensor
            if variable is not None and id(variable) in wanted:
                found.setdefault(id(variable), []).append(path or "(output)")
            stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return found


SORT_KEYS = values_of(GradSort)


def check_order(sort: str | None, top: int | None) -> None:
    """UsageError for a ``sort`` key or ``top`` count that ``order_rows`` cannot use."""
    if sort is not None and sort not in SORT_KEYS:
        raise UsageError(f"unknown --sort {sort!r}", hint=f"choose one of: {', '.join(SORT_KEYS)}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise UsageError(f"--top must be an integer 1 or more, got {top!r}", hint="e.g. --top 10")


def grads_report(options: RunOptions, *, sort: str | None = None, top: int | None = None) -> Report:
    """``grads``: forward, loss and backward once under the run lock, rows ordered and cut by
    ``sort``/``top`` (``order_rows``; the caller checks them first with ``check_order``).
    ``inference_mode(False)``: a model hookcli builds gets normal tensors, also under the caller's."""
    from hookcli.engine.run import prepare
    from hookcli.engine.state import exclusive

    with exclusive(options.model), torch.inference_mode(False):
        report = backward_report(prepare(options, batched=True), "grads")
    return order_rows(report, sort=sort, top=top)


def _grad_key(grad: dict[str, Any] | None, sort: str) -> float:
    if not grad:
        return -math.inf  # no gradient: last
    value = grad.get("norm") if sort == "norm" else max(abs(grad.get("min") or 0.0), abs(grad.get("max") or 0.0))
    if value is None:
        return -math.inf
    return math.inf if math.isnan(value) else float(value)  # NaN first: it is what one looks for


def natural_key(name: str) -> list[str | int]:
    """Sort key that orders the numbers inside a name by value: ``blocks.9`` before ``blocks.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def order_rows(report: Report, *, sort: str | None, top: int | None) -> Report:
    """The layer and parameter rows sorted by gradient ``norm``, largest ``max`` |gradient| (both
    descending; NaN first, rows without a gradient last) or ``name`` (numbers by value: ``natural_key``),
    and cut to the ``top`` N."""
    if sort is None and top is None:
        return report
    key = sort or "norm"

    def ordered(rows: list[Any]) -> list[Any]:
        if key == "name":
            rows = sorted(rows, key=lambda r: natural_key(r.name))
        else:
            rows = sorted(rows, key=lambda r: -_grad_key(r.grad, key))
        return rows[:top] if top is not None else rows

    shown = {"norm": "gradient norm", "max": "largest |gradient|", "name": "name"}[key]
    total_layers, total_params = len(report.layers), len(report.params or [])
    report.layers = ordered(report.layers)
    if report.params is not None:
        report.params = ordered(report.params)
    if top is not None and (total_layers > top or total_params > top):
        report.notes.append(f"showing the top {top} of {total_layers} layer rows and {total_params} parameters "
                            f"by {shown} (--top)")
    elif sort is not None:
        report.notes.append(f"rows sorted by {shown} (--sort)")
    return report


def param_scope(index: ModelIndex, selection: list[tuple[str, nn.Module]], scope: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters to report, in ``named_parameters()`` order: of the selected modules, all, or none."""
    if scope == "none":
        return []
    named = index.named_parameters()
    if scope == "all":
        return named
    covered = index.subtree_modules([module for _, module in selection])
    wanted = {id(p) for _, module in index.named if id(module) in covered
              for p in module._parameters.values() if p is not None}
    return [(n, p) for n, p in named if id(p) in wanted]


def quantized_modules(model: nn.Module) -> list[str]:
    """``name (Type)`` of every module that computes on quantized tensors (they have no backward)."""
    found: list[str] = []
    inside: list[str] = []
    for name, m in model.named_modules():
        package = type(m).__module__
        if package.startswith(_QUANTIZED_PACKAGES) and not any(name.startswith(p + ".") for p in inside):
            inside.append(name)
            found.append(f"{name or '(model)'} ({package.split('.modules')[0]}.{type(m).__name__})")
    return found


def no_gradients(prep: Any) -> UnsupportedError:
    """The error for a model whose loss reaches no parameter or input: quantized, or all frozen."""
    model = prep.loaded.model
    quantized = quantized_modules(model)
    if quantized:
        shown = ", ".join(quantized[:3]) + (f", ... ({len(quantized)} in all)" if len(quantized) > 3 else "")
        return UnsupportedError(
            f"{prep.info.spec} has no gradients: it is quantized ({shown}), and quantized ops and "
            "integer outputs have no backward",
            hint="run hookcli stats or shapes on it, or grads on the float model before quantization")
    return UnsupportedError(
        f"{prep.info.spec} has no gradients: the loss does not depend on any parameter or input that requires grad",
        hint="set requires_grad on the parameters (or pick a float output with --output-key); "
        "stats and shapes need no gradients")


def _refuse_inference_tensors(index: ModelIndex) -> None:
    """Parameters/buffers made under ``torch.inference_mode`` cannot take part in a backward pass."""
    named = index.named_parameters() + index.named_buffers()
    inference = [name for name, t in named if t.is_inference()]
    if inference:
        raise UnsupportedError(
            f"the model's tensors ({', '.join(inference[:3])}{', ...' if len(inference) > 3 else ''}) are "
            "inference tensors: it was built or loaded under torch.inference_mode, and those cannot be used "
            "in a backward pass",
            hint="build or load the model outside torch.inference_mode (and call hookcli.grads/check outside it); "
            "stats and shapes work on it as it is")


def refuse_sharded_check(prep: Any, command: str) -> None:
    """UnsupportedError for ``check --shard fsdp2|tp``: some of check's rules (the copies it trains or
    probes, parameter norms) work on the model each rank holds, a part of a sharded one (ddp's are whole copies).
    UsageError under ``--shard ddp|fsdp2`` when the global batch leaves a rank an empty slice: its loss
    would raise there while the others wait in the backward's collectives."""
    if command == "check" and prep.options.shard in (Shard.fsdp2, Shard.tp):
        raise UnsupportedError(f"check --shard {prep.options.shard} is not supported: some of check's rules work on the "
                               "model each rank holds, and each rank holds only part of a sharded model",
                               hint="check with --shard ddp, or run stats / grads --shard "
                                    f"{prep.options.shard} for the model's numbers")
    from hookcli.engine import distributed

    if command == "check" and distributed.runs_collectives(prep.loaded.model):  # every rank decides alike
        raise UnsupportedError("check is not supported on a model sharded over the ranks (FSDP2, tensor parallel): "
                               "some of check's rules (the copies it steps and probes, per-channel dead units, "
                               "parameter norms) work on the model each rank holds, a part of it",
                               hint="check a plain or DistributedDataParallel copy of the model, or take its "
                                    "numbers with hookcli.stats / hookcli.grads, which merge the shards")
    refuse_empty_slices(prep, command, prep.inputs)


def refuse_empty_slices(prep: Any, command: str, inputs: Any, where: str = "") -> None:
    """UsageError under ``--shard ddp|fsdp2`` when the global batch of ``inputs`` (its input rows: the
    whole batch's, before ``rank_slice``) leaves a rank an empty slice: its loss would raise there while
    the others wait in the backward's collectives. Every rank decides alike, before running the batch
    (``where``: which batch of ``--data``, whose last one may be smaller than the world)."""
    if prep.options.shard in (Shard.ddp, Shard.fsdp2):
        world = torch.distributed.get_world_size()
        whole = next((info.shape[0] for info in inputs.infos if info.shape), None)  # the global batch's
        if whole is not None and whole < world:  # every rank decides alike: none is left waiting in a collective
            raise UsageError(f"{command} --shard {prep.options.shard}: {where}a batch of {whole} sample(s) leaves "
                             f"some of the {world} ranks an empty slice, and a loss over no values has no gradient",
                             hint=f"give batches of at least {world} samples (one a rank; with --data, a batch size "
                                  "that leaves a last batch that large, or --batches), or run on fewer ranks")


def backward_report(prep: Any, command: str = "grads", *, stats: bool = False,
                    observer: RunObserver | None = None) -> Report:
    """Forward with gradients, build the loss, backward once; report output and parameter gradients.

    The model's parameters keep their ``.grad`` and ``requires_grad`` (``autograd.grad`` writes none).
    Gradients are enabled for the run, also under the caller's ``torch.no_grad`` or
    ``torch.inference_mode``. Raises ModelRaisedError with the partial report when forward or
    backward raises (or the model calls ``sys.exit``); UnsupportedError when the model has no
    gradients (quantized, or nothing requires grad), is TorchScript, or holds inference tensors;
    InternalError when hookcli's own hooks (or ``observer``) fail. ``observer`` measures more
    during the run (see ``RunObserver``; ``check`` uses it).
    """
    from hookcli.engine.run import require_values
    from hookcli.engine.loading import refuse_torchscript

    refuse_sharded_check(prep, command)
    if prep.data is not None and command == "grads" and observer is None:
        return data_backward_report(prep, command)
    require_values(prep, command)
    refuse_torchscript(prep.loaded.model, prep.selection)
    _refuse_inference_tensors(prep.index)
    with torch.inference_mode(False):
        return _backward_report(prep, command, stats=stats, observer=observer)


def _backward_report(prep: Any, command: str, *, stats: bool, observer: RunObserver | None) -> Report:
    from hookcli.engine import distributed, rank_stats
    from hookcli.engine.collectors import Collector, FlopCount, Merged, Observed, ParamStats
    from hookcli.engine.run import RunPlan, global_rows, new_report, note_ranks, raise_failure, run_step, running

    opts = prep.options
    # under torchrun, ``grads`` and ``check`` are over every rank's batch (docs/distributed.md)
    ranks = (command == "check" or command == "grads" and observer is None) and distributed.process_group() is not None
    tp = distributed.supported_tp_groups(prep.loaded.model) if ranks else None
    if ranks and opts.clip is not None and any(distributed.is_sharded(name, p)
                                               for name, p in prep.loaded.model.named_parameters()):
        # FSDP2's backward runs on unsharded copies (the clipping hooks on the shards never fire); a
        # DTensor's clipped count is not a number of this rank's
        raise UnsupportedError("--clip cannot go with parameters sharded over the ranks (FSDP2, tensor parallel)",
                               hint="leave --clip out under torchrun, or clip a plain or DDP model's gradients")
    report = new_report(prep, command)
    taps: list[Tap] = [*([Statistics()] if stats else []), *([InputGradients()] if opts.input_grads else [])]

    def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module
             ) -> tuple[torch.Tensor, tuple[LossChoice, list[tuple[str, Any]]]]:
        choice = loss_for(output, opts, (args, kwargs), model)
        # the other outputs' graphs: which of them a parameter without a gradient still feeds
        others = [(path, t.grad_fn) for path, t in iter_tensors(output)
                  if path != choice.output and t.grad_fn is not None]
        if not choice.value.requires_grad:
            raise no_gradients(prep)
        return choice.value, (choice, others)

    # parameters are read inside ``running``: moving the model may replace its parameter objects
    with running(prep) as (model, args, kwargs):
        scope = param_scope(prep.index, prep.selection, opts.params)
        collect: list[Collector] = [FlopCount()] if opts.flops else []
        collect += [ParamStats(scope, opts.clip)]  # (Observed after it: it marks unused ones)
        collect += [Observed(observer)] if observer is not None else []
        collect += [Merged(scope)] if ranks else []
        run = run_step(prep, model, args, kwargs, taps, RunPlan(loss=loss, collectors=collect))
        if ranks:
            _over_ranks(prep, run, scope, tp)
    if run.failure is None and not run.reached:  # e.g. quantized ops: backward reached nothing
        raise no_gradients(prep)
    report.layers = global_rows(prep, run.layers)
    if run.unreached and run.loss is not None:
        reaches = reached_from(run.loss[1], {id(p) for p in run.unreached.values()})
        for record in run.params:
            if record.name in run.unreached:
                record.other_outputs = reaches.get(id(run.unreached[record.name]), [])
    report.params = run.params if opts.params != "none" else None
    if opts.params == "selected" and not run.params:
        report.notes.append("the selected modules have no parameters (--params all lists every parameter)")
    if run.loss is not None:
        report.loss = run.loss[0].info(rank_stats.rank_mean(run.loss_value) if ranks and run.failure is None
                                       else run.loss_value)
        if (unused := run.loss[0].unused_target(opts.target)) is not None:
            report.notes.append(unused)
    if ranks:
        note_ranks(report, tp)
    if run.flops is not None:
        report.flops = run.flops
    quantized = quantized_modules(model)
    if quantized:
        report.notes.append("no gradient flows back through quantized modules: " + ", ".join(quantized[:5])
                            + (", ..." if len(quantized) > 5 else ""))
    if opts.clip is not None:
        report.notes.append(f"parameter gradients clipped to [-{opts.clip:g}, {opts.clip:g}] by tensor hooks")
    if run.failure is not None:
        raise_failure(report, run.failure, run.cause, input_hint=prep.input_hint)
    return report


def _over_ranks(prep: Any, run: Any, scope: list[tuple[str, nn.Parameter]], tp: list[list[int]] | None) -> None:
    """``run``'s layer rows and parameter gradients merged over the ranks (under ``torchrun``; ``tp``:
    ``distributed.supported_tp_groups``): the layers' statistics over every rank's batch, each
    parameter's gradient and norm over the ranks (``rank_stats.param_rows``: a copy's gradient the
    ranks' mean, DDP's; a shard's merged with the others)."""
    from hookcli.engine import rank_stats
    from hookcli.engine.batches import MergedRows, batch_size_of
    from hookcli.engine.run import ranked_records

    rows = MergedRows()
    rows.add(run.layers, run.vectors or {}, batch_size_of(prep.inputs))
    run.layers = ranked_records(rows, failed=run.failure is not None, tp=tp, model=prep.loaded.model)
    if run.failure is not None:
        return
    over = rank_stats.param_rows(scope, run.gradients or {}, tp)
    for record in run.params:
        if record.name in over:
            grad, record.norm = over[record.name]
            if grad is not None:
                record.grad = gradient_stats(grad, abs_max=True)


def _refuse_data_run(prep: Any, command: str) -> None:
    """UsageError for the flags a run over many batches refuses; what ``backward_report`` refuses too."""
    from hookcli.engine.loading import refuse_torchscript
    from hookcli.engine.run import require_values

    opts = prep.options
    given = [flag for flag, on in (("--flops", opts.flops), ("--input-grads", opts.input_grads),
                                   ("--clip", opts.clip is not None)) if on]
    if given:
        raise UsageError(f"{', '.join(given)} cannot go with --data (a run over many batches)",
                         hint="leave them out, or run one batch with --input / --input-shape")
    refuse_sharded_check(prep, command)
    require_values(prep, command)
    refuse_torchscript(prep.loaded.model, prep.selection)
    _refuse_inference_tensors(prep.index)


def _add_gradients(sums: dict[str, torch.Tensor], gradients: Mapping[str, torch.Tensor | None] | None) -> None:
    """A batch's parameter gradients summed into ``sums`` (in at least float32: many float16 terms
    would lose digits)."""
    for name, g in (gradients or {}).items():
        if g is not None:
            have = sums.get(name)
            sums[name] = g.detach().to(torch.promote_types(g.dtype, torch.float32), copy=True) \
                if have is None else have.add_(g)


def _mean_gradient_records(prep: Any, reported: list[tuple[str, nn.Parameter]], sums: dict[str, torch.Tensor],
                           count: int, tp: list[list[int]] | None) -> list[ParamRecord] | None:
    """Each reported parameter's row of the mean gradient over the ``count`` batches (``sums`` divided
    in place), over the ranks under ``torchrun`` (every rank takes part, also with ``--params none``)."""
    from hookcli.engine import rank_stats

    over = rank_stats.param_rows(reported, {name: sums[name].div_(count) for name in sums}, tp)
    if prep.options.params == "none":
        return None
    return [param_record(name, p, over[name][1], over[name][0]) for name, p in reported]


def data_backward_report(prep: Any, command: str = "grads", *, stats: bool = False) -> Report:
    """``grads`` over every batch of ``--data``: one forward and backward per batch (the engine's
    ``run_step``).

    What the rows mean over many batches: each layer row's output gradient is that of its batch's loss,
    and its statistics are merged over the batches (the distribution of the per-batch gradients, as
    activation statistics are merged); each parameter's gradient is that of the *mean* of the batch
    losses (the per-batch gradients summed, one tensor per parameter as ``.grad`` accumulates, divided
    by the number of batches), which is what a training step over those batches would apply; the loss
    is the mean of the batch losses. ``--flops``, ``--input-grads`` and ``--clip`` are refused with
    ``--data`` (exit 2). The model raising on a batch is ModelRaisedError naming the batch, with the rows
    merged so far. ``stats``: activation statistics too, merged the same way (``check``)."""
    from hookcli.progress import bar as progress_bar
    from hookcli.engine.batches import MergedRows
    from hookcli.engine import distributed
    from hookcli.engine.collectors import Merged, ParamStats
    from hookcli.engine.run import (RunPlan, add_batch, data_batches, keep_rows, new_report,
                                    ranked_records, run_step, running)

    opts = prep.options
    _refuse_data_run(prep, command)
    report = new_report(prep, command)
    rows = MergedRows()
    ranks = distributed.process_group() is not None  # under torchrun: over every rank's batches
    tp = distributed.supported_tp_groups(prep.loaded.model) if ranks else None
    sums: dict[str, torch.Tensor] = {}  # parameter name -> sum of its per-batch gradients
    losses: list[float] = []
    choice: LossChoice | None = None

    def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module
             ) -> tuple[torch.Tensor, LossChoice]:
        made = loss_for(output, opts, (args, kwargs), model)
        if not made.value.requires_grad:
            raise no_gradients(prep)
        return made.value, made

    bar, advance = progress_bar(command, prep.data.total, "batches")
    with (torch.inference_mode(False), bar, running(prep) as (model, first_args, first_kwargs),
          keep_rows(prep, report, rows, ranks=ranks, tp=tp)):
        reported = param_scope(prep.index, prep.selection, opts.params)
        for index, batch, args, kwargs in data_batches(prep, first_args, first_kwargs):
            refuse_empty_slices(prep, command, batch, where=f"batch {index}: ")
            run = run_step(prep, model, args, kwargs, [Statistics()] if stats else [],
                           RunPlan(loss=loss, collectors=[ParamStats(reported), Merged(reported)], show_phase=False))
            add_batch(prep, report, rows, run, batch, index, ranks=ranks, tp=tp)
            if not run.reached:
                raise no_gradients(prep)
            _add_gradients(sums, run.gradients)
            choice = run.loss
            losses.append(float(run.loss_value) if run.loss_value is not None else math.nan)
            advance(1)
        count = len(losses)
        if ranks:  # the layers' rows first: a rank whose model raised waits in that collective
            report.layers = ranked_records(rows, failed=False, tp=tp)
        report.params = _mean_gradient_records(prep, reported, sums, count, tp)
    if not ranks:
        report.layers = rows.records()
    _finish_data_report(prep, report, rows, choice, losses, ranks, tp)
    return report


def _finish_data_report(prep: Any, report: Report, rows: Any, choice: LossChoice | None, losses: list[float],
                        ranks: bool, tp: list[list[int]] | None) -> None:
    """What ``data_backward_report`` adds after its batches: the global layer rows, the data source, the
    mean loss over the batches (and the ranks) and the notes that say what the rows are of."""
    from hookcli.engine import distributed, rank_stats
    from hookcli.engine.run import data_source, global_rows, note_ranks

    count = len(losses)
    report.layers = global_rows(prep, report.layers)
    data_source(prep, report, rows, done=True)
    if choice is not None:
        report.loss = choice.info(rank_stats.rank_mean(math.fsum(losses) / count))
        if (unused := choice.unused_target(prep.options.target)) is not None:
            report.notes.append(unused)
    if ranks:
        note_ranks(report, tp)
    where = f"{count} batches" + (f" of {distributed.batch_owners(tp)}" if ranks else "")
    report.notes.append(f"parameter gradients: of the mean loss over the {where}; layer gradients: "
                        "of each batch's loss, their statistics merged")
