"""The watched parameters' part of a logged step (``engine.watch.StepWatcher``'s): what is read of them at
the optimizer's step events, on the device, for the step's one host transfer.

At a logged step's pre-step (before ``optimizer.step()`` changes anything): each parameter's gradient and
norm (``HookSet.param_vectors``), its group's learning-rate scale, its histograms (``histograms=``), a
copy of its values; at the post-step: the update's norm (w_after - w_before) and, where asked, the
cosine between update and gradient and Adam's normalised-gradient RMS; when the closure handed to
``optimizer.step()`` returns (LBFGS, Lightning): the gradients it left. A step whose optimizer never
stepped (or a watch without one) reads the gradients and norms when the step ends (``at_close``).
Nothing here synchronises with the host; nothing writes the optimizer's state or the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from hookcli.engine import distributed, rank_stats, reduction

from hookcli.engine.hooks import HookSet, ParamVectors
from hookcli.engine.stats import Vector
from hookcli.engine.taps import reducible

#: A parameter's histograms (of its values, of its gradient) on the device, or under torchrun its part
Histograms = list[tuple[Any, Any]]


class ParamWatch:
    """The watched ``params`` at a logged step (see the module's docstring), for ``StepWatcher``, which
    calls ``begin`` as each step begins and the step events of the steps it logs. ``reduction``: under
    torchrun (``rank_stats.StepReduction``), with which parameters are ``sharded`` and which this rank
    ``owned``; ``histograms``: take the parameters' and gradients' histograms; ``gather``: the signals
    (``"adam"``, ``"cosines"``) measured at the post-step."""

    def __init__(self, hooks: HookSet, optimizer: torch.optim.Optimizer | None,
                 params: Sequence[tuple[str, nn.Parameter]], *, reduction: rank_stats.StepReduction | None,
                 sharded: Sequence[bool], owned: Sequence[bool], histograms: bool, gather: Collection[str]) -> None:
        self.hooks, self.optimizer, self.params = hooks, optimizer, list(params)
        self.reduction, self.sharded, self.owned = reduction, list(sharded), list(owned)
        self.wants_histograms, self.gather = histograms, frozenset(gather)
        self.begin()

    def begin(self) -> None:
        """A step begins: nothing of it is read yet."""
        #: each parameter's gradient and norm vectors, taken at the pre-step (None: not taken there)
        self.vectors: list[ParamVectors] | None = None
        #: under torchrun: the Partial gradients' values (``distributed.partial_grads``)
        self.partial: list[distributed.PartialGrad] | None = None
        self.histograms: Histograms | None = None
        self.updates: list[Vector] | None = None
        #: the cosines' dot products and Adam's RMS (None each where not gathered)
        self.signals: tuple[list[Vector] | None, list[Vector] | None] | None = None
        self.lr_scales: list[float | None] | None = None
        self._before: list[torch.Tensor] | None = None  # the weights at the pre-step
        #: the gradients as the closure handed to optimizer.step() left them (``HookSet.observe_closures``)
        self._closure_grads: list[Vector | None] | None = None

    @property
    def taken(self) -> bool:
        """Whether the gradients and norms were taken at this step's pre-step."""
        return self.vectors is not None

    def pre_step(self) -> None:
        """A logged step's optimizer pre-step: the gradients, norms, scales, histograms and a copy of the values."""
        self.lr_scales = lr_scales(self.optimizer, self.params)
        self.vectors = self.hooks.param_vectors(zeros=True)
        self.partial = distributed.partial_grads(self.params) if self.reduction is not None else None
        self.histograms = self._histograms()
        self._before = [distributed.local(p.detach()).clone() for _, p in self.params]

    def post_step(self) -> None:
        """The optimizer's post-step: the updates' norms (and the signals) against the pre-step's copy; the
        gradients a closure left replace the pre-step's (the norms stay the pre-step's)."""
        if self._before is not None:
            diffs = [before.sub_(distributed.local(p.detach())) for before, (_, p) in zip(self._before, self.params)]
            self.updates = reduction.norms([reducible(diff) for diff in diffs])
            if self.gather:
                self.signals = (update_grad_dots(diffs, self.params) if "cosines" in self.gather else None,
                                adam_rms(self.optimizer, self.params, diffs) if "adam" in self.gather else None)
            self._before = None
        if self.vectors is not None and self._closure_grads is not None:
            # the step's closure ran (a backward) inside optimizer.step(): the gradients it applied are
            # those its last call left
            for entry, grad in zip(self.vectors, self._closure_grads):
                entry.grad = grad

    def closure_returned(self) -> None:
        """The closure handed to a logged step's ``optimizer.step()`` returned: it may have run a backward
        (LBFGS, Lightning's automatic optimisation: the step's only backward, or gradient accumulation's
        last micro-batch), so the gradients the step applies are read now, as the pre-step reads them; a
        later call (LBFGS) reads them again."""
        if self.vectors is None:
            return
        self._closure_grads = [entry.grad for entry in self.hooks.param_vectors(zeros=True)]
        if self.reduction is not None:
            self.partial = distributed.partial_grads(self.params)
        self.histograms = self._histograms()

    def at_close(self) -> tuple[list[ParamVectors], Histograms | None]:
        """The step ends: its gradients and norms (read now where the pre-step did not) and histograms."""
        if self.vectors is not None:
            return self.vectors, self.histograms
        vectors = self.hooks.param_vectors(zeros=True)
        if self.reduction is not None:
            self.partial = distributed.partial_grads(self.params)
        return vectors, self._histograms()

    def _histograms(self) -> Histograms | None:
        """Each watched parameter's histogram and its gradient's, on the device (``histograms`` only)."""
        if not self.wants_histograms:
            return None
        if self.reduction is not None:  # over every rank's part: a shard it owns, or rank 0's copy
            adds = [owned if sharded else self.reduction.rank == 0 for owned, sharded in zip(self.owned, self.sharded)]
            partial = self.partial if self.partial is not None else distributed.partial_grads(self.params)
            return rank_stats.global_histograms(self.reduction, [
                (distributed.local(p.detach()), distributed.local(p.grad) if p.grad is not None and found is None
                 else None) for (_, p), found in zip(self.params, partial)], adds)
        values = reduction.histograms([p.detach() for _, p in self.params])
        grads = reduction.histograms([p.grad for _, p in self.params])
        return list(zip(values, grads))


def lr_scales(optimizer: torch.optim.Optimizer | None, params: Sequence[tuple[str, nn.Parameter]]
              ) -> list[float | None] | None:
    """Each watched parameter's group's learning rate over its ``initial_lr`` (set by every torch LR
    scheduler: the rate it was configured with), None where it has none: the update_ratio rule judges
    "too low" at the configured rate, not at a warmup's start or an annealed tail."""
    if optimizer is None:
        return None
    scale_of: dict[int, float | None] = {}
    for group in optimizer.param_groups:
        lr, initial = group.get("lr"), group.get("initial_lr")
        try:
            scale = float(lr) / float(initial) if initial is not None and float(initial) > 0 else None
        except (TypeError, ValueError, RuntimeError):  # a learning rate that is no number: not judged by it
            scale = None
        for p in group["params"]:
            scale_of[id(p)] = scale
    return [scale_of.get(id(p)) for _, p in params]



def update_grad_dots(diffs: Sequence[torch.Tensor], params: Sequence[tuple[str, nn.Parameter]]) -> list[Vector]:
    """Each parameter's dot product of its update (w_after - w_before; ``diffs`` hold w_before - w_after)
    with its gradient as the step left it, as a one-element float32 vector on the device (one pass; NaN
    without a gradient): over the update's and the gradient's norms, which the step transfers anyway,
    it is their cosine (``_attach_signals``)."""
    out: list[Vector] = []
    for diff, (_, p) in zip(diffs, params):
        grad = p.grad
        if grad is None or grad.layout != torch.strided or grad.shape != diff.shape or diff.is_complex() \
                or grad.is_complex():
            out.append(torch.full((1,), math.nan, device=diff.device))
            continue
        d, g = diff.detach().reshape(-1), grad.detach().reshape(-1)
        if d.dtype != torch.float32 or g.dtype != torch.float32:
            d, g = d.float(), g.float()
        out.append(torch.dot(d, g).neg().reshape(1))
    return out


#: ``adam_rms`` works through the parameters in pieces of at most this many elements (a parameter larger
#: than it split into flat slices, smaller ones packed together), each piece's few passes one
#: ``torch._foreach_*`` call each: its temporaries (2 MiB apiece in float32) stay in the cache, so the
#: gradient and the second moment are read from memory once.
ADAM_RMS_PIECE = 1 << 19


def adam_rms(optimizer: torch.optim.Optimizer | None, params: Sequence[tuple[str, nn.Parameter]],
             diffs: Sequence[torch.Tensor]) -> list[Vector] | None:
    """Right after an Adam/AdamW step: each parameter's RMS of the normalised gradient
    g / (sqrt(v_hat) + eps), with v_hat = exp_avg_sq / (1 - beta2^step) as the step used it (the
    amsgrad maximum with ``amsgrad``; g with the coupled weight decay Adam adds, from w_before = w +
    ``diffs``), and the same without eps (0 where v_hat is 0), as two-element vectors on the device
    (NaN for a parameter it did not update), in float32 (``_adam_sums``: all parameters at once, no
    float64 copy, no host synchronisation). None for another optimizer. Reads the optimizer's state,
    never writes it."""
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)  # a wrapper (Accelerate's, Lightning's)
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    out: list[Vector] = [torch.full((2,), math.nan, device=diff.device) for diff in diffs]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor, float, Any]]] = {}
    for i, (diff, (_, p)) in enumerate(zip(diffs, params)):
        state, group, grad = optimizer.state.get(p), groups.get(id(p)), p.grad
        v = state.get("max_exp_avg_sq" if group and group.get("amsgrad") else "exp_avg_sq") if state else None
        if group is None or v is None or "step" not in state or grad is None or grad.layout != torch.strided \
                or grad.is_complex() or grad.shape != v.shape or v.device != grad.device:
            continue
        g = grad.detach()
        decoupled = group.get("decoupled_weight_decay", False) or isinstance(optimizer, torch.optim.AdamW)
        if group.get("weight_decay") and not decoupled:  # (its sign under ``maximize`` matters here only)
            g = (g.float().neg() if group.get("maximize") else g.float()) + \
                group["weight_decay"] * (p.detach().float() + diff.float())
        by_device.setdefault(g.device, []).append((i, g, v.detach(), group["eps"],
                                                   _root_c(group["betas"][1], state["step"])))
    for device, entries in by_device.items():
        for (i, *_), row in zip(entries, _adam_sums(device, entries).unbind()):
            out[i] = row
    return out


