"""hookcli benchmarks: every performance goal (issues 6, 14, 15, 22, 24) with its measured ratio, through the public API.

    python benchmarks/bench.py                 # everything (about 10 minutes on 2 idle cores, + ~20 for watch)
    python benchmarks/bench.py --quick         # fewer repeats (a few minutes; watch: every=50 over 50 steps)
    python benchmarks/bench.py --only table    # table|memory|cli|scaling|gpu|help|meta|kernel|diff|watch|distributed
    python benchmarks/bench.py --json rows.json

What is measured is what users call: ``hookcli.stats``/``hookcli.shapes`` on a model instance and the
``hookcli`` command, with model construction excluded and hook setup, the run, report building and
restoring the model included. The hookcli measured is the one in this checkout (its root goes first on
``sys.path`` and ``PYTHONPATH``).

Timings: each variant alternates with its own bare ``torch.no_grad()`` forward of the same model and input
(bare, variant, bare, variant, ... after one warm-up of each); its ratio is the median over rounds of
``variant / the bare forward just before it``, so a slow spell of the machine, which hits both runs of a
round, mostly cancels. Peak memory is each variant's own process peak (``VmHWM`` of a fresh interpreter,
median of a few). Nothing here is a test: the suite never times anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# measure the hookcli of this checkout, in this process and in every subprocess
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if HERE not in sys.path:
    sys.path.insert(1, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


# --------------------------------------------------------------------------- the variants (run in-process)

def _resnet50_case(batch: int = 8) -> tuple[Any, Any]:
    import torch
    from torchvision.models import resnet50

    torch.manual_seed(0)
    return resnet50(weights=None).eval(), torch.randn(batch, 3, 224, 224)


def run_bare(model: Any, x: Any) -> None:
    """The floor: a plain forward under ``torch.no_grad()``."""
    import torch

    with torch.no_grad():
        model(x)


def run_stats(model: Any, spec: str) -> None:
    """``hookcli.stats(model, input_shapes=[spec], all_modules=True)``: what ``hookcli stats --all`` runs."""
    import hookcli

    hookcli.stats(model, input_shapes=[spec], all_modules=True)


def run_stats_no_kernel(model: Any, spec: str) -> None:
    """The same with ``HOOKCLI_NO_KERNEL=1``: what an install without a C compiler gets (read per call)."""
    from hookcli.engine.kernel import NO_KERNEL_ENV

    before = os.environ.get(NO_KERNEL_ENV)
    os.environ[NO_KERNEL_ENV] = "1"
    try:
        run_stats(model, spec)
    finally:
        if before is None:
            del os.environ[NO_KERNEL_ENV]
        else:
            os.environ[NO_KERNEL_ENV] = before


def run_shapes(model: Any, spec: str, device: str = "cpu") -> None:
    """``hookcli.shapes(model, input_shapes=[spec], device=..., all_modules=True)``: a real forward."""
    import hookcli

    hookcli.shapes(model, input_shapes=[spec], device=device, all_modules=True)


def _tensors(obj: Any) -> list[Any]:
    """Every tensor in a module's output (a tensor, or tuples/lists/dicts of them)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def run_item_hooks(model: Any, x: Any) -> None:
    """The naive way from the articles: a forward hook on every module (registered in the timed run) that
    computes the same statistics as ``stats`` with one ``.item()`` each: mean, std, min, max, norm, zero
    fraction, NaN count and Inf count of every floating-point output tensor."""
    import torch

    rows: list[tuple[float, ...]] = []
    handles = [m.register_forward_hook(item_hook(rows)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # std of one element
            model(x)
    finally:
        for h in handles:
            h.remove()


def item_hook(rows: list[tuple[float, ...]]) -> Callable[[Any, Any, Any], None]:
    """The articles' forward hook: mean, std, min, max, norm, zero fraction, NaN and Inf count of each
    floating-point output tensor, one ``.item()`` (one host synchronisation) each, appended to ``rows``."""
    import torch

    def hook(_m: Any, _i: Any, out: Any) -> None:
        for o in _tensors(out):
            if o.is_floating_point() and o.numel():
                o = o.detach()
                rows.append((o.mean().item(), o.std().item(), o.min().item(), o.max().item(), o.norm().item(),
                             (o == 0).float().mean().item(), torch.isnan(o).sum().item(),
                             torch.isinf(o).sum().item()))

    return hook


def run_torchinfo(model: Any, x: Any) -> None:
    """``torchinfo.summary(model, input_data=x, verbose=0)`` (optional: pip install torchinfo)."""
    import torchinfo

    torchinfo.summary(model, input_data=x, verbose=0)


HAVE_TORCHINFO = importlib.util.find_spec("torchinfo") is not None


# --------------------------------------------------------------------------- timing and memory

def alternate(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds per variant, running the variants in turn ``repeats`` times (after a warm-up)."""
    return alternate_ratios(fns, repeats)[0]


def alternate_ratios(fns: dict[str, Callable[[], None]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Like ``alternate`` (round-robin after a warm-up), also returning each variant's median over rounds of
    its time / the time of the first variant (the bare forward) in the same round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    first = next(iter(fns))
    return ({name: statistics.median(ts) for name, ts in times.items()},
            {name: statistics.median(t / b for t, b in zip(ts, times[first])) for name, ts in times.items()})


def paired(bare: Callable[[], None], variant: Callable[[], None], rounds: int, *, budget_s: float = 0.0,
           max_rounds: int = 60, sync: Callable[[], None] | None = None, warm: bool = False) -> dict[str, float]:
    """``variant`` against ``bare``, alternating (bare, variant, bare, variant, ...) after one warm-up of
    each (of the variant only with ``warm``: the bare forward of the same model and input already ran).

    At least ``rounds`` rounds, more for fast models until ``budget_s`` seconds are spent (at most
    ``max_rounds``). Returns the medians of both (``bare``, ``variant`` seconds) and ``ratio``: the
    median over rounds of variant / the bare forward of the same round. ``sync`` (``cuda.synchronize``)
    runs before each clock read.
    """
    sync = sync or (lambda: None)

    def timed(fn: Callable[[], None]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    if not warm:
        timed(bare)
    timed(variant)
    bares: list[float] = []
    variants: list[float] = []
    spent, began = 0.0, time.perf_counter()
    while len(bares) < max_rounds and (len(bares) < rounds or spent < budget_s):
        bares.append(timed(bare))
        variants.append(timed(variant))
        spent = time.perf_counter() - began
    return {"bare": statistics.median(bares), "variant": statistics.median(variants),
            "ratio": statistics.median(v / b for v, b in zip(variants, bares)), "rounds": len(bares)}


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
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=HERE)
    if out.returncode:
        raise RuntimeError(f"peak_rss_mb: the subprocess failed:\n{out.stderr[-2000:]}")
    kb = int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("PEAK")))
    return kb / 1024


def command_seconds(args: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(args, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(section: str, target: str, variant: str, seconds: float | None, ratio: float | None, goal: str = "",
         detail: str = "", met: bool | None = None) -> dict[str, Any]:
    """One result row. ``goal``: e.g. ``<= 1.05`` (then ``met`` is worked out from ``ratio`` unless given)."""
    if met is None and goal:
        m = re.match(r"\s*(<=|<)\s*([0-9.]+)", goal)
        if m and ratio is not None:
            met = ratio <= float(m.group(2)) if m.group(1) == "<=" else ratio < float(m.group(2))
    return {"section": section, "target": target, "variant": variant,
            "seconds": None if seconds is None else round(seconds, 6), "ratio": None if ratio is None else round(ratio, 3),
            "goal": goal, "met": met, "detail": detail}


def _mark(met: bool | None) -> str:
    return "" if met is None else "met" if met else "NOT MET"


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The generic row layout (every section but the table)."""
    for r in rows:
        s = r["seconds"]
        seconds = "" if s is None else f"{s:.3f}" if s >= 0.01 else f"{s:.2e}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        goal = f"goal {r['goal']}: {_mark(r.get('met'))}" if r.get("goal") else ""
        print(f"  {r['target']:40s} {r['variant']:24s} {seconds:>8s} {ratio:>7s}  {goal}  {r.get('detail', '')}".rstrip())
    sys.stdout.flush()


def print_goals(rows: list[dict[str, Any]]) -> None:
    """Goal rows of the table: met or not, what the goal is, what was measured."""
    for r in rows:
        simple = r["variant"] == "vs bare"
        what = f"{r['target']} {r['goal']}x" if simple else r["target"]
        measured = f"{r['ratio']:.2f}x" if simple else r["variant"]
        print(f"    {_mark(r['met']):8s} {what:66s} {measured}")
    sys.stdout.flush()


# --------------------------------------------------------------------------- 1. the table of issue 14

TABLE_VARIANTS = ("stats", "stats, no C kernel", "shapes", ".item() hooks", "torchinfo")


def bench_table(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """Each model of the table, each public call against its own bare forward, in one process."""
    import models

    budget = 1.0 if quick else 5.0  # seconds per variant: fast models get more rounds
    rows: list[dict[str, Any]] = []
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, _builder, _args in models.TABLE:
        results[name], bare_s, case_rows = _table_model(models.build(name), repeats, budget)
        rows += case_rows
        _print_table_line(name, bare_s, {v: r["ratio"] for v, r in results[name].items()})
        gc.collect()
    rows += _table_goals(results)
    return rows


def _table_model(case: Any, repeats: int,
                 budget: float) -> tuple[dict[str, dict[str, float]], float, list[dict[str, Any]]]:
    """One model of the table: each variant paired with its own bare forward."""
    model, x, spec = case.model, case.x, case.spec
    fns: dict[str, Callable[[], None]] = {
        "stats": lambda: run_stats(model, spec),
        "stats, no C kernel": lambda: run_stats_no_kernel(model, spec),
        "shapes": lambda: run_shapes(model, spec),
        ".item() hooks": lambda: run_item_hooks(model, x),
    }
    if HAVE_TORCHINFO:
        fns["torchinfo"] = lambda: run_torchinfo(model, x)
    results = {variant: paired(lambda: run_bare(model, x), fn, repeats, budget_s=budget, warm=i > 0)
               for i, (variant, fn) in enumerate(fns.items())}
    bare_s = statistics.median(r["bare"] for r in results.values())
    rows = [_row("table", case.name, "bare forward", bare_s, 1.0,
                 detail=f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, input {spec}, "
                        f"{sum(1 for _ in model.modules()) - 1} modules")]
    for variant, r in results.items():
        rows.append(_row("table", case.name, variant, r["variant"], r["ratio"],
                         detail=f"bare {r['bare']:.4f} s, {r['rounds']} rounds"))
    return results, bare_s, rows


#: Column headings of the printed table.
TABLE_HEADINGS = {"stats": "stats", "stats, no C kernel": "no kernel", "shapes": "shapes",
                  ".item() hooks": ".item() hooks", "torchinfo": "torchinfo"}


def _print_table_header() -> None:
    from hookcli import api

    cols = "".join(f"{TABLE_HEADINGS[v]:>14s}" for v in TABLE_VARIANTS)
    print("  ratios to the bare forward. stats: hookcli.stats(model, input_shapes=[...], all_modules=True);"
          " no kernel: the same with HOOKCLI_NO_KERNEL=1;\n  shapes: hookcli.shapes(..., device='cpu',"
          " all_modules=True); .item() hooks: a forward hook on every module, 8 statistics with .item() each;\n"
          "  torchinfo: torchinfo.summary(model, input_data=x, verbose=0)" + ("" if HAVE_TORCHINFO else " (not installed)"))
    if api.kernel_status() != "built":
        print(f"  note: the C kernel is {api.kernel_status()}: the stats and no kernel columns both take torch reductions")
    print(f"  {'model':28s} {'bare s':>8s}{cols}")
    sys.stdout.flush()


def _print_table_line(name: str, bare_s: float, ratios: dict[str, float]) -> None:
    cols = "".join(f"{(f'{ratios[v]:.2f}x' if v in ratios else 'n/a'):>14s}" for v in TABLE_VARIANTS)
    print(f"  {name:28s} {bare_s:8.4f}{cols}")
    sys.stdout.flush()


def _table_goals(results: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """The goals of issue 14 that the table measures, each with its measurement."""
    rows = []

    def ratio(model: str, variant: str) -> float | None:
        r = results.get(model, {}).get(variant)
        return None if r is None else r["ratio"]

    resnet, mobile = "resnet50 b8 224", "mobilenet_v3_small b1"
    for model, variant, goal in ((resnet, "stats", "<= 1.05"), (resnet, "stats, no C kernel", "<= 1.15"),
                                 (mobile, "stats", "<= 1.5"), (mobile, "stats, no C kernel", "<= 1.5"),
                                 (mobile, "shapes", "<= 1.4")):
        if ratio(model, variant) is not None:
            rows.append(_row("table goals", f"{model}: {variant}", "vs bare", None, ratio(model, variant), goal))
    for model in results:
        for ours, peer in (("stats", ".item() hooks"), ("stats, no C kernel", ".item() hooks"), ("shapes", "torchinfo")):
            a, b = ratio(model, ours), ratio(model, peer)
            if a is None or b is None:
                continue
            rows.append(_row("table goals", f"{model}: {ours} faster than {peer}", f"{a:.2f}x vs {b:.2f}x",
                             None, a / b, "< 1 (ours / peer)", met=a < b))
    return rows


# --------------------------------------------------------------------------- 2. peak memory

def bench_memory(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """Peak memory of ``stats`` vs the bare forward on every model of the table: fresh processes, each
    building the model and running twice (bare, stats, bare, stats, ...), median of a few."""
    import models

    runs = 2 if quick else 5
    rows = []
    for name, _builder, _args in models.TABLE:
        setup = f"import models, bench; c = models.build({name!r})\n"
        bare: list[float] = []
        hooked: list[float] = []
        for _ in range(runs):
            bare.append(peak_rss_mb(setup + "bench.run_bare(c.model, c.x); bench.run_bare(c.model, c.x)"))
            hooked.append(peak_rss_mb(setup + "bench.run_stats(c.model, c.spec); bench.run_stats(c.model, c.spec)"))
        b, h = statistics.median(bare), statistics.median(hooked)
        rows.append(_row("memory", f"peak memory, {name}", "stats / bare", None, h / b, "<= 1.10",
                         f"{h:.0f} MB vs {b:.0f} MB (median of {runs} processes each)"))
        print_rows(rows[-1:])
    return rows


# --------------------------------------------------------------------------- 3. the command, end to end

def hookcli_command() -> tuple[list[str], str]:
    """How to run the ``hookcli`` command: the installed entry-point script beside this interpreter (not a
    pyenv shim, which adds its own start-up), else ``python -m hookcli``."""
    script = os.path.join(os.path.dirname(sys.executable), "hookcli")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script], "hookcli (entry point)"
    return [sys.executable, "-m", "hookcli"], "python -m hookcli"


def bench_cli(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """``hookcli shapes resnet50`` end to end against building the model in a bare interpreter."""
    command, label = hookcli_command()
    reference = [sys.executable, "-c", "import torch, torchvision; torchvision.models.resnet50()"]

    def run(args: list[str]) -> Callable[[], None]:
        return lambda: subprocess.run(args, capture_output=True, check=True, cwd=HERE)

    r = paired(run(reference), run(command + ["shapes", "resnet50"]), repeats)
    row = _row("cli", "hookcli shapes resnet50, end to end", "vs import+build", r["variant"], r["ratio"], "<= 1.3",
               f"{label}; reference {r['bare']:.2f} s: python -c 'import torch, torchvision; "
               f"torchvision.models.resnet50()'; {r['rounds']} rounds")
    print_rows([row])
    return [row]


# --------------------------------------------------------------------------- 4. setup is O(modules)

def _chain_model(n_modules: int) -> Any:
    from torch import nn

    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(n_modules // 3)])


def bench_scaling(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """``hookcli.stats(..., all_modules=True)`` on 1,000 and 10,000 small modules: time per module."""
    models = {n: _chain_model(n) for n in (1_000, 10_000)}
    counts = {n: sum(1 for _ in m.modules()) - 1 for n, m in models.items()}
    # alternating the two sizes: a slow spell of the machine then hits both, not one
    seconds, ratios = alternate_ratios({str(n): (lambda m=m: run_stats(m, "4x32")) for n, m in models.items()},
                                       2 * repeats)
    per_module = {n: seconds[str(n)] / counts[n] for n in models}
    row = _row("scaling", "time per module, 10k vs 1k modules", "hookcli.stats all", None,
               ratios["10000"] * counts[1_000] / counts[10_000], "<= 1.5",
               f"{per_module[1_000] * 1e6:.0f} vs {per_module[10_000] * 1e6:.0f} us/module "
               f"({seconds['1000']:.3f} s, {seconds['10000']:.3f} s per call)")
    print_rows([row])
    return [row]


# --------------------------------------------------------------------------- 5. GPUs

def gpu_cases(quick: bool = False) -> list[tuple[str, Callable[[], Any]]]:
    """resnet50 at batch 32, and a ~1.1B-parameter GPT-2-style decoder in bfloat16 (built on demand)."""
    import torch

    import models

    def decoder() -> Any:
        case = models.gpt_case(models.GPT_1B, batch=1, seq=1024, name="gpt2-style 1.1B bf16 b1 s1024")
        case.model.to(torch.bfloat16)
        return case

    return [("resnet50 b32 224", lambda: models.torchvision_case("resnet50", 32)),
            ("gpt2-style 1.1B bf16 b1 s1024", decoder)]


#: The GPU floor's goals (stats against the bare forward) by case; peak device memory: ``GPU_PEAK_GOAL``.
GPU_STATS_GOALS = {"resnet50 b32 224": "<= 1.3", "gpt2-style 1.1B bf16 b1 s1024": "<= 1.15"}
GPU_PEAK_GOAL = "<= 1.05"


def bench_gpu(repeats: int, quick: bool = False, device: str = "cuda",
              cases: list[tuple[str, Callable[[], Any]]] | None = None) -> list[dict[str, Any]]:
    """Each GPU case against a bare forward on the device (``torch.cuda.synchronize()`` around every
    timing), and the peak device memory of ``stats`` against the bare forward's."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("  skipped: no CUDA")
        return [_row("gpu", "GPU rows", "", None, None, detail="skipped: no CUDA")]
    on_cuda = device.startswith("cuda")
    rows: list[dict[str, Any]] = []
    for name, build in cases or gpu_cases(quick):
        case_rows = _gpu_model(name, build(), repeats, quick, device)
        print_rows(case_rows)
        rows += case_rows
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
    return rows


def _gpu_model(name: str, case: Any, repeats: int, quick: bool, device: str) -> list[dict[str, Any]]:
    """One GPU case: each variant paired with its own bare forward; peak device memory of stats vs bare."""
    import torch

    on_cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else None
    model, x, spec = case.model.to(device), case.x.to(device), case.spec
    fns: dict[str, Callable[[], None]] = {
        "stats": lambda: run_stats(model, spec),
        "shapes": lambda: run_shapes(model, spec, device),
        ".item() hooks": lambda: run_item_hooks(model, x),
    }
    if HAVE_TORCHINFO:
        fns["torchinfo"] = lambda: run_torchinfo(model, x)
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    label = f"{name} ({torch.cuda.get_device_name() if on_cuda else device})"
    for variant, fn in fns.items():
        r = paired(lambda: run_bare(model, x), fn, repeats, budget_s=2.0 if quick else 5.0, sync=sync, warm=bool(ratios))
        ratios[variant] = r["ratio"]
        rows.append(_row("gpu", label, variant, r["variant"], r["ratio"],
                         GPU_STATS_GOALS.get(name, "") if variant == "stats" else "",
                         detail=f"bare {r['bare']:.4f} s, {r['rounds']} rounds"))
    for ours, peer in (("stats", ".item() hooks"), ("shapes", "torchinfo")):
        if peer in ratios:
            rows.append(_row("gpu", f"{name}: {ours} faster than {peer}", f"{ratios[ours]:.2f}x vs {ratios[peer]:.2f}x",
                             None, ratios[ours] / ratios[peer], "< 1 (ours / peer)", met=ratios[ours] < ratios[peer]))
    if on_cuda:
        peaks = {}
        for variant, fn in (("bare", lambda: run_bare(model, x)), ("stats", fns["stats"])):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peaks[variant] = torch.cuda.max_memory_allocated() / 2**20
        rows.append(_row("gpu", f"{name}: peak device memory", "stats / bare", None, peaks["stats"] / peaks["bare"],
                         GPU_PEAK_GOAL, f"{peaks['stats']:.0f} MB vs {peaks['bare']:.0f} MB (max_memory_allocated)"))
    return rows


# --------------------------------------------------------------------------- 6. the rows kept from issue 6

def bench_help(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """``hookcli --help`` / ``--version`` against ``python -c "import torch"`` (help must not import torch)."""
    command, label = hookcli_command()
    torch_s = command_seconds([sys.executable, "-c", "import torch"], repeats)
    rows = []
    for flag in ("--help", "--version"):
        s = command_seconds(command + [flag], repeats)
        rows.append(_row("help", f"hookcli {flag} vs import torch", label, s, s / torch_s, "<= 0.2"))
    print_rows(rows)
    return rows


#: About 7B parameters, shared with tests/test_scale.py (which checks its weights are never allocated).
BIG_MODEL = os.path.join(ROOT, "tests", "big_model.py")


def bench_meta(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """``hookcli.shapes(spec)`` of big models on the meta device: time vs importing torch+torchvision; peak."""
    imports_s = command_seconds([sys.executable, "-c", "import torch, torchvision"], repeats)
    rows = []
    for spec in ("vit_h_14", f"{BIG_MODEL}:Big"):
        code = f"import hookcli; r = hookcli.shapes({spec!r}); print('PARAMS', r.model.params, r.device)"
        start = time.perf_counter()
        mb = peak_rss_mb(code)
        seconds = time.perf_counter() - start
        rows.append(_row("meta", "shapes on meta", os.path.basename(spec), seconds, seconds / imports_s,
                         "<= 2.0", f"time vs import torch, torchvision ({imports_s:.2f} s); peak {mb:.0f} MB "
                                   f"(goal < 1500 MB: {_mark(mb < 1500)})", met=seconds / imports_s <= 2.0 and mb < 1500))
    if importlib.util.find_spec("transformers") is not None:
        rows += [hf_meta_row(model_type) for model_type in HF_META_TYPES]
    print_rows(rows)
    return rows


#: Mixture-of-experts and vision-language model types whose DEFAULT configs (up to 671B parameters)
#: ``shapes`` runs on the meta device: the goal is seconds, on meta (not a real build that cannot fit).
HF_META_TYPES = ("qwen3_moe", "deepseek_v3", "mixtral", "olmoe", "llava", "paligemma", "qwen2_vl")


def hf_meta_row(model_type: str) -> dict[str, Any]:
    """``hookcli.shapes("hf:TYPE")`` at the type's default config in a fresh interpreter: seconds, device, params."""
    code = (f"import hookcli; r = hookcli.shapes('hf:{model_type}'); "
            "print('RESULT', r.device, r.model.params)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    found = re.search(r"RESULT (\S+) (\d+)", done.stdout)
    device, params = (found.group(1), int(found.group(2))) if found else ("failed", 0)
    return _row("meta", "shapes on meta, default config", f"hf:{model_type}", seconds, None, "<= 60 s on meta",
                f"{device}, {params / 1e9:.3g}B params", met=device == "meta" and seconds <= 60)


def bench_kernel(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """Does the C kernel earn its place? ``hookcli.stats(..., all_modules=True)`` through the public
    API with the kernel and with ``HOOKCLI_NO_KERNEL=1``, alternating with a bare forward (bare, kernel,
    no kernel, bare, ...), on resnet50 at batch 8 (float32 and bfloat16) and on two small models at
    batch 1. Then the kernel and the torch reductions on one activation, and the per-call cost on a
    small one (``Reducer``: the kernel itself, below the API).
    """
    import torch

    import models
    from hookcli.engine.stats import Reducer

    rows: list[dict[str, Any]] = []
    cases = [("resnet50", 8, None), ("resnet50", 8, torch.bfloat16), ("resnet18", 1, None),
             ("mobilenet_v3_small", 1, None)]
    for arch, batch, dtype in cases:
        case = models.torchvision_case(arch, batch)
        model, x, spec = case.model, case.x, case.spec
        if dtype is not None:
            model, x, spec = model.to(dtype), x.to(dtype), f"{spec}:{str(dtype).removeprefix('torch.')}"
        times, ratios = alternate_ratios({"bare": lambda model=model, x=x: run_bare(model, x),
                                          "kernel": lambda model=model, spec=spec: run_stats(model, spec),
                                          "torch": lambda model=model, spec=spec: run_stats_no_kernel(model, spec)},
                                         repeats)
        target = f"kernel: stats API, {arch} b{batch}" + (f" {str(dtype)[6:]}" if dtype else "")
        for variant, key in (("bare forward", "bare"), ("with the C kernel", "kernel"),
                             ("HOOKCLI_NO_KERNEL=1", "torch")):
            rows.append(_row("kernel", target, variant, times[key], ratios[key],
                             detail="" if key == "bare" else f"vs kernel {ratios[key] / ratios['kernel']:.2f}x"))
        print_rows(rows[-3:])

    from hookcli.engine import kernel

    if kernel.load() is None:
        rows.append(_row("kernel", "kernel: one reduction", "", None, None, detail="skipped: the C kernel is not built"))
        print_rows(rows[-1:])
        return rows
    # one activation of resnet50 at batch 8 (layer1's ReLU: 8x256x56x56 float32, 25.7 MB), and a small one
    for label, t in (("one 25.7 MB activation", torch.randn(8, 256, 56, 56).relu()),
                     ("one 4 KB activation", torch.randn(1000).relu())):
        fns = {"kernel": lambda t=t: Reducer(kernel=True).reduce(t),
               "torch": lambda t=t: Reducer(kernel=False).reduce(t)}
        inner = 20 if t.numel() > 10_000 else 2000
        per = alternate({k: (lambda fn=fn, inner=inner: [fn() for _ in range(inner)]) for k, fn in fns.items()}, repeats)
        for variant, key in (("C kernel", "kernel"), ("torch reductions", "torch")):
            rows.append(_row("kernel", f"kernel: {label}", variant, per[key] / inner, per[key] / per["kernel"],
                             detail=f"{per[key] / inner * 1e6:.1f} us per reduce"))
        print_rows(rows[-2:])
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



def bench_check_steps(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """Issue 23: ``hookcli.check(model, steps=30)`` (the one-step check, a 3 x 5-step lr sweep, 30 steps)
    on resnet18 at 2x3x64x64 and on a tiny GPT-2; goal <= 60 s each on the 2-core machine."""
    import hookcli

    def resnet() -> Any:
        from torchvision.models import resnet18

        return resnet18(weights=None), {"input_shapes": ["2x3x64x64"]}

    def gpt2() -> Any:
        import transformers

        config = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                                         eos_token_id=0)
        return transformers.GPT2LMHeadModel(config), {"seq_len": 64}

    rows = []
    for name, case in (("resnet18 2x3x64x64", resnet), ("tiny GPT-2 (2 layers, 64 wide, 64 tokens)", gpt2)):
        model, options = case()
        times = []
        for _ in range(1 if quick else max(1, min(repeats, 3))):
            start = time.perf_counter()
            result = hookcli.check(model, steps=30, **options)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append(_row("check_steps", f"check --steps 30, {name}, CPU", "hookcli.check(steps=30)", seconds,
                         seconds, goal="<= 60", detail="passed" if result.ok else f"FAILED: {result.headline()}"))
    return rows


# --------------------------------------------------------------------------- 11. watch (issue 22)

class Trainee:
    """A GPT-style model with its own AdamW and one fixed batch of token ids; ``step()`` is one plain
    training step: forward, cross-entropy, backward, ``optimizer.step()``, ``zero_grad()``."""

    def __init__(self, config: Any, batch: int, seq: int, seed: int = 0, device: str = "cpu") -> None:
        import torch

        import models

        torch.manual_seed(seed)
        self.model = models.GPT(config).train().to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, config.vocab, (batch, seq + 1)).to(device)
        #: on a GPU, every step ends with ``torch.cuda.synchronize()`` so that its time is the device's
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else None

    def step(self) -> Any:
        """One training step; the loss (detached)."""
        import torch.nn.functional as F

        logits = self.model(self.tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), self.tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.sync is not None:
            self.sync()
        return loss.detach()


class Steps(NamedTuple):
    """Seconds of each round's bare step and variant step: wall clock, and this process's CPU time."""

    bare: list[float]
    variant: list[float]
    bare_cpu: list[float]
    variant_cpu: list[float]

    def tail(self, start: int) -> Steps:
        return Steps(*(times[start:] for times in self))


def alternate_steps(bare: Callable[[], Any], variant: Callable[[int], Any], rounds: int) -> Steps:
    """``rounds`` rounds of (a bare step, a variant step), each timed; ``variant`` gets the round's index.

    CPU time (``time.process_time``) is kept too: with ``--threads 1`` on a loaded machine it leaves
    out the time spent waiting for a core, which wall-clock ratios of a few percent drown in."""
    steps = Steps([], [], [], [])
    for i in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        bare()
        middle, middle_cpu = time.perf_counter(), time.process_time()
        variant(i)
        steps.bare.append(middle - start)
        steps.variant.append(time.perf_counter() - middle)
        steps.bare_cpu.append(middle_cpu - start_cpu)
        steps.variant_cpu.append(time.process_time() - middle_cpu)
    return steps


def watch_peak_run(watch: bool, config: Any, batch: int, seq: int, steps: int) -> None:
    """What a peak-memory process of the watch rows runs: ``steps`` training steps, bare or under
    ``hookcli.watch(every=1)``. Both import hookcli, so the two peaks differ by what the steps hold."""
    import tempfile

    import hookcli

    trainee = Trainee(config, batch, seq)
    if not watch:
        for _ in range(steps):
            trainee.step()
        return
    with tempfile.TemporaryDirectory() as tmp:
        with hookcli.watch(trainee.model, trainee.optimizer, every=1, out=os.path.join(tmp, "log.jsonl")) as w:
            for _ in range(steps):
                w.step(loss=trainee.step())


def bench_watch(repeats: int, quick: bool = False, *, config: Any = None, batch: int = 8, seq: int = 128,
                every: int = 50, steps: int | None = None, memory_runs: int | None = None,
                memory_steps: int = 3) -> list[dict[str, Any]]:
    """Issue 22: ``hookcli.watch`` over a GPT-style training step with AdamW, against the same bare step.

    Two twin models (same seed, same batch, each with its own AdamW) train side by side: every round is
    a bare step of one, then a step of the other under the variant, so both see the same machine and
    stay identical (the watch changes no number). Rows: a logged step (``every=1``), one with the transformer
    signals off (their three rules off), and an unlogged one
    (``every`` huge, its logged step 0 left out), medians over rounds of variant / bare; ``every`` over
    ``steps`` (default 4 x every, ``--quick``: 1 x every, the same share of logged steps), total time
    over total bare time; peers: the articles' ``.item()`` forward hooks on every leaf module at every
    step, and ``wandb.watch(model, log="all", log_freq=every)`` offline over ``steps``; peak memory:
    ``VmHWM`` of fresh processes running ``memory_steps`` steps bare or under ``every=1``.
    """
    import tempfile

    import hookcli
    import models
    from hookcli.commands.watch_transformer_rules import TRANSFORMER_SPECS

    config = config or models.WATCH_GPT
    steps = steps or (every if quick else 4 * every)
    memory_runs = memory_runs or (1 if quick else 3)
    twin, bare = Trainee(config, batch, seq), Trainee(config, batch, seq)
    params = sum(p.numel() for p in bare.model.parameters())
    label = f"gpt-style {config.layers}L w{config.width} b{batch} s{seq}"
    rows: list[dict[str, Any]] = []
    bare_times: list[float] = []

    def per_step(variant: str, steps: Steps, goal: str = "", note: str = "") -> None:
        bare_times.extend(steps.bare)
        rows.append(_row("watch", label, variant, statistics.median(steps.variant),
                         _median_ratio(steps.variant, steps.bare), goal,
                         f"{note}bare {statistics.median(steps.bare):.3f} s, {len(steps.bare)} rounds; "
                         f"CPU time {_median_ratio(steps.variant_cpu, steps.bare_cpu):.3f}x"))
        print_rows(rows[-1:])

    def total(variant: str, steps: Steps, goal: str = "", note: str = "") -> None:
        bare_times.extend(steps.bare)
        rows.append(_row("watch", label, variant, sum(steps.variant), sum(steps.variant) / sum(steps.bare), goal,
                         f"{note}{_totals(steps)}"))
        print_rows(rows[-1:])

    with tempfile.TemporaryDirectory(prefix="hookcli-bench-watch-") as tmp:
        alternate_steps(bare.step, lambda i: twin.step(), 1)  # warm-up
        # the rules that read the attention heads and output logits, all off: the signals are not measured
        off = {spec.name: False for spec in TRANSFORMER_SPECS}
        for every_n, variant, goal, rules in ((1, "logged step (every=1)", "<= 1.35", None),
                                              (1, "logged step, transformer signals off", "<= 1.25", off),
                                              (10**9, "unlogged step", "<= 1.02", None)):
            log = os.path.join(tmp, f"every{every_n}{'off' if rules else ''}.jsonl")
            with hookcli.watch(twin.model, twin.optimizer, every=every_n, out=log, rules=rules) as w:
                timed = alternate_steps(bare.step, lambda i, w=w: w.step(loss=twin.step()), 1 + repeats)
            per_step(variant, timed.tail(1), goal, "first round left out (step 0); ")
        with hookcli.watch(twin.model, twin.optimizer, every=every, out=os.path.join(tmp, "every.jsonl")) as w:
            timed = alternate_steps(bare.step, lambda i: w.step(loss=twin.step()), steps)
        total(f"every={every} over {steps} steps", timed, "<= 1.02", f"{len(range(0, steps, every))} logged; ")

        item_rows: list[tuple[float, ...]] = []
        leaves = [m for m in twin.model.modules() if next(m.children(), None) is None]
        handles = [m.register_forward_hook(item_hook(item_rows)) for m in leaves]
        try:
            timed = alternate_steps(bare.step, lambda i: (item_rows.clear(), twin.step()), 1 + repeats)
        finally:
            for h in handles:
                h.remove()
        per_step("peer: .item() hooks", timed.tail(1), note=f"every step, {len(leaves)} leaf modules, 8 .item() "
                                                            "per output; ")
        rows.extend(_wandb_rows(label, bare, twin, every, steps, tmp, bare_times))

    rows.insert(0, _row("watch", label, "bare step", statistics.median(bare_times), 1.0,
                        detail=f"{params / 1e6:.1f}M params, vocab {config.vocab}, AdamW; "
                               f"torch threads {_threads()}"))
    print_rows(rows[:1])

    code = (f"from models import GPTConfig; import bench; bench.watch_peak_run({{watch}}, {config!r}, {batch}, {seq}, "
            f"{memory_steps})")
    bare_mb = peak_rss_mb(code.format(watch=False), memory_runs)
    watch_mb = peak_rss_mb(code.format(watch=True), memory_runs)
    rows.append(_row("watch", f"peak memory, {label}", "every=1 / bare", None, watch_mb / bare_mb, "<= 1.05",
                     f"{watch_mb:.0f} MB vs {bare_mb:.0f} MB (VmHWM, {memory_steps} steps, median of "
                     f"{memory_runs} processes each)"))
    print_rows(rows[-1:])
    return rows


def bench_watch_gpu(repeats: int, quick: bool = False) -> list[dict[str, Any]]:
    """Issue 22's watch rows on a CUDA GPU: the logged (``every=1``) and unlogged step of a GPT-style
    model with AdamW against its twin's bare step (``torch.cuda.synchronize()`` ends every step), the
    articles' ``.item()`` hooks as the peer, and the peak device memory of a watched step against a
    bare one (``torch.cuda.max_memory_allocated``). Two sizes: the CPU rows' model, and one 8x wider
    in compute (width 1024, 8 layers, b16 s256) where the GPU is busy rather than waiting on launches."""
    import torch

    import models

    if not torch.cuda.is_available():
        row = _row("watch_gpu", "watch on CUDA", "skipped", None, None, detail="no CUDA GPU here")
        print_rows([row])
        return [row]
    rows: list[dict[str, Any]] = []
    sizes = ((models.WATCH_GPT, 8, 128),
             (models.GPTConfig(vocab=8192, width=1024, heads=16, layers=8, max_len=256), 16, 256))
    rounds = 1 + (10 if quick else 30)
    for (config, batch, seq), logged_goal in zip(sizes, ("<= 1.5", "<= 1.10")):
        rows += _watch_gpu_rows(config, batch, seq, rounds, logged_goal)
        torch.cuda.empty_cache()
    return rows


def _watch_gpu_rows(config: Any, batch: int, seq: int, rounds: int, logged_goal: str) -> list[dict[str, Any]]:
    """``bench_watch_gpu``'s rows of one model size: its own twins, each row over ``rounds`` rounds; a logged
    step's goal is ``logged_goal`` (the small launch-bound model's is looser), an unlogged one's 1.01x."""
    import tempfile

    import torch

    import hookcli

    rows: list[dict[str, Any]] = []
    twin, bare = (Trainee(config, batch, seq, device="cuda") for _ in range(2))
    label = f"gpt-style {config.layers}L w{config.width} b{batch} s{seq} ({torch.cuda.get_device_name()})"
    bare_times: list[float] = []
    alternate_steps(bare.step, lambda i: twin.step(), 3)  # warm-up: kernels, allocator, AdamW state
    with tempfile.TemporaryDirectory(prefix="hookcli-bench-watch-gpu-") as tmp:
        for every, variant, goal in ((1, "logged step (every=1)", logged_goal), (10**9, "unlogged step", "<= 1.01")):
            with hookcli.watch(twin.model, twin.optimizer, every=every, out=os.path.join(tmp, f"{every}.jsonl")) as w:
                timed = alternate_steps(bare.step, lambda i, w=w: w.step(loss=twin.step()), rounds).tail(1)
            bare_times.extend(timed.bare)
            rows.append(_row("watch_gpu", label, variant, statistics.median(timed.variant),
                             _median_ratio(timed.variant, timed.bare), goal,
                             f"bare {statistics.median(timed.bare) * 1e3:.2f} ms, {len(timed.bare)} rounds"))
            print_rows(rows[-1:])
        item_rows: list[tuple[float, ...]] = []
        leaves = [m for m in twin.model.modules() if next(m.children(), None) is None]
        handles = [m.register_forward_hook(item_hook(item_rows)) for m in leaves]
        try:
            timed = alternate_steps(bare.step, lambda i: (item_rows.clear(), twin.step()), rounds).tail(1)
        finally:
            for h in handles:
                h.remove()
        peer = _median_ratio(timed.variant, timed.bare)
        rows.append(_row("watch_gpu", label, "peer: .item() hooks", statistics.median(timed.variant), peer,
                         detail=f"{len(leaves)} leaf modules"))
        logged = next(r["ratio"] for r in rows if r["variant"] == "logged step (every=1)")
        rows.append(_row("watch_gpu", f"{label}: logged step faster than .item() hooks",
                         f"{logged:.2f}x vs {peer:.2f}x", None, logged / peer, "< 1 (ours / peer)", met=logged < peer))
        print_rows(rows[-2:])
        peaks = {}
        for variant in ("bare", "watched"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if variant == "bare":
                bare.step()
            else:
                with hookcli.watch(twin.model, twin.optimizer, every=1, out=os.path.join(tmp, "peak.jsonl")) as w:
                    w.step(loss=twin.step())
            peaks[variant] = torch.cuda.max_memory_allocated() / 2**20
        rows.append(_row("watch_gpu", f"peak device memory, {label}", "every=1 / bare", None,
                         peaks["watched"] / peaks["bare"], GPU_PEAK_GOAL,
                         f"{peaks['watched']:.0f} MiB vs {peaks['bare']:.0f} MiB (max_memory_allocated, one step)"))
        print_rows(rows[-1:])
    rows.insert(0, _row("watch_gpu", label, "bare step", statistics.median(bare_times), 1.0))
    return rows


def _median_ratio(variants: list[float], bares: list[float]) -> float:
    return statistics.median(v / b for v, b in zip(variants, bares))


def _totals(steps: Steps) -> str:
    """The detail of a total-time row: the bare total, the median step ratio, the CPU-time ratio."""
    return (f"total / total bare {sum(steps.bare):.2f} s over {len(steps.bare)} steps; median step ratio "
            f"{_median_ratio(steps.variant, steps.bare):.3f}; CPU time {sum(steps.variant_cpu) / sum(steps.bare_cpu):.3f}x")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _wandb_rows(label: str, bare: Trainee, twin: Trainee, every: int, steps: int, tmp: str,
                bare_times: list[float]) -> list[dict[str, Any]]:
    """The peer: ``wandb.watch(model, log="all", log_freq=every)`` in offline mode over ``steps`` steps,
    the loss logged at the steps hookcli logs (optional: pip install wandb, the ``bench`` extra)."""
    variant = f"peer: wandb.watch all, log_freq={every}"
    if importlib.util.find_spec("wandb") is None:
        row = _row("watch", label, variant, None, None, detail="skipped: wandb not installed (pip install .[bench])")
        print_rows([row])
        return [row]
    import wandb

    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    try:
        run = wandb.init(mode="offline", dir=tmp, project="hookcli-bench", settings=wandb.Settings(console="off"))
        try:
            wandb.watch(twin.model, log="all", log_freq=every)

            def step(i: int) -> None:
                loss = twin.step()
                if i % every == 0:
                    run.log({"loss": loss.item()})

            timed = alternate_steps(bare.step, step, steps)
            wandb.unwatch(twin.model)
        finally:
            run.finish()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    bare_times.extend(timed.bare)
    row = _row("watch", label, variant, sum(timed.variant), sum(timed.variant) / sum(timed.bare),
               detail=f"offline, wandb {wandb.__version__}, the loss logged every {every}; {_totals(timed)}")
    print_rows([row])
    return [row]


# --------------------------------------------------------------------------- 13. distributed (issue 24)

def bench_distributed(repeats: int, quick: bool = False, *, device: str = "cpu", world: int = 2,
                      config: Any = None, batch: int = 4, seq: int = 128, every: int = 50,
                      steps: int | None = None, threads: int | None = None) -> list[dict[str, Any]]:
    """Issue 24: ``hookcli.watch`` on a DDP model under torchrun (``world`` ranks, started here), against
    the same bare DDP step: the watch rows' model and twins (``bench_distributed.py``, which rank 0's rows
    come from), each rank its own ``batch``. Rows: a logged step (``every=1``) and an unlogged one,
    medians over rounds of variant / bare; ``every`` over ``steps`` (default 4 x every, ``--quick``:
    1 x every), total over total bare; the collectives hookcli adds to a logged and an unlogged step
    (count and bytes: the step's ``c10d`` calls less those of a bare DDP step). ``device="cuda"``: NCCL
    when there are ``world`` GPUs, else gloo with every rank on ``cuda:0``."""
    import tempfile

    steps = steps or (every if quick else 4 * every)
    threads = threads or (max(1, _threads() // world) if device == "cpu" else 1)
    with tempfile.TemporaryDirectory(prefix="hookcli-bench-distributed-") as tmp:
        out = os.path.join(tmp, "rows.json")
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                os.path.join(HERE, "bench_distributed.py"), out, "--repeats", str(repeats), "--every", str(every),
                "--steps", str(steps), "--device", device, "--threads", str(threads), "--batch", str(batch),
                "--seq", str(seq)]
        if config is not None:
            args += ["--config", json.dumps(dataclasses.asdict(config))]
        done = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if done.returncode:
            raise RuntimeError(f"bench_distributed.py under torchrun failed:\n{done.stderr[-4000:]}")
        with open(out) as fh:
            rows = json.load(fh)
    print_rows(rows)
    return rows


# --------------------------------------------------------------------------- main

def machine_line() -> str:
    """Where the numbers come from: CPU, cores, memory, versions, the hookcli measured, load average."""
    import torch
    import torchvision

    import hookcli
    from hookcli import api

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as fh:
            mem = f", {int(next(line.split()[1] for line in fh if line.startswith('MemTotal'))) / 2**20:.0f} GB"
    except (OSError, StopIteration, ValueError):
        mem = ""
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return (f"machine: {cpu}, {os.cpu_count()} cores{mem}{gpu}; torch threads {torch.get_num_threads()}\n"
            f"versions: Python {platform.python_version()}, torch {torch.__version__}, torchvision "
            f"{torchvision.__version__}, torchinfo {_torchinfo_version()}, hookcli {hookcli.__version__} from "
            f"{os.path.dirname(hookcli.__file__)} (C kernel: {api.kernel_status()})\n"
            f"load average at start: {_load()}")


def _torchinfo_version() -> str:
    if not HAVE_TORCHINFO:
        return "not installed (its column is skipped)"
    import torchinfo

    return getattr(torchinfo, "__version__", "installed")


def _load() -> str:
    try:
        return ", ".join(f"{v:.2f}" for v in os.getloadavg()) + " (1, 5, 15 min)"
    except OSError:
        return "unknown"


SECTIONS: dict[str, tuple[str, Callable[..., list[dict[str, Any]]]]] = {
    "table": ("1. through the public API, each ratio against its own bare torch.no_grad() forward", bench_table),
    "memory": ("2. peak memory (VmHWM of fresh processes) of hookcli.stats vs the bare forward", bench_memory),
    "cli": ("3. the command end to end, vs importing torch+torchvision and building resnet50", bench_cli),
    "scaling": ("4. setup is O(modules): hookcli.stats on 1,000 vs 10,000 modules", bench_scaling),
    "gpu": ("5. GPU rows (torch.cuda.synchronize() around every timing)", bench_gpu),
    "help": ("6. start-up of the command without torch", bench_help),
    "meta": ("7. shapes of big models on the meta device", bench_meta),
    "kernel": ("8. the optional C kernel, through the API and per reduction", bench_kernel),
    "diff": ("9. hookcli diff (issue 15)", lambda repeats, quick=False: bench_diff(repeats)),
    "check_steps": ("10. hookcli check --steps 30 (issue 23), seconds", bench_check_steps),
    "watch": ("11. hookcli.watch over a GPT-style training step with AdamW (issue 22), vs the same bare step",
              bench_watch),
    "watch_gpu": ("12. hookcli.watch on a CUDA GPU, vs the same bare step (torch.cuda.synchronize() ends each step)",
                  bench_watch_gpu),
    "distributed": ("13. hookcli.watch on DDP under torchrun, 2 ranks (issue 24), vs the same bare DDP step",
                    bench_distributed),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a few minutes on 2 cores)")
    parser.add_argument("--only", choices=list(SECTIONS), action="append", help="run only this part (repeatable)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads in this process (default: every core)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the distributed section's ranks run (cuda: NCCL on 2+ GPUs, else gloo on one)")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    import torch

    torch.set_num_threads(max(1, args.threads))
    machine = machine_line()
    print(machine)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 0.5 * (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores: other processes are running. torch's "
              "OpenMP threads then wait for each other\n  at every parallel region, which slows small ops many "
              "times over (seen: 10x per module on 2 busy cores);\n  ratios of this run are indicative only, "
              "--threads 1 makes them steadier (at one core's speed)")
    print(f"mode: {'--quick' if args.quick else 'full'} ({repeats} rounds at least per ratio, medians)")
    sys.stdout.flush()
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for name, (title, fn) in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        print(f"\n{title}")
        if name == "table":
            _print_table_header()
        options = {"device": args.device} if name == "distributed" else {}
        section_rows = [_normalised(name, r) for r in fn(repeats, quick=args.quick, **options)]
        if name == "table":
            print("  goals:")
            print_goals([r for r in section_rows if r["section"] == "table goals"])
        elif name == "diff":
            print_rows(section_rows)
        rows += section_rows
    goals = [r for r in rows if r.get("goal") and r.get("met") is not None]
    met = sum(1 for r in goals if r["met"])
    print(f"\ngoals: {met} of {len(goals)} met" + (":" if len(goals) > met else ""))
    for r in goals:
        if not r["met"]:
            measured = "" if r["ratio"] is None else f": {r['ratio']:.2f}"
            print(f"  NOT MET  {r['target']} ({r['variant']}){measured}, goal {r['goal']}")
    print(f"load average at end: {_load()}; {time.perf_counter() - started:.0f} s in all")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([_row("machine", "machine", "--quick" if args.quick else "full", None, None,
                            detail=machine + f"; load average at end: {_load()}")] + rows, fh, indent=2)


def _normalised(section: str, r: dict[str, Any]) -> dict[str, Any]:
    """A row from any section (``bench_diff`` writes its own) in the layout of ``_row``."""
    if "section" in r and "met" in r:
        return r
    return _row(section, r["target"], r["variant"], r.get("seconds"), r.get("ratio"), r.get("goal", ""),
                r.get("detail", ""), r.get("met"))


if __name__ == "__main__":
    main()
