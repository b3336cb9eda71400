"""The hook engine through the Python API, checked against plain torch computed in the test."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hookcli
import tiny_models as tm
from reference import dummy, float64_stats
from hookcli.errors import LayerNotFoundError, ModelRaisedError
from hookcli.engine.hooks import attach
from hookcli.engine.taps import Statistics
from hookcli.engine.selection import select_modules


def assert_stats_match(stats: dict, tensor: torch.Tensor) -> None:
    exp = float64_stats(tensor)
    for key in ("mean", "std", "min", "max", "norm", "zero_fraction"):
        assert stats[key] == pytest.approx(exp[key], rel=1e-5, abs=1e-6), key
    assert stats["nan_count"] == int(torch.isnan(tensor).sum())
    assert stats["inf_count"] == int(torch.isinf(tensor).sum())


def test_reused_module_gives_one_record_per_call_with_correct_stats() -> None:
    model = tm.Reused().eval()
    report = hookcli.stats(model, input_shapes=["3x4"], seed=0, all_modules=True)
    acts = [r for r in report.layers if r.name == "act"]
    assert [r.call for r in acts] == [0, 1, 2]
    assert [r.label for r in acts] == ["act#0", "act#1", "act#2"]
    # independent forward with the same input the tool made (randn with seed 0)
    calls = tm.reused_calls(model, dummy(3, 4))
    for record, tensor in zip(acts, (calls["act#0"], calls["act#1"], calls["act#2"])):
        assert record.shape == list(tensor.shape)
        assert_stats_match(record.stats, tensor)
    order = [r.label for r in report.layers]
    assert order == ["fc1", "act#0", "fc2", "act#1", "act#2", "head"]


def test_tuple_dict_and_integer_outputs() -> None:
    model = tm.TupleOut()
    report = hookcli.stats(model, input_shapes=["2x4"], all_modules=True)
    by_label = {r.label: r for r in report.layers}
    assert {"split[0]", "split[1]", "split[2]", "heads['out']", "heads['aux']"} <= set(by_label)
    mask = by_label["split[2]"]
    assert mask.dtype == "int64" and mask.shape == [2, 4] and mask.stats is None
    assert by_label["heads['out']"].input_shapes == [[2, 2], [2, 2]]
    x = dummy(2, 4)
    with torch.no_grad():
        h = model.stem(x)
        out = model.heads.a(h[:, :2])
    assert_stats_match(by_label["heads['out']"].stats, out)
    assert_stats_match(by_label["split[1]"].stats, h[:, 2:] * 3.0)


def test_namedtuple_and_lstm_outputs() -> None:
    report = hookcli.shapes(tm.NamedTupleOut(), input_shapes=["2x4"], depth=0)
    assert [r.label for r in report.layers] == ["(model).logits", "(model).features"]
    report = hookcli.shapes(tm.TinyLSTM(), input_shapes=["2x6x5"], layers=["lstm"])
    assert [(r.output, r.shape) for r in report.layers] == [
        ("[0]", [2, 6, 7]), ("[1][0]", [1, 2, 7]), ("[1][1]", [1, 2, 7]),
    ]


def test_nan_and_inf_are_counted(tmp_path) -> None:
    model = tm.MakesNaN()
    with torch.no_grad():  # fc becomes the identity, so log sees the input itself
        model.fc.weight.copy_(torch.eye(4))
        model.fc.bias.zero_()
    report = hookcli.stats(model, input_shapes=["1x4"], fill="ones", layers=["log"])
    (record,) = report.layers
    assert record.stats["nan_count"] == 0 and record.stats["inf_count"] == 0
    path = tmp_path / "x.pt"
    torch.save(torch.tensor([[-1.0, 0.0, 2.0, 3.0]]), path)  # log(-1) = nan, log(0) = -inf
    report = hookcli.stats(model, inputs=[path], layers=["log"])
    (record,) = report.layers
    assert record.stats["nan_count"] == 1 and record.stats["inf_count"] == 1
    assert math.isnan(record.stats["mean"])


def test_half_precision_is_reduced_in_float32() -> None:
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU())
    report = hookcli.stats(model, input_shapes=["4x8"], dtype="float16")
    assert report.layers[0].dtype == "float16" and report.inputs[0].dtype == "float16"
    assert next(model.parameters()).dtype == torch.float32  # restored
    x = dummy(4, 8).half()
    half_linear = nn.Linear(8, 64).half()
    half_linear.load_state_dict({k: v.half() for k, v in model[0].state_dict().items()})
    with torch.no_grad():
        expected = half_linear(x).float()
    assert_stats_match(report.layers[0].stats, expected)


def test_not_called_module_is_reported() -> None:
    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    report = hookcli.shapes(Skips(), input_shapes=["1x2"])
    unused = [r for r in report.layers if r.name == "unused"]
    assert len(unused) == 1 and unused[0].called is False and unused[0].shape is None
    assert unused[0].to_dict()["called"] is False


def test_model_that_raises_gives_partial_rows_failing_module_and_is_restored() -> None:
    model = tm.Raises().train()
    model.good.weight.grad = torch.ones_like(model.good.weight)
    grad_before = model.good.weight.grad
    with pytest.raises(ModelRaisedError) as info:
        hookcli.stats(model, input_shapes=["2x4"])
    err = info.value
    assert err.module == "bad" and err.input_shapes == [[2, 6]]
    assert err.exit_code == 1
    rows = {r.name: r for r in err.report.layers}
    assert rows["good"].called and rows["good"].stats is not None
    assert rows["act"].called and rows["act"].shape == [2, 6]
    assert rows["bad"].raised and rows["bad"].shape is None
    assert rows["never"].called is False
    assert err.report.failure.module == "bad"
    # restored: hooks gone, train mode back, .grad object untouched
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(m.training for m in model.modules())
    assert model.good.weight.grad is grad_before


def test_model_restored_after_device_dtype_and_mode_change() -> None:
    model = tm.InPlace().train()
    weight = model.fc.weight
    data_ptr = weight.data_ptr()
    running_mean = model.bn.running_mean.clone()
    hookcli.stats(model, input_shapes=["5x4"], dtype="float64", train=True)
    assert model.fc.weight is weight and weight.dtype == torch.float32 and weight.data_ptr() == data_ptr
    assert torch.equal(model.bn.running_mean, running_mean)  # train-mode BN update undone
    assert model.training and model.bn.training
    hookcli.stats(model, input_shapes=["5x4"])  # eval run
    assert model.training


def test_hooks_are_removed_and_engine_works_directly() -> None:
    model = tm.Reused()
    with attach(model, select_modules(model), [Statistics()]) as session:
        with torch.no_grad():
            model(torch.randn(2, 4))
        assert model.act._forward_hooks
    assert not model.act._forward_hooks and not model.act._forward_pre_hooks
    records, _ = session.records()
    assert [r.label for r in records] == ["fc1", "act#0", "fc2", "act#1", "act#2", "head"]


def test_selection_forms() -> None:
    model = tm.TupleOut()
    names = lambda **kw: [n for n, _ in select_modules(model, **kw)]  # noqa: E731
    assert names() == ["stem", "split", "heads"]
    assert names(depth=2) == ["stem", "split", "heads", "heads.a", "heads.b"]
    assert names(depth=0) == [""]
    assert names(all_modules=True) == ["stem", "split", "heads", "heads.a", "heads.b"]
    assert names(layers=["heads.*"]) == ["heads.a", "heads.b"]
    assert names(layers="stem,heads.b") == ["stem", "heads.b"]
    assert names(types=["Linear"]) == ["stem", "heads.a", "heads.b"]
    assert names(layers=["heads"], types=["Linear"]) == ["heads.a", "heads.b"]
    with pytest.raises(LayerNotFoundError) as info:
        names(layers=["head.a"])
    assert "heads.a" in info.value.hint
    with pytest.raises(LayerNotFoundError) as info:
        names(types=["Linaer"])
    assert "Linear" in info.value.hint


def test_tied_parameters_are_counted_once() -> None:
    model = tm.Tied()
    report = hookcli.shapes(model, input_shapes=["2x3:int64"])
    expected = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert report.model.params == expected == 40
    assert report.layers[0].dtype == "float32"  # embedding output


def test_resnet18_children_shapes_and_stats() -> None:
    report = hookcli.stats("resnet18", input_shapes=["1x3x64x64"])
    names = [r.name for r in report.layers]
    assert names == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"]
    shapes = {r.name: r.shape for r in report.layers}
    assert shapes["layer4"] == [1, 512, 2, 2] and shapes["fc"] == [1, 1000]
    assert report.model.params == 11689512
    relu = next(r for r in report.layers if r.name == "relu")
    assert relu.stats["min"] >= 0 and 0 < relu.stats["zero_fraction"] < 1


@pytest.mark.parametrize("kernel", ["kernel", "torch reductions"])
def test_every_call_of_every_resnet18_module_matches_plain_torch(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on both CPU statistics paths (the C kernel, with several threads on these sizes, and
    HOOKCLI_NO_KERNEL=1), against outputs captured by plain forward hooks in the test."""
    from torchvision.models import resnet18

    from hookcli.engine.kernel import NO_KERNEL_ENV
    from hookcli.engine.stats import _fastreduce

    if kernel == "kernel" and _fastreduce is None:
        pytest.skip("hookcli.engine._fastreduce was not built here")
    monkeypatch.setenv(NO_KERNEL_ENV, "0" if kernel == "kernel" else "1")
    torch.manual_seed(0)
    model = resnet18(weights=None).eval()
    report = hookcli.stats(model, input_shapes=["2x3x64x64"], seed=0, all_modules=True)

    captured: dict[tuple[str, int], torch.Tensor] = {}
    calls: dict[str, int] = {}

    def capture(name: str):
        def hook(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
            captured[(name, calls.get(name, 0))] = out.detach().clone()  # as it is when the module returns
            calls[name] = calls.get(name, 0) + 1
        return hook

    handles = [m.register_forward_hook(capture(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(dummy(2, 3, 64, 64))
    finally:
        for h in handles:
            h.remove()
    assert {(r.name, r.call) for r in report.layers} == set(captured)
    for record in report.layers:
        assert_stats_match(record.stats, captured[(record.name, record.call)])


def test_a_collector_sees_the_run_loops_events_in_order_and_gets_its_vectors_back() -> None:
    """A collector added to a run's plan is called at each phase (the output at forward's end, inside the
    forward context; backward inside its own) and its vectors come back from the run's one transfer:
    here the output's float64-checked sum and the loss, equal to plain torch's."""
    from contextlib import contextmanager

    from hookcli.engine import run as engine
    from hookcli.engine.collectors import Collector
    from hookcli.options import RunOptions

    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh()).double()
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    events: list[str] = []

    @contextmanager
    def around(name: str):
        events.append(f"enter {name}")
        yield
        events.append(f"leave {name}")

    class Seen(Collector):
        def begin(self, step, stack):
            events.append("begin")

        def forward(self, step):
            return around("forward")

        def forward_end(self, step, output):
            events.append("forward_end")
            self.total = output.detach().sum().reshape(1)

        def backward(self, step):
            return around("backward")

        def ran(self, step):
            events.append("ran")

        def end(self, step):
            events.append("end")

        def vectors(self, step):
            events.append("vectors")
            return [self.total, step.loss.detach().reshape(1)]

        def records(self, step, values):
            events.append("records")
            self.values = values

    seen = Seen()
    prep = engine.prepare(RunOptions(model=model, inputs=x, seed=0))
    plan = engine.RunPlan(loss=lambda out, a, k, m: (out.pow(2).mean(), "mine"), collectors=[seen], show_phase=False)
    run = engine.run_model(prep, [Statistics()], plan)
    assert events == ["begin", "enter forward", "forward_end", "leave forward", "enter backward", "leave backward",
                      "ran", "end", "vectors", "records"]
    with torch.no_grad():
        expected = model(x)
    assert seen.values[0][0] == pytest.approx(float(expected.sum()), rel=1e-12)
    assert seen.values[1][0] == pytest.approx(float(expected.pow(2).mean()), rel=1e-12)
    assert run.loss == "mine" and run.loss_value == pytest.approx(float(expected.pow(2).mean()), rel=1e-12)


def test_a_collectors_own_failure_during_forward_is_hookclis_not_the_models() -> None:
    """What a collector raises at forward's end is stored by the session and raised after the run as
    hookcli's InternalError; the model is not blamed."""
    from hookcli.engine import run as engine
    from hookcli.engine.collectors import Collector
    from hookcli.errors import InternalError
    from hookcli.options import RunOptions

    class Broken(Collector):
        def forward_end(self, step, output):
            step.session.call(lambda: 1 / 0, where="a broken collector")

    prep = engine.prepare(RunOptions(model=nn.Linear(2, 2), input_shapes=["1x2"], seed=0))
    with pytest.raises(InternalError, match="a broken collector"):
        engine.run_model(prep, [], engine.RunPlan(collectors=[Broken()], show_phase=False))


def test_a_collector_sees_each_optimiser_step_with_the_steps_gradients_before_the_update() -> None:
    """With optimiser steps, ``optimiser_step`` is called after each ``loss.backward()`` and before
    ``optimizer.step()``: the weight's ``.grad`` there is torch's gradient of that step's loss, and
    ``end`` comes after the plan's own ``finished``."""
    from hookcli.engine import run as engine
    from hookcli.engine.collectors import Collector
    from hookcli.options import RunOptions

    model = nn.Linear(3, 1).double()
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    reference = nn.Linear(3, 1).double()
    reference.load_state_dict(model.state_dict())
    events: list[str] = []
    seen: list[torch.Tensor] = []

    class Grads(Collector):
        def optimiser_step(self, step):
            events.append("optimiser_step")
            seen.append(step.model.weight.grad.clone())

        def end(self, step):
            events.append("end")

    steps = engine.OptimiserSteps(lambda: torch.optim.SGD(model.parameters(), lr=0.1), 2,
                                  finished=lambda: events.append("finished"))
    plan = engine.RunPlan(loss=lambda out, a, k, m: (out.pow(2).mean(), None), steps=steps, collectors=[Grads()],
                          show_phase=False)
    prep = engine.prepare(RunOptions(model=model, inputs=x, seed=0))
    with engine.running(prep, keep_params=False) as (placed, args, kwargs):
        engine.run_step(prep, placed, args, kwargs, [], plan)
    assert events == ["optimiser_step", "optimiser_step", "finished", "end"]
    for got in seen:  # plain SGD steps on the reference, each step's gradient checked before its update
        weight, bias = torch.autograd.grad(reference(x).pow(2).mean(), [reference.weight, reference.bias])
        assert torch.allclose(got, weight, rtol=1e-12, atol=1e-15)
        with torch.no_grad():
            reference.weight -= 0.1 * weight
            reference.bias -= 0.1 * bias
