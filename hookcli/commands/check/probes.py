"""The measurements of the probe rules of ``hookcli check`` (off by default; a config or ``checks={...}``
enables them): ``batch_independence``, ``input_dependence`` and ``grad_accumulation``.

Each probe runs the model through the engine (``engine.run_model``: its seeded RNGs, placement and
restore; hooks only through the engine's session and a ``RunObserver``) and leaves plain values in
``Observations.probes[rule]``; the rules themselves (torch-free) are in ``probe_rules``. The user's
model is only run, never stepped; its mode is set and restored by the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hookcli.commands.check.rules import Observations
from hookcli.commands.check.schema import CheckRules
from hookcli.engine import run as engine
from hookcli.engine.losses import build_loss
from hookcli.engine.collectors import Merged, Observed, ParamStats
from hookcli.engine.session import RunObserver, exact
from hookcli.engine.taps import InputGradients
from hookcli.engine.state import copy_model
from hookcli.engine.stats import iter_tensors, map_tensors
from hookcli.errors import describe_exception
from hookcli.records.core import call_label

#: The seed of the random weights that turn a sample's output into one number (a plain sum can cancel
#: out: a softmax's outputs always sum to 1).
PROJECTION_SEED = 1234


def _loss_fn(prep: engine.Prepared) -> engine.LossFn:
    """The check's own loss (``--loss``, ``--target``) as an engine loss function."""
    opts = prep.options

    def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], model: nn.Module) -> tuple[torch.Tensor, None]:
        return build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key,
                          inputs=(args, kwargs), model=model, seed=opts.seed).value, None

    return loss


def _first_input(inputs: tuple[Any, dict[str, Any]]) -> torch.Tensor | None:
    return next((t for _, t in iter_tensors(inputs)), None)


def _with_inputs(prep: engine.Prepared, args: Any, kwargs: Any, *, train: bool | None = None) -> engine.Prepared:
    opts = prep.options if train is None else replace(prep.options, train=train)
    return replace(prep, options=opts, inputs=replace(prep.inputs, args=args, kwargs=kwargs))


def _failed(run: engine.RunResult, what: str) -> str | None:
    if run.cause is None:
        return None
    return f"the model raised on {what}: {describe_exception(run.cause)}"


#: A layer scale: a trainable per-channel parameter (at most one dimension above 1) initialised tiny but
#: not zero (CaiT's and ConvNeXt's γ = 1e-5 / 1e-6); what passes through it is scaled down as much.
LAYER_SCALE_MAX = 1e-3
#: The value a lifted copy gives layer scales: what training makes of them (order 0.1 to 1).
LAYER_SCALE_LIFT = 1.0


def layer_scales(model: nn.Module) -> list[str]:
    """The names of ``model``'s layer-scale parameters (``LAYER_SCALE_MAX``)."""
    found = []
    for name, p in model.named_parameters():
        if (p.requires_grad and p.is_floating_point() and p.numel() > 0 and p.device.type != "meta"
                and sum(d > 1 for d in p.shape) <= 1):
            top = float(p.detach().abs().max())
            if 0 < top <= LAYER_SCALE_MAX:
                found.append(name)
    return found


def _lifted(prep: engine.Prepared, scales: list[str]) -> engine.Prepared | None:
    """``prep`` with a copy of the model whose ``scales`` are ``LAYER_SCALE_LIFT`` (None: not copyable)."""
    try:
        clone = copy_model(prep.loaded.model)
    except Exception:  # noqa: BLE001 - any failure to copy: no lifted look
        return None
    params = dict(clone.named_parameters())
    with torch.no_grad():
        for name in scales:
            if name in params:
                params[name].fill_(LAYER_SCALE_LIFT)
    return replace(prep, loaded=replace(prep.loaded, model=clone), selection=[], model_index=None)


# --------------------------------------------------------------------------- input_dependence


