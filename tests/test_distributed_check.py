"""hookcli.check under torchrun (docs/distributed.md): 2 ranks on CPU with gloo, each on its half of a
global batch; every rank's report is the same, its numbers those of plain torch over the global batch;
the ``replica_desync`` rule names a parameter whose copies differ, and the rank.

One torchrun run (tests/distributed_check_worker.py) for every case.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hookcli
from hookcli.commands.check.schema import DEFAULTS, parse_checks
from hookcli.engine import distributed
from hookcli.engine import rank_stats
from hookcli.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
import distributed_check_worker as worker  # noqa: E402
from torchrun_launch import NEEDS_GLOO, close, rank_results  # noqa: E402

pytestmark = NEEDS_GLOO
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's cases (the worker's ``rank<r>.json``): one torchrun of 2 ranks."""
    out = tmp_path_factory.mktemp("check")
    return rank_results(str(Path(worker.__file__)), out, WORLD)


def rule(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in result["rules"] if r["rule"] == name)


def timeless(value: Any) -> Any:
    """A result's dict without its timings (each rank measures its own)."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [timeless(v) for v in value]
    return value


def test_a_healthy_model_passes_on_every_rank_with_the_numbers_of_the_global_batch(
        ranks: list[dict[str, Any]]) -> None:
    """Every rank gets the same passing result, with the note that it is over the ranks; the numbers the
    rules read are plain torch's over the global batch: the ReLU's zero fraction (max_zero_fraction),
    every parameter's gradient norm (grad_norm: the gradient of the ranks' mean loss, what DDP applies),
    the loss, and input_dependence's relative change of the global loss with the input zeroed."""
    results = [rank["healthy"]["result"] for rank in ranks]
    assert timeless(results[0]) == timeless(results[1])
    result = results[0]
    assert result["ok"], result["rules"]
    assert any("over all 2 ranks" in note for note in result["report"]["notes"])
    net = worker.model()
    x = worker.batch()
    relu = net[1](net[0](x))
    per = worker.GLOBAL_BATCH // WORLD
    out = net(x)
    loss = sum(out[r * per:(r + 1) * per].mean() for r in range(WORLD)) / WORLD
    zero = rule(result, "max_zero_fraction")
    assert zero["offender"] == "1" and close(zero["value"], (relu == 0).double().mean().item())
    assert close(result["report"]["loss"]["value"], loss.item())
    grads = torch.autograd.grad(loss, list(net.parameters()))
    norms = {name: torch.linalg.vector_norm(g.double()).item() for (name, _), g in zip(net.named_parameters(), grads)}
    reported = {p["name"]: p["grad"]["norm"] for p in result["report"]["params"]}
    assert set(reported) == set(norms)
    for name, norm in norms.items():
        assert close(reported[name], norm), name
    norm_rule = rule(result, "grad_norm")
    assert norm_rule["status"] == "PASS" and close(norm_rule["value"], norms[norm_rule["offender"]])
    with torch.no_grad():
        zeroed = net(torch.zeros_like(x)).mean().item()
    change = abs(loss.item() - zeroed) / max(abs(loss.item()), abs(zeroed))
    assert close(rule(result, "input_dependence")["value"], change)
    assert [rule(result, name)["status"] for name in ("batch_independence", "grad_accumulation", "replica_desync",
                                                      "params_change")] == ["PASS"] * 4


