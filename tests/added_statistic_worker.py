"""One rank of tests/test_add_statistic.py's torchrun launch: mean |x| registered here (as a plugin module
would), then one DDP step of added_statistic.Model under hookcli.watch; rank 0 writes the log."""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import added_statistic
import hookcli


def main(log: str) -> None:
    added_statistic.register()
    dist.init_process_group("gloo")
    step(log)
    # DDP's reducer holds the group: left alive past destroy_process_group, it aborted a rank at exit
    # (about one launch in ten: "terminate called without an active exception")
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def step(log: str) -> None:
    """One DDP step under hookcli.watch; the model, its reducer and the watch go when this returns."""
    model = DistributedDataParallel(added_statistic.Model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = added_statistic.batch(dist.get_rank())
    with hookcli.watch(model, optimizer, out=log) as w:
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        w.step(loss=loss)


if __name__ == "__main__":
    main(sys.argv[1])
