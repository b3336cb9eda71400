"""The command line under ``torchrun``: its process group, and ``--shard ddp|fsdp2|tp`` (docs/distributed.md).

``process_group`` initialises the default process group from torchrun's environment for one command
(gloo on CPU, nccl with ``--device cuda``, each rank on ``cuda:LOCAL_RANK``) and destroys it after,
also when the command raises. ``load_sharded`` builds a model the way a one-process run builds it, but
sharded: every rank builds it on the meta device (no memory), shards it, allocates its own part and
fills it from rank 0, which alone builds the full model on the host with the model's own seeded
initialisation (``set_model_state_dict(..., broadcast_from_rank0=True)``; every buffer, persistent or
not, broadcast from rank 0): the weights are exactly those of ``hookcli stats MODEL``, and device
memory holds each rank's part only (rank 0's host holds one full copy while it is sent).
``rank_slice`` gives each data-parallel rank its part of the global batch.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from hookcli.engine.input_types import ModelInputs
from hookcli.engine.loading import LoadedModel
from hookcli.engine.model_index import ModelIndex
from hookcli.errors import HookcliError, ModelImportError, RanksFailed, UnsupportedError, UsageError
from hookcli.options import Shard, torchrun_env

#: How long a rank waits for the others in one collective before it gives up (a rank that died or
#: never came: the others must not hang for torch's default half hour).
TIMEOUT = timedelta(minutes=5)


@contextlib.contextmanager
def process_group(device: str | None) -> Iterator[bool]:
    """The default process group for one command under torchrun (yields True), nothing otherwise
    (False), or when the caller initialised one already (True: it stays theirs). Destroyed after,
    also when the block raises."""
    dist = torch.distributed
    if not torchrun_env() or not dist.is_available():
        yield False
        return
    if dist.is_initialized():
        yield True
        return
    try:
        cuda = device is not None and torch.device(device).type == "cuda"
    except (RuntimeError, ValueError):
        cuda = False  # not a device: the run's options say so (UsageError), on every rank
    if cuda:
        local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= count:
            raise UsageError(f"--device {device} under torchrun: this is local rank {local}, and there are "
                             f"{count} CUDA device(s) here", hint="torchrun --nproc-per-node at most the number of "
                                                                  "GPUs, or --device cpu")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    global _settled
    _settled = False  # the command's votes are ahead (``agreement``)
    try:
        yield True
    finally:
        _wait_and_destroy()


def _wait_and_destroy() -> None:
    """Destroy the default process group once every collective it started has finished: a collective
    still in flight when the group goes (the backward of a tensor-parallel layer leaves one, gloo runs
    it on its own thread) aborts the process as it exits. gloo's barrier waits for them."""
    from hookcli.engine import distributed

    dist = torch.distributed
    if distributed.deserted():  # the others may wait in the model's collective: a barrier would never end
        return
    try:
        dist.barrier()
    except RuntimeError:  # a rank that is gone: nothing is left to wait for
        pass
    dist.destroy_process_group()


def agree(code: int, own: bool, failure: BaseException | None = None) -> tuple[int, bool]:
    """The exit code every rank of the default process group exits with, and whether rank 0 failed
    with an error of its own, from each rank's ``code`` (``own``: an error of this rank's own, not
    ``RanksFailed``, the echo of another rank's): the highest code of an error of a rank's own, else
    the highest code (one ``all_reduce`` MAX of three numbers). Without a process group, as given.
    ``failure``: this rank's, when it failed before its run agreed to start: its vote is cast first
    (``owe_vote``), where the other ranks wait for it."""
    from hookcli.engine import distributed, rank_stats

    if failure is not None:
        owe_vote(failure)
    group = distributed.process_group()
    if group is None:  # a rank that deserted the group knows nothing of the others: it says its own error
        return code, own and not distributed.deserted()
    rank = torch.distributed.get_rank(group)
    device = rank_stats.StepReduction(group).device
    codes = torch.tensor([code if own else 0, code, code if own and rank == 0 else 0], dtype=torch.int64,
                         device=device)
    torch.distributed.all_reduce(codes, op=torch.distributed.ReduceOp.MAX, group=group)
    first, anyone, rank0 = (int(v) for v in codes.tolist())
    return (first or anyone), rank0 != 0


def _device(device: str | None) -> torch.device:
    """Where this rank's part of the model lives: ``--device`` (cuda: this rank's GPU), else the CPU."""
    target = torch.device(device or "cpu")
    if target.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return target


