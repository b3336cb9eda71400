"""``hookcli.watch(flight=K)``: the flight recorder. A NaN injected at a known layer and step (unlogged,
``every=50``) is named exactly, forward or backward; the ring's lines hold the numbers plain torch gives;
the loop raising writes the ring; the ring stays K steps; the device-side flag finds the first
non-finite step without reading the device per step."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pandas
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.engine.flight import FlightRecorder
from hookcli.engine import reduction
from hookcli.engine.stats import Reducer
from hookcli.errors import CheckFailedError, UsageError
from test_watch import assert_stats, no_hooks_left, read_log
from training_bugs import NanGrad


class Poisoned(nn.Linear):
    """A Linear whose output is NaN in one row at call ``at`` (forward), or whose input gradient is at
    call ``grad_at`` (backward only: the forward values are untouched)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.at: int | None = None
        self.grad_at: int | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call == self.grad_at:
            x = NanGrad.apply(x)
        y = super().forward(x)
        if call == self.at:
            y = y.clone()
            y[0] = float("nan")
        return y


def mlp() -> nn.Sequential:
    """0 Linear, 1 ReLU, 2 Poisoned, 3 Tanh, 4 Poisoned, 5 Linear: every module selected by default."""
    return nn.Sequential(Poisoned(4, 8), nn.ReLU(), Poisoned(8, 8), nn.Tanh(), Poisoned(8, 8), nn.Linear(8, 1))


