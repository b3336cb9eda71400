"""Config loading: standalone TOML, [tool.hookcli], validation errors, path resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from hookcli.config import OPTION_KEYS, Config, load_config
from hookcli.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_standalone_config(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", """
model = "resnet18"
input_shape = "1,3,64,64"
batch_size = 2
fill = "zeros"
seed = 3
layers = ["layer1", "layer4"]
types = "Conv2d"
depth = 0
all = true
device = "cpu"
dtype = "float16"
mode = "train"
format = "json"
width = 100
model_args = {num_classes = 10, dropout = 0.5}
""")
    config = load_config(cfg)
    assert isinstance(config, Config)
    assert config.origin == "config" and config.path == cfg.resolve()
    assert config.values == {
        "model": "resnet18", "input_shape": ["1,3,64,64"], "batch_size": 2, "fill": "zeros",
        "seed": 3, "layers": ["layer1", "layer4"], "types": ["Conv2d"], "depth": 0,
        "all": True, "device": "cpu", "dtype": "float16", "mode": "train", "format": "json",
        "width": 100, "model_args": {"num_classes": 10, "dropout": 0.5},
    }
    assert config.checks == {}
    assert config.get("batch-size") == 2 and "input-shape" in config
    assert set(config.values) <= set(OPTION_KEYS)


def test_pyproject_tool_table_from_cwd(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", """
[project]
name = "x"

[tool.hookcli]
model = "resnet50"
format = "markdown"

[tool.hookcli.checks]
max_nan = 0
""")
    config = load_config(cwd=tmp_path)
    assert config.origin == "pyproject"
    assert config.path == (tmp_path / "pyproject.toml").resolve()
    assert config.values == {"model": "resnet50", "format": "markdown"}
    assert config.checks == {"max_nan": 0}


def test_pyproject_given_as_config_file(tmp_path: Path) -> None:
    cfg = write(tmp_path / "sub" / "pyproject.toml", '[tool.hookcli]\nmodel = "vgg11"\n')
    config = load_config(cfg)
    assert config.origin == "config" and config.values == {"model": "vgg11"}
    write(tmp_path / "other" / "pyproject.toml", '[project]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"no \[tool.hookcli\] table"):
        load_config(tmp_path / "other" / "pyproject.toml")


def test_no_config(tmp_path: Path) -> None:
    assert load_config(cwd=tmp_path) == Config({}, None, "none", {})
    write(tmp_path / "pyproject.toml", '[project]\nname = "x"\n')
    assert load_config(cwd=tmp_path) == Config({}, None, "none", {})


def test_relative_config_path_uses_cwd(tmp_path: Path) -> None:
    write(tmp_path / "configs" / "a.toml", 'model = "resnet18"\n')
    assert load_config("configs/a.toml", cwd=tmp_path).values == {"model": "resnet18"}


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(tmp_path / "nope.toml")
    assert "nope.toml" in str(info.value)


def test_unknown_key_names_key_file_and_suggestion(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", "batchsize = 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    message = str(info.value)
    assert "'batchsize'" in message and str(cfg) in message and "batch_size" in message
    assert info.value.exit_code == 2
    assert "input_shape" in (info.value.hint or "")


@pytest.mark.parametrize("line", ["trust_pickle = true", "trust-pickle = true", "trust_pickle = false"])
def test_trust_pickle_is_refused_in_a_config(tmp_path: Path, line: str) -> None:
    assert "trust_pickle" not in OPTION_KEYS
    cfg = write(tmp_path / "h.toml", f'model = "tiny_models:Scaled"\n{line}\n')
    with pytest.raises(ConfigError, match="cannot be set in a config file") as info:
        load_config(cfg)
    assert str(cfg) in str(info.value) and "--trust-pickle on the command line" in str(info.value)
    assert info.value.exit_code == 2
    write(tmp_path / "pyproject.toml", f"[tool.hookcli]\n{line}\n")
    with pytest.raises(ConfigError, match="--trust-pickle on the command line") as pyproject:
        load_config(cwd=tmp_path)
    assert "pyproject.toml" in str(pyproject.value)


def test_config_cannot_opt_in_to_unpickling(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiny_models
    import torch

    torch.save(tiny_models.Scaled(), tmp_path / "whole.pt")  # a pickled module: needs --trust-pickle
    torch.save(torch.randn(2, 4), tmp_path / "x.pt")
    cfg = write(tmp_path / "h.toml", 'model = "tiny_models:Scaled"\nweights = "whole.pt"\ninput = "x.pt"\n'
                                      "trust_pickle = true\n")
    result = cli("stats", "--config", cfg)
    assert result.exit_code == 2 and result.stdout == ""
    assert "trust_pickle" in result.stderr and "--trust-pickle on the command line" in result.stderr
    assert "Traceback" not in result.stderr
    monkeypatch.chdir(tmp_path)  # [tool.hookcli] read on its own: refused the same way
    write(tmp_path / "pyproject.toml", "[tool.hookcli]\nmodel = 'tiny_models:Scaled'\ntrust-pickle = true\n")
    result = cli("modules")
    assert result.exit_code == 2 and "--trust-pickle on the command line" in result.stderr
    (tmp_path / "pyproject.toml").unlink()
    import hookcli

    with pytest.raises(ConfigError, match="--trust-pickle"):
        hookcli.check(config=cfg)
    # without the key the config's files load only when the command line trusts them
    cfg.write_text('model = "tiny_models:Scaled"\nweights = "whole.pt"\ninput = "x.pt"\n', encoding="utf-8")
    result = cli("stats", "--config", cfg, "-f", "json")
    assert result.exit_code == 2 and "--trust-pickle" in result.stderr
    result = cli("stats", "--config", cfg, "--trust-pickle", "-f", "json")
    assert result.exit_code == 0, result.output


def test_unknown_key_in_pyproject(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", "[tool.hookcli]\nlayer = 'fc'\n")
    with pytest.raises(ConfigError, match=r"unknown key 'layer'.*layers") as info:
        load_config(cwd=tmp_path)
    assert "pyproject.toml" in str(info.value)


@pytest.mark.parametrize(
    ("line", "expected", "got"),
    [
        ("batch_size = true", "integer > 0", "boolean"),
        ("batch_size = 0", "integer > 0", "integer 0"),
        ("batch_size = '2'", "integer > 0", "string"),
        ("seed = false", "integer", "boolean"),
        ("depth = -1", "integer >= 0", "integer -1"),
        ("width = 1.5", "integer > 0", "float"),
        ("all = 1", "boolean", "integer"),
        ("model = 3", "string", "integer"),
        ("layers = [1, 2]", "string or array of strings", "array of integer"),
        ("fill = 'Randn'", "randn | rand | ones | zeros", "string 'Randn'"),
        ("mode = 'training'", "train | eval", "string"),
        ("format = 'yaml'", "table | json | csv | markdown", "string"),
        ("model_args = ['novalue']", "KEY=VALUE", "array of string"),
        ("model_args = ['1x=2']", "KEY=VALUE", "array of string"),
        ("model_args = 3", "table", "integer"),
        ("checks = 3", "table", "integer"),
    ],
)
def test_wrong_types(tmp_path: Path, line: str, expected: str, got: str) -> None:
    cfg = write(tmp_path / "h.toml", line + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    message = str(info.value)
    assert str(cfg) in message and line.split(" =")[0] in message
    assert expected in message and got in message


def test_toml_syntax_error(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", 'model = "resnet18"\nseed = = 3\n')
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_config(cfg)
    assert str(cfg) in str(info.value) and "line 2" in str(info.value)


def test_relative_paths_resolve_against_config_dir(tmp_path: Path, monkeypatch) -> None:
    cfg = write(tmp_path / "configs" / "h.toml", """
