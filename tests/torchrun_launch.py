"""The distributed tests' shared parts (not a test module itself): launching a script under ``torchrun``
on localhost, and comparing what the ranks report with plain torch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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


def launch(args: list[str], world: int = 2, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node world ARGS`` (a script path or ``-m MODULE`` and its arguments), with
    this checkout first on ``PYTHONPATH`` and one thread a rank; stdout and stderr captured apart."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
