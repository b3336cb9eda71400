"""Smoke test of benchmarks/bench.py's watch section (issue 22) at a tiny size: it runs through the public
API and writes every row. Correctness only: nothing is timed or compared with a time here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from timeouts import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

TINY = """
import json
from models import GPTConfig
import bench
rows = bench.bench_watch(2, config=GPTConfig(vocab=64, width=32, heads=2, layers=2, max_len=8), batch=2, seq=8,
                         every=2, steps=4, memory_runs=1, memory_steps=1)
print("ROWS " + json.dumps(rows))
"""


def test_watch_section_runs_at_a_tiny_size(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}  # wandb, when installed, writes under HOME
    out = subprocess.run([sys.executable, "-c", TINY], cwd=BENCHMARKS, env=env, capture_output=True, text=True,
                         timeout=scaled_timeout(600))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROWS "))[5:])
    by_variant = {r["variant"]: r for r in rows}
    assert list(by_variant) == ["bare step", "logged step (every=1)", "logged step, transformer signals off",
                                "unlogged step", "every=2 over 4 steps",
                                "peer: .item() hooks", "peer: wandb.watch all, log_freq=2", "every=1 / bare"]
    assert all(r["section"] == "watch" for r in rows)
    assert by_variant["bare step"]["ratio"] == 1.0 and "AdamW" in by_variant["bare step"]["detail"]
    goals = {v: by_variant[v]["goal"] for v in ("logged step (every=1)", "logged step, transformer signals off",
                                                 "unlogged step", "every=2 over 4 steps", "every=1 / bare")}
    assert goals == {"logged step (every=1)": "<= 1.35", "logged step, transformer signals off": "<= 1.25",
                     "unlogged step": "<= 1.02",
                     "every=2 over 4 steps": "<= 1.02", "every=1 / bare": "<= 1.05"}
    wandb = by_variant["peer: wandb.watch all, log_freq=2"]
    measured = [r for r in rows if not r["detail"].startswith("skipped")]
    assert wandb in measured or wandb["detail"].startswith("skipped: wandb not installed")
    for r in measured:
        assert r["ratio"] is not None and math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert isinstance(r["met"], bool) if r["goal"] else r["met"] is None, r
    assert "2 logged" in by_variant["every=2 over 4 steps"]["detail"]
    assert not (BENCHMARKS / "wandb").exists()  # wandb's offline run stays in the section's temporary folder


def test_distributed_section_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """benchmarks/bench_distributed.py (``bench.py --only distributed``; issue 24) on 2 ranks, tiny: every
    row is written, and the collectives hookcli adds (the step's ``c10d`` calls less a bare DDP step's)
    are the 3 all-reduces of docs/distributed.md on a logged step and none on an unlogged one. A bare
    DDP step all-reduces its float32 gradients once, which checks the byte count. Nothing is timed here."""
    from torchrun_launch import launch

    tiny = {"vocab": 64, "width": 32, "heads": 2, "layers": 2, "max_len": 8}
    out = tmp_path / "rows.json"
    done = launch([str(BENCHMARKS / "bench_distributed.py"), str(out), "--repeats", "1", "--every", "2", "--steps", "2",
                   "--batch", "2", "--seq", "8", "--config", json.dumps(tiny)], world=2)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows[:4]] == ["bare DDP step", "logged step (every=1)", "unlogged step",
                                                "every=2 over 2 steps"]
    assert all(r["section"] == "distributed" for r in rows)
    for r in rows[:4]:
        assert r["ratio"] is not None and math.isfinite(r["ratio"]) and r["ratio"] > 0, r
    logged, unlogged = rows[4:]
    assert (logged["target"], logged["met"], unlogged["met"]) == ("collectives per logged step", True, True)
    assert logged["variant"].startswith("3 calls, ") and "rank 0: 3 allreduce_ (" in logged["detail"]
    assert unlogged["variant"] == "0 calls, 0 bytes"
    spec = importlib.util.spec_from_file_location("bench_models", BENCHMARKS / "models.py")
    models = sys.modules.setdefault("bench_models", importlib.util.module_from_spec(spec))  # dataclasses need it there
    spec.loader.exec_module(models)
    params = sum(p.numel() for p in models.GPT(models.GPTConfig(**tiny)).parameters())
    assert f"1 allreduce_ ({4 * params} bytes)" in logged["detail"]  # DDP's float32 gradients, the tied weight once