def _root_c(beta2: float, step: Any) -> Any:
    """sqrt(1 - beta2^step), Adam's square-rooted bias correction: a float, or a 0-dim float32 tensor on
    the device where the step count lives there (``capturable``, ``fused``: read without a host sync)."""
    if torch.is_tensor(step) and step.device.type != "cpu":
        return (1 - beta2 ** step.to(dtype=torch.float32)).sqrt()
    return math.sqrt(1 - beta2 ** float(step))


def _adam_sums(device: torch.device, entries: Sequence[tuple[int, torch.Tensor, torch.Tensor, float, Any]]
               ) -> torch.Tensor:
    """``adam_rms``'s (with eps, without eps) for each entry (index, g, v, eps, sqrt(c)), a (n, 2) float32
    tensor on ``device``: with c = 1 - beta2^step, g / (sqrt(v / c) + eps) is sqrt(c) g / (sqrt(v) + eps
    sqrt(c)), so the RMS is sqrt(c) ||g / (sqrt(v) + eps sqrt(c))|| / sqrt(n). By pieces of at most
    ``ADAM_RMS_PIECE`` elements, each a handful of ``torch._foreach_*`` passes; the slices' squared
    norms summed back by parameter."""
    slices: list[tuple[torch.Tensor, torch.Tensor, Any, int]] = []
    for owner, (_, g, v, eps, root_c) in enumerate(entries):
        if g.numel() > ADAM_RMS_PIECE and g.is_contiguous() and v.is_contiguous():
            slices += [(gs, vs, eps * root_c, owner)
                       for gs, vs in zip(g.view(-1).split(ADAM_RMS_PIECE), v.view(-1).split(ADAM_RMS_PIECE))]
        else:
            slices.append((g, v, eps * root_c, owner))
    norms: list[torch.Tensor] = []
    start = 0
    while start < len(slices):
        end, size = start + 1, slices[start][0].numel()
        while end < len(slices) and size + slices[end][0].numel() <= ADAM_RMS_PIECE:
            size, end = size + slices[end][0].numel(), end + 1
        norms += _adam_piece(slices[start:end])
        start = end
    owners = torch.tensor([owner for *_, owner in slices], device=device)
    squares = torch.stack(norms).square_().view(-1, 2)
    sums = torch.zeros(len(entries), 2, device=device).index_add_(0, owners, squares)
    root_c = torch.stack([torch.as_tensor(c, dtype=torch.float32, device=device) for *_, c in entries]) \
        if any(torch.is_tensor(c) for *_, c in entries) else torch.tensor([c for *_, c in entries], device=device)
    counts = torch.tensor([max(g.numel(), 1) for _, g, *_ in entries], dtype=torch.float32, device=device)
    return sums.sqrt_().mul_((root_c / counts.sqrt()).unsqueeze(1))


def _adam_piece(piece: Sequence[tuple[torch.Tensor, torch.Tensor, Any, int]]) -> list[torch.Tensor]:
    """One piece's norms of g / (sqrt(v) + shift) and of g / sqrt(v) (0 where that is not finite: v = 0)
    per slice, interleaved (with, without, with, ...)."""
    grads = [g if g.dtype == torch.float32 else g.float() for g, *_ in piece]
    roots = torch._foreach_sqrt([v if v.dtype == torch.float32 else v.float() for _, v, *_ in piece])
    ratios = torch._foreach_div(grads, roots)
    for ratio in ratios:
        ratio.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    without = torch._foreach_norm(ratios)
    del ratios
    shifts = [shift for _, _, shift, _ in piece]
    if any(torch.is_tensor(s) for s in shifts):
        torch._foreach_add_(roots, [torch.as_tensor(s, dtype=torch.float32, device=roots[0].device) for s in shifts])
    else:
        torch._foreach_add_(roots, shifts)
    with_eps = torch._foreach_norm(torch._foreach_div(grads, roots))
    return [norm for pair in zip(with_eps, without) for norm in pair]
