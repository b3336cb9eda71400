"""What each rank runs under torchrun in tests/test_distributed_check.py (not a test module itself).

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed_check_worker.py OUT``: one process
group, several ``hookcli.check`` cases, each rank on its own slice of the global batch ``batch()``;
``OUT/rank<r>.json`` holds, per case, the result's dict or the error raised (class, exit code, message):

- ``healthy``: ``model()``, every default rule and the probe rules;
- ``channels``: ``channel_model()``, whose ReLU channels are dead on every sample (2 of 8) or on rank
  0's samples only (1): dead over the global batch are those of the first kind only;
- ``zero_init``: ``model()`` with its last weight zero (the second look at a stepped copy runs);
- ``desync``: rank 1's copy of ``2.weight`` nudged by 1e-3 relative, and a ``.grad`` of ``0.bias`` that
  differs between the ranks (a backward whose gradients nobody averaged);
- ``raises``: a model whose forward raises on rank 1 only;
- ``raises_in_copy``: one that raises on rank 1 from its second call (params_change's copy) on;
- ``data``: ``model()`` on this rank's half as ``data`` in batches of 8;
- ``steps``: ``check`` with ``steps=3`` (refused under torchrun);
- ``shard_ddp``: ``sharded_models.py:build`` with ``shard="ddp"`` (``check --shard ddp``) on a global
  batch of 5 (slices of 3 and 2), ``output_shape`` [5, 3].
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hookcli

GLOBAL_BATCH = 32
NUDGE = 1e-3
PROBES = {"batch_independence": True, "input_dependence": True, "grad_accumulation": True}


def model(zero_last: bool = False) -> nn.Sequential:
    """The tiny model of every case (seed 0): Linear, ReLU, Linear, Tanh, Linear."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    if zero_last:
        with torch.no_grad():
            net[4].weight.zero_()
    return net


def channel_model() -> nn.Sequential:
    """Linear(3, 8) then ReLU, then Linear(8, 1): channels 0-1 have a bias of -100 (dead on any input of
    ``batch()``), channel 2 is the first input feature, which is negative on rank 0's half of the global
    batch and positive on rank 1's (``batch(signed=True)``); the others are random."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        net[0].bias[:2] = -100.0
        net[0].weight[2] = torch.tensor([1.0, 0.0, 0.0])
        net[0].bias[2] = 0.0
    return net


def batch(signed: bool = False) -> torch.Tensor:
    """The global batch (the same in every process); ``signed``: its first feature negative in the first
    half and positive in the second."""
    x = torch.randn(GLOBAL_BATCH, 3, generator=torch.Generator().manual_seed(7))
    if signed:
        half = GLOBAL_BATCH // 2
        x[:half, 0] = -x[:half, 0].abs() - 0.1
        x[half:, 0] = x[half:, 0].abs() + 0.1
    return x


def my_slice(x: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = x.shape[0] // world
    return x[rank * per:(rank + 1) * per]


class RaisesOnRank1(nn.Module):
    """``model()`` whose forward raises on rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            raise ValueError("rank 1 cannot run this batch")
        return self.net(x)


class RaisesOnRank1Later(RaisesOnRank1):
    """``model()`` whose forward raises on rank 1 from its second call on (the checked run passes; the
    SGD step on params_change's copy raises)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RaisesOnRank1Later.calls += 1
        if dist.get_rank() == 1 and RaisesOnRank1Later.calls > 1:
            raise ValueError("rank 1 cannot run this batch twice")
        return self.net(x)


def run(**kwargs: Any) -> dict[str, Any]:
    """``hookcli.check`` as a dict, or the error it raised; ``collectives``: how many it made (the
    process group's own sequence number, every collective on it)."""
    group = dist.group.WORLD
    before = group._get_sequence_number_for_group()
    try:
        done: dict[str, Any] = {"result": hookcli.check(loss="mean", **kwargs).to_dict()}
    except hookcli.errors.HookcliError as exc:
        done = {"error": [type(exc).__name__, exc.exit_code, str(exc)]}
    return {**done, "collectives": group._get_sequence_number_for_group() - before}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cases: dict[str, Any] = {}
    cases["healthy"] = run(model=model(), inputs=my_slice(batch()), checks=PROBES)
    cases["channels"] = run(model=channel_model(), inputs=my_slice(batch(signed=True)))
    cases["zero_init"] = run(model=model(zero_last=True), inputs=my_slice(batch()))
    net = model()
    with torch.no_grad():
        if rank == 1:
            net[2].weight[0, 0] *= 1 + NUDGE
    net[0].bias.grad = torch.full_like(net[0].bias, float(rank + 1))
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    cases["desync"] = run(model=net, inputs=my_slice(batch()))
    cases["desync_kept"] = all(torch.equal(before[name], p) for name, p in net.named_parameters())
    cases["raises"] = run(model=RaisesOnRank1(), inputs=my_slice(batch()))
    cases["raises_in_copy"] = run(model=RaisesOnRank1Later(), inputs=my_slice(batch()))
    cases["data"] = run(model=model(), data=my_slice(batch()), batch_size=8)
    cases["steps"] = run(model=model(), inputs=my_slice(batch()), steps=3)
    # as ``hookcli check MODEL --shard ddp`` runs: the global batch of 5 cut in slices of 3 and 2
    cases["shard_ddp"] = run(model=str(Path(__file__).with_name("sharded_models.py")) + ":build", shard="ddp",
                             input_shapes=["5x6"], checks={"output_shape": [5, 3]})
    (out / f"rank{rank}.json").write_text(json.dumps(cases))
    del net
    gc.collect()  # what the runs wrapped in DDP (its reducer holds the group) goes before the group
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
