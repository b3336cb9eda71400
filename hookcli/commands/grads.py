"""Backward through the model: the loss, output/input gradients per call, parameter gradients.

The engine's run loop (``engine.run.run_step``) runs forward, the loss built here and backward:
gradients come from ``torch.autograd.grad`` (so no parameter's ``.grad`` is touched) and from tensor
hooks on every selected output tensor; ``--clip`` clamps each parameter gradient to [-clip, clip]
there. This module picks the loss, the parameters to report and orders the rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookcli.errors import HookcliError, UnsupportedError, UsageError
from hookcli.engine.model_index import ModelIndex
from hookcli.engine.session import HookOptions, RunObserver
from hookcli.options import GradSort, Loss, RunOptions, Shard, output_key_path, values_of
from hookcli.records import ParamRecord, Report
from hookcli.engine.stats import gradient_stats, iter_tensors, shape_of

LOSS_NAMES = {Loss.ce: "cross_entropy", Loss.nll: "nll", Loss.mean_square: "mean_square", Loss.sum: "sum",
              Loss.mean: "mean"}
#: Modules of these packages compute on quantized tensors: no backward.
_QUANTIZED_PACKAGES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized",
                       "torch.nn.intrinsic.quantized")


@dataclass
class LossChoice:
    """The loss a backward pass starts from, and what it was built from (``report.loss``)."""

    kind: str  # model_loss | cross_entropy | nll | mean_square | sum | mean
    output: str  # path of the tensor in the model output the loss was built from
    target: int | None  # the class index of a (batch, classes) cross-entropy, else None
    value: torch.Tensor
    targets: str | None = None  # what the targets were, in words ("next token of input_ids", ...)

    def info(self, value: float) -> dict[str, Any]:
        return {"kind": self.kind, "output": self.output, "target": self.target, "targets": self.targets,
                "value": value}


def _is_model_loss(path: str, tensor: torch.Tensor) -> bool:
    """A scalar float entry named ``loss`` at the top of the output (``ModelOutput.loss``, ``{'loss': ...}``)."""
    return tensor.dim() == 0 and path in ("['loss']", ".loss")


def loss_collection(output: Any) -> list[tuple[str, torch.Tensor]] | None:
    """The entries of a dict, list or tuple output that holds only scalar float losses (torchvision
    detection in train mode: ``loss_classifier``, ``loss_box_reg``, ...), two or more; else None.
    Scalars that do not require grad (a metric such as an accuracy beside the loss) are left out when
    some do: they are not losses training would sum."""
    if not isinstance(output, (Mapping, list, tuple)) or isinstance(output, torch.Tensor):
        return None
    tensors = list(iter_tensors(output))
    if len(tensors) < 2 or not all(t.dim() == 0 and t.is_floating_point() for _, t in tensors):
        return None
    return [(path, t) for path, t in tensors if t.requires_grad] or tensors


def pick_output(output: Any, key: str | None, *, skip_loss: bool = False) -> tuple[str, torch.Tensor]:
    """The tensor the loss is built from: the output itself, ``--output-key``, or the first float tensor
    that holds values (an empty one, such as no detections, would give a NaN loss). The model's own
    scalar ``loss`` entry comes first, unless ``skip_loss`` (an explicitly chosen loss)."""
    tensors = [(path, t if t.layout == torch.strided else t.to_dense())  # a sparse output: its dense values
               for path, t in iter_tensors(output) if t.is_floating_point()]
    if not tensors:
        raise UnsupportedError("the model output holds no floating-point tensor to build a loss from",
                               hint="gradients need a float output; run hookcli stats or shapes on this model")
    if key is None:
        filled = [(p, t) for p, t in tensors if t.numel() > 0]
        if not filled:
            shown = ", ".join(f"{p or '(output)'} {shape_of(t)}" for p, t in tensors[:4])
            raise UnsupportedError(
                f"every floating tensor of the model output is empty ({shown}{', ...' if len(tensors) > 4 else ''}): "
                "a loss over no values would be NaN, with all gradients zero",
                hint="give an input the model outputs values for; a detection model in --train mode with "
                "targets (an --input .pt file holding the images and their targets) returns its losses")
        if skip_loss:
            return next(((p, t) for p, t in filled if not _is_model_loss(p, t)), filled[0])
        return next(((p, t) for p, t in filled if _is_model_loss(p, t)), filled[0])
    path = output_key_path(key, (p for p, _ in tensors))
    if path is not None:
        return path, dict(tensors)[path]
    raise UsageError(
        f"--output-key {key!r} is not in the model output",
        hint="floating tensors in the output: " + ", ".join(p or "(output)" for p in (p for p, _ in tensors)),
    )


#: Keyword inputs that hold the tokens a sequence's logits predict, most specific first.
_TOKEN_NAMES = ("decoder_input_ids", "input_ids")


def _token_inputs(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    """Integer ``[batch, seq]`` tensors among the model inputs ``(args, kwargs)``, named ones first."""
    if inputs is None:
        return []
    args, kwargs = inputs
    named = [(n, kwargs[n]) for n in _TOKEN_NAMES if isinstance(kwargs.get(n), torch.Tensor)]
    rest = [(f"input {path}", t) for path, t in iter_tensors((args, {k: v for k, v in kwargs.items()
                                                                    if k not in _TOKEN_NAMES}))]
    return [(n, t) for n, t in named + rest
            if t.dim() == 2 and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]


def _vocab_sizes(model: nn.Module | None) -> set[int]:
    return {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)} if model is not None else set()


def is_sequence_logits(path: str, out: torch.Tensor, model: nn.Module | None, inputs: Any) -> bool:
    """A ``[batch, seq, vocab]`` output that holds logits: it is named ``logits``, or its last dimension
    is the size of one of the model's ``nn.Embedding`` tables and integer tokens ``[batch, seq]`` are
    among the inputs (a language model's head). Hidden states ``[batch, seq, hidden]`` are neither."""
    if out.dim() != 3 or out.shape[-1] < 2:
        return False
    if "logits" in path.lower():
        return True
    return out.shape[-1] in _vocab_sizes(model) and any(
        tuple(t.shape) == tuple(out.shape[:2]) for _, t in _token_inputs(inputs))


def sequence_targets(out: torch.Tensor, inputs: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Logits and targets for a per-token cross-entropy over ``[batch, seq, vocab]``.

    Next-token targets (position t predicts token t+1, so the last position is dropped) when integer
    tokens of the same ``[batch, seq]`` below ``vocab`` are among the inputs (``decoder_input_ids``, then
    ``input_ids``, then any); else random targets ``randint(0, vocab)`` from a generator seeded with ``seed``.
    """
    batch, seq, vocab = out.shape
    if seq >= 2:
        for name, ids in _token_inputs(inputs):
            if tuple(ids.shape) == (batch, seq) and 0 <= int(ids.min()) and int(ids.max()) < vocab:
                return out[:, :-1], ids[:, 1:].to(out.device, torch.long), f"next token of {name}"
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen).to(out.device)
    return out, labels, f"randint(0, {vocab}, seed={seed}) per token"


def _in_loss_precision(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the precision the loss is computed in: float32, or float64 for a float64 output
    (a float64 model's loss and gradients were rounded to float32, and its outputs above 3e38 became inf)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def build_loss(output: Any, *, loss: str, target: int, output_key: str | None, inputs: Any = None,
               model: nn.Module | None = None, seed: int = 0) -> LossChoice:
    """The loss to backpropagate from the model's ``output``.

    ``auto`` picks, in order: the sum of a dict/list/tuple output of scalar losses (``loss_collection``,
    as training sums them); the model's own scalar ``loss`` entry (a ModelOutput or dict that has one) or
    a scalar output; per-token cross-entropy over the last dimension for ``[batch, seq, vocab]``
    logits (:func:`is_sequence_logits`; targets from :func:`sequence_targets`); cross-entropy against
    class ``target`` for ``[batch, classes]``; otherwise the mean of squares, ``mean(x**2)`` (its
    gradient ``2x/numel`` never cancels out the way a sum's does after a normalisation layer).
    ``inputs`` is ``(args, kwargs)`` of the run (for next-token targets), ``model`` the model (its
    embedding sizes tell logits from hidden states).
    """
    loss = Loss(loss)
    losses = loss_collection(output) if loss == Loss.auto and output_key is None else None
    if losses is not None:
        value = torch.stack([_in_loss_precision(t) for _, t in losses]).sum()
        return LossChoice("model_loss", "sum of " + ", ".join(p for p, _ in losses), None, value)
    path, out = pick_output(output, output_key, skip_loss=loss != Loss.auto)
    if loss == Loss.auto:
        if out.dim() == 0 and (output_key is not None or _is_model_loss(path, out) or path == ""):
            return LossChoice("model_loss", path, None, _in_loss_precision(out), "the model's own loss")
        if is_sequence_logits(path, out, model, inputs):
            loss = Loss.ce
        elif out.dim() == 2 and out.shape[1] > 1:
            loss = Loss.ce
        else:
            loss = Loss.mean_square
    if loss in (Loss.ce, Loss.nll):
        if out.dim() < 2:
            raise UsageError(f"--loss {loss} needs (batch, classes) output, got shape {shape_of(out)}",
                             hint="use --loss mean_square, sum or mean")
        fn = F.cross_entropy if loss == Loss.ce else F.nll_loss
        if out.dim() == 3:  # [batch, seq, vocab]: per token, classes on the last dimension
            logits, labels, described = sequence_targets(out, inputs, seed)
            value = fn(_in_loss_precision(logits).reshape(-1, out.shape[-1]), labels.reshape(-1))
            return LossChoice(LOSS_NAMES[loss], path, None, value, described)
        if target >= out.shape[1]:
            raise UsageError(f"--target {target} is out of range for {out.shape[1]} classes",
                             hint=f"give --target 0 to {out.shape[1] - 1}")
        # [batch, classes] or [batch, classes, d1, ...] (segmentation): class ``target`` everywhere
        labels = torch.full((out.shape[0], *out.shape[2:]), target, dtype=torch.long, device=out.device)
        value = fn(_in_loss_precision(out), labels)
        return LossChoice(LOSS_NAMES[loss], path, target, value)  # ``target`` says it
    if loss == Loss.mean_square:
        return LossChoice(LOSS_NAMES[loss], path, None, _in_loss_precision(out).square().mean())
    value = _in_loss_precision(out).sum() if loss == Loss.sum else _in_loss_precision(out).mean()
    return LossChoice(LOSS_NAMES[loss], path, None, value)


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


def loss_for(output: Any, opts: Any, inputs: Any = None, model: nn.Module | None = None) -> LossChoice:
    """``build_loss`` on the model's output; a failure there is hookcli's (it cannot build a loss from
    that output: UnsupportedError), never the model's."""
    try:
        return build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key,
                          inputs=inputs, model=model, seed=opts.seed)
    except HookcliError:
        raise
    except Exception as exc:
        kinds = ", ".join(sorted({f"{t.dtype} {t.layout}".replace("torch.", "") for _, t in iter_tensors(output)}))
        raise UnsupportedError(
            f"cannot build a loss from the model output ({kinds or 'no tensors'}): {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            hint="choose the tensor with --output-key and the loss with --loss sum or mean; "
            "stats and shapes need no loss") from exc


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
    from hookcli.engine import distributed
    from hookcli.engine.collectors import Collector, Merged, Observed, ParamStats
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
    hooks = HookOptions(stats=stats, input_grads=opts.input_grads, flops=opts.flops)

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
        collect: list[Collector] = [ParamStats(scope, opts.clip)]  # (Observed after it: it marks unused ones)
        collect += [Observed(observer)] if observer is not None else []
        collect += [Merged(scope)] if ranks else []
        run = run_step(prep, model, args, kwargs, hooks, RunPlan(loss=loss, collectors=collect))
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
        report.loss = run.loss[0].info(distributed.rank_mean(run.loss_value) if ranks and run.failure is None
                                       else run.loss_value)
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
    parameter's gradient and norm over the ranks (``distributed.param_rows``: a copy's gradient the
    ranks' mean, DDP's; a shard's merged with the others)."""
    from hookcli.engine import distributed
    from hookcli.engine.batches import MergedRows, batch_size_of
    from hookcli.engine.run import ranked_records

    rows = MergedRows()
    rows.add(run.layers, run.vectors or {}, batch_size_of(prep.inputs))
    run.layers = ranked_records(rows, failed=run.failure is not None, tp=tp, model=prep.loaded.model)
    if run.failure is not None:
        return
    over = distributed.param_rows(scope, run.gradients or {}, tp)
    for record in run.params:
        if record.name in over:
            grad, record.norm = over[record.name]
            if grad is not None:
                record.grad = gradient_stats(grad, abs_max=True)


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
    from hookcli.engine.loading import refuse_torchscript
    from hookcli.engine import distributed
    from hookcli.engine.collectors import Merged, ParamStats
    from hookcli.engine.run import (RunPlan, add_batch, data_batches, data_source, global_rows, keep_rows, new_report,
                                    note_ranks, ranked_records, require_values, run_step, running)

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
            run = run_step(prep, model, args, kwargs, HookOptions(stats=stats),
                           RunPlan(loss=loss, collectors=[ParamStats(reported), Merged(reported)], show_phase=False))
            add_batch(prep, report, rows, run, batch, index, ranks=ranks, tp=tp)
            if not run.reached:
                raise no_gradients(prep)
            for name, g in (run.gradients or {}).items():
                if g is not None:  # summed in at least float32: many float16 terms would lose digits
                    have = sums.get(name)
                    sums[name] = g.detach().to(torch.promote_types(g.dtype, torch.float32), copy=True) \
                        if have is None else have.add_(g)
            choice = run.loss
            losses.append(float(run.loss_value) if run.loss_value is not None else math.nan)
            advance(1)
        count = len(losses)
        if ranks:  # the layers' rows first: a rank whose model raised waits in that collective
            report.layers = ranked_records(rows, failed=False, tp=tp)
        over = distributed.param_rows(reported, {name: sums[name].div_(count) for name in sums}, tp)
        report.params = [ParamRecord(name=name, shape=shape_of(p), requires_grad=p.requires_grad,
                                     norm=over[name][1],
                                     grad=gradient_stats(over[name][0], abs_max=True) if over[name][0] is not None
                                     else None)
                         for name, p in reported] if opts.params != "none" else None
    if not ranks:
        report.layers = rows.records()
    report.layers = global_rows(prep, report.layers)
    data_source(prep, report, rows, done=True)
    if choice is not None:
        report.loss = choice.info(distributed.rank_mean(math.fsum(losses) / count))
    if ranks:
        note_ranks(report, tp)
    where = f"{count} batches" + (f" of {distributed.batch_owners(tp)}" if ranks else "")
    report.notes.append(f"parameter gradients: of the mean loss over the {where}; layer gradients: "
                        "of each batch's loss, their statistics merged")
    return report
