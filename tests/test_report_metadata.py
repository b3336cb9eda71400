"""Reports say what was run: the model's arguments in JSON, the table header and exported files, and
``--model-arg`` overriding a config's ``model_args`` key by key (issue 13, "Reports say what was run")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

import hookcli

MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=4, depth=1, scale=1.0):
        super().__init__()
        self.scale = scale
        self.layers = nn.Sequential(*[nn.Linear(3 if i == 0 else width, width) for i in range(depth)])

    def forward(self, x):
        return self.layers(x) * self.scale
'''


@pytest.fixture
def model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "net.py"
    path.write_text(MODEL_FILE)
    return path


def _json(out: str) -> dict:
    return json.loads(out)


def test_model_args_are_in_the_json_and_the_header(cli, model_file: Path) -> None:
    out = cli("shapes", "net.py:Net", "--input-shape", "2x3", "--model-arg", "width=5", "--model-arg", "scale=0.5",
              "--format", "json")
    assert out.exit_code == 0, out.stderr
    model = _json(out.stdout)["model"]
    assert model["model_args"] == {"width": 5, "scale": 0.5}
    assert _json(out.stdout)["inputs"][0]["shape"] == [2, 3]
    table = cli("shapes", "net.py:Net", "--input-shape", "2x3", "--model-arg", "width=5")
    assert table.exit_code == 0 and "args: width=5" in table.stdout.splitlines()[0]


def test_command_line_model_args_override_the_config_key_by_key(cli, model_file: Path) -> None:
    Path("cfg.toml").write_text('model = "net.py:Net"\ninput_shape = "2x3"\n'
                                '[model_args]\nwidth = 6\ndepth = 2\n')
    out = cli("stats", "--config", "cfg.toml", "--model-arg", "width=7", "--format", "json")
    assert out.exit_code == 0, out.stderr
    report = _json(out.stdout)
    assert report["model"]["model_args"] == {"width": 7, "depth": 2}
    # the model really was built with both: two layers of width 7
    shapes = {row["name"]: row["shape"] for row in report["layers"] if row.get("shape")}
    assert shapes["layers"] == [2, 7]
    assert report["model"]["params"] == (3 * 7 + 7) + (7 * 7 + 7)
    only_config = _json(cli("stats", "--config", "cfg.toml", "--format", "json").stdout)
    assert only_config["model"]["model_args"] == {"width": 6, "depth": 2}


def test_python_check_merges_model_args_with_its_config(model_file: Path) -> None:
    Path("cfg.toml").write_text('model = "net.py:Net"\ninput_shape = "2x3"\n[model_args]\nwidth = 6\ndepth = 2\n')
    result = hookcli.check(config="cfg.toml", model_args={"width": 3})
    assert result.report.model.model_args == {"width": 3, "depth": 2}


def test_exported_features_carry_the_model_args_and_inputs(cli, model_file: Path) -> None:
    out = cli("features", "net.py:Net", "--input-shape", "2x3", "--model-arg", "width=5", "--model-arg", "depth=2",
              "--output", "feats.safetensors")
    assert out.exit_code == 0, out.stderr
    with safe_open("feats.safetensors", framework="pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
    assert json.loads(meta["model_args"]) == {"width": 5, "depth": 2}
    assert json.loads(meta["inputs"])[0]["shape"] == [2, 3]
    assert meta["model"] == "net.py:Net" and keys


def test_model_args_of_any_literal_stay_json(model_file: Path) -> None:
    report = hookcli.shapes("net.py:Net", input_shapes=["2x3"], model_args={"width": 4, "scale": 2.0})
    data = json.loads(json.dumps(report.to_dict()))
    assert data["model"]["model_args"] == {"width": 4, "scale": 2.0}
