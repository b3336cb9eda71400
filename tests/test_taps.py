"""Taps (``engine.taps``): what the hooks record of each selected call's tensors is one object each, and a
new one is added without touching the session. A tap written here, at test time, measures every output
and first input of a real model through the commands' run loop and through a hook set kept over steps,
checked against float64 torch; what a tap raises is hookcli's failure, never the model's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchvision
from torch import nn

from hookcli.engine import run as engine
from hookcli.engine.hooks import HookSet, hooked_globally
from hookcli.engine.selection import select_modules
from hookcli.engine.taps import Gradients, InputGradients, Statistics, Tap
from hookcli.errors import InternalError
from hookcli.options import RunOptions


class AbsSums(Tap):
    """A statistic no table has: the float64 sum of |x| of each output and of each call's first input."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[str, int, str], torch.Tensor] = {}
        self.inputs: dict[tuple[str, int], torch.Tensor] = {}

    def input(self, session: Any, call: Any, inputs: Any) -> None:
        if inputs:
            self.inputs[(call.name, call.call)] = inputs[0][1].detach().abs().sum(dtype=torch.float64)

    def output(self, session: Any, call: Any, entry: Any, tensor: torch.Tensor) -> None:
        if entry.floating:
            self.outputs[(call.name, call.call, entry.path)] = tensor.detach().abs().sum(dtype=torch.float64)


def _float64_outputs(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each named module's (first input, output) in float64, from hooks of the test's own on a float64 copy."""
    import copy

    twin = copy.deepcopy(model).double()
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            seen.setdefault(name, (args[0].detach(), out.detach()))
        return hook

    handles = [twin.get_submodule(name).register_forward_hook(keep(name)) for name in names]
    with torch.no_grad():
        twin(x.double())
    for handle in handles:
        handle.remove()
    return seen


def test_a_tap_added_at_test_time_measures_every_output_and_input_through_the_run_loop() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    tap = AbsSums()
    prep = engine.prepare(RunOptions(model=model, inputs=x, layers=["layer1.0.conv1", "layer2", "fc"], seed=0))
    run = engine.run_model(prep, [Statistics(), tap], engine.RunPlan(show_phase=False))
    assert run.failure is None
    assert {(r.name, r.call, r.output) for r in run.layers} == set(tap.outputs)
    want = _float64_outputs(model, x, ["layer1.0.conv1", "layer2", "fc"])
    for name, (inp, out) in want.items():
        assert tap.outputs[(name, 0, "")].item() == pytest.approx(out.abs().sum().item(), rel=1e-5)
        assert tap.inputs[(name, 0)].item() == pytest.approx(inp.abs().sum().item(), rel=1e-5)
    # the statistics tap beside it gave the table's numbers as before
    fc = next(r for r in run.layers if r.name == "fc")
    assert fc.stats["mean"] == pytest.approx(want["fc"][1].mean().item(), rel=1e-5, abs=1e-7)


def test_a_tap_on_a_hook_set_sees_every_step_and_the_gradients_tap_beside_it_equals_autograd() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    xs = [torch.randn(5, 4) for _ in range(3)]
    wanted = []  # (the hidden activation, its gradient), from plain torch before anything is hooked
    for x in xs:
        hidden = model[1](model[0](x))
        g, = torch.autograd.grad(model[2](hidden).pow(2).sum(), hidden)
        wanted.append((hidden.detach().double(), g.double()))
    tap = AbsSums()
    with HookSet().install(model, select_modules(model, layers=["1"]), [tap, Gradients()]) as hooks:
        for step, (x, (hidden, g)) in enumerate(zip(xs, wanted)):
            model(x).pow(2).sum().backward()
            records = hooks.step_records()
            assert records.step == step and [r.name for r in records.layers] == ["1"]
            assert tap.outputs[("1", 0, "")].item() == pytest.approx(hidden.abs().sum().item(), rel=1e-6)
            assert records.layers[0].grad["norm"] == pytest.approx(g.norm().item(), rel=1e-5)
            model.zero_grad()


class Broken(Tap):
    def output(self, session: Any, call: Any, entry: Any, tensor: torch.Tensor) -> None:
        raise ZeroDivisionError("a tap's own bug")


def test_what_a_tap_raises_is_hookclis_failure_raised_after_a_run_the_model_finished() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    outputs: list[torch.Tensor] = []
    model.register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone()))
    prep = engine.prepare(RunOptions(model=model, inputs=x, all_modules=True, seed=0))
    with pytest.raises(InternalError, match="forward hook on 0") as raised:
        engine.run_model(prep, [Broken()], engine.RunPlan(show_phase=False))
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    with torch.no_grad():
        assert len(outputs) == 1 and torch.equal(outputs[0], model(x))  # the model ran to its end, untouched


def test_only_a_tap_that_needs_keyword_inputs_keeps_per_module_hooks() -> None:
    assert hooked_globally(200, 208, [Statistics(), AbsSums(), Gradients()])
    assert not hooked_globally(200, 208, [Statistics(), InputGradients()])
