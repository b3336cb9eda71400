"""Kernel launches of one hookcli.watch step against the same bare training step (torch.profiler).

    python benchmarks/launch_count.py                  # CUDA: the watch rows' GPT-style model, b8 s128
    python benchmarks/launch_count.py --json out.json
    python benchmarks/launch_count.py --device cpu --tiny   # no GPU: aten ops instead of launches

On CUDA it counts, per step, the CPU side's kernel launch calls (``cudaLaunchKernel``, ``cuLaunchKernel``
and their ``Ex`` forms; a Triton kernel is a ``cuLaunchKernel``) and the kernels the device ran, for a
bare step, an unlogged step and a logged (``every=1``) step of a twin model, each after warm-up steps.
On CPU (``--device cpu``) there are no launches: it counts the aten ops the profiler records instead,
which keeps this script runnable (and tested) without a GPU. The reduction backend is the one
``HOOKCLI_REDUCTION`` chooses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

#: The runtime calls that launch a kernel, as the profiler names them.
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def count(step: Any, device: str) -> dict[str, int]:
    """``{"launches": ..., "kernels": ...}`` of one call of ``step()`` (CPU: ``aten_ops`` instead)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    if device != "cuda":
        return {"aten_ops": sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)}
    launches = sum(1 for e in events if e.name in LAUNCHES)
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name
                  and "Memset" not in e.name)
    return {"launches": launches, "kernels": kernels}


def measure(device: str, tiny: bool, warmup: int = 3) -> list[dict[str, Any]]:
    """The three rows: bare step, unlogged step, logged step (and each one's ratio to the bare one)."""
    import bench
    import hookcli
    import models

    if tiny:
        config, batch, seq = models.GPTConfig(vocab=64, width=32, heads=2, layers=2, max_len=8), 2, 8
    else:
        config, batch, seq = models.WATCH_GPT, 8, 128
    bare, twin = (bench.Trainee(config, batch, seq, device=device) for _ in range(2))
    rows = []
    with tempfile.TemporaryDirectory(prefix="hookcli-launches-") as tmp:
        for _ in range(warmup):
            bare.step()
        rows.append({"variant": "bare step", **count(bare.step, device)})
        for every, variant in ((10**9, "unlogged step"), (1, "logged step (every=1)")):
            with hookcli.watch(twin.model, twin.optimizer, every=every, out=os.path.join(tmp, f"{every}.jsonl")) as w:
                for _ in range(warmup):
                    w.step(loss=twin.step())
                rows.append({"variant": variant, **count(lambda w=w: w.step(loss=twin.step()), device)})
    unit = "launches" if device == "cuda" else "aten_ops"
    for row in rows:
        row["ratio"] = row[unit] / rows[0][unit] if rows[0][unit] else None
        row["reduction"] = os.environ.get("HOOKCLI_REDUCTION", "auto")
        row["model"] = f"gpt-style {config.layers}L w{config.width} b{batch} s{seq}"
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    unit = "launches" if "launches" in rows[0] else "aten_ops"
    print(f"{'model':<28} {'reduction':<10} {'variant':<24} {unit:>9} {'kernels':>8} {'ratio':>6}")
    for r in rows:
        kernels = r.get("kernels", "")
        print(f"{r['model']:<28} {r['reduction']:<10} {r['variant']:<24} {r[unit]:>9} {kernels:>8} {r['ratio']:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer width-32 model (a smoke test)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA")
        return
    rows = measure(args.device, args.tiny)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
