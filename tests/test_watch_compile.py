"""``hookcli.watch`` over a ``torch.compile``d model (backend ``aot_eager``: Dynamo's guards and AOT
autograd, no C++ compiler): 200 steps with ``every=10`` recompile at most twice, all of it in the first
steps (flipping the hooks between logged and unlogged steps recompiles nothing), the losses are the
compiled unwatched run's, and the logged steps' numbers are plain torch's. Counted with torch's own
compile metrics (``torch._dynamo.utils.get_compilation_metrics``: one entry per frame compiled, with
its recompile reason)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import hookcli
from test_watch import assert_stats, no_hooks_left

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics  # noqa: E402


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))


def compiled_run(model: nn.Module, steps: int, watch: dict[str, Any] | None) -> tuple[list[float], Any, list[int]]:
    """Train ``torch.compile(model)`` for ``steps``; the losses, the watch, and the step at which each
    recompilation happened (from a fresh Dynamo state)."""
    dynamo.reset()
    clear_compilation_metrics()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    losses: list[float] = []
    recompiled_at: list[int] = []
    w = hookcli.watch(compiled, opt, **watch) if watch is not None else None
    seen = 0
    with w if w is not None else torch.enable_grad():
        for step in range(steps):
            x = torch.randn(8, 4, generator=g)
            loss = compiled(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if w is not None:
                w.step(loss=loss)
            losses.append(loss.item())
            reasons = [m for m in get_compilation_metrics() if m.recompile_reason]
            recompiled_at += [step] * (len(reasons) - seen)
            seen = len(reasons)
    no_hooks_left(model, opt)
    return losses, w, recompiled_at


def test_a_compiled_model_recompiles_at_most_twice_in_200_steps_and_its_losses_are_the_unwatched_ones() -> None:
    torch.manual_seed(0)
    model = mlp()
    plain = copy.deepcopy(model)
    want, _, plain_recompiles = compiled_run(plain, 200, None)
    got, w, recompiled_at = compiled_run(model, 200, {"every": 10})
    graph_breaks = sum(counters["graph_break"].values())
    assert got == want
    assert plain_recompiles == []
    # the selected modules' hooks run eagerly (torch.compiler.disable): each is a graph break, and the
    # Linear.forward they split off is compiled per distinct input (3 Linears: 2 recompiles), at step 0;
    # the idle/recording flip between steps 0, 1, ..., 10, 11 recompiles nothing
    assert len(recompiled_at) <= 2 and set(recompiled_at) <= {0}, recompiled_at
    assert graph_breaks >= 1  # (benchmarks/compile_breaks.py prints them for a resnet18)
    assert w.last.step == 190 and [layer.name for layer in w.last.layers] == ["0", "1", "2", "3", "4"]


def test_a_compiled_models_logged_step_is_plain_torch() -> None:
    """Step 0's outputs and their gradients against the test's own forward hooks on the uncompiled copy."""
    torch.manual_seed(0)
    model = mlp()
    reference = copy.deepcopy(model)
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o))
               for n, m in reference.named_children()]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    loss = reference(x).pow(2).mean()
    for h in handles:
        h.remove()
    grads = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values()))))
    _, w, _ = compiled_run(model, 1, {"every": 10})
    assert w.last.loss == pytest.approx(loss.item(), rel=1e-6)
    for layer in w.last.layers:
        assert_stats(layer.stats, [outputs[layer.name]])
        assert_stats(layer.grad, [grads[layer.name]])


def test_a_compiled_model_with_flight_names_the_nan() -> None:
    """flight=K records every step of a compiled model too (the hooks run at every step then)."""
    torch.manual_seed(0)
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")  # from step 0 on: the NaN is in 2's output first
    _, w, recompiled_at = compiled_run(model, 12, {"every": 10, "flight": 4, "layers": "0,2,4"})
    assert [(f.layer, f.step, f.direction) for f in w.findings] == [("2", 0, "forward")]
    assert set(recompiled_at) <= {0}
