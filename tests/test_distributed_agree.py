"""Under torchrun the ranks agree on what they run before it runs (``engine.sharding.agreement``): ranks
given different configs or models, or a rank that cannot read its inputs, stop every rank with exit 2
and one line naming what differs or the failing rank's reason; never a report of wrong "whole batch"
numbers, never a hang. Real torchrun launches (gloo, 2 ranks), each rank in a checkout of its own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.torchrun_launch import launch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

WORKER = str(Path(__file__).with_name("distributed_agree_worker.py"))
NET = ("import torch\n\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, {width}), torch.nn.ReLU(), "
       "torch.nn.Linear({width}, 2))\n")


def checkouts(root: Path, *, config: tuple[str, str], width: tuple[int, int] = (3, 3),
              data: tuple[bool, bool] = (True, True)) -> None:
    """``root/rank0`` and ``root/rank1``: each its pyproject.toml ``[tool.hookcli]`` (``config``), its net.py
    (a hidden layer of ``width``) and, where ``data``, its data.pt of 4 samples."""
    for rank in range(2):
        folder = root / f"rank{rank}"
        folder.mkdir(parents=True)
        (folder / "net.py").write_text(NET.format(width=width[rank]))
        (folder / "pyproject.toml").write_text("[tool.hookcli]\n" + config[rank])
        if data[rank]:
            torch.save(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), folder / "data.pt")


def stopped(done, *words: str) -> list[str]:
    """Every rank exited 2 (torchrun's table), no report; the Error lines, which hold ``words``."""
    assert done.returncode != 0 and done.stdout == "", (done.stdout, done.stderr[-3000:])
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank.*?exitcode\s*: (-?\d+)", done.stderr, re.DOTALL))
    assert codes == {"0": "2", "1": "2"}, (codes, done.stderr[-3000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert errors and all(word in "\n".join(errors) for word in words), errors
    assert "internal error" not in done.stderr and "Traceback" not in "\n".join(
        line for line in done.stderr.splitlines() if "hookcli" in line), done.stderr[-3000:]
    return errors


def test_ranks_given_different_configs_stop_saying_what_differs(tmp_path: Path) -> None:
    """Rank 1's config asks for another batch: before, each rank ran its own and the merged 'whole batch'
    statistics (exit 0) were of neither."""
    checkouts(tmp_path, config=('model = "net:build"\ninput_shape = "2x4"\n', 'model = "net:build"\ninput_shape = "4x4"\n'))
    errors = stopped(launch([WORKER, str(tmp_path), "stats", "-f", "json"]), "--input-shape",
                     "rank 0: [2x4]", "rank 1: [4x4]")
    assert len(errors) == 1 and errors[0].startswith("Error: rank 0: the ranks were given different"), errors


def test_ranks_given_different_models_stop_under_ddp(tmp_path: Path) -> None:
    """The same spec, net:build, but each checkout's net.py builds another model (hidden width 3 and 5)."""
    checkouts(tmp_path, config=('model = "net:build"\ninput_shape = "4x4"\n',) * 2, width=(3, 5))
    errors = stopped(launch([WORKER, str(tmp_path), "grads", "--shard", "ddp", "--loss", "mean"]), "different model",
                     "rank 1: Sequential, 4 tensors, 37 values")
    assert len(errors) == 1, errors


def test_a_rank_that_cannot_read_its_data_stops_every_rank_under_fsdp2(tmp_path: Path) -> None:
    """Rank 1's checkout has no data.pt: before, rank 0 went on into the run's collectives and rank 1
    into the exit-code agreement, and both waited for ever."""
    checkouts(tmp_path, config=('model = "net:build"\n',) * 2, data=(True, False))
    errors = stopped(launch([WORKER, str(tmp_path), "stats", "--data", "data.pt", "--shard", "fsdp2", "--batch-size",
                             "2"]),
                     "rank 1: ", "data.pt")
    assert any(line.startswith("Error: rank 0: ") and "failed on 1 of 2 ranks (rank 1: " in line for line in errors), errors
    assert sum(line.startswith("Error: rank 1: ") for line in errors) == 1, errors
