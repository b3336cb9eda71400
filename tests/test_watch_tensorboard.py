"""``hookcli.watch(tensorboard_dir=...)``: the event file read back with TensorBoard's own
``EventAccumulator`` holds, at each logged step, the values of that step's JSON log line (float32, as
TensorBoard keeps scalars); without the tensorboard package it is a UsageError with a pip hint."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hookcli
from hookcli.errors import OutputError, UsageError
from test_watch import read_log

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_the_event_file_holds_the_log_lines_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with hookcli.watch(model, opt, every=5, out=tmp_path / "log.jsonl", tensorboard_dir=tmp_path / "tb" / "run1",
                       flight=3) as w:
        for _ in range(12):
            loss = model(torch.randn(16, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "run1"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    lines = read_log(tmp_path / "log.jsonl")
    assert [line["step"] for line in lines] == [0, 5, 10]
    want: dict[str, dict[int, float]] = {}
    for line in lines:
        step = line["step"]
        want.setdefault("loss", {})[step] = line["loss"]
        for layer in line["layers"]:
            for key in ("rms", "abs_max", "zero_fraction"):
                want.setdefault(f"layers/{layer['name']}/{key}", {})[step] = layer["stats"][key]
            want.setdefault(f"layers/{layer['name']}/grad_rms", {})[step] = layer["grad"]["rms"]
        for p in line["params"]:
            want.setdefault(f"params/{p['name']}/grad_norm", {})[step] = p["grad"]["rms"] * math.sqrt(p["grad"]["count"])
            want.setdefault(f"params/{p['name']}/update_ratio", {})[step] = p["update_ratio"]
    assert set(scalars) == set(want)
    assert "layers/1/zero_fraction" in want and "params/2.weight/update_ratio" in want
    for tag, values in want.items():
        assert scalars[tag] == pytest.approx(values, rel=1e-6, abs=1e-30), tag


def test_without_tensorboard_it_is_a_usage_error_with_a_pip_hint(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith(("tensorboard.", "torch.utils.tensorboard"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without it imports
    with pytest.raises(UsageError, match="needs the tensorboard package") as info:
        hookcli.watch(nn.Linear(2, 2), tensorboard_dir=tmp_path / "tb")
    assert "pip install 'hookcli[tensorboard]'" in info.value.hint
    assert not (tmp_path / "tb").exists()


def test_a_tensorboard_dir_that_is_a_file_is_an_output_error(tmp_path: Path) -> None:
    (tmp_path / "tb").write_text("not a folder")
    with pytest.raises(OutputError, match="cannot write"):
        hookcli.watch(nn.Linear(2, 2), tensorboard_dir=tmp_path / "tb")
    assert (tmp_path / "tb").read_text() == "not a folder"
