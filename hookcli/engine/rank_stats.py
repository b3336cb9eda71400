"""Exact global statistics of a watched step under ``torchrun`` (docs/distributed.md).

Every rank reduces what it holds (its micro-batch's activations and activation gradients, its shards
of FSDP2/DTensor parameters and their gradients) to host ``Moments`` as usual; ``StepReduction`` then
merges the ranks' rows into the global ones with three ``all_reduce`` calls over packed float64
buffers, however many layers there are:

1. SUM: presence, counts, ``count * mean``, zero/NaN/Inf counts, squared shard norms, losses, rank
   0's copy of every replicated row (the other ranks add zeros), the outputs' per-channel nonzero
   counts, the histograms' bucket counts (``global_histograms``: their min and max come from one more
   collective at the optimizer's pre-step) and the values of ``Partial`` gradients (``partial_grads``);
2. SUM: the central moment sums ``m2..m4`` about the *global* mean (Chan/Pebay: each rank shifts its
   own central sums by ``d = mean_r - mean`` with the binomial formula), so no power sums about 0 and
   no digits lost to an offset;
3. MAX: maxima, negated minima (MIN as MAX of ``-x``, exact), the call counts, the lowest rank that
   saw a NaN/Inf (as ``-rank``) and, per replicated row, the highest rank whose copy differs from
   rank 0's (a replica desync).

A rank that did not run a module contributes the identity (``EMPTY``, no presence). The parameter
slots are fixed at attach; the layer slots ``(module, output path)`` are learned and then kept: when a
rank meets one that no rank had before (at the first logged step, and when a module runs for the first
time), the ranks exchange their keys once (``all_gather_object``) and the step's reduction runs again
over the larger layout, the same on every rank.

Parameters are *replicated* (a plain or DDP parameter: the ranks hold equal copies, counted once and
compared) or *sharded* (a DTensor sharded over a 1-D mesh of the whole world, as FSDP2 makes them:
the local shard is reduced, never gathered).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hookcli.engine import reduction as engine_reduction
from hookcli.engine.stats import (EMPTY, HISTOGRAM_BINS, Moments, Vector, as_moments, extras,
                                  histogram, reduce_tensor, to_host)
from hookcli.engine.distributed import PartialGrad, is_sharded, local, owns, process_group
from hookcli.engine.step_rows import Groups, watch_layers, watch_param
from hookcli.errors import RanksFailed, UnsupportedError
from hookcli.records import Finding, Histogram, WatchStep, statistics


#: Slot kinds: rows each rank holds part of (merged), rows every rank holds a copy of (rank 0's is
#: reported, the others are compared with it), norms of shards (root of the summed squares), and
#: per-rank numbers reported as their mean over the ranks (the loss).
MERGED, REPLICATED, SHARDED_NORM, RANK_MEAN = "merged", "replicated", "sharded_norm", "rank_mean"


#: ... and values whose sum over the ranks is the tensor (a ``Partial`` gradient: ``partial_grads``):
#: the row is ``[adds, *values]``, its statistics are taken from the summed values
SUMMED = "summed"


#: Replicas whose rows differ by more than this (relative) are a desync; equal copies reduce equally.
DESYNC_RTOL = 1e-9


@dataclass(frozen=True)
class Slots:
    """Where a step's rows sit in a reduction (``StepResult.rows``), by name: each layer's ``LAYER`` rows,
    then each parameter's ``PARAM`` rows, then the loss. Every rank packs them in this order."""

    layers: int
    LAYER = ("stats", "grad")
    PARAM = ("grad", "norm", "update")

    @classmethod
    def of_layer(cls, index: int, what: str) -> int:
        return len(cls.LAYER) * index + cls.LAYER.index(what)

    @classmethod
    def in_params(cls, index: int, what: str) -> int:
        """A parameter's row in the parameters' own ``Plan``."""
        return len(cls.PARAM) * index + cls.PARAM.index(what)

    def of_param(self, index: int, what: str) -> int:
        return len(self.LAYER) * self.layers + self.in_params(index, what)

    def which(self, slot: int) -> tuple[str, int, str]:
        """``("layer" or "param", index, what)`` of a slot."""
        base = len(self.LAYER) * self.layers
        if slot < base:
            index, part = divmod(slot, len(self.LAYER))
            return "layer", index, self.LAYER[part]
        index, part = divmod(slot - base, len(self.PARAM))
        return "param", index, self.PARAM[part]


def additive_fields() -> tuple[str, ...]:
    """The accumulators a merged slot sums over the ranks in the first SUM, after its presence, count and
    sum: the counts, then the declared extra accumulators (``records.statistics``)."""
    return ("zeros", "nans", "infs", *(a.name for a in statistics.extra_accumulators()))


def row_width() -> int:
    """The values of a statistics row in host form: ``Moments``, then the extra accumulators."""
    return len(Moments._fields) + len(statistics.extra_accumulators())


@dataclass
class Plan:
    """The slots of one reduction: kind and local row (None: this rank holds nothing there)."""

    kinds: list[str] = field(default_factory=list)
    rows: list[Sequence[float] | None] = field(default_factory=list)

    def add(self, kind: str, row: Sequence[float] | None) -> None:
        self.kinds.append(kind)
        self.rows.append(host_row(row))


def host_row(row: Sequence[float] | None) -> Sequence[float] | None:
    """A statistics row in host ``Moments`` form: ``to_host``'s copy of an accelerator's vector carries
    ``SCALE`` (one value more, its moments in units of it), a host row does not; every rank must pack
    the same number of values for a slot whatever its device. Other rows (norms) as they are."""
    return [*as_moments(row), *extras(row)] if row is not None and len(row) == row_width() + 1 else row


