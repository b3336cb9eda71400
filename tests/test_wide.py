"""Issue 13, reading wide models: tables readable at 80 columns that never cut silently (--width,
--no-truncate), grads --top/--sort, modules --depth, containers, and channels-last feature maps."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.render.table import crop_middle, fold

LONG = "encoder_with_a_really_long_name"
LEAF = "attention_block_number_zero_projection"


class Wide(nn.Module):
    """Long module names, a ModuleDict and a ModuleList (containers, never called themselves)."""

    def __init__(self) -> None:
        super().__init__()
        setattr(self, LONG, nn.ModuleDict({LEAF: nn.Linear(8, 8)}))
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = getattr(self, LONG)[LEAF](x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def build() -> nn.Module:
    torch.manual_seed(0)
    return Wide()


SPEC = f"{__file__}:build"


def test_80_columns_shortens_names_in_the_middle_and_says_so(cli) -> None:
    out = cli("grads", SPEC, "--input-shape", "2x3x5x7x8", "--all", "--params", "all", "--width", "80")
    assert out.exit_code == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert f"{LONG}.{LEAF}.weight" not in out.stdout
    assert any("…" in line and "weight" in line for line in lines)  # the end of a shortened name is kept
    assert "to fit 80 columns" in out.stdout and "--no-truncate" in out.stdout
    full = cli("grads", SPEC, "--input-shape", "2x3x5x7x8", "--all", "--params", "all", "--no-truncate")
    assert f"{LONG}.{LEAF}.weight" in full.stdout and "[2, 3, 5, 7, 8]" in full.stdout
    assert "to fit" not in full.stdout and "…" not in full.stdout
    data = json.loads(cli("grads", SPEC, "--input-shape", "2x3x5x7x8", "--all", "--params", "all",
                          "--width", "80", "-f", "json").stdout)
    assert f"{LONG}.{LEAF}.weight" in [p["name"] for p in data["params"]]


def test_wide_enough_table_has_no_note(cli) -> None:
    out = cli("stats", SPEC, "--input-shape", "2x8", "--width", "400")
    assert out.exit_code == 0 and "to fit" not in out.stdout and "…" not in out.stdout


@settings(max_examples=30, deadline=None)
@given(text=st.text(alphabet="abcdefghij._0123456789", min_size=1, max_size=60), width=st.integers(4, 40),
       indent=st.integers(0, 6))
def test_crop_middle_fits_and_keeps_both_ends(text: str, width: int, indent: int) -> None:
    name = " " * indent + text
    short = crop_middle(name, width)
    assert len(short) <= width
    if len(name) <= width:
        assert short == name
    else:
        assert "…" in short
        head, _, tail = short.strip(" ").partition("…")
        assert text.startswith(head) and text.endswith(tail)


@settings(max_examples=30, deadline=None)
@given(dims=st.lists(st.integers(1, 100_000), min_size=1, max_size=8), width=st.integers(8, 30))
def test_fold_keeps_every_dimension(dims: list[int], width: int) -> None:
    shape = "[" + ", ".join(map(str, dims)) + "]"
    folded, cut = fold(shape, width)
    assert not cut
    assert all(len(line) <= width for line in folded.split("\n"))
    assert folded.replace("\n", "").replace(" ", "") == shape.replace(" ", "")


def test_containers_are_not_reported_as_not_called(cli) -> None:
    report = hookcli.stats(build(), input_shapes=["2x8"], all_modules=True)
    rows = {r.name: r for r in report.layers}
    assert rows["blocks"].container and not rows["blocks"].called
    assert rows[LONG].container
    assert not rows["head"].container and rows["head"].called
    assert report.to_dict()["layers"][[r.name for r in report.layers].index("blocks")]["container"] is True
    out = cli("stats", SPEC, "--input-shape", "2x8", "--all", "--no-truncate")
    row = next(line for line in out.stdout.splitlines() if line.startswith("blocks "))
    assert "container" in row and "not called" not in row
    assert "0 not called" in out.stdout and "2 containers" in out.stdout


def _reference_param_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))
    named = list(model.named_parameters())
    return dict(zip([n for n, _ in named], torch.autograd.grad(loss, [p for _, p in named])))


@pytest.mark.parametrize("sort", ["norm", "max", "name"])
def test_grads_sort_and_top(sort: str, tmp_path) -> None:
    model = build()
    x = torch.randn(4, 8)
    path = tmp_path / "x.pt"
    torch.save(x, path)
    grads = _reference_param_grads(model, x)
    key = {"norm": lambda n: -float(grads[n].norm()), "max": lambda n: -float(grads[n].abs().max()),
           "name": lambda n: n}[sort]
    expected = sorted(grads, key=key)
    report = hookcli.grads(model, inputs=[str(path)], params="all", sort=sort, top=3, all_modules=True)
    assert [p.name for p in report.params] == expected[:3]
    assert len(report.layers) == 3 and any("top 3" in n for n in report.notes)
    report = hookcli.grads(model, inputs=[str(path)], params="all", sort=sort)
    assert [p.name for p in report.params] == expected


def test_grads_top_and_sort_on_the_command_line(cli) -> None:
    out = cli("grads", SPEC, "--input-shape", "2x8", "--params", "all", "--top", "2", "--sort", "name",
              "-f", "json")
    assert out.exit_code == 0, out.stderr
    names = [p["name"] for p in json.loads(out.stdout)["params"]]
    assert names == sorted(n for n, _ in build().named_parameters())[:2]
    bad = cli("grads", SPEC, "--input-shape", "2x8", "--sort", "size")
    assert bad.exit_code == 2 and "size" in bad.stderr and bad.stdout == ""


def test_modules_depth(cli) -> None:
    model = build()
    for depth in (0, 1, 2):
        tree = hookcli.modules(model, depth=depth)
        expected = [n for n, _ in model.named_modules() if (n.count(".") + 1 if n else 0) <= depth]
        assert [m.name for m in tree.modules] == expected
    out = cli("modules", SPEC, "--depth", "1", "-f", "json")
    assert out.exit_code == 0
    assert [m["name"] for m in json.loads(out.stdout)["modules"]] == ["", LONG, "blocks", "head"]


class ChannelsLast(nn.Module):
    """A Swin-like stage: its output is [batch, height, width, channels]."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 5, 3, padding=1)
        self.stage = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(self.proj(x).permute(0, 2, 3, 1))


