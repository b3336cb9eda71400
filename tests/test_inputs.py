"""Inputs: shape parsing, per-model defaults, fills and seeds, image and tensor files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tiny_models
import torch
import torchvision.models as tvm
import torchvision.transforms.functional as TF1
import torchvision.transforms.v2.functional as F
from PIL import Image
from torch import nn

from hookcli.errors import InputError, UsageError
from hookcli.engine.build_inputs import make_inputs
from hookcli.options import FILLS, InputSpec, parse_input_shape
from hookcli.engine.loading import LoadedModel, from_instance, list_torchvision_models

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def tv(name: str) -> LoadedModel:
    """A torchvision LoadedModel without building the (big) model: a stand-in module."""
    (family,) = [f for n, f in list_torchvision_models(name) if n == name]
    return LoadedModel(nn.Identity(), name, "torchvision", family, name,
                       tvm.get_model_weights(name).DEFAULT, None)


def user(model: nn.Module) -> LoadedModel:
    return from_instance(model)


def image(path: Path, h: int, w: int, seed: int = 0) -> torch.Tensor:
    img = torch.randint(0, 256, (3, h, w), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    write_png(img, path)
    return img


def write_png(img: torch.Tensor, path: Path) -> None:
    """Write a uint8 CHW tensor as an image file (PIL picks the format from the suffix)."""
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(path, format="PNG")


def generic(img: torch.Tensor) -> torch.Tensor:
    img = F.center_crop(F.resize(img, [256], antialias=True), [224, 224])
    return F.normalize(F.to_dtype(img, torch.float32, scale=True), MEAN, STD)


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(("text", "shape", "dtype"), [
    ("2x3x224x224", (2, 3, 224, 224), None),
    ("2,3,224,224", (2, 3, 224, 224), None),
    ("1x16:int64", (1, 16), "int64"),
    ("3x224x224:half", (3, 224, 224), "float16"),
    ("4X5:float", (4, 5), "float32"),
    (" 8 : long ", (8,), "int64"),
    ("2x2:bool", (2, 2), "bool"),
    ("2x2:torch.bfloat16", (2, 2), "bfloat16"),
])
def test_parse_input_shape(text: str, shape: tuple[int, ...], dtype: str | None) -> None:
    assert parse_input_shape(text) == InputSpec(shape, dtype)


@pytest.mark.parametrize("text", ["", "2x0", "2x-1", "axb", "2xx3", "2x3:complex7", "2x3:", "2.5x3"])
def test_parse_input_shape_errors(text: str) -> None:
    with pytest.raises(UsageError) as excinfo:
        parse_input_shape(text)
    assert "2x3x224x224" in (excinfo.value.hint or "")


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize(("name", "shape"), [
    ("resnet18", [1, 3, 224, 224]),
    ("inception_v3", [1, 3, 299, 299]),
    ("swin_v2_t", [1, 3, 256, 256]),
    ("quantized_resnet18", [1, 3, 224, 224]),
    ("fcn_resnet50", [1, 3, 520, 520]),
    ("r3d_18", [1, 3, 16, 112, 112]),
    ("mvit_v2_s", [1, 3, 16, 224, 224]),
])
def test_torchvision_default_shapes(name: str, shape: list[int]) -> None:
    inputs = make_inputs(tv(name))
    assert [list(a.shape) for a in inputs.args] == [shape] and inputs.kwargs == {}
    assert inputs.infos[0].shape == shape and inputs.infos[0].source == "randn(seed=0)"


@pytest.mark.parametrize(("name", "size"), [("ssdlite320_mobilenet_v3_large", 320),
                                            ("ssd300_vgg16", 300), ("fasterrcnn_resnet50_fpn", 320)])
def test_detection_default_is_a_list_of_images(name: str, size: int) -> None:
    inputs = make_inputs(tv(name), batch_size=2)
    (images,) = inputs.args
    assert isinstance(images, list) and [list(i.shape) for i in images] == [[3, size, size]] * 2
    assert inputs.infos[0].shape == [2, 3, size, size]
    assert "list of 2 images" in inputs.infos[0].source


def test_optical_flow_default_is_two_frames() -> None:
    inputs = make_inputs(tv("raft_small"))
    assert len(inputs.args) == 2 and not torch.equal(inputs.args[0], inputs.args[1])
    for arg in inputs.args:
        assert arg.shape[0] == 1 and arg.shape[-1] % 8 == 0 and arg.shape[-2] % 8 == 0


@pytest.mark.parametrize(("model", "shape", "dtype", "note"), [
    (tiny_models.Reused(), [1, 4], "float32", "fc1 (Linear)"),
    (nn.Sequential(nn.Conv2d(5, 2, 3), nn.ReLU()), [1, 5, 224, 224], "float32", "0 (Conv2d)"),
    (nn.Sequential(nn.Conv1d(2, 2, 3)), [1, 2, 64], "float32", "0 (Conv1d)"),
    (tiny_models.Tied(), [1, 128], "int64", "embed (Embedding)"),  # [batch, --seq-len (128)]
    (tiny_models.TinyLSTM(), [1, 128, 5], "float32", "lstm (LSTM)"),
    (nn.GRU(3, 4), [128, 1, 3], "float32", "(model) (GRU)"),
    (nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 1)), [1, 6], "float32", "0 (BatchNorm1d)"),
    (nn.Sequential(nn.ReLU()), [1, 3, 224, 224], "float32", "no layer with parameters"),
])
def test_user_model_guesses(model: nn.Module, shape: list[int], dtype: str, note: str) -> None:
    inputs = make_inputs(user(model))
    info = inputs.infos[0]
    assert (info.shape, info.dtype) == (shape, dtype)
    assert "guessed" in info.source and note in info.source
    model.eval()
    with torch.no_grad():
        model(*inputs.args)  # the guess fits the model


def test_embedding_guess_stays_in_vocabulary() -> None:
    model = nn.Sequential(nn.Embedding(50, 3))
    (ids,) = make_inputs(user(model), batch_size=64).args
    assert ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < 50 and ids.max() >= 10


class WithExamples(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.x, self.y = torch.ones(3, 2), torch.zeros(3, 1)
        if how == "tuple":
            self.example_inputs = (self.x, self.y)
        elif how == "single":
            self.example_input = self.x
        elif how == "dict":
            self.example_inputs = {"x": self.x, "y": self.y}


class WithExampleMethod(WithExamples):
    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (self.y,)


@pytest.mark.parametrize(("how", "args", "kwargs"), [
    ("tuple", ["x", "y"], []), ("single", ["x"], []), ("dict", [], ["x", "y"]),
    ("method", ["y"], []),
])
def test_example_inputs_attribute(how: str, args: list[str], kwargs: list[str]) -> None:
    model = WithExampleMethod(how) if how == "method" else WithExamples(how)
    inputs = make_inputs(user(model), batch_size=5)
    assert [a.tolist() for a in inputs.args] == [getattr(model, n).tolist() for n in args]
    assert sorted(inputs.kwargs) == kwargs
    assert all(i.source.startswith("example_input") for i in inputs.infos)
    assert [i.name for i in inputs.infos] == [str(n) for n in range(len(args))] + kwargs


# --------------------------------------------------------------------------- fills, seeds, batch


def test_fills_and_seeds_are_reproducible() -> None:
    loaded = user(tiny_models.Reused())
    specs = [InputSpec((2, 3), None), InputSpec((4,), None)]
    state = torch.random.get_rng_state()
    a = make_inputs(loaded, shapes=specs, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    generator = torch.Generator().manual_seed(5)
    assert torch.equal(a.args[0], torch.randn(2, 3, generator=generator))
    assert torch.equal(a.args[1], torch.randn(4, generator=generator))
    assert a.infos[0].source == "randn(seed=5)"
    again = make_inputs(loaded, shapes=specs, seed=5)
    other = make_inputs(loaded, shapes=specs, seed=6)
    assert torch.equal(a.args[0], again.args[0]) and not torch.equal(a.args[0], other.args[0])
    rand = make_inputs(loaded, shapes=specs[:1], fill="rand", seed=1).args[0]
    assert torch.equal(rand, torch.rand(2, 3, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(make_inputs(loaded, shapes=specs, fill="ones").args[0], torch.ones(2, 3))
    zeros = make_inputs(loaded, shapes=specs, fill="zeros")
    assert torch.equal(zeros.args[1], torch.zeros(4)) and zeros.infos[1].source == "zeros"
    assert set(FILLS) == {"randn", "rand", "ones", "zeros"}
    with pytest.raises(UsageError) as excinfo:
        make_inputs(loaded, fill="randm")
    assert "randn" in (excinfo.value.hint or "")


def test_dtypes() -> None:
    loaded = user(tiny_models.Reused())
    ints, flags, halves = make_inputs(loaded, shapes=[
        InputSpec((100,), "int64"), InputSpec((100,), "bool"), InputSpec((3,), "float16")]).args
    assert ints.dtype == torch.int64 and 0 <= ints.min() and ints.max() < 10
    assert flags.dtype == torch.bool and flags.any() and not flags.all()
    generator = torch.Generator().manual_seed(0)
    torch.randint(0, 10, (100,), generator=generator)
    torch.randint(0, 2, (100,), generator=generator)
    assert torch.equal(halves, torch.randn(3, generator=generator).half())
    # no dtype given for an embedding model: integer ids within the vocabulary
    (ids,) = make_inputs(user(tiny_models.Tied()), shapes=[InputSpec((2, 50), None)]).args
    assert ids.dtype == torch.int64 and ids.max() < 10


def test_batch_size() -> None:
    loaded = user(tiny_models.Reused())
    spec = [InputSpec((2, 3, 8, 8), None)]
    assert make_inputs(loaded, shapes=spec, batch_size=4).args[0].shape == (4, 3, 8, 8)
    assert make_inputs(loaded, shapes=spec).args[0].shape == (2, 3, 8, 8)
    assert make_inputs(tv("resnet18"), batch_size=3).infos[0].shape == [3, 3, 224, 224]
    with pytest.raises(UsageError):
        make_inputs(loaded, batch_size=0)


# --------------------------------------------------------------------------- image files


def test_image_user_model_generic_preprocessing(tmp_path: Path) -> None:
    img = image(tmp_path / "cat.png", 300, 400)
    inputs = make_inputs(user(tiny_models.Reused()), files=[tmp_path / "cat.png"], batch_size=7)
    (batch,) = inputs.args
    assert batch.shape == (1, 3, 224, 224)
    assert torch.allclose(batch[0], generic(img))
    assert inputs.infos[0].source == f"image: {tmp_path / 'cat.png'}"
    assert inputs.infos[0].dtype == "float32"


def test_image_torchvision_uses_weights_transforms(tmp_path: Path) -> None:
    img = image(tmp_path / "cat.png", 300, 400)
    (batch,) = make_inputs(tv("resnet18"), files=[str(tmp_path / "cat.png")]).args
    expected = TF1.center_crop(TF1.resize(img, [256], antialias=True), [224, 224])
    expected = TF1.normalize(TF1.convert_image_dtype(expected, torch.float32), MEAN, STD)
    assert torch.allclose(batch[0], expected)
    (big,) = make_inputs(tv("inception_v3"), files=[str(tmp_path / "cat.png")]).args
    assert big.shape == (1, 3, 299, 299)


def test_image_folder_is_one_batch_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    for value, name in [(200, "b.png"), (10, "a.png"), (90, "c.jpg")]:
        # c.jpg holds PNG bytes: decoders go by content, so the values stay exact
        write_png(torch.full((3, 64, 80), value, dtype=torch.uint8), folder / name)
    (folder / "notes.txt").write_text("not an image")
    inputs = make_inputs(user(tiny_models.Reused()), files=[folder])
    (batch,) = inputs.args
    assert batch.shape == (3, 3, 224, 224)
    expected = [(v / 255 - MEAN[0]) / STD[0] for v in (10, 200, 90)]  # a, b, c
    assert batch[:, 0, 100, 100].tolist() == pytest.approx(expected, abs=1e-5)
    assert inputs.infos[0].source == f"images: {folder}/ (3 files)"


def test_several_images_and_pil_fallback(tmp_path: Path) -> None:
    first = image(tmp_path / "one.png", 240, 240, seed=1)
    second = torch.full((3, 250, 260), 77, dtype=torch.uint8)
    Image.fromarray(second.permute(1, 2, 0).numpy()).save(tmp_path / "two.bmp")
    (batch,) = make_inputs(user(tiny_models.Reused()),
                           files=[tmp_path / "two.bmp", tmp_path / "one.png"]).args
    assert torch.allclose(batch[0], generic(second)) and torch.allclose(batch[1], generic(first))


def test_images_for_other_families(tmp_path: Path) -> None:
    paths = [tmp_path / "f0.png", tmp_path / "f1.png"]
    small = image(paths[0], 40, 48)
    image(paths[1], 40, 48, seed=2)
    detection = make_inputs(tv("ssdlite320_mobilenet_v3_large"), files=paths)
    (images,) = detection.args
    assert isinstance(images, list) and len(images) == 2
    assert torch.allclose(images[0], small.float() / 255)
    assert "list of 2 images" in detection.infos[0].source
    flow = make_inputs(tv("raft_small"), files=paths)
    assert [a.shape for a in flow.args] == [(1, 3, 40, 48)] * 2
    assert torch.allclose(flow.args[0][0], small.float() / 255 * 2 - 1)
    (clip,) = make_inputs(tv("r3d_18"), files=paths).args
    assert clip.shape == (1, 3, 2, 112, 112)
    with pytest.raises(InputError, match="two images"):
        make_inputs(tv("raft_small"), files=paths[:1])


def test_images_of_different_sizes_after_preprocessing(tmp_path: Path) -> None:
    image(tmp_path / "wide.png", 30, 60)
    image(tmp_path / "tall.png", 60, 30)
    with pytest.raises(InputError, match="wide.png") as excinfo:
        make_inputs(tv("fcn_resnet50"), files=[tmp_path / "wide.png", tmp_path / "tall.png"])
    assert "tall.png" in str(excinfo.value)


# --------------------------------------------------------------------------- tensor files


def test_pt_files(tmp_path: Path) -> None:
    loaded = user(tiny_models.Reused())
    t, u = torch.randn(2, 4), torch.arange(3)
    torch.save(t, tmp_path / "t.pt")
    torch.save((t, u), tmp_path / "tuple.pth")
    torch.save({"x": t, "mask": u}, tmp_path / "dict.pt")
    single = make_inputs(loaded, files=[tmp_path / "t.pt"], batch_size=9)
    assert torch.equal(single.args[0], t) and single.infos[0].shape == [2, 4]
    assert single.infos[0].source == f"file: {tmp_path / 't.pt'}"
    pair = make_inputs(loaded, files=[tmp_path / "tuple.pth"])
    assert torch.equal(pair.args[1], u) and pair.infos[1].dtype == "int64"
    keyed = make_inputs(loaded, files=[tmp_path / "dict.pt"])
    assert keyed.args == () and torch.equal(keyed.kwargs["mask"], u)
    assert [i.name for i in keyed.infos] == ["x", "mask"]
    several = make_inputs(loaded, files=[tmp_path / "tuple.pth", tmp_path / "t.pt"])
    assert len(several.args) == 3 and torch.equal(several.args[2], t)


def test_numpy_files(tmp_path: Path) -> None:
    loaded = user(tiny_models.Reused())
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, dtype=np.int32)
    np.save(tmp_path / "a.npy", a)
    np.savez(tmp_path / "pos.npz", arr_10=b, arr_2=a)
    np.savez(tmp_path / "kw.npz", x=a, lengths=b)
    (single,) = make_inputs(loaded, files=[tmp_path / "a.npy"]).args
    assert torch.equal(single, torch.from_numpy(a))
    positional = make_inputs(loaded, files=[tmp_path / "pos.npz"])
    assert [list(x.shape) for x in positional.args] == [[2, 3], [4]]  # numeric order: 2, 10
    keyword = make_inputs(loaded, files=[tmp_path / "kw.npz"])
    assert keyword.args == () and keyword.kwargs["lengths"].dtype == torch.int32
    assert {i.name: i.dtype for i in keyword.infos} == {"x": "float32", "lengths": "int32"}


def test_safetensors_files(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    a, b = torch.randn(2, 3), torch.arange(5)
    safetensors_torch.save_file({"1": b, "0": a}, str(tmp_path / "pos.safetensors"))
    safetensors_torch.save_file({"input_ids": b}, str(tmp_path / "kw.safetensors"))
    loaded = user(tiny_models.Reused())
    positional = make_inputs(loaded, files=[tmp_path / "pos.safetensors"])
    assert torch.equal(positional.args[0], a) and torch.equal(positional.args[1], b)
    keyword = make_inputs(loaded, files=[tmp_path / "kw.safetensors"])
    assert torch.equal(keyword.kwargs["input_ids"], b)


# --------------------------------------------------------------------------- errors


def test_file_errors(tmp_path: Path) -> None:
    loaded = user(tiny_models.Reused())
    with pytest.raises(InputError, match="nope.png"):
        make_inputs(loaded, files=[tmp_path / "nope.png"])
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(InputError, match="x.txt") as excinfo:
        make_inputs(loaded, files=[tmp_path / "x.txt"])
    assert ".png" in (excinfo.value.hint or "") and ".npz" in (excinfo.value.hint or "")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="empty"):
        make_inputs(loaded, files=[tmp_path / "empty"])
    (tmp_path / "bad.png").write_bytes(b"\x89PNG but not really")
    with pytest.raises(InputError, match="bad.png"):
        make_inputs(loaded, files=[tmp_path / "bad.png"])
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(InputError, match="bad.pt"):
        make_inputs(loaded, files=[tmp_path / "bad.pt"])
    torch.save({"layer": nn.Linear(1, 1)}, tmp_path / "obj.pt")
    with pytest.raises(InputError, match="non-tensor"):
        make_inputs(loaded, files=[tmp_path / "obj.pt"])


def test_usage_errors(tmp_path: Path) -> None:
    loaded = user(tiny_models.Reused())
    image(tmp_path / "a.png", 8, 8)
    torch.save(torch.zeros(1), tmp_path / "t.pt")
    with pytest.raises(UsageError) as both:
        make_inputs(loaded, shapes=[InputSpec((1, 4), None)], files=[tmp_path / "a.png"])
    with pytest.raises(UsageError, match="mix") as mixed:
        make_inputs(loaded, files=[tmp_path / "a.png", tmp_path / "t.pt"])
    assert both.type is UsageError and mixed.type is UsageError


# --------------------------------------------------------------------------- --trust-pickle


def _pickled_batch(tmp_path: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A .pt input file holding a namedtuple of two tensors (weights_only loading refuses it)."""
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, 2, generator=generator), torch.randn(3, 2, generator=generator)
    torch.save(tiny_models.Batch(x, y), tmp_path / "batch.pt")
    return tmp_path / "batch.pt", x, y


