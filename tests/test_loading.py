"""Model specs -> nn.Module: torchvision names, import paths, files, weights files and names."""

from __future__ import annotations

import json
import sys
import textwrap
import urllib.error
from pathlib import Path

import pytest
import tiny_models
import torch
import torchvision
from torch import nn

from hookcli.errors import (
    ModelImportError,
    ModelNotFoundError,
    UsageError,
    WeightsError,
)
from hookcli.engine.loading import (
    LoadedModel,
    from_instance,
    list_torchvision_models,
    load_model,
)
from hookcli.options import parse_model_args


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A tripwire: any attempt to fetch weights raises URLError (as offline) and is recorded."""
    attempts: list[str] = []

    def refuse(url: str, *args: object, **kwargs: object) -> None:
        attempts.append(url)
        raise urllib.error.URLError("network is unreachable (test tripwire)")

    monkeypatch.setattr("torchvision.models._api.load_state_dict_from_url", refuse)
    monkeypatch.setattr("torch.hub.load_state_dict_from_url", refuse)
    return attempts


# --------------------------------------------------------------------------- torchvision


@pytest.mark.parametrize("spec", ["resnet18", "torchvision:resnet18", "ResNet18"])
def test_torchvision_name(spec: str, no_download: list[str]) -> None:
    loaded = load_model(spec)
    assert isinstance(loaded.model, torchvision.models.ResNet)
    assert (loaded.spec, loaded.kind, loaded.family, loaded.tv_name) == (
        spec, "torchvision", "classification", "resnet18")
    assert loaded.weights is None
    assert loaded.weights_enum is torchvision.models.ResNet18_Weights.DEFAULT
    assert no_download == []


def test_torchvision_model_args() -> None:
    loaded = load_model("resnet18", model_args={"num_classes": 7})
    assert loaded.model.fc.out_features == 7


def test_detection_builds_without_backbone_download(no_download: list[str]) -> None:
    loaded = load_model("ssdlite320_mobilenet_v3_large")
    assert loaded.family == "detection"
    assert no_download == []


def test_bad_torchvision_model_arg_is_usage_error() -> None:
    with pytest.raises(UsageError, match="resnet18"):
        load_model("resnet18", model_args={"no_such_arg": 1})


def test_misspelled_torchvision_name_suggests_close_matches() -> None:
    with pytest.raises(ModelNotFoundError, match="resnt18") as excinfo:
        load_model("resnt18")
    assert "resnet18" in (excinfo.value.hint or "")


def test_unknown_torchvision_weights_name_lists_valid_names() -> None:
    with pytest.raises(WeightsError) as excinfo:
        load_model("resnet18", weights="NOPE")
    assert "IMAGENET1K_V1" in str(excinfo.value) and "DEFAULT" in str(excinfo.value)


def test_weights_name_offline_is_a_clear_weights_error(no_download: list[str]) -> None:
    with pytest.raises(WeightsError, match="offline") as excinfo:
        load_model("resnet18", weights="DEFAULT")
    assert no_download, "the download should have been attempted (and refused)"
    assert "--weights FILE" in (excinfo.value.hint or "")


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # torch.ao quantization
def test_quantized_weights_name_builds_a_quantized_model(no_download: list[str]) -> None:
    with pytest.raises(WeightsError, match="offline"):  # got as far as the download
        load_model("quantized_shufflenet_v2_x0_5", weights="DEFAULT")
    assert no_download


def test_torchvision_weights_file(tmp_path: Path) -> None:
    args = {"num_classes": 3}
    reference = torchvision.models.shufflenet_v2_x0_5(weights=None, **args)
    torch.save(reference.state_dict(), tmp_path / "shuffle.pth")
    loaded = load_model("shufflenet_v2_x0_5", model_args=args, weights=str(tmp_path / "shuffle.pth"))
    assert loaded.weights == f"file: {tmp_path / 'shuffle.pth'}"
    assert torch.equal(loaded.model.fc.weight, reference.fc.weight)
    assert loaded.weights_enum is torchvision.models.ShuffleNet_V2_X0_5_Weights.DEFAULT


def test_list_torchvision_models() -> None:
    everything = list_torchvision_models()
    assert everything == sorted(everything)
    assert ("raft_small", "optical_flow") in everything
    assert ("fasterrcnn_resnet50_fpn", "detection") in everything
    assert ("fcn_resnet50", "segmentation") in everything
    assert ("r3d_18", "video") in everything
    assert ("quantized_resnet18", "quantization") in everything
    resnets = list_torchvision_models("resnet*")
    assert ("resnet18", "classification") in resnets
    assert all(name.startswith("resnet") for name, _ in resnets)
    assert list_torchvision_models("RESNET18") == [("resnet18", "classification")]
    assert list_torchvision_models("no_such_model*") == []


# --------------------------------------------------------------------------- import paths


def test_class_with_model_args() -> None:
    loaded = load_model("tiny_models:Scaled", model_args={"width": 3, "scale": 2.0})
    assert isinstance(loaded.model, tiny_models.Scaled)
    assert loaded.model.fc.out_features == 3 and loaded.model.scale == 2.0
    assert (loaded.kind, loaded.family, loaded.tv_name, loaded.weights_enum) == (
        "import", None, None, None)


def test_factory() -> None:
    loaded = load_model("tiny_models:build_scaled", model_args={"width": 5})
    assert isinstance(loaded.model, tiny_models.Scaled) and loaded.model.fc.out_features == 5


def test_instance_and_dotted_attr() -> None:
    assert load_model("tiny_models:instance").model is tiny_models.instance
    assert isinstance(load_model("tiny_models:TupleOut.Heads").model, tiny_models.TupleOut.Heads)
    with pytest.raises(UsageError, match="instance"):
        load_model("tiny_models:instance", model_args={"width": 2})


def test_bad_import_path_names_what_failed() -> None:
    with pytest.raises(ModelNotFoundError) as excinfo:
        load_model("no_such_pkg_hookcli.models:Net")
    message = str(excinfo.value)
    assert "could not import 'no_such_pkg_hookcli.models'" in message
    assert "No module named 'no_such_pkg_hookcli'" in message


def test_missing_attr_suggests_close_matches() -> None:
    with pytest.raises(ModelNotFoundError, match="Scald") as excinfo:
        load_model("tiny_models:Scald")
    assert "Scaled" in (excinfo.value.hint or "")


def test_constructor_type_error_is_model_import_error() -> None:
    with pytest.raises(ModelImportError, match="TypeError") as excinfo:
        load_model("tiny_models:Scaled", model_args={"bogus": 1})
    assert "bogus" in str(excinfo.value) and "width" in (excinfo.value.hint or "")


def test_module_in_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "hookcli_cwd_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text("from torch import nn\nclass Net(nn.Linear):\n"
                                 "    def __init__(self):\n        super().__init__(2, 3)\n")
    (pkg / "broken.py").write_text("import hookcli_missing_dependency\n")
    (pkg / "raises.py").write_text("raise ValueError('boom at import')\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    assert load_model("hookcli_cwd_pkg.nets:Net").model.out_features == 3
    assert sys.path == before
    with pytest.raises(ModelImportError, match="hookcli_missing_dependency"):
        load_model("hookcli_cwd_pkg.broken:Net")
    with pytest.raises(ModelImportError, match="ValueError: boom at import"):
        load_model("hookcli_cwd_pkg.raises:Net")


NET_PY = """
from torch import nn
from sibling_hookcli_test import WIDTH

