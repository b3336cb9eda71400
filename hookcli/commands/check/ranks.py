"""``hookcli check`` under ``torchrun`` (docs/distributed.md): the measurements each rank makes on its
own, merged so that every rank evaluates the rules on the same data and returns the same report.

The checked run's layer rows, parameter gradients and loss are merged by the engine
(``grads.backward_report``: ``rank_stats.global_rows``, ``mean_over_ranks``). What the check measures
beyond them is plain data, merged here with one ``all_gather_object`` each (``distributed.gathered``)
at points every rank reaches (each rank's extra runs and copies make no collective of their own, so a
model raising there on one rank leaves none waiting): dead channels over every rank's batch, the
output's NaN/Inf count summed, the parameter norms, ``params_change`` over the ranks' copies, the probe
rules' worst rank, and the ``replica_desync`` comparison (``rank_stats.replica_desync``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hookcli.commands.check.rules import Observations
from hookcli.commands.check.schema import CheckRules
from hookcli.engine import distributed, rank_stats
from hookcli.records import Report


def active() -> bool:
    """Whether the check runs under a process group of two or more ranks (its rules then merge them)."""
    return distributed.process_group() is not None


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is on any (one collective): the ranks take the same branch.
    ``flag`` itself without a process group."""
    return any(distributed.gathered(bool(flag)))


def merge_probe(obs: Observations, masks: dict[Any, torch.Tensor]) -> None:
    """``obs.channels`` and ``obs.outputs`` over every rank's batch: a channel is dead when it is zero on
    every rank that ran the layer (``masks``: this rank's per-channel dead masks), its values per channel
    are summed; the outputs are rank 0's (paths, shapes of its micro-batch, dtypes) with every rank's
    NaN/Inf count added."""
    mine = {key: (masks[key], per, dim) for key, (_, _, per, dim) in obs.channels.items() if key in masks}
    every = distributed.gathered((mine, obs.outputs))
    channels: dict[Any, tuple[int, int, int, int]] = {}
    dead: dict[Any, torch.Tensor] = {}
    for rank_channels, _ in every:
        for key, (mask, per, dim) in rank_channels.items():
            if key not in channels:
                dead[key], channels[key] = mask.clone(), (0, int(mask.numel()), per, dim)
            elif mask.numel() == dead[key].numel():
                dead[key] &= mask
                channels[key] = (0, channels[key][1], channels[key][2] + per, dim)
    obs.channels = {key: (int(dead[key].sum()), n, per, dim) for key, (_, n, per, dim) in channels.items()}
    outputs = [dict(out) for out in every[0][1]]
    for _, rank_outputs in every[1:]:
        for out, theirs in zip(outputs, rank_outputs):
            if out["path"] == theirs["path"]:
                out["nonfinite"] += theirs["nonfinite"]
    obs.outputs = outputs


def merge_norms(report: Report) -> None:
    """The report's parameter norms the same on every rank: rank 0's copy's (as the watch logs it),
    or the first non-finite one of any rank (so ``finite`` sees a NaN in any copy; ``replica_desync``
    names copies that differ)."""
    every = distributed.gathered([p.norm for p in report.params or []])
    for index, p in enumerate(report.params or []):
        norms = [rank_norms[index] for rank_norms in every if index < len(rank_norms)]
        bad = [n for n in norms if n is not None and not math.isfinite(n)]
        p.norm = bad[0] if bad else norms[0]


def merge_changes(obs: Observations) -> None:
    """``params_change`` over the ranks' copies (each stepped on its own batch, with no collective): a
    parameter changed when it changed on any rank (DDP's mean gradient moves it then), its largest
    gradient the largest of any rank's; a copy that failed on any rank fails the rule, naming the rank."""
    every = distributed.gathered((obs.change_error, obs.changes, obs.grad_max))
    failed = [(rank, error) for rank, (error, _, _) in enumerate(every) if error is not None]
    if failed:
        rank, error = failed[0]
        obs.change_error = f"on rank {rank}: {error}"
    grad_max: dict[str, float] = {}
    for _, _, rank_max in every:
        for name, value in rank_max.items():
            grad_max[name] = max(grad_max.get(name, 0.0), value)
    obs.grad_max = grad_max
    if any(changes is None for _, changes, _ in every):  # a failed copy (above), or no parameter in scope
        obs.changes = None
        return
    merged: dict[str, float | None] = {}
    for name in every[0][1]:
        values = [changes.get(name) for _, changes, _ in every]
        given = [v for v in values if v is not None]
        merged[name] = None if not given else math.nan if any(math.isnan(v) for v in given) else max(given)
    obs.changes = merged


def _worst(rule: str, found: list[dict[str, Any]]) -> dict[str, Any]:
    """The probe's data of the rank that fares worst (its value furthest past the rule's limit)."""
    if rule == "batch_independence":
        return max(found, key=lambda data: data["ratio"])
    return max(found, key=lambda data: data["diff"] / data["norm"] if data["norm"] > 0 else
               (0.0 if data["diff"] == 0 else math.inf))


def merge_probes(rules: CheckRules, obs: Observations) -> None:
    """The probe rules over the ranks (each rank probes its own batch, with no collective): SKIP when
    any rank skipped (naming it); ``input_dependence`` on the ranks' mean losses (the global loss and
    its value with the input zeroed); ``batch_independence`` and ``grad_accumulation`` as the worst rank
    measured them."""
    if not any(rules.get(name) is not None for name in ("batch_independence", "input_dependence",
                                                        "grad_accumulation")):
        return
    every = distributed.gathered(obs.probes)
    merged: dict[str, dict[str, Any]] = {}
    for name in every[0]:
        found = [probes.get(name, {"skip": "not measured"}) for probes in every]
        skipped = [(rank, data["skip"]) for rank, data in enumerate(found) if "skip" in data]
        if skipped:
            rank, why = skipped[0]
            merged[name] = {"skip": f"on rank {rank}: {why}"}
        elif name == "input_dependence":
            data = {key: math.fsum(d[key] for d in found) / len(found) for key in ("loss", "zeroed")}
            if all("lifted" in d for d in found):
                data["lifted"] = {key: math.fsum(d["lifted"][key] for d in found) / len(found)
                                  for key in ("loss", "zeroed")}
                data["lifted"]["scales"] = found[0]["lifted"]["scales"]
            merged[name] = data
        else:
            merged[name] = _worst(name, found)
    obs.probes = merged


def replicas(params: list[tuple[str, torch.Tensor]], rules: CheckRules) -> dict[str, Any] | None:
    """What ``replica_desync`` judges: every parameter's copies compared across the ranks
    (``rank_stats.replica_desync`` at the rule's ``rtol``), or None when the rule is off."""
    rule = rules.get("replica_desync")
    if rule is None:
        return None
    compared, desync = rank_stats.replica_desync(params, rule["rtol"])
    return {"world": distributed.world_size(), "compared": compared, "desync": desync}