def run(model: nn.Module, steps: int, log: Path | None, **watch: Any) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with hookcli.watch(model, opt, out=log, **watch) as w:
        for _ in range(steps):
            loss = model(torch.randn(16, 4, generator=g)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    no_hooks_left(model, opt)
    return w


@settings(max_examples=10, deadline=None)
@given(layer=st.sampled_from(["0", "2", "4"]), step=st.integers(1, 49), size=st.integers(1, 12),
       backward=st.booleans())
def test_a_nan_at_an_unlogged_step_is_named_by_layer_step_and_direction(
        tmp_path_factory: pytest.TempPathFactory, layer: str, step: int, size: int, backward: bool) -> None:
    """every=50: steps 1..49 are unlogged; the ring writes the steps up to the NaN and the finding names
    where it was made: L itself, forward or backward (a NaN gradient into L's input is first seen at the
    output before L, and the message says so)."""
    log = tmp_path_factory.mktemp("flight") / "log.jsonl"
    torch.manual_seed(0)
    model = mlp()
    setattr(model[int(layer)], "grad_at" if backward else "at", step)
    w = run(model, step + 3, log, every=50, flight=size)

    named = layer  # the module whose code made it: L's forward, or L's backward (into its input)
    if layer == "0" and backward:
        named = None  # no selected output before the first layer: its parameters' gradients stay finite
    lines = read_log(log)
    flight = [line for line in lines if line.get("flight")]
    if named is None:
        assert w.findings == [] and flight == []
        return
    assert [(f.rule, f.layer, f.step, f.direction) for f in w.findings] == [
        ("nonfinite", named, step, "backward" if backward else "forward")]
    after = [50] if step + 3 > 50 else []  # a logged step's line as ever, after the ring's
    assert [line["step"] for line in lines] == [0, *range(max(1, step - size + 1), step + 1), *after]
    assert flight[-1]["findings"][0]["layer"] == named
    assert all(line["params"] == [] and not line["findings"] for line in flight[:-1])


def test_a_flight_line_holds_plain_torch_numbers(tmp_path: Path) -> None:
    """The ring's step 5 against the test's own forward hooks and torch.autograd.grad, in float64."""
    torch.manual_seed(0)
    model = mlp()
    model[4].at = 6
    reference = mlp()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):  # the same first 5 steps, unwatched
        reference(torch.randn(16, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    outputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o)) for n, m in
               reference.named_children()]
    loss = reference(torch.randn(16, 4, generator=g)).pow(2).mean()
    for h in handles:
        h.remove()
    grads = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values()))))

    run(model, 8, tmp_path / "log.jsonl", every=50, flight=4)
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 3, 4, 5, 6]
    line = lines[3]
    assert line["flight"] is True and line["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert [layer["name"] for layer in line["layers"]] == ["0", "1", "2", "3", "4", "5"]
    for layer in line["layers"]:
        assert_stats(layer["stats"], [outputs[layer["name"]]])
        assert_stats(layer["grad"], [grads[layer["name"]]])
    frame = pandas.read_json(tmp_path / "log.jsonl", lines=True)
    assert list(frame["step"][frame["flight"] == True]) == [3, 4, 5, 6]  # noqa: E712 (pandas' NaN elsewhere)


def test_the_loop_raising_writes_the_ring_with_the_step_in_progress(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="the loop's own"):
        with hookcli.watch(model, opt, every=50, out=tmp_path / "log.jsonl", flight=5) as w:
            for step in range(30):
                loss = model(torch.randn(16, 4)).pow(2).mean()
                if step == 23:
                    raise RuntimeError("the loop's own error")
                loss.backward()
                opt.step()
                opt.zero_grad()
                w.step(loss=loss)
    lines = read_log(tmp_path / "log.jsonl")
    assert [(line["step"], line.get("flight")) for line in lines] == [
        (0, None), (19, True), (20, True), (21, True), (22, True), (23, True)]
    last = lines[-1]  # forward ran, backward did not
    assert last["loss"] is None and all(layer["stats"]["count"] and layer["grad"] is None for layer in last["layers"])
    assert w.findings == []
    no_hooks_left(model, opt)


def test_a_healthy_run_writes_no_flight_line_and_the_ring_stays_k_steps(tmp_path: Path) -> None:
    """400 steps with flight=7: the ring holds 7 steps; what the watch keeps does not grow (counted as
    live tensors and objects between step 200 and 400)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    counts = []
    with hookcli.watch(model, opt, every=100, out=tmp_path / "log.jsonl", flight=7) as w:
        for step in range(400):
            if step in (200, 399):
                gc.collect()
                counts.append((sum(type(o) in (torch.Tensor, nn.Parameter) for o in gc.get_objects()), len(gc.get_objects())))
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
        ring = w._watcher.flight.ring
        assert len(ring) == 7 and [entry[0] for entry in ring] == list(range(393, 400))
    assert counts[0][0] == counts[1][0]
    assert counts[1][1] - counts[0][1] < 50  # no growth (what other tests left, e.g. dynamo caches, may shrink)
    assert [line["step"] for line in read_log(tmp_path / "log.jsonl")] == [0, 100, 200, 300]


def test_on_finding_raise_stops_the_loop_at_the_flight_finding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp()
    model[2].at = 12
    with pytest.raises(CheckFailedError, match=r"step 12: made by 2 \(its output: 8 non-finite values\)"):
        run(model, 30, tmp_path / "log.jsonl", every=50, flight=3, on_finding="raise")
    assert [line["step"] for line in read_log(tmp_path / "log.jsonl")] == [0, 10, 11, 12]


@pytest.mark.parametrize("flight", [0, -1, 2.5, True, "10"])
def test_a_bad_flight_is_a_usage_error(flight: Any) -> None:
    with pytest.raises(UsageError, match="flight must be a whole number"):
        hookcli.watch(nn.Linear(2, 2), flight=flight)


def device_vector(t: torch.Tensor, zeros: bool = True) -> torch.Tensor:
    """``t``'s vector by the device backend (the accelerator path), here on a CPU tensor."""
    vector = reduction.reduce(t, zeros=zeros, reducer=Reducer(backend="device"))
    assert isinstance(vector, torch.Tensor)
    return vector


def test_the_device_flag_names_the_first_bad_step_without_reading_every_step() -> None:
    """Device vectors (the accelerator path, here on CPU tensors): the flag is read every K steps
    and by ``read``; the first bad step is exact, later bad steps do not move it."""
    recorder = FlightRecorder(5)
    good, bad = torch.ones(6), torch.tensor([1.0, float("inf"), 2.0])
    for step in range(4):
        recorder.push(step, {("a", ""): ["Linear", [6], "float32", 1, device_vector(good), None]}, None)
    assert recorder.first_bad is None and recorder._unread == 4
    recorder.push(4, {("a", ""): ["Linear", [3], "float32", 1, device_vector(bad), None]}, None)
    assert recorder.first_bad == 4 and recorder._unread == 0  # the 5th unread step: read now
    recorder = FlightRecorder(50)
    for step in range(6):
        vector = device_vector(bad if step >= 2 else good)
        recorder.push(step, {("a", ""): ["Linear", [3], "float32", 1, None, vector]}, None)
    assert recorder.first_bad is None
    assert recorder.read() == 2
    two = {("a", ""): ["Linear", [6], "float32", 1, device_vector(good),
                       device_vector(good * 2, zeros=False)]}
    recorder.push(6, two, None)
    stats, grad = two[("a", "")][4:]  # one tensor per step in the ring, its rows the vectors
    assert stats.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    assert stats.tolist() == device_vector(good).tolist()


@settings(max_examples=20, deadline=None)
@given(size=st.integers(2, 9), bad=st.integers(0, 40))
def test_device_flags_read_late_still_write_the_k_steps_up_to_the_first_bad_one(size: int, bad: int) -> None:
    """On an accelerator the flag is read up to K - 1 steps after the bad step: the ring (2K - 1 steps)
    still holds the K steps up to it, and exactly those are written, as on CPU."""
    recorder = FlightRecorder(size)
    good, inf = torch.ones(4), torch.tensor([1.0, float("inf")])
    step = 0
    while recorder.first_bad is None:
        vector = device_vector(inf if step >= bad else good)
        recorder.push(step, {("a", ""): ["Linear", [4], "float32", 1, vector, None]}, None)
        step += 1
    assert recorder.first_bad == bad and step - 1 - bad < size
    assert [entry[0] for entry in recorder.unwritten(upto=recorder.first_bad)] == list(range(max(0, bad - size + 1),
                                                                                         bad + 1))


def test_without_w_step_the_optimizer_ends_the_recorded_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp()
    model[4].at = 7
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with hookcli.watch(model, opt, every=50, out=tmp_path / "log.jsonl", flight=4) as w:
        for _ in range(10):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    assert [(f.layer, f.step, f.direction) for f in w.findings] == [("4", 7, "forward")]
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 4, 5, 6, 7]
    # the loss is the value backward() was called on (NaN from step 7 on, as "nan")
    assert [line["loss"] for line in lines[:4]] == [losses[0], losses[4], losses[5], losses[6]]
    assert lines[4]["loss"] == "nan" and losses[7] != losses[7]


def test_a_nan_at_a_logged_step_writes_the_steps_before_it(tmp_path: Path) -> None:
    """every=5, the NaN at step 10 (logged): the ring's 8 and 9 are written before 10's own line, which
    carries the finding as without flight."""
    torch.manual_seed(0)
    model = mlp()
    model[2].at = 10
    w = run(model, 12, tmp_path / "log.jsonl", every=5, flight=3)
    lines = read_log(tmp_path / "log.jsonl")
    assert [(line["step"], line.get("flight", False)) for line in lines] == [
        (0, False), (5, False), (8, True), (9, True), (10, False)]
    assert [(f.layer, f.step, f.direction) for f in w.findings] == [("2", 10, "forward")]
    assert lines[-1]["findings"][0]["rule"] == "nonfinite" and lines[-1]["params"]
