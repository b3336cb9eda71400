"""A watched step's rows from its host values: the one builder of ``WatchLayer`` and ``WatchParam``.

A logged step (``engine.watch``), a flight recorder's steps (``engine.flight``) and a step merged over
the ranks under torchrun (``engine.distributed``) each bring their host rows here: each output's
merged statistics and gradient rows (``merged_outputs``' groups, in their order), its per-channel
nonzero counts, and each parameter's gradient row, norm and update norm. The statistics dicts are
``watch_stats``' (the ``WATCH`` table), as one-shot rows are ``activation_stats``' and
``gradient_stats``' (engine.session).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hookcli.engine.stats import dtype_name, watch_stats
from hookcli.records import WatchLayer, WatchParam

#: A row's host values (None: the output or parameter had none in the step).
Row = Sequence[float] | None
#: (module name, output path) -> (values per channel, each channel's nonzero count)
ChannelRows = Mapping[tuple[str, str], tuple[float, Sequence[float]]]


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
