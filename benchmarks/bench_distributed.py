"""What each rank runs for ``bench.py --only distributed`` (issue 24); bench.py starts it under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_distributed.py OUT.json \\
        --repeats 3 --every 50 --steps 50 --device cpu

Two twin DDP models (``ddp_trainee``: the watch rows' GPT-style model; each rank its own batch) train
side by side, as in the watch rows: every round a bare DDP step of one, then a step of the other under
the variant. Rank 0 times them (the collectives make both ranks wait for the slower one, as a user's
run does) and writes the rows to OUT.json. Backend: gloo on CPU; on CUDA NCCL when every rank has a GPU
of its own, else gloo with every rank on ``cuda:0`` (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (puts this checkout's hookcli first on sys.path)
import models  # noqa: E402

import hookcli  # noqa: E402


class Collectives(TorchDispatchMode):
    """Counts the ``c10d`` collectives this rank calls while active (DDP's bucket all-reduces from the
    autograd engine included) and the bytes of the tensors it hands them (its contribution: an
    all-reduce's buffer, an all-gather's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.namespace == "c10d" and func.__name__.split(".")[0] in COLLECTIVES:
            inputs = args[1] if func.__name__.startswith("allgather") else args[0]
            tensors = inputs if isinstance(inputs, (list, tuple)) else [inputs]
            self.calls.append((func.__name__.split(".")[0], sum(t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))


#: the c10d ops that move data between ranks (``barrier``, ``monitored_barrier`` and the like are left out)
COLLECTIVES = {"allreduce_", "allreduce_coalesced_", "allgather_", "allgather_into_tensor_coalesced_",
               "_allgather_base_", "reduce_scatter_", "_reduce_scatter_base_", "broadcast_", "reduce_", "gather_",
               "scatter_", "alltoall_", "alltoall_base_"}


def setup(device: str) -> tuple[str, str]:
    """The process group and this rank's device: (backend, device)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_distributed: --device cuda without CUDA")
        own_gpu = torch.cuda.device_count() >= world
        dev = f"cuda:{local if own_gpu else 0}"
        torch.cuda.set_device(dev)
        backend = "nccl" if own_gpu else "gloo"
    else:
        dev, backend = "cpu", "gloo"
    dist.init_process_group(backend)
    return backend, dev


def ddp_trainee(config: Any, batch: int, seq: int, device: str) -> bench.Trainee:
    """``bench.Trainee`` (the watch rows' model, AdamW, seed 0) on ``device``, wrapped in
    ``DistributedDataParallel``, with a batch of this rank's own."""
    trainee = bench.Trainee(config, batch, seq)
    params = list(trainee.model.parameters())
    trainee.model.to(device)  # in place: the parameters the optimizer holds move (checked)
    assert all(p is q for p, q in zip(params, trainee.model.parameters())), "module.to made new parameters"
    rank = dist.get_rank()
    trainee.tokens = torch.randint(0, config.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(rank))
    trainee.tokens = trainee.tokens.to(device)
    trainee.model = torch.nn.parallel.DistributedDataParallel(trainee.model)
    return trainee


def counted(step: Any) -> list[tuple[str, int]]:
    """The collectives of one call of ``step`` on this rank."""
    with Collectives() as seen:
        step()
    return seen.calls


def by_kind(calls: list[tuple[str, int]]) -> str:
    """``2 broadcast_ (120 bytes), 1 allreduce_ (111104 bytes)``; ``none``."""
    kinds = dict.fromkeys(kind for kind, _ in calls)
    return ", ".join(f"{sum(1 for k, _ in calls if k == kind)} {kind} ({sum(b for k, b in calls if k == kind)} bytes)"
                     for kind in kinds) or "none"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--config", default="", help="GPTConfig fields as JSON (the smoke test's tiny model)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend, device = setup(args.device)
    try:
        rows = run(args, backend, device)
        if dist.get_rank() == 0:
            with open(args.out, "w") as fh:
                json.dump(rows, fh)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run(args: argparse.Namespace, backend: str, device: str) -> list[dict[str, Any]]:
    """The section's rows (the same on every rank but for the timings: rank 0's are kept)."""
    config = models.GPTConfig(**json.loads(args.config)) if args.config else models.WATCH_GPT
    world = dist.get_world_size()
    twin, bare = (ddp_trainee(config, args.batch, args.seq, device) for _ in range(2))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def bare_step() -> None:
        bare.step()
        sync()

    params = sum(p.numel() for p in bare.model.parameters())
    label = f"DDP x{world} gpt-style {config.layers}L w{config.width} b{args.batch}/rank s{args.seq}"
    rows: list[dict[str, Any]] = []
    bare_times: list[float] = []
    counts: dict[str, list[tuple[str, int]]] = {}

    def per_step(variant: str, steps: bench.Steps, goal: str) -> None:
        bare_times.extend(steps.bare)
        rows.append(bench._row("distributed", label, variant, statistics.median(steps.variant),
                               bench._median_ratio(steps.variant, steps.bare), goal,
                               f"first round left out (step 0); bare {statistics.median(steps.bare):.3f} s, "
                               f"{len(steps.bare)} rounds; CPU time "
                               f"{bench._median_ratio(steps.variant_cpu, steps.bare_cpu):.3f}x"))

    with tempfile.TemporaryDirectory(prefix="hookcli-bench-distributed-") as tmp:
        bench.alternate_steps(bare_step, lambda i: (twin.step(), sync()), 1)  # warm-up (DDP builds its buckets)
        counts["bare"] = counted(bare_step)
        for every, variant, goal in ((1, "logged step (every=1)", "<= 1.25"), (10**9, "unlogged step", "<= 1.02")):
            with hookcli.watch(twin.model, twin.optimizer, every=every, out=os.path.join(tmp, f"{every}.jsonl")) as w:
                def step(i: int, w: Any = w) -> None:
                    w.step(loss=twin.step())
                    sync()

                timed = bench.alternate_steps(bare_step, step, 1 + args.repeats)
                counts[variant] = counted(lambda: step(0))  # a later logged (or unlogged) step
            per_step(variant, timed.tail(1), goal)
        with hookcli.watch(twin.model, twin.optimizer, every=args.every, out=os.path.join(tmp, "every.jsonl")) as w:
            def every_step(i: int) -> None:
                w.step(loss=twin.step())
                sync()

            timed = bench.alternate_steps(bare_step, every_step, args.steps)
        bare_times.extend(timed.bare)
        rows.append(bench._row("distributed", label, f"every={args.every} over {args.steps} steps", sum(timed.variant),
                               sum(timed.variant) / sum(timed.bare), "<= 1.02",
                               f"{len(range(0, args.steps, args.every))} logged; {bench._totals(timed)}"))
    on = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    rows.insert(0, bench._row("distributed", label, "bare DDP step", statistics.median(bare_times), 1.0,
                              detail=f"{params / 1e6:.1f}M params, AdamW, {world} ranks on {on} ({backend}), "
                                     f"torch {torch.__version__}, {args.threads} thread(s) a rank"))
    ddp = counts["bare"]
    for variant in ("logged step (every=1)", "unlogged step"):
        ours = list((Counter(counts[variant]) - Counter(ddp)).elements())  # the step's calls less DDP's own
        most = 3 if variant.startswith("logged") else 0
        rows.append(bench._row("distributed", f"collectives per {variant.split(' (')[0]}",
                               f"{len(ours)} calls, {sum(b for _, b in ours)} bytes", None, None, f"<= {most} calls",
                               f"hookcli's, rank 0: {by_kind(ours)}; a bare DDP step: {by_kind(ddp)}",
                               met=len(ours) <= most))
    return rows


if __name__ == "__main__":
    main()
