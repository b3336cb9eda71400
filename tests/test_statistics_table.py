"""The table of named statistics (hookcli.records.statistics): a statistic declared there reaches the
stats dicts, the table's columns and CSV, and ``report --stat``'s names; against float64 torch."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from hookcli.engine.stats import Reducer, activation_stats, to_host, watch_stats
from hookcli.records import statistics


@pytest.fixture
def mean_square() -> Iterator[statistics.Statistic]:
    """A statistic from the accumulators every backend has: mean(x^2) = std^2 + mean^2."""
    stat = statistics.Statistic("mean_square", lambda s: s.std ** 2 + s.mean ** 2 if s.numel else s.missing,
                                "Mean x^2", frozenset({statistics.ACTIVATION, statistics.WATCH}))
    statistics.register(stat, after="norm")
    yield stat
    statistics.unregister(stat.name)


def test_a_declared_statistic_is_in_the_dicts_and_equals_float64_torch(mean_square: statistics.Statistic) -> None:
    t = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    want = float((t.double() ** 2).mean())
    row = to_host([Reducer().reduce(t)])[0]
    got = activation_stats(row)
    assert list(got) == ["mean", "std", "min", "max", "norm", "mean_square", "zero_fraction", "nan_count",
                         "inf_count", "kurtosis"]
    # 1e-7: under HOOKCLI_REDUCTION=device the moments are float32 data's, scaled, summed in float64
    assert math.isclose(got["mean_square"], want, rel_tol=1e-7)
    assert math.isclose(watch_stats(row)["mean_square"], want, rel_tol=1e-7)


def test_a_declared_statistic_is_a_column_and_a_report_stat(mean_square: statistics.Statistic) -> None:
    from hookcli.commands.report import stat_names
    from hookcli.records import LayerRecord, ModelInfo, Report
    from hookcli.render.columns import layer_columns

    report = Report("stats", ModelInfo("m", "python", "M"),
                    layers=[LayerRecord("fc", 0, "Linear", stats={"mean_square": 2.5})])
    columns = {c.key: c for c in layer_columns(report)}
    assert columns["stat_mean_square"].header == "Mean x^2"
    assert columns["stat_mean_square"].display(report.layers[0]).text == "2.5"
    assert "mean_square" in stat_names() and "grad.mean_square" in stat_names()


def test_removed_statistic_is_gone() -> None:
    stat = statistics.Statistic("gone", lambda s: 1.0, "Gone", frozenset({statistics.ACTIVATION}))
    statistics.register(stat)
    statistics.unregister("gone")
    assert "gone" not in activation_stats(to_host([Reducer().reduce(torch.ones(3))])[0])
    with pytest.raises(ValueError, match="declared already"):
        statistics.register(statistics.statistic("mean"))
