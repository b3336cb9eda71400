"""hookcli benchmarks: every issue-6 target with its measured ratio (CPU, a few minutes on 2 cores).

    python benchmarks/bench.py            # all targets
    python benchmarks/bench.py --quick    # smaller repeat counts

Timings are medians of alternating runs in one process (so both sides see the same machine state);
peak memory is each variant's own process peak (``VmHWM``, median of fresh subprocesses). Nothing here
is a test: the suite never times anything.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- variants (run in-process)

def _resnet50_case(batch: int = 8) -> tuple[Any, Any]:
    import torch
    from torchvision.models import resnet50

    torch.manual_seed(0)
    return resnet50(weights=None).eval(), torch.randn(batch, 3, 224, 224)


def run_bare(model: Any, x: Any) -> None:
    import torch

    with torch.no_grad():
        model(x)


def run_hookcli(model: Any, x: Any) -> None:
    """What `hookcli stats --all` does around the forward: hooks, on-device stats, one transfer."""
    import torch

    from hookcli.engine.session import HookOptions, attach
    from hookcli.engine.selection import select_modules

    with attach(model, select_modules(model, all_modules=True), HookOptions(stats=True)) as session:
        with torch.no_grad():
            model(x)
    session.records()


def run_hookcli_torch_reductions(model: Any, x: Any) -> None:
    """The same without the C kernel (HOOKCLI_NO_KERNEL=1): what an install without a C compiler gets."""
    from hookcli.engine.kernel import NO_KERNEL_ENV

    os.environ[NO_KERNEL_ENV] = "1"
    try:
        run_hookcli(model, x)
    finally:
        del os.environ[NO_KERNEL_ENV]


def run_item_hooks(model: Any, x: Any) -> None:
    """The naive way: forward hooks calling .item() per statistic (the seeds' ForwardCheck, extended)."""
    import torch

    rows: list[tuple[float, ...]] = []

    def hook(_m: Any, _i: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            o = out.detach()
            rows.append((o.mean().item(), o.std().item(), o.min().item(), o.max().item(), o.norm().item(),
                         (o == 0).float().mean().item(), torch.isnan(o).sum().item(), torch.isinf(o).sum().item()))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()


def run_capture_all(model: Any, x: Any) -> None:
    """A capture-everything tool: keeps a clone of every module output, then computes statistics."""
    import torch

    kept: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda _m, _i, o: kept.append(o.detach().clone()) if isinstance(o, torch.Tensor) else None)
               for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(x)
        [(t.mean().item(), t.std().item()) for t in kept]
    finally:
        for h in handles:
            h.remove()


def run_torchinfo(model: Any, x: Any) -> None:
    import torchinfo  # optional: pip install torchinfo

    torchinfo.summary(model, input_data=x, verbose=0, depth=10)


VARIANTS: dict[str, Callable[[Any, Any], None]] = {
    "bare forward": run_bare,
    "hookcli stats --all": run_hookcli,
    "  without the C kernel": run_hookcli_torch_reductions,
    "plain .item() hooks": run_item_hooks,
    "capture everything": run_capture_all,
    "torchinfo.summary": run_torchinfo,
}


def alternate(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds per variant, running the variants in turn ``repeats`` times (after a warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_rss_mb(code: str, runs: int = 1) -> float:
    """Peak resident memory (MB) of a fresh Python process running ``code`` (median of ``runs``).

    Read from ``VmHWM`` in /proc/self/status, which starts afresh at exec; ``ru_maxrss`` would not
    (a child inherits its parent's peak across fork). One process's peak varies by up to ~10% from run
    to run (glibc's allocator, for a bare forward too), hence the median.
    """
    if runs > 1:
        return statistics.median(peak_rss_mb(code) for _ in range(runs))
    script = code + textwrap.dedent("""
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                print("PEAK", line.split()[1])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=HERE)
    kb = int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("PEAK")))
    return kb / 1024


def command_seconds(args: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(args, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------- targets

def bench_overhead(repeats: int) -> list[dict[str, Any]]:
    """Each variant alternates with its own bare forward (bare, variant, bare, variant, ...).

    Pairing matters on this kind of machine: a run right after one that freed a lot of memory (the
    capture-everything variant frees 1.3 GB) pays for faulting fresh pages, so a single round-robin
    over all variants would charge that to whichever variant comes next.
    """
    import copy

    import torch

    model, x = _resnet50_case()
    available = dict(VARIANTS)
    available.pop("bare forward")
    if importlib.util.find_spec("torchinfo") is None:
        available.pop("torchinfo.summary")
    target = "stats overhead, resnet50 b8 224 CPU"
    rows: list[dict[str, Any]] = []
    for name, fn in available.items():
        pair = alternate({"bare": lambda: run_bare(model, x), name: lambda fn=fn: fn(model, x)}, repeats)
        if not rows:
            rows.append({"target": target, "variant": "bare forward", "seconds": round(pair["bare"], 3),
                         "ratio": 1.0, "goal": ""})
        rows.append({"target": target, "variant": name, "seconds": round(pair[name], 3),
                     "ratio": round(pair[name] / pair["bare"], 2), "goal": "<= 1.15" if name == "hookcli stats --all" else "",
                     "detail": f"bare {pair['bare']:.3f} s"})
    half_model, half_x = copy.deepcopy(model).to(torch.bfloat16), x.to(torch.bfloat16)  # informative: no target
    half = alternate({"bare": lambda: run_bare(half_model, half_x),
                      "hookcli": lambda: run_hookcli(half_model, half_x)}, repeats)
    rows.append({"target": "same, in bfloat16 (no target)", "variant": "hookcli stats --all",
                 "seconds": round(half["hookcli"], 3), "ratio": round(half["hookcli"] / half["bare"], 2),
                 "goal": "", "detail": f"bare {half['bare']:.3f} s"})
    setup = "import sys; sys.path.insert(0, '.'); from bench import _resnet50_case, VARIANTS; m, x = _resnet50_case()\n"
    runs = 3 if repeats < 7 else 5
    bare_mb = peak_rss_mb(setup + "VARIANTS['bare forward'](m, x); VARIANTS['bare forward'](m, x)", runs)
    hook_mb = peak_rss_mb(setup + "VARIANTS['hookcli stats --all'](m, x); VARIANTS['hookcli stats --all'](m, x)", runs)
    rows.append({"target": "peak memory, same case", "variant": "hookcli / bare", "seconds": None,
                 "ratio": round(hook_mb / bare_mb, 3), "goal": "<= 1.10",
                 "detail": f"{hook_mb:.0f} MB vs {bare_mb:.0f} MB"})
    return rows


def bench_help(repeats: int) -> list[dict[str, Any]]:
    torch_s = command_seconds([sys.executable, "-c", "import torch"], repeats)
    help_s = command_seconds([sys.executable, "-m", "hookcli.cli", "--help"], repeats)
    version_s = command_seconds([sys.executable, "-m", "hookcli.cli", "--version"], repeats)
    return [
        {"target": "hookcli --help vs import torch", "variant": "--help", "seconds": round(help_s, 3),
         "ratio": round(help_s / torch_s, 3), "goal": "<= 0.2"},
        {"target": "hookcli --version vs import torch", "variant": "--version", "seconds": round(version_s, 3),
         "ratio": round(version_s / torch_s, 3), "goal": "<= 0.2"},
    ]


#: About 7B parameters, shared with tests/test_scale.py (which checks its weights are never allocated).
BIG_MODEL = os.path.join(os.path.dirname(HERE), "tests", "big_model.py")


def bench_meta(repeats: int) -> list[dict[str, Any]]:
    imports_s = command_seconds([sys.executable, "-c", "import torch, torchvision"], repeats)
    rows = []
    for spec in ("vit_h_14", f"{BIG_MODEL}:Big"):
        code = f"import hookcli; r = hookcli.shapes({spec!r}); print('PARAMS', r.model.params, r.device)"
        start = time.perf_counter()
        mb = peak_rss_mb(code)
        seconds = time.perf_counter() - start
        rows.append({"target": "shapes on meta", "variant": os.path.basename(spec), "seconds": round(seconds, 2),
                     "ratio": round(seconds / imports_s, 2), "goal": "<= 2.0 (time vs import) ; < 1500 MB",
                     "detail": f"peak {mb:.0f} MB"})
    return rows


def _chain_model(n_modules: int) -> Any:
    from torch import nn

    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(n_modules // 3)])


def bench_scaling(repeats: int) -> list[dict[str, Any]]:
    import torch

    x = torch.randn(4, 32)
    models = {n: _chain_model(n) for n in (1_000, 10_000)}
    # alternating the two sizes: a slow spell of the machine then hits both, not one
    seconds = alternate({str(n): (lambda m=m: run_hookcli(m, x)) for n, m in models.items()}, 2 * repeats)
    per_module = {n: seconds[str(n)] / (sum(1 for _ in m.modules()) - 1) for n, m in models.items()}
    ratio = per_module[10_000] / per_module[1_000]
    return [{"target": "time per module, 10k vs 1k modules", "variant": "stats --all", "seconds": None,
             "ratio": round(ratio, 2), "goal": "<= 1.5",
             "detail": f"{per_module[1_000] * 1e6:.0f} vs {per_module[10_000] * 1e6:.0f} us/module"}]


def bench_kernel(repeats: int) -> list[dict[str, Any]]:
    """Does the C kernel earn its place? ``hookcli.stats(..., all_modules=True)`` through the public
    API with the kernel and with ``HOOKCLI_NO_KERNEL=1``, alternating with a bare forward (bare, kernel,
    no kernel, bare, ...), on resnet50 at batch 8 and on two small models at batch 1. Then the kernel
    and the torch reductions on one activation, and the per-call cost on a small one.

    The API run includes what the bare forward does not: making the randn input, snapshotting and
    restoring the model's state, the report. The kernel/no-kernel ratio is the number that decides.
    """
    import torch
    from torchvision import models

    import hookcli
    from hookcli.engine.kernel import NO_KERNEL_ENV
    from hookcli.engine.stats import Reducer

    def api(model: Any, shape: str, kernel: bool) -> None:
        if kernel:
            os.environ.pop(NO_KERNEL_ENV, None)
        else:
            os.environ[NO_KERNEL_ENV] = "1"
        try:
            hookcli.stats(model, input_shapes=[shape], all_modules=True)
        finally:
            os.environ.pop(NO_KERNEL_ENV, None)

    rows: list[dict[str, Any]] = []
    cases = [("resnet50", 8, 224), ("resnet18", 1, 224), ("mobilenet_v3_small", 1, 224)]
    for name, batch, size in cases:
        torch.manual_seed(0)
        model = getattr(models, name)(weights=None).eval()
        x = torch.randn(batch, 3, size, size)
        shape = f"{batch}x3x{size}x{size}"
        times = alternate({"bare": lambda: run_bare(model, x),
                           "kernel": lambda: api(model, shape, True),
                           "torch": lambda: api(model, shape, False)}, repeats)
        target = f"kernel: stats API, {name} b{batch} {size}"
        for variant, key in (("bare forward", "bare"), ("with the C kernel", "kernel"),
                             ("HOOKCLI_NO_KERNEL=1", "torch")):
            rows.append({"target": target, "variant": variant, "seconds": round(times[key], 4),
                         "ratio": round(times[key] / times["bare"], 2), "goal": "",
                         "detail": "" if key == "bare" else f"vs kernel {times[key] / times['kernel']:.2f}x"})

    # one activation of resnet50 at batch 8 (layer1's ReLU: 8x256x56x56 float32, 25.7 MB), and a small one
    for label, t in (("one 25.7 MB activation", torch.randn(8, 256, 56, 56).relu()),
                     ("one 4 KB activation", torch.randn(1000).relu())):
        fns = {"kernel": lambda t=t: Reducer(kernel=True).reduce(t),
               "torch": lambda t=t: Reducer(kernel=False).reduce(t)}
        inner = 20 if t.numel() > 10_000 else 2000
        per = alternate({k: (lambda fn=fn: [fn() for _ in range(inner)]) for k, fn in fns.items()}, repeats)
        for variant, key in (("C kernel", "kernel"), ("torch reductions", "torch")):
            rows.append({"target": f"kernel: {label}", "variant": variant,
                         "seconds": round(per[key] / inner, 7), "ratio": round(per[key] / per["kernel"], 2),
                         "goal": "", "detail": f"{per[key] / inner * 1e6:.1f} us per reduce"})
    return rows


def run_diff(model: Any, x: Any) -> None:
    """`hookcli diff --all` on a model instance and input: run A stored on disk, run B compared as it runs
    (no change applied: the same work as with one, without a second model in memory)."""
    from hookcli.commands.diff import VsOptions, diff_report
    from hookcli.options import RunOptions

    path = os.path.join(HERE, ".bench_input.pt")
    if not os.path.exists(path):
        import torch

        torch.save(x, path)
    diff_report(RunOptions(model=model, model_source="python", inputs=[path], all_modules=True), VsOptions())


def bench_diff(repeats: int) -> list[dict[str, Any]]:
    """Issue 15: diff of resnet50 b8, every module, against two bare forwards; and its peak memory."""
    model, x = _resnet50_case()
    pair = alternate({"bare": lambda: run_bare(model, x), "diff": lambda: run_diff(model, x)}, repeats)
    target = "diff --all, resnet50 b8 224 CPU"
    rows = [{"target": target, "variant": "hookcli diff / 2 bare", "seconds": round(pair["diff"], 3),
             "ratio": round(pair["diff"] / (2 * pair["bare"]), 2), "goal": "<= 3",
             "detail": f"bare {pair['bare']:.3f} s"}]
    setup = "import sys; sys.path.insert(0, '.'); from bench import _resnet50_case, run_bare, run_diff; m, x = _resnet50_case()\n"
    runs = 3 if repeats < 7 else 5  # one process's peak varies by tens of MB (glibc), the bare one's too
    bare_mb = peak_rss_mb(setup + "run_bare(m, x); run_bare(m, x)", runs)
    diff_mb = peak_rss_mb(setup + "run_diff(m, x)", runs)
    biggest = 8 * 64 * 112 * 112 * 4 / 2**20 * 2  # the two largest activations (conv1/bn1 outputs), MB
    rows.append({"target": "peak memory, same case", "variant": "diff - bare", "seconds": None,
                 "ratio": round((diff_mb - bare_mb) / biggest, 2), "goal": "<= 1 (x two largest activations)",
                 "detail": f"{diff_mb:.0f} MB vs {bare_mb:.0f} MB; two largest activations {biggest:.0f} MB"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--only", choices=["overhead", "help", "meta", "scaling", "kernel", "diff"], action="append")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    benches = {"overhead": bench_overhead, "help": bench_help, "meta": bench_meta, "scaling": bench_scaling,
               "kernel": bench_kernel, "diff": bench_diff}
    rows: list[dict[str, Any]] = []
    for name, fn in benches.items():
        if args.only and name not in args.only:
            continue
        rows += fn(repeats)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    print(f"{'target':42s} {'variant':22s} {'seconds':>8s} {'ratio':>7s}  goal / detail")
    for r in rows:
        seconds = "" if r["seconds"] is None else f"{r['seconds']:.3f}" if r["seconds"] >= 0.01 else f"{r['seconds']:.2e}"
        print(f"{r['target']:42s} {r['variant']:22s} {seconds:>8s} {r['ratio']:>7.2f}  {r['goal']} {r.get('detail', '')}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