@dataclass
class StepResult:
    """A step's global rows, by slot, and what the ranks said about them."""

    rows: list[list[float] | None]
    #: slot -> the lowest rank whose row there had a NaN/Inf
    nonfinite_rank: dict[int, int]
    #: slot -> a rank whose replicated row differs from rank 0's
    desync_rank: dict[int, int]
    #: layer key -> (values per channel, nonzero values per channel), summed over the ranks that added
    #: the layer's statistics (``StepReduction.reduce``'s ``channels``)
    channels: dict[tuple[str, str], tuple[float, list[float]]] = field(default_factory=dict)
    #: ``reduce``'s ``extra`` summed over the ranks
    extra: list[float] = field(default_factory=list)
    #: slot -> the summed values of a ``SUMMED`` slot
    summed: dict[int, list[float]] = field(default_factory=dict)


class StepReduction:
    """The ranks' rows of one watched step merged into global ones (three collectives: see the module).

    ``layers``: the layer keys ``(module name, output path)`` in slot order, the same on every rank.
    ``collectives`` counts the ``all_reduce``/``all_gather_object`` calls it made (tests check it against the process group's own sequence number).
    """

    def __init__(self, group: Any, tp: list[list[int]] | None = None) -> None:
        self.group = group
        self.rank = torch.distributed.get_rank(group)
        self.world = torch.distributed.get_world_size(group)
        #: the tensor-parallel groups (``tp_groups``), None without tensor parallelism
        self.tp = tp
        #: whether this rank is the first of its TP group (it alone adds a replicated output's rows)
        self.tp_first = tp is None or any(ranks[0] == self.rank for ranks in tp)
        self.layers: list[tuple[str, str]] = []
        #: layer key -> (type, shape, dtype) as the first rank that ran it saw it
        self.meta: dict[tuple[str, str], tuple[str, list[int] | None, str]] = {}
        #: layer key -> "data" (no TP: each rank its own batch, summed), "sharded" (the ranks of a TP
        #: group hold parts of the output: summed) or "replicated" (they hold copies: counted once)
        self.placement: dict[tuple[str, str], str] = {}
        #: layer key -> its channel count, whose per-channel nonzero counts ride in the first SUM; None:
        #: not counted (no channel dimension, ranks that disagree, or a TP-sharded output)
        self.channel_sizes: dict[tuple[str, str], int | None] = {}
        self.collectives = 0
        self.nonfinite_seen = False
        #: the ranks' summed ``flag`` at the last ``watch_step`` (riding in its first SUM)
        self.flagged = 0.0
        #: replicated rows that differ by more than this (relative) are a desync (``_same``)
        self.rtol = DESYNC_RTOL
        backend = torch.distributed.get_backend(group)
        self.device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

    # -- the layout ------------------------------------------------------------------------------
    def _learn(self, local_meta: dict[tuple[str, str], tuple[Any, ...]]) -> None:
        """Every rank's keys into the layout (one ``all_gather_object``): known keys keep their slots, new
        ones follow in rank order and, within a rank, in the order its modules ran. Under tensor
        parallelism each key's meta carries the rank's statistics row, and a new key's placement is
        decided from them (``_placement``), the same on every rank; its last item is the output's
        channel count (None: not counted), which a new key's ``channel_sizes`` takes when the ranks
        agree."""
        gathered: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(gathered, local_meta, group=self.group)
        self.collectives += 1
        for metas in gathered:
            for key, meta in metas.items():
                if key not in self.meta:
                    self.meta[key] = meta[:3]
                    self.layers.append(key)
                    self.placement[key] = self._placement(key, gathered)
                    sizes = {m[key][4] for m in gathered if key in m and m[key][4] is not None}
                    # a TP-sharded output's ranks hold other channels or other tokens of it: not counted
                    self.channel_sizes[key] = sizes.pop() if len(sizes) == 1 and \
                        self.placement[key] != "sharded" else None

    def _placement(self, key: tuple[str, str], gathered: list[Any]) -> str:
        """A plain-tensor output's placement, from the ranks' statistics rows of the step that first ran
        it: "replicated" when in every TP group that ran it all ranks hold equal rows (``_same``), else
        "sharded"; "data" without tensor parallelism."""
        if self.tp is None:
            return "data"
        ran = False
        for ranks in self.tp:
            rows = [gathered[r][key][3] if key in gathered[r] else None for r in ranks]
            if all(row is None for row in rows):
                continue
            ran = True
            if any(row is None for row in rows) or not all(_same(row, rows[0]) for row in rows[1:]):
                return "sharded"
        return "replicated" if ran else "sharded"

    # -- the reduction ---------------------------------------------------------------------------
    def reduce(self, layer_rows: dict[tuple[str, str], tuple[tuple[Any, ...], Sequence[float] | None,
                                                              Sequence[float] | None]],
               params: Plan, loss: float | None, *, failed: bool = False,
               channels: dict[tuple[str, str], tuple[float, Sequence[float]]] | None = None,
               extra: Sequence[float] = ()) -> tuple[list[tuple[tuple[str, str], tuple[Any, ...]]], StepResult]:
        """Global rows of a step. ``layer_rows``: key -> (meta ``(type, shape, dtype, calls)``, stats row,
        gradient row) of the layers this rank ran, in the order they ran; ``params``: the parameter
        slots in attach order; ``loss``: this rank's; ``channels``: key -> (values per channel, nonzero
        values per channel) of this rank's outputs counted per channel; ``extra``: values summed over
        the ranks in the first SUM too (the same length on every rank). Returns the layers in layout
        order, each as key and meta (with the most calls any rank made), and the result: slots ``2 i``
        and ``2 i + 1`` are layer ``i``'s statistics and gradient, then come ``params``' slots, then
        the mean loss; a layer's channel counts are summed where every rank that added its
        statistics counted them alike."""
        channels = channels or {}
        # under TP, each key's row that decides its placement (``_placement``): its statistics, else (a
        # ``grads`` run, which has none) its gradient's: copies of an output have copies of a gradient
        local_meta = {key: (*meta[:3], (stats if stats is not None else grad) if self.tp is not None else None,
                            len(channels[key][1]) if key in channels else None)
                      for key, (meta, stats, grad) in layer_rows.items()}
        new = sum(1 for key in layer_rows if key not in self.meta)
        while True:
            plan = Plan()
            counted: list[tuple[tuple[str, str], int]] = []  # the layers whose channel counts ride along
            tail: list[float] = []
            for key in self.layers:
                _, stats, grad = layer_rows.get(key, ((), None, None))
                if self.placement[key] == "replicated" and not self.tp_first:  # counted once: the TP group's first rank's
                    stats = grad = None
                plan.add(MERGED, stats)
                plan.add(MERGED, grad)
                if (size := self.channel_sizes.get(key)) is not None:
                    counted.append((key, size))
                    mine = channels.get(key) if stats is not None else None
                    alike = mine is not None and len(mine[1]) == size
                    tail += [float(stats is not None), float(alike), float(mine[0]) if alike else 0.0]
                    tail += [float(v) for v in mine[1]] if alike else [0.0] * size
            plan.kinds += params.kinds
            plan.rows += params.rows
            plan.add(RANK_MEAN, None if loss is None else [loss])
            calls = [float(layer_rows[key][0][3]) if key in layer_rows else 0.0 for key in self.layers]
            result, max_calls, more = self._reduce(plan, calls, new, failed, [*tail, *extra])
            if not more:
                break
            self._learn(local_meta)
            new = 0
        at = 0
        for key, size in counted:
            adding, alike, per = result.extra[at:at + 3]
            if adding and alike == adding and per:
                result.channels[key] = (per, result.extra[at + 3:at + 3 + size])
            at += 3 + size
        result.extra = result.extra[at:]
        layers = [(key, (*self.meta[key], int(max_calls[index]))) for index, key in enumerate(self.layers)]
        return layers, result

    def rank_mean(self, value: float) -> float:
        """The mean of the ranks' ``value`` (one collective): the first step's loss, when ``Watch.step``
        adds it after the optimizer closed the step."""
        return self._all_reduce([value], torch.distributed.ReduceOp.SUM)[0] / self.world

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (one collective, when the watch starts): every rank
        then takes part in what one rank asked for (``tensorboard_dir=`` given to rank 0 alone)."""
        return self._all_reduce([float(flag)], torch.distributed.ReduceOp.MAX)[0] > 0

    def first_rank(self, step: int | None) -> tuple[int, int] | None:
        """The earliest of the ranks' ``step`` (None: this rank has none) and the lowest rank that had it,
        None where no rank has one (one MIN collective)."""
        mine = float(step * self.world + self.rank) if step is not None else math.inf
        least = self._all_reduce([mine], torch.distributed.ReduceOp.MIN)[0]
        return None if least == math.inf else divmod(int(least), self.world)

    def _all_reduce(self, values: list[float], op: Any) -> list[float]:
        buffer = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(buffer, op=op, group=self.group)
        self.collectives += 1
        return buffer.cpu().tolist()

    def _reduce(self, plan: Plan, calls: list[float], new: int, failed: bool, tail: Sequence[float] = ()
                ) -> tuple[StepResult, list[float], bool]:
        """The three collectives over ``plan``, ``tail`` summed in the first (``StepResult.extra``);
        ``more``: a rank has keys the layout lacks (the caller learns them and reduces again)."""
        sum1 = [float(new), float(failed), *self._first_sums(plan), *tail]
        total1 = self._all_reduce(sum1, torch.distributed.ReduceOp.SUM)
        if total1[1] > 0:
            raise RanksFailed(f"the run failed on {int(total1[1])} of {self.world} ranks in this step (the model "
                              "or hookcli's hooks raised there)",
                              hint="the failed rank raised its own error: its output says what went wrong")
        if total1[0] > 0:
            return StepResult([], {}, {}), [], True
        means, sum2 = _central_sums(plan, total1)
        total2 = self._all_reduce(sum2, torch.distributed.ReduceOp.SUM) if sum2 else []
        total3 = self._all_reduce([*calls, *self._maxima(plan, total1)], torch.distributed.ReduceOp.MAX)
        max_calls, extremes = total3[:len(calls)], total3[len(calls):]
        result = _unpack(plan, total1, means, total2, extremes)
        result.extra = total1[len(total1) - len(tail):]
        return result, max_calls, False

    def _first_sums(self, plan: Plan) -> list[float]:
        """Each slot's values in the first SUM (``_width`` of them): presence and the additive
        accumulators of a merged row, a norm's square, the loss, a ``SUMMED`` row, rank 0's replicated
        row (zeros from the others)."""
        sum1: list[float] = []
        for kind, row in zip(plan.kinds, plan.rows):
            present = row is not None
            if kind == MERGED:
                m = as_moments(row) if present else EMPTY
                added = {**m._asdict(), **dict(zip(additive_fields()[3:], extras(row) if present else []))}
                sum1 += [float(present), m.count, m.count * m.mean if m.count else 0.0]
                sum1 += [added.get(name, 0.0) for name in additive_fields()]
            elif kind == SHARDED_NORM:
                value = row[0] if present else 0.0
                sum1 += [float(present), value * value]
            elif kind == RANK_MEAN:
                sum1 += [float(present), row[0] if present else 0.0]
            elif kind == SUMMED:
                sum1 += [float(v) for v in row]  # type: ignore[union-attr]
            else:  # REPLICATED: rank 0's row (its length first), zeros from the others
                mine = self.rank == 0 and present
                sum1 += [float(mine), float(len(row)) if mine else 0.0]
                sum1 += [float(v) for v in row] + [0.0] * (row_width() - len(row)) if mine else [0.0] * row_width()
        return sum1

    def _maxima(self, plan: Plan, total1: Sequence[float]) -> list[float]:
        """Each slot's values in the MAX: a merged row's extremes and the first rank with a NaN/Inf
        there (negated), a replicated row's rank when this rank's copy differs from rank 0's
        (``total1``: the first SUM's result, which carries rank 0's copy)."""
        max1: list[float] = []
        at = 2
        for kind, row in zip(plan.kinds, plan.rows):
            if kind == MERGED:
                m = as_moments(row) if row is not None else EMPTY
                nonfinite = m.nans + m.infs > 0
                max1 += [m.max, -m.min, -float(self.rank) if nonfinite else -math.inf]
            elif kind == REPLICATED:
                size = int(total1[at + 1])
                theirs = total1[at + 2: at + 2 + size]
                differs = row is not None and total1[at] > 0 and not _same(row, theirs, self.rtol)
                max1 += [float(self.rank) if differs else -1.0]
            at += _width(kind, row)
        return max1


def _central_sums(plan: Plan, total1: Sequence[float]) -> tuple[list[float], list[float]]:
    """The global mean of each merged slot (from the first SUM's result ``total1``) and this rank's
    central sums about it, the second SUM's values."""
    sum2: list[float] = []
    means: list[float] = []
    at = 2
    for kind, row in zip(plan.kinds, plan.rows):
        if kind == MERGED:
            n, s = total1[at + 1], total1[at + 2]
            mean = s / n if n else 0.0
            means.append(mean)
            sum2 += centred_about(as_moments(row) if row is not None else EMPTY, mean)
        at += _width(kind, row)
    return means, sum2


def _unpack(plan: Plan, total1: Sequence[float], means: Sequence[float], total2: Sequence[float],
            extremes: Sequence[float]) -> StepResult:
    """The global rows of ``plan``'s slots from the three collectives' results (``total1``: the first
    SUM's, ``means`` and ``total2``: the merged slots' global means and summed central sums,
    ``extremes``: the MAX's after the call counts); ``extra`` is the caller's to fill."""
    result = StepResult([], {}, {})
    at, at2, at3 = 2, 0, 0
    for slot, kind in enumerate(plan.kinds):
        if kind == MERGED:
            width = _width(kind, None)
            result.rows.append(_merged_row(total1[at:at + width], extremes[at3:at3 + 2], means[at2 // 3],
                                           total2[at2:at2 + 3]))
            if extremes[at3 + 2] != -math.inf:  # the lowest rank with a NaN/Inf there, negated
                result.nonfinite_rank[slot] = int(-extremes[at3 + 2])
            at, at2, at3 = at + width, at2 + 3, at3 + 3
        elif kind == SHARDED_NORM:
            present, squares = total1[at:at + 2]
            result.rows.append([math.sqrt(squares)] if present else None)
            at += 2
        elif kind == RANK_MEAN:
            present, value = total1[at:at + 2]
            result.rows.append([value / present] if present else None)
            at += 2
        elif kind == SUMMED:
            size = len(plan.rows[slot])  # type: ignore[arg-type]
            values = total1[at + 1:at + size]
            result.rows.append(host_row(to_host([reduce_tensor(torch.tensor(values, dtype=torch.float64))])[0])
                               if total1[at] and values else None)
            if result.rows[-1] is not None:
                result.summed[slot] = values
            at += size
        else:
            present, size = total1[at:at + 2]
            result.rows.append(total1[at + 2: at + 2 + int(size)] if present else None)
            if extremes[at3] >= 0:
                result.desync_rank[slot] = int(extremes[at3])
            at, at3 = at + 2 + row_width(), at3 + 1
    return result


def _merged_row(sums: Sequence[float], extremes: Sequence[float], mean: float, central: Sequence[float]
                ) -> list[float] | None:
    """A merged slot's global row (``Moments``, then the extra accumulators) from its first SUM's values
    (presence, count, sum, the ``additive_fields``), its MAX's ``(max, -min)``, the global mean and the
    second SUM's central sums; None where no rank had it."""
    present, n = sums[0], sums[1]
    if not present:
        return None
    added = dict(zip(additive_fields(), sums[3:]))
    merged = Moments(mean, -extremes[1], extremes[0], n, *central, added["zeros"], added["nans"], added["infs"])
    return [*merged, *(added[a.name] for a in statistics.extra_accumulators())]


def _width(kind: str, row: Sequence[float] | None) -> int:
    """How many values a slot of ``kind`` takes in the first SUM (``StepReduction._reduce`` packs them)."""
    if kind == MERGED:
        return 3 + len(additive_fields())  # presence, count, sum, then the additive accumulators
    if kind in (SHARDED_NORM, RANK_MEAN):
        return 2
    if kind == SUMMED:
        return len(row)  # type: ignore[arg-type]
    return 2 + row_width()  # REPLICATED: presence, length, the row padded


def centred_about(m: Moments, mean: float) -> list[float]:
    """The sums of ``(x - mean)^k``, k = 2..4, over ``m``'s finite values, from its own central sums
    (binomial shift by ``d = m.mean - mean``, small where ranks see alike data): what each rank adds in
    the second SUM. Zeros for no values."""
    if not m.count:
        return [0.0, 0.0, 0.0]
    d = m.mean - mean
    d2 = d * d
    return [m.m2 + m.count * d2, m.m3 + 3 * d * m.m2 + m.count * d2 * d,
            m.m4 + 4 * d * m.m3 + 6 * d2 * m.m2 + m.count * d2 * d2]


def _same(mine: Sequence[float], theirs: Sequence[float], rtol: float = DESYNC_RTOL) -> bool:
    """Whether two copies of a replicated row agree (NaN equals NaN; ``rtol`` relative)."""
    if len(mine) != len(theirs):
        return False
    for a, b in zip(mine, theirs):
        if a == b or (math.isnan(a) and math.isnan(b)):
            continue
        if not (abs(a - b) <= rtol * max(abs(a), abs(b))):
            return False
    return True


#: A parameter's or its gradient's share of a histogram over every rank (``global_histograms``): the
#: global ``(min, max)`` and this rank's ``engine.stats.histogram`` vector with those edges (None where
#: it adds nothing); None for the whole entry: no histogram (no values on any rank, or a NaN/Inf)
HistogramPart = tuple[float, float, torch.Tensor | None] | None


def watch_step(reduction: StepReduction, step: int, groups: Groups,
               params: Sequence[Any], sharded: Sequence[bool], updates: Sequence[Vector] | None,
               loss: Vector | None, *, failed: bool = False, owned: Sequence[bool] | None = None,
               channels: dict[tuple[str, str], tuple[torch.Tensor, int]] | None = None,
               histograms: Sequence[tuple[HistogramPart, HistogramPart]] | None = None,
               partial: Sequence[PartialGrad] | None = None, flag: bool = False) -> WatchStep:
    """A watched step's record over every rank (``StepWatcher._collect``'s counterpart under
    ``torchrun``): the local vectors to the host in one transfer, then ``StepReduction.reduce``.
    ``groups``: ``merged_outputs``; ``params``: ``ParamVectors`` in attach order; ``sharded``: which
    of them are shards (``is_sharded``); ``owned``: which this rank adds (``owns``; all without it);
    ``failed``: hookcli's hooks failed on this rank in the step; ``channels``: ``merged_channels``
    (the per-channel nonzero counts, summed over the ranks in the first SUM); ``histograms``: each
    parameter's and gradient's ``global_histograms`` part (the bucket counts summed in the first SUM
    too); ``partial``: ``partial_grads`` (those gradients' values summed in the first SUM); ``flag``:
    this rank's, counted over the ranks in the first SUM too (``reduction.flagged``). Every rank gets
    the same record; rank diagnostics are findings."""
    try:
        rows = _local_rows(groups, params, sharded, updates, loss, owned, channels, histograms, partial)
    except Exception:  # this rank cannot make its rows: the others are told (no rank waits), then it raises
        plan = Plan()  # the same slots as the other ranks', all empty
        for i, shard in enumerate(sharded):
            for k, kind in enumerate((MERGED, SHARDED_NORM, SHARDED_NORM) if shard else (REPLICATED,) * 3):
                summed = k == 0 and partial is not None and partial[i] is not None
                plan.add(SUMMED if summed else kind, [0.0] * (1 + partial[i][1].numel()) if summed else None)
        try:
            reduction.reduce({}, plan, None, failed=True,
                             extra=[0.0] * (2 * HISTOGRAM_PART * len(histograms) if histograms is not None else 0) + [0.0])
        except RanksFailed:
            pass
        raise
    layer_rows, plan, loss_row, channel_rows, extra = rows
    layers, result = reduction.reduce(layer_rows, plan, loss_row, failed=failed, channels=channel_rows,
                                      extra=[*extra, float(flag)])
    reduction.flagged = result.extra[-1]
    record = _record(reduction, step, layers, params, result)
    if histograms is not None:
        _add_histograms(record, histograms, result.extra)
        for i, found in enumerate(partial or ()):  # a Partial gradient's histogram: of its summed values
            values = result.summed.get(Slots(len(layers)).of_param(i, "grad"))
            if found is not None and values is not None:
                record.params[i].grad_histogram = Histogram.from_values(
                    to_host([histogram(torch.tensor(values, dtype=torch.float64))])[0])  # type: ignore[list-item]
    return record


#: What a rank adds to the first SUM for one histogram: count, sum, sum of squares, the bucket counts
HISTOGRAM_PART = 3 + HISTOGRAM_BINS


def global_histograms(reduction: StepReduction, tensors: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
                      adds: Sequence[bool]) -> list[tuple[HistogramPart, HistogramPart]]:
    """Each parameter's and its gradient's histogram over every rank's part, nothing gathered: the
    global min and max of the parts (one MAX ``all_reduce``, the step's fourth collective), then this
    rank's bucket counts with those edges, on the device (``StepReduction.reduce`` sums them in the
    step's first SUM). ``tensors``: each parameter's (local values, local gradient or None: none, or a
    ``Partial`` one, whose histogram ``watch_step`` takes from its summed values), in attach order;
    ``adds``: which this rank counts (a shard it owns, or rank 0's copy of a replicated one)."""
    parts = [t for pair in tensors for t in pair]
    counted = [t is not None and add and t.numel() > 0 and t.is_floating_point()
               for pair, add in zip(tensors, adds) for t in pair]
    mine = iter(engine_reduction.extremes([t for t, c in zip(parts, counted) if c]))  # type: ignore[misc]
    local_extremes = to_host([next(mine) if c else (-math.inf, -math.inf)  # type: ignore[misc]
                              for c in counted])
    flat = [v if math.isfinite(v) or v == -math.inf else math.inf  # a NaN/Inf: no histogram (inf wins the MAX)
            for row in local_extremes for v in row]
    extremes = reduction._all_reduce([float(v) for v in flat], torch.distributed.ReduceOp.MAX)
    bounds: list[tuple[float, float] | None] = []
    for index in range(len(parts)):
        hi, lo = extremes[2 * index], -extremes[2 * index + 1]
        bounds.append((lo, hi) if math.isfinite(hi) and math.isfinite(lo) else None)
    drawn = [(local(t), b) for t, c, b in zip(parts, counted, bounds) if c and b is not None]  # type: ignore[arg-type]
    counts = iter(engine_reduction.histograms([t for t, _ in drawn], bounds=[b for _, b in drawn]))
    out: list[HistogramPart] = [None if b is None else (b[0], b[1], next(counts) if c else None)
                                for c, b in zip(counted, bounds)]
    return list(zip(out[::2], out[1::2]))


def _add_histograms(record: WatchStep, histograms: Sequence[tuple[HistogramPart, HistogramPart]],
                    summed: Sequence[float]) -> None:
    """The global histograms into ``record``'s parameters from the summed parts (``global_histograms``)."""
    for index, (entry, pair) in enumerate(zip(record.params, histograms)):
        found = []
        for kind, part in enumerate(pair):
            at = (2 * index + kind) * HISTOGRAM_PART
            found.append(Histogram.from_values([part[0], part[1], *summed[at:at + HISTOGRAM_PART]])
                         if part is not None and summed[at] else None)
        entry.values_histogram, entry.grad_histogram = found


def _local_rows(groups: Groups, params: Sequence[Any], sharded: Sequence[bool],
                updates: Sequence[Vector] | None, loss: Vector | None, owned: Sequence[bool] | None = None,
                channels: dict[tuple[str, str], tuple[torch.Tensor, int]] | None = None,
                histograms: Sequence[tuple[HistogramPart, HistogramPart]] | None = None,
                partial: Sequence[PartialGrad] | None = None) -> tuple[Any, ...]:
    """This rank's rows for ``StepReduction.reduce``: its vectors to the host in one transfer; a
    sharded parameter's rows are left out where this rank does not own its part (``owns``). Also its
    channel counts (key -> (values per channel, nonzeros)) and the histograms' ``extra``."""
    local_vectors: list[Vector] = []
    for *_, stats, grad in groups.values():
        local_vectors += [v for v in (stats, grad) if v is not None]
    for i, p in enumerate(params):
        local_vectors += [v for v in (p.grad, p.norm, updates[i] if updates else None) if v is not None]
    if loss is not None:
        local_vectors.append(loss)
    channels = channels or {}
    local_vectors += [nonzeros for nonzeros, _ in channels.values()]
    hist_vectors = [part[2] for pair in histograms or () for part in pair if part is not None and part[2] is not None]
    local_vectors += hist_vectors
    summed = [p[1] for p in partial or () if p is not None]
    local_vectors += summed
    host = iter(to_host(local_vectors))  # the step's one transfer

    def take(vector: Vector | None) -> list[float] | None:
        return next(host) if vector is not None else None

    layer_rows = {key: ((typ, shape, dtype, calls), take(stats), take(grad))
                  for key, (typ, shape, dtype, calls, stats, grad) in groups.items()}
    plan = Plan()
    for i, p in enumerate(params):
        rows = [take(p.grad), take(p.norm), take(updates[i]) if updates else None]
        if sharded[i] and owned is not None and not owned[i]:  # another rank adds this copy of the part
            rows = [None, None, None]
        plan.add(MERGED if sharded[i] else REPLICATED, rows[0])
        norm_kind = SHARDED_NORM if sharded[i] else REPLICATED
        plan.add(norm_kind, rows[1])
        plan.add(norm_kind, rows[2])
    loss_row = take(loss)
    channel_rows = {key: (float(per), next(host)) for key, (_, per) in channels.items()}
    extra: list[float] = []
    for pair in histograms or ():
        for part in pair:
            vector = take(part[2]) if part is not None else None
            extra += vector[2:] if vector is not None else [0.0] * HISTOGRAM_PART
    for i, found in enumerate(partial or ()):
        if found is not None:  # the gradient's slot: its values, summed (a REPLICATED row would see a desync)
            adds, values = found
            values = next(host)
            slot = Slots.in_params(i, "grad")
            plan.rows[slot], plan.kinds[slot] = [float(adds), *(values if adds else [0.0] * len(values))], SUMMED
    return layer_rows, plan, loss_row[0] if loss_row is not None else None, channel_rows, extra


def _record(reduction: StepReduction, step: int, layers: Sequence[tuple[tuple[str, str], tuple[Any, ...]]],
            params: Sequence[Any], result: StepResult) -> WatchStep:
    """The step's record from the global rows (the same on every rank)."""
    rows = result.rows
    record = WatchStep(step, rows[-1][0] if rows[-1] is not None else None)
    record.layers = watch_layers(layers, [(rows[Slots.of_layer(i, "stats")], rows[Slots.of_layer(i, "grad")])
                                          for i in range(len(layers))],
                                 result.channels, reduction.placement if reduction.tp is not None else None)
    slots = Slots(len(layers))
    for i, p in enumerate(params):
        g, n, u = (slots.of_param(i, what) for what in Slots.PARAM)
        record.params.append(watch_param(p, rows[n][0] if rows[n] is not None else math.nan, rows[g],
                                         rows[u][0] if rows[u] is not None else None))
    record.findings = _rank_findings(reduction, step, layers, params, slots, result)
    return record


def _rank_findings(reduction: StepReduction, step: int, layers: Sequence[tuple[tuple[str, str], Any]],
                   params: Sequence[Any], slots: Slots, result: StepResult) -> list[Finding]:
    """``replica_desync`` for each replicated parameter (or its gradient) whose copies differ, and
    ``nonfinite_rank``, once per run, for the first slot where a rank saw a NaN/Inf."""
    found: list[Finding] = []
    for slot, bad_rank in sorted(result.desync_rank.items()):
        _, index, part = slots.which(slot)
        what = {"grad": "gradient", "norm": "value", "update": "update"}[part]
        name = params[index].name
        found.append(Finding("replica_desync", "error", step, name, "update" if part == "update" else
                             "backward" if part == "grad" else "forward", float(bad_rank), None,
                             f"the {what} of parameter {name} on rank {bad_rank} differs from rank 0's: "
                             "data-parallel replicas are out of sync"))
    if result.nonfinite_rank and not reduction.nonfinite_seen:
        reduction.nonfinite_seen = True
        slot = min(result.nonfinite_rank)
        bad_rank = result.nonfinite_rank[slot]
        kind, index, part = slots.which(slot)
        if kind == "layer":
            (name, path), _ = layers[index]
            where, direction = f"{name}{path}" + ("'s output" if part == "stats" else "'s gradient"), \
                ("forward" if part == "stats" else "backward")
        else:
            name = params[index].name
            where, direction = f"parameter {name}'s gradient", "backward"
        found.append(Finding("nonfinite_rank", "error", step, name, direction, float(bad_rank), None,
                             f"NaN/Inf first seen on rank {bad_rank}, in {where}"))
    return found


Rows = dict[Any, list[float]]


def global_rows(stats: Rows, grads: Rows, *, failed: bool = False, tp: list[list[int]] | None = None
                ) -> tuple[Rows, Rows, dict[Any, str]]:
    """The ranks' host statistics rows merged into global ones (``stats`` / ``grads`` of the Python API
    under ``torchrun``: each rank ran its own part of the batch; ``MergedRows.records``): the rows of
    each key (any picklable key, the same model on every rank) over every rank that had it, with
    ``StepReduction``'s collectives. ``tp``: the tensor-parallel groups (``supported_tp_groups``): the
    ranks of a TP group ran the same batch, an output they hold parts of is summed, one they hold
    copies of counted once, as the watch does; the third value says which, by key ("sharded" or
    "replicated"; empty without TP). Without a process group, the rows as they are. ``failed``: this
    rank's run failed: every rank raises ``RanksFailed`` (none is left waiting in a collective)."""
    group = process_group()
    if group is None:
        return stats, grads, {}
    reduction = StepReduction(group, tp)
    keys = list(dict.fromkeys([*stats, *grads]))
    layer_rows = {key: (("", None, "", 1), stats.get(key), grads.get(key)) for key in keys}
    layers, result = reduction.reduce(layer_rows, Plan(), None, failed=failed)
    out_stats: Rows = {}
    out_grads: Rows = {}
    for index, (key, _) in enumerate(layers):
        for out, row in ((out_stats, result.rows[Slots.of_layer(index, "stats")]),
                         (out_grads, result.rows[Slots.of_layer(index, "grad")])):
            if row is not None:
                out[key] = row
    placement = {key: reduction.placement[key] for key, _ in layers} if tp is not None else {}
    return out_stats, out_grads, placement


def mean_over_ranks(params: Sequence[tuple[str, torch.Tensor]], grads: dict[str, torch.Tensor | None]
                    ) -> dict[str, torch.Tensor | None]:
    """Each replicated parameter's gradient averaged over the ranks (what DDP applies: a rank without
    one adds zeros), in one ``all_reduce`` of a packed float64 buffer; None where no rank has one.
    ``params``: the same names in the same order on every rank, each a copy on every rank (a plain
    tensor, or a DTensor that ``is_sharded`` says is not: its local copy is averaged). A sharded
    gradient (FSDP2's, reduce-scattered: already the ranks' mean) is not theirs to average:
    ``param_rows`` merges its shards. Without a process group, ``grads`` as they are."""
    group = process_group()
    if group is None:
        return grads
    device = StepReduction(group).device
    parts = []
    for name, p in params:
        g = grads.get(name)
        numel = local(p).numel()
        parts.append(torch.tensor([0.0 if g is None else 1.0], dtype=torch.float64, device=device))
        parts.append(torch.zeros(numel, dtype=torch.float64, device=device) if g is None
                     else local(g.detach()).reshape(-1).to(device=device, dtype=torch.float64))
    buffer = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(buffer, group=group)
    out: dict[str, torch.Tensor | None] = {}
    at = 0
    world = torch.distributed.get_world_size(group)
    for name, p in params:
        shape = local(p).shape
        numel = shape.numel()
        present, values = buffer[at].item(), buffer[at + 1:at + 1 + numel]
        at += 1 + numel
        out[name] = (values / world).reshape(shape) if present else None
    return out


def param_rows(params: Sequence[tuple[str, torch.Tensor]], grads: Mapping[str, torch.Tensor | None],
               tp: list[list[int]] | None = None) -> dict[str, tuple[list[float] | None, float]]:
    """Each parameter's gradient (a host statistics row for ``gradient_stats``; None where no rank has
    one) and norm, over the ranks under ``torchrun`` (``grads`` of the Python API):

    - replicated (plain, DDP, a DTensor without ``Shard``): every rank holds a copy; the gradient is
      the ranks' mean (``mean_over_ranks``: what DDP applies), the norm this rank's copy's;
    - sharded (FSDP2, tensor parallel, both: ``is_sharded``): every rank reduces its local shard (never
      gathered), whose gradient is already the global one (FSDP2 reduce-scatters the ranks' mean);
      the owners' (``owns``; ``tp``: ``supported_tp_groups``) rows are merged and the norm is the
      root of the summed squares (``StepReduction``: three collectives, none without a shard).

    ``params``: the same names in the same order on every rank. Without a process group, each
    parameter's own gradient and norm."""
    group = process_group()
    sharded = [group is not None and is_sharded(name, p) for name, p in params]
    replicated = [(name, p) for (name, p), shard in zip(params, sharded) if not shard]
    means = mean_over_ranks(replicated, {name: grads.get(name) for name, _ in replicated})
    chosen = [grads.get(name) if shard else means.get(name) for (name, _), shard in zip(params, sharded)]
    reduced = iter(engine_reduction.reduce_many([local(g.detach()) for g in chosen if g is not None], zeros=False))
    norms = engine_reduction.norms([local(p.detach()) for _, p in params])
    vectors: list[Vector] = []
    for g, norm in zip(chosen, norms):
        vectors += [next(reduced), norm] if g is not None else [norm]
    host = iter(to_host(vectors))  # one transfer
    rows: dict[str, tuple[list[float] | None, float]] = {}
    for (name, _), shard in zip(params, sharded):
        has_grad = (grads.get(name) if shard else means.get(name)) is not None
        grad_row = next(host) if has_grad else None
        rows[name] = (grad_row, next(host)[0])
    if not any(sharded):
        return rows
    reduction = StepReduction(group, tp)
    plan = Plan()
    for (name, p), shard in zip(params, sharded):
        if shard:
            owned = owns(p, reduction.tp_first)  # a part held by several ranks is added once
            grad_row, norm = rows[name]
            plan.add(MERGED, grad_row if owned else None)
            plan.add(SHARDED_NORM, [norm] if owned else None)
    _, result = reduction.reduce({}, plan, None)
    merged = iter(result.rows)
    for (name, _), shard in zip(params, sharded):
        if shard:
            grad_row, norm_row = next(merged), next(merged)
            rows[name] = (grad_row, norm_row[0] if norm_row is not None else 0.0)
    return rows


def replica_desync(params: Sequence[tuple[str, torch.Tensor]], rtol: float = DESYNC_RTOL
                   ) -> tuple[list[str], list[tuple[str, str, int]]]:
    """The parameters whose copies differ across the ranks (``check``'s ``replica_desync`` rule), by
    ``StepReduction``'s comparison of replicated rows (``_same`` at ``rtol``: the MAX slot of the
    highest rank whose copy differs from rank 0's): each parameter's values and, where it holds one,
    its ``.grad`` (what the user's backward left: DDP makes them equal), as statistics rows (a
    fingerprint: mean, extremes, central moments, counts). Sharded parameters (FSDP2, tensor
    parallel: a DTensor with a ``Shard`` placement, or one this module does not reduce) are not
    replicas and are left out. Returns the names compared and each desync as (parameter, "value" or
    "gradient", rank); two collectives, the same on every rank. Nothing without a process group."""
    group = process_group()
    if group is None:
        return [], []
    compared: list[str] = []
    values: list[torch.Tensor] = []
    grads: list[torch.Tensor | None] = []
    for name, p in params:
        try:
            if is_sharded(name, p):
                continue
        except UnsupportedError:  # a layout the watch refuses: not a plain copy either
            continue
        compared.append(name)
        values.append(local(p.detach()))
        grads.append(local(p.grad.detach()) if p.grad is not None else None)
    present = [g for g in grads if g is not None]
    host = to_host(engine_reduction.reduce_many([*values, *present]))  # one call, one transfer
    value_rows, grad_rows = iter(host[:len(values)]), iter(host[len(values):])
    plan = Plan()
    for g in grads:
        plan.add(REPLICATED, next(value_rows))
        plan.add(REPLICATED, next(grad_rows) if g is not None else None)
    reduction = StepReduction(group)
    reduction.rtol = rtol
    _, result = reduction.reduce({}, plan, None)
    return compared, [(compared[slot // 2], ("value", "gradient")[slot % 2], rank)
                      for slot, rank in sorted(result.desync_rank.items())]


def rank_mean(value: float) -> float:
    """The mean of the ranks' ``value`` (one collective); ``value`` without a process group."""
    group = process_group()
    return StepReduction(group).rank_mean(value) if group is not None else value
