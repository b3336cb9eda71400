"""The ranks' parameter rows, replica comparison and histograms (engine.rank_stats' ``param_rows``,
``replica_desync``, ``global_histograms``) go through the reduction backend's many-tensor face: one
call of each function a step, whatever the number of parameters, with the numbers of plain float64
torch over the global batch. One 2-rank torchrun (tests/distributed_reduction_worker.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import distributed_reduction_worker as worker  # noqa: E402
from distributed_api_worker import batch, model  # noqa: E402
from torchrun_launch import NEEDS_GLOO, close, rank_results  # noqa: E402

from hookcli.engine.stats import HISTOGRAM_BINS  # noqa: E402

pytestmark = NEEDS_GLOO
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("reduction")
    return rank_results(str(Path(worker.__file__)), out, WORLD)


def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's parameters and the ranks' mean gradient (each rank's of its half's mean output), in
    float64."""
    net = model(worker.HIDDEN).double()
    params = dict(net.named_parameters())
    x = batch().double()
    per = x.shape[0] // WORLD
    grads = [torch.autograd.grad(net(x[r * per:(r + 1) * per]).mean(), list(params.values())) for r in range(WORLD)]
    mean = {name: sum(g[i] for g in grads) / WORLD for i, name in enumerate(params)}
    return {name: p.detach() for name, p in params.items()}, mean


def test_each_function_makes_one_many_tensor_call_whatever_the_parameter_count(ranks: list[dict[str, Any]]) -> None:
    for said in ranks:
        assert said["calls"] == {"param_rows": {"reduce_many": 1, "norms": 1},
                                 "replica_desync": {"reduce_many": 1},
                                 "global_histograms": {"extremes": 1, "histograms": 1}}


def test_param_rows_are_the_mean_gradient_and_the_norm_of_float64_torch(ranks: list[dict[str, Any]]) -> None:
    values, mean = reference()
    for said in ranks:
        assert set(said["param_rows"]) == set(values)
        for name, (grad, norm) in said["param_rows"].items():
            g = mean[name]
            assert close(norm, float(torch.linalg.vector_norm(values[name])))
            for key, want in (("mean", g.mean()), ("std", g.std(correction=0)), ("min", g.min()), ("max", g.max()),
                              ("norm", torch.linalg.vector_norm(g))):
                assert close(grad[key], float(want), spread=float(g.std(correction=0))), (name, key)


def test_replica_desync_names_the_copy_rank_1_moved(ranks: list[dict[str, Any]]) -> None:
    values, _ = reference()
    for said in ranks:
        assert said["replica_desync"] == [list(values), [["2.bias", "value", 1]]]


def test_global_histograms_span_every_rank_and_count_each_ranks_own_part(ranks: list[dict[str, Any]]) -> None:
    values, _ = reference()
    moved = {name: v + worker.SHIFT if name == "2.bias" else v for name, v in values.items()}
    for rank, said in enumerate(ranks):
        for name, (value_part, grad_part) in zip(values, said["global_histograms"]):
            g = torch.tensor(said["grads"][name], dtype=torch.float64)  # the ranks' mean, as DDP applies it
            mine = (values, moved)[rank][name]
            for part, copies, own in ((value_part, (values[name], moved[name]), mine), (grad_part, (g, g), g)):
                lo, hi = min(float(c.min()) for c in copies), max(float(c.max()) for c in copies)
                assert close(part[0], lo) and close(part[1], hi), name
                width = (part[1] - part[0]) if part[1] > part[0] else 2.0
                left = part[0] if part[1] > part[0] else part[0] - 1.0
                bucket = ((own.reshape(-1) - left) / width * HISTOGRAM_BINS).floor().clamp(0, HISTOGRAM_BINS - 1)
                want = torch.bincount(bucket.long(), minlength=HISTOGRAM_BINS).tolist()
                assert part[2][2] == own.numel() and close(part[2][3], float(own.sum()), spread=1.0)
                assert part[2][5:] == want, name
