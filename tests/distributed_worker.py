"""What each rank runs under torchrun in tests/test_distributed.py (not a test module itself).

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed_worker.py MODE OUT``: trains
``model()`` for ``STEPS`` steps on its slice of the global batch ``batch()`` under ``hookcli.watch``
(every step logged, the log at ``OUT/log.jsonl``), and writes ``OUT/rank<r>.json``: each logged
record as ``w.last.to_dict()`` and the process group's collective counts around ``w.step()``.

MODE: ``ddp`` | ``fsdp`` (FSDP2, uneven and empty shards) | ``tp`` (tensor parallel: ``0`` colwise,
``2`` rowwise; every rank the whole batch) | ``tp_dtensor`` (as ``tp``, ``0`` and ``1`` output DTensors) | ``fsdp_tp`` (4 ranks: FSDP2 over mesh
dimension ``dp`` x TP as ``tp`` over ``tp``; each TP group its half of the batch) | ``faults`` (DDP; rank 1's copy of
``2.weight`` nudged after DDP's broadcast, a NaN in rank 1's input at step 1, and at step 2 an output
on rank 1 that hookcli's hook cannot read) | ``count`` (DDP over 4, then 40 Linear layers: collectives
per logged step; ``OUT/4/`` and ``OUT/40/``) | ``stats`` (``hookcli.stats`` on each rank's slice of step
0's batch, as one tensor and as ``data`` in batches of 2: ``OUT/rank<r>.json`` holds both reports) | ``cause``
(who made a NaN: ``made_in_a_parent``, then ``made_on_rank_one``).
``fsdp`` and ``tp`` also write TensorBoard histograms (``OUT/tb``, rank 0 alone asks); ``ddp`` then runs
``dead_units`` (``OUT/dead<r>.json``) and ``unused_branch`` (``OUT/branch/``), ``tp`` then ``sequence_parallel`` (``OUT/sp/``), ``fsdp_tp`` then
``sequence_parallel`` under FSDP2 x TP (``OUT/sp_fsdp/``): packed into those
launches, as each launch costs every rank a torch start-up.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookcli
from hookcli.records import WatchStep

STEPS = 3
GLOBAL_BATCH = 8
LR = 0.1
TP_HIDDEN = 6


def model(layers: int = 0, hidden: int = 5) -> nn.Sequential:
    """The matrix's tiny model (seed 0): ``hidden`` rows in the first weight (5: FSDP2 on 2 ranks 3 + 2;
    6 for tensor parallelism, whose activations shard evenly only) and one in the last (1 + 0: an
    empty shard). ``layers``: a stack of that many Linear(4, 4) + ReLU instead."""
    torch.manual_seed(0)
    if layers:
        return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(4, 4), nn.ReLU())), nn.Linear(4, 1))
    return nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 4), nn.Tanh(), nn.Linear(4, 1))


def batch(step: int, features: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same in every process)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, features, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g)


class Unreadable(torch.Tensor):
    """A tensor subclass whose first ``detach`` raises (``armed``): hookcli's forward hook, the first to
    detach the output, fails; the model and the loss run on."""

    armed = True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.Tensor.detach and Unreadable.armed:
            Unreadable.armed = False
            raise RuntimeError("this output cannot be detached")
        return super().__torch_function__(func, types, args, kwargs or {})


def refusals() -> list[tuple[str, int, str]]:
    """What hookcli.watch says of what it does not reduce yet: (error class, exit code, message) for a
    DTensor parameter on a 2-D mesh without FSDP2 (two tensor-parallel dimensions). (FSDP1, also
    refused, cannot be built on CPU: "FSDP needs a non-CPU accelerator device".)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()))
    tp = nn.Linear(4, 4)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Replicate(), Shard(0)]))
    said = []
    for net in (tp,):
        try:
            hookcli.watch(net, None)
        except hookcli.errors.HookcliError as exc:
            said.append((type(exc).__name__, exc.exit_code, str(exc)))
    return said