def _fsdp2(model: nn.Module, mesh: object) -> None:
    """``fully_shard`` every module that owns parameters directly, innermost first, then the root: each
    module's parameters are gathered only while it runs (FSDP2's usual per-layer wrapping)."""
    from torch.distributed.fsdp import fully_shard

    for module in reversed(list(model.modules())):
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _ties(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """The parameters ``model`` shares between modules (tied weights: a language model's embedding and
    output head), each as its (module name, module, attribute) places, the first as ``named_parameters``
    names it."""
    places: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module_name, module, attr))
    return [group for group in places.values() if len(group) > 1]


def _tie_names(ties: list[list[tuple[str, nn.Module, str]]]) -> str:
    return "; ".join(" = ".join(f"{m}.{a}" if m else a for m, _, a in group) for group in ties)


def _retie(ties: list[list[tuple[str, nn.Module, str]]]) -> None:
    """Share each tied parameter again (``to_empty`` gives every module a parameter of its own)."""
    for (_, first, attr), *rest in ties:
        for _, module, other in rest:
            setattr(module, other, getattr(first, attr))


def tp_plan(model: nn.Module, world: int) -> dict[str, object]:
    """A tensor-parallel plan right for any model: every ``nn.Linear`` whose ``out_features`` the world
    size divides (but a ``MultiheadAttention``'s ``out_proj``, which it never calls), column-wise, its
    output gathered back (``Replicate``): each module's output is the
    one-process output, whatever comes after it. UnsupportedError when no Linear can be split."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    # an attention's out_proj is no module call: MultiheadAttention's forward reads its weight (a DTensor
    # there would meet the plain inputs and raise)
    unsplit = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    plan: dict[str, object] = {name: ColwiseParallel(output_layouts=Replicate()) for name, m in model.named_modules()
                               if name and isinstance(m, nn.Linear) and m.out_features % world == 0
                               and id(m) not in unsplit}
    if not plan:
        raise UnsupportedError(f"--shard tp: the model has no nn.Linear whose out_features divides by {world} ranks",
                               hint="shard it with --shard fsdp2 or --shard ddp, or run on a world size that "
                                    "divides its Linear layers' widths")
    return plan


def load_sharded(shard: Shard, device: str | None, build: Callable[[bool], LoadedModel]) -> LoadedModel:
    """The model ``build`` makes (``build(meta)``: on the meta device or, seeded, on the host), sharded
    over the default process group's ranks as ``shard`` says, with rank 0's initialisation (see the
    module). The model handed back is the one whose modules are hooked: under DDP the module it wraps
    (names as in one process)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    try:  # what each rank does alone (no collective: a 1-D mesh of the world is the default group)
        full = build(False) if rank == 0 else None
        loaded = _meta_build(build)
        model = loaded.model
        target = _device(device)
        ties = _ties(model)
        if ties and shard != Shard.ddp:
            raise UnsupportedError(f"--shard {shard.value}: the model ties parameters between modules "
                                   f"({_tie_names(ties)}), which hookcli's {shard.value} plan would untie or "
                                   "cannot shard", hint="run it with --shard ddp (ties are kept there)")
        if shard == Shard.fsdp2:
            _fsdp2(model, init_device_mesh(target.type, (world,)))
        elif shard == Shard.tp:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, init_device_mesh(target.type, (world,)), tp_plan(model, world))  # type: ignore[arg-type]
        model.to_empty(device=target)
        _retie(ties)  # before the state is filled: a tied weight is filled once, as in the full model
    except Exception as exc:
        vote(exc, f"--shard {shard.value}: building or sharding the model")
        raise
    vote(None, f"--shard {shard.value}: building or sharding the model", {"model": model_summary(model)})
    state = full.model.state_dict() if full is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    sources = dict(full.model.named_buffers()) if full is not None else {}
    with torch.no_grad():  # every buffer, persistent or not (a state dict leaves the latter out)
        for name, buffer in model.named_buffers():
            if rank == 0:
                buffer.copy_(sources[name])
            dist.broadcast(buffer, src=0)
    del full, state, sources
    if shard == Shard.ddp:
        # DDP checks that every rank holds the same parameter shapes and broadcasts rank 0's states; the run
        # calls the module it wraps (its forward is that module's; hookcli averages gradients as DDP does)
        nn.parallel.DistributedDataParallel(model)
    return loaded


