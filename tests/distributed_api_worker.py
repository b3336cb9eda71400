"""What each rank runs under torchrun in tests/test_distributed_api.py (not a test module itself).

``python -m torch.distributed.run --nproc-per-node N tests/distributed_api_worker.py MODE OUT``: builds
``model()`` (seed 0) wrapped as each case of MODE says, runs ``hookcli.stats`` and ``hookcli.grads``
(loss: the output's mean) on this rank's part of ``batch()`` (as one input, and as ``data`` in
batches of 2), and writes ``OUT/<case>/rank<r>.json``: the reports' dicts, or
``[error class, exit code, message]`` where hookcli refused.

MODE ``two`` (2 ranks): ``ddp`` (DistributedDataParallel; each rank its half of the batch), ``fsdp``
(FSDP2, hidden 5: uneven shards 3 + 2, the last weight's single row 1 + 0: an empty shard; each rank
its half), ``tp`` (``0`` ColwiseParallel, ``2`` RowwiseParallel; every rank the whole batch),
``tp_replicate`` (``0`` ColwiseParallel with ``output_layouts=Replicate()``; the rest plain copies;
every rank the whole batch), ``refused`` (what they refuse: ``refusals``).
After them, ``two`` runs the ``report`` example of docs/distributed.md (FSDP2; ``OUT/docs.json``).
MODE ``four`` (4 ranks): ``fsdp_tp`` (FSDP2 over mesh dimension ``dp`` x TP as ``tp`` over ``tp``; each
TP group its half of the batch).
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookcli

GLOBAL_BATCH = 8
FEATURES = 3
#: the cases of each mode, and the hidden width of their model (6 under TP: its activations shard evenly only)
CASES = {"two": {"ddp": 5, "fsdp": 5, "tp": 6, "tp_replicate": 6, "refused": 5}, "four": {"fsdp_tp": 6}}


def model(hidden: int) -> nn.Sequential:
    """The tiny model of every case (seed 0): ``Linear(3, hidden)``, ReLU, ``Linear(hidden, 4)``, Tanh, ``Linear(4, 1)``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 4), nn.Tanh(), nn.Linear(4, 1))


def batch() -> torch.Tensor:
    """The global batch (the same in every process)."""
    return torch.randn(GLOBAL_BATCH, FEATURES, generator=torch.Generator().manual_seed(100))


def wrapped(case: str, hidden: int) -> tuple[nn.Module, int, int]:
    """The case's model as the user holds it, and which part of the global batch this rank runs: (model,
    data-parallel index, data-parallel size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, world = dist.get_rank(), dist.get_world_size()
    net = model(hidden)
    if case == "ddp":
        return nn.parallel.DistributedDataParallel(net), rank, world
    if case == "fsdp":
        mesh = init_device_mesh("cpu", (world,))  # FSDP2's default mesh is on CUDA wherever a GPU exists
        for index in (0, 2, 4):
            fully_shard(net[index], mesh=mesh)
        return fully_shard(net, mesh=mesh), rank, world
    if case == "tp":
        parallelize_module(net, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return net, 0, 1
    if case == "tp_replicate":
        parallelize_module(net, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(output_layouts=Replicate())})
        return net, 0, 1
    if case == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for index in (0, 2, 4):
            fully_shard(net[index], mesh=mesh["dp"])
        return fully_shard(net, mesh=mesh["dp"]), mesh["dp"].get_local_rank(), world // 2
    raise ValueError(case)


def refusals() -> list[tuple[str, int, str]]:
    """What ``stats`` / ``grads`` / ``check`` refuse, as (error class, exit code, message): a DTensor
    parameter on a 2-D mesh without FSDP2 (two tensor-parallel dimensions), ``clip`` on an FSDP2 model,
    and ``check`` of a tensor-parallel or an FSDP2 model. (FSDP1,
    refused too, cannot be built on CPU: "FSDP needs a non-CPU accelerator device".)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x = batch()[:2]
    two_d = model(5)
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()))
    two_d[0].weight = nn.Parameter(distribute_tensor(two_d[0].weight.detach(), mesh, [Replicate(), Shard(0)]))
    fsdp, _, _ = wrapped("fsdp", 5)
    tp, _, _ = wrapped("tp", 6)
    said = []
    for call in (lambda: hookcli.stats(two_d, inputs=x), lambda: hookcli.grads(two_d, inputs=x, loss="mean"),
                 lambda: hookcli.grads(fsdp, inputs=x, loss="mean", clip=0.1),
                 lambda: hookcli.check(tp, inputs=x, loss="mean"), lambda: hookcli.check(fsdp, inputs=x, loss="mean")):
        try:
            call()
        except hookcli.errors.HookcliError as exc:
            said.append((type(exc).__name__, exc.exit_code, str(exc)))
    return said


def run(case: str, hidden: int) -> list[Any]:
    """The case's reports (dicts) in order: stats, then grads, each as one input and over ``data`` in
    batches of 2; or the refusal. Under FSDP2 the user has gradients in ``.grad`` (a backward of their own) before hookcli
    runs; ``{"grads_kept": ...}`` follows the reports: whether they are there, unchanged, after."""
    if case == "refused":
        return refusals()
    net, part, parts = wrapped(case, hidden)
    per = GLOBAL_BATCH // parts
    x = batch()[part * per:(part + 1) * per]
    fsdp = case.startswith("fsdp")
    if fsdp:
        net(x).square().mean().backward()
        before = [p.grad.to_local().clone() for p in net.parameters()]
    try:
        reports = [hookcli.stats(net, inputs=x), hookcli.stats(net, data=x, batch_size=2),
                   hookcli.grads(net, inputs=x, loss="mean"), hookcli.grads(net, data=x, batch_size=2, loss="mean")]
    except hookcli.errors.HookcliError as exc:
        return [type(exc).__name__, exc.exit_code, str(exc)]
    out: list[Any] = [report.to_dict() for report in reports]
    if fsdp:
        out.append({"grads_kept": all(p.grad is not None and torch.equal(p.grad.to_local(), saved)
                                      for p, saved in zip(net.parameters(), before))})
    return out


class Started:
    """``torch.distributed`` for the docs' example, whose process group the worker has started already
    (one process group per process: starting a second after the first ended hangs under torchrun)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def init_process_group(*_args: Any, **_kwargs: Any) -> None:
        """Started already."""

    @staticmethod
    def destroy_process_group() -> None:
        """Left to the worker."""


def docs_example(out: Path) -> None:
    """The ``report`` example of docs/distributed.md, as the page shows it, in the worker's process
    group: rank 0 writes ``out``."""
    page = (Path(__file__).parents[1] / "docs" / "distributed.md").read_text()
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    for block in re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M):
        exec(compile(block, "docs/distributed.md", "exec"), namespace)  # noqa: S102 - the docs' own example
    namespace["dist"] = Started()
    namespace["report"](str(out))


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case, hidden in CASES[mode].items():
        result = run(case, hidden)
        (out / case).mkdir(exist_ok=True)
        (out / case / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
        gc.collect()  # the case's meshes (and their process groups) go before the next case's
        dist.barrier()
    if mode == "two":
        docs_example(out / "docs.json")
        gc.collect()  # the example's DDP model (its reducer holds the group) goes before the group
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