class Net(nn.Module):
    def __init__(self, out: int = 2):
        super().__init__()
        self.fc = nn.Linear(WIDTH, out)

    def forward(self, x):
        return self.fc(x)

class Outer:
    class Inner(nn.Linear):
        def __init__(self):
            super().__init__(1, 1)

def not_a_model():
    return 42

CONSTANT = 3
"""


def test_file_spec(tmp_path: Path) -> None:
    (tmp_path / "net.py").write_text(textwrap.dedent(NET_PY))
    (tmp_path / "sibling_hookcli_test.py").write_text("WIDTH = 6\n")
    spec = str(tmp_path / "net.py") + ":Net"
    loaded = load_model(spec, model_args={"out": 4})
    assert (loaded.kind, loaded.spec, loaded.family) == ("file", spec, None)
    assert loaded.model.fc.in_features == 6 and loaded.model.fc.out_features == 4
    assert str(tmp_path) not in sys.path
    assert isinstance(load_model(str(tmp_path / "net.py") + ":Outer.Inner").model, nn.Linear)
    with pytest.raises(ModelImportError, match="int"):
        load_model(str(tmp_path / "net.py") + ":not_a_model")
    with pytest.raises(ModelImportError, match="not an nn.Module"):
        load_model(str(tmp_path / "net.py") + ":CONSTANT")
    with pytest.raises(ModelNotFoundError) as excinfo:
        load_model(str(tmp_path / "net.py") + ":Nett")
    assert "Net" in (excinfo.value.hint or "")


def test_file_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="missing.py"):
        load_model(str(tmp_path / "missing.py") + ":Net")
    (tmp_path / "bad.py").write_text("def broken(:\n")
    with pytest.raises(ModelImportError, match="SyntaxError"):
        load_model(str(tmp_path / "bad.py") + ":Net")
    with pytest.raises(UsageError, match="attribute"):
        load_model(str(tmp_path / "bad.py"))


def test_from_instance() -> None:
    model = tiny_models.Reused()
    loaded = from_instance(model)
    assert isinstance(loaded, LoadedModel)
    assert loaded.model is model and loaded.kind == "instance" and loaded.spec == "Reused"
    assert loaded.family is None and loaded.weights_enum is None
    assert from_instance(model, spec="mine").spec == "mine"
    raft = torchvision.models.optical_flow.raft_small(weights=None)
    assert from_instance(raft).family == "optical_flow"


# --------------------------------------------------------------------------- model args


def test_parse_model_args() -> None:
    parsed = parse_model_args(["num_classes=10", "scale=0.5", "flag=True", "dims=(1, 2)",
                               "name=abc", "quoted='x y'", "expr=a=b", "none=None"])
    assert parsed == {"num_classes": 10, "scale": 0.5, "flag": True, "dims": (1, 2),
                      "name": "abc", "quoted": "x y", "expr": "a=b", "none": None}
    assert parse_model_args([]) == {}


@pytest.mark.parametrize("item", ["novalue", "=3", " =3", "a b=1"])
def test_parse_model_args_errors(item: str) -> None:
    with pytest.raises(UsageError) as excinfo:
        parse_model_args([item])
    assert "KEY=VALUE" in str(excinfo.value) or "--model-arg" in (excinfo.value.hint or "")


# --------------------------------------------------------------------------- weights files


def _reference_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    return {"fc.weight": torch.randn(4, 4, generator=generator),
            "fc.bias": torch.randn(4, generator=generator)}


def test_weights_from_pt_with_module_prefix(tmp_path: Path) -> None:
    state = _reference_state()
    path = tmp_path / "w.pt"
    torch.save({f"module.{k}": v for k, v in state.items()}, path)
    loaded = load_model("tiny_models:Scaled", weights=str(path))
    assert torch.equal(loaded.model.fc.weight, state["fc.weight"])
    assert torch.equal(loaded.model.fc.bias, state["fc.bias"])
    assert loaded.weights == f"file: {path}"


def test_weights_from_checkpoint_dict(tmp_path: Path) -> None:
    state = _reference_state()
    path = tmp_path / "ckpt.pth"
    torch.save({"state_dict": state, "epoch": 3}, path)
    loaded = load_model("tiny_models:Scaled", weights=str(path))
    assert torch.equal(loaded.model.fc.weight, state["fc.weight"])


def test_weights_from_safetensors(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = _reference_state()
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file(state, str(path))
    loaded = load_model("tiny_models:Scaled", weights=str(path))
    assert torch.equal(loaded.model.fc.bias, state["fc.bias"])


def test_mismatched_weights(tmp_path: Path) -> None:
    path = tmp_path / "reused.pt"
    torch.save(tiny_models.Reused().state_dict(), path)
    with pytest.raises(WeightsError) as excinfo:
        load_model("tiny_models:Scaled", weights=str(path))
    message = str(excinfo.value)
    assert "missing keys: fc.weight" in message and "unexpected keys" in message
    wide = tmp_path / "wide.pt"
    torch.save(tiny_models.Scaled(width=5).state_dict(), wide)
    with pytest.raises(WeightsError, match="shape mismatch"):
        load_model("tiny_models:Scaled", weights=str(wide))


def test_weights_file_errors(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="not found"):
        load_model("tiny_models:Scaled", weights=str(tmp_path / "nope.pt"))
    pickled = tmp_path / "module.pt"
    torch.save({"model": nn.Linear(4, 4)}, pickled)
    with pytest.raises(WeightsError, match="non-tensor"):
        load_model("tiny_models:Scaled", weights=str(pickled))
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"this is not a checkpoint")
    with pytest.raises(WeightsError, match="corrupt.pt"):
        load_model("tiny_models:Scaled", weights=str(corrupt))


def test_weights_name_for_user_model_is_usage_error() -> None:
    with pytest.raises(UsageError, match="torchvision") as excinfo:
        load_model("tiny_models:Scaled", weights="DEFAULT")
    assert not isinstance(excinfo.value, WeightsError)


# --------------------------------------------------------------------------- --trust-pickle


def _trained_scaled() -> tiny_models.Scaled:
    """A Scaled(width=3) whose weights differ from what seed 0 builds."""
    torch.manual_seed(7)
    return tiny_models.Scaled(width=3, scale=2.0)


def _pickled_weights(tmp_path: Path) -> dict[str, tuple[Path, tiny_models.Scaled]]:
    """Weights files weights_only loading refuses: a whole module, checkpoints holding objects."""
    files: dict[str, tuple[Path, tiny_models.Scaled]] = {}
    whole = _trained_scaled()
    torch.save(whole, tmp_path / "whole.pt")
    files["whole module"] = (tmp_path / "whole.pt", whole)
    ckpt = _trained_scaled()
    torch.save({"state_dict": ckpt.state_dict(), "train_state": tiny_models.TrainState(epoch=3)},
               tmp_path / "ckpt.pth")
    files["checkpoint with an object"] = (tmp_path / "ckpt.pth", ckpt)
    in_ckpt = _trained_scaled()
    torch.save({"model": in_ckpt, "epoch": 3}, tmp_path / "model_in_ckpt.pt")
    files["checkpoint holding the module"] = (tmp_path / "model_in_ckpt.pt", in_ckpt)
    return files


def test_pickled_weights_need_trust_pickle(tmp_path: Path) -> None:
    for what, (path, ref) in _pickled_weights(tmp_path).items():
        with pytest.raises(WeightsError, match="non-tensor") as excinfo:
            load_model("tiny_models:Scaled", model_args={"width": 3}, weights=str(path))
        assert "--trust-pickle" in (excinfo.value.hint or ""), what
        assert "torch.save(model.state_dict(), PATH)" in (excinfo.value.hint or ""), what
        loaded = load_model("tiny_models:Scaled", model_args={"width": 3}, weights=str(path), trust_pickle=True)
        assert loaded.weights == f"file: {path}", what
        for name, tensor in ref.state_dict().items():
            assert torch.equal(loaded.model.state_dict()[name], tensor), (what, name)


def test_trust_pickle_keeps_other_weights_errors(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"this is not a checkpoint")
    with pytest.raises(WeightsError, match="could not read .*corrupt.pt") as excinfo:
        load_model("tiny_models:Scaled", weights=str(corrupt), trust_pickle=True)
    assert "non-tensor" not in str(excinfo.value)
    torch.save(tiny_models.TrainState(), tmp_path / "state.pt")
    with pytest.raises(WeightsError, match="holds a TrainState, not a state dict"):
        load_model("tiny_models:Scaled", weights=str(tmp_path / "state.pt"), trust_pickle=True)
    torch.save(tiny_models.Reused(), tmp_path / "reused.pt")  # the wrong model: strict checks still apply
    with pytest.raises(WeightsError, match="missing keys: fc.weight"):
        load_model("tiny_models:Scaled", weights=str(tmp_path / "reused.pt"), trust_pickle=True)


def test_trust_pickle_names_a_class_it_cannot_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module_file = tmp_path / "hookcli_gone_model.py"
    module_file.write_text("from torch import nn\n\nclass Gone(nn.Linear):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import hookcli_gone_model

    torch.save(hookcli_gone_model.Gone(4, 4), tmp_path / "gone.pt")
    monkeypatch.delitem(sys.modules, "hookcli_gone_model")
    module_file.unlink()
    with pytest.raises(WeightsError, match="hookcli_gone_model") as excinfo:
        load_model("tiny_models:Scaled", weights=str(tmp_path / "gone.pt"), trust_pickle=True)
    assert "importable" in (excinfo.value.hint or "")


def test_cli_trust_pickle_weights(cli, tmp_path: Path) -> None:
    path, ref = _pickled_weights(tmp_path)["whole module"]
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    args = ["stats", "tiny_models:Scaled", "--model-arg", "width=3", "--model-arg", "scale=2.0",
            "--weights", path, "--input", tmp_path / "x.pt", "-f", "json"]
    refused = cli(*args)
    assert refused.exit_code == 2 and refused.stdout == ""
    assert "non-tensor" in refused.stderr and "--trust-pickle" in refused.stderr
    assert "Traceback" not in refused.stderr
    result = cli(*args, "--trust-pickle")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"]["weights"] == f"file: {path}"
    (row,) = report["layers"]
    with torch.no_grad():
        expected = ref.fc(x)
    assert row["name"] == "fc" and row["shape"] == [5, 3]
    assert row["stats"]["mean"] == pytest.approx(expected.mean().item(), rel=1e-5, abs=1e-6)
    assert row["stats"]["std"] == pytest.approx(expected.std(correction=0).item(), rel=1e-5)
    assert row["stats"]["min"] == pytest.approx(expected.min().item(), rel=1e-6)
    assert row["stats"]["max"] == pytest.approx(expected.max().item(), rel=1e-6)


def test_cli_modules_trust_pickle(cli, tmp_path: Path) -> None:
    path, _ = _pickled_weights(tmp_path)["checkpoint with an object"]
    refused = cli("modules", "tiny_models:Scaled", "--model-arg", "width=3", "--weights", path)
    assert refused.exit_code == 2 and "--trust-pickle" in refused.stderr
    result = cli("modules", "tiny_models:Scaled", "--model-arg", "width=3", "--weights", path,
                 "--trust-pickle", "-f", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"]["weights"] == f"file: {path}"


def test_every_command_with_files_takes_trust_pickle() -> None:
    from hookcli.cli import main

    for name, command in main.commands.items():
        params = {p.name for p in command.params}
        if params & {"weights", "input_files"}:
            assert "trust_pickle" in params, name


def test_api_trust_pickle(tmp_path: Path) -> None:
    import hookcli

    path, ref = _pickled_weights(tmp_path)["whole module"]
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    torch.save(x, tmp_path / "x.pt")
    options = {"model_args": {"width": 3, "scale": 2.0}, "weights": str(path), "inputs": [tmp_path / "x.pt"]}
    with pytest.raises(WeightsError, match="non-tensor"):
        hookcli.stats("tiny_models:Scaled", **options)
    report = hookcli.stats("tiny_models:Scaled", trust_pickle=True, **options)
    with torch.no_grad():
        expected = ref.fc(x)
    assert report.layers[0].stats["max"] == pytest.approx(expected.max().item(), rel=1e-6)
    assert hookcli.shapes("tiny_models:Scaled", trust_pickle=True, **options).layers[0].shape == [2, 3]
    grads = hookcli.grads("tiny_models:Scaled", trust_pickle=True, params="all", **options)
    assert {p.name for p in grads.params} == {"fc.weight", "fc.bias"}
    tree = hookcli.modules("tiny_models:Scaled", model_args={"width": 3}, weights=str(path), trust_pickle=True)
    assert tree.model.weights == f"file: {path}"
    with pytest.raises(UsageError, match="trust_pickle must be True or False"):
        hookcli.stats("tiny_models:Scaled", trust_pickle="yes", **options)