class MaskedBlock(nn.Module):
    """Its own forward multiplies its output by a NaN mask at step 2 (its Linear and Tanh stay finite),
    on every rank or on rank ``rank`` only."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.lin, self.act, self.calls, self.rank = nn.Linear(5, 5), nn.Tanh(), 0, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.calls = self.act(self.lin(x)), self.calls + 1
        here = self.rank is None or not dist.is_initialized() or dist.get_rank() == self.rank
        return y * float("nan") if self.calls == 3 and here else y


def made_in_a_parent(out: Path) -> None:
    """DDP on every rank, every step logged: the NaN made in ``1``'s own forward at step 2 is named by
    its maker on every rank (``out/cause<r>.json``: the findings)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), MaskedBlock(), nn.Linear(5, 1))
    wrapped = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    with hookcli.watch(wrapped, optimizer, every=1, on_finding="warn") as w:
        for step in range(4):
            x, y = batch(step)
            nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    (out / f"cause{dist.get_rank()}.json").write_text(json.dumps([f.to_dict() for f in w.findings]))


def _nonfinite_output(bad: list[tuple[int, str]], at: list[int], name: str, _module: nn.Module, _args: Any,
                      output: Any) -> None:
    """The test's own forward hook: (step, module) when the module's output holds a NaN/Inf."""
    if isinstance(output, torch.Tensor) and not bool(torch.isfinite(output).all()):
        bad.append((at[0], name))


