"""Config loading: standalone TOML, [tool.hookcli], validation errors, path resolution."""

from __future__ import annotations

from pathlib import Path

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

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
    write(tmp_path / "own.py", "from tiny_models import Scaled\n")  # the repository's own model file
    cfg = write(tmp_path / "h.toml", 'model = "own.py:Scaled"\nweights = "whole.pt"\ninput = "x.pt"\n'
                                      "trust_pickle = true\n")
    result = cli("stats", "--config", cfg)
    assert result.exit_code == 2 and result.stdout == ""
    assert "trust_pickle" in result.stderr and "--trust-pickle on the command line" in result.stderr
    assert "Traceback" not in result.stderr
    monkeypatch.chdir(tmp_path)  # [tool.hookcli] read on its own: refused the same way
    write(tmp_path / "pyproject.toml", "[tool.hookcli]\nmodel = 'own.py:Scaled'\ntrust-pickle = true\n")
    result = cli("modules")
    assert result.exit_code == 2 and "--trust-pickle on the command line" in result.stderr
    (tmp_path / "pyproject.toml").unlink()
    import hookcli

    with pytest.raises(ConfigError, match="--trust-pickle"):
        hookcli.check(config=cfg)
    # without the key the config's files load only when the command line trusts them
    cfg.write_text('model = "own.py:Scaled"\nweights = "whole.pt"\ninput = "x.pt"\n', encoding="utf-8")
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
    cfg = write(tmp_path / "configs" / "h.toml", f"""
model = "../models/net.py:Net"
weights = "w.pt"
input = ["img.png", "mask=masks/m.pt", "{tmp_path}/abs/x.pt"]
output = "out/report.json"
""")
    monkeypatch.chdir(tmp_path.parent)
    values = load_config(cfg).values
    base = (tmp_path / "configs").resolve()
    assert values["model"] == f"{(tmp_path / 'models' / 'net.py').resolve()}:Net"
    assert values["weights"] == str(base / "w.pt")
    assert values["input"] == [str(base / "img.png"), f"mask={base / 'masks' / 'm.pt'}",
                               f"{tmp_path}/abs/x.pt"]
    assert values["output"] == str(base / "out" / "report.json")


def test_non_path_values_are_kept(tmp_path: Path) -> None:
    cfg = write(tmp_path / "h.toml", """
model = "torchvision:resnet18"
weights = "ResNet18_Weights.IMAGENET1K_V1"
""")
    values = load_config(cfg).values
    assert values == {"model": "torchvision:resnet18", "weights": "ResNet18_Weights.IMAGENET1K_V1"}


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


# --------------------------------------------------------------------------- issue #20: what a config may name

import pickle  # noqa: E402
import sys  # noqa: E402

NET = "import torch\n\n\ndef build(width=4):\n    return torch.nn.Linear(width, 2)\n"


class Explode:
    """Unpickling this creates the file ``path`` (code execution from a pickle)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository checkout as the working directory (its own model in net.py), and a HOME
    beside it holding the user's .bashrc."""
    root = tmp_path / "repo"
    write(root / "net.py", NET)
    home = tmp_path / "home"
    write(home / ".bashrc", "the user's shell setup\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(root)
    sys.modules.pop("net", None)
    yield root
    sys.modules.pop("net", None)


def _refused(out, key: str) -> None:
    lines = out.stderr.splitlines()
    assert out.exit_code == 2 and out.stdout == "", out.output
    assert len(lines) == 2 and lines[0].startswith("Error: ") and lines[1].startswith("  hint: "), out.stderr
    assert f"'{key}'" in lines[0] and "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["~/.bashrc", "../home/.bashrc", "{home}/.bashrc", "$HOME/.bashrc",
                                   "sub/../../home/.bashrc", "link/.bashrc", "tolink.json"])
@pytest.mark.parametrize("where", ["pyproject", "config"])
def test_a_config_cannot_write_outside_its_directory(cli, repo: Path, value: str, where: str) -> None:
    home = repo.parent / "home"
    (repo / "link").symlink_to(home)  # a symlink inside the tree that leads out of it
    (repo / "tolink.json").symlink_to(home / ".bashrc")
    body = f'model = "net:build"\ninput_shape = "1x4"\noutput = "{value.format(home=home)}"\n'
    if where == "pyproject":
        write(repo / "pyproject.toml", "[tool.hookcli]\n" + body)
        out = cli("stats")  # bare: reads ./pyproject.toml by itself
    else:
        out = cli("stats", "--config", write(repo / "ci.toml", body))
    if value.startswith("$HOME"):  # not expanded: a folder named "$HOME" inside the tree, which is fine
        assert out.exit_code == 0, out.output
    else:
        _refused(out, "output")
    assert (home / ".bashrc").read_text() == "the user's shell setup\n"


def test_a_config_may_write_inside_its_tree_and_the_command_line_anywhere(cli, repo: Path) -> None:
    cfg = write(repo / "ci" / "hookcli.toml", 'model = "net:build"\ninput_shape = "1x4"\noutput = "out/r.json"\n')
    out = cli("stats", "--config", cfg)
    assert out.exit_code == 0, out.output
    assert json.loads((repo / "ci" / "out" / "r.json").read_text())["command"] == "stats"
    elsewhere = repo.parent / "home" / "mine.json"  # -o is the user's own choice: free
    out = cli("stats", "--config", cfg, "-o", elsewhere)
    assert out.exit_code == 0 and json.loads(elsewhere.read_text())["command"] == "stats"


