"""hookcli.stats and hookcli.grads under torchrun on the models users hold (docs/distributed.md): a
DistributedDataParallel, an FSDP2 model (uneven and empty shards), tensor parallel (Colwise then
Rowwise; Colwise with a replicated output) on 2 ranks and FSDP2 x TP on 4, against plain torch over
the global batch in one process (counts exact, floats 1e-5 relative).

Two torchrun runs (tests/distributed_api_worker.py): 2 ranks (five cases) and 4 ranks (one).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import distributed_api_worker as worker  # noqa: E402
from torchrun_launch import NEEDS_GLOO, close, launch  # noqa: E402

pytestmark = NEEDS_GLOO
#: case -> how many parts the global batch is split into (data-parallel ranks, or TP groups; 1: every
#: rank the whole batch), and the placement of each layer's output under tensor parallelism
PARTS = {"ddp": 2, "fsdp": 2, "tp": 1, "tp_replicate": 1, "fsdp_tp": 2}
PLACEMENT = {"ddp": None, "fsdp": None,
             "tp": {"0": "sharded", "1": "sharded", "2": "replicated", "3": "replicated", "4": "replicated"},
             "tp_replicate": dict.fromkeys("01234", "replicated"),
             "fsdp_tp": {"0": "sharded", "1": "sharded", "2": "replicated", "3": "replicated", "4": "replicated"}}


def run_mode(mode: str, out: Path) -> dict[str, Any]:
    """Run the worker's ``mode`` on its ranks: case -> each rank's result (reports, or a refusal), and
    ``docs``: what the docs' example wrote (mode ``two``)."""
    world = 4 if mode == "four" else 2
    done = launch([str(Path(worker.__file__)), mode, str(out)], world)
    assert done.returncode == 0, done.stderr[-4000:]
    results: dict[str, Any] = {case: [json.loads((out / case / f"rank{r}.json").read_text()) for r in range(world)]
                               for case in worker.CASES[mode]}
    if mode == "two":
        results["docs"] = json.loads((out / "docs.json").read_text())
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every case's per-rank results (and the docs' example's): one 2-rank and one 4-rank torchrun."""
    out: dict[str, Any] = {}
    for mode in worker.CASES:
        out.update(run_mode(mode, tmp_path_factory.mktemp(mode)))
    return out


def described(t: torch.Tensor) -> dict[str, float]:
    """What a report says of a tensor (mean, std, min, max, norm), computed by torch in float64."""
    t = t.detach().double()
    return {"mean": t.mean().item(), "std": t.std(correction=0).item(), "min": t.min().item(),
            "max": t.max().item(), "norm": torch.linalg.vector_norm(t).item()}


def count_of(row: dict[str, float]) -> int:
    """The number of values behind a row's statistics: its norm is sqrt(count) * hypot(std, mean)."""
    return round((row["norm"] / math.hypot(row["std"], row["mean"])) ** 2)


def reference(case: str, rows: int) -> dict[str, Any]:
    """The case's model (the worker's weights: seed 0) over the whole global batch in one process
    (``expected``)."""
    return expected(worker.model(worker.CASES["four" if case == "fsdp_tp" else "two"][case]), worker.batch(), rows)


def expected(net: nn.Sequential, x: torch.Tensor, rows: int) -> dict[str, Any]:
    """``net`` on the global batch ``x`` in plain torch: each layer's output; the loss of each
    ``rows``-row chunk (one rank's or one TP group's part, or one ``data`` batch: each the mean of its
    outputs); each layer's output gradient, that of the sum of the chunk losses (each chunk's backward
    starts from its own); each parameter's gradient, that of their mean (what DDP and FSDP2 average
    to), and its norm; their mean loss."""
    outputs, h = [], x
    for module in net:
        h = module(h)
        outputs.append(h)
    losses = [h[start:start + rows].mean() for start in range(0, len(x), rows)]
    out_grads = torch.autograd.grad(sum(losses), outputs, retain_graph=True)
    params = dict(net.named_parameters())
    param_grads = torch.autograd.grad(sum(losses) / len(losses), list(params.values()))
    return {"outputs": outputs, "out_grads": out_grads, "loss": (sum(losses) / len(losses)).item(),
            "params": {name: (torch.linalg.vector_norm(p.detach().double()).item(), g)
                       for (name, p), g in zip(params.items(), param_grads)}}


def assert_stats(report: dict[str, Any], outputs: list[torch.Tensor], where: str) -> None:
    """A ``stats`` report's rows are plain torch's statistics of ``outputs`` (layers ``0``, ``1``, ...):
    floats ``REL``, counts exact (of values, zeros, NaN/Inf)."""
    assert [layer["name"] for layer in report["layers"]] == [str(i) for i in range(len(outputs))]
    for layer, out in zip(report["layers"], outputs):
        stats = layer["stats"]
        want = described(out)
        for key, value in want.items():
            assert close(stats[key], value, want["std"] if key == "mean" else 0.0), (where, layer["name"], key)
        assert count_of(stats) == out.numel(), (where, layer["name"])
        assert round(stats["zero_fraction"] * out.numel()) == int((out == 0).sum())
        assert stats["nan_count"] == stats["inf_count"] == 0