def _losses(prep: engine.Prepared, first: torch.Tensor) -> dict[str, Any]:
    args, kwargs = prep.inputs.args, prep.inputs.kwargs
    zeroed = map_tensors(lambda t: torch.zeros_like(t) if t is first else t, (args, kwargs))
    losses = []
    for what, (a, k) in (("its input", (args, kwargs)), ("the zeroed input", zeroed)):
        run = engine.run_model(_with_inputs(prep, a, k), [],
                               engine.RunPlan(loss=_loss_fn(prep), show_phase=False))
        problem = _failed(run, what)
        if problem is not None:
            return {"skip": problem}
        losses.append(run.loss_value)
    return {"loss": losses[0], "zeroed": losses[1]}


#: Below this relative change of the loss, input_dependence looks again with the layer scales lifted.
SMALL_CHANGE = 1e-3


def input_dependence(prep: engine.Prepared) -> dict[str, Any]:
    """The loss on the real input and with the first input tensor zeroed (token id 0 for integer inputs),
    in the check's mode and seed (same dropout masks)."""
    first = _first_input((prep.inputs.args, prep.inputs.kwargs))
    if first is None:
        return {"skip": "the model takes no tensor input"}
    found = _losses(prep, first)
    if "skip" in found or abs(found["loss"] - found["zeroed"]) > SMALL_CHANGE * abs(found["loss"]):
        return found
    # a model behind layer scales of 1e-5 (CaiT) barely sees its input at init: judge it with them lifted
    scales = layer_scales(prep.loaded.model)
    lifted = _lifted(prep, scales) if scales else None
    if lifted is not None:
        again = _losses(lifted, first)
        if "skip" not in again:
            found["lifted"] = {**again, "scales": len(scales)}
    return found


# --------------------------------------------------------------------------- grad_accumulation


def _random_layers(model: nn.Module) -> list[str]:
    """Modules that make two half batches differ from one full batch in train mode: BatchNorm (batch
    statistics) and dropout (other random masks)."""
    found = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) or (
                isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0) or (
                float(getattr(m, "drop_prob", 0.0) or 0.0) > 0):
            found.append(name or "(model)")
    return found


#: Full-batch gradients under two seeds differing by more than this (relative): the model is random.
RANDOM_TOLERANCE = 1e-6


