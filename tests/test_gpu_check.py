"""benchmarks/gpu_check.sh (the GPU floor's one check) and benchmarks/launch_count.py without a GPU:
the script says it skipped and succeeds; the launch counter runs on CPU at a tiny size, counting aten
ops instead of launches. Nothing is timed here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from timeouts import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_without_cuda_says_skipped_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=scaled_timeout(300), check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "skipped: no CUDA\n"


def test_launch_count_runs_on_cpu_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "launch_count.py"), "--device", "cpu", "--tiny",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=scaled_timeout(300), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["bare step", "unlogged step", "logged step (every=1)"]
    assert rows["bare step"]["ratio"] == 1.0
    assert rows["logged step (every=1)"]["aten_ops"] > rows["bare step"]["aten_ops"] > 0
    assert "logged step (every=1)" in done.stdout