def assert_grads(report: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """A ``grads`` report's loss, layer rows and parameter rows are plain torch's (``expected``)."""
    assert close(report["loss"]["value"], want["loss"])
    assert [layer["name"] for layer in report["layers"]] == [str(i) for i in range(len(want["out_grads"]))]
    for layer, g in zip(report["layers"], want["out_grads"]):
        want_grad = described(g)
        for key, value in want_grad.items():
            assert close(layer["grad"][key], value, want_grad["std"] if key == "mean" else 0.0), (where, layer["name"], key)
        assert count_of(layer["grad"]) == g.numel(), (where, layer["name"])
    assert [p["name"] for p in report["params"]] == list(want["params"])
    for p in report["params"]:
        norm, g = want["params"][p["name"]]
        assert close(p["norm"], norm), (where, p["name"])
        want_grad = described(g)
        for key, value in want_grad.items():
            assert close(p["grad"][key], value, want_grad["std"] if key == "mean" else 0.0), (where, p["name"], key)
        assert count_of(p["grad"]) == g.numel(), (where, p["name"])


CASES = list(PARTS)


@pytest.mark.parametrize("case", CASES)
def test_stats_equal_plain_torch_over_the_global_batch(case: str, results: dict[str, list[Any]]) -> None:
    """``hookcli.stats`` on each rank's part (as one input, and as ``data`` in batches of 2): every
    rank's report holds plain torch's statistics of each layer's output over the whole global batch,
    under the model's own layer names (a DDP unwrapped); counts exact (a TP copy counted once, its
    parts summed); the placement of each TP output said."""
    ranks = results[case]
    assert all(rank == ranks[0] for rank in ranks)
    outputs = reference(case, worker.GLOBAL_BATCH // PARTS[case])["outputs"]
    for report in ranks[0][:2]:  # one input, then data in batches of 2
        assert_stats(report, outputs, case)
        [note] = [note for note in report["notes"] if f"all {len(ranks)} ranks" in note]
        assert ("tensor parallel in groups of 2" in note) == (PLACEMENT[case] is not None), note
        for layer in report["layers"]:
            assert layer.get("placement") == (PLACEMENT[case] or {}).get(layer["name"]), (case, layer["name"])


@pytest.mark.parametrize("case", CASES)
def test_grads_equal_plain_torch_over_the_global_batch(case: str, results: dict[str, list[Any]]) -> None:
    """``hookcli.grads`` (loss: the output's mean) on each rank's part, as one input and as ``data`` in
    batches of 2: every rank's report holds plain torch's gradients over the global batch: each
    layer's output gradient that of the sum of the batch losses (DDP, FSDP2: each rank's; TP: each TP
    group's), each parameter's gradient that of their mean (merged from the local shards under FSDP2
    and TP) and its norm, the loss their mean."""
    ranks = results[case]
    assert all(rank == ranks[0] for rank in ranks)
    for report, rows in zip(ranks[0][2:4], (worker.GLOBAL_BATCH // PARTS[case], 2)):
        assert_grads(report, reference(case, rows), f"{case}, {rows} rows")
        for layer in report["layers"]:
            assert layer.get("placement") == (PLACEMENT[case] or {}).get(layer["name"])
        if rows == 2:  # who had batches of their own: the ranks, or the TP groups (each the same batch)
            owners = {"tp": "the one TP group", "tp_replicate": "the one TP group",
                      "fsdp_tp": "each of the 2 TP groups"}.get(case, "each of the 2 ranks")
            assert any(f"over the {4 // PARTS[case]} batches of {owners};" in note for note in report["notes"])


def test_the_docs_example_writes_plain_torchs_numbers(results: dict[str, Any]) -> None:
    """docs/distributed.md's ``report`` example, run as the page shows it on 2 ranks (FSDP2, each rank
    4 rows of its own): the ``stats`` and ``grads`` reports it writes are plain torch's over the 8 rows."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 1))
        parts = []
        for rank in range(2):
            torch.manual_seed(1 + rank)
            parts.append(torch.randn(4, 3))
    x = torch.cat(parts)
    want = expected(net, x, 4)
    assert_stats(results["docs"]["stats"], want["outputs"], "docs")
    assert_grads(results["docs"]["grads"], want, "docs")


def test_fsdp2_gradients_leave_the_users_grad_as_it_was(results: dict[str, list[Any]]) -> None:
    """FSDP2's gradients come from its own backward (into ``.grad``): the gradients the user had
    accumulated before are there, unchanged, after ``stats`` and ``grads`` (the worker compares)."""
    for case in ("fsdp", "fsdp_tp"):
        assert all(rank[-1] == {"grads_kept": True} for rank in results[case]), case


def test_what_hookcli_does_not_reduce_is_refused_on_every_rank(results: dict[str, list[Any]]) -> None:
    """A DTensor parameter on a 2-D mesh without FSDP2 (two TP dimensions), in ``stats`` and ``grads``
    (as ``hookcli.watch`` refuses it), ``clip`` on an FSDP2 model (its clipping hooks would never
    fire), and ``check`` of a TP or FSDP2 model: UnsupportedError, exit code 2, on every rank, before
    anything runs."""
    ranks = results["refused"]
    assert ranks[0] == ranks[1]
    [mesh_stats, mesh_grads, clip, check_tp, check_fsdp] = ranks[0]
    for error, code, message in (mesh_stats, mesh_grads):
        assert (error, code) == ("UnsupportedError", 2)
        assert "parameter 0.weight" in message and "2-D mesh" in message
    assert clip[:2] == ["UnsupportedError", 2] and "--clip" in clip[2]
    # check on a sharded model (before: an internal error from DTensor, its per-channel dead units of
    # other channels on each TP rank merged as if the same): refused on every rank
    for error, code, message in (check_tp, check_fsdp):
        assert (error, code) == ("UnsupportedError", 2)
        assert message.startswith("check is not supported on a model sharded over the ranks"), message
