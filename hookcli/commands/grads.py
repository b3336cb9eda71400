"""Backward through the model: the loss, output/input gradients per call, parameter gradients.

Gradients come from ``torch.autograd.grad`` (so no parameter's ``.grad`` is touched) and from tensor
hooks that the engine session (``engine.session.attach``) registers on every selected output tensor.
``--clip`` is the seeds' gradient clipper: tensor hooks on the parameters clamp each gradient to
[-clip, clip] (``engine.session.clipped_gradients``).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookcli import progress
from hookcli.errors import HookcliError, UnsupportedError, UsageError
from hookcli.engine.flops import FlopCounter
from hookcli.engine.session import HookOptions, RunObserver, attach, clipped_gradients
from hookcli.options import Loss, output_key_path
from hookcli.records import FailureInfo, ParamRecord, Report
from hookcli.engine.stats import Vector, device_float, gradient_stats, iter_tensors, shape_of

LOSS_NAMES = {Loss.ce: "cross_entropy", Loss.nll: "nll", Loss.sum: "sum", Loss.mean: "mean"}
#: Modules of these packages compute on quantized tensors: no backward.
_QUANTIZED_PACKAGES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized",
                       "torch.nn.intrinsic.quantized")


@dataclass
class LossChoice:
    kind: str  # cross_entropy | nll | sum | mean
    output: str  # path of the tensor in the model output the loss was built from
    target: int | None
    value: torch.Tensor

    def info(self, value: float) -> dict[str, Any]:
        return {"kind": self.kind, "output": self.output, "target": self.target, "value": value}


def pick_output(output: Any, key: str | None) -> tuple[str, torch.Tensor]:
    """The tensor the loss is built from: the output itself, ``--output-key``, or the first float tensor."""
    tensors = [(path, t if t.layout == torch.strided else t.to_dense())  # a sparse output: its dense values
               for path, t in iter_tensors(output) if t.is_floating_point()]
    if not tensors:
        raise UnsupportedError("the model output holds no floating-point tensor to build a loss from",
                               hint="gradients need a float output; run hookcli stats or shapes on this model")
    if key is None:
        return tensors[0]
    path = output_key_path(key, (p for p, _ in tensors))
    if path is not None:
        return path, dict(tensors)[path]
    raise UsageError(
        f"--output-key {key!r} is not in the model output",
        hint="floating tensors in the output: " + ", ".join(p or "(output)" for p, _ in tensors),
    )


def build_loss(output: Any, *, loss: str, target: int, output_key: str | None) -> LossChoice:
    """Cross-entropy against ``target`` for (batch, classes) logits by default, else the sum."""
    path, out = pick_output(output, output_key)
    loss = Loss(loss)
    if loss == Loss.auto:
        loss = Loss.ce if out.dim() == 2 and out.shape[1] > 1 else Loss.sum
    if loss in (Loss.ce, Loss.nll):
        if out.dim() < 2:
            raise UsageError(f"--loss {loss} needs (batch, classes) output, got shape {shape_of(out)}",
                             hint="use --loss sum or --loss mean")
        if target >= out.shape[1]:
            raise UsageError(f"--target {target} is out of range for {out.shape[1]} classes",
                             hint=f"give --target 0 to {out.shape[1] - 1}")
        labels = torch.full((out.shape[0],), target, dtype=torch.long, device=out.device)
        fn = F.cross_entropy if loss == Loss.ce else F.nll_loss
        value = fn(out.float(), labels)
        return LossChoice(LOSS_NAMES[loss], path, target, value)
    value = out.float().sum() if loss == Loss.sum else out.float().mean()
    return LossChoice(LOSS_NAMES[loss], path, None, value)


def require_grad(obj: Any) -> Any:
    """Fresh leaf copies of the floating tensors in a nested input, with ``requires_grad`` (an
    inference tensor, made under the caller's ``torch.inference_mode``, is copied out of it)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_inference():
            obj = obj.clone()  # outside inference mode (backward_report's), a normal tensor
        return obj.detach().requires_grad_(True) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(require_grad(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(require_grad(v) for v in obj)
    if isinstance(obj, dict):
        return {k: require_grad(v) for k, v in obj.items()}
    return obj


def _loss(output: Any, opts: Any) -> LossChoice:
    """``build_loss`` on the model's output; a failure there is hookcli's (it cannot build a loss from
    that output: UnsupportedError), never the model's."""
    try:
        return build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key)
    except HookcliError:
        raise
    except Exception as exc:
        kinds = ", ".join(sorted({f"{t.dtype} {t.layout}".replace("torch.", "") for _, t in iter_tensors(output)}))
        raise UnsupportedError(
            f"cannot build a loss from the model output ({kinds or 'no tensors'}): {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            hint="choose the tensor with --output-key and the loss with --loss sum or mean; "
            "stats and shapes need no loss") from exc


def param_scope(model: nn.Module, selection: list[tuple[str, nn.Module]], scope: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters to report, in ``named_parameters()`` order: of the selected modules, all, or none."""
    if scope == "none":
        return []
    named = list(model.named_parameters())
    if scope == "all":
        return named
    wanted = {id(p) for _, module in selection for p in module.parameters()}
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


def _refuse_inference_tensors(model: nn.Module) -> None:
    """Parameters/buffers made under ``torch.inference_mode`` cannot take part in a backward pass."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    inference = [name for name, t in named if t.is_inference()]
    if inference:
        raise UnsupportedError(
            f"the model's tensors ({', '.join(inference[:3])}{', ...' if len(inference) > 3 else ''}) are "
            "inference tensors: it was built or loaded under torch.inference_mode, and those cannot be used "
            "in a backward pass",
            hint="build or load the model outside torch.inference_mode (and call hookcli.grads/check outside it); "
            "stats and shapes work on it as it is")


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

    require_values(prep, command)
    refuse_torchscript(prep.loaded.model, prep.selection)
    _refuse_inference_tensors(prep.loaded.model)
    with torch.inference_mode(False):
        return _backward_report(prep, command, stats=stats, observer=observer)


def _backward_report(prep: Any, command: str, *, stats: bool, observer: RunObserver | None) -> Report:
    from hookcli.engine.run import blame, new_report, params_by_module, raise_failure, running

    opts = prep.options
    report = new_report(prep, command)
    failure: FailureInfo | None = None
    cause: BaseException | None = None
    loss_choice: LossChoice | None = None
    grads: dict[int, torch.Tensor | None] = {}
    hook_options = HookOptions(stats=stats, grads=True, input_grads=opts.input_grads, flops=opts.flops,
                               observe=observer.tensor if observer is not None and observer.wants_tensors else None)
    forward_flops: FlopCounter | None = None
    backward_flops: FlopCounter | None = None
    # parameters are read inside ``running``: moving the model may replace its parameter objects
    with running(prep) as (model, args, kwargs), \
            clipped_gradients(all_params := list(model.named_parameters()), opts.clip) as clipped:
        reported = param_scope(model, prep.selection, opts.params)
        args, kwargs = require_grad(args), require_grad(kwargs)
        with attach(model, prep.selection, hook_options) as session:
            phase = "forward"
            if opts.flops:
                forward_flops, backward_flops = FlopCounter(session.add_flops), FlopCounter()
            try:
                with torch.enable_grad():
                    with forward_flops or nullcontext(), progress.phase("forward"):
                        output = model(*args, **kwargs)
                        if observer is not None:
                            session.call(observer.output, output, where="observer of the model output")
                    session.raise_error()
                    loss_choice = _loss(output, opts)
                    del output
                    leaves = [p for _, p in all_params if p.requires_grad]
                    leaves += [t for _, t in iter_tensors((args, kwargs)) if t.requires_grad]
                    if not loss_choice.value.requires_grad:
                        raise no_gradients(prep)
                    phase = "backward"
                    with backward_flops or nullcontext(), progress.phase("backward"), warnings.catch_warnings():
                        # ops without a backward (quantized ones) give no gradient: said by the report
                        # (a note, or UnsupportedError when nothing got one), not by torch's warning
                        warnings.filterwarnings("ignore", message=".*an autograd kernel was not registered")
                        results = torch.autograd.grad(loss_choice.value, leaves, allow_unused=True)
                session.raise_error()
                for counter in (forward_flops, backward_flops):
                    if counter is not None:
                        counter.raise_error()
                if all(g is None for g in results):  # e.g. quantized ops: backward reached nothing
                    raise no_gradients(prep)
                grads = {id(leaf): g for leaf, g in zip(leaves, results)}
            except HookcliError:
                raise
            except (Exception, SystemExit) as exc:  # the user's model raised or exited: keep what we have
                session.raise_error()  # unless one of hookcli's hooks failed first
                if phase == "backward" and _reentrant_checkpoint(exc):
                    raise UnsupportedError(
                        "the model uses reentrant activation checkpointing (torch.utils.checkpoint with "
                        "use_reentrant=True), which refuses torch.autograd.grad: hookcli reads gradients "
                        "without touching .grad",
                        hint="checkpoint with use_reentrant=False (Hugging Face: model.gradient_checkpointing_enable("
                             "gradient_checkpointing_kwargs={'use_reentrant': False})), or run without checkpointing",
                    ) from None
                cause = exc
                failure = blame(exc, model, phase)
                if phase == "backward" and session.last_grad_call is not None:
                    failure.module = session.last_grad_call.name or None
                    failure.module_type = session.last_grad_call.type
                    failure.input_shapes = session.last_grad_call.input_shapes
            if observer is not None:
                observer.finished(session.completion_order())
            extra: list[Vector] = []
            plan: list[tuple[str, nn.Parameter, int | None, int, int | None]] = []
            for name, p in reported:
                g = grads.get(id(p))
                g_slot = None
                if g is not None:
                    extra.append(session.reducer.reduce(g, zeros=False))
                    g_slot = len(extra) - 1
                extra.append(torch.linalg.vector_norm(p.detach(), dtype=device_float(p.device)).reshape(1))
                n_slot = len(extra) - 1
                c_slot = None
                if name in clipped:
                    extra.append(clipped[name].reshape(1))
                    c_slot = len(extra) - 1
                plan.append((name, p, g_slot, n_slot, c_slot))
            if loss_choice is not None:
                extra.append(loss_choice.value.detach().reshape(1))
            report.layers, values = session.records(params_by_module(prep.selection), extra)
    params: list[ParamRecord] = []
    for name, p, g_slot, n_slot, c_slot in plan:
        params.append(ParamRecord(
            name=name,
            shape=shape_of(p),
            requires_grad=p.requires_grad,
            norm=values[n_slot][0],
            grad=gradient_stats(values[g_slot], abs_max=True) if g_slot is not None else None,
            clipped=int(values[c_slot][0]) if c_slot is not None else (0 if opts.clip and p.requires_grad else None),
        ))
    report.params = params if opts.params != "none" else None
    if opts.params == "selected" and not params:
        report.notes.append("the selected modules have no parameters (--params all lists every parameter)")
    if loss_choice is not None:
        report.loss = loss_choice.info(values[-1][0])
    if forward_flops is not None and backward_flops is not None:
        report.flops = forward_flops.summary(backward=backward_flops.total)
        report.flops["partial"] = forward_flops.partial or backward_flops.partial
        report.flops["missing_ops"] = sorted(forward_flops.missing | backward_flops.missing)
    quantized = quantized_modules(model)
    if quantized:
        report.notes.append("no gradient flows back through quantized modules: " + ", ".join(quantized[:5])
                            + (", ..." if len(quantized) > 5 else ""))
    if opts.clip is not None:
        report.notes.append(f"parameter gradients clipped to [-{opts.clip:g}, {opts.clip:g}] by tensor hooks")
    if failure is not None:
        raise_failure(report, failure, cause)
    return report
