"""The statistics reducer, branch by branch, against float64 references computed in the test."""

from __future__ import annotations

import math

import pytest
import torch

from hookcli.recorders import Reducer, activation_stats, gradient_stats, iter_tensors, to_host


def reference(t: torch.Tensor) -> dict[str, float]:
    d = t.detach().double().reshape(-1)
    finite = d[torch.isfinite(d)]
    return {
        "mean": d.mean().item(), "std": d.std(correction=0).item(), "min": d.min().item(),
        "max": d.max().item(), "norm": d.norm().item(), "zero_fraction": (d == 0).double().mean().item(),
        "nan_count": int(torch.isnan(d).sum()), "inf_count": int(torch.isinf(d).sum()), "finite": finite.numel(),
    }


def seeded(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def stats_of(t: torch.Tensor, device_path: bool = False) -> dict:
    reducer = Reducer()
    if device_path:  # the branch-free accelerator path, exercised on CPU tensors
        vec = reducer._reduce_device(t.detach().float().reshape(-1), True)
    else:
        vec = reducer.reduce(t)
    return activation_stats(to_host([vec])[0])


CASES = {
    "relu": lambda: seeded(4, 64, 30, 30).relu(),
    "gaussian": lambda: seeded(3_000_000) * 0.3 + 0.05,
    "offset (ill-conditioned)": lambda: seeded(100_000) * 0.01 + 1000.0,
    "huge values (x^2 overflows float32)": lambda: seeded(10_000) * 1e20,
    "all zero": lambda: torch.zeros(5, 7),
    "one element": lambda: torch.tensor([2.5]),
}


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu-path", "device-path"])
@pytest.mark.parametrize("name", list(CASES))
def test_statistics_match_float64_reference(name: str, device_path: bool) -> None:
    if device_path and name.startswith("huge"):
        pytest.skip("the accelerator path squares in float32 (documented limitation)")
    t = CASES[name]()
    got, exp = stats_of(t, device_path), reference(t)
    for key in ("mean", "std", "min", "max", "norm", "zero_fraction"):
        assert got[key] == pytest.approx(exp[key], rel=2e-5, abs=1e-9), key
    assert got["nan_count"] == 0 and got["inf_count"] == 0


@pytest.mark.parametrize("device_path", [False, True], ids=["cpu-path", "device-path"])
def test_nan_and_inf_are_counted_exactly(device_path: bool) -> None:
    t = torch.tensor([0.0, 1.0, math.nan, -math.inf, math.inf, 0.0, math.nan, 2.0, math.nan])
    got = stats_of(t, device_path)
    assert (got["nan_count"], got["inf_count"]) == (3, 2)
    assert got["zero_fraction"] == pytest.approx(2 / 9)
    assert math.isnan(got["mean"]) and math.isnan(got["norm"])


def test_inf_without_nan_gives_infinite_norm() -> None:
    got = stats_of(torch.tensor([1.0, math.inf, 0.0]))
    assert got["inf_count"] == 1 and got["nan_count"] == 0 and got["norm"] == math.inf


def test_half_precision_and_empty() -> None:
    t = seeded(1000).half()
    got, exp = stats_of(t), reference(t.float())
    assert got["std"] == pytest.approx(exp["std"], rel=1e-5)
    empty = stats_of(torch.empty(0, 3))
    assert empty["zero_fraction"] is None and math.isnan(empty["mean"])


def test_gradient_stats_have_abs_max() -> None:
    t = torch.tensor([-3.0, 1.0, 2.0])
    got = gradient_stats(to_host([Reducer().reduce(t, zeros=False)])[0], abs_max=True)
    assert got["abs_max"] == 3.0 and "zero_fraction" not in got


def test_unchanged_tensor_is_reduced_once_and_in_place_change_is_seen() -> None:
    reducer = Reducer()
    t = seeded(100)
    first = reducer.reduce(t)
    assert reducer.reduce(t) is first  # an aliased output (Bottleneck == its last ReLU) costs nothing
    t.relu_()  # a new version: must be recomputed
    again = activation_stats(to_host([reducer.reduce(t)])[0])
    assert again["min"] >= 0 and again["zero_fraction"] > 0


def test_iter_tensors_paths() -> None:
    from collections import namedtuple

    NT = namedtuple("NT", "a b")
    x = torch.zeros(1)
    out = {"out": (x, [x, None]), "nt": NT(x, 3)}
    assert [p for p, _ in iter_tensors(out)] == ["['out'][0]", "['out'][1][0]", "['nt'].a"]
