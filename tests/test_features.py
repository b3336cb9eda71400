"""``hookcli features``: saved tensors against plain torch, names per call and output, batches, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference import dummy
import tiny_models as tm
import torch
from torch import nn

import hookcli
from hookcli.errors import LayerNotFoundError, ModelRaisedError, OutputError
from timeouts import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent


def resnet18_reference(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """layer4 and avgpool of resnet18 built as hookcli builds it (seed 0), children run by hand."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(weights=None).eval()
    out = {}
    with torch.no_grad():
        for name, child in model.named_children():
            if name == "fc":
                break
            x = child(x)
            out[name] = x.clone()
    return {"layer4": out["layer4"], "avgpool": out["avgpool"]}


def load_saved(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a features file with the format's own library (not hookcli)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        return load_file(str(path)), metadata
    if path.suffix == ".pt":
        data = torch.load(path, weights_only=True)
        assert set(data) == {"tensors", "metadata"}
        return data["tensors"], data["metadata"]
    with np.load(path) as data:
        arrays = {k: torch.from_numpy(data[k]) for k in data.files if k != "__metadata__"}
        metadata = json.loads(str(data["__metadata__"]))
    return arrays, metadata


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
def test_saved_tensors_equal_plain_torch_with_metadata(cli, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"feats{suffix}"
    result = cli("features", "resnet18", "--input-shape", "1x3x64x64", "--layers", "layer4,avgpool",
                 "--output", out, "--format", "json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert report["command"] == "features"
    assert [(t["label"], t["shape"], t["dtype"]) for t in report["tensors"]] == [
        ("layer4", [1, 512, 2, 2], "float32"), ("avgpool", [1, 512, 1, 1], "float32")]
    assert report["file"] == {"path": str(out), "format": {".safetensors": "safetensors", ".pt": "torch",
                                                          ".npz": "numpy"}[suffix],
                              "bytes": out.stat().st_size}
    tensors, metadata = load_saved(out)
    expected = resnet18_reference(dummy(1, 3, 64, 64))
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], value), name
    assert metadata["format"] == "hookcli.features/1"
    assert metadata["hookcli"] == hookcli.__version__
    assert metadata["model"] == "resnet18" and metadata["model_class"] == "ResNet"
    assert json.loads(metadata["layers"]) == ["layer4", "avgpool"]
    assert json.loads(metadata["inputs"]) == [
        {"name": "0", "shape": [1, 3, 64, 64], "dtype": "float32", "source": "randn(seed=0)"}]
    assert [e["label"] for e in json.loads(metadata["entries"])] == ["layer4", "avgpool"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary file left


def test_reused_module_one_entry_per_call(tmp_path: Path) -> None:
    model = tm.Reused().eval()
    out = tmp_path / "act.safetensors"
    result = hookcli.features(model, input_shapes=["3x4"], layers="act,head", output=out)
    assert [e.label for e in result.entries] == ["act#0", "act#1", "act#2", "head"]
    assert [(e.name, e.call) for e in result.entries] == [("act", 0), ("act", 1), ("act", 2), ("head", 0)]
    calls = tm.reused_calls(model, dummy(3, 4))
    saved, _ = load_saved(out)
    for label in ("act#0", "act#1", "act#2", "head"):
        value = calls[label]
        assert torch.equal(saved[label], value), label
        assert torch.equal(result.tensors[label], value), label


def test_tuple_and_dict_outputs_one_entry_per_tensor(cli, tmp_path: Path) -> None:
    out = tmp_path / "t.npz"
    result = cli("features", "tiny_models:TupleOut", "--input-shape", "2x4", "--layers", "split,heads",
                 "-o", out, "-f", "csv")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "label,name,call,output,type,shape,dtype,bytes"
    assert [line.split(",")[0] for line in lines[1:]] == [
        "split[0]", "split[1]", "split[2]", "heads['out']", "heads['aux']"]
    saved, metadata = load_saved(out)
    torch.manual_seed(0)  # hookcli seeds the model's random initialisation with --seed
    model = tm.TupleOut().eval()
    x = dummy(2, 4)
    with torch.no_grad():
        h = model.stem(x)
        a, b, mask = model.split(h)
        heads = model.heads(a, b)
    assert torch.equal(saved["split[0]"], a) and torch.equal(saved["split[1]"], b)
    assert saved["split[2]"].dtype == torch.int64 and torch.equal(saved["split[2]"], mask)
    assert torch.equal(saved["heads['out']"], heads["out"]) and torch.equal(saved["heads['aux']"], heads["aux"])
    entries = json.loads(metadata["entries"])
    assert [(e["name"], e["output"]) for e in entries][:3] == [("split", "[0]"), ("split", "[1]"), ("split", "[2]")]


def test_table_lists_what_was_saved(cli, tmp_path: Path) -> None:
    out = tmp_path / "r.pt"
    result = cli("features", "tiny_models:Reused", "--input-shape", "2x4", "--layers", "act", "-o", out)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "Name" in text and "Shape" in text and "Dtype" in text and "Size" in text
    assert "act#0" in text and "act#2" in text and "[2, 8]" in text and "64 B" in text
    assert f"saved to {out} (torch" in text
    assert "3 tensors" in text


class TinyConv(nn.Module):
    """A small image model (a user model, so images get the generic 224 crop)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=8, stride=8)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


def write_images(folder: Path, count: int) -> None:
    from PIL import Image

    folder.mkdir()
    gen = torch.Generator().manual_seed(3)
    for i in range(count):
        pixels = torch.randint(0, 256, (40, 48, 3), dtype=torch.uint8, generator=gen)
        Image.fromarray(pixels.numpy()).save(folder / f"im{i}.png")


def test_folder_runs_in_batches_and_equals_one_run(tmp_path: Path) -> None:
    write_images(tmp_path / "imgs", 5)
    model = TinyConv().eval()
    batched = hookcli.features(model, inputs=[tmp_path / "imgs"], batch_size=2, layers="conv,pool,fc",
                               output=tmp_path / "b.safetensors")
    at_once = hookcli.features(model, inputs=[tmp_path / "imgs"], batch_size=5, layers="conv,pool,fc")
    assert batched.batches == 3 and batched.batch_size == 2
    assert at_once.batches == 1 and at_once.batch_size is None and at_once.path is None
    assert batched.inputs[0].shape == [5, 3, 224, 224]
    assert "imgs/ (5 files), 3 batches of 2" in batched.inputs[0].source
    saved, metadata = load_saved(tmp_path / "b.safetensors")
    assert json.loads(metadata["inputs"])[0]["shape"] == [5, 3, 224, 224]
    for label in ("conv", "pool", "fc"):
        assert saved[label].shape[0] == 5
        assert torch.allclose(saved[label], at_once.tensors[label], atol=1e-6), label
    # and the all-at-once run matches the model run by hand on hookcli's preprocessed batch
    from hookcli.engine.build_inputs import make_inputs
    from hookcli.engine.loading import from_instance

    x = make_inputs(from_instance(model), files=[tmp_path / "imgs"]).args[0]
    with torch.no_grad():
        assert torch.allclose(at_once.tensors["fc"], model(x), atol=1e-6)


def test_folder_batches_through_the_cli(cli, tmp_path: Path) -> None:
    write_images(tmp_path / "imgs", 5)
    out = tmp_path / "f.npz"
    result = cli("features", "resnet18", "--input", tmp_path / "imgs", "--batch-size", "2", "--layers", "avgpool",
                 "-o", out, "-f", "json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    report = json.loads(result.stdout)
    assert report["batches"] == 3 and report["batch_size"] == 2
    assert report["tensors"][0]["shape"] == [5, 512, 1, 1]
    saved, _ = load_saved(out)
    assert saved["avgpool"].shape == (5, 512, 1, 1)


def test_progress_bar_on_request_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_images(tmp_path / "imgs", 3)
    hookcli.features(TinyConv(), inputs=[tmp_path / "imgs"], batch_size=1, layers="fc", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "3/3" in captured.err


def test_not_called_module_is_reported_not_dropped(tmp_path: Path) -> None:
    class Nothing(nn.Module):
        def forward(self, x: torch.Tensor) -> None:
            return None

    class Skips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)
            self.nothing = Nothing()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.nothing(x)
            return self.used(x)

    result = hookcli.features(Skips(), input_shapes=["1x2"], layers="used,unused,nothing",
                              output=tmp_path / "s.pt")
    assert [e.label for e in result.entries] == ["used"]
    assert result.not_called == ["unused"] and any("unused was not called" in n for n in result.notes)
    assert any("nothing returned no tensor" in n for n in result.notes)
    assert result.to_dict()["not_called"] == ["unused"]


# --------------------------------------------------------------------------- errors leave no file


@pytest.mark.parametrize("args, needle", [
    (["--layers", "layer5"], "layer5"),
    (["--output-name", "feats.txt"], "unsupported file type"),
    (["--output-name", "feats"], "unsupported file type"),
    (["--output-name", "afile/sub/feats.pt"], "not a directory"),
    (["--output-name", "afile/feats.pt"], "not a directory"),
])
def test_bad_layer_or_output_exits_2_and_writes_nothing(cli, tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "afile").write_text("x")
    output = "feats.safetensors"
    if args[0] == "--output-name":
        output, args = args[1], []
    result = cli("features", "resnet18", "--input-shape", "1x3x32x32", *args, "-o", tmp_path / output)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_output_is_checked_before_the_model_is_built(tmp_path: Path) -> None:
    with pytest.raises(OutputError):
        hookcli.features("no_such_model_anywhere", output=tmp_path / "x.csv")
    with pytest.raises(LayerNotFoundError):
        hookcli.features(tm.Reused(), input_shapes=["1x4"], layers="nope", output=tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []


def test_missing_output_option_exits_2(cli) -> None:
    result = cli("features", "tiny_models:Reused")
    assert result.exit_code == 2 and "--output" in result.stderr


def test_model_that_raises_exits_1_and_keeps_the_old_file(cli, tmp_path: Path) -> None:
    out = tmp_path / "f.pt"
    out.write_bytes(b"old")
    result = cli("features", "tiny_models:Raises", "--input-shape", "2x4", "-o", out, "-f", "json")
    assert result.exit_code == 1
    assert "bad" in result.stderr
    assert json.loads(result.stdout)["failure"]["module"] == "bad"  # the partial report
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pt"]
    with pytest.raises(ModelRaisedError):
        hookcli.features(tm.Raises(), input_shapes=["2x4"], output=out)
    assert out.read_bytes() == b"old"


def test_npz_stores_bfloat16_as_float32(tmp_path: Path) -> None:
    model = tm.Reused()
    result = hookcli.features(model, input_shapes=["2x4"], layers="head", dtype="bfloat16",
                              output=tmp_path / "h.npz")
    assert result.entries[0].dtype == "bfloat16"
    assert any("float32" in n for n in result.notes)
    saved, _ = load_saved(tmp_path / "h.npz")
    assert saved["head"].dtype == torch.float32
    assert torch.equal(saved["head"], result.tensors["head"].float())


# --------------------------------------------------------------------------- rendering


def test_features_and_fmaps_results_render_in_every_format_without_torch() -> None:
    code = """
import sys
from hookcli.records import ChannelRecord, FeatureExport, FeatureMaps, InputInfo, ModelInfo, SavedTensor
from hookcli.render import OutputFormat, render
info = ModelInfo("resnet18", "argument", "ResNet", 10, 10)
inputs = [InputInfo("0", [1, 3, 64, 64], "float32", "randn(seed=0)")]
fe = FeatureExport(info, inputs, entries=[SavedTensor("act#1", "act", 1, "", "ReLU", [1, 8], "float32", 32)],
                   path="f.pt", format="torch", file_bytes=1234, not_called=["x"], notes=["x was not called"])
fm = FeatureMaps(info, "conv1", "Conv2d", inputs, shape=[1, 2, 4, 4], dtype="float32",
                 channels=[ChannelRecord(0, 0.0, 0.0, 0.0, "dead", True), ChannelRecord(1, -1.0, 2.0, 0.5, "ok", True)],
                 tile=[32, 32], grid=[1, 2], image_size=[70, 36], scale=8, path="c.png", file_bytes=99)
for result in (fe, fm):
    for fmt in OutputFormat:
        text = render(result, fmt, width=100, color=True)
        assert text.endswith("\\n") and text.strip(), (result.command, fmt)
        print(text)
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=scaled_timeout(60),
                            check=False)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "act#1" in out and "saved to f.pt (torch, 1.2 kB)" in out and "x was not called" in out
    assert "1 dead" in out and "scale 8" in out and "saved to c.png (99 B)" in out
    assert '"command": "fmaps"' in out and '"command": "features"' in out
    assert "index,status,min,max,mean,shown" in out
