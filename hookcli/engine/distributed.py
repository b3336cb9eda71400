"""torchrun, DTensor and FSDP2 as hookcli meets them: the process group (``process_group``, ``rank``,
``world_size``), a tensor's part on this rank (``local``), which parameters are sharded and which this rank
owns, the tensor-parallel groups, gradients FSDP2 makes, a rank leaving the collectives (``desert``), and
small collectives (``rank_mean``, ``gathered``). The exact statistics over the ranks built on them are
``engine.rank_stats``' (docs/distributed.md).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hookcli.errors import UnsupportedError


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
