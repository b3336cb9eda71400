"""``hookcli report`` on logs nobody should trust: a log is data, whatever it holds.

Hostile text in every field of a log (layer names, output keys, types, finding rules, severities,
messages, keys) stays text in the HTML page (parsed here with ``html.parser``, and by a headless
Chromium where one is installed) and in CSV; the reading is bounded (a line too long, a device, nesting,
a number beyond float, a line of garbage); a reader of stdout that leaves early ends the run quietly;
and the terminal view honours ``--width`` and ``--no-truncate`` without ever showing two names alike.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

import hookcli
from timeouts import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent
#: What a hostile log puts in every text field: it closes a quoted or unquoted attribute, adds event
#: handlers, opens elements.
HOSTILE = ('x" autofocus onfocus=alert(1) hkinj=\'z\' data-hk=1><script>alert(2)</script><img src=x onerror=alert(3)>'
           '<svg onload=alert(4)>')
SEVERITY = "warning autofocus onfocus=alert(5) x"


def _line(step: int, **extra: object) -> dict[str, object]:
    return {"schema": 1, "step": step, "loss": 1.0 + step,
            "layers": [{"name": "blocks.0" + HOSTILE, "output": HOSTILE, "type": HOSTILE, "calls": 1, "shape": [2],
                        "dtype": "float32", "stats": {"rms": 0.5 + step, HOSTILE: HOSTILE}, HOSTILE: HOSTILE}],
            "params": [{"name": HOSTILE + ".weight", "norm": 1.0, HOSTILE: HOSTILE}],
            "findings": [{"rule": HOSTILE, "severity": SEVERITY, "step": step, "layer": HOSTILE,
                          "direction": HOSTILE, "value": 1.0, "limit": 2.0, "message": HOSTILE, HOSTILE: HOSTILE}],
            HOSTILE: HOSTILE, **extra}


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


class _Page(HTMLParser):
    """Every element and attribute of a page, as a browser's tokenizer sees them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += [(name, value or "") for name, value in attrs]


def _injected(page: str) -> list[str]:
    """What of the hostile text became markup: elements or attributes it named, or text in an attribute."""
    parsed = _Page()
    parsed.feed(page)
    bad = [f"<{t}>" for t in parsed.tags if t in ("script", "img", "iframe")]
    bad += [f"{n}={v!r}" for n, v in parsed.attrs if n.startswith("on") or n in ("autofocus", "data-hk", "hkinj")]
    bad += [f"{n}={v!r}" for n, v in parsed.attrs if "alert" in v]
    return bad


def test_the_injection_check_catches_what_it_must() -> None:
    assert _injected('<li class=warning autofocus onfocus=alert(1)>x</li>')
    assert _injected('<p title="a" onmouseover="alert(1)">') and _injected("<script>alert(1)</script>")
    assert _injected('<td class="x">a</td><img src=x>') and not _injected('<p class="n">alert(1) &lt;img&gt;</p>')


@pytest.mark.parametrize("stat", ["rms", "norm"])
def test_html_of_a_hostile_log_carries_no_markup_from_it(tmp_path: Path, stat: str) -> None:
    """Every value of the log in every place of the page (text, the class of a finding, the figures'
    labels, the table) is escaped: the page's elements and attributes are the page's own."""
    pytest.importorskip("matplotlib")
    from hookcli.render.report_html import render_html

    log = _write(tmp_path / "hostile.jsonl", [_line(0), _line(1)])
    page = render_html(hookcli.report(log, stat=stat))
    assert _injected(page) == []
    assert HOSTILE.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;") \
        .replace("'", "&#x27;") in page  # shown, as text


def test_html_of_a_hostile_log_path_and_note_carries_no_markup(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from hookcli.render.report_html import render_html

    folder = tmp_path / "a b"
    folder.mkdir()
    log = _write(folder / "x'onload=alert(1) '.jsonl", [_line(0), "<script>alert(1)</script>", _line(1)])
    report = hookcli.report(log)
    assert report.notes  # the garbage line's note is on the page too
    assert _injected(render_html(report)) == []


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium installed (apt-get install chromium)")
def test_a_browser_runs_no_script_of_a_hostile_log(tmp_path: Path) -> None:
    """The page as Chromium builds it: no element the log named, no event handler (its DOM, dumped)."""
    pytest.importorskip("matplotlib")
    from hookcli.render.report_html import render_html

    page = tmp_path / "page.html"
    page.write_text(render_html(hookcli.report(_write(tmp_path / "h.jsonl", [_line(0), _line(1)]))))
    done = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=scaled_timeout(120), check=False)
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    assert _injected(done.stdout) == []


