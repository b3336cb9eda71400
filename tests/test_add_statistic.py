"""A statistic that needs a new accumulator (mean |x|: the sum of |x|), added through the table of
statistics at test time (tests/added_statistic.py), equals float64 torch in ``stats`` JSON, in a
hookcli.watch log line, and merged over a 2-rank torchrun launch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import hookcli
from added_statistic import Model, batch, outputs, register, unregister
from hookcli.records import statistics
from torchrun_launch import launch

TESTS = Path(__file__).resolve().parent
REL = 1e-9  # float32 activations summed in float64 both ways: only the order of the sums differs


def mean_abs(*tensors: torch.Tensor) -> float:
    values = torch.cat([t.double().reshape(-1) for t in tensors])
    return float(values.abs().mean())


@pytest.fixture
def added() -> Iterator[None]:
    register()
    yield
    unregister()


@pytest.mark.parametrize("backend", ["auto", "torch", "device"])
def test_stats_json_has_mean_abs_equal_to_float64_torch(cli, added: None, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setenv("HOOKCLI_REDUCTION", backend)
    x = batch(0)
    torch.save(x, tmp_path / "x.pt")
    result = cli("stats", "added_statistic:Model", "--input", tmp_path / "x.pt", "--format", "json")
    assert result.exit_code == 0, result.output
    layers = {layer["name"]: layer["stats"] for layer in json.loads(result.stdout)["layers"]}
    want = outputs(x)
    assert set(layers) == set(want)
    for name, stats in layers.items():
        assert list(stats)[:3] == ["mean", "std", "mean_abs"]  # declared after std
        assert stats["mean_abs"] == pytest.approx(mean_abs(want[name]), rel=REL)
    assert layers["0"]["mean_abs"] != pytest.approx(abs(layers["0"]["mean"]), rel=1e-3)  # not |mean| (signs mixed)
    table = cli("stats", "added_statistic:Model", "--input", tmp_path / "x.pt")
    assert "Mean |x|" in table.stdout


def test_gone_after_the_fixture(cli, tmp_path: Path) -> None:
    assert "mean_abs" not in statistics.keys(statistics.WATCH) and not statistics.extra_accumulators()
    torch.save(batch(0), tmp_path / "x.pt")
    result = cli("stats", "added_statistic:Model", "--input", tmp_path / "x.pt", "--format", "json")
    assert "mean_abs" not in json.loads(result.stdout)["layers"][0]["stats"]


def test_watch_line_has_mean_abs_of_outputs_and_gradients(added: None, tmp_path: Path) -> None:
    model = Model()
    x = batch(0).requires_grad_(False)
    want = outputs(x)
    # the output gradients of plain torch's step 0: d loss / d output
    h0 = model[0](x)
    h1 = model[1](h0)
    h2 = model[2](h1)
    grads = dict(zip(["0", "1", "2"], torch.autograd.grad(h2.square().mean(), [h0, h1, h2])))
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "w.jsonl"
    with hookcli.watch(model, optimizer, out=log) as w:
        for _ in range(2):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step(loss=loss)
    line = json.loads(log.read_text().splitlines()[0])
    for layer in line["layers"]:
        assert layer["stats"]["mean_abs"] == pytest.approx(mean_abs(want[layer["name"]]), rel=REL)
        assert layer["grad"]["mean_abs"] == pytest.approx(mean_abs(grads[layer["name"]]), rel=1e-6)
    weight = next(p for p in line["params"] if p["name"] == "0.weight")
    assert weight["grad"]["mean_abs"] > 0


def test_merged_over_two_torchrun_ranks(tmp_path: Path) -> None:
    log = tmp_path / "w.jsonl"
    done = launch([str(TESTS / "added_statistic_worker.py"), str(log)])
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(log.read_text().splitlines()[0])
    ranks = [outputs(batch(rank)) for rank in range(2)]
    for layer in line["layers"]:
        name = layer["name"]
        assert layer["stats"]["count"] == sum(r[name].numel() for r in ranks)
        assert layer["stats"]["mean_abs"] == pytest.approx(mean_abs(*(r[name] for r in ranks)), rel=REL)
