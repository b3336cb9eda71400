"""``hookcli report LOG`` / ``hookcli.report``: a watch log read back (docs/watch.md "Reading the log").

Logs are made here by ``hookcli.watch`` on a tiny model (a healthy run, and one whose input gets a NaN
at step 5: an error finding). The numbers are checked against plain torch computed during the same
training loop (the test's own forward hook, ``torch.autograd.grad``, the weights before and after
``optimizer.step``). The terminal view is pinned by golden files (colour off) of two committed logs,
tests/golden/watch/*.jsonl, which ``pytest --update-docs`` rewrites with ``make_log`` (as it does the
golden tables). The HTML page is checked for the layer names, its figures and no network URL.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from torch import nn

import hookcli
from hookcli.errors import InputError, LayerNotFoundError, UsageError
from hookcli.render import render
from hookcli.render.report import LEVELS, Scale, bucket_value, buckets, scale
from timeouts import scaled_timeout

WATCH_LOGS = Path(__file__).resolve().parent / "golden" / "watch"
LAYERS = ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]


class Blocks(nn.Module):
    """stem -> blocks (Linear, ReLU, Linear) -> head: the watch's default rows are all five modules."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


def make_log(path: Path, steps: int, nan_at: int | None = None) -> dict[str, list[float]]:
    """Train ``Blocks`` for ``steps`` steps under ``hookcli.watch(every=1, out=path)``; at step ``nan_at``
    one input value is NaN (the run's first NaN: an error finding). Returns plain torch's float64
    values of blocks.0 at each step: its output's RMS, its output gradient's RMS, its weight's update
    ratio, and the loss."""
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    refs: dict[str, list[float]] = {"rms": [], "grad.rms": [], "update_ratio": [], "loss": []}
    seen: list[torch.Tensor] = []
    handle = model.blocks[0].register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        with hookcli.watch(model, optimizer, every=1, out=path) as w:
            for step in range(steps):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(16, 4, generator=g)
                if step == nan_at:
                    x[0, 0] = math.nan
                seen.clear()
                loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                (grad,) = torch.autograd.grad(loss, seen[0], retain_graph=True)
                loss.backward()
                before = model.blocks[0].weight.detach().clone().double()
                optimizer.step()
                after = model.blocks[0].weight.detach().double()
                optimizer.zero_grad()
                w.step(loss=loss)
                refs["rms"].append(float(seen[0].detach().double().pow(2).mean().sqrt()))
                refs["grad.rms"].append(float(grad.double().pow(2).mean().sqrt()))
                refs["update_ratio"].append(float((after - before).norm() / before.norm()))
                refs["loss"].append(float(loss.detach()))
    finally:
        handle.remove()
    return refs


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[float]]]:
    path = tmp_path_factory.mktemp("report") / "runs" / "healthy.jsonl"
    return path, make_log(path, steps=12)


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "nan.jsonl"
    make_log(path, steps=8, nan_at=5)
    return path


@pytest.fixture
def committed(request: pytest.FixtureRequest):
    """A committed log of tests/golden/watch/ (rewritten by make_log under ``--update-docs``)."""
    update = bool(request.config.getoption("--update-docs"))

    def get(name: str, steps: int, nan_at: int | None = None) -> Path:
        path = WATCH_LOGS / name
        if update:
            path.unlink(missing_ok=True)
            make_log(path, steps, nan_at)
        return path

    return get


