"""The table of named statistics: every statistic hookcli reports, declared once.

A statistic is computed on the host from a tensor's *accumulators*, the mergeable sufficient statistics
the reduction backend (``hookcli.engine.reduction``) computes and merges over calls, batches, steps and
ranks: the ``ACCUMULATORS`` (the fields of ``engine.stats.Moments``) and any extra one declared with
``register_accumulator`` (a sum over a tensor's finite values of an elementwise function: additive, so
it merges by addition everywhere, torchrun's ranks included). ``Summary`` turns one host row of them
into what statistics read (mean, std, min, max, kurtosis, norm as torch computes them on the whole
tensor); each ``Statistic`` says how its value comes from that, its table header and format, and in
which *directions* (``ACTIVATION``, ``GRADIENT``, ``PARAM_GRADIENT``, ``WATCH``) it is a key. The
stats dicts, the records' key lists, the table columns, ``report --stat``'s choices and the watch
log's keys all read this table (``keys``, ``statistics_for``, ``stats_dict``). Torch-free: renderers
read it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: Activation statistics of ``stats`` / ``check`` rows (the tables' columns, then JSON-only extras).
ACTIVATION = "activation"
#: A layer output's gradient (``grads``, ``check``).
GRADIENT = "gradient"
#: A parameter's gradient (``grads``' parameter rows, ``check``).
PARAM_GRADIENT = "param_gradient"
#: A tensor in ``hookcli.watch``'s log: activations, output gradients and parameter gradients alike.
WATCH = "watch"

#: The accumulators every backend computes, in the order of a statistics vector (``engine.stats.Moments``):
#: mean, min and max (merged as a mean and extremes), count of finite values, central moment sums m2..m4,
#: counts of zeros, NaNs and Infs.
ACCUMULATORS: tuple[str, ...] = ("mean", "min", "max", "count", "m2", "m3", "m4", "zeros", "nans", "infs")

Format = Literal["number", "count", "percent"]
Value = float | int | None


@dataclass(frozen=True)
class Accumulator:
    """An extra accumulator: ``sum(term(x))`` over a tensor's finite values, in float64. ``term`` is an
    elementwise function of a float tensor: a torch function's name (``"abs"``: this module never imports
    torch) or the function (``torch.abs``). Sums add up over calls, batches, steps and ranks, and scale
    with repeats."""

    name: str
    term: str | Callable[[Any], Any]


@dataclass(frozen=True)
class Statistic:
    """One reported statistic: ``value`` computes it from a ``Summary``; ``header`` names its table column
    (``grad_header`` in gradient tables, default the same); ``format`` says how a table shows it;
    ``directions``: where it is one of the keys, in the table's order; ``extra_in``: where it is a
    key after those, in JSON and the Python API only (no table column)."""

    name: str
    value: Callable[[Summary], Value]
    header: str
    directions: frozenset[str]
    format: Format = "number"
    grad_header: str | None = None
    extra_in: frozenset[str] = frozenset()

    def header_in(self, direction: str) -> str:
        return self.grad_header or self.header if direction in (GRADIENT, PARAM_GRADIENT) else self.header


@dataclass
class Summary:
    """One tensor's (or merged tensors') accumulators, by name, and what statistics read of them.

    The same numbers as torch on the whole tensor: a NaN makes mean, std, min, max and kurtosis NaN; an
    Inf (and no NaN) makes std and kurtosis NaN and the mean +-inf (NaN when both signs are present); no
    values give NaN. Otherwise the moments of the values: std is the population one (correction=0),
    kurtosis Pearson's, ``n * m4 / m2^2``. ``missing``: what a statistic that needs values gives where
    there are none (NaN in the watch log, None elsewhere).
    """

    acc: Mapping[str, float]
    missing: float | None = None
    mean: float = field(init=False)
    std: float = field(init=False)
    min: float = field(init=False)
    max: float = field(init=False)
    kurtosis: float = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.mean, self.std, self.min, self.max, self.kurtosis = summary(self.acc)
        self.numel = int(self.acc["count"] + self.acc["nans"] + self.acc["infs"])

    @property
    def norm(self) -> float:
        """L2 norm from population mean and std: sqrt(n * (std^2 + mean^2)), in float64 (as sqrt(n) *
        hypot(std, mean): squares of float64 data above ~1e154 would overflow, the norm itself does not)."""
        if self.acc["nans"]:
            return math.nan
        if self.acc["infs"]:
            return math.inf
        if not self.numel:
            return 0.0  # an empty sum of squares, as torch.linalg.vector_norm of an empty tensor
        return math.sqrt(self.numel) * math.hypot(self.std, self.mean)


def summary(acc: Mapping[str, float]) -> tuple[float, float, float, float, float]:
    """``(mean, std, min, max, kurtosis)`` of accumulators by name (``Summary`` says what they are)."""
    mean, lo, hi, count, m2, m4 = (acc[k] for k in ("mean", "min", "max", "count", "m2", "m4"))
    nans, infs = acc["nans"], acc["infs"]
    if nans or not (count or infs):
        return math.nan, math.nan, math.nan, math.nan, math.nan
    if infs:
        mean = math.nan if lo == -math.inf and hi == math.inf else (math.inf if hi == math.inf else -math.inf)
        return mean, math.nan, lo, hi, math.nan
    kurtosis = count * m4 / (m2 * m2) if m2 > 0.0 and m4 > 0.0 else math.nan
    return mean, math.sqrt(max(m2, 0.0) / count), lo, hi, kurtosis


def _all(*directions: str) -> frozenset[str]:
    return frozenset(directions)


_EVERYWHERE = _all(ACTIVATION, GRADIENT, PARAM_GRADIENT, WATCH)

#: The statistics, in the order of every dict and table that shows them.
_TABLE: list[Statistic] = [
    Statistic("mean", lambda s: float(s.mean), "Mean", _EVERYWHERE, grad_header="Grad mean"),
    Statistic("std", lambda s: float(s.std), "Std", _EVERYWHERE, grad_header="Grad std"),
    Statistic("rms", lambda s: s.norm / math.sqrt(s.numel) if s.numel else s.missing, "RMS", _all(WATCH)),
    Statistic("min", lambda s: float(s.min), "Min", _EVERYWHERE, grad_header="Grad min"),
    Statistic("max", lambda s: float(s.max), "Max", _EVERYWHERE, grad_header="Grad max"),
    Statistic("abs_max", lambda s: max(abs(s.min), abs(s.max)) if s.numel else s.missing, "Abs max", _all(WATCH),
              extra_in=_all(PARAM_GRADIENT)),
    Statistic("norm", lambda s: s.norm, "Norm", _all(ACTIVATION, GRADIENT, PARAM_GRADIENT), grad_header="Grad norm"),
    Statistic("zero_fraction", lambda s: s.acc["zeros"] / s.numel if s.numel else None, "Zero %",
              _all(ACTIVATION, WATCH), format="percent"),
    Statistic("nan_count", lambda s: int(s.acc["nans"]), "NaN", _EVERYWHERE, format="count"),
    Statistic("inf_count", lambda s: int(s.acc["infs"]), "Inf", _EVERYWHERE, format="count"),
    Statistic("kurtosis", lambda s: float(s.kurtosis), "Kurtosis", _all(WATCH), extra_in=_all(ACTIVATION)),
    Statistic("count", lambda s: s.numel, "Count", _all(WATCH), format="count"),
]
_EXTRA_ACCUMULATORS: list[Accumulator] = []


def statistics() -> tuple[Statistic, ...]:
    """Every statistic, in table order."""
    return tuple(_TABLE)


def statistic(name: str) -> Statistic:
    return next(s for s in _TABLE if s.name == name)


def statistics_for(direction: str, *, extra: bool = True) -> tuple[Statistic, ...]:
    """The statistics of ``direction`` in key order: its columns, then (``extra``) its JSON-only ones.
    (Read for every row of a run: kept per direction until the table changes.)"""
    key = (direction, extra)
    found = _FOR.get(key)
    if found is None:
        columns = tuple(s for s in _TABLE if direction in s.directions)
        found = _FOR[key] = columns + tuple(s for s in _TABLE if direction in s.extra_in) if extra else columns
    return found


#: ``statistics_for``'s answers since the table last changed.
_FOR: dict[tuple[str, bool], tuple[Statistic, ...]] = {}


def keys(direction: str, *, extra: bool = True) -> tuple[str, ...]:
    """The keys of ``direction``'s statistics dict (``statistics_for``), in order."""
    return tuple(s.name for s in statistics_for(direction, extra=extra))