@pytest.mark.parametrize("channel_dim", [None, -1, 3])
def test_fmaps_channels_last(channel_dim: int | None, tmp_path) -> None:
    torch.manual_seed(0)
    model = ChannelsLast()
    x = torch.randn(2, 3, 6, 6)
    path = tmp_path / "x.pt"
    torch.save(x, path)
    result = hookcli.fmaps(model, layer="stage", inputs=[str(path)], sample=1, channel_dim=channel_dim)
    with torch.no_grad():
        maps = model(x)[1].permute(2, 0, 1)  # (C, H, W) of sample 1
    assert len(result.channels) == 5 and result.tile[0] % 6 == 0
    for record, m in zip(result.channels, maps):
        assert record.min == pytest.approx(float(m.min()), rel=1e-5)
        assert record.max == pytest.approx(float(m.max()), rel=1e-5)
        assert record.mean == pytest.approx(float(m.mean()), rel=1e-4, abs=1e-6)
    assert any("channels-last" in n for n in result.notes)
    first = hookcli.fmaps(model, layer="stage", inputs=[str(path)], channel_dim=1)
    assert len(first.channels) == 6  # dim 1 (height) taken as channels when asked to


def test_fmaps_channel_dim_on_the_command_line(cli, tmp_path) -> None:
    torch.manual_seed(0)
    out = cli("fmaps", f"{__file__}:ChannelsLast", "--layer", "stage", "--input-shape", "1x3x6x6",
              "--channel-dim", "-1", "-o", tmp_path / "m.png")
    assert out.exit_code == 0, out.stderr
    assert (tmp_path / "m.png").read_bytes().startswith(b"\x89PNG")
    bad = cli("fmaps", f"{__file__}:ChannelsLast", "--layer", "stage", "--input-shape", "1x3x6x6",
              "--channel-dim", "2")
    assert bad.exit_code == 2 and bad.stdout == ""


def test_sort_by_name_orders_block_numbers_by_value() -> None:
    """``blocks.9`` comes before ``blocks.10`` (not after ``blocks.1``, as a plain string sort puts it)."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    report = hookcli.grads(model, input_shapes=["2x4"], params="all", sort="name", all_modules=True)
    expected = [f"{i}.{kind}" for i in range(12) for kind in ("bias", "weight")]
    assert [p.name for p in report.params] == expected
    assert [r.name for r in report.layers] == [str(i) for i in range(12)]
