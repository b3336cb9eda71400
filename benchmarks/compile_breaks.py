"""Graph breaks and recompilations of a ``torch.compile``d model watched by ``hookcli.watch`` (issue #22).

``python benchmarks/compile_breaks.py [--steps 21] [--every 10] [--backend eager]`` trains a random-init
torchvision resnet18 (batch 2, 32x32) and a small MLP compiled, unwatched and watched, and prints, from
torch's own counters, the graph breaks, frames compiled and recompilations (with the step of each).
The watch's hooks run eagerly (``torch.compiler.disable``), so each hooked module call is a graph break.
Nothing is timed.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torchvision
from torch import nn
from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

import hookcli


def measure(make: type[nn.Module] | object, steps: int, every: int, backend: str, watched: bool,
            shape: tuple[int, ...]) -> dict[str, object]:
    """One compiled training run from a fresh Dynamo state: graph breaks, frames, recompiles by step."""
    torch._dynamo.reset()
    clear_compilation_metrics()
    counters.clear()
    torch.manual_seed(0)
    model = make()  # type: ignore[operator]
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    recompiled_at: list[int] = []
    seen = 0
    with hookcli.watch(compiled, opt, every=every) if watched else contextlib.nullcontext() as w:
        for step in range(steps):
            loss = compiled(torch.randn(*shape)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if w is not None:
                w.step(loss=loss)
            count = sum(1 for m in get_compilation_metrics() if m.recompile_reason)
            recompiled_at += [step] * (count - seen)
            seen = count
    metrics = get_compilation_metrics()
    return {"graph breaks": sum(counters["graph_break"].values()), "frames compiled": len(metrics),
            "recompiles": len(recompiled_at), "recompiled at steps": sorted(set(recompiled_at))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--backend", default="eager")
    args = parser.parse_args()
    cases = {
        "resnet18": (lambda: torchvision.models.resnet18(weights=None, num_classes=10), (2, 3, 32, 32)),
        "mlp 3 Linear": (lambda: nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(),
                                               nn.Linear(16, 1)), (8, 4)),
    }
    print(f"torch {torch.__version__}, backend {args.backend}, {args.steps} steps, every={args.every}")
    for name, (make, shape) in cases.items():
        for watched in (False, True):
            row = measure(make, args.steps, args.every, args.backend, watched, shape)
            print(f"{name:14} {'watched' if watched else 'unwatched':9} " + ", ".join(f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
