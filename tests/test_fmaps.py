"""``hookcli fmaps``: the PNG against channels normalised in the test, selection, bars, errors."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
from reference import dummy
import tiny_models as tm
import torch
from torch import nn

import hookcli
from hookcli.errors import UsageError

PAD, PAD_VALUE = 2, 0.5  # what fmaps gives make_grid


def decode(path: Path) -> torch.Tensor:
    from torchvision.io import decode_png, read_file

    with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_png(read_file(str(path)))


def quantize(x: torch.Tensor) -> torch.Tensor:
    """What torchvision.utils.save_image does to [0, 1] floats."""
    return x.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)


def normalized(channel: torch.Tensor) -> torch.Tensor:
    lo, hi = channel.min(), channel.max()
    return torch.zeros_like(channel) if hi == lo else (channel - lo) / (hi - lo)


def grid_dims(n: int, h: int, w: int) -> tuple[int, int, int, int]:
    """make_grid's layout with nrow = ceil(sqrt(n)): (columns, rows, height px, width px)."""
    cols = min(math.ceil(math.sqrt(n)), n)
    rows = math.ceil(n / cols)
    return cols, rows, rows * (h + PAD) + PAD, cols * (w + PAD) + PAD


def tile(image: torch.Tensor, k: int, cols: int, h: int, w: int) -> torch.Tensor:
    row, col = divmod(k, cols)
    y, x = row * (h + PAD) + PAD, col * (w + PAD) + PAD
    return image[0, y:y + h, x:x + w]


def resnet18_conv1(x: torch.Tensor) -> torch.Tensor:
    from torchvision.models import resnet18

    torch.manual_seed(0)  # hookcli seeds the random initialisation with --seed
    model = resnet18(weights=None).eval()
    with torch.no_grad():
        return model.conv1(x)


def test_grid_png_matches_channels_normalised_in_the_test(cli, tmp_path: Path) -> None:
    out = tmp_path / "conv1.png"
    result = cli("fmaps", "resnet18", "--layer", "conv1", "--input-shape", "1x3x64x64", "--output", out)
    assert result.exit_code == 0, result.output
    assert "conv1 (Conv2d)" in result.stdout and "64 of 64 channels shown" in result.stdout
    assert f"saved to {out}" in result.stdout and "image 274x274 px" in result.stdout
    image = decode(out)
    cols, rows, height, width = grid_dims(64, 32, 32)  # conv1 maps are 32x32: no upscaling
    assert (cols, rows) == (8, 8)
    assert image.shape == (1, height, width) == (1, 274, 274)
    maps = resnet18_conv1(dummy(1, 3, 64, 64))[0]
    for k in (0, 13, 63):
        assert torch.equal(tile(image, k, cols, 32, 32), quantize(normalized(maps[k]))), k
    assert image[0, 0, 0] == image[0, 0, -1] == quantize(torch.tensor(PAD_VALUE))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv1.png"]


def test_channel_list_and_sample(cli, tmp_path: Path) -> None:
    out = tmp_path / "sel.png"
    result = cli("fmaps", "resnet18", "--layer", "conv1", "--input-shape", "2x3x64x64", "--channels", "0,5,7",
                 "--sample", "1", "-o", out, "-f", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["shown"] == [0, 5, 7] and data["sample"] == 1 and data["grid"] == [2, 2]
    assert data["layer"]["shape"] == [2, 64, 32, 32] and len(data["channels"]) == 64
    image = decode(out)
    cols, _, height, width = grid_dims(3, 32, 32)
    assert image.shape == (1, height, width) == (1, 70, 70)
    maps = resnet18_conv1(dummy(2, 3, 64, 64))[1]
    for k, channel in enumerate((0, 5, 7)):
        assert torch.equal(tile(image, k, cols, 32, 32), quantize(normalized(maps[channel]))), channel
    empty = tile(image, 3, cols, 32, 32)  # the fourth cell has no channel: padding colour
    assert bool((empty == quantize(torch.tensor(PAD_VALUE))).all())


def test_small_maps_are_upscaled_and_dead_constant_channels_reported(tmp_path: Path) -> None:
    conv = nn.Conv2d(1, 3, kernel_size=1)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, 0.0, 0.0]).reshape(3, 1, 1, 1))
        conv.bias.copy_(torch.tensor([0.0, 0.0, 0.7]))  # channel 1 all zero, channel 2 constant
    model = nn.Sequential(conv)
    result = hookcli.fmaps(model, layer="0", input_shapes=["1x1x5x6"], output=tmp_path / "c.png")
    assert [c.status for c in result.channels] == ["ok", "dead", "constant"]
    assert result.scale == 7 and result.tile == [35, 42]  # ceil(32 / 5): tiles at least 32 px
    image = decode(tmp_path / "c.png")
    cols, _, height, width = grid_dims(3, 35, 42)
    assert image.shape == (1, height, width) and result.image_size == [width, height]
    x = dummy(1, 1, 5, 6)[0, 0]
    expected = quantize(normalized(x)).repeat_interleave(7, 0).repeat_interleave(7, 1)
    assert torch.equal(tile(image, 0, cols, 35, 42), expected)
    assert not tile(image, 1, cols, 35, 42).any() and not tile(image, 2, cols, 35, 42).any()
    from hookcli.render import render

    table = render(result, "table", width=100)
    assert "dead or constant channels" in table and "1 dead · 1 constant" in table
    rows = [line.split()[:2] for line in table.splitlines() if line.split()[-1:] in (["yes"], ["no"])]
    assert rows == [["1", "dead"], ["2", "constant"]]  # only the channels worth a look