def extra_accumulators() -> tuple[Accumulator, ...]:
    """The declared accumulators beyond ``ACCUMULATORS``, in the order a host row carries them after those."""
    return tuple(_EXTRA_ACCUMULATORS)


def stats_dict(row: Sequence[float], direction: str, *, missing: float | None = None) -> dict[str, Value]:
    """A host row of accumulators (``ACCUMULATORS``, then ``extra_accumulators()``) as ``direction``'s
    statistics dict."""
    names = ACCUMULATORS + tuple(a.name for a in _EXTRA_ACCUMULATORS)
    s = Summary(dict(zip(names, row)), missing)
    return {stat.name: stat.value(s) for stat in statistics_for(direction)}


def register_accumulator(accumulator: Accumulator) -> None:
    """Declare an extra accumulator (every backend computes it from then on; before a run starts)."""
    if accumulator.name in ACCUMULATORS or any(a.name == accumulator.name for a in _EXTRA_ACCUMULATORS):
        raise ValueError(f"accumulator {accumulator.name!r} is declared already")
    _EXTRA_ACCUMULATORS.append(accumulator)
    _FOR.clear()


def register(stat: Statistic, *, after: str | None = None) -> None:
    """Add a statistic to the table (at its end, or right after the one named ``after``)."""
    if any(s.name == stat.name for s in _TABLE):
        raise ValueError(f"statistic {stat.name!r} is declared already")
    at = len(_TABLE) if after is None else [s.name for s in _TABLE].index(after) + 1
    _TABLE.insert(at, stat)
    _FOR.clear()


def unregister(name: str) -> None:
    """Remove a statistic or an extra accumulator added by ``register`` / ``register_accumulator``."""
    _TABLE[:] = [s for s in _TABLE if s.name != name]
    _EXTRA_ACCUMULATORS[:] = [a for a in _EXTRA_ACCUMULATORS if a.name != name]
    _FOR.clear()
