"""The distributed tests' shared parts (not a test module itself): launching a script under ``torchrun``
on localhost, and comparing what the ranks report with plain torch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from timeouts import scaled_timeout

ROOT = Path(__file__).parents[1]


#: The issue's bar for floats (counts are compared exactly).
REL = 1e-5


def close(actual: float, expected: float, spread: float = 0.0) -> bool:
    """Equal within ``REL``; a mean also within ``REL`` of its values' ``spread`` (their std): a mean
    near 0 of float32 values summed in another order (DDP's averaged gradients) has no relative
    precision."""
    return actual == pytest.approx(expected, rel=REL, abs=max(1e-9, REL * spread))


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous of one launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux ``/proc``; none elsewhere), children first."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def launch(args: list[str], world: int = 2, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node world ARGS`` (a script path or ``-m MODULE`` and its arguments), with
    this checkout first on ``PYTHONPATH`` and one thread a rank; stdout and stderr captured apart."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    # on a timeout the ranks go too (killing torchrun alone left them running, holding the pipes)
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=scaled_timeout(timeout))
        except subprocess.TimeoutExpired:
            for pid in [*descendants(process.pid), process.pid]:  # its ranks run in sessions of their own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int = 2) -> None:
    """This process made to look like torchrun's rank ``rank`` of ``world`` (no process group is made)."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, str(value))


def rank_results(worker: str, out: Path, world: int = 2) -> list[dict[str, Any]]:
    """Launch ``worker OUT`` on ``world`` ranks (it must succeed) and read each rank's ``OUT/rank<r>.json``."""
    done = launch([worker, str(out)], world)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


#: A test module's ``pytestmark`` where it launches ranks: torch.distributed with gloo.
NEEDS_GLOO = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo")