def test_linear_output_is_a_bar_strip(tmp_path: Path) -> None:
    model = tm.Reused().eval()
    result = hookcli.fmaps(model, layer="head", input_shapes=["2x4"], sample=1, output=tmp_path / "b.png")
    assert result.kind == "bars" and result.grid == [1, 3] and result.shown == [0, 1, 2]
    x = dummy(2, 4)
    with torch.no_grad():
        values = model(x)[1]
    image = decode(tmp_path / "b.png")
    bar_h, bar_w = 64, 8
    assert image.shape == (1, bar_h + 2 * PAD, 3 * (bar_w + PAD) + PAD)
    heights = torch.round(normalized(values) * bar_h).to(torch.int64)
    for k in range(3):
        column = tile(image, k, 3, bar_h, bar_w)[:, 0]
        assert int((column == 255).sum()) == int(heights[k])
        assert bool((column[bar_h - int(heights[k]):] == 255).all())  # filled from the bottom


def test_call_picks_the_call_of_a_reused_module(cli, tmp_path: Path) -> None:
    result = cli("fmaps", "tiny_models:Reused", "--layer", "act", "--call", "2", "--input-shape", "1x4",
                 "-o", tmp_path / "a.png", "-f", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["layer"]["label"] == "act#2" and data["layer"]["calls"] == 3 and data["kind"] == "bars"
    torch.manual_seed(0)
    model = tm.Reused().eval()
    a2 = tm.reused_calls(model, dummy(1, 4))["act#2"][0]
    assert [c["max"] for c in data["channels"]] == pytest.approx(a2.tolist())
    assert [c["status"] == "dead" for c in data["channels"]] == (a2 == 0).tolist()


def test_output_key_picks_a_tensor_of_a_tuple_output(tmp_path: Path) -> None:
    result = hookcli.fmaps(tm.TupleOut(), layer="split", output_key="1", input_shapes=["2x4"])
    assert result.output == "[1]" and result.label == "split[1]" and result.image is not None
    assert result.path is None and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, needle", [
    (["tiny_models:TupleOut", "--layer", "split", "--output-key", "2", "--input-shape", "2x4"], "int64"),
    (["tiny_models:TupleOut", "--layer", "split", "--input-shape", "2x4"], "--output-key"),
    (["tiny_models:TinyLSTM", "--layer", "lstm", "--output-key", "0"], "(batch, channels, height, width)"),
    (["tiny_models:Reused", "--layer", "actt", "--input-shape", "1x4"], "act"),
    (["tiny_models:Reused", "--layer", "act", "--call", "3", "--input-shape", "1x4"], "called 3 times"),
    (["tiny_models:Reused", "--layer", "head", "--sample", "2", "--input-shape", "2x4"], "--sample 2"),
    (["tiny_models:Reused", "--layer", "head", "--channels", "0,3", "--input-shape", "1x4"], "3 features"),
    (["tiny_models:Reused", "--layer", "head", "--channels", "x"], "--channels"),
    (["tiny_models:Reused", "--layer", "*", "--input-shape", "1x4"], "matches"),
])
def test_outputs_that_cannot_be_drawn_exit_2_and_write_nothing(cli, tmp_path: Path, args: list[str],
                                                                needle: str) -> None:
    result = cli("fmaps", *args, "-o", tmp_path / "x.png")
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, needle", [
    ("x.jpg", "PNG"), ("afile/sub/x.png", "not a directory"), ("afile/x.png", "not a directory")])
def test_bad_output_path_exits_2_before_running(cli, tmp_path: Path, name: str, needle: str) -> None:
    (tmp_path / "afile").write_text("x")
    result = cli("fmaps", "tiny_models:Reused", "--layer", "head", "-o", tmp_path / name)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_options_are_validated_in_python_too() -> None:
    with pytest.raises(UsageError):
        hookcli.fmaps(tm.Reused(), layer="head", channels="3-1")
    with pytest.raises(UsageError):
        hookcli.fmaps(tm.Reused(), layer="head", sample=-1)
    with pytest.raises(UsageError):
        hookcli.fmaps(tm.Reused(), layer="head", scale=0)
    with pytest.raises(UsageError):
        hookcli.fmaps(tm.Reused(), layer="head,act")


def test_one_by_one_maps_become_bars() -> None:
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.AdaptiveAvgPool2d(1))
    result = hookcli.fmaps(model, layer="1", input_shapes=["1x3x8x8"], channels="all")
    assert result.kind == "bars" and len(result.shown) == 5 and any("1x1" in n for n in result.notes)
