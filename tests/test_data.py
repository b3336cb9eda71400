"""Statistics over a whole data set (``--data``, ``--batches``, ``--batch-size``; ``data=`` in Python).

Every number is checked against plain torch: the test runs the same model on the same batches with
its own forward hooks, concatenates each layer's outputs over all batches and computes float64
statistics over the concatenation."""

from __future__ import annotations

import gc
import json
import math
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch import nn

import hookcli
from hookcli.errors import InputError, UsageError
from hookcli.records import LayerRecord

MODEL_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    image_size = 32  # hookcli preprocesses images to this crop

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc(self.pool(self.relu(self.conv(x))).flatten(1))
'''


def write_model(tmp_path: Path) -> str:
    (tmp_path / "net.py").write_text(MODEL_FILE)
    return f"{tmp_path / 'net.py'}:Net"


def make_images(folder: Path, count: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (36, 40, 3), dtype=np.uint8)).save(folder / f"{i:03d}.png")


def preprocess(path: Path) -> torch.Tensor:
    """The generic preprocessing docs/options.md describes, written out with torchvision: shorter side
    to crop / 0.875, centre crop, [0, 1], ImageNet mean and std."""
    import torchvision.transforms.v2.functional as F
    from torchvision.io import read_image

    img = read_image(str(path))
    img = F.center_crop(F.resize(img, [int(32 / 0.875)], antialias=True), [32, 32])
    return F.normalize(F.to_dtype(img, torch.float32, scale=True), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def reference(model: nn.Module, batches: list[tuple[tuple, dict]]) -> dict[str, dict[str, float]]:
    """Plain torch: each direct child's outputs over all batches, float64 statistics of their concatenation."""
    outs: dict[str, list[torch.Tensor]] = {}
    handles = [m.register_forward_hook(lambda m, i, o, name=name: outs.setdefault(name, []).append(o.detach()))
               for name, m in model.named_children()]
    with torch.no_grad():
        for args, kwargs in batches:
            model(*args, **kwargs)
    for h in handles:
        h.remove()
    stats = {}
    for name, chunks in outs.items():
        x = torch.cat([c.reshape(-1) for c in chunks]).double()
        stats[name] = {"mean": x.mean().item(), "std": x.std(correction=0).item(), "min": x.min().item(),
                       "max": x.max().item(), "norm": torch.linalg.vector_norm(x).item(),
                       "zero_fraction": (x == 0).sum().item() / x.numel(), "numel": x.numel()}
    return stats


def assert_rows_match(layers: list[dict], ref: dict[str, dict[str, float]]) -> None:
    assert [row["name"] for row in layers] == list(ref)
    for row in layers:
        got, want = row["stats"], ref[row["name"]]
        assert got["min"] == want["min"] and got["max"] == want["max"], row["name"]  # exact
        assert got["zero_fraction"] == want["zero_fraction"], row["name"]  # exact counts
        for key in ("mean", "std", "norm"):
            assert math.isclose(got[key], want[key], rel_tol=1e-9, abs_tol=1e-12), (row["name"], key)


# --------------------------------------------------------------------------- a folder of images


def test_stats_over_a_folder_of_50_images_equals_torch_over_all_50(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    make_images(tmp_path / "imgs", 50)
    result = cli("stats", spec, "--data", tmp_path / "imgs", "--batch-size", "8", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    images = sorted((tmp_path / "imgs").iterdir())
    model = _load(tmp_path)
    batches = [((torch.stack([preprocess(p) for p in images[i:i + 8]]),), {}) for i in range(0, 50, 8)]
    assert_rows_match(report["layers"], reference(model, batches))
    assert "7 batches, 50 samples" in report["inputs"][0]["source"]
    assert report["inputs"][0]["shape"] == [8, 3, 32, 32]


def test_a_tree_of_class_folders_mixed_modes_and_sizes_equals_torch_over_all(cli, tmp_path: Path) -> None:
    """Class subfolders, PNG and JPEG, grayscale, RGBA and RGB of different sizes, 7 images at 3 a batch
    (the last batch short); a symlink to the folder itself, a hidden folder and a text file are not
    read. Plain torch: PIL's RGB conversion (grayscale repeated, alpha dropped), the generic preprocessing."""
    import torchvision.transforms.v2.functional as F

    spec = write_model(tmp_path)
    root, rng = tmp_path / "set", np.random.default_rng(3)
    files = {"cat/a.png": ("RGB", (36, 40)), "cat/b.png": ("L", (50, 33)), "cat/c.jpg": ("RGB", (64, 48)),
             "dog/d.png": ("RGBA", (40, 40)), "dog/e.PNG": ("RGB", (90, 37)), "dog/small/f.png": ("L", (32, 32)),
             "g.png": ("RGBA", (45, 70))}
    for name, (mode, (h, w)) in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shape = (h, w) if mode == "L" else (h, w, len(mode))
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        if name.endswith(".jpg"):  # one flat colour: JPEG decoders (PIL's, torchvision's) agree to the bit
            pixels[:] = pixels[0, 0]
        Image.fromarray(pixels, mode).save(root / name)
    (root / "dog" / "loop").symlink_to(root, target_is_directory=True)
    (root / ".hidden").mkdir()
    Image.fromarray(np.zeros((36, 40, 3), dtype=np.uint8)).save(root / ".hidden" / "copy.png")
    (root / "labels.txt").write_text("cat\ndog\n")
    result = cli("stats", spec, "--data", root, "--batch-size", "3", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert "(7 images), 3 batches, 7 samples" in report["inputs"][0]["source"]

    def expected(path: Path) -> torch.Tensor:
        with Image.open(path) as im:
            img = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        img = F.center_crop(F.resize(img, [int(32 / 0.875)], antialias=True), [32, 32])
        return F.normalize(F.to_dtype(img, torch.float32, scale=True), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    order = sorted(root / name for name in files)
    batches = [((torch.stack([expected(p) for p in order[i:i + 3]]),), {}) for i in range(0, 7, 3)]
    assert_rows_match(report["layers"], reference(_load(tmp_path), batches))


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".safetensors"])
def test_npy_npz_and_safetensors_data_files_equal_torch_over_the_whole_tensor(cli, tmp_path: Path,
                                                                              suffix: str) -> None:
    spec = write_model(tmp_path)
    data = torch.randn(11, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    path = tmp_path / f"set{suffix}"
    if suffix == ".npy":
        np.save(path, data.numpy())
    elif suffix == ".npz":
        np.savez(path, x=data.numpy())  # keyed by forward's argument name
    else:
        from safetensors.torch import save_file
        save_file({"0": data}, path)  # key "0": the first positional input
    result = cli("stats", spec, "--data", path, "--batch-size", "4", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert "3 batches, 11 samples" in report["inputs"][0]["source"]
    batches = [((data[i:i + 4],), {}) for i in range(0, 11, 4)]
    assert_rows_match(report["layers"], reference(_load(tmp_path), batches))


def test_token_ids_of_a_tiny_language_model_equal_torch_over_all_batches(cli, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "lm")
    ids = torch.randint(0, 50, (10, 12), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    for command in ("stats", "check"):
        result = cli(command, f"hf:{tmp_path / 'lm'}", "--data", tmp_path / "ids.safetensors", "--batch-size", "3",
                     "--eval", "-f", "json")
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout)
        report = report.get("report", report)
        assert "4 batches, 10 samples" in report["inputs"][0]["source"]
        model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "lm").eval()
        logits = []
        with torch.no_grad():
            for i in range(0, 10, 3):
                logits.append(model(input_ids=ids[i:i + 3]).logits)
        x = torch.cat([t.reshape(-1) for t in logits]).double()
        row = next(r for r in report["layers"] if r["name"] == "lm_head")
        assert row["stats"]["min"] == x.min().item() and row["stats"]["max"] == x.max().item()
        assert math.isclose(row["stats"]["mean"], x.mean().item(), rel_tol=1e-9)
        assert math.isclose(row["stats"]["std"], x.std(correction=0).item(), rel_tol=1e-9)


def test_a_16_bit_tiff_is_scaled_by_65535_and_a_float_one_is_refused(cli, tmp_path: Path) -> None:
    """PIL's RGB conversion clips: a 16-bit TIFF came out white (255) and a float TIFF black (0), silently.
    A constant 16-bit grey image of 13107 (0.2 x 65535) is 0.2 in every channel, as a 16-bit PNG is."""
    import torchvision.transforms.v2.functional as F

    spec = write_model(tmp_path)
    (tmp_path / "imgs").mkdir()
    Image.fromarray(np.full((36, 40), 13107, dtype=np.uint16)).save(tmp_path / "imgs" / "grey16.tif")
    with Image.open(tmp_path / "imgs" / "grey16.tif") as im:
        assert im.mode.startswith("I;16")  # the case under test: PIL reads it, torchvision does not
    result = cli("stats", spec, "--data", tmp_path / "imgs", "-f", "json")
    assert result.exit_code == 0, result.stderr
    x = F.to_dtype(torch.full((1, 3, 32, 32), 13107, dtype=torch.uint16), torch.float32, scale=True)
    assert x[0, 0, 0, 0].item() == pytest.approx(0.2)
    x = F.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    assert_rows_match(json.loads(result.stdout)["layers"], reference(_load(tmp_path), [((x,), {})]))
    Image.fromarray(np.full((36, 40), 0.5, dtype=np.float32)).save(tmp_path / "imgs" / "depth.tif")
    result = cli("stats", spec, "--data", tmp_path / "imgs")
    assert result.exit_code == 2 and result.stdout == ""
    first, hint = result.stderr.splitlines()
    assert "depth.tif" in first and "32-bit float" in first and hint.startswith("  hint: ")


def _load(tmp_path: Path) -> nn.Module:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_test_data_net", tmp_path / "net.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net().eval()


# --------------------------------------------------------------------------- an iterable of dict batches

DATA_FILE = '''
import torch
from torch.utils.data import DataLoader, Dataset