def test_csv_of_a_hostile_log_has_no_formula_cell_and_numbers_stay_numbers(cli, tmp_path: Path) -> None:
    """Every text cell a spreadsheet would run (= + - @, tab, CR) starts with ' (OWASP); a negative
    value is a number."""
    line = _line(0)
    line["layers"] = [{"name": name, "output": "", "type": kind, "stats": {"rms": -0.5}}
                      for name, kind in (("=HYPERLINK(\"http://x\")", "+cmd"), ("-1+2", "@SUM(A1)"),
                                         ("\tx", "\rx"), ("ok", "-3"))]
    log = _write(tmp_path / "f.jsonl", [line])
    result = cli("report", log, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    cells = [row[k] for row in rows for k in ("name", "type")]
    assert cells and all(not c.startswith(("=", "+", "-", "@", "\t", "\r")) or c == "-3" for c in cells), cells
    assert [float(r["value"]) for r in rows if r["name"] != "(loss)"] == [-0.5] * 4


def test_garbage_nan_literals_huge_numbers_and_deep_nesting_are_read_or_left_out(cli, tmp_path: Path) -> None:
    """A line of garbage, a line nested too deep and a step beyond 64 bits are left out with a note each;
    NaN and Infinity literals are read as such; an integer beyond float is infinite; the HTML is drawn."""
    pytest.importorskip("matplotlib")
    huge = _line(3)
    huge["loss"] = 10 ** 400
    huge["findings"][0]["step"] = 10 ** 400  # read as its line's step
    lines = [_line(0), "garbage", "[" * 100_000 + "]" * 100_000, json.dumps(_line(1)).replace('"loss": 2.0', '"loss": NaN'),
             json.dumps(_line(2)).replace('"rms": 2.5', '"rms": Infinity'), huge, {**_line(4), "step": 10 ** 400}]
    log = _write(tmp_path / "odd.jsonl", lines)
    result = cli("report", log, "--format", "json", "--html", tmp_path / "odd.html")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["steps"] == [0, 1, 2, 3]
    assert [n.split(":")[0] for n in data["notes"]] == ["line 2 left out", "line 3 left out", "line 7 left out"]
    losses = [math.nan if v == "nan" else v for v in data["losses"]]
    assert losses[0] == 1.0 and math.isnan(losses[1]) and losses[3] == "inf", data["losses"]
    assert data["series"][0]["values"][2] == "inf"
    assert (tmp_path / "odd.html").stat().st_size > 0


def test_a_line_longer_than_the_bound_is_left_out_without_holding_it(tmp_path: Path, monkeypatch) -> None:
    from hookcli.commands import report

    monkeypatch.setattr(report, "MAX_LINE_BYTES", 4096)
    log = tmp_path / "long.jsonl"
    log.write_text(json.dumps(_line(0)) + "\n" + "x" * 50_000 + "\n" + json.dumps(_line(1)) + "\n")
    result = hookcli.report(log)
    assert result.steps == [0, 1] and len(result.notes) == 1
    assert result.notes[0].startswith("line 2 left out: it is longer than")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_as_the_log_is_exit_2_at_once(cli) -> None:
    """``report /dev/zero`` read an endless line (8 GB, then exit 3)."""
    started = time.monotonic()
    result = cli("report", "/dev/zero")
    assert result.exit_code == 2 and "is a device, not a log file" in result.stderr.splitlines()[0]
    assert time.monotonic() - started < scaled_timeout(30)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_is_read_as_a_pipe(tmp_path: Path) -> None:
    """A named pipe (``report <(zcat log.gz)``) is read line by line like stdin."""
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    text = json.dumps(_line(0)) + "\n" + json.dumps(_line(1)) + "\n"
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(fifo)!r}, 'w').write({text!r})"])
    try:
        assert hookcli.report(fifo).steps == [0, 1]
    finally:
        writer.wait(timeout=scaled_timeout(60))


