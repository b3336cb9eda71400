"""What lives between modules, measured over the training run of ``check --steps N``.

A module's output is what the other rules see; three faults live elsewhere:

- ``residual_growth``: a residual stream (``x = x + block(x)`` in the parent's forward) is only ever a
  module's *input*. ``StepWatch`` records the RMS and max |x| of the first input of every block of a
  repeated stack (consecutive children of one class of a ``ModuleList``/``Sequential``), and of the
  final norm the stack flows into (GPT-2's ``ln_f``, Llama's ``norm``: the stream's last value is only
  ever its input), at every step.
- ``dead_units``: a unit behind a functional ``F.relu`` is no module's output. ``StepWatch`` records,
  per output channel of each ``Linear``/``Conv``, whether it was ever positive and whether its weights
  ever got a nonzero gradient: never either, over every step, is a unit dead behind a gate.
- ``target_leak``: ``fresh_losses`` evaluates the trained copy on fresh batches (the same input builder,
  seeds ``seed + 1``, ``seed + 2``, ...): a loss far below chance there means the targets are in the inputs.

Everything is handed to ``step_rules`` as plain values (``Training.between``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hookcli.engine import run as engine
from hookcli.engine.losses import LOSS_NAMES, build_loss, pick_output
from hookcli.engine.session import CompletionOrder, RunObserver
from hookcli.engine.stats import to_host
from hookcli.errors import describe_exception
from hookcli.options import Loss

#: The layers whose output channels ``dead_units`` judges (transposed convolutions excluded: their
#: weight's first dimension is the input's).
UNIT_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def stacks(model: nn.Module) -> list[list[str]]:
    """Runs of 2+ consecutive children of one class in each ``ModuleList``/``Sequential`` (a repeated stack)."""
    found: list[list[str]] = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        run: list[tuple[str, nn.Module]] = []
        for child_name, child in [*container.named_children(), ("", None)]:
            if run and (child is None or type(child) is not type(run[-1][1])):
                if len(run) >= 2:
                    found.append([n for n, _ in run])
                run = []
            if child is not None:
                run.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def final_norm(model: nn.Module, stack: list[str]) -> str | None:
    """The normalisation layer the stack's stream flows into: the module registered right after the
    stack's last block (in its container; after the container, in the container's parent, when the
    block is the container's last), when it is a norm (GPT-2's ``ln_f``, Llama's ``norm``, T5's
    ``final_layer_norm``, a ViT's ``norm``). None otherwise."""
    modules = dict(model.named_modules())
    name = stack[-1]
    while True:
        parent = name.rpartition(".")[0]
        children = [f"{parent}.{c}" if parent else c for c, _ in modules[parent].named_children()]
        after = children[children.index(name) + 1:]
        if after:
            return after[0] if _is_norm(modules[after[0]]) else None
        if name != stack[-1] or not parent:
            return None
        name = parent  # the stack's container: what comes after it


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def units(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Each ``UNIT_TYPES`` layer: (its channel dimension in the output, its output channels)."""
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            found[name] = (-1, m.out_features)
        elif isinstance(m, UNIT_TYPES) and not m.transposed:
            found[name] = (1, m.out_channels)
    return found


class StepWatch(RunObserver):
    """Per step: the first input of each stack block and of its final norm; per channel of each unit
    layer, ever positive (any sample, any position) and ever a nonzero weight gradient."""

    wants_tensors = True
    wants_inputs = True

    def __init__(self, model: nn.Module) -> None:
        self.stacks = stacks(model)
        self.norms = [final_norm(model, s) for s in self.stacks]
        self.blocks = {b for s in self.stacks for b in s} | {n for n in self.norms if n is not None}
        self.units = units(model)
        modules = dict(model.named_modules())
        self.selection = [(n, modules[n]) for n in modules if n in self.blocks or n in self.units]
        #: each unit's trainable leaf parameters with one row per output channel (weight, bias; the
        #: original of a spectral_norm or a parametrization): none known, its units count as alive
        self.params = {n: [p for p in modules[n].parameters() if p.requires_grad and p.dim() and p.shape[0] == c]
                       for n, (_, c) in self.units.items()}
        self.step = 0
        self.inputs: dict[str, list[torch.Tensor]] = {}  # block -> per step [rms, max |x|]
        self.shapes: dict[str, list[int]] = {}
        self.positive: dict[str, torch.Tensor] = {}
        self.gradient: dict[str, torch.Tensor] = {}
        self.values: dict[str, int] = {}

    def input(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        if name not in self.blocks or len(self.inputs.setdefault(name, [])) > self.step:
            return
        if not tensor.is_floating_point() or not tensor.numel():
            return
        x = tensor.detach().float()
        self.shapes.setdefault(name, list(x.shape))
        self.inputs[name].append(torch.stack([x.pow(2).mean().sqrt(), x.abs().max()]))

    def tensor(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        if name not in self.units or not tensor.is_floating_point() or not tensor.dim():
            return
        dim, channels = self.units[name]
        if tensor.shape[dim] != channels:
            return
        x = tensor.detach().movedim(dim, 0).reshape(channels, -1)
        positive = (x > 0).any(1)
        self.positive[name] = self.positive[name] | positive if name in self.positive else positive
        self.values[name] = min(self.values.get(name, x.shape[1]), x.shape[1])

    def output(self, output: Any) -> None:
        self.step += 1

    def gradients(self) -> None:
        """After each backward: which output channels' weights (and bias) got a nonzero gradient."""
        for name, (_, channels) in self.units.items():
            params = self.params[name]
            if not params:
                got = torch.ones(channels, dtype=torch.bool)
            else:
                got = torch.zeros(channels, dtype=torch.bool, device=params[0].device)
            for p in params:
                if p.grad is not None:
                    got = got | (p.grad.detach().reshape(channels, -1) != 0).any(1).to(got.device)
            self.gradient[name] = self.gradient[name] | got if name in self.gradient else got

    def finished(self, order: CompletionOrder) -> None:
        pass

    def host(self) -> dict[str, Any]:
        """The plain values the rules read: ``stacks`` (blocks of one input shape and the final norm
        after the last of them, ``norm``, or None; per step the RMS and max |input| of each, the norm's
        last) and ``units`` (channels, dead channels, the fewest values per channel in a step)."""
        blocks = [b for b in self.inputs if self.inputs[b]]
        stats = dict(zip(blocks, to_host([torch.cat(self.inputs[b]) for b in blocks]))) if blocks else {}
        found = []
        for stack, norm in zip(self.stacks, self.norms):
            run: list[str] = []
            for name in [*stack, norm, None] if norm is not None else [*stack, None]:
                ok = name in stats and len(stats[name]) == 2 * self.step
                if run and (not ok or self.shapes[name] != self.shapes[run[-1]]):
                    last = run[-1] if run[-1] == norm else None
                    if len(run) - (last is not None) >= 2:
                        found.append({"blocks": run[:-1] if last else run, "norm": last,
                                      "rms": [[stats[b][2 * s] for b in run] for s in range(self.step)],
                                      "max": [[stats[b][2 * s + 1] for b in run] for s in range(self.step)]})
                    run = []
                if ok:
                    run.append(str(name))
        names = [n for n in self.units if n in self.positive and n in self.gradient]
        dead = to_host([(~(self.positive[n] | self.gradient[n].to(self.positive[n].device))).float() for n in names])
        layers = {n: {"channels": len(d), "dead": [i for i, v in enumerate(d) if v], "values": self.values[n]}
                  for n, d in zip(names, dead)}
        return {"stacks": found, "units": layers, "steps": self.step}


def _chance(choice: Any, output: Any) -> tuple[float | None, str]:
    """ln(classes) when the targets come from the inputs (next-token targets; the model's own loss
    beside a ``logits`` output), else None and why there is nothing to judge."""
    if choice.kind == LOSS_NAMES[Loss.ce]:
        if choice.targets is not None and choice.targets.startswith("next token"):
            _, out = pick_output(output, None)
            return math.log(out.shape[-1]), f"per-token cross-entropy over {out.shape[-1]} tokens ({choice.targets})"
        return None, "the targets are not made from the inputs (a fixed class or seeded random tokens)"
    if choice.kind == "model_loss":
        path, out = pick_output(output, None, skip_loss=True)
        if "logits" in path.lower() and out.dim() >= 2 and out.shape[-1] > 1:
            return math.log(out.shape[-1]), f"the model's own loss beside its {out.shape[-1]}-way {path.strip(chr(39) + '[]')}"
        return None, "the model computes its own loss and has no logits output to tell its chance level"
    return None, f"the loss is {choice.kind}, not a cross-entropy"


def fresh_losses(prep: engine.Prepared, model: nn.Module, batches: int) -> dict[str, Any]:
    """The trained copy's loss on ``batches`` fresh batches (seeds ``seed + 1`` ...), with chance."""
    opts = prep.options
    seen: list[tuple[Any, Any]] = []

    def loss(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], m: nn.Module) -> tuple[torch.Tensor, None]:
        choice = build_loss(output, loss=opts.loss, target=opts.target, output_key=opts.output_key,
                            inputs=(args, kwargs), model=m, seed=opts.seed)
        if not seen:
            seen.append((choice, _chance(choice, output)))
        return choice.value, None

    losses, seeds = [], []
    for k in range(1, batches + 1):
        fresh = engine.fresh_inputs(prep, opts.seed + k)
        if fresh is None:
            return {"skip": "the inputs were not generated from a seed (files, --data, tensors given, the model's example "
                            "inputs): no fresh batch to make"}
        run = engine.run_model(replace(prep, loaded=replace(prep.loaded, model=model), inputs=fresh, selection=[]),
                               [], engine.RunPlan(loss=loss, show_phase=False))
        if run.cause is not None:
            return {"skip": f"the model raised on a fresh batch: {describe_exception(run.cause)}"}
        chance, task = seen[0][1]
        if chance is None:
            return {"skip": task}
        losses.append(float(run.loss_value))
        seeds.append(opts.seed + k)
    return {"losses": losses, "seeds": seeds, "chance": chance, "task": task}
