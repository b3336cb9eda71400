"""``hookcli.watch(tensorboard_dir=...)``: the event file read back with TensorBoard's own
``EventAccumulator`` holds, at each logged step, the values of that step's JSON log line (float32, as
TensorBoard keeps scalars) and the parameters' histograms (plain torch's buckets); without the tensorboard
package it is a UsageError with a pip hint."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.errors import OutputError, UsageError
from test_watch import read_log

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_the_event_file_holds_the_log_lines_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with hookcli.watch(model, opt, every=5, out=tmp_path / "log.jsonl", tensorboard_dir=tmp_path / "tb" / "run1",
                       flight=3) as w:
        for _ in range(12):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "run1"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 5, 10]
    want: dict[str, dict[int, float]] = {}
    for line in lines:
        step = line["step"]
        want.setdefault("loss", {})[step] = line["loss"]
        for layer in line["layers"]:
            for key in ("rms", "abs_max", "zero_fraction"):
                want.setdefault(f"layers/{layer['name']}/{key}", {})[step] = layer["stats"][key]
            want.setdefault(f"layers/{layer['name']}/grad_rms", {})[step] = layer["grad"]["rms"]
        for p in line["params"]:
            want.setdefault(f"params/{p['name']}/grad_norm", {})[step] = p["grad"]["rms"] * math.sqrt(p["grad"]["count"])
            want.setdefault(f"params/{p['name']}/update_ratio", {})[step] = p["update_ratio"]
    assert set(scalars) == set(want)
    assert "layers/1/zero_fraction" in want and "params/2.weight/update_ratio" in want
    for tag, values in want.items():
        assert scalars[tag] == pytest.approx(values, rel=1e-6, abs=1e-30), tag


def test_without_tensorboard_it_is_a_usage_error_with_a_pip_hint(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith(("tensorboard.", "torch.utils.tensorboard"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without it imports
    with pytest.raises(UsageError, match="needs the tensorboard package") as info:
        hookcli.watch(nn.Linear(2, 2), tensorboard_dir=tmp_path / "tb")
    assert "pip install 'hookcli[tensorboard]'" in info.value.hint
    assert not (tmp_path / "tb").exists()


def test_a_tensorboard_dir_that_is_a_file_is_an_output_error(tmp_path: Path) -> None:
    (tmp_path / "tb").write_text("not a folder")
    with pytest.raises(OutputError, match="cannot write"):
        hookcli.watch(nn.Linear(2, 2), tensorboard_dir=tmp_path / "tb")
    assert (tmp_path / "tb").read_text() == "not a folder"


def _histograms(directory: Path) -> dict[str, dict[int, Any]]:
    events = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.HISTOGRAMS: 0})
    events.Reload()
    return {tag: {e.step: e.histogram_value for e in events.Histograms(tag)} for tag in events.Tags()["histograms"]}


def _at_centres(lo: float, span: float, buckets: list[int], shape: tuple[int, int]) -> torch.Tensor:
    """Values at the centres of 30 buckets from lo to lo + span (so no value is near an edge), with lo
    and lo + span themselves first and last: the min and max."""
    values = [lo] + [lo + (k + 0.5) * span / 30 for k in buckets] + [lo + span]
    return torch.tensor((values * shape[0] * shape[1])[: shape[0] * shape[1]]).reshape(shape)


@settings(max_examples=15, deadline=None)
@given(lo=st.floats(-10, 10), span=st.floats(0.5, 100), buckets=st.lists(st.integers(0, 29), min_size=1, max_size=40),
       grad_lo=st.floats(-5, 5), grad_buckets=st.lists(st.integers(0, 29), min_size=1, max_size=40))
def test_parameter_histograms_are_plain_torchs_buckets(lo: float, span: float, buckets: list[int], grad_lo: float,
                                                       grad_buckets: list[int]) -> None:
    """At a logged step: ``params/<name>/values`` and ``params/<name>/grad`` are 30 equal buckets from the
    tensor's min to its max, whose counts are ``torch.histc``'s, and min / max / num / sum / sum of
    squares are plain torch's (the weights before the update, the gradient that the update read)."""
    model = nn.Linear(6, 5)
    weight = _at_centres(lo, span, buckets, (5, 6)).float()
    coefficient = _at_centres(grad_lo, 2.0, grad_buckets, (5, 6)).float()
    with torch.no_grad():
        model.weight.copy_(weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        with hookcli.watch(model, opt, every=1, tensorboard_dir=tmp) as w:
            model(torch.zeros(1, 6))  # a forward the watch sees; the loss below makes weight's gradient known
            (model.weight * coefficient).sum().backward()
            grad = model.weight.grad.clone()
            opt.step()
            opt.zero_grad()
            w.step()
        got = _histograms(Path(tmp))
    assert torch.equal(grad, coefficient)
    for tag, t in (("params/weight/values", weight), ("params/weight/grad", grad)):
        h = got[tag][0]
        lo_t, hi_t = float(t.min()), float(t.max())
        assert (h.min, h.max, h.num) == (lo_t, hi_t, t.numel())
        assert h.sum == pytest.approx(float(t.double().sum()), rel=1e-9, abs=1e-9)
        assert h.sum_squares == pytest.approx(float(t.double().square().sum()), rel=1e-9)
        assert list(h.bucket) == torch.histc(t, bins=30, min=lo_t, max=hi_t).tolist()
        assert list(h.bucket_limit) == pytest.approx([lo_t + (hi_t - lo_t) * (k + 1) / 30 for k in range(30)])


def test_histograms_are_written_at_logged_steps_only_and_only_with_a_tensorboard_dir(tmp_path: Path) -> None:
    """every=2 over 4 steps: histograms at steps 0 and 2, for each parameter and its gradient, the sum of
    their buckets the parameter's size; the JSON log's lines stay as they were (no histogram in them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = {}
    with hookcli.watch(model, opt, every=2, out=tmp_path / "log.jsonl", tensorboard_dir=tmp_path / "tb") as w:
        for step in range(4):
            model(torch.randn(16, 4)).pow(2).mean().backward()
            seen[step] = {name: (p.detach().clone(), p.grad.clone()) for name, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            w.step()
    got = _histograms(tmp_path / "tb")
    names = [name for name, _ in model.named_parameters()]
    assert set(got) == {f"params/{name}/{kind}" for name in names for kind in ("values", "grad")}
    for name in names:
        for kind, index in (("values", 0), ("grad", 1)):
            assert set(got[f"params/{name}/{kind}"]) == {0, 2}
            for step, h in got[f"params/{name}/{kind}"].items():
                t = seen[step][name][index]
                assert (h.min, h.max, h.num) == (float(t.min()), float(t.max()), t.numel())
                assert sum(h.bucket) == t.numel() and len(h.bucket) == 30
    assert all("histogram" not in text for text in (tmp_path / "log.jsonl").read_text().splitlines())
    with hookcli.watch(model, opt, every=1) as w:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        w.step()
    assert all(p.values_histogram is None and p.grad_histogram is None for p in w.last.params)


def _shown(h: Any) -> list[list[float]]:
    """The buckets TensorBoard's histogram dashboard draws of a written histogram, ``[left, right, count]``
    each: its own conversion of the proto (``data_compat``: the empty buckets at both ends dropped, the
    outer edges the values' min and max)."""
    from tensorboard import data_compat
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary
    from tensorboard.util import tensor_util

    proto = HistogramProto(min=h.min, max=h.max, num=h.num, sum=h.sum, sum_squares=h.sum_squares,
                           bucket_limit=h.bucket_limit, bucket=h.bucket)
    return tensor_util.make_ndarray(data_compat.migrate_value(Summary.Value(tag="t", histo=proto)).tensor).tolist()


def test_a_constant_parameters_histogram_is_torch_histcs_and_shows_as_add_histograms(tmp_path: Path) -> None:
    """A LayerNorm's weight (all 1) and bias (all 0) at init are constant: their buckets span value - 1
    to value + 1 with every value in the middle one, as ``torch.histc`` widens a constant range (not 30
    empty-width buckets with everything in the first), and TensorBoard draws them as it draws
    ``SummaryWriter.add_histogram`` of the same tensor."""
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with hookcli.watch(model, opt, every=1, tensorboard_dir=tmp_path / "tb") as w:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        w.step()
    got = _histograms(tmp_path / "tb")
    with SummaryWriter(str(tmp_path / "own")) as own:
        for name in ("1.weight", "1.bias"):
            own.add_histogram(name, before[name], 0)
    theirs = _histograms(tmp_path / "own")
    for name, value in (("1.weight", 1.0), ("1.bias", 0.0)):
        t = before[name]
        assert torch.equal(t, torch.full_like(t, value))  # constant, as the test needs
        h = got[f"params/{name}/values"][0]
        assert (h.min, h.max, h.num) == (value, value, 6)
        assert list(h.bucket) == torch.histc(t, bins=30).tolist() and h.bucket[15] == 6
        edges = torch.linspace(value - 1, value + 1, 31, dtype=torch.float64)[1:].tolist()
        assert list(h.bucket_limit) == pytest.approx(edges, abs=1e-9)
        assert _shown(h) == _shown(theirs[name][0]) == [[value, value, 6.0]]
    # a parameter that is not constant keeps its own min..max
    h = got["params/0.weight/values"][0]
    assert list(h.bucket) == torch.histc(before["0.weight"], bins=30).tolist()


@pytest.mark.parametrize("value", [1.0, 0.0, -2.5])
def test_a_constant_histogram_over_ranks_bounds_is_torch_histcs(value: float) -> None:
    """Under torchrun the buckets are counted with the global min and max as ``bounds``
    (``rank_stats.global_histograms``) and the record made from them (``_add_histograms``): a tensor
    constant over every rank gets ``torch.histc``'s widened buckets there too."""
    from hookcli.engine.stats import histogram
    from hookcli.records import Histogram

    part = torch.full((5,), value)
    counts = histogram(part, bounds=(value, value))
    assert counts is not None
    record = Histogram.from_values([value, value, *counts[2:].tolist()])
    assert record is not None and record.counts == torch.histc(part, bins=30).tolist()
    edges = torch.linspace(value - 1, value + 1, 31, dtype=torch.float64)[1:].tolist()
    assert record.limits == pytest.approx(edges, abs=1e-9)