def _relative_difference(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    diff = norm = 0.0
    for name, g in a.items():
        h = b.get(name)
        if g is None or h is None:
            continue
        diff += float((exact(g) - exact(h)).abs().pow(2).sum())
        norm += float(exact(g).abs().pow(2).sum())
    return (diff / norm) ** 0.5 if norm > 0 else 0.0


def grad_accumulation(prep: engine.Prepared) -> dict[str, Any]:
    """Parameter gradients of the full batch's loss and of each half batch's (every input tensor whose
    dim 0 is the batch is split), in the check's mode. What the rule compares: full vs the mean of halves."""
    args, kwargs = prep.inputs.args, prep.inputs.kwargs
    first = _first_input((args, kwargs))
    if first is None or first.dim() == 0:
        return {"skip": "the model takes no batched tensor input"}
    batch = int(first.shape[0])
    if batch < 2 or batch % 2:
        return {"skip": f"a batch of {batch} does not split into two halves (give an even batch, e.g. --batch-size 4)"}
    if prep.options.train:
        random = _random_layers(prep.loaded.model)
        if random:
            shown = ", ".join(random[:3]) + (f", ... ({len(random)} in all)" if len(random) > 3 else "")
            return {"skip": f"batch-dependent or random layers in train mode ({shown}); --eval checks it"}
    half = batch // 2
    params = [(n, p) for n, p in prep.index.named_parameters() if p.requires_grad]
    if not params:
        return {"skip": "no trainable parameters"}
    grads: list[dict[str, torch.Tensor | None]] = []
    runs = [("the full batch", slice(None), prep), ("the first half batch", slice(0, half), prep),
            ("the second half batch", slice(half, batch), prep)]
    if prep.options.train:  # functional dropout (F.dropout in forward) has no module: another seed tells
        runs.append(("the full batch with another seed", slice(None),
                     replace(prep, options=replace(prep.options, seed=prep.options.seed + 1))))
    for what, part, where in runs:
        a, k = map_tensors(lambda t, part=part: t[part] if t.dim() and t.shape[0] == batch else t, (args, kwargs))
        run = engine.run_model(_with_inputs(where, a, k), [], engine.RunPlan(
            loss=_loss_fn(where), collectors=[ParamStats(params), Merged(params)], show_phase=False))
        problem = _failed(run, what)
        if problem is not None:
            return {"skip": problem}
        grads.append(run.gradients or {})
    full, one, two = grads[:3]
    if len(grads) > 3 and _relative_difference(full, grads[3]) > RANDOM_TOLERANCE:
        return {"skip": "the model's gradients change with the seed in train mode (dropout in forward?); "
                        "--eval checks it"}
    total = diff_total = 0.0
    rows = []
    for name, _ in params:
        g, g1, g2 = full.get(name), one.get(name), two.get(name)
        if g is None or g1 is None or g2 is None:
            continue
        g = exact(g)
        diff = float(torch.linalg.vector_norm(g - (exact(g1) + exact(g2)) / 2))
        norm = float(torch.linalg.vector_norm(g))
        total += norm ** 2
        diff_total += diff ** 2
        rows.append((name, diff, norm))
    if not rows:
        return {"skip": "no parameter got a gradient"}
    # the coarsest precision the gradients were computed in: its rounding alone makes the halves differ
    coarsest = max((g.dtype for g in full.values() if g is not None and g.is_floating_point()),
                   key=lambda dtype: torch.finfo(dtype).eps, default=torch.float32)
    return {"batch": batch, "norm": total ** 0.5, "diff": diff_total ** 0.5,
            "params": [{"name": n, "diff": d, "norm": g} for n, d, g in rows],
            "dtype": str(coarsest).removeprefix("torch."), "eps": torch.finfo(coarsest).eps}


# --------------------------------------------------------------------------- batch_independence


class _Outputs(RunObserver):
    """Every selected float output (with its graph) in the order calls finish."""

    wants_tensors = True

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, int, str], torch.Tensor]] = []

    def tensor(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        if (tensor.is_floating_point() and tensor.requires_grad and tensor.layout == torch.strided
                and not tensor.is_nested and tensor.dim() >= 1):
            self.seen.append(((name, call, path), tensor))


def _cross(outputs: list[torch.Tensor], sources: list[torch.Tensor], i: int, batch: int) -> tuple[float, float] | None:
    """(norm of the gradient of sample ``i``'s projected output w.r.t. the other samples of
    ``sources``, the same w.r.t. sample ``i`` itself), or None when no source reaches it."""
    gen = torch.Generator().manual_seed(PROJECTION_SEED)
    total = None
    for o in outputs:
        w = torch.randn(tuple(o[i].shape), generator=gen, dtype=torch.float64).to(o.device, o.dtype)
        term = (o[i] * w).sum()
        total = term if total is None else total + term
    if total is None:
        return None
    grads = torch.autograd.grad(total, sources, retain_graph=True, allow_unused=True)
    own = other = 0.0
    reached = False
    for g in grads:
        if g is None:
            continue
        reached = True
        g = g.detach().double()
        mask = torch.ones(batch, dtype=torch.bool, device=g.device)
        mask[i] = False
        own += float(g[i].pow(2).sum())
        other += float(g[mask].pow(2).sum())
    return (other ** 0.5, own ** 0.5) if reached else None


#: Cross-sample gradient above this fraction of the sample's own: the batch is mixed (float noise is
#: far below; a real mix is of the same order).
MIX_TOLERANCE = 1e-4


def batch_independence(prep: engine.Prepared) -> dict[str, Any]:
    """In eval mode (BatchNorm on running statistics does not mix samples): the gradient of sample i's
    output w.r.t. the other samples' inputs (floating inputs; for integer inputs, w.r.t. the first float
    output of a selected module with the batch in dim 0, e.g. the embedding's), for the first and last
    sample. When it is not zero, the first selected module (in the order calls finish) whose output mixes
    the samples is located the same way."""
    args, kwargs = prep.inputs.args, prep.inputs.kwargs
    first = _first_input((args, kwargs))
    if first is None or first.dim() == 0:
        return {"skip": "the model takes no batched tensor input"}
    batch = int(first.shape[0])
    if batch < 2:
        return {"skip": "a batch of 1 has no other sample (give a batch of 2 or more)"}
    observer = _Outputs()
    found: dict[str, Any] = {}

    def loss(output: Any, a: tuple[Any, ...], k: dict[str, Any], model: nn.Module) -> tuple[torch.Tensor, None]:
        sources = [t for _, t in iter_tensors((a, k)) if t.requires_grad and t.dim() and t.shape[0] == batch]
        layers = [(key, t) for key, t in observer.seen if t.shape[0] == batch]
        source = "the input"
        if not sources:  # integer inputs: the first float tensor made from them
            if not layers:
                found["skip"] = "no float input and no module output with the batch in dim 0"
                return _scalar(output), None
            key, t = layers[0]
            sources, layers, source = [t], layers[1:], _label(key, observer)
        outs = [t for _, t in iter_tensors(output) if t.is_floating_point() and t.requires_grad
                and t.dim() and t.shape[0] == batch]
        if not outs:
            found["skip"] = "no float model output with the batch in dim 0"
            return _scalar(output), None
        found["source"] = source
        worst = 0.0
        for i in sorted({0, batch - 1}):
            pair = _cross(outs, sources, i, batch)
            if pair is None:
                continue
            other, own = pair
            ratio = other / own if own > 0 else (float("inf") if other > 0 else 0.0)
            worst = max(worst, ratio)
            if ratio > MIX_TOLERANCE and "where" not in found:
                found["sample"] = i
                for key, t in layers:
                    layer_pair = _cross([t], sources, i, batch)
                    if layer_pair is not None and layer_pair[0] > MIX_TOLERANCE * layer_pair[1]:
                        found["where"] = _label(key, observer)
                        found["layer_ratio"] = layer_pair[0] / layer_pair[1] if layer_pair[1] else float("inf")
                        break
                else:
                    found["where"] = "(model)"
        found["ratio"] = worst
        return _scalar(output), None

    run = engine.run_model(_with_inputs(prep, args, kwargs, train=False), [InputGradients()],
                           engine.RunPlan(loss=loss, collectors=[Observed(observer)], show_phase=False))
    observer.seen = []
    problem = _failed(run, "its input in eval mode")
    if problem is not None:
        return {"skip": problem}
    return found


def _label(key: tuple[str, int, str], observer: _Outputs) -> str:
    name, call, path = key
    calls = 1 + max((c for (n, c, _), _ in observer.seen if n == name), default=0)
    return call_label(name, call, calls, path)


def _scalar(output: Any) -> torch.Tensor:
    """A scalar of the model output for the engine's backward (its value is not used)."""
    for _, t in iter_tensors(output):
        if t.is_floating_point() and t.requires_grad:
            return t.float().sum() * 0
    return torch.zeros((), requires_grad=True)


PROBES: dict[str, Callable[[engine.Prepared], dict[str, Any]]] = {
    "batch_independence": batch_independence,
    "input_dependence": input_dependence,
    "grad_accumulation": grad_accumulation,
}


def measure_probes(prep: engine.Prepared, rules: CheckRules, obs: Observations) -> None:
    """Run the enabled probe rules' measurements into ``obs.probes``."""
    for name, probe in PROBES.items():
        if rules.get(name) is not None:
            obs.probes[name] = probe(prep)
