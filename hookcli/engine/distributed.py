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
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookcli.engine import reduction as engine_reduction
from hookcli.engine.stats import (EMPTY, HISTOGRAM_BINS, Moments, Vector, as_moments, extras,
                                  histogram, reduce_tensor, to_host)
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


#: This rank left the process group's collectives for good (``desert``).
_deserted = False


def process_group() -> Any | None:
    """The default process group when ``torch.distributed`` is initialised with more than one rank, else
    None (also once this rank has ``desert``-ed it)."""
    if _deserted or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if torch.distributed.get_world_size() < 2:
        return None
    return torch.distributed.group.WORLD


#: The oldest torch hookcli runs on under a process group: the oldest the distributed test matrix passes
#: on (CPU, gloo; what fails below it: docs/distributed.md "Which torch"). pyproject's ``distributed`` extra.
MIN_TORCH = (2, 9)


def check_torch_version(version: str) -> None:
    """UnsupportedError when ``version`` (a ``torch.__version__`` string: ``2.8.0+cu128``, ``2.9.0a0+git...``)
    is older than ``MIN_TORCH``; the major.minor decides, so a pre-release of the floor passes. A string
    that does not start with ``major.minor`` passes (a custom build: nothing to compare)."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= MIN_TORCH:
        return
    needed = f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"
    raise UnsupportedError(f"hookcli under torchrun needs torch {needed} or newer, this is {version}",
                           hint=f"pip install 'torch>={needed}' (or 'hookcli[distributed]'), or run one rank's "
                                "model without a process group")


def check_supported(model: nn.Module) -> None:
    """UnsupportedError, under a process group, for a torch older than ``MIN_TORCH`` and for FSDP1
    (``FullyShardedDataParallel``: its flat parameters are not per-layer tensors hookcli could name)."""
    check_torch_version(torch.__version__)
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise UnsupportedError("hookcli does not reduce FSDP1 (FullyShardedDataParallel) models over the ranks",
                               hint="shard with FSDP2 (torch.distributed.fsdp.fully_shard) or use DDP")


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    group = process_group()
    return torch.distributed.get_rank() if group is not None else 0


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` or an ``nn.DataParallel`` wraps (so layer and parameter
    names are the model's own, ``0`` not ``module.0``, as in a one-process run); any other module as it is."""
    ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    wrappers = (torch.nn.DataParallel, ddp) if ddp is not None else (torch.nn.DataParallel,)
    return model.module if isinstance(model, wrappers) else model  # type: ignore[return-value]


def type_name(module: nn.Module) -> str:
    """The module's class name as the user wrote it: FSDP2's ``fully_shard`` swaps a module's class
    for a subclass ``FSDP<Name>`` of ``(FSDPModule, <Name>)``; that is reported (and ``--types``
    matched) as ``<Name>``, as in a one-process run."""
    cls = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    base = getattr(fsdp, "FSDPModule", None)
    if base is not None and isinstance(module, base) and len(cls.__bases__) == 2 and cls.__bases__[0] is base:
        return cls.__bases__[1].__name__
    return cls.__name__


def _dtensor_type() -> type | None:
    """torch's DTensor class, or None while nothing has imported ``torch.distributed.tensor``: a tensor
    can only be a DTensor once its module is loaded, and importing it for a check would cost every run
    sympy and the symbolic-shapes machinery (~1 s; tests/test_setup_cost.py)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: no communication); any other tensor as it is."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def is_sharded(name: str, p: torch.Tensor) -> bool:
    """Whether ``p``'s ranks hold disjoint parts of it (a DTensor with a ``Shard`` placement on some mesh
    dimension: FSDP2, tensor parallelism, both) rather than copies. UnsupportedError for layouts this
    step does not reduce exactly (a mesh of more than two dimensions, a ``Partial`` placement; a mesh
    of part of the world is checked by ``tp_groups``)."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(p, dtensor):
        return False
    mesh, placements = p.device_mesh, p.placements
    if mesh.ndim > 2:
        raise UnsupportedError(f"parameter {name} is a DTensor over a {mesh.ndim}-D mesh of {mesh.size()} ranks",
                               hint="hookcli's distributed watch reduces DTensor parameters on a 1-D or 2-D mesh "
                                    "of the whole world (FSDP2, tensor parallel, FSDP2 x TP) and replicated ones (DDP)")
    if any(placement.is_partial() for placement in placements):
        raise UnsupportedError(f"parameter {name} is a DTensor with a Partial placement",
                               hint="watch parameters that are sharded or replicated (FSDP2, TP, DDP)")
    return any(placement.is_shard() for placement in placements)


