"""Renderers: every format, golden table, colours, CSV/Markdown/JSON round trips (no torch)."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hookcli import records as rec
from hookcli.config import FORMATS
from hookcli.errors import OutputError
from hookcli.records import InputInfo, LayerRecord, ModelInfo, ParamRecord, Report
from hookcli.render import RENDERERS, OutputFormat, render
from hookcli.render import columns as cols
from hookcli.render import formats as fm
from hookcli.render.jsonfmt import sanitize
from timeouts import scaled_timeout

ANSI = re.compile(r"\x1b\[")
NAN, INF = float("nan"), float("inf")
ROOT = Path(__file__).resolve().parents[1]


def line_with(text: str, needle: str, *, start: bool = False) -> str:
    """The first line of ``text`` containing (or, with ``start``, starting with) ``needle``."""
    lines = text.splitlines()
    return next(ln for ln in lines if ln.startswith(needle) or (not start and needle in ln))


def _model() -> ModelInfo:
    return ModelInfo("tiny", "argument", "Tiny", params=1234567, trainable_params=1000000,
                     param_bytes=4938268, buffer_bytes=200000)


def _stats(mean: float, zero: float = 0.0, nan: int = 0, inf: int = 0) -> rec.Stats:
    return {"mean": mean, "std": 0.5, "min": -1.25, "max": 3.0, "norm": 12.3456789,
            "zero_fraction": zero, "nan_count": nan, "inf_count": inf}


def stats_report() -> Report:
    inputs = [InputInfo("0", [1, 3, 8, 8], "float32", "randn(seed=0)")]
    layers = [
        LayerRecord("conv", 0, "Conv2d", input_shapes=[[1, 3, 8, 8]], shape=[1, 4, 8, 8],
                    dtype="float32", params=112, stats=_stats(0.0123456)),
        LayerRecord("act", 0, "ReLU", calls=2, input_shapes=[[1, 4, 8, 8]], shape=[1, 4, 8, 8],
                    dtype="float32", stats=_stats(0.25, zero=0.5)),
        LayerRecord("act", 1, "ReLU", calls=2, input_shapes=[[1, 4, 8, 8]], shape=[1, 4, 8, 8],
                    dtype="float32", stats=_stats(0.0, zero=1.0)),
        LayerRecord("block.norm", 0, "BatchNorm2d", depth=2, input_shapes=[[1, 4, 8, 8]],
                    shape=[1, 4, 8, 8], dtype="float32", params=8,
                    stats={"mean": NAN, "std": NAN, "min": -INF, "max": INF, "norm": NAN,
                           "zero_fraction": 0.0, "nan_count": 12, "inf_count": 3}),
        LayerRecord("head", 0, "Argmax", output="[0]", input_shapes=[[1, 10]], shape=[1],
                    dtype="int64"),
        LayerRecord("aux", 0, "Linear", called=False, params=50),
    ]
    return Report("stats", _model(), inputs, layers=layers, version="0.1.0",
                  notes=["BatchNorm in eval mode uses running statistics"])


def shapes_report() -> Report:
    inputs = [InputInfo("0", [1, 3, 100, 100], "float32", "randn(seed=0)"),
              InputInfo("mask", [1, 10], "bool", "ones")]
    layers = [
        LayerRecord("conv", 0, "Conv2d", input_shapes=[[1, 3, 100, 100]], shape=[1, 64, 50, 50],
                    dtype="float32", params=1234567),
        LayerRecord("block", 0, "Sequential", input_shapes=[[1, 64, 50, 50]], shape=[1, 10],
                    dtype="float16", params=0),
        LayerRecord("block.fc", 0, "Linear", depth=2, input_shapes=[[1, 64], None], raised=True),
        LayerRecord("aux", 0, "Linear", called=False, params=50),
    ]
    failure = rec.FailureInfo("forward", "block.fc", "Linear", [[1, 64]], "RuntimeError",
                          "mat1 and mat2 shapes cannot be multiplied\n(1x64 and 32x10)")
    return Report("shapes", _model(), inputs, layers=layers, failure=failure)


def _grad(norm: float, nan: int = 0, abs_max: float | None = None) -> rec.GradStats:
    g: rec.GradStats = {"mean": 1e-5, "std": 2.5e-4, "min": -1.2e-3, "max": 1.3e-3,
                        "norm": norm, "nan_count": nan, "inf_count": 0}
    if abs_max is not None:
        g["abs_max"] = abs_max
    return g


def grads_report(clipped: bool = True) -> Report:
    inputs = [InputInfo("0", [1, 4], "float32", "randn(seed=0)")]
    layers = [
        LayerRecord("fc1", 0, "Linear", input_shapes=[[1, 4]], shape=[1, 8], dtype="float32",
                    params=40, grad=_grad(0.25), grad_input=[_grad(0.5)]),
        LayerRecord("fc2", 0, "Linear", input_shapes=[[1, 8]], shape=[1, 3], dtype="float32",
                    params=27, grad=_grad(NAN, nan=2)),
        LayerRecord("pick", 0, "Argmax", input_shapes=[[1, 3]], shape=[1], dtype="int64"),
    ]
    params = [
        ParamRecord("fc1.weight", [8, 4], True, 2.0, _grad(0.5, abs_max=1.3e-3),
                    clipped=3 if clipped else None),
        ParamRecord("fc2.weight", [3, 8], True, 0.0, _grad(0.1, abs_max=1e-3)),
        ParamRecord("fc2.bias", [3], False, 0.3, None),
    ]
    return Report("grads", _model(), inputs, layers=layers, params=params,
                  loss={"kind": "cross_entropy", "target": 0, "value": 6.9078})


def module_tree() -> rec.ModuleTree:
    return rec.ModuleTree(_model(), [
        rec.ModuleRow("", "Tiny", 0, 1234567, 0, 2),
        rec.ModuleRow("block", "Sequential", 1, 1234000, 0, 1),
        rec.ModuleRow("block.fc", "Linear", 2, 1234000, 1234000, 0),
        rec.ModuleRow("head", "Linear", 1, 567, 567, 0),
    ])


def model_list() -> rec.ModelList:
    return rec.ModelList("res*", [{"name": "resnet18", "family": "resnet"},
                              {"name": "resnext50_32x4d", "family": "resnext"}])


ALL = [stats_report, shapes_report, grads_report, module_tree, model_list]


# --------------------------------------------------------------------------- helpers


def test_format_helpers() -> None:
    assert fm.format_shape([1, 64, 56, 56]) == "[1, 64, 56, 56]"
    assert fm.format_shape([]) == "[]"
    assert fm.format_shape(None) == "-"
    assert fm.format_number(0.0123456) == "0.01235"
    assert fm.format_number(123456.0) == "1.235e+05"
    assert fm.format_number(-0.0) == "0"
    assert [fm.format_number(x) for x in (NAN, INF, -INF, None)] == ["nan", "inf", "-inf", "-"]
    assert fm.format_count(1234567) == "1,234,567"
    assert fm.format_count(None) == "-"


def test_every_format_has_its_own_renderer() -> None:
    """Each format's renderer writes that format (no format falls back to another's renderer)."""
    assert set(RENDERERS) == set(OutputFormat)
    report = stats_report()
    out = {fmt: RENDERERS[fmt].render(report, width=100) for fmt in OutputFormat}
    assert json.loads(out[OutputFormat.JSON]) == sanitize(report.to_dict())
    rows = list(csv.DictReader(io.StringIO(out[OutputFormat.CSV])))
    assert [(r["name"], r["call"]) for r in rows] == [(r.name, str(r.call)) for r in report.layers]
    assert out[OutputFormat.MARKDOWN].startswith("### stats: tiny\n") and "| :--- |" in out[OutputFormat.MARKDOWN]
    assert out[OutputFormat.TABLE] == render(report, "table", width=100) and "─" * 20 in out[OutputFormat.TABLE]
    assert len(set(out.values())) == len(OutputFormat)


@pytest.mark.parametrize("make", ALL)
@pytest.mark.parametrize("fmt", list(OutputFormat))
def test_every_renderer_renders_every_report(make, fmt: OutputFormat) -> None:
    text = render(make(), fmt, width=100)
    assert text.endswith("\n") and text.strip()
    assert not ANSI.search(text)  # color=False (the default): no escape codes at all


def test_format_parsing() -> None:
    assert OutputFormat.parse("JSON") is OutputFormat.JSON
    assert OutputFormat.parse("md") is OutputFormat.MARKDOWN
    assert render(model_list(), "csv") == render(model_list(), OutputFormat.CSV)
    with pytest.raises(OutputError, match="unknown output format") as info:
        render(model_list(), "jsn")
    assert "json" in (info.value.hint or "")
    assert fm.format_for_path("out/report.JSON") is OutputFormat.JSON
    assert fm.format_for_path("r.md") is OutputFormat.MARKDOWN
    assert fm.format_for_path("r.dat") is None
    assert set(FORMATS) == {f.value for f in OutputFormat}  # config validates --format values


# --------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("make", ALL)
def test_json_round_trip(make) -> None:
    report = make()
    data = json.loads(render(report, "json"))
    assert data == sanitize(report.to_dict())


def test_json_maps_non_finite_floats_to_strings() -> None:
    text = render(stats_report(), OutputFormat.JSON)
    assert "NaN" not in text and "Infinity" not in text
    norm = json.loads(text)["layers"][3]["stats"]
    assert (norm["mean"], norm["min"], norm["max"], norm["nan_count"]) == ("nan", "-inf", "inf", 12)
    assert json.loads(text)["layers"][0]["stats"]["mean"] == 0.0123456


# --------------------------------------------------------------------------- table

def test_golden_stats_table(golden) -> None:
    """Every kind of row (nested, reused, NaN/Inf, all zero, integer output, not called) at width 100."""
    golden("tables/render_stats.txt", render(stats_report(), "table", width=100, color=False))




def test_narrow_table_crops_names_and_text_but_keeps_numbers() -> None:
    text = render(stats_report(), "table", width=70)
    lines = text.splitlines()
    assert all(len(line) <= 70 for line in lines)
    assert "0.01235" in text and "-1.25" in text
    assert "12.35" in text or "left out Norm" in text  # issue 13: a column may be left out, never silently
    assert any("…" in line for line in lines)
    assert any(line.startswith("  block.norm") for line in lines)
    assert all(len(line) <= 40 for line in render(stats_report(), "table", width=40).splitlines())


def test_color_marks_anomalies() -> None:
    text = render(stats_report(), "table", width=100, color=True)
    assert ANSI.search(text)
    assert "\x1b[1;31m" in line_with(text, "block.norm")  # NaN/Inf: bold red
    assert "\x1b[33m" in line_with(text, "act#1")  # all zero: yellow
    assert "\x1b[2m" in line_with(text, "aux")  # not called: dim
    assert "31m" not in line_with(text, "act#0")


def test_markup_like_labels_are_literal() -> None:
    report = stats_report()
    report.layers[0].output = "['out']"
    report.layers[0].name = "[bold]x"
    text = render(report, "table", width=100)
    assert "[bold]x['out']" in text


def test_shapes_table_footer_and_rows() -> None:
    report = shapes_report()
    text = render(report, "table", width=160)
    assert "input mask: [1, 10] bool ones" in text
    assert "[1, 3, 100, 100]" in text and "[1, 64, 50, 50]" in text
    assert "1,234,567" in text
    # 1*3*100*100*4 + 1*10*1 bytes = 120010 -> 0.12 MB; outputs 64*50*50*4 + 10*2 = 640020 -> 0.64
    footer = ("Total params: 1,234,567 · Trainable: 1,000,000 · Params size: 4.94 MB · "
              "Buffers: 0.20 MB · Input size: 0.12 MB · Output size (selected layers): 0.64 MB")
    assert footer in text
    fc = line_with(text, "block.fc")
    assert fc.startswith("  block.fc") and "raised" in fc and "[1, 64], -" in fc
    assert "not called" in line_with(text, "aux", start=True)
    assert ("the model raised in forward at block.fc (Linear) with input shape(s) 1x64: RuntimeError: "
            "mat1 and mat2 shapes cannot be multiplied (1x64 and 32x10)") in text
    lines = render(shapes_report(), "table", width=80).splitlines()  # footer breaks between parts
    assert any(line.startswith("Total params: 1,234,567") for line in lines)
    assert any(line.startswith("  Input size: 0.12 MB") or line.startswith("  Buffers")
               for line in lines)


def test_raised_and_not_called_styles() -> None:
    text = render(shapes_report(), "table", width=160, color=True)
    assert "\x1b[31m" in line_with(text, "block.fc")
    assert "\x1b[2m" in line_with(text, "not called")


def test_grads_tables() -> None:
    text = render(grads_report(), "table", width=160)
    assert "loss: 6.908 (cross_entropy, target=0)" in text
    assert "Input grad norm" in text
    assert "Parameters" in text and "Clipped" in text and "Ratio" in text
    fc1 = line_with(text, "fc1.weight", start=True)
    assert "[8, 4]" in fc1 and "0.25" in fc1 and fc1.rstrip().endswith("3")  # ratio 0.5/2, clipped
    fc2w = line_with(text, "fc2.weight", start=True)
    assert "inf" not in fc2w  # zero weight norm: no ratio, not a meaningless inf
    assert "frozen" in line_with(text, "fc2.bias", start=True)
    assert "no grad" in line_with(text, "pick", start=True)
    assert "Clipped" not in render(grads_report(clipped=False), "table", width=160)
    report = grads_report()
    report.params = None
    assert "Parameters" not in render(report, "table", width=160)


def test_module_tree_and_model_list() -> None:
    text = render(module_tree(), "table", width=100)
    lines = text.splitlines()
    assert any(line.startswith("(model)") and "1,234,567" in line for line in lines)
    assert any(line.startswith("    block.fc") for line in lines)
    assert "Own params" in text and "4 modules" in text
    text = render(model_list(), "table", width=100)
    assert "resnext50_32x4d" in text and "2 models" in text and "pattern: res*" in text


# --------------------------------------------------------------------------- CSV


def _csv(report) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(render(report, "csv"))))


def test_csv_layers() -> None:
    rows = _csv(stats_report())
    assert len(rows) == 6
    first = rows[0]
    assert first["kind"] == "layer" and first["name"] == "conv" and first["call"] == "0"
    assert first["input_shapes"] == "1x3x8x8" and first["shape"] == "1x4x8x8"
    assert float(first["stat_mean"]) == 0.0123456  # full precision
    assert [f"stat_{k}" in first for k in rec.STAT_KEYS] == [True] * len(rec.STAT_KEYS)
    assert math.isnan(float(rows[3]["stat_mean"])) and rows[3]["stat_min"] == "-inf"
    assert rows[4]["output"] == "[0]" and rows[4]["stat_mean"] == ""
    assert rows[5]["called"] == "false" and rows[5]["shape"] == ""
    assert not any(k.startswith("grad_") for k in first)


def test_csv_grads_with_param_rows() -> None:
    rows = _csv(grads_report())
    assert [r["kind"] for r in rows] == ["layer"] * 3 + ["param"] * 3
    assert rows[0]["grad_norm"] == "0.25" and rows[0]["grad_input_norm"] == "0.5"
    p = rows[3]
    assert p["name"] == "fc1.weight" and p["shape"] == "8x4" and p["requires_grad"] == "true"
    assert p["norm"] == "2.0" and p["grad_abs_max"] == "0.0013" and p["clipped"] == "3"
    assert p["call"] == "" and p["type"] == ""
    assert rows[5]["grad_mean"] == "" and rows[5]["requires_grad"] == "false"


def test_csv_module_tree_and_model_list() -> None:
    rows = _csv(module_tree())
    assert rows[0]["name"] == "" and rows[2] == {
        "name": "block.fc", "type": "Linear", "depth": "2", "params": "1234000",
        "own_params": "1234000", "children": "0"}
    assert _csv(model_list())[1] == {"name": "resnext50_32x4d", "family": "resnext"}


@pytest.mark.parametrize("make", [stats_report, shapes_report, grads_report])
def test_table_columns_are_a_subset_of_csv_columns(make) -> None:
    report = make()
    groups: list[list[cols.Column[Any]]] = [list(cols.layer_columns(report))]
    if report.params:
        groups.append(list(cols.param_columns(report)))
    for group in groups:
        shown = {c.key for c in cols.table_columns(group)} - {"ratio"}
        assert shown <= {c.key for c in cols.csv_columns(group)}


# --------------------------------------------------------------------------- Markdown


def test_markdown() -> None:
    text = render(stats_report(), "markdown")
    assert text.startswith("### stats: tiny\n")
    assert "| Layer | Type | Shape | Mean | Std | Min | Max | Norm | Zero % | NaN | Inf |" in text
    assert "| :--- | :--- | :--- | ---: |" in text
    assert "| conv | Conv2d | [1, 4, 8, 8] | 0.01235 |" in text
    assert "6 rows · 1 with NaN/Inf" in text


def test_markdown_escapes_pipes_and_renders_params() -> None:
    report = grads_report()
    report.layers[0].name = "a|b"
    text = render(report, "markdown")
    assert "a\\|b" in text
    assert "#### Parameters" in text and "| Parameter | Shape |" in text
    assert "loss: 6.908 (cross_entropy, target=0)" in text
    assert "**the model raised in forward at block.fc" in render(shapes_report(), "markdown")
    text = render(model_list(), "markdown")
    assert text.startswith("### models: res*") and "| resnet18 | resnet |" in text


# --------------------------------------------------------------------------- no torch


def test_rendering_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "import hookcli.render, hookcli.config, hookcli.output\n"
        "from test_render import ALL\n"
        "for make in ALL:\n"
        "    for fmt in hookcli.render.OutputFormat:\n"
        "        hookcli.render.render(make(), fmt, width=100, color=True)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=scaled_timeout(60))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