def _meta_build(build: Callable[[bool], LoadedModel]) -> LoadedModel:
    """``build(True)``: the model on the meta device. A model whose code cannot run there (an init that
    reads values: torchvision's RegNet computes its widths with ``.tolist()``) is built on the host
    instead and moved to meta (its ties kept), as ``shapes`` falls back to a real run: this rank's host
    holds one more full copy for a moment. What fails on any device (a usage error, a model not found)
    is raised as it is."""
    try:
        return build(True)
    except ModelImportError as exc:
        if exc.__cause__ is None:
            raise  # not the model's own code: the same on any device
    except HookcliError:
        raise
    except Exception:  # noqa: S110 - the model's code on meta: built for real below, or raises there
        pass
    loaded = build(False)
    ties = _ties(loaded.model)
    loaded.model.to("meta")
    _retie(ties)
    return loaded


def rank_slice(inputs: ModelInputs, shard: Shard | None) -> ModelInputs:
    """This rank's part of the global batch: under ddp/fsdp2 every tensor split along its first
    dimension into world-size consecutive slices (``torch.tensor_split``: uneven ones differ by one
    sample, a rank past the batch gets an empty slice); under tp, or unsharded, the whole batch. The
    input rows (``infos``) stay the global batch's."""
    if shard not in (Shard.ddp, Shard.fsdp2):
        return inputs
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def part(value: object) -> object:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return torch.tensor_split(value, world)[rank]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            keep = torch.tensor_split(torch.arange(len(value)), world)[rank].tolist()
            return type(value)(value[i] for i in keep)  # a list of images (detection models)
        return value

    return ModelInputs(tuple(part(v) for v in inputs.args), {k: part(v) for k, v in inputs.kwargs.items()},
                       inputs.infos)


def global_shape(shape: list[int] | None, local: int, whole: int) -> list[int] | None:
    """A row's shape as one process over the whole batch shows it: a leading dimension of this
    rank's slice size (``local``) is the batch's (``whole``)."""
    if shape and local != whole and shape[0] == local:
        return [whole, *shape[1:]]
    return shape


__all__ = ["TIMEOUT", "agree", "global_shape", "load_sharded", "process_group", "rank_slice", "tp_plan"]


# --------------------------------------------------------------------------- the ranks agree before they run

#: Whether this command's votes are over: one showed a rank's failure (every rank is raising), or the
#: ranks agreed to run (``agreement``'s last vote). Until then a rank whose command fails still owes the
#: others its vote (``agree`` casts it), or they would wait in theirs.
_settled = False


def vote(failure: BaseException | None, what: str,
         fingerprint: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None) -> None:
    """Every rank's word at one checkpoint before a run's collectives, in one ``all_gather_object``: whether
    its part failed (and why) and what it is about to run (``fingerprint``: a name -> its value on this rank,
    or a function giving it, called only under a process group).

    A rank whose part failed raises its own error after the vote (the caller re-raises it); the others
    raise ``RanksFailed`` naming the failed rank and its reason. When every part succeeded but the
    fingerprints differ (ranks given different configs, models or inputs), every rank raises the same
    UsageError naming what differs. Every rank then meets in the CLI's exit-code agreement (``agree``).
    Nothing without a process group."""
    global _settled
    from hookcli.engine import distributed

    group = distributed.process_group()
    if group is None:
        return
    reason = None if failure is None else _reason(failure)
    if callable(fingerprint):
        fingerprint = fingerprint()
    votes: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(votes, (reason, dict(fingerprint or {})), group=group)
    failed = [(rank, text) for rank, (text, _) in enumerate(votes) if text is not None]
    if failed:
        _settled = True
        if failure is None:
            rank, text = failed[0]
            raise RanksFailed(f"{what} failed on {len(failed)} of {len(votes)} ranks (rank {rank}: {text})")
        return
    differs = _differs([prints for _, prints in votes])
    if differs is not None:
        _settled = True
        raise UsageError(f"the ranks were given different {differs}: every rank must run the same command on "
                         "the same model, options and config", hint="give every rank the same config and files "
                         "(torchrun runs one command line on every rank)")


def _reason(failure: BaseException) -> str:
    from hookcli.errors import describe_exception, one_line

    text = failure.message if isinstance(failure, HookcliError) else describe_exception(failure)
    return one_line(text, 300)