def test_dead_channels_are_those_zero_on_every_ranks_batch(ranks: list[dict[str, Any]]) -> None:
    """A channel zero on rank 0's half only is alive over the global batch: the count is plain torch's
    over the global batch (2 of 8), not over rank 0's half (more), on both ranks."""
    results = [rank["channels"]["result"] for rank in ranks]
    assert timeless(results[0]) == timeless(results[1])
    net = worker.channel_model()
    x = worker.batch(signed=True)
    with torch.no_grad():
        relu = net[1](net[0](x))
    dead = int(((relu == 0).all(dim=0)).sum())
    rank0_dead = int(((relu[:worker.GLOBAL_BATCH // WORLD] == 0).all(dim=0)).sum())
    assert dead == 2 and rank0_dead > dead  # the case tells the two apart
    channels = rule(results[0], "dead_channels")
    assert channels["offender"] == "1" and close(channels["value"], dead / 8)
    assert f"{dead} of 8 channels" in channels["message"]


def test_the_second_look_runs_alike_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """A zero-initialised last weight: gradients below min at first, the second look at a stepped copy
    (its collectives on every rank) explains them; both ranks the same passing result."""
    results = [rank["zero_init"]["result"] for rank in ranks]
    assert timeless(results[0]) == timeless(results[1])
    assert results[0]["ok"], results[0]["rules"]


def test_a_nudged_replica_fails_replica_desync_naming_the_layer_and_rank_1(ranks: list[dict[str, Any]]) -> None:
    """Rank 1's copy of 2.weight nudged by 1e-3 relative, and 0.bias's .grad set differently on each
    rank: replica_desync FAILs on both ranks with the same findings, naming each parameter, its layer
    and rank 1; the model each rank passed is unchanged."""
    results = [rank["desync"]["result"] for rank in ranks]
    assert timeless(results[0]) == timeless(results[1])  # the parameter norms too: rank 0's copy's
    found = [rule(result, "replica_desync") for result in results]
    assert [r["ok"] for r in results] == [False, False]
    assert found[0]["status"] == "FAIL"
    violations = {(v["where"], v["value"]) for v in found[0]["violations"]}
    assert violations == {("2.weight", 1), ("0.bias", 1)}
    messages = [v["message"] for v in found[0]["violations"]]
    assert any("value of parameter 2.weight (layer 2) on rank 1" in m for m in messages)
    assert any("gradient of parameter 0.bias (layer 0) on rank 1" in m for m in messages)
    assert ranks[0]["desync_kept"] and ranks[1]["desync_kept"]


def test_a_model_raising_on_rank_1_stops_every_rank(ranks: list[dict[str, Any]]) -> None:
    """The model raises on rank 1 alone: rank 1's check fails its runs rule with the model's error;
    rank 0, whose model ran, raises RanksFailed (exit 2) instead of waiting for rank 1's statistics."""
    raised = ranks[1]["raises"]["result"]
    assert not raised["ok"] and rule(raised, "runs")["status"] == "FAIL"
    assert "rank 1 cannot run this batch" in rule(raised, "runs")["message"]
    name, code, message = ranks[0]["raises"]["error"]
    assert (name, code) == ("RanksFailed", 2) and "1 of 2 ranks" in message


def test_a_copy_raising_on_rank_1_fails_params_change_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """The checked run passes on both ranks, params_change's copy raises on rank 1 alone: each rank
    steps its copy without a collective, so neither waits, and both fail params_change naming rank 1."""
    results = [rank["raises_in_copy"]["result"] for rank in ranks]
    assert timeless(results[0]) == timeless(results[1])
    change = rule(results[0], "params_change")
    assert change["status"] == "FAIL" and change["message"].startswith("on rank 1: ")
    assert "cannot run this batch twice" in change["message"]
    assert [r["rule"] for r in results[0]["rules"] if r["status"] == "FAIL"] == ["params_change"]


def test_check_over_data_is_over_every_ranks_batches(ranks: list[dict[str, Any]]) -> None:
    """``data`` in batches of 8 on each rank's half: the same passing result on both ranks; the ReLU's
    zero fraction that of plain torch over the global batch."""
    results = [rank["data"]["result"] for rank in ranks]
    assert timeless(results[0]) == timeless(results[1])
    assert results[0]["ok"], results[0]["rules"]
    net = worker.model()
    with torch.no_grad():
        relu = net[1](net[0](worker.batch()))
    zero = rule(results[0], "max_zero_fraction")
    assert zero["offender"] == "1" and close(zero["value"], (relu == 0).double().mean().item())


def test_the_collectives_a_check_makes(ranks: list[dict[str, Any]]) -> None:
    """What docs/distributed.md says a check costs, counted by the process group's sequence number:
    20 collectives (4 of them the ranks' votes before the run), 22 with the probe rules, 12 more for a
    second look at a stepped copy; the same on both ranks."""
    counts = [{case: rank[case]["collectives"] for case in ("channels", "healthy", "zero_init")} for rank in ranks]
    assert counts[0] == counts[1] == {"channels": 20, "healthy": 22, "zero_init": 32}


def test_check_steps_is_refused_under_torchrun(ranks: list[dict[str, Any]]) -> None:
    """``steps=N`` would train on each rank's batch alone: refused on every rank, exit 2."""
    for rank in ranks:
        name, code, message = rank["steps"]["error"]
        assert (name, code) == ("UnsupportedError", 2) and "torchrun" in message


# --------------------------------------------------------------------------- without a process group


def test_replica_desync_is_off_without_torchrun_and_skips_when_enabled() -> None:
    """Without a process group the rule is not among the results; enabled, it is SKIP saying it needs
    torchrun; its tolerance defaults to the watch's (``rank_stats.DESYNC_RTOL``)."""
    assert distributed.process_group() is None
    net = worker.model()
    result = hookcli.check(net, inputs=worker.batch()[:4], loss="mean")
    assert "replica_desync" not in [r.rule for r in result.rules]
    result = hookcli.check(net, inputs=worker.batch()[:4], loss="mean", checks={"replica_desync": True})
    skipped = result.rule("replica_desync")
    assert skipped.status == "SKIP" and "torchrun" in skipped.message and result.ok
    assert DEFAULTS["replica_desync"]["rtol"] == rank_stats.DESYNC_RTOL


@pytest.mark.parametrize(("table", "named"), [({"rtol": 0}, "'rtol'"), ({"rtol": "tight"}, "'rtol'"),
                                              ({"tol": 1e-6}, "unknown key 'tol'")])
def test_replica_desync_settings_are_validated(table: dict[str, Any], named: str) -> None:
    """A tolerance must be a finite number > 0, and the rule's table has no other key."""
    with pytest.raises(ConfigError) as info:
        parse_checks({"replica_desync": table})
    assert "replica_desync" in str(info.value) and named in str(info.value)
    assert parse_checks({"replica_desync": {"rtol": 1e-6}}).rules["replica_desync"]["rtol"] == 1e-6


def test_replicas_compare_at_the_given_tolerance() -> None:
    """``_same`` at a tolerance: a copy 1e-6 off is a desync at the default, not at 1e-5."""
    assert not rank_stats._same([1.0], [1.0 + 1e-6])
    assert rank_stats._same([1.0], [1.0 + 1e-6], 1e-5)


def test_output_shape_under_shard_ddp_is_the_whole_batchs(ranks: list[dict[str, Any]]) -> None:
    """``check --shard ddp`` (the API's ``shard="ddp"``) on a batch of 5 cut in slices of 3 and 2: the
    ``output_shape`` rule judges the shape one process over the whole batch has, [5, 3], as the report
    shows it (before: rank 0's slice, [3, 3], failed a config that passes in one process)."""
    for rank in ranks:
        result = rank["shard_ddp"]["result"]
        assert result["ok"], [(r["rule"], r["status"]) for r in result["rules"]]
        shape = rule(result, "output_shape")
        assert (shape["status"], shape["value"]) == ("PASS", [5, 3]), shape
