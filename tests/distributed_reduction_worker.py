"""What each rank runs under torchrun in tests/test_distributed_reduction.py (not a test module itself).

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed_reduction_worker.py OUT``: on the
model of tests/distributed_api_worker.py (plain copies on both ranks), each rank takes the gradient of
its half of the global batch's loss (the output's mean) and calls, with every many-tensor function of
``hookcli.engine.reduction`` counted:

1. ``param_rows`` (the parameters' gradients averaged over the ranks, and this rank's norms);
2. ``replica_desync``, after ``.grad`` is set to the ranks' mean gradient (what DDP applies) and rank 1
   has moved its copy of ``2.bias`` by ``SHIFT``;
3. ``global_histograms`` of every (value, gradient) pair, each rank adding its own (as shards are).

It writes ``OUT/rank<r>.json``: the calls each made, by function, and what each returned.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distributed_api_worker import batch, model
from hookcli.engine import distributed
from hookcli.engine import rank_stats
from hookcli.engine import reduction as engine_reduction
from hookcli.engine.stats import gradient_stats

HIDDEN = 5
#: what rank 1 adds to its copy of ``2.bias`` before ``replica_desync`` and ``global_histograms``
SHIFT = 0.5
COUNTED = ("reduce", "reduce_many", "norms", "histograms", "extremes", "channel_counts")


def count_calls() -> Counter[str]:
    """``COUNTED``'s functions of ``hookcli.engine.reduction`` wrapped to count their calls (the real ones
    run); the counter."""
    calls: Counter[str] = Counter()
    for name in COUNTED:
        real = getattr(engine_reduction, name)

        def counting(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(engine_reduction, name, counting)
    return calls


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = count_calls()
    net = model(HIDDEN)
    params = list(net.named_parameters())
    per = batch().shape[0] // world
    x = batch()[rank * per:(rank + 1) * per]
    grads = dict(zip((n for n, _ in params), torch.autograd.grad(net(x).mean(), [p for _, p in params])))
    result: dict[str, Any] = {"calls": {}}

    rows = rank_stats.param_rows(params, grads)
    result["calls"]["param_rows"] = dict(calls)
    result["param_rows"] = {name: [gradient_stats(row) if row is not None else None, norm]
                            for name, (row, norm) in rows.items()}

    calls.clear()
    with torch.no_grad():
        for name, p in params:
            mean = grads[name].clone()
            dist.all_reduce(mean)
            p.grad = mean / world
        if rank == 1:
            net[2].bias.add_(SHIFT)
    compared, desyncs = rank_stats.replica_desync(params)
    result["calls"]["replica_desync"] = dict(calls)
    result["replica_desync"] = [compared, desyncs]

    calls.clear()
    step = rank_stats.StepReduction(distributed.process_group())
    pairs = [(p.detach(), p.grad) for _, p in params]
    parts = rank_stats.global_histograms(step, pairs, [True] * len(pairs))
    result["calls"]["global_histograms"] = dict(calls)
    result["global_histograms"] = [[None if part is None else
                                    [part[0], part[1], None if part[2] is None else part[2].tolist()]
                                    for part in pair] for pair in parts]
    result["grads"] = {name: p.grad.tolist() for name, p in params}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