def owns(p: torch.Tensor, tp_first: bool = True) -> bool:
    """Whether this rank adds its local part of ``p`` to the global statistics: a DTensor's part is held
    by every rank along the mesh dimensions where it is ``Replicate``; the rank at coordinate 0 there
    adds it, the others add nothing (so shards sum and copies count once). A DTensor over part of the
    world (FSDP2's data-parallel mesh under FSDP2 x TP) has a copy in every TP group: the TP group's
    first rank adds it (``tp_first``). True for other tensors."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(p, dtensor):
        return True
    if p.device_mesh.size() != torch.distributed.get_world_size() and not tp_first:
        return False
    coordinate = p.device_mesh.get_coordinate()
    return all(coordinate[dim] == 0 for dim, placement in enumerate(p.placements) if placement.is_replicate())


def tp_groups(model: nn.Module, params: Sequence[tuple[str, torch.Tensor]]) -> list[list[int]] | None:
    """The tensor-parallel groups (each a list of ranks) of ``model``'s DTensor parameters, or None
    without tensor parallelism. Their mesh's dimensions are tensor parallel but for the first when
    the model has FSDP2 modules (``fully_shard`` shards over mesh dimension 0: FSDP2 x TP). Ranks of one
    TP group see the same batch: a layer output they hold copies of is counted once, one they hold
    parts of is summed (``StepReduction.placement``). UnsupportedError for more than one TP dimension
    or parameters on different TP groups, and for a DTensor over part of the world but under FSDP2 x TP."""
    dtensor = _dtensor_type()
    meshes = [(name, p.device_mesh) for name, p in params if dtensor is not None and isinstance(p, dtensor)]
    if not meshes:
        return None
    from torch.distributed.fsdp import FSDPModule

    first_tp_dim = 1 if any(isinstance(m, FSDPModule) for m in model.modules()) else 0
    found: list[list[int]] | None = None
    for name, mesh in meshes:
        tp_dims = mesh.ndim - first_tp_dim
        if tp_dims == 0:
            continue
        if tp_dims > 0 and mesh.size() != torch.distributed.get_world_size():
            raise UnsupportedError(f"parameter {name} is tensor parallel over {mesh.size()} of "
                                   f"{torch.distributed.get_world_size()} ranks",
                                   hint="hookcli reduces a device mesh of the whole world (TP, or FSDP2 x TP)")
        if tp_dims > 1:
            raise UnsupportedError(f"parameter {name} is a DTensor over a {mesh.ndim}-D mesh without FSDP2",
                                   hint="hookcli reduces tensor parallelism over one mesh dimension, alone or "
                                        "under FSDP2 (fully_shard over mesh dimension 0)")
        ranks = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
        if found is not None and sorted(ranks) != sorted(found):
            raise UnsupportedError(f"parameter {name} is tensor parallel over other ranks than the model's "
                                   "other DTensor parameters", hint="parallelize the model over one device mesh")
        found = ranks
    partial = [name for name, mesh in meshes if mesh.size() != torch.distributed.get_world_size()]
    if partial and found is None:
        raise UnsupportedError(f"parameter {partial[0]} is a DTensor over part of the world's ranks",
                               hint="hookcli reduces DTensor parameters on a mesh of the whole world, or FSDP2's "
                                    "data-parallel mesh under FSDP2 x TP")
    return found


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


#: A ``Partial`` gradient's local values (float64, flat: a copy) and whether this rank adds them
PartialGrad = tuple[bool, torch.Tensor] | None


def partial_grads(params: Sequence[tuple[str, torch.Tensor]]) -> list[PartialGrad]:
    """For each parameter whose ``.grad`` is a DTensor with a ``Partial`` placement (sequence
    parallelism's LayerNorm: each TP rank holds its tokens' share of the gradient, summed by the
    optimizer's step), a copy of its local values, to be summed in the step's first SUM (exact
    statistics of a sum need its values; these are the size of the parameter); None for any other.
    Taken at the optimizer's pre-step (``zero_grad`` may follow before the step ends). The rank at
    coordinate 0 of each ``Replicate`` mesh dimension adds them. UnsupportedError for a ``Partial``
    gradient that is also sharded (the same on every rank: they all raise)."""
    dtensor = _dtensor_type()
    out: list[PartialGrad] = []
    for name, p in params:
        g = p.grad
        if dtensor is None or not isinstance(g, dtensor) or not any(pl.is_partial() for pl in g.placements):
            out.append(None)
            continue
        if any(pl.is_shard() for pl in g.placements):
            raise UnsupportedError(f"the gradient of parameter {name} is both sharded and Partial",
                                   hint="hookcli reduces a Partial gradient replicated elsewhere (sequence "
                                        "parallelism's norms over a 1-D TP mesh)")
        coordinate = g.device_mesh.get_coordinate()
        adds = all(coordinate[d] == 0 for d, pl in enumerate(g.placements) if pl.is_replicate())
        out.append((adds, g.to_local().detach().reshape(-1).to(torch.float64, copy=True)))
    return out


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


def supported_tp_groups(model: nn.Module) -> list[list[int]] | None:
    """What ``global_rows`` needs to know of ``model`` (``stats`` / ``grads`` under ``torchrun``): its
    tensor-parallel groups (``tp_groups``; None without tensor parallelism), after refusing, as the watch
    does, what hookcli does not reduce exactly (``check_supported``, ``is_sharded``, ``tp_groups``):
    UnsupportedError."""
    check_supported(model)
    params = list(model.named_parameters())
    for name, p in params:
        is_sharded(name, p)
    return tp_groups(model, params)


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


def world_size() -> int:
    """The number of ranks of the default process group (1 without one)."""
    return torch.distributed.get_world_size() if process_group() is not None else 1


def batch_owners(tp: list[list[int]] | None = None) -> str:
    """Who ran a batch of its own under ``torchrun``: every rank, or under tensor parallelism
    (``tp``: ``supported_tp_groups``) every TP group (its ranks ran the same batch)."""
    if tp is None:
        return f"each of the {world_size()} ranks"
    return f"each of the {len(tp)} TP groups" if len(tp) > 1 else "the one TP group"


def ranks_note(tp: list[list[int]] | None = None) -> str:
    """What a report merged over the ranks says of it (``tp``: ``supported_tp_groups``); on a rank that
    ``desert``-ed the group (its run failed in a model with collectives of its own), that its rows are
    its own part's only."""
    if _deserted:
        return ("statistics of this rank's own part only (torchrun): its run failed before the ranks merged "
                "them (docs/distributed.md)")
    if tp is None:
        return (f"statistics over all {world_size()} ranks of the process group (torchrun): each rank's own "
                "batch, merged (docs/distributed.md)")
    return (f"statistics over all {world_size()} ranks of the process group (torchrun), tensor parallel in "
            f"groups of {len(tp[0])}: the batch of {batch_owners(tp)}, an output's parts summed and its copies "
            "counted once (docs/distributed.md)")


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


def uses_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` has FSDP2 (``fully_shard``) modules, under a process group."""
    if process_group() is None:
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def runs_collectives(model: nn.Module) -> bool:
    """Whether ``model``'s own forward and backward run collectives (FSDP2 modules; DTensor parameters:
    tensor parallelism), under a process group: a rank whose run of it failed may have left the others
    waiting in one of them."""
    if process_group() is None:
        return False
    dtensor = _dtensor_type()
    return uses_fsdp2(model) or (dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters()))


def desert() -> None:
    """This rank's run failed in a model that ``runs_collectives``: the other ranks may be waiting in one
    of the model's collectives, which none of hookcli's would match (every rank would hang). From now on
    this rank enters no collective (``process_group()`` is None; no barrier before the group goes) and
    raises its own error; as its process ends, its connections close and the others' collective fails
    (or torchrun stops them)."""
    global _deserted
    _deserted = True


def deserted() -> bool:
    """Whether this rank has ``desert``-ed the process group."""
    return _deserted


def fsdp2_gradients(value: torch.Tensor, leaves: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of ``value`` w.r.t. ``leaves`` under FSDP2, where ``torch.autograd.grad`` cannot
    take them (forward ran on unsharded copies of the parameters; FSDP2's post-backward hooks
    reduce-scatter their gradients into the sharded parameters' ``.grad``: each rank its shard of the
    ranks' mean). ``value.backward()``, then each leaf's ``.grad`` is read and put back as it was
    (the user's gradients are kept, also when backward raises)."""
    saved = [leaf.grad for leaf in leaves]
    try:
        for leaf in leaves:
            leaf.grad = None
        value.backward()
        return [leaf.grad for leaf in leaves]
    finally:
        for leaf, grad in zip(leaves, saved):
            leaf.grad = grad


def rank_mean(value: float) -> float:
    """The mean of the ranks' ``value`` (one collective); ``value`` without a process group."""
    group = process_group()
    return StepReduction(group).rank_mean(value) if group is not None else value


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, with one ``all_gather_object``: how ``check``
    merges the plain measurements each rank made on its own (``commands/check/ranks.py``);
    ``[value]`` without a process group."""
    group = process_group()
    if group is None:
        return [value]
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, value, group=group)
    return out


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