model = "../models/net.py:Net"
weights = "w.pt"
input = ["img.png", "mask=masks/m.pt", "/abs/x.pt"]
output = "out/report.json"
""")
    monkeypatch.chdir(tmp_path.parent)
    values = load_config(cfg).values
    base = (tmp_path / "configs").resolve()
    assert values["model"] == f"{(tmp_path / 'models' / 'net.py').resolve()}:Net"
    assert values["weights"] == str(base / "w.pt")
    assert values["input"] == [str(base / "img.png"), f"mask={base / 'masks' / 'm.pt'}",
                               "/abs/x.pt"]
    assert values["output"] == str(base / "out" / "report.json")


def test_non_path_values_are_kept(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", """
model = "torchvision.models:resnet18"
weights = "ResNet18_Weights.IMAGENET1K_V1"
output = "-"
""")
    values = load_config(cfg).values
    assert values == {"model": "torchvision.models:resnet18",
                      "weights": "ResNet18_Weights.IMAGENET1K_V1", "output": "-"}


def test_hyphen_keys(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", 'input-shape = ["1,3,8,8", "1,4"]\nbatch-size = 3\n'
                                      'model-args = ["num_classes=10", "name=abc", "flag=true"]\n')
    values = load_config(cfg).values
    assert values == {"input_shape": ["1,3,8,8", "1,4"], "batch_size": 3,
                      "model_args": ["num_classes=10", "name=abc", "flag=true"]}
    dup = write(tmp_path / "d.toml", "batch-size = 3\nbatch_size = 4\n")
    with pytest.raises(ConfigError, match="twice"):
        load_config(dup)


def test_checks_table_kept_raw(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", """
model = "resnet18"

[checks]
max_nan = 0
anything = {nested = [1, 2]}
""")
    config = load_config(cfg)
    assert config.checks == {"max_nan": 0, "anything": {"nested": [1, 2]}}
    assert "checks" not in config.values