def test_a_megabyte_name_is_shown_in_seconds_not_minutes(cli, tmp_path: Path) -> None:
    """Shortening a name was quadratic in its length (a 1 MB name: more than 300 s)."""
    line = _line(0)
    line["layers"][0].update(name="n" * 1_000_000, output="")
    log = _write(tmp_path / "long.jsonl", [line])
    started = time.monotonic()
    result = cli("report", log, "--width", "100")
    assert result.exit_code == 0 and "nnnnnnnnnn…nnnn" in result.stdout and len(result.stdout) < 10_000
    assert time.monotonic() - started < scaled_timeout(60)


BERT = [f"bert.encoder.layer.{i}.attention.self.query" for i in (0, 1, 10, 11)]


def _bert_log(tmp_path: Path, names: list[str] = BERT) -> Path:
    layers = [{"name": n, "output": "", "type": "Linear", "stats": {"rms": 1.0 + i}} for i, n in enumerate(names)]
    return _write(tmp_path / "bert.jsonl", [{"schema": 1, "step": 0, "loss": 1.0, "layers": layers}])


def _name_cells(stdout: str, count: int) -> list[str]:
    lines = stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("loss "))  # then the layers' rows
    return [row.split("  ")[0].strip() for row in lines[first + 1:first + 1 + count]]


@pytest.mark.parametrize("width", ["60", "80", "100"])
def test_names_that_differ_in_the_middle_never_print_alike(cli, tmp_path: Path, width: str) -> None:
    result = cli("report", _bert_log(tmp_path), "--width", width)
    shown = _name_cells(result.stdout, len(BERT))
    assert len(set(shown)) == len(BERT), shown


def test_names_whose_escapes_read_alike_never_print_alike(cli, tmp_path: Path) -> None:
    names = ["a\nb", "a\\nb", "loss"]
    result = cli("report", _bert_log(tmp_path, names))
    shown = _name_cells(result.stdout, 3)
    assert len(set(shown)) == 3 and "loss" not in shown, shown


@pytest.mark.parametrize("option", [["--no-truncate"], ["--width", "140"]])
def test_no_truncate_and_a_wide_width_show_names_whole(cli, tmp_path: Path, option: list[str]) -> None:
    result = cli("report", _bert_log(tmp_path), *option)
    assert _name_cells(result.stdout, len(BERT)) == BERT


def test_layers_with_one_pattern_matching_nothing_reports_the_rest_and_says_which(cli, tmp_path: Path) -> None:
    """As a log holds the rows its run logged, a pattern of another run's names is noted, not fatal;
    exit 2 only when no pattern matches any row."""
    log = _bert_log(tmp_path)
    result = cli("report", log, "--layers", "bert.encoder.layer.1.*,decoder.*", "--format", "json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert [s["name"] for s in data["series"]] == [BERT[1]]
    assert any("'decoder.*' matches no layer" in n for n in data["notes"])
    assert "note: --layers: 'decoder.*' matches no layer" in result.stderr
    result = cli("report", log, "--layers", "decoder.*,encoder.x")
    assert result.exit_code == 2 and "'decoder.*', 'encoder.x' match no layer" in result.stderr


@pytest.mark.parametrize("args", [[], ["--format", "json"], ["--format", "csv"], ["--format", "markdown"],
                                  ["--html", "page.html"], ["--layers", "nothing,blocks.*"]])
@pytest.mark.parametrize("log", ["healthy", "nan", "garbage"])
def test_a_reader_of_stdout_that_left_ends_the_report_quietly(tmp_path: Path, args: list[str], log: str) -> None:
    """``hookcli report LOG | head -1``: the reader is gone before the report is written. Exit 141
    (SIGPIPE's), nothing on stderr but the notes, never exit 3; the HTML page is written first."""
    if "--html" in args:
        pytest.importorskip("matplotlib")
    source = ROOT / "tests" / "golden" / "watch" / f"{'nan' if log == 'nan' else 'healthy'}.jsonl"
    path = tmp_path / "log.jsonl"
    text = source.read_text()
    path.write_text(text.replace("\n", "\ngarbage\n", 1) if log == "garbage" else text)
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-m", "hookcli", "report", str(path), *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env, timeout=scaled_timeout(300), check=False)
    finally:
        os.close(write)
    assert done.returncode == 141, done.stderr
    assert all(line.startswith(("note: ", "wrote ")) for line in done.stderr.splitlines()), done.stderr
    if "--html" in args:
        assert (tmp_path / "page.html").stat().st_size > 0
