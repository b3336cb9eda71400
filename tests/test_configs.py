"""Every shipped example config in configs/ works: ``hookcli check --config configs/X.toml`` exits 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CHECK_CONFIGS = ["resnet18.toml", "user_model.toml", "baseline.toml"]


@pytest.mark.parametrize("name", CHECK_CONFIGS)
def test_example_config_passes(cli, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = CONFIGS / name
    monkeypatch.chdir(tmp_path)  # configs resolve their paths relative to themselves
    result = cli("check", "--config", config, "-f", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] and data["config"] == str(config)
    assert {r["status"] for r in data["rules"]} == {"PASS"}
