"""The engine session's extension points (only the engine's hook modules register hooks).

``check`` measures through a ``RunObserver`` (completion order, selected output tensors, the model's
output) and ``grads --clip`` through ``clipped_gradients``; neither registers hooks of its own. Each
test compares what the engine hands out with what hooks the test registers itself see, and checks that
an observer's failure is hookcli's (InternalError) with the model handed back clean.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hookcli.commands.grads import backward_report
from hookcli.engine.run import prepare
from hookcli.engine.selection import select_modules
from hookcli.engine.hooks import attach
from hookcli.engine.session import CompletionOrder, RunObserver
from hookcli.errors import InternalError
from hookcli.options import RunOptions


class Recursive(nn.Module):
    """Calls itself ``depth`` times: the inner calls start last and return first."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, level: int = 0) -> torch.Tensor:
        x = self.lin(x)
        return self(x, level + 1) if level < self.depth else x


class Net(nn.Module):
    def __init__(self, depth: int, reuse: int) -> None:
        super().__init__()
        self.rec = Recursive(depth)
        self.act = nn.Tanh()
        self.reuse = reuse
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.rec(x)
        for _ in range(self.reuse):
            x = self.act(x)
        return self.head(x)


def order_by_hand(model: nn.Module, x: torch.Tensor, names: set[str]) -> CompletionOrder:
    """(name, call index by start) -> position in return order of the ``names`` modules' calls,
    from hooks registered here."""
    started: dict[str, int] = {}
    stack: dict[str, list[int]] = {}
    order: CompletionOrder = {}
    handles = []
    for name, module in model.named_modules():
        if name not in names:
            continue

        def pre(_m: nn.Module, _a: Any, name: str = name) -> None:
            stack.setdefault(name, []).append(started.get(name, 0))
            started[name] = started.get(name, 0) + 1

        def post(_m: nn.Module, _a: Any, _o: Any, name: str = name) -> None:
            order[(name, stack[name].pop())] = len(order)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return order


@settings(max_examples=10, deadline=None)
@given(depth=st.integers(0, 3), reuse=st.integers(1, 3))
def test_completion_order_is_the_order_calls_return(depth: int, reuse: int) -> None:
    torch.manual_seed(0)
    model, x = Net(depth, reuse), torch.randn(2, 4)
    selection = select_modules(model, all_modules=True)
    expected = order_by_hand(model, x, {name for name, _ in selection})
    with attach(model, selection, []) as session, torch.no_grad():
        model(x)
    records, _ = session.records()
    assert session.completion_order() == expected
    # keyed like the report's rows: every called row has its place, and nothing else does
    assert set(expected) == {(r.name, r.call) for r in records if r.called}


class Recorder(RunObserver):
    """Keeps copies of what the engine hands it."""

    def __init__(self, wants_tensors: bool = True) -> None:
        self.wants_tensors = wants_tensors
        self.tensors: dict[tuple[str, int, str], torch.Tensor] = {}
        self.outputs: list[torch.Tensor] = []
        self.order: CompletionOrder | None = None

    def tensor(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        self.tensors[(name, call, path)] = tensor.detach().clone()

    def output(self, output: Any) -> None:
        self.outputs.append(output.detach().clone())

    def finished(self, order: CompletionOrder) -> None:
        self.order = order


def _prep(model: nn.Module) -> Any:
    return prepare(RunOptions(model=model, input_shapes=["2x4"], all_modules=True, loss="sum"))


def test_observer_sees_each_selected_output_and_the_model_output() -> None:
    torch.manual_seed(0)
    model = Net(depth=1, reuse=2)
    prep = _prep(model)
    (x,) = prep.inputs.args
    seen: dict[tuple[str, int], torch.Tensor] = {}
    counts: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        def post(_m: nn.Module, _a: Any, out: torch.Tensor, name: str = name) -> None:
            seen[(name, counts.get(name, 0))] = out.detach().clone()
            counts[name] = counts.get(name, 0) + 1

        handles.append(module.register_forward_hook(post))
    with torch.no_grad():
        expected_output = model(x)
    for handle in handles:
        handle.remove()

    recorder = Recorder()
    backward_report(prep, observer=recorder)
    assert len(recorder.outputs) == 1 and torch.equal(recorder.outputs[0], expected_output)
    # the same tensors, for the non-recursive modules whose call index is the same either way
    for name in ("act", "head"):
        for call in range(counts[name]):
            assert torch.equal(recorder.tensors[(name, call, "")], seen[(name, call)])
    assert recorder.order == order_by_hand(model, x, {name for name, _ in prep.selection})


def test_an_observer_that_wants_no_tensors_gets_none() -> None:
    torch.manual_seed(0)
    recorder = Recorder(wants_tensors=False)
    backward_report(_prep(Net(depth=0, reuse=1)), observer=recorder)
    assert recorder.tensors == {} and len(recorder.outputs) == 1 and recorder.order


class Broken(RunObserver):
    def __init__(self, where: str) -> None:
        self.where = where
        self.wants_tensors = where == "tensor"

    def tensor(self, name: str, call: int, path: str, tensor: torch.Tensor) -> None:
        raise RuntimeError("observer bug")

    def output(self, output: Any) -> None:
        if self.where == "output":
            raise RuntimeError("observer bug")


class Swallows(nn.Module):
    """Catches what its layer raises: an observer error raised into the model would vanish here."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.lin(x)
        except Exception:  # noqa: BLE001 - the point of this model
            return x * 2


@pytest.mark.parametrize("where", ["tensor", "output"])
def test_a_failing_observer_is_hookclis_failure_and_the_model_comes_back_clean(where: str) -> None:
    torch.manual_seed(0)
    model = Swallows()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(InternalError, match="internal error") as info:
        backward_report(_prep(model), observer=Broken(where))
    assert isinstance(info.value.__cause__, RuntimeError)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for name, p in model.named_parameters():
        assert p.grad is None and not p._backward_hooks and torch.equal(p.detach(), before[name])
