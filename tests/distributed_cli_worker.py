"""Run under torchrun by tests/test_distributed_cli.py: build ``sharded_models.py:build`` the way
``hookcli stats MODEL --shard KIND`` does, for each KIND, and save every parameter (gathered: a test
may) and buffer as the ranks hold them, to compare with a one-process build."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hookcli

from hookcli.engine.run import load
from hookcli.errors import HookcliError
from hookcli.options import RunOptions

MODEL = str(Path(__file__).with_name("sharded_models.py")) + ":build"
TIED = str(Path(__file__).with_name("sharded_models.py")) + ":tied"
#: A model whose code cannot run on the meta device (built on the host, then sharded as fsdp2).
READS_VALUES = str(Path(__file__).with_name("sharded_models.py")) + ":reads_values"
#: A transformer layer, whose attention reads a Linear's weight without calling it (``--shard tp``).
ATTENTION = str(Path(__file__).with_name("sharded_models.py")) + ":attention"
#: Models whose build fails on one rank only: rank 0's host build, rank 1's meta build.
FAILING = {name: str(Path(__file__).with_name("sharded_models.py")) + ":" + name
           for name in ("host_fails", "rank1_fails")}
#: The tied model's input: token ids (the same on every rank).
TOKENS = [[1, 2, 3, 4], [5, 6, 0, 1]]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for kind, spec in (("ddp", MODEL), ("fsdp2", MODEL), ("tp", MODEL), ("reads_values", READS_VALUES)):
        shard = "fsdp2" if kind == "reads_values" else kind
        model = load(RunOptions(model=spec, shard=shard).validate()).model
        whole = {}
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            gathered = [torch.empty_like(full) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, full.detach().contiguous())
            whole[name] = torch.stack(gathered)  # every rank's copy: they must all be equal
        if rank == 0:
            torch.save(whole, out / f"{kind}.pt")
        dist.barrier()
    tied: dict[str, object] = {}
    for kind in ("ddp", "fsdp2", "tp"):  # ddp keeps the tie; the others refuse it, on every rank alike
        try:
            model = load(RunOptions(model=TIED, shard=kind).validate()).model
        except HookcliError as exc:
            tied[kind] = [type(exc).__name__, exc.exit_code]
            continue
        model(torch.tensor(TOKENS)).square().mean().backward()
        tied[kind] = {"same": model.head.weight is model.emb.weight, "params": len(list(model.parameters())),
                      "grad": model.emb.weight.grad.tolist()}
    if rank == 0:
        (out / "tied.json").write_text(json.dumps(tied))
    failures: dict[str, object] = {}  # a build failing on one rank: every rank raises, none waits
    for name, spec in FAILING.items():
        for kind in ("fsdp2", "ddp"):
            try:
                load(RunOptions(model=spec, shard=kind).validate())
                failures[f"{name} {kind}"] = None
            except HookcliError as exc:
                failures[f"{name} {kind}"] = [type(exc).__name__, exc.exit_code, exc.message]
    # --shard tp of a transformer layer (its attention's out_proj left whole): the forward runs
    attention = load(RunOptions(model=ATTENTION, shard="tp").validate()).model
    with torch.no_grad():
        output = attention(torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0)))
    if rank == 0:
        torch.save(output, out / "attention.pt")
    # grads --shard ddp over --data of 3 samples in batches of 2: batch 1 (1 sample) leaves rank 1 nothing
    try:
        data = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
        hookcli.grads(model=MODEL, shard="ddp", data=data, batch_size=2, loss="mean")
        failures["empty slice"] = None
    except HookcliError as exc:
        failures["empty slice"] = [type(exc).__name__, exc.exit_code, exc.message]
    (out / f"failures{rank}.json").write_text(json.dumps(failures))
    del model, attention
    gc.collect()  # a DDP model's reducer holds the group: alive past destroy, it can abort a rank at exit
    dist.barrier()  # the group still works: the ranks are in step
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
