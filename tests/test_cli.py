"""The CLI through Click's CliRunner: exit codes, stdout vs stderr, JSON, config, a golden table."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent


def _help_and_version() -> list[list[str]]:
    """``--help`` of the group and of every command, and ``--version`` (torch-free to build)."""
    from hookcli.cli import main

    return [["--help"], ["--version"], *([name, "--help"] for name in sorted(main.commands))]


def test_help_names_every_model_source(cli) -> None:
    """``hookcli --help`` names each form of MODEL, and each example it gives is one hookcli takes."""
    from hookcli.options import MODEL_SOURCES

    result = cli("--help")
    assert result.exit_code == 0 and result.stderr == ""
    text = " ".join(result.stdout.split())  # click wraps lines at spaces
    for form in ("a torchvision name (resnet50)", "timm:NAME", "hf:TYPE", "hf:DIR", "hf:ORG/NAME",
                 "an import path (pkg.mod:Net)", "a file (path/net.py:build)"):
        assert form in text, form
    assert [source.example for source in MODEL_SOURCES][:3] == ["resnet50", "timm:resnet18", "hf:gpt2"]
    for spec in ("timm:resnet18", "hf:gpt2"):  # each builds offline (listed by `hookcli modules`)
        pytest.importorskip(spec.split(":")[0].replace("hf", "transformers"))
        out = cli("modules", spec, "--depth", "1", "-f", "json")
        assert out.exit_code == 0, out.stderr


@pytest.mark.parametrize("args", _help_and_version(), ids=" ".join)
def test_help_and_version_do_not_import_torch(args: list[str]) -> None:
    """In a fresh interpreter: the help (every option of the command listed) or the version line,
    without importing torch; the C kernel (which loads an OpenMP runtime) only for --version."""
    from hookcli.cli import main

    code = textwrap.dedent(f"""
        import sys
        from click.testing import CliRunner
        from hookcli.cli import main
        result = CliRunner().invoke(main, {args!r})
        assert result.exit_code == 0, result.output
        if {args!r} != ["--version"]:
            assert "hookcli.engine._fastreduce" not in sys.modules
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        sys.stdout.write(result.output)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    if args == ["--version"]:
        assert out.stdout.startswith("hookcli 0.1.0 (C statistics kernel: ")
        return
    command = main if args == ["--help"] else main.commands[args[0]]
    assert out.stdout.startswith("Usage: ")
    options = {opt for param in command.params if not getattr(param, "hidden", False)
               for opt in param.opts if opt.startswith("--")}
    missing = sorted(opt for opt in options if opt not in out.stdout)
    assert not missing, f"hookcli {' '.join(args)} does not list {missing}"
    if command is main:
        assert all(name in out.stdout for name in main.commands)


def test_version(cli) -> None:
    from hookcli.engine.stats import _fastreduce

    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.startswith("hookcli 0.1.0 (C statistics kernel: ")
    assert ("kernel: built)" in result.stdout) == (_fastreduce is not None)