def test_pickled_input_file_needs_trust_pickle(tmp_path: Path) -> None:
    loaded = user(tiny_models.TupleOut.Heads())
    path, x, y = _pickled_batch(tmp_path)
    with pytest.raises(InputError, match="batch.pt holds non-tensor") as excinfo:
        make_inputs(loaded, files=[path])
    assert "--trust-pickle" in (excinfo.value.hint or "")
    inputs = make_inputs(loaded, files=[path], trust_pickle=True)
    assert len(inputs.args) == 2 and torch.equal(inputs.args[0], x) and torch.equal(inputs.args[1], y)
    assert [i.source for i in inputs.infos] == [f"file: {path}[0]", f"file: {path}[1]"]
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(InputError, match="could not read input file .*bad.pt") as corrupt:
        make_inputs(loaded, files=[tmp_path / "bad.pt"], trust_pickle=True)
    assert "non-tensor" not in str(corrupt.value)
    torch.save(tiny_models.TrainState(), tmp_path / "state.pt")
    with pytest.raises(InputError, match="holds a TrainState, not a tensor"):
        make_inputs(loaded, files=[tmp_path / "state.pt"], trust_pickle=True)


def test_cli_trust_pickle_input(cli, tmp_path: Path) -> None:
    torch.manual_seed(11)
    heads = tiny_models.TupleOut.Heads()
    torch.save(heads.state_dict(), tmp_path / "heads.pt")  # plain tensors: no trust needed
    path, x, y = _pickled_batch(tmp_path)
    args = ["stats", "tiny_models:TupleOut.Heads", "--weights", tmp_path / "heads.pt", "--input", path, "-f", "json"]
    refused = cli(*args)
    assert refused.exit_code == 2 and refused.stdout == ""
    assert "non-tensor" in refused.stderr and "--trust-pickle" in refused.stderr
    result = cli(*args, "--trust-pickle")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [i["shape"] for i in report["inputs"]] == [[3, 2], [3, 2]]
    with torch.no_grad():
        expected = {"a": heads.a(x), "b": heads.b(y)}
    rows = {r["name"]: r for r in report["layers"]}
    assert set(rows) == {"a", "b"}
    for name, out in expected.items():
        stats = rows[name]["stats"]
        assert stats["mean"] == pytest.approx(out.mean().item(), rel=1e-5, abs=1e-6), name
        assert stats["std"] == pytest.approx(out.std(correction=0).item(), rel=1e-5), name
        assert stats["min"] == pytest.approx(out.min().item(), rel=1e-6), name
        assert stats["max"] == pytest.approx(out.max().item(), rel=1e-6), name