def _close(actual: list[float | None], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a is not None and a == pytest.approx(e, rel=1e-5, abs=1e-12)


# --------------------------------------------------------------------------- the numbers


@pytest.mark.parametrize("stat", ["rms", "grad.rms", "update_ratio"])
def test_report_values_are_plain_torchs(healthy, stat: str) -> None:
    path, refs = healthy
    report = hookcli.report(path, stat=stat)
    assert report.stat == stat and report.steps == list(range(12))
    row = "blocks.0.weight" if stat == "update_ratio" else "blocks.0"
    (series,) = [s for s in report.series if s.name == row]
    _close(series.values, refs[stat])
    _close(report.losses, refs["loss"])
    assert report.ok and report.findings == []


def test_layers_filter_by_glob_and_parameters_by_their_module(healthy) -> None:
    path, _ = healthy
    assert [s.name for s in hookcli.report(path).series] == LAYERS
    assert [s.name for s in hookcli.report(path, layers="blocks.*").series] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [s.name for s in hookcli.report(path, layers=["head", "stem"]).series] == ["stem", "head"]
    params = hookcli.report(path, stat="norm", layers="blocks.2")
    assert [s.name for s in params.series] == ["blocks.2.weight", "blocks.2.bias"]
    assert {s.type for s in params.series} == {"parameter"}


def test_parameter_gradient_statistic_is_plain_torchs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    with hookcli.watch(model, optimizer, out=tmp_path / "p.jsonl") as w:
        for _ in range(3):
            loss = model(torch.randn(4, 3)).pow(2).mean()
            (grad,) = torch.autograd.grad(loss, model.weight, retain_graph=True)
            expected.append(float(grad.double().abs().max()))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step(loss=loss)
    (weight, _bias) = hookcli.report(tmp_path / "p.jsonl", stat="param.grad.abs_max").series
    _close(weight.values, expected)


# --------------------------------------------------------------------------- the gate and bad input


def test_cli_exits_1_on_an_error_finding_after_printing(cli, broken: Path) -> None:
    result = cli("report", broken)
    assert result.exit_code == 1
    assert "nonfinite" in result.stdout and "FAILED: 1 finding (1 error" in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: report: 1 error finding(s)") and "step 5" in lines[0]
    assert lines[1].startswith("  hint: ")
    assert hookcli.report(broken).ok is False  # the API returns the record; only the CLI gates


def test_cli_exits_0_on_a_healthy_log_with_a_table_on_stdout_only(cli, healthy) -> None:
    path, _ = healthy
    result = cli("report", path)
    assert result.exit_code == 0 and result.stderr == ""
    assert all(name in result.stdout for name in LAYERS) and "ok: 0 findings" in result.stdout


def test_json_has_every_value_and_the_findings(cli, broken: Path) -> None:
    result = cli("report", broken, "--stat", "grad.rms", "--format", "json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    report = hookcli.report(broken, stat="grad.rms")
    assert data["stat"] == "grad.rms" and data["steps"] == list(range(8)) and data["ok"] is False
    assert [s["name"] for s in data["series"]] == LAYERS
    for row, series in zip(data["series"], report.series):  # NaN is written as "nan", as every hookcli JSON
        assert [v if isinstance(v, float) or v is None else float(v) for v in row["values"]] == \
            pytest.approx(series.values, nan_ok=True)
    assert "nan" in data["series"][0]["values"][5:]
    assert [(f["rule"], f["severity"], f["step"], f["layer"]) for f in data["findings"]] == \
        [("nonfinite", "error", 5, "stem")]


def test_csv_is_one_row_per_row_and_step_and_markdown_has_the_findings(cli, broken: Path, tmp_path: Path) -> None:
    import csv

    report = hookcli.report(broken, stat="zero_fraction", layers="blocks.1")
    out = tmp_path / "r.csv"
    assert cli("report", broken, "--stat", "zero_fraction", "--layers", "blocks.1", "-o", out).exit_code == 1
    rows = list(csv.DictReader(out.open()))
    assert [(int(r["step"]), r["name"]) for r in rows] == \
        [(step, "(loss)") for step in range(8)] + [(step, "blocks.1") for step in range(8)]
    assert [float(r["value"]) for r in rows[8:]] == pytest.approx(report.series[0].values, nan_ok=True)
    md = cli("report", broken, "--layers", "blocks.1", "-f", "markdown")
    assert md.exit_code == 1 and "| blocks.1 | ReLU |" in md.stdout
    assert "- step 5 · error · nonfinite · first NaN/Inf" in md.stdout and "**FAILED: 1 finding" in md.stdout


def _log_text(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


@pytest.mark.parametrize(("content", "needle"), [
    (None, "no such log file"),
    ("", "no logged steps"),
    ("\n\n", "no logged steps"),
    ("not json\n", "line 1 is not JSON"),  # a log with no good line at all (one bad line is left out)
    ("[1, 2]\n", "line 1 is not a JSON object"),
    ('{{"schema": 2, "step": 1}}\n', "line 1 has schema 2, not 1"),
    ('{{"schema": 1, "step": "one"}}\n', "line 1 has no whole-number 'step'"),
    ('{{"schema": 1, "step": 1, "layers": 3}}\n', "line 1 has a 'layers' that is not a list"),
    ("{torn} ]\n", "line 1 is not JSON"),  # not a line cut short: the log is damaged
    ("x\n" * 3, "line 1 is not JSON (and 2 more"),
    pytest.param("[" * 100_000 + "]" * 100_000 + "\n", "line 1 is not JSON", id="too-deep"),  # not exit 3
])
def test_a_bad_log_is_exit_2_with_one_line_naming_it(cli, healthy, tmp_path: Path, content: str | None,
                                                     needle: str) -> None:
    lines = _log_text(healthy[0])
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content.format(line1=lines[0], line2=lines[1], torn=lines[2][:40]))
    result = cli("report", path)
    err = result.stderr.splitlines()
    assert result.exit_code == 2, result.stderr
    assert len(err) == 2 and err[0].startswith("Error: ") and needle in err[0], result.stderr
    assert err[1].startswith("  hint: ") and result.stdout == ""


def test_a_directory_and_a_binary_file_are_exit_2(cli, tmp_path: Path) -> None:
    (tmp_path / "bin.jsonl").write_bytes(b'\n\xff\xfe\n')
    for path, needle in ((tmp_path, "is a directory"), (tmp_path / "bin.jsonl", "line 2 is not UTF-8")):
        result = cli("report", path)
        assert result.exit_code == 2 and needle in result.stderr.splitlines()[0]


def test_a_torn_last_line_is_left_out_with_a_note(cli, healthy, tmp_path: Path) -> None:
    """A crash mid-write leaves a last line without its newline: the steps before it are reported."""
    lines = _log_text(healthy[0])
    path = tmp_path / "torn.jsonl"
    path.write_text("".join(lines[:3]) + lines[3][:50])
    result = cli("report", path, "--format", "json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["steps"] == [0, 1, 2]
    assert result.stderr.startswith("note: line 4 left out: it ends without a newline")
    path.write_text("".join(lines[:3]) + lines[3].rstrip("\n"))  # whole, only its newline missing: kept
    assert hookcli.report(path).steps == [0, 1, 2, 3]


@pytest.mark.parametrize(("args", "needle", "hint"), [
    (["--stat", "rsm"], "unknown statistic 'rsm'", "did you mean: rms"),
    (["--stat", "grad.norm"], "unknown statistic 'grad.norm'", "grad.rms"),
    (["--layers", "block.*"], "'block.*' matches no layer", "globs"),
    (["--format", "html"], "'html' is not one of", "--help"),
])
def test_bad_options_are_exit_2_with_a_hint(cli, healthy, tmp_path: Path, monkeypatch, args: list[str],
                                            needle: str, hint: str) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli("report", healthy[0], *args)
    err = result.stderr.splitlines()
    assert result.exit_code == 2 and len(err) == 2, result.stderr
    assert needle in err[0] and hint in err[1] and result.stdout == ""
    assert not (tmp_path / "out.md").exists()


def test_the_api_raises_the_librarys_errors(healthy, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="unknown statistic"):
        hookcli.report(healthy[0], stat="bogus")
    with pytest.raises(LayerNotFoundError):
        hookcli.report(healthy[0], layers="nothing")
    with pytest.raises(InputError, match="no such log file"):
        hookcli.report(tmp_path / "missing.jsonl")


def test_values_beyond_float_are_infinite_not_an_internal_error(healthy, tmp_path: Path) -> None:
    line = json.loads(healthy[0].read_text().splitlines()[0])
    (tmp_path / "big.jsonl").write_text(json.dumps(line).replace(f'"rms": {line["layers"][0]["stats"]["rms"]!r}',
                                                                 '"rms": 1' + "0" * 400, 1) + "\n")
    assert hookcli.report(tmp_path / "big.jsonl").series[0].values == [math.inf]
    with pytest.raises(UsageError, match="stat must be a name"):
        hookcli.report(healthy[0], stat=["rms"])


def test_steps_that_go_back_are_noted(healthy, tmp_path: Path) -> None:
    """A second run appended to the same log: shown in the log's order, with a note."""
    text = healthy[0].read_text()
    (tmp_path / "twice.jsonl").write_text(text + text)
    report = hookcli.report(tmp_path / "twice.jsonl")
    assert report.steps == list(range(12)) * 2 and "the steps go back" in report.notes[0]


def test_report_does_not_import_torch(healthy) -> None:
    """Reading a log needs no torch: a fresh interpreter runs hookcli report without importing it."""
    code = textwrap.dedent(f"""
        import sys
        from click.testing import CliRunner
        from hookcli.cli import main
        result = CliRunner().invoke(main, ["report", {str(healthy[0])!r}, "--stat", "grad.rms"])
        assert result.exit_code == 0, result.output
        assert "torch" not in sys.modules and "matplotlib" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- the terminal view


def test_golden_terminal_views(committed, golden, monkeypatch: pytest.MonkeyPatch) -> None:
    nan = committed("nan.jsonl", steps=8, nan_at=5)
    healthy = committed("healthy.jsonl", steps=20)
    monkeypatch.chdir(WATCH_LOGS)  # the header names the log as given: relative, the same on every machine
    nan, healthy = Path(nan.name), Path(healthy.name)
    golden("tables/report_nan_grad_rms.txt", render(hookcli.report(nan, stat="grad.rms"), "table", width=100))
    # 20 logged steps in a narrow terminal: columns of up to 2 steps
    golden("tables/report_healthy_narrow.txt",
           render(hookcli.report(healthy, layers="blocks.*"), "table", width=60))
    golden("tables/report_update_ratio.txt", render(hookcli.report(healthy, stat="update_ratio"), "table", width=100))


def test_colour_marks_levels_and_non_finite_values(broken: Path) -> None:
    report = hookcli.report(broken)
    plain_text = render(report, "table", width=100, color=False)
    coloured = render(report, "table", width=100, color=True)
    assert "\x1b[" not in plain_text and "\x1b[38;5;" in coloured  # the 256-colour palette
    stripped = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    assert [line.rstrip() for line in stripped.splitlines()] == plain_text.splitlines()


def test_the_heatmap_shows_nan_and_missing_steps(tmp_path: Path, healthy) -> None:
    """A layer missing at a step is blank there; a NaN is '!'."""
    lines = [json.loads(line) for line in healthy[0].read_text().splitlines()[:4]]
    lines[1]["layers"] = [layer for layer in lines[1]["layers"] if layer["name"] != "head"]
    lines[2]["layers"][0]["stats"]["rms"] = "nan"
    (tmp_path / "edit.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = hookcli.report(tmp_path / "edit.jsonl")
    assert report.series[-1].values[1] is None and math.isnan(report.series[0].values[2])
    text = render(report, "table", width=100).splitlines()
    column = next(line for line in text if line.startswith("Layer")).index("Steps")
    strips = {line.split()[0]: line[column:column + 4] for line in text if line.split()}
    assert strips["head"][1] == " " and all(c in LEVELS for c in strips["head"][::2])
    assert strips["stem"][2] == "!" and all(c in LEVELS for c in strips["stem"][:2])


@given(st.integers(1, 500), st.integers(1, 120))
def test_buckets_cover_every_step_once_in_order(count: int, width: int) -> None:
    groups = buckets(count, width)
    assert len(groups) == min(count, width)
    assert [i for g in groups for i in g] == list(range(count))
    assert max(len(g) for g in groups) - min(len(g) for g in groups) <= 1


values = st.lists(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32)), min_size=1,
                  max_size=30)


@given(values)
def test_a_bucket_is_its_largest_value_and_nan_wins(group: list[float | None]) -> None:
    value = bucket_value(group, range(len(group)))
    known = [v for v in group if v is not None]
    if not known:
        assert value is None
    elif any(not math.isfinite(v) for v in known):
        assert math.isnan(value)
    else:
        assert value == max(known)


@given(st.lists(st.floats(1e-30, 1e30), min_size=1, max_size=40))
def test_levels_are_monotonic_and_span_the_range(data: list[float]) -> None:
    s = Scale(data)
    levels = [s.level(v) for v in sorted(data)]
    assert levels == sorted(levels) and all(0 <= lv < len(LEVELS) for lv in levels)
    assert s.kind == ("log" if max(data) >= 100 * min(data) else "linear") == scale(data)
    if min(data) < max(data):
        assert levels[0] == 0 and levels[-1] == len(LEVELS) - 1


# --------------------------------------------------------------------------- HTML


#: Attributes whose value a browser fetches. A value must be in the page (``#id``) or inline (``data:``).
FETCHING = {"src", "srcset", "href", "xlink:href", "action", "formaction", "poster", "data", "background",
            "cite", "longdesc", "manifest", "ping"}
#: Elements that fetch or run something whatever their attributes say.
FETCHING_TAGS = {"script", "link", "iframe", "frame", "object", "embed", "base", "applet", "audio", "video"}
CSS_URL = re.compile(r"url\(\s*[\"']?+(?!#|data:)[^)]*\)|@import", re.IGNORECASE)


def network_references(page: str) -> list[str]:
    """What in ``page`` a browser would fetch from elsewhere: a fetching attribute (src, href,
    xlink:href, ...) or a CSS ``url(...)`` (in a style attribute or a <style> element) that is not
    ``#...`` or ``data:...``, a CSS @import, and elements such as <script> and <link>. Text is not a
    fetch, nor is an XML namespace (``xmlns="http://www.w3.org/2000/svg"`` names a vocabulary)."""
    from html.parser import HTMLParser

    found: list[str] = []

    class Parser(HTMLParser):
        in_style = False

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.in_style = tag == "style"
            if tag in FETCHING_TAGS:
                found.append(f"<{tag}>")
            for name, value in attrs:
                value = (value or "").strip()
                if name in FETCHING and not value.startswith(("#", "data:")):
                    found.append(f"{name}={value}")
                elif name == "style" or not name.startswith("xmlns"):
                    found.extend(CSS_URL.findall(value))

        handle_startendtag = handle_starttag

        def handle_data(self, data: str) -> None:
            if self.in_style:
                found.extend(CSS_URL.findall(data))

        def handle_endtag(self, tag: str) -> None:
            self.in_style = False

    parser = Parser()
    parser.feed(page)
    parser.close()
    return found


@pytest.mark.parametrize("page", [
    '<img src="http://example.com/a.png">', "<a href='//cdn.example.com/x'>", '<div style="background: url(https://x.io/a)">',
    '<script>1</script>', '<link rel="stylesheet" href="a.css">', '<image xlink:href="file:///etc/passwd"/>',
    "<style>@import 'x.css';</style>", '<svg><image href="//x.io/a.png"/></svg>', "<style>p { background: url(a.png) }</style>",
])
def test_the_network_check_catches_what_it_must(page: str) -> None:
    assert network_references(page)


def test_the_network_check_allows_namespaces_in_page_links_and_inline_data() -> None:
    assert network_references('<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
                              '<use xlink:href="#m1"/><path clip-path="url(#p1)"/>'
                              '<image xlink:href="data:image/png;base64,AAAA"/><text>see https://x.io</text></svg>') == []


def test_html_is_one_offline_page_with_every_layer_heatmap_and_curves(cli, broken: Path, tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    rc_before, backend = dict(matplotlib.rcParams), matplotlib.get_backend()
    out = tmp_path / "site" / "report.html"
    result = cli("report", broken, "--stat", "grad.rms", "--html", out)
    assert result.exit_code == 1  # the NaN gate holds with --html too, after the page is written
    assert f"wrote {out}" in result.stderr and "nonfinite" in result.stdout
    page = out.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 2
    assert '<figure id="heatmap">' in page and '<figure id="curves">' in page
    assert "data:image/png;base64," in page  # the heatmap's cells, inline
    heatmap, curves = page.split('<figure id="curves">')
    heatmap = heatmap.split('<figure id="heatmap">')[1]
    assert RED in _heatmap_colours(heatmap)  # the NaN/Inf cells, in red over the values
    for name in LAYERS:  # searchable text: a heatmap row's label, a curve's title, a row of the values table
        assert f">{name}</text>" in heatmap and f">{name}</text>" in curves and f"<td>{name}</td>" in page
    assert "first NaN/Inf of the run at step 5" in page
    assert network_references(page) == []
    assert re.findall(r"https?://", re.sub(r'xmlns(?::\w+)?="[^"]*"', "", page)) == []  # no URL text at all
    assert dict(matplotlib.rcParams) == rc_before and matplotlib.get_backend() == backend


RED = (214, 39, 40)  # matplotlib's tab:red, which viridis does not hold


def _heatmap_colours(heatmap: str) -> set[tuple[int, int, int]]:
    """The colours of the heatmap's cells: its first inline PNG (matplotlib composites the axes' images)."""
    import base64
    import io

    from PIL import Image

    data = re.search(r'href="data:image/png;base64,([^"]+)"', heatmap).group(1)
    image = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
    return {rgb for _, rgb in image.getcolors(maxcolors=1 << 20)}


def test_html_heatmap_is_red_only_where_a_value_is_nan(healthy) -> None:
    pytest.importorskip("matplotlib")
    from hookcli.render.report_html import render_html

    heatmap = render_html(hookcli.report(healthy[0])).split('<figure id="heatmap">')[1].split("</figure>")[0]
    assert RED not in _heatmap_colours(heatmap)


def test_html_escapes_names_from_the_log(healthy, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from hookcli.render.report_html import render_html

    lines = [json.loads(line) for line in healthy[0].read_text().splitlines()[:3]]
    for line in lines:
        line["layers"][0]["name"] = '<img src="http://x.io/a">$x$'
    (tmp_path / "odd.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    page = render_html(hookcli.report(tmp_path / "odd.jsonl"))
    assert "<img" not in page and network_references(page) == []
    assert "&lt;img src=&quot;http://x.io/a&quot;&gt;$x$" in page


def test_html_without_matplotlib_is_exit_2_with_the_install_hint(cli, healthy, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "report.html"
    result = cli("report", healthy[0], "--html", out)
    err = result.stderr.splitlines()
    assert result.exit_code == 2 and len(err) == 2 and result.stdout == ""
    assert "--html needs matplotlib" in err[0] and "pip install 'hookcli[report]'" in err[1]
    assert not out.exists()


def test_help_names_every_statistic_family(cli) -> None:
    text = " ".join(cli("report", "--help").stdout.split())
    for word in ("rms", "abs_max", "zero_fraction", "kurtosis", "grad.rms", "update_ratio", "norm",
                 "param.grad.rms", "--html", "hookcli[report]"):
        assert word in text, word


@settings(max_examples=25, deadline=None)
@given(st.integers(40, 200))
def test_every_row_fits_the_width_on_one_line(width: int) -> None:
    """Narrow terminals drop the Type column, then shorten names, then the Trend, never wrap a row."""
    report = hookcli.report(WATCH_LOGS / "healthy.jsonl", stat="update_ratio")
    lines = render(report, "table", width=width).splitlines()
    for series in [*report.series]:
        (row,) = [line for line in lines if line.split() and series.name.startswith(line.split()[0].split("…")[0])
                  and line.rstrip().endswith(f"{series.values[-1]:.4g}")]
        assert cell_len(row) <= width


def test_stat_dead_channels_is_the_count_plain_torch_finds_per_step(tmp_path: Path) -> None:
    """``--stat dead_channels``: per layer and logged step, how many channels were zero in every value;
    a conv whose bias kills 3 of its 8 channels before a ReLU shows 3 at each step (plain torch counts)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    with torch.no_grad():
        model[0].bias[[0, 3, 6]] = -50.0
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    expected = []
    with hookcli.watch(model, opt, every=1, out=tmp_path / "log.jsonl") as w:
        for step in range(3):
            x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                act = model[1](model[0](x))
            expected.append(float((act == 0).all(dim=0).all(dim=-1).all(dim=-1).sum()))  # channels: dim 1
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            w.step(loss=loss)
    report = hookcli.report(tmp_path / "log.jsonl", stat="dead_channels", layers="1")
    (relu,) = report.series
    assert relu.values == expected and expected == [3.0, 3.0, 3.0]


class PackedTagger(nn.Module):
    """An LSTM over a PackedSequence (its output holds the int64 ``batch_sizes`` and indices) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return self.head(out.data)


def watch_lstm_steps(model: nn.Module, log: Path, forward: Callable[[torch.Generator], torch.Tensor],
                     output: Callable[[Any], torch.Tensor]) -> list[torch.Tensor]:
    """Three SGD steps of ``model`` under a watch logging to ``log`` (step k's batch from a generator
    seeded k, the loss the output's mean square); ``output`` of ``model.lstm``'s output at each call, as
    plain torch's hook saw it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.Tensor] = []
    handle = model.lstm.register_forward_hook(lambda _m, _i, out: seen.append(output(out).detach()))
    try:
        with hookcli.watch(model, optimizer, out=log) as w:
            for step in range(3):
                loss = forward(torch.Generator().manual_seed(step)).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                w.step(loss=loss)
    finally:
        handle.remove()
    return seen


INT_ROWS = ["lstm[0].batch_sizes", "lstm[0].sorted_indices", "lstm[0].unsorted_indices"]


def test_integer_outputs_are_left_out_with_one_note_and_float_ones_kept(cli, tmp_path: Path) -> None:
    """A PackedSequence's ``batch_sizes`` and indices are int64: the watch logs their shape and dtype only,
    so the report leaves them out (not a row of blanks) and says so in one note on stderr; the float
    outputs of the same module keep their values (plain torch's RMS)."""
    torch.manual_seed(0)
    model = PackedTagger()
    log = tmp_path / "packed.jsonl"
    seen = watch_lstm_steps(model, log, lambda g: model(torch.randn(3, 5, 4, generator=g), torch.tensor([5, 2, 4])),
                            lambda out: out[0].data)
    logged = [layer for layer in json.loads(log.read_text().splitlines()[0])["layers"]]
    assert {layer["name"] + layer["output"] for layer in logged if layer["stats"] is None} == set(INT_ROWS)

    report = hookcli.report(log)
    assert [s.name for s in report.series] == ["lstm[0].data", "lstm[1][0]", "lstm[1][1]", "head"]
    _close(report.series[0].values, [float(t.double().pow(2).mean().sqrt()) for t in seen])
    (note,) = report.notes
    assert note.startswith("3 outputs left out, not floating point") and "lstm[0].batch_sizes (int64)" in note
    assert [s.name for s in hookcli.report(log, stat="grad.rms", layers="lstm*").series] == \
        ["lstm[0].data", "lstm[1][0]", "lstm[1][1]"]
    # named alone: no "matches no layer" error, an empty report and the note
    only = hookcli.report(log, layers="lstm[[]0].batch_sizes")
    assert only.series == [] and "lstm[0].batch_sizes (int64)" in only.notes[0]

    result = cli("report", log)
    assert result.exit_code == 0 and not any(name in result.stdout for name in INT_ROWS)
    assert "lstm[0].data" in result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith("note: 3 outputs left out, not floating point: lstm[0].batch_sizes (int64)")
    data = json.loads(cli("report", log, "--format", "json").stdout)
    assert INT_ROWS[0] not in [s["name"] for s in data["series"]] and data["notes"] == report.notes


class LstmTagger(nn.Module):
    """An LSTM (its output a tuple: rows ``lstm[0]``, ``lstm[1][0]``, ``lstm[1][1]``) and a head whose
    name starts with the LSTM's."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.lstm_head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm_head(self.lstm(x)[0])


def test_layers_naming_a_module_keeps_its_output_rows_as_every_command_does(cli, tmp_path: Path) -> None:
    """``report --layers lstm`` matched no row (the rows are ``lstm[0]``, ``lstm[1][0]``...): only the
    exact row or a glob did. A module's name now keeps its own output rows, as ``--layers`` selects a
    module in the other commands, and only its own (not ``lstm_head``); the values are plain torch's."""
    torch.manual_seed(0)
    model = LstmTagger()
    log = tmp_path / "lstm.jsonl"
    seen = watch_lstm_steps(model, log, lambda g: model(torch.randn(2, 5, 4, generator=g)), lambda out: out[0])
    result = cli("report", log, "--layers", "lstm", "-f", "json")
    assert result.exit_code == 0, result.stderr
    series = json.loads(result.stdout)["series"]
    assert [s["name"] for s in series] == ["lstm[0]", "lstm[1][0]", "lstm[1][1]"]
    _close(series[0]["values"], [float(t.double().pow(2).mean().sqrt()) for t in seen])
    assert [s.name for s in hookcli.report(log, layers="lstm_head").series] == ["lstm_head"]
    assert [s.name for s in hookcli.report(log, layers="lstm[[]1]*").series] == ["lstm[1][0]", "lstm[1][1]"]
    params = [s.name for s in hookcli.report(log, stat="norm", layers="lstm").series]
    assert params and all(p.startswith("lstm.") for p in params)
    result = cli("report", log, "--layers", "lst")  # a module name is matched whole, not as a prefix
    assert result.exit_code == 2 and result.stdout == "" and "'lst' matches no layer" in result.stderr


# --------------------------------------------------------------------------- report - (stdin)


def test_dash_reads_the_log_from_stdin_as_from_its_file(cli, healthy, broken: Path) -> None:
    """``cat log.jsonl | hookcli report -``: the same report as from the path, the gate included."""
    path, refs = healthy
    piped = cli("report", "-", "--stat", "grad.rms", "--format", "json", input=path.read_bytes())
    assert piped.exit_code == 0 and piped.stderr == ""
    data, direct = json.loads(piped.stdout), hookcli.report(path, stat="grad.rms")
    assert data["path"] == "-" and data["steps"] == direct.steps
    assert [s["name"] for s in data["series"]] == LAYERS
    _close(data["series"][1]["values"], refs["grad.rms"])  # blocks.0, against plain torch
    table = cli("report", "-", input=path.read_bytes())
    assert table.exit_code == 0 and table.stdout.startswith("report - · 12 logged steps")
    gate = cli("report", "-", input=broken.read_bytes())
    assert gate.exit_code == 1 and gate.stderr.startswith("Error: report: 1 error finding(s) in -: step 5")
    lines = _log_text(path)
    torn = cli("report", "-", "--format", "json", input="".join(lines[:2]) + lines[2][:30])
    assert torn.exit_code == 0 and json.loads(torn.stdout)["steps"] == [0, 1]
    assert torn.stderr.startswith("note: line 3 left out")


@pytest.mark.parametrize(("gzipped", "needle"), [
    (False, "Error: stdin has no logged steps (empty log)"),
    (True, "Error: stdin is gzip-compressed, not a log's JSON lines"),
])
def test_dash_with_an_empty_or_gzipped_stdin_is_exit_2_with_a_hint(cli, healthy, gzipped: bool,
                                                                     needle: str) -> None:
    import gzip

    result = cli("report", "-", input=gzip.compress(healthy[0].read_bytes()) if gzipped else b"")
    err = result.stderr.splitlines()
    assert result.exit_code == 2 and result.stdout == "" and len(err) == 2, result.stderr
    assert err[0] == needle and err[1].startswith("  hint: ")
    if gzipped:
        assert "gunzip -c LOG.gz | hookcli report -" in err[1]


def test_a_gzipped_log_file_is_exit_2_naming_the_command_that_reads_it(cli, healthy, tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "exp.jsonl.gz"
    path.write_bytes(gzip.compress(healthy[0].read_bytes()))
    result = cli("report", path)
    err = result.stderr.splitlines()
    assert result.exit_code == 2 and result.stdout == "" and len(err) == 2
    assert err[0] == f"Error: {path} is gzip-compressed, not a log's JSON lines"
    assert err[1] == f"  hint: decompress it on the way in: gunzip -c {path} | hookcli report -"
    # what the hint says works
    piped = cli("report", "-", "--format", "json", input=gzip.decompress(path.read_bytes()))
    assert piped.exit_code == 0 and json.loads(piped.stdout)["steps"] == list(range(12))


@pytest.mark.parametrize("stdin", ["terminal", "closed"])
def test_dash_without_a_pipe_is_exit_2_not_a_wait(stdin: str) -> None:
    """``hookcli report -`` typed at a terminal would wait for JSON to be typed: refused at once; a
    closed stdin (``<&-``) too. A real process: the terminal is a pseudo-terminal."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    command = [sys.executable, "-m", "hookcli", "report", "-"]
    if stdin == "terminal":
        import pty

        leader, follower = pty.openpty()
        try:
            out = subprocess.run(command, stdin=follower, capture_output=True, text=True, env=env, timeout=scaled_timeout(120),
                                 check=False)
        finally:
            os.close(leader)
            os.close(follower)
    else:
        out = subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh", *command], capture_output=True, text=True,
                             env=env, timeout=scaled_timeout(120), check=False)
    err = out.stderr.splitlines()
    assert out.returncode == 2 and out.stdout == "" and len(err) == 2, out.stderr
    why = "a terminal, not a log" if stdin == "terminal" else "closed, there is no log to read"
    assert err[0] == f"Error: report -: stdin is {why}"
    assert err[1].startswith("  hint: pipe a log in (cat runs/exp.jsonl | hookcli report -)")


class TiedHead(nn.Module):
    """One Linear reached by two names (``decoder`` first, ``lm_head`` the tied one), called once."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.decoder = nn.Linear(8, 4)
        self.lm_head = self.decoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.body(x)))


def test_a_tied_module_is_found_by_any_of_its_names(tmp_path: Path) -> None:
    """The watch records a module under its first name (``decoder``) and its other names in the log
    (``aliases``); ``--layers lm_head`` finds its rows, and its parameters', as ``--layers decoder`` does."""
    torch.manual_seed(0)
    model = TiedHead()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "tied.jsonl"
    outputs: list[torch.Tensor] = []
    model.decoder.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().double()))
    with hookcli.watch(model, optimizer, every=1, out=log) as w:
        for _ in range(2):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            w.step()
    entry = next(e for e in json.loads(log.read_text().splitlines()[0])["layers"] if e["name"] == "decoder")
    assert entry["aliases"] == ["lm_head"]
    report = hookcli.report(log, layers="lm_head")
    assert [s.name for s in report.series] == ["decoder"]
    _close(report.series[0].values, [float(o.pow(2).mean().sqrt()) for o in outputs])
    assert [s.name for s in hookcli.report(log, layers="lm_head", stat="norm").series] == \
        ["decoder.weight", "decoder.bias"]