@pytest.mark.parametrize("line, key", [
    ('input = "{home}/x.pt"', "input"),
    ('input = "x={home}/x.pt"', "input"),
    ('input = "~/x.pt"', "input"),
    ('weights = "~/w.pt"', "weights"),
    ('weights = "link/w.pt"', "weights"),
    ('model = "{home}/evil.py:build"', "model"),
    ('model = "link/evil.py:build"', "model"),
    ('[checks]\nbaseline = "~/b.json"', "baseline"),
])
def test_a_config_reads_only_files_of_its_repository(cli, repo: Path, line: str, key: str) -> None:
    import torch

    home = repo.parent / "home"
    (repo / "link").symlink_to(home)
    torch.save(torch.zeros(1, 4), home / "x.pt")
    torch.save({"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, home / "w.pt")
    write(home / "evil.py", f"open({str(home / 'ran')!r}, 'w')\n" + NET)
    write(home / "b.json", "{}")
    model = "" if line.startswith("model") else 'model = "net:build"\n'
    text = model + 'input_shape = "1x4"\n' * ("input =" not in line) + line.format(home=home) + "\n"
    out = cli("check", "--config", write(repo / "ci.toml", text))
    _refused(out, key)
    assert not (home / "ran").exists()
    # the same file from the command line is the user's own choice
    if key == "weights":
        assert cli("stats", "net:build", "--input-shape", "1x4", "--weights", home / "w.pt").exit_code == 0


@pytest.mark.parametrize("target", ["numpy:load", "torch:load", "pickle:loads", "builtins:eval", "subprocess:run",
                                    "transformers:AutoModel.from_pretrained", "torchvision.models:resnet18",
                                    "own:load", "own:Loader.load"])
@pytest.mark.parametrize("where", ["pyproject", "config", "api"])
def test_a_config_names_only_its_repositorys_own_code(cli, repo: Path, target: str, where: str) -> None:
    """Issue #20: ``model = "numpy:load"`` with ``allow_pickle = true`` unpickled a file (code
    execution). A config's model must be the repository's own code; re-exports are caught too."""
    sentinel = repo / "ran"
    (repo / "evil.npy").write_bytes(pickle.dumps(Explode(str(sentinel))))
    write(repo / "own.py", "from numpy import load\n\nclass Loader:\n    load = staticmethod(load)\n")
    sys.modules.pop("own", None)
    body = f'model = "{target}"\nmodel_args = {{ file = "evil.npy", allow_pickle = true }}\n'
    try:
        if where == "api":
            import hookcli

            with pytest.raises(hookcli.errors.UsageError) as info:
                hookcli.check(config=write(repo / "ci.toml", body))
            assert info.value.exit_code == 2 and target in str(info.value)
        else:
            if where == "pyproject":
                write(repo / "pyproject.toml", "[tool.hookcli]\n" + body)
                out = cli("check")
            else:
                out = cli("check", "--config", write(repo / "ci.toml", body))
            assert out.exit_code == 2 and out.stdout == "" and target in out.stderr, out.output
            assert len(out.stderr.splitlines()) == 2
    finally:
        sys.modules.pop("own", None)
    assert not sentinel.exists()


@pytest.mark.parametrize("model", ["net:build", "net.py:build", "models/deep.py:build", "resnet18"])
def test_a_config_still_names_its_own_model(cli, repo: Path, model: str) -> None:
    write(repo / "models" / "blocks.py", NET)
    write(repo / "models" / "deep.py", "from blocks import build\n")  # a re-export inside the repository
    sys.modules.pop("blocks", None)
    cfg = write(repo / "ci.toml", f'model = "{model}"\ninput_shape = "{"1x3x32x32" if model == "resnet18" else "1x4"}"\n')
    out = cli("shapes", "--config", cfg, "-f", "json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["model"]["spec"].endswith(model.split("/")[-1])


@settings(max_examples=80, deadline=None)
@given(parts=st.lists(st.sampled_from(["..", ".", "a", "b", "link", "~", "$HOME"]), min_size=1, max_size=6))
@example(parts=[".", "~"])  # ./~/r.json: a folder named ~ in the tree (Path("./~") drops the ./)
def test_output_from_a_config_is_accepted_exactly_when_it_stays_in_the_tree(tmp_path_factory: Any,
                                                                          parts: list[str]) -> None:
    """Walk the path by hand (``link`` leads to a folder outside, ``..`` leaves the folder the walk is
    in, ``~`` is home only as the first part): the config is accepted exactly when the walk never
    ends outside the config's tree, and then ``output`` names the file the walk ends at."""
    root = tmp_path_factory.mktemp("walk")
    tree, outside = root / "repo" / "cfg", root / "elsewhere"
    tree.mkdir(parents=True)
    outside.mkdir()
    (tree / "link").symlink_to(outside)
    cfg = write(tree / "h.toml", f'output = "{"/".join(parts)}/r.json"\n')
    where = [Path.home()] if parts[0] == "~" else [tree]
    for part in parts[1:] if parts[0] == "~" else parts:
        if part == "..":
            where.append(where[-1].resolve().parent)
        elif part == "link" and where[-1].resolve() == tree.resolve():
            where.append(outside)
        elif part != ".":
            where.append(where[-1] / part)
    end = (where[-1].resolve() / "r.json")
    inside = end.is_relative_to(tree.resolve())
    if inside:
        assert Path(load_config(cfg).values["output"]).resolve() == end
    else:
        with pytest.raises(ConfigError, match="'output'"):
            load_config(cfg)