def test_shapes_json_matches_plain_forward(cli) -> None:
    result = cli("shapes", "resnet18", "--input-shape", "2x3x64x64", "--format", "json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert report["schema"] == 1 and report["command"] == "shapes"
    assert report["model"] == {**report["model"], "spec": "resnet18", "source": "argument", "class": "ResNet",
                               "params": 11689512, "trainable_params": 11689512}
    assert report["inputs"] == [{"name": "0", "shape": [2, 3, 64, 64], "dtype": "float32", "source": "randn(seed=0)"}]
    from torchvision.models import resnet18

    model = resnet18(weights=None).eval()
    expected, x = {}, torch.zeros(2, 3, 64, 64)
    with torch.no_grad():
        for name, child in model.named_children():
            x = torch.flatten(x, 1) if name == "fc" else x
            x = child(x)
            expected[name] = list(x.shape)
    assert {layer["name"]: layer["shape"] for layer in report["layers"]} == expected
    conv1 = report["layers"][0]
    assert conv1 == {**conv1, "call": 0, "type": "Conv2d", "output": "", "called": True,
                     "input_shapes": [[2, 3, 64, 64]], "dtype": "float32", "params": 9408}


def test_default_model_is_resnet50(cli) -> None:
    result = cli("shapes", "--input-shape", "1x3x32x32", "--layers", "fc", "-f", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["spec"] == "resnet50" and report["model"]["source"] == "default"
    assert report["layers"][0]["shape"] == [1, 1000]


def test_file_model_with_model_args_and_reused_module(cli, tmp_path: Path) -> None:
    net = tmp_path / "net.py"
    net.write_text(textwrap.dedent("""
        from torch import nn
        class Net(nn.Module):
            def __init__(self, width=4):
                super().__init__()
                self.fc = nn.Linear(3, width)
                self.act = nn.Tanh()
            def forward(self, x):
                return self.act(self.act(self.fc(x)))
        def build(width=4):
            return Net(width)
    """))
    result = cli("shapes", f"{net}:build", "--model-arg", "width=6", "--input-shape", "2x3", "-f", "json")
    assert result.exit_code == 0, result.output
    layers = json.loads(result.stdout)["layers"]
    assert [(r["name"], r["call"], r["shape"]) for r in layers] == [
        ("fc", 0, [2, 6]), ("act", 0, [2, 6]), ("act", 1, [2, 6])]


def test_module_attr_spec_csv_and_markdown(cli) -> None:
    result = cli("stats", "tiny_models:Reused", "--input-shape", "3x4", "-f", "csv")
    assert result.exit_code == 0, result.output
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(r["name"], r["call"]) for r in rows] == [
        ("fc1", "0"), ("act", "0"), ("fc2", "0"), ("act", "1"), ("act", "2"), ("head", "0")]
    result = cli("shapes", "tiny_models:Reused", "--input-shape", "3x4", "-f", "markdown")
    assert result.exit_code == 0 and "| Layer" in result.stdout and "act#2" in result.stdout


def test_unknown_model_exits_2_with_close_matches(cli) -> None:
    result = cli("shapes", "resnet5O")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "resnet50" in result.stderr and "Traceback" not in result.stderr


def test_bad_import_path_says_what_failed(cli) -> None:
    result = cli("shapes", "no_such_pkg.models:Net")
    assert result.exit_code == 2
    assert "no_such_pkg" in result.stderr and "Traceback" not in result.stderr


def test_unknown_layer_exits_2_with_close_matches(cli) -> None:
    result = cli("shapes", "resnet18", "--layers", "layer5", "--input-shape", "1x3x32x32")
    assert result.exit_code == 2
    assert "layer5" in result.stderr and "layer4" in result.stderr and result.stdout == ""


@pytest.mark.parametrize("args, needle", [
    (["--input-shape", "1xAx3"], "input"),
    (["--input", "missing.png"], "missing.png"),
    (["--dtype", "float17"], "dtype"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
    (["--fill", "lots"], "fill"),
])
def test_bad_inputs_exit_2(cli, args: list[str], needle: str) -> None:
    result = cli("shapes", "tiny_models:Reused", *args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr.lower() and "Traceback" not in result.stderr


def test_model_that_raises_prints_partial_rows_and_exits_1(cli) -> None:
    result = cli("stats", "tiny_models:Raises", "--input-shape", "2x4", "-f", "json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert [(r["name"], r["called"], r.get("raised", False)) for r in report["layers"]] == [
        ("good", True, False), ("act", True, False), ("bad", True, True), ("never", False, False)]
    assert report["failure"]["module"] == "bad" and report["failure"]["input_shapes"] == [[2, 6]]
    assert "bad (CheckedLinear)" in result.stderr and "2x6" in result.stderr
    assert "Traceback" not in result.stderr
    debug = cli("stats", "tiny_models:Raises", "--input-shape", "2x4", "--debug")
    assert debug.exit_code == 1 and "Traceback" in debug.stderr


def test_output_file_is_written_atomically(cli, tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    result = cli("shapes", "tiny_models:Reused", "--input-shape", "3x4", "-o", target)  # .json implies JSON
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and str(target) in result.stderr
    assert json.loads(target.read_text())["command"] == "shapes"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temp files left
    bad = cli("shapes", "tiny_models:Reused", "-o", tmp_path / "report.json" / "x.json")  # under a file
    assert bad.exit_code == 2 and "not a directory" in bad.stderr


def test_config_file_and_pyproject_defaults(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "inspect.toml"
    config.write_text('model = "tiny_models:Reused"\ninput_shape = "5x4"\nlayers = ["act"]\nformat = "json"\n')
    result = cli("shapes", "--config", config)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["source"] == "config"
    assert [(r["name"], r["shape"]) for r in report["layers"]] == [("act", [5, 8])] * 3
    # the command line wins over the config
    result = cli("shapes", "--config", config, "--layers", "head")
    assert [r["name"] for r in json.loads(result.stdout)["layers"]] == ["head"]
    monkeypatch.chdir(tmp_path)  # a config names its repository's own code: a module of tmp_path
    (tmp_path / "cli_repo_models.py").write_text("from tiny_models import Reused\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.hookcli]\nmodel = "cli_repo_models:Reused"\ninput_shape = "2x4"\nformat = "json"\n')
    result = cli("shapes")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["model"]["source"] == "pyproject"
    assert report["inputs"][0]["shape"] == [2, 4]


def test_shipped_example_config_runs(cli) -> None:
    config = TESTS.parent / "configs" / "resnet18_small.toml"
    result = cli("shapes", "--config", config, "-f", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [r["name"] for r in report["layers"]] == ["layer4", "fc"]
    assert report["inputs"][0]["shape"] == [2, 3, 64, 64]


def test_bad_config_exits_2_naming_key_and_file(cli, tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('model = "tiny_models:Reused"\nlayer = "act"\n')
    result = cli("shapes", "--config", config)
    assert result.exit_code == 2
    assert "layer" in result.stderr and "bad.toml" in result.stderr and "layers" in result.stderr


def test_grads_layer4_from_config_model(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.hookcli]\nmodel = "resnet18"\ninput_shape = "1x3x64x64"\n')
    result = cli("grads", "--layers", "layer4", "-f", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["command"] == "grads" and report["model"]["spec"] == "resnet18"
    (layer4,) = report["layers"]
    assert layer4["grad"]["norm"] > 0 and layer4["grad"]["nan_count"] == 0
    assert report["params"][0]["name"] == "layer4.0.conv1.weight"
    assert report["loss"]["kind"] == "cross_entropy"
    table = cli("grads", "--layers", "layer4")
    assert table.exit_code == 0 and "Grad norm" in table.stdout and "layer4.0.conv1.weight" in table.stdout


def test_image_input(cli, tmp_path: Path) -> None:
    from torchvision.io import write_png

    image = (torch.arange(3 * 40 * 50) % 255).to(torch.uint8).reshape(3, 40, 50)
    write_png(image, str(tmp_path / "img.png"))
    result = cli("shapes", "resnet18", "--input", tmp_path / "img.png", "--layers", "fc", "-f", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["inputs"][0]["shape"] == [1, 3, 224, 224] and "img.png" in report["inputs"][0]["source"]


def test_models_and_modules(cli) -> None:
    result = cli("models", "resnet*", "-f", "json")
    names = [m["name"] for m in json.loads(result.stdout)["models"]]
    assert "resnet50" in names and all(n.startswith("resnet") for n in names)
    result = cli("modules", "tiny_models:TupleOut", "-f", "json")
    modules = json.loads(result.stdout)["modules"]
    assert [m["name"] for m in modules] == ["", "stem", "split", "heads", "heads.a", "heads.b"]
    assert modules[0]["params"] == 32


def test_golden_stats_table(cli, golden, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table on stdout, width 120 and no colour (the ``cli`` fixture): tests/golden/tables/cli_stats.txt."""
    monkeypatch.chdir(tmp_path)
    net = tmp_path / "fixed.py"
    net.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        def build():
            model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (i + 1))
            return model
    """))
    result = cli("stats", "fixed.py:build", "--input-shape", "2x3", "--fill", "ones")
    assert result.exit_code == 0, result.output
    golden("tables/cli_stats.txt", result.stdout)
