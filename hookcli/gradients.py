"""Backward through the model: the loss, output/input gradients per call, parameter gradients.

Gradients come from ``torch.autograd.grad`` (so no parameter's ``.grad`` is touched) and from tensor
hooks that ``hooks.attach`` registers on every selected output tensor. ``--clip`` is the seeds'
gradient clipper: tensor hooks on the parameters clamp each gradient to [-clip, clip].
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hookcli import progress
from hookcli.errors import ModelRaisedError, UsageError
from hookcli.flops import FlopCounter
from hookcli.hooks import HookOptions, attach
from hookcli.records import FailureInfo, ParamRecord, Report
from hookcli.recorders import Vector, device_float, gradient_stats, iter_tensors, shape_of

LOSS_NAMES = {"ce": "cross_entropy", "nll": "nll", "sum": "sum", "mean": "mean"}


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
    tensors = [(path, t) for path, t in iter_tensors(output) if t.is_floating_point()]
    if not tensors:
        raise UsageError("the model output holds no floating-point tensor to build a loss from",
                         hint="grads needs a float output; use stats or shapes for this model")
    if key is None:
        return tensors[0]
    wanted = {key, f"[{key}]", f"[{key!r}]", f".{key}"}
    for path, tensor in tensors:
        if path in wanted:
            return path, tensor
    raise UsageError(
        f"--output-key {key!r} is not in the model output",
        hint="floating tensors in the output: " + ", ".join(p or "(output)" for p, _ in tensors),
    )


def build_loss(output: Any, *, loss: str, target: int, output_key: str | None) -> LossChoice:
    """Cross-entropy against ``target`` for (batch, classes) logits by default, else the sum."""
    path, out = pick_output(output, output_key)
    if loss == "auto":
        loss = "ce" if out.dim() == 2 and out.shape[1] > 1 else "sum"
    if loss in ("ce", "nll"):
        if out.dim() < 2:
            raise UsageError(f"--loss {loss} needs (batch, classes) output, got shape {shape_of(out)}",
                             hint="use --loss sum or --loss mean")
        if target >= out.shape[1]:
            raise UsageError(f"--target {target} is out of range for {out.shape[1]} classes",
                             hint=f"give --target 0 to {out.shape[1] - 1}")
        labels = torch.full((out.shape[0],), target, dtype=torch.long, device=out.device)
        fn = F.cross_entropy if loss == "ce" else F.nll_loss
        value = fn(out.float(), labels)
        return LossChoice(LOSS_NAMES[loss], path, target, value)
    value = out.float().sum() if loss == "sum" else out.float().mean()
    return LossChoice(LOSS_NAMES[loss], path, None, value)


def require_grad(obj: Any) -> Any:
    """Fresh leaf copies of the floating tensors in a nested input, with ``requires_grad``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(True) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(require_grad(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(require_grad(v) for v in obj)
    if isinstance(obj, dict):
        return {k: require_grad(v) for k, v in obj.items()}
    return obj


@contextmanager
def clipping(params: list[tuple[str, nn.Parameter]], clip: float | None) -> Iterator[dict[str, torch.Tensor]]:
    """Clamp every parameter gradient to [-clip, clip] with tensor hooks; count clipped elements."""
    counts: dict[str, torch.Tensor] = {}
    handles = []

    def hook_for(name: str):  # noqa: ANN202 - small closure factory
        def hook(grad: torch.Tensor) -> torch.Tensor:
            assert clip is not None
            counts[name] = (grad.abs() > clip).sum()
            return grad.clamp(-clip, clip)

        return hook

    try:
        if clip is not None:
            for name, p in params:
                if p.requires_grad:
                    handles.append(p.register_hook(hook_for(name)))
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def param_scope(model: nn.Module, selection: list[tuple[str, nn.Module]], scope: str) -> list[tuple[str, nn.Parameter]]:
    """Parameters to report, in ``named_parameters()`` order: of the selected modules, all, or none."""
    if scope == "none":
        return []
    named = list(model.named_parameters())
    if scope == "all":
        return named
    wanted = {id(p) for _, module in selection for p in module.parameters()}
    return [(n, p) for n, p in named if id(p) in wanted]


def backward_report(prep: Any, command: str = "grads", *, stats: bool = False) -> Report:
    """Forward with gradients, build the loss, backward once; report output and parameter gradients.

    The model's parameters keep their ``.grad`` and ``requires_grad`` (``autograd.grad`` writes none).
    Raises ModelRaisedError with the partial report when forward or backward raises.
    """
    from hookcli.api import failure_message, locate_failure, new_report, params_by_module, running

    opts = prep.options
    report = new_report(prep, command)
    model: nn.Module = prep.loaded.model
    all_params = list(model.named_parameters())
    reported = param_scope(model, prep.selection, opts.params)
    failure: FailureInfo | None = None
    cause: BaseException | None = None
    loss_choice: LossChoice | None = None
    grads: dict[int, torch.Tensor | None] = {}
    hook_options = HookOptions(stats=stats, grads=True, input_grads=opts.input_grads, flops=opts.flops)
    forward_flops: FlopCounter | None = None
    backward_flops: FlopCounter | None = None
    with running(prep) as (model, args, kwargs), clipping(all_params, opts.clip) as clipped:
        args, kwargs = require_grad(args), require_grad(kwargs)
        with attach(model, prep.selection, hook_options) as session:
            phase = "forward"
            if opts.flops:
                forward_flops, backward_flops = FlopCounter(session.add_flops), FlopCounter()
            try:
                with torch.enable_grad():
                    with forward_flops or nullcontext(), progress.phase("forward"):
                        output = model(*args, **kwargs)
                    loss_choice = build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key)
                    del output
                    leaves = [p for _, p in all_params if p.requires_grad]
                    leaves += [t for _, t in iter_tensors((args, kwargs)) if t.requires_grad]
                    if not loss_choice.value.requires_grad:
                        raise UsageError("the loss does not depend on any parameter or input that requires grad",
                                         hint="does the model freeze every parameter (requires_grad=False)?")
                    phase = "backward"
                    with backward_flops or nullcontext(), progress.phase("backward"):
                        results = torch.autograd.grad(loss_choice.value, leaves, allow_unused=True)
                grads = {id(leaf): g for leaf, g in zip(leaves, results)}
            except UsageError:
                raise
            except Exception as exc:  # the user's model raised: keep what we have
                cause = exc
                failure = locate_failure(exc, model, phase)
                if phase == "backward" and session.last_grad_call is not None:
                    failure.module = session.last_grad_call.name or None
                    failure.module_type = session.last_grad_call.type
                    failure.input_shapes = session.last_grad_call.input_shapes
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
    if opts.clip is not None:
        report.notes.append(f"parameter gradients clipped to [-{opts.clip:g}, {opts.clip:g}] by tensor hooks")
    if failure is not None:
        report.failure = failure
        raise ModelRaisedError(failure_message(failure), report=report, module=failure.module,
                               input_shapes=failure.input_shapes, phase=failure.phase) from cause
    return report