def _differs(prints: list[dict[str, str]]) -> str | None:
    """``NAME (rank 0: A, rank 1: B)`` for the first name whose value is not the same on every rank."""
    from hookcli.options import short

    for name in dict.fromkeys(name for mine in prints for name in mine):
        values = [mine.get(name, "(none)") for mine in prints]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {rank}: {short(value, 80)}" for rank, value in enumerate(values)
                              if rank == 0 or value != values[0])
            return f"{name} ({shown})"
    return None


class Agreement:
    """The checkpoints of one ``prepare`` under a process group: ``start`` (the options each rank runs
    with) and ``ready`` (the model it built and the batch it read), each a ``vote``."""

    def start(self, fingerprint: Mapping[str, str] | Callable[[], Mapping[str, str]]) -> None:
        vote(None, "preparing the run", fingerprint)

    def ready(self, fingerprint: Mapping[str, str] | Callable[[], Mapping[str, str]]) -> None:
        global _settled
        vote(None, "preparing the run", fingerprint)
        _settled = True


@contextlib.contextmanager
def agreement() -> Iterator[Agreement]:
    """The ranks agree on what they run before it runs: a failure in the block (this rank's options, model,
    inputs) is voted at the others' next checkpoint, so none waits for it in a collective; then raised."""
    global _settled
    _settled = False
    try:
        yield Agreement()
    except Exception as exc:
        if not _settled:
            vote(exc, "preparing the run")
        raise


def owe_vote(failure: BaseException) -> None:
    """A command that failed on this rank before its run agreed to start (``agreement``): its vote, which the
    other ranks wait for at their next checkpoint. Nothing once the votes are over."""
    if not _settled:
        vote(failure, "preparing the run")


def model_summary(model: nn.Module, index: ModelIndex | None = None) -> str:
    """What a rank built, to compare: its class, its parameters' and buffers' names, shapes and dtypes
    (as one process sees them: a DTensor's global shape), digested. Read through ``index`` when given
    (the run's one traversal of the modules: the same names as ``named_parameters``, no walk of its own)."""
    import hashlib

    named = ((*index.named_parameters(), *index.named_buffers()) if index is not None and index.model is model
             else (*model.named_parameters(), *model.named_buffers()))
    entries = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    digest = hashlib.sha1(repr(entries).encode()).hexdigest()[:12]
    count = sum(math.prod(shape) for _, shape, _ in entries)
    return f"{type(model).__name__}, {len(entries)} tensors, {count:,} values (layout {digest})"


#: RunOptions fields that are where a config lies, not what runs (``options_fingerprint`` leaves them out).
_NOT_COMPARED = ("model_source", "model_roots", "data_roots", "specs")


def options_fingerprint(opts: Any) -> dict[str, str]:
    """What a rank runs, by its validated RunOptions (the command line's, a config's and the defaults'):
    each field as text. A model object or in-memory inputs and data (Python callers, each rank its own
    part) are compared by kind only."""
    import dataclasses

    from hookcli.options import MemoryInputs, option_flags

    flags = option_flags()
    prints: dict[str, str] = {}
    for f in dataclasses.fields(opts):
        if f.name in _NOT_COMPARED:
            continue
        value = getattr(opts, f.name)
        if f.name == "inputs":
            value = [type(v).__name__ if isinstance(v, MemoryInputs) else v for v in value]
        elif f.name in ("model", "data") and value is not None and not isinstance(value, str):
            value = type(value).__name__
        prints[flags.get(f.name, f.name)] = _text(value)
    return prints


def _text(value: Any) -> str:
    """An option's value as the command line would say it: ``2x4, 1x8``, ``num_classes=10``, ``fsdp2``."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}={_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def ready_fingerprint(model: nn.Module, inputs: ModelInputs, sharded: bool,
                      index: ModelIndex | None = None) -> dict[str, str]:
    """What a rank is about to run: the model it built (``model_summary``) and, when the ranks share one
    global batch (``--shard``: each takes its part of it), that batch: its tensors' shapes, dtypes and bytes."""
    prints = {"model": model_summary(model, index)}
    if sharded:
        import hashlib

        from hookcli.engine.stats import iter_tensors

        digest = hashlib.sha1()
        shapes = []
        for path, t in iter_tensors((inputs.args, inputs.kwargs)):
            shapes.append(f"{path}{list(t.shape)}")
            digest.update(f"{path}{list(t.shape)}{t.dtype}".encode())
            if t.device.type == "cpu":
                try:
                    digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                except (RuntimeError, TypeError):  # a dtype without a byte view: compared by shape only
                    pass
        prints["input batch"] = f"{', '.join(shapes)} (content {digest.hexdigest()[:12]})"
    return prints