def made_on_rank_one(out: Path) -> None:
    """DDP, the NaN made in ``1``'s own forward at step 2 on rank 1 only (rank 0's forward stays finite;
    DDP's averaged gradients carry it to rank 0's weights after the step): every step logged, then
    unlogged with the flight recorder (``every=50, flight=4``), then with the flight recorder and a logged
    step after the NaN (``every=3, flight=2``). ``out/rank_one<r>.json``: each run's findings, and plain
    torch's ground truth on this rank: the (step, module) of each module output that was not finite, in
    call order, from the test's own forward hooks (an unwatched run); ``collectives``: each run's
    collectives on the process group (its own sequence number, DDP's included) in each step, then
    at the watch's end."""
    said: dict[str, Any] = {"collectives": {}}
    group = dist.group.WORLD
    runs = (("logged", {"every": 1}), ("flight", {"every": 50, "flight": 4}),
            ("flight_logged", {"every": 3, "flight": 2}), ("plain", None))
    for name, options in runs:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 5), MaskedBlock(rank=1), nn.Linear(5, 1))
        wrapped = nn.parallel.DistributedDataParallel(net)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        bad: list[tuple[int, str]] = []
        at = [0]  # the step in progress, for the hooks
        handles = [m.register_forward_hook(partial(_nonfinite_output, bad, at, n))
                   for n, m in net.named_modules()] if options is None else []
        counts = said["collectives"][name] = []
        with hookcli.watch(wrapped, optimizer, **options, on_finding="warn") if options else contextlib.nullcontext() as w:
            for step in range(5):
                at[0] = step
                x, y = batch(step)
                before = group._get_sequence_number_for_group()
                nn.functional.mse_loss(wrapped(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                counts.append(group._get_sequence_number_for_group() - before)
            before = group._get_sequence_number_for_group()
        counts.append(group._get_sequence_number_for_group() - before)
        for handle in handles:
            handle.remove()
        said[name] = bad if options is None else [f.to_dict() for f in w.findings]
        del wrapped
        gc.collect()
    (out / f"rank_one{dist.get_rank()}.json").write_text(json.dumps(said))


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if mode == "stats":
        stats(out)
    elif mode == "count":  # one process group, two watches: 4 and 40 layers
        for layers in (4, 40):
            (out / str(layers)).mkdir(exist_ok=True)
            train(mode, out / str(layers), layers)
    elif mode != "cause":
        train(mode, out, 0)
    if mode == "ddp":  # packed into the ddp launch (each launch costs every rank a torch start-up)
        dead_units(out)
        accelerator_path(out / "accelerator")
        unused_branch(out)
    if mode == "tp":
        sequence_parallel(out)
    if mode == "fsdp_tp":
        sequence_parallel(out, fsdp=True)
    if mode == "cause":
        made_in_a_parent(out)
        made_on_rank_one(out)
    if mode == "faults":
        (out / f"refused{dist.get_rank()}.json").write_text(json.dumps(refusals()))
    gc.collect()  # the watches and meshes (and their process groups) go before the groups are destroyed
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


def accelerator_path(out: Path) -> None:
    """The ddp run again with every statistic taken as on an accelerator (``HOOKCLI_REDUCTION=device``:
    vectors as tensors, ``SCALE`` included, read by ``to_host``), here on CPU tensors: the ranks must pack
    the same slots as on the host path (on a GPU they did not: one more value per replicated row on
    rank 0, and gloo aborted)."""
    import os

    from hookcli.engine.reduction import REDUCTION_ENV

    out.mkdir(exist_ok=True)
    os.environ[REDUCTION_ENV] = "device"
    try:
        train("ddp", out, 0)
    finally:
        del os.environ[REDUCTION_ENV]


def watch_stopped(said: list[warnings.WarningMessage]) -> list[str]:
    """What the watch said stopped it (``WatchWarning``s, in ``optimizer.step()`` or ``w.step()``: it never
    raises into the loop)."""
    return [str(s.message) for s in said if s.category is hookcli.errors.WatchWarning]


def stats(out: Path) -> None:
    """``hookcli.stats``, then ``hookcli.grads`` (loss: the output's mean) of ``model()`` on this rank's
    slice of ``batch(0)``: as one input tensor and as ``data`` in batches of 2 (the reports' dicts in
    ``out/rank<r>.json``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    x = batch(0)[0][rank * per_rank:(rank + 1) * per_rank]
    net = model()
    reports = [hookcli.stats(net, inputs=x), hookcli.stats(net, data=x, batch_size=2),
               hookcli.grads(net, inputs=x, loss="mean"), hookcli.grads(net, data=x, batch_size=2, loss="mean")]
    (out / f"rank{rank}.json").write_text(json.dumps([report.to_dict() for report in reports]))


def train(mode: str, out: Path, layers: int) -> None:
    """``STEPS`` steps of ``model(layers)`` under a watch; ``out/rank<r>.json`` says what it saw."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(layers, TP_HIDDEN if mode in ("tp", "tp_dtensor", "fsdp_tp") else 5)
    data_rank, data_world = rank, world  # which slice of the global batch this rank trains on, of how many
    if mode in ("tp", "tp_dtensor", "fsdp_tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        shape = (world // 2, 2) if mode == "fsdp_tp" else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp") if mode == "fsdp_tp" else ("tp",))
        colwise = ColwiseParallel(use_local_output=mode != "tp_dtensor")  # tp_dtensor: 0 and 1 output DTensors
        parallelize_module(net, mesh["tp"], {"0": colwise, "2": RowwiseParallel()})
        data_rank, data_world = (mesh["dp"].get_local_rank(), world // 2) if mode == "fsdp_tp" else (0, 1)
    if mode in ("fsdp", "fsdp_tp"):
        from torch.distributed.fsdp import fully_shard

        from torch.distributed.device_mesh import init_device_mesh

        # a CPU mesh named: FSDP2's default mesh is on CUDA wherever a GPU exists (one GPU: rank 1 fails)
        dp = {"mesh": mesh["dp"] if mode == "fsdp_tp" else init_device_mesh("cpu", (world,))}
        for index in (0, 2, 4):
            fully_shard(net[index], **dp)
        wrapped: nn.Module = fully_shard(net, **dp)
    elif mode in ("tp", "tp_dtensor"):
        wrapped = net
    else:
        wrapped = nn.parallel.DistributedDataParallel(net)
        if mode == "faults" and rank == 1:
            with torch.no_grad():
                net[2].weight[0, 0] += 1e-3
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    group = dist.group.WORLD
    records, collectives, errors, channels = [], [], [], []
    per_rank = GLOBAL_BATCH // data_world
    # histograms over the shards (FSDP2, TP): rank 0 alone asks for them, every rank takes part
    tensorboard = out / "tb" if mode in ("fsdp", "tp") and rank == 0 else None
    with warnings.catch_warnings(record=True) as said, \
            hookcli.watch(wrapped, optimizer, every=1, out=out / "log.jsonl", tensorboard_dir=tensorboard) as w:
        warnings.simplefilter("always", hookcli.errors.WatchWarning)
        for step in range(STEPS):
            x, y = batch(step, 4 if layers else 3)
            x, y = x[data_rank * per_rank:(data_rank + 1) * per_rank], y[data_rank * per_rank:(data_rank + 1) * per_rank]
            if mode == "faults" and rank == 1 and step == 1:
                x = x.clone()
                x[0, 0] = float("nan")
            if mode == "faults" and rank == 1 and step == 2:
                net[1].register_forward_hook(lambda _m, _a, out: out.as_subclass(Unreadable))
            loss = nn.functional.mse_loss(wrapped(x), y)
            loss.backward()
            in_step = group._get_sequence_number_for_group()
            optimizer.step()
            in_step = group._get_sequence_number_for_group() - in_step
            optimizer.zero_grad()
            before = (group._get_sequence_number_for_group(), w._watcher.reduction.collectives)
            w.step(loss=loss)
            if stopped := watch_stopped(said):  # faults: every rank's watch stops at step 2 (the loop would go on)
                errors.extend(stopped)
                break
            after = (group._get_sequence_number_for_group(), w._watcher.reduction.collectives)
            collectives.append({"process_group": after[0] - before[0], "hookcli": after[1] - before[1],
                                "optimizer_step": in_step})
            records.append(json.loads(w.last.to_json_line()))  # as the log writes it (NaN sanitised)
            channels.append(channel_fractions(w.last))
    (out / f"rank{rank}.json").write_text(json.dumps({"records": records, "collectives": collectives,
                                                       "findings": [f.to_dict() for f in w.findings],
                                                       "errors": errors, "channels": channels}))


def channel_fractions(record: WatchStep) -> dict[str, list[float]]:
    """Each counted layer's per-channel zero fractions (the ``dead_units`` rule's; not in the log)."""
    return {layer.name + layer.output: layer.channel_zero_fraction for layer in record.layers
            if layer.channel_zero_fraction is not None}


#: ``dead_model``'s channels killed by its init: a large negative bias, zero on every rank's data
DEAD = (0, 1)


def dead_model() -> nn.Sequential:
    """Linear(3, 6) + ReLU, seeded, whose channels ``DEAD`` are zero on any input; channel 2 is ``x[..., 0]``,
    channel 3 its negation (``dead_batch`` makes each zero on one rank's half only)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.ReLU())
    with torch.no_grad():
        net[0].bias[list(DEAD)] = -1e3
        net[0].weight[2:4] = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
        net[0].bias[2:4] = 0.0
    return net


def dead_batch(step: int) -> torch.Tensor:
    """The global batch ``[8, 16, 3]`` of ``step``: feature 0 is at most 0 in the first half of the rows (rank
    0's), at least 0 in the second (rank 1's). 64 values a channel on a rank (fewer than the 100 that the
    ``dead_units`` rule judges a channel on), 128 in all."""
    x = torch.randn(GLOBAL_BATCH, 16, 3, generator=torch.Generator().manual_seed(300 + step))
    half = GLOBAL_BATCH // 2
    x[:half, :, 0] = -x[:half, :, 0].abs()
    x[half:, :, 0] = x[half:, :, 0].abs()
    return x


def dead_units(out: Path) -> None:
    """``dead_model`` under DDP with its rank's half of ``dead_batch`` (no optimizer: the weights stay), 3
    logged steps: ``OUT/dead<r>.json`` holds each record's layers (dead and all channels) and per-channel
    zero fractions, and the findings."""
    rank, half = dist.get_rank(), GLOBAL_BATCH // dist.get_world_size()
    wrapped = nn.parallel.DistributedDataParallel(dead_model())
    layers, channels = [], []
    with hookcli.watch(wrapped, None, every=1) as w:
        for step in range(STEPS):
            wrapped(dead_batch(step)[rank * half:(rank + 1) * half]).sum().backward()
            w.step()
            layers.append([layer.to_dict() for layer in w.last.layers])
            channels.append(channel_fractions(w.last))
    (out / f"dead{rank}.json").write_text(json.dumps({"layers": layers, "channels": channels,
                                                       "findings": [f.to_dict() for f in w.findings]}))


#: ``sp_model``'s tokens per sequence and batch rows
SP_TOKENS, SP_ROWS = 4, 2


def sp_model() -> nn.Sequential:
    """torch's tensor-parallel tutorial in small (seed 1): a LayerNorm on sequence-sharded tokens, a Linear
    pair (colwise from ``Shard(1)``, rowwise back to ``Shard(1)``), a head (colwise to ``Replicate``)."""
    torch.manual_seed(1)
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.Linear(4, 2))


def sp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` (every rank the same; each feeds the model its own tokens)."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(SP_ROWS, SP_TOKENS, 4, generator=g), torch.randn(SP_ROWS, SP_TOKENS, 2, generator=g)


def sequence_parallel(out: Path, fsdp: bool = False) -> None:
    """``sp_model`` under sequence + tensor parallelism over every rank (each rank its slice of the tokens),
    ``STEPS`` logged steps, the loss of the replicated head output: ``OUT/sp/log.jsonl`` and
    ``OUT/sp/rank<r>.json`` as ``train`` writes them. ``fsdp`` (4 ranks): FSDP2 over mesh dimension
    ``dp`` x the same over ``tp`` (each TP group one row of the batch), in ``OUT/sp_fsdp/``; then one more
    step whose LayerNorm weight's gradient is made both sharded and ``Partial`` (torch 2.14's FSDP2
    leaves it summed: ``Replicate`` on ``tp``), which the watch refuses: ``errors`` says how."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    rank, world = dist.get_rank(), dist.get_world_size()
    net = sp_model()
    if fsdp:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, rows = mesh["tp"], slice(mesh["dp"].get_local_rank(), mesh["dp"].get_local_rank() + 1)
    else:
        tp_mesh, rows = init_device_mesh("cpu", (world,)), slice(None)
    parallelize_module(net, tp_mesh, {
        "0": SequenceParallel(), "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1)),
        "4": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    wrapped: nn.Module = net
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for index in (0, 1, 3, 4):
            fully_shard(net[index], mesh=mesh["dp"])
        wrapped = fully_shard(net, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    folder = out / ("sp_fsdp" if fsdp else "sp")
    folder.mkdir(exist_ok=True)
    records, channels, errors = [], [], []
    tokens = SP_TOKENS // tp_mesh.size()
    first = tp_mesh.get_local_rank() * tokens
    with hookcli.watch(wrapped, optimizer, every=1, out=folder / "log.jsonl") as w:
        for step in range(STEPS + (1 if fsdp else 0)):
            x, y = sp_batch(step)
            loss = nn.functional.mse_loss(wrapped(x[rows, first:first + tokens]), y[rows])
            loss.backward()
            if step == STEPS:  # a gradient both sharded (dp) and Partial (tp): refused at the logged step
                g = net[0].weight.grad
                net[0].weight.grad = DTensor.from_local(g.to_local(), g.device_mesh, [Shard(0), Partial()])
            optimizer.step()  # (a refusal found in its hook is raised at the next w.step(), as on_finding="raise")
            optimizer.zero_grad()
            try:
                w.step(loss=loss)
            except hookcli.errors.UnsupportedError as exc:
                errors.append((type(exc).__name__, exc.exit_code, str(exc), exc.hint))
                break
            records.append(json.loads(w.last.to_json_line()))
            channels.append(channel_fractions(w.last))
    (folder / f"rank{rank}.json").write_text(json.dumps({"records": records, "channels": channels, "errors": errors,
                                                         "findings": [f.to_dict() for f in w.findings]}))


class Branchy(nn.Module):
    """A trunk, then one of two heads, as the caller says (seed 2)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.trunk = nn.Linear(3, 4)
        self.left = nn.Linear(4, 2)
        self.right = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, left: bool) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.left(h) if left else self.right(h)


def branch_batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch of ``step``; ``right_taken``: whether it takes the right head then."""
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(300 + 10 * step + rank))


def right_taken(step: int, rank: int) -> bool:
    """Rank 1 takes the right head at step 1, every other (rank, step) the left one."""
    return rank == 1 and step == 1


def unused_branch(out: Path) -> None:
    """``Branchy`` under DDP with ``find_unused_parameters=True``, ``STEPS`` logged steps (SGD, zero_grad
    setting None): each rank's loss the mean square of its head's output. At step 1 the right head's
    gradient, which only rank 1's backward makes, is DDP's mean on every rank: ``OUT/branch/log.jsonl``."""
    rank = dist.get_rank()
    net = nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    (out / "branch").mkdir(exist_ok=True)
    with hookcli.watch(net, optimizer, every=1, out=out / "branch" / "log.jsonl") as w:
        for step in range(STEPS):
            loss = net(branch_batch(step, rank), not right_taken(step, rank)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step(loss=loss)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
