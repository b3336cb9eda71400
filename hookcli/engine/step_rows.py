"""A watched step's records: its calls merged per output, then its rows from their host values.

``merged_outputs`` and ``merged_channels`` merge the step's calls (a ``HookSession``'s) per (module,
output path) on the device (``stats.merged``, as a run's batches are merged). From the
host values of what they give, ``watch_layers`` and ``watch_param`` are the one builder of
``WatchLayer`` and ``WatchParam``: a logged step (``engine.watch``), a flight recorder's steps
(``engine.flight``) and a step merged over the ranks under torchrun (``engine.rank_stats``) each bring
their host rows here. The statistics dicts are ``watch_stats``' (the ``WATCH`` table), as one-shot rows
are ``activation_stats``' and ``gradient_stats``' (engine.session).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from hookcli.engine.stats import dtype_name, merged, watch_stats
from hookcli.records import WatchLayer, WatchParam

#: (name, output path) -> [type, shape, dtype, calls, merged stats vector, merged gradient vector]
Groups = dict[tuple[str, str], list[Any]]

#: A row's host values (None: the output or parameter had none in the step).
Row = Sequence[float] | None
#: (module name, output path) -> (values per channel, each channel's nonzero count)
ChannelRows = Mapping[tuple[str, str], tuple[float, Sequence[float]]]


def merged_outputs(calls: Sequence[Any]) -> Groups:
    """The step's calls grouped by (module, output path), their statistics and gradients merged
    (``stats.merged``: exact counts and extremes, Pebay's moments): micro-batches and reuses of a module are
    one entry, as a training log wants. Calls that raised or never returned are left out."""
    groups: Groups = {}
    for call in calls:
        if call.raised or not call.finished:
            continue
        for out in call.outputs:
            group = groups.get((call.name, out.path))
            if group is None:
                groups[(call.name, out.path)] = [call.type, out.shape, out.dtype, 1, out.stats, out.grad]
                continue
            group[3] += 1
            group[4] = merged(group[4], out.stats)
            group[5] = merged(group[5], out.grad)
    return groups


def merged_channels(calls: Sequence[Any]) -> dict[tuple[str, str], tuple[torch.Tensor, int]]:
    """The step's per-channel nonzero counts by (module, output path), summed over its calls, and how
    many values each channel held in all: an output whose channel count differs between calls (or that
    some call did not count) is left out, as is a call that raised or never returned."""
    out: dict[tuple[str, str], tuple[torch.Tensor, int] | None] = {}
    for call in calls:
        if call.raised or not call.finished:
            continue
        for t in call.outputs:
            key, nonzeros = (call.name, t.path), t.nonzeros
            if key in out and out[key] is None:
                continue
            if nonzeros is None:
                out[key] = None
                continue
            per = math.prod(t.shape) // nonzeros.numel()
            had = out.get(key)
            out[key] = (nonzeros, per) if had is None else \
                (had[0] + nonzeros, had[1] + per) if had[0].shape == nonzeros.shape else None
    return {key: value for key, value in out.items() if value is not None}


def stats_of(row: Row) -> dict[str, Any] | None:
    """A host row as the watch logs it (``watch_stats``), None for None."""
    return watch_stats(row) if row is not None else None


def watch_layers(meta: Iterable[tuple[tuple[str, str], Sequence[Any]]], rows: Iterable[tuple[Row, Row]],
                 channels: ChannelRows | None = None,
                 placement: Mapping[tuple[str, str], str] | None = None) -> list[WatchLayer]:
    """One ``WatchLayer`` per output: ``meta`` is ((name, path), (type, shape, dtype, calls, ...)) in the
    step's order, ``rows`` the (statistics, gradient) host rows in the same order; ``channels`` the
    outputs' per-channel counts (each channel's zero fraction, and how many channels were all zeros);
    ``placement`` each output's tensor-parallel placement (None: no tensor parallelism)."""
    layers = []
    for ((name, path), (typ, shape, dtype, calls, *_)), (stats, grad) in zip(meta, rows):
        layer = WatchLayer(name, typ, path, calls, shape, dtype, stats_of(stats), stats_of(grad),
                           placement.get((name, path)) if placement is not None else None)
        if channels is not None and (counts := channels.get((name, path))) is not None:
            per, nonzeros = counts
            layer.channels, layer.channel_zero_fraction = len(nonzeros), [1.0 - n / per for n in nonzeros]
            layer.dead_channels = sum(n == 0 for n in nonzeros)
        layers.append(layer)
    return layers


def watch_param(p: Any, norm: float, grad: Row, update: float | None) -> WatchParam:
    """A watched parameter's row: ``p`` a ``ParamVectors`` (its name and parameter), its norm, its
    gradient's host row and its update's norm (None: not measured), the update ratio from them."""
    return WatchParam(p.name, list(p.param.shape), norm, stats_of(grad), update,
                      update / norm if update is not None and norm else None, dtype_name(p.param.dtype))
