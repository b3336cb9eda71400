"""Round-3 tryout: inputs and models nobody here wrote, used as a new user would.

Every number is checked against plain torch computed here (``torch.autograd.grad`` for gradients);
the faults these found have bad-input rows in ``tests/test_bad_inputs.py`` besides.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from reference import float64_stats

LINEAR_FILE = """
from torch import nn


def build():
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh())
"""


@pytest.fixture
def linear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file model ``net.py:build`` in a scratch working directory."""
    (tmp_path / "net.py").write_text(LINEAR_FILE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _layer_stats(stdout: str, name: str) -> dict[str, float]:
    (layer,) = [r for r in json.loads(stdout)["layers"] if r["name"] == name]
    return layer["stats"]


@pytest.mark.parametrize("npz", [False, True], ids=["npy", "npz"])
@pytest.mark.parametrize("kind", ["f4", "f8"])
@pytest.mark.parametrize("order", [">", "<"], ids=["big-endian", "little-endian"])
def test_a_big_endian_npy_is_read_as_its_values(cli, linear: Path, order: str, kind: str, npz: bool) -> None:
    """numpy writes the byte order into the file (``>f4``); torch.from_numpy refused a non-native one
    (exit 2, "is it a complete .npy file?"). The values must arrive as they were saved."""
    values = np.linspace(-2, 2, 8).reshape(2, 4)
    array = values.astype(order + kind)
    if npz:
        np.savez(linear / "x.npz", input=array)
    else:
        np.save(linear / "x.npy", array)
    linear_layer = torch.nn.Linear(4, 3)
    torch.save(torch.nn.Sequential(linear_layer, torch.nn.Tanh()).state_dict(), linear / "w.pt")
    dtype = ["--dtype", "float64"] if kind == "f8" else []
    result = cli("stats", "net.py:build", "--weights", "w.pt", "--input", "x.npz" if npz else "x.npy",
                 "--layers", "0", "--format", "json", *dtype)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    with torch.no_grad():
        expected = float64_stats(linear_layer.double()(torch.from_numpy(values)))
    stats = _layer_stats(result.stdout, "0")
    for key in ("mean", "std", "min", "max", "norm"):
        assert stats[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