class Rows(Dataset):
    def __len__(self):
        return 23

    def __getitem__(self, i):
        return {"x": torch.sin(torch.arange(48, dtype=torch.float32) * 0.37 + i).reshape(3, 4, 4) * (1 + i % 5)}


loader = DataLoader(Rows(), batch_size=5)
'''


def test_stats_through_a_dataloader_of_dict_batches_in_a_file(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text(DATA_FILE)
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:loader", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    rows = [{"x": torch.sin(torch.arange(48, dtype=torch.float32) * 0.37 + i).reshape(3, 4, 4) * (1 + i % 5)}
            for i in range(23)]
    batches = [((), {"x": torch.stack([r["x"] for r in rows[i:i + 5]])}) for i in range(0, 23, 5)]
    assert_rows_match(report["layers"], reference(_load(tmp_path), batches))
    assert report["inputs"][0]["name"] == "x"
    assert "5 batches, 23 samples" in report["inputs"][0]["source"]


def test_batches_caps_the_count_and_the_statistics_are_of_those_batches(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text(DATA_FILE)
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:loader", "--batches", "2", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    rows = [torch.sin(torch.arange(48, dtype=torch.float32) * 0.37 + i).reshape(3, 4, 4) * (1 + i % 5)
            for i in range(10)]
    batches = [((), {"x": torch.stack(rows[i:i + 5])}) for i in (0, 5)]
    assert_rows_match(report["layers"], reference(_load(tmp_path), batches))
    assert "2 batches, 10 samples" in report["inputs"][0]["source"]


# --------------------------------------------------------------------------- Python: data= of any kind


@settings(max_examples=15, deadline=None)
@given(samples=st.integers(1, 40), batch=st.integers(1, 16), scale=st.floats(1e-3, 1e3))
def test_api_data_tensor_sliced_equals_torch_over_the_whole_tensor(samples: int, batch: int, scale: float) -> None:
    model = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3)).eval()
    data = torch.randn(samples, 6, generator=torch.Generator().manual_seed(samples)) * scale
    report = hookcli.stats(model, data=data, batch_size=batch)
    # (fresh tensors, as hookcli copies each batch: a view's alignment may change a matmul's last bit)
    ref = reference(model, [((data[i:i + batch].clone(),), {}) for i in range(0, samples, batch)])
    assert_rows_match([r.to_dict() for r in report.layers], ref)
    assert f"{-(-samples // batch)} batch" in report.inputs[0].source


def test_api_data_list_of_tuples_and_a_generator_with_batches() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 4, generator=gen),) for _ in range(4)]
    report = hookcli.stats(model, data=batches)
    assert_rows_match([r.to_dict() for r in report.layers], reference(model, [(b, {}) for b in batches]))

    def endless() -> Iterator[torch.Tensor]:
        while True:
            yield torch.ones(2, 4)

    with pytest.raises(InputError, match="no length"):
        hookcli.stats(model, data=endless())
    report = hookcli.stats(model, data=endless(), batches=3)
    assert "3 batches, 6 samples" in report.inputs[0].source


# --------------------------------------------------------------------------- memory stays flat


def test_kept_records_and_tensors_do_not_grow_with_the_number_of_batches() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)]).eval()
    live: dict[int, tuple[int, int]] = {}

    def count() -> tuple[int, int]:  # (a function: the list of every object is gone when it returns)
        gc.collect()
        objects = gc.get_objects()
        return sum(type(o) is LayerRecord for o in objects), sum(type(o) is torch.Tensor for o in objects)

    def batches() -> Iterator[torch.Tensor]:
        for index in range(30):
            if index in (3, 29):  # between batches: what the run holds on to now
                live[index] = count()
            yield torch.randn(4, 8)

    hookcli.stats(model, data=batches(), batches=30)
    assert live[3][0] > 0  # the rows kept so far are seen
    assert live[29] == live[3]


# --------------------------------------------------------------------------- bad data


def test_a_batch_of_another_shape_is_the_models_failure_naming_the_batch_with_the_rows_so_far(
        cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    good = torch.randn(12, 3, 8, 8)
    bad = torch.randn(4, 5, 8, 8)  # 5 channels: conv raises
    (tmp_path / "data.py").write_text(textwrap.dedent(f'''
        import torch
        batches = [torch.load({str(tmp_path / "good.pt")!r})[i:i + 4] for i in range(0, 12, 4)]
        batches.append(torch.load({str(tmp_path / "bad.pt")!r}))
    '''))
    torch.save(good, tmp_path / "good.pt")
    torch.save(bad, tmp_path / "bad.pt")
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:batches", "-f", "json")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: batch 3: ")
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout)
    assert report["partial"] is True
    # the rows gathered so far: each layer merged over the three good batches
    ref = reference(_load(tmp_path), [((good[i:i + 4],), {}) for i in range(0, 12, 4)])
    fc = next(r for r in report["layers"] if r["name"] == "fc")
    assert math.isclose(fc["stats"]["mean"], ref["fc"]["mean"], rel_tol=1e-9)


@pytest.mark.parametrize("command", ["stats", "grads", "check"])
def test_a_corrupt_image_mid_run_is_exit_2_naming_the_batch_with_the_rows_before_it(cli, tmp_path: Path,
                                                                                   command: str) -> None:
    """Bad data met after batches ran is bad input (exit 2), and, as when the model raises, the rows of
    the batches that ran go to stdout marked partial; the error line names the batch."""
    spec = write_model(tmp_path)
    make_images(tmp_path / "imgs", 8)
    images = sorted((tmp_path / "imgs").iterdir())
    (tmp_path / "imgs" / "004.png").write_bytes(b"not a png")  # the 5th file: batch 2 at 2 per batch
    result = cli(command, spec, "--data", tmp_path / "imgs", "--batch-size", "2", "-f", "json")
    assert result.exit_code == 2, result.stderr
    first, hint = result.stderr.splitlines()
    assert first.startswith("Error: batch 2: ") and "004.png" in first and hint.startswith("  hint: ")
    report = json.loads(result.stdout)
    assert report["partial"] is True and report["failure"]["phase"] == "data"
    assert "2 batches, 4 samples" in report["inputs"][0]["source"]
    assert [row["name"] for row in report["layers"]] == ["conv", "relu", "pool", "fc"]
    if command != "grads":  # activation statistics of the first 4 images, as plain torch sees them
        batches = [((torch.stack([preprocess(p) for p in images[i:i + 2]]),), {}) for i in (0, 2)]
        assert_rows_match(report["layers"], reference(_load(tmp_path), batches))
    table = cli(command, spec, "--data", tmp_path / "imgs", "--batch-size", "2")
    assert table.exit_code == 2 and "PARTIAL: bad data" in table.stdout and "Traceback" not in table.stderr


def test_api_a_bad_batch_after_two_raises_data_error_carrying_their_rows() -> None:
    from hookcli.errors import DataError

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()
    good = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with pytest.raises(DataError) as err:
        hookcli.stats(model, data=[good[0], good[1], "not a batch"])
    assert err.value.exit_code == 2 and err.value.message.startswith("batch 2 is a str")
    report = err.value.report
    assert report is not None and report.partial and report.failure.phase == "data"
    with torch.no_grad():
        want = torch.cat([model(x) for x in good]).double()
    row = next(r for r in report.layers if r.name == "1")
    assert row.stats["max"] == want.max().item() and row.stats["zero_fraction"] == (want == 0).double().mean().item()
    assert math.isclose(row.stats["mean"], want.mean().item(), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("source, words", [
    ("batches = []", "gave no batches"),
    ("batches = [__import__('torch').ones(2, 3, 8, 8), 'text']", "batch 1 is a str"),
    ("batches = [__import__('torch').ones(2, 3, 8, 8), {'y': __import__('torch').ones(2, 3, 8, 8)}]", "batch 1:"),
    ("batches = 7", "not an iterable"),
    ("def batches(n):\n    yield n", "takes arguments (n)"),
    ("def batches():\n    raise ValueError('no data here')", "calling --data"),
    ("def batches():\n    return 7", "batches' returned a int, not an iterable"),
])
def test_bad_data_is_one_line_and_exit_2(cli, tmp_path: Path, source: str, words: str) -> None:
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text(source + "\n")
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:batches")
    assert result.exit_code == 2, result.stderr
    assert words in result.stderr.splitlines()[0]
    assert "hint:" in result.stderr and "Traceback" not in result.stderr
    if "batch 1" in words:  # met after batch 0 ran: its rows go to stdout, marked partial
        report = json.loads(cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:batches", "-f", "json").stdout)
        assert report["partial"] is True and "1 batch, 2 samples" in report["inputs"][0]["source"]
    else:
        assert result.stdout == ""


def test_a_dataloader_of_inputs_and_labels_is_exit_2_saying_labels_go_to_forward_too(cli, tmp_path: Path) -> None:
    """The commonest data set, (images, labels) pairs: the labels would be forward's second argument.
    Exit 2 naming batch 0, and a hint about --data, not about --input-shape."""
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text(textwrap.dedent('''
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        loader = DataLoader(TensorDataset(torch.randn(10, 3, 8, 8), torch.zeros(10, dtype=torch.long)), batch_size=4)
    '''))
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:loader")
    assert result.exit_code == 2 and result.stdout == ""
    first, hint = result.stderr.splitlines()
    assert first.startswith("Error: batch 0: Net.forward cannot take the 2 inputs given (4x3x8x8, 4)")
    assert "(inputs, labels)" in hint and "--input-shape" not in hint


def test_a_generator_function_or_a_loader_factory_is_called_for_its_batches(cli, tmp_path: Path) -> None:
    """``--data data.py:batches`` naming a generator function, or a ``make_loader()`` returning a
    DataLoader, was refused ('a function, not an iterable'): a function of no arguments is called
    (seeded, as a DataLoader is read) and its iterable run; the numbers equal torch's over its batches."""
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text(textwrap.dedent('''
        import torch
        from torch.utils.data import DataLoader

        DATA = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(6))

        def batches():
            for start in range(0, 10, 4):
                yield DATA[start:start + 4]

        def make_loader():
            return DataLoader(DATA, batch_size=3)
    '''))
    data = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    for attr, extra, size in (("batches", ("--batches", "9"), 4), ("make_loader", (), 3)):
        result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:{attr}", *extra, "-f", "json")
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout)
        assert f"{attr}(), {-(-10 // size)} batches, 10 samples" in report["inputs"][0]["source"]
        assert_rows_match(report["layers"],
                          reference(_load(tmp_path), [((data[i:i + size],), {}) for i in range(0, 10, size)]))
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:batches")  # a generator: no length
    assert result.exit_code == 2 and result.stdout == "" and "--batches" in result.stderr


@pytest.mark.parametrize("last", [4, 2])
def test_a_list_of_batches_in_a_data_file_is_refused_saying_how_to_save_it(cli, tmp_path: Path, last: int) -> None:
    """A list of batches cannot be told from one batch of positional inputs (a list of tensors with a
    leading dimension either way): exit 2 whose hint says how to save a data set, and what it says
    works, equal to torch over those batches."""
    spec = write_model(tmp_path)
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(n, 3, 8, 8, generator=gen) for n in (4, 4, last)]
    torch.save(batches, tmp_path / "list.pt")
    result = cli("stats", spec, "--data", tmp_path / "list.pt")
    assert result.exit_code == 2 and result.stdout == ""
    first, hint = result.stderr.splitlines()
    assert first.startswith("Error: ") and "Traceback" not in result.stderr
    assert "torch.save(torch.cat(batches), PATH)" in hint and "--batch-size" in hint
    torch.save(torch.cat(batches), tmp_path / "set.pt")
    result = cli("stats", spec, "--data", tmp_path / "set.pt", "--batch-size", "4", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert_rows_match(json.loads(result.stdout)["layers"], reference(_load(tmp_path), [((b,), {}) for b in batches]))


def test_one_image_file_as_data_says_to_give_its_folder(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    make_images(tmp_path / "imgs", 1)
    result = cli("stats", spec, "--data", tmp_path / "imgs" / "000.png")
    assert result.exit_code == 2 and result.stdout == ""
    first, hint = result.stderr.splitlines()
    assert "not one image file" in first and "folder" in hint and "--input" in hint


def test_an_endless_iterable_needs_batches(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text("import itertools, torch\nbatches = itertools.repeat(torch.ones(2, 3, 8, 8))\n")
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:batches")
    assert result.exit_code == 2 and "--batches" in result.stderr
    result = cli("stats", spec, "--data", f"{tmp_path / 'data.py'}:batches", "--batches", "3", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert "3 batches, 6 samples" in json.loads(result.stdout)["inputs"][0]["source"]


def test_data_options_that_do_not_go_together(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    result = cli("stats", spec, "--batches", "3")
    assert result.exit_code == 2 and "--batches needs --data" in result.stderr
    result = cli("stats", spec, "--data", tmp_path, "--input-shape", "1x3x8x8")
    assert result.exit_code == 2 and "mutually exclusive" in result.stderr
    result = cli("stats", spec, "--data", "os:environ")
    assert result.exit_code == 2 and "standard library" in result.stderr
    with pytest.raises(UsageError, match="taken by stats, grads and check only"):
        hookcli.shapes(nn.Linear(2, 2), data=[torch.ones(1, 2)])


def test_a_tensor_file_with_a_leading_batch_dimension_is_sliced(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    data = torch.randn(19, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    torch.save(data, tmp_path / "set.pt")
    result = cli("stats", spec, "--data", tmp_path / "set.pt", "--batch-size", "6", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert_rows_match(report["layers"],
                      reference(_load(tmp_path), [((data[i:i + 6],), {}) for i in range(0, 19, 6)]))
    assert "4 batches, 19 samples" in report["inputs"][0]["source"]


@pytest.mark.parametrize("dtype, lossy", [(torch.float64, True), (torch.float16, False), (torch.bfloat16, False)])
def test_a_float_data_or_input_file_of_another_dtype_is_cast_to_the_models(cli, tmp_path: Path,
                                                                           dtype: torch.dtype, lossy: bool) -> None:
    """A float64 array (numpy's default) or a float16 file on a float32 model was the model's failure
    (exit 1, 'mat1 and mat2 must have the same dtype'): hookcli fed it. Now the file's floats are cast
    to the model's dtype, as images are, with a note in the input's source when the cast can change
    values (float64 -> float32); the numbers equal torch's on the cast tensor."""
    spec = write_model(tmp_path)
    data = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    path = tmp_path / ("set.npy" if dtype == torch.float64 else "set.pt")
    np.save(path, data.numpy()) if dtype == torch.float64 else torch.save(data, path)
    note = "float64 cast to float32"
    result = cli("stats", spec, "--data", path, "--batch-size", "4", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    source = report["inputs"][0]["source"]
    assert report["inputs"][0]["dtype"] == "float32" and "3 batches, 10 samples" in source
    assert (note in source) is lossy
    cast = data.float()
    assert_rows_match(report["layers"], reference(_load(tmp_path), [((cast[i:i + 4],), {}) for i in range(0, 10, 4)]))
    result = cli("stats", spec, "--input", path, "-f", "json")  # one batch: the same rule
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert (note in report["inputs"][0]["source"]) is lossy
    assert_rows_match(report["layers"], reference(_load(tmp_path), [((cast,), {})]))


def test_a_float64_file_under_dtype_float64_is_not_rounded_through_float32(cli, tmp_path: Path) -> None:
    """With --dtype the file's floats go to that dtype directly: float64 values stay float64 (no note)."""
    spec = write_model(tmp_path)
    data = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * (1 + 1e-12)
    np.save(tmp_path / "set.npy", data.numpy())
    result = cli("stats", spec, "--data", tmp_path / "set.npy", "--dtype", "float64", "-f", "json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["inputs"][0]["dtype"] == "float64" and "cast" not in report["inputs"][0]["source"]
    assert_rows_match(report["layers"], reference(_load(tmp_path).double(), [((data,), {})]))


# --------------------------------------------------------------------------- grads over batches


def _float64_stats(x: torch.Tensor) -> dict[str, float]:
    x = x.reshape(-1).double()
    return {"mean": x.mean().item(), "std": x.std(correction=0).item(), "min": x.min().item(),
            "max": x.max().item(), "norm": torch.linalg.vector_norm(x).item()}


def _close(got: dict, want: dict, what: str) -> None:
    """Equal but for float32 summation order (a mean near 0 is judged on the scale of the values)."""
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6 * want["norm"]), (what, key, got[key], value)


def test_grads_over_batches_parameters_of_the_mean_loss_layers_per_batch_merged(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    data = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    torch.save(data, tmp_path / "set.pt")
    result = cli("grads", spec, "--data", tmp_path / "set.pt", "--batch-size", "4", "--params", "all", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    model = _load(tmp_path)
    params = dict(model.named_parameters())
    batches = [data[i:i + 4] for i in range(0, 10, 4)]
    # plain torch: cross-entropy on class 0 (--loss auto on [batch, classes] logits, --target 0) of each batch
    losses, outs = [], {}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: outs.setdefault(name, []).append(o))
             for name, m in model.named_children()]
    for x in batches:
        logits = model(x)
        losses.append(nn.functional.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long)))
    for h in hooks:
        h.remove()
    mean_loss = torch.stack(losses).mean()
    grads = torch.autograd.grad(mean_loss, list(params.values()), retain_graph=True)
    for row in report["params"]:
        _close(row["grad"], _float64_stats(grads[list(params).index(row["name"])]), row["name"])
    # each layer: the gradient of its batch's loss w.r.t. its output, statistics over all batches
    for row in report["layers"]:
        per_batch = [torch.autograd.grad(loss, out, retain_graph=True)[0]
                     for loss, out in zip(losses, outs[row["name"]])]
        _close(row["grad"], _float64_stats(torch.cat([g.reshape(-1) for g in per_batch])), row["name"])
    assert math.isclose(report["loss"]["value"], mean_loss.item(), rel_tol=1e-6)
    assert "3 batches, 10 samples" in report["inputs"][0]["source"]


def test_grads_over_batches_refuses_what_it_does_not_merge(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    torch.save(torch.randn(4, 3, 8, 8), tmp_path / "set.pt")
    result = cli("grads", spec, "--data", tmp_path / "set.pt", "--clip", "1")
    assert result.exit_code == 2 and "--clip cannot go with --data" in result.stderr


def test_a_shuffling_dataloader_leaves_the_callers_rng_and_gives_the_same_numbers_each_run() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Sequential(nn.Linear(3, 3)).eval()
    rows = torch.randn(12, 3, generator=torch.Generator().manual_seed(2))
    loader = DataLoader(TensorDataset(rows), batch_size=5, shuffle=True)  # items: 1-tuples
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = hookcli.stats(model, data=loader)
    assert torch.equal(torch.get_rng_state(), before)
    second = hookcli.stats(model, data=loader)
    assert [r.stats for r in first.layers] == [r.stats for r in second.layers]
    # the order of the samples does not change statistics over all of them
    assert_rows_match([r.to_dict() for r in first.layers], reference(model, [((rows,), {})]))


def test_a_progress_bar_on_stderr_counts_the_batches(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from hookcli import progress

    monkeypatch.setattr(progress, "_enabled", True)  # what the CLI's progress.enable() sets on a terminal
    model = nn.Sequential(nn.Linear(3, 3)).eval()
    hookcli.stats(model, data=[torch.ones(2, 3)] * 3)
    hookcli.grads(model, data=[torch.ones(2, 3)] * 4)
    captured = capsys.readouterr()
    assert "3/3 batches" in captured.err and "4/4 batches" in captured.err
    assert captured.out == ""


# --------------------------------------------------------------------------- Python: tensors as inputs


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)  # changes its input in place
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc(self.act(x))
        return out if y is None else out + y


def test_api_inputs_take_tensors_tuples_and_dicts_and_leave_them_as_they_were() -> None:
    model = TwoInputs().eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    y = torch.randn(3, 2, generator=torch.Generator().manual_seed(5))
    kept_x = x.clone()
    for value, args, kwargs in [(x, (x,), {}), ((x, y), (x, y), {}), ({"x": x, "y": y}, (), {"x": x, "y": y})]:
        report = hookcli.stats(model, inputs=value)
        assert torch.equal(x, kept_x)  # the in-place ReLU ran on a copy
        assert_rows_match([r.to_dict() for r in report.layers],
                          reference(model, [(tuple(a.clone() for a in args),
                                             {k: v.clone() for k, v in kwargs.items()})]))
        assert report.inputs[0].source.startswith("python: inputs")
    grads = hookcli.grads(model, inputs={"x": x})
    assert grads.params and torch.equal(x, kept_x)
    hookcli.stats(model, data=[x, x])
    hookcli.stats(model, data=x, batch_size=2)
    assert torch.equal(x, kept_x)


# --------------------------------------------------------------------------- a config's data


def test_a_configs_data_is_the_repositorys_own(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text(DATA_FILE)
    config = tmp_path / "hookcli.toml"
    config.write_text(f'model = "{spec}"\ndata = "data.py:loader"\nbatches = 2\nformat = "json"\n')
    result = cli("stats", "--config", config)
    assert result.exit_code == 0, result.stderr
    assert "2 batches, 10 samples" in json.loads(result.stdout)["inputs"][0]["source"]
    for data, words in [("numpy:ones", "not the repository's own code"), ("os:environ", "standard library"),
                        ("/etc", "outside the config's directory")]:
        config.write_text(f'model = "{spec}"\ndata = "{data}"\n')
        result = cli("stats", "--config", config)
        assert result.exit_code == 2, (data, result.stderr)
        assert words in result.stderr and "'data'" in result.stderr
        assert result.stdout == ""


def test_a_configs_data_function_is_called_only_if_it_is_the_repositorys_own(cli, tmp_path: Path) -> None:
    """``--data pkg:fn`` calls a function for its batches. From a config, a function the repository's
    module only re-exports (``from os import getpid``: any zero-argument callable of any library) is
    refused before it is called, exit 2; the repository's own loader function is still called; and the
    same re-export named on the command line is the user's choice (called, then refused as no data)."""
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text(DATA_FILE + "\n\ndef make_loader():\n    return loader\n")
    (tmp_path / "reexport.py").write_text("from os import getpid as fn\n")
    config = tmp_path / "hookcli.toml"
    config.write_text(f'model = "{spec}"\ndata = "data.py:make_loader"\nbatches = 2\nformat = "json"\n')
    result = cli("stats", "--config", config)
    assert result.exit_code == 0, result.stderr
    assert "make_loader()" in json.loads(result.stdout)["inputs"][0]["source"]
    config.write_text(f'model = "{spec}"\ndata = "reexport.py:fn"\n')
    result = cli("stats", "--config", config)
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and "refusing data" in lines[0] and "getpid" in lines[0] and "not the repository's own code" in lines[0]
    assert result.stdout == ""
    result = cli("stats", spec, "--data", f"{tmp_path / 'reexport.py'}:fn")  # the user's own command line
    assert result.exit_code == 2 and "returned a int" in result.stderr


def test_grads_over_batches_a_batch_the_model_cannot_take_names_it(cli, tmp_path: Path) -> None:
    spec = write_model(tmp_path)
    (tmp_path / "data.py").write_text("import torch\nbatches = [torch.ones(2, 3, 8, 8), torch.ones(2, 3, 8, 8), "
                                      "torch.ones(2, 5, 8, 8)]\n")
    result = cli("grads", spec, "--data", f"{tmp_path / 'data.py'}:batches", "-f", "json")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: batch 2: the model raised in forward at conv")
    report = json.loads(result.stdout)
    assert report["partial"] is True
    assert next(r for r in report["layers"] if r["name"] == "fc")["grad"]["norm"] > 0  # merged from batches 0, 1


class Branchy(nn.Module):
    """Calls ``extra`` only on batches whose sum is positive, and returns a batch-long sequence from ``grow``."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(2, 2)
        self.extra = nn.Linear(2, 2)
        self.grow = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.main(x)
        if x.sum() > 0:
            y = self.extra(y)
        return self.grow(y.repeat(1, int(x[0, 0].abs().item()) + 1))


def test_rows_that_did_not_run_in_every_batch_or_changed_shape_are_noted() -> None:
    batches = [torch.full((2, 2), 1.0), torch.full((2, 2), -1.0), torch.full((2, 2), 2.0)]
    model = Branchy().eval()
    report = hookcli.stats(model, data=batches)
    assert "extra ran in 2 of 3 batches: its statistics are over those" in report.notes
    assert any(n.startswith("grow: the output shape varies between batches") for n in report.notes)
    extra = next(r for r in report.layers if r.name == "extra")
    with torch.no_grad():
        outs = torch.cat([hookcli_free(model, b) for b in (batches[0], batches[2])])
    assert math.isclose(extra.stats["mean"], outs.double().mean().item(), rel_tol=1e-9, abs_tol=1e-12)


def hookcli_free(model: Branchy, x: torch.Tensor) -> torch.Tensor:
    """``extra``'s output on ``x``, with plain torch."""
    return model.extra(model.main(x)).reshape(-1)


# --------------------------------------------------------------------------- check over batches

LOG_NET = '''
import torch
from torch import nn


class LogNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.fc(torch.log(x)))


good = [torch.full((2, 2), 2.0), torch.full((2, 2), 3.0)]
bad = good + [torch.full((2, 2), -1.0)]  # log of a negative number: NaN in the third batch only
'''


def test_check_over_batches_rules_see_every_batch(cli, tmp_path: Path) -> None:
    (tmp_path / "lognet.py").write_text(LOG_NET)
    spec = f"{tmp_path / 'lognet.py'}:LogNet"
    result = cli("check", spec, "--data", f"{tmp_path / 'lognet.py'}:good", "-f", "json")
    assert result.exit_code == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert "2 batches, 4 samples" in report["report"]["inputs"][0]["source"]
    result = cli("check", spec, "--data", f"{tmp_path / 'lognet.py'}:bad", "-f", "json")
    assert result.exit_code == 1, result.stdout + result.stderr
    failed = {r["rule"] for r in json.loads(result.stdout)["rules"] if r["status"] == "FAIL"}
    assert failed == {"finite", "grad_norm"}  # NaN activations, and the mean loss's NaN gradients
    # the first batch alone passes: the failure comes from the merged statistics
    torch.save(torch.full((2, 2), 2.0), tmp_path / "first.pt")
    assert cli("check", spec, "--input", tmp_path / "first.pt").exit_code == 0


def test_grads_over_many_bfloat16_batches_sum_parameter_gradients_in_float32() -> None:
    model = nn.Sequential(nn.Linear(8, 4)).eval()
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randn(3, 8, generator=gen) * (1 + i % 3) for i in range(40)]
    report = hookcli.grads(model, data=batches, dtype="bfloat16", loss="sum", params="all")
    # plain torch: each batch's gradient in bfloat16 (as the run computes it), their mean in float64
    copy = nn.Sequential(nn.Linear(8, 4)).to(torch.bfloat16)
    copy.load_state_dict(model.state_dict())
    per_batch = [torch.autograd.grad(copy(x.to(torch.bfloat16)).sum(), copy[0].weight)[0].double() for x in batches]
    want = torch.stack(per_batch).mean(0)
    got = next(p for p in report.params if p.name == "0.weight").grad
    assert math.isclose(got["norm"], torch.linalg.vector_norm(want).item(), rel_tol=1e-4)
    assert math.isclose(got["mean"], want.mean().item(), rel_tol=1e-4, abs_tol=1e-4 * got["norm"])
