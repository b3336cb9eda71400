"""Names and text from the model are data, never control (issue 11, section 4).

- module names, type names and exception messages with terminal escapes, CR/LF, bidi controls and
  Markdown/HTML/formula text reach no output raw: table, Markdown, CSV, stderr errors, GitHub
  annotations, the step summary and JUnit XML show them escaped; JSON keeps them exactly;
- ``features`` entry names are unique by construction: every call of every module of adversarial
  models is found, in every file format, equal to what plain forward hooks see;
- a MODEL import path into the standard library, builtins or PyTorch's own functions is refused
  before anything is called, from the command line, ``--config`` and ``[tool.hookcli]``.

The models live here and are imported by the CLI as ``test_untrusted_names:Name`` (tests/ is on
sys.path, see conftest.py).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import math
import os
import re
import sys
import unicodedata
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.errors import UsageError
from hookcli.commands.features import feature_key
from hookcli.escape import csv_cell, escape_control

# --------------------------------------------------------------------------- hostile names

ESC = "\x1b[31mred\x1b[0m"  # SGR colour
OSC = "\x1b]8;;http://evil/\x07link\x1b]8;;\x07"  # a terminal hyperlink
CR = "ok\rEVIL"  # rewrites the line
NL = "a\n::error title=forged::forged"  # a forged GitHub workflow command on its own line
BIDI = "\u202eabc"  # right-to-left override
TAB = "t\tab"
C1 = "x\x9b2Jy\x00z\x7f"  # C1 CSI, NUL, DEL
FORMULA = '=HYPERLINK("http://evil","click")'
MARKUP = '<img src=x>[l](http://evil)&#x202e;|`c`'
UNICODE = "层.卷积"[:1] + "🙂"  # printable non-ASCII stays as it is

CHAIN_NAMES = (ESC, OSC, CR, NL, BIDI, TAB, C1, FORMULA, MARKUP, UNICODE)
#: What the human formats show for each (written out by hand from the escaping rule).
SHOWN = {
    ESC: "\\x1b[31mred\\x1b[0m",
    OSC: "\\x1b]8;;http://evil/\\x07link\\x1b]8;;\\x07",
    CR: "ok\\rEVIL",
    NL: "a\\n::error title=forged::forged",
    BIDI: "\\u202eabc",
    TAB: "t\\tab",
    C1: "x\\x9b2Jy\\x00z\\x7f",
}

HostileType = type("Hostile\x1b[2JType\u202e", (nn.Linear,), {})


class HostileNet(nn.Module):
    """A chain of Linear layers whose names (and one type name) are hostile strings."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        for i, name in enumerate(CHAIN_NAMES):
            layer = HostileType(4, 4) if i == 0 else nn.Linear(4, 4)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(4, 4, generator=gen))
                layer.bias.copy_(torch.randn(4, generator=gen) - 1.0)  # negative outputs
            self.add_module(name, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = torch.tanh(layer(x))
        return x


class MakesNaN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("nan")


class HostileNaN(nn.Module):
    """The ``finite`` check fails at a module whose name forges a workflow command."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module(ESC, nn.Linear(4, 4))
        self.add_module(NL + OSC, MakesNaN())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


class RaisesHostile(nn.Module):
    """Raises with a message that clears the screen and starts a new line."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module(BIDI, nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._modules[BIDI](x)
        raise RuntimeError("boom\x1b[2J\x1b]0;title\x07\nError: forged second line")


def control_chars(text: str, *, allow: str = "\n") -> list[str]:
    """The characters of ``text`` a terminal or viewer would act on (controls, format, separators)."""
    return [ch for ch in text if ch not in allow
            and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")]


# --------------------------------------------------------------------------- escaping rule


def test_escape_control_writes_controls_as_visible_escapes() -> None:
    for raw, shown in SHOWN.items():
        assert escape_control(raw) == shown
    assert escape_control("\u2028\U000e0001\ud800") == "\\u2028\\U000e0001\\ud800"
    for text in ("layer1.0.relu", UNICODE, "a\\x1b", FORMULA, MARKUP, ""):
        assert escape_control(text) == text  # printable text (backslashes too) is left alone


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_escape_control_leaves_nothing_to_act_on(text: str) -> None:
    shown = escape_control(text)
    assert shown.isprintable() and not control_chars(shown, allow="")
    assert escape_control(shown) == shown
    if text.isprintable():
        assert shown == text


def test_csv_cell_guards_formulas_but_keeps_numbers() -> None:
    for text in ("=1+1", "+1", "-x1", "@SUM(A1)", "\t=1", "\r=1", "\uff1d1", FORMULA, "-1+cmd|' /C calc'!A0"):
        cell = csv_cell(text)
        assert isinstance(cell, str) and cell.startswith("'"), text
    for number in (-0.5, -1, 0, 2.5, float("-inf"), float("nan")):
        assert csv_cell(number) is number
    for text in ("-1x10", "2x3;-1x4", "-5", "-1e-05", "-inf", "layer1", ""):
        assert csv_cell(text) == text  # numbers and shapes written as text start no formula


# --------------------------------------------------------------------------- reports


def reference_outputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every child's output, from plain forward hooks."""
    out: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda mod, args, y, name=name: out.__setitem__(name, y.detach().clone()))
               for name, m in model.named_children()]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return out


def dummy(*shape: int) -> torch.Tensor:
    """The dummy input hookcli builds: randn from a generator seeded with --seed (0)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("fmt", ["table", "markdown"])
@pytest.mark.parametrize("command", ["stats", "shapes", "grads", "modules"])
def test_human_formats_show_names_escaped(cli, monkeypatch: pytest.MonkeyPatch, command: str, fmt: str) -> None:
    monkeypatch.setenv("COLUMNS", "220")  # no cropping: every escaped name is shown whole
    args = [command, "test_untrusted_names:HostileNet", "-f", fmt]
    if command != "modules":
        args += ["--input-shape", "2x4"]
    out = cli(*args)
    assert out.exit_code == 0, out.stderr
    allow = "\n\u00a0" if fmt == "markdown" else "\n"  # markdown indents cells with NBSP
    assert control_chars(out.stdout, allow=allow) == [] and "\x1b" not in out.stdout
    assert control_chars(out.stderr) == []
    text = out.stdout.replace("\\\\", "\\")  # markdown doubles backslashes
    for shown in SHOWN.values():
        assert shown in text
    assert "Hostile\\x1b[2JType\\u202e" in text
    if fmt == "markdown":  # markup from names is inert: no HTML tag, entity, link or code span
        assert not re.search(r"(?<!\\)(<img|\]\(|&#x202e;|`c)", out.stdout)
        assert "\\<img src=x\\>\\[l\\]\\(" not in out.stdout  # only what starts markup is escaped
        assert "\\<img src=x\\>[l]\\(http://evil)\\&#x202e;\\|\\`c\\`" in out.stdout


def test_json_keeps_exact_names(cli) -> None:
    out = cli("stats", "test_untrusted_names:HostileNet", "--input-shape", "2x4", "-f", "json")
    assert out.exit_code == 0, out.stderr
    assert control_chars(out.stdout) == [] and "\x1b" not in out.stdout  # json.dumps escapes them
    data = json.loads(out.stdout)
    assert [row["name"] for row in data["layers"]] == list(CHAIN_NAMES)
    assert data["layers"][0]["type"] == HostileType.__name__


def test_csv_escapes_names_guards_formulas_and_keeps_numbers(cli) -> None:
    out = cli("stats", "test_untrusted_names:HostileNet", "--input-shape", "2x4", "-f", "csv")
    assert out.exit_code == 0, out.stderr
    assert control_chars(out.stdout) == []
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    names = [row["name"] for row in rows]
    assert names[:7] == [SHOWN[n] for n in CHAIN_NAMES[:7]]
    assert names[7] == "'" + FORMULA and names[8:] == [MARKUP, UNICODE]
    assert rows[0]["type"] == "Hostile\\x1b[2JType\\u202e"
    model = HostileNet().eval()
    refs = reference_outputs(model, dummy(2, 4))
    for row, name in zip(rows, CHAIN_NAMES, strict=True):
        ref = refs[name].double()
        for key, value in (("stat_min", ref.min()), ("stat_mean", ref.mean()), ("stat_max", ref.max())):
            assert not row[key].startswith("'")  # numbers stay numbers, negative ones too
            assert math.isclose(float(row[key]), float(value), rel_tol=1e-5, abs_tol=1e-6), (name, key)
    assert any(float(row["stat_min"]) < 0 for row in rows)


def test_stderr_error_and_hint_are_one_line_each(cli) -> None:
    out = cli("stats", "test_untrusted_names:RaisesHostile", "--input-shape", "2x4", "-f", "json")
    assert out.exit_code == 1
    assert control_chars(out.stderr) == []
    lines = out.stderr.splitlines()
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and not any(line.startswith("Error: forged") for line in lines)
    assert "boom\\x1b[2J\\x1b]0;title\\x07" in errors[0]
    report = json.loads(out.stdout)  # the partial report keeps the exact name and message
    assert report["layers"][0]["name"] == BIDI

    out = cli("stats", "test_untrusted_names:HostileNet", "--input-shape", "2x4", "--layers", "red")
    assert out.exit_code == 2 and control_chars(out.stderr) == []
    assert [line.split(":")[0] for line in out.stderr.splitlines()] == ["Error", "  hint"]


def test_annotations_junit_and_step_summary_escape_names(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "summary.md"
    junit = tmp_path / "check.xml"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    out = cli("check", "test_untrusted_names:HostileNaN", "--input-shape", "2x4", "--github", "--junit", junit)
    assert out.exit_code == 1
    assert control_chars(out.stdout) == [] and control_chars(out.stderr) == []
    commands = [line for line in out.stderr.splitlines() if line.startswith("::")]
    assert commands and all(line.startswith(("::error ", "::warning ")) for line in commands)
    for line in commands:  # ::command prop=value,prop=value::message, with nothing forged in between
        head, message = line[2:].split("::", 1)
        props = head.split(" ", 1)[1].split(",")
        assert [p.split("=", 1)[0] for p in props] in (["title"], ["file", "title"])
        assert all(":" not in p for p in props)
    finite = next(line for line in commands if "finite" in line)
    assert "a\\n%3A%3Aerror title=forged%3A%3Aforged\\x1b]8;;http%3A//evil/\\x07link" in finite
    assert "\\x1b[31mred\\x1b[0m" in out.stderr

    text = summary.read_text(encoding="utf-8")
    assert control_chars(text) == [] and "\x1b" not in text
    assert "a\\\\n::error title=forged::forged" in text  # Markdown shows the backslash doubled

    root = ET.parse(junit).getroot()
    pieces = [v for el in root.iter() for v in [el.text or "", *el.attrib.values()]]
    assert all(control_chars(p) == [] for p in pieces)
    failure = next(el for el in root.iter("failure") if el.get("type") == "finite")
    assert "a\\n::error title=forged::forged\\x1b]8;;http://evil/\\x07link" in failure.get("message")


# --------------------------------------------------------------------------- features: keys


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x * 2


class Heads(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[Any, torch.Tensor]:
        return {"out": x - 1, "#1": x * 3, 0: x / 2}


class Fields(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        from collections import namedtuple

        return namedtuple("Out", ["logits", "b"])(x * 5, x - 7)


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


#: Children whose names read like generated entry names, reserved keys and npz arguments.
COLLIDING = ["act", "act#1", "act#0", "split", "split[0]", "split[1]", "heads", "heads['out']",
             "heads[0]", "%", "%23", "__metadata__", "file", "allow_pickle", "(model)", "a/b", "\\x",
             "fields", "fields#0", "层🙂", ESC, NL]


class Colliding(nn.Module):
    """Every child runs on the input; ``act`` runs twice; ``fields`` has a child ``logits`` as well
    as an output field ``.logits``; the root returns a tuple (its own entries)."""

    def __init__(self) -> None:
        super().__init__()
        for i, name in enumerate(COLLIDING):
            special = {"act": nn.Tanh(), "split": Split(), "heads": Heads(), "fields": Fields()}
            module = special.get(name, Scale(i + 2.0))
            self.add_module(name, module)
        self.fields.add_module("logits", Scale(-3.0))
        self._modules["fields#0"].add_module("logits", Scale(-4.0))  # full name ``fields#0.logits``

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = self.act(self.act(x))
        for name, module in self.named_children():
            if name == "act":
                continue
            out = module(x)
            if name == "fields":
                total = total + self.fields.logits(out.logits)
                continue
            if name == "fields#0":
                out = module.logits(out)
            for t in (out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]):
                total = total + t
        return total, x.sum(dim=1)


class DottedTwin(nn.Module):
    """A child put in ``_modules`` as ``'x.y'`` next to a real ``x`` -> ``y``: two modules, one name."""

    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Module()
        self.x.y = Scale(2.0)
        self._modules["x.y"] = Scale(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.x.y(x) + self._modules["x.y"](x)


def flatten(value: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor in a module output, written as the JSON report writes paths."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return [p for f in value._fields for p in flatten(getattr(value, f), f"{path}.{f}")]
    if isinstance(value, (tuple, list)):
        return [p for i, v in enumerate(value) for p in flatten(v, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in flatten(v, f"{path}[{k!r}]")]
    return []


def hooked_calls(model: nn.Module, x: torch.Tensor) -> list[tuple[str, int, str, torch.Tensor]]:
    """(name, call, path, tensor) of every output tensor of every call of every module, root too,
    from plain forward hooks."""
    calls: list[tuple[str, int, str, torch.Tensor]] = []
    counts: dict[str, int] = {}

    def hook(name: str):
        def run(module: nn.Module, args: Any, output: Any) -> None:
            index = counts.get(name, 0)
            counts[name] = index + 1
            calls.extend((name, index, path, t.detach().clone()) for path, t in flatten(output))
        return run

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules(remove_duplicate=False)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return calls


def read_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A features file read with the format's own library (not hookcli)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    if path.suffix == ".pt":
        data = torch.load(path, weights_only=True)
        return data["tensors"], data["metadata"]
    with np.load(path, allow_pickle=False) as data:
        metadata = json.loads(str(data["__metadata__"]))
        return {k: torch.from_numpy(data[k]) for k in data.files if k != "__metadata__"}, metadata


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz"])
@pytest.mark.parametrize("model_class", [Colliding, DottedTwin])
def test_features_finds_every_call_of_every_module(tmp_path: Path, suffix: str, model_class: type) -> None:
    model = model_class().eval()
    x = dummy(2, 3)
    expected = hooked_calls(model, x)
    path = tmp_path / f"feats{suffix}"
    result = hookcli.features(model, input_shapes=["2x3"], layers=["(model)", "*"], output=path)
    tensors, metadata = read_file(path)
    assert "__metadata__" not in tensors
    entries = json.loads(metadata["entries"])
    labels = [e["label"] for e in entries]
    assert len(set(labels)) == len(labels) == len(tensors) == len(expected)
    assert set(labels) == set(tensors)
    by_call = {(e["name"], e["call"], e["output"]): tensors[e["label"]] for e in entries}
    assert len(by_call) == len(expected)
    for name, call, out_path, ref in expected:
        saved = by_call[(name, call, out_path)]
        assert saved.shape == ref.shape and torch.equal(saved, ref), (name, call, out_path)
    assert all(label.isprintable() for label in labels)
    assert [t.label for t in result.entries] == labels and set(result.tensors) == set(labels)


def test_features_names_of_adversarial_modules_read_plainly(tmp_path: Path) -> None:
    result = hookcli.features(Colliding().eval(), input_shapes=["2x3"], layers=["(model)", "*"])
    label = {(t.name, t.call, t.output): t.label for t in result.entries}
    # ordinary names keep the report's labels
    assert label[("act", 0, "")] == "act#0" and label[("act", 1, "")] == "act#1"
    assert label[("split", 0, "[0]")] == "split[0]" and label[("heads", 0, "['out']")] == "heads['out']"
    assert label[("", 0, "[0]")] == "(model)[0]"
    assert label[("fields.logits", 0, "")] == "fields.logits"
    # names that would read as another entry, or as a reserved key, are percent-encoded
    assert label[("act#1", 0, "")] == "act%231" and label[("split[0]", 0, "")] == "split%5B0]"
    assert label[("__metadata__", 0, "")] == "%5F_metadata__" and label[("(model)", 0, "")] == "%28model)"
    assert label[("fields", 0, ".logits")] == "fields#0.logits"  # a field path always shows its call
    assert label[("fields#0.logits", 0, "")] == "fields%230.logits" and label[("fields#0", 0, "")] == "fields%230"
    assert label[(ESC, 0, "")] == "%1B%5B31mred%1B%5B0m" and label[("a/b", 0, "")] == "a%2Fb"


def test_features_table_and_csv_show_exact_names_safely(cli, tmp_path: Path) -> None:
    out = cli("features", "test_untrusted_names:Colliding", "--input-shape", "2x3", "--all",
              "-o", tmp_path / "f.safetensors", "-f", "csv")
    assert out.exit_code == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert control_chars(out.stdout) == []
    assert {row["name"] for row in rows} >= {"act#1", "split[0]", "__metadata__", "a\\n::error title=forged::forged"}
    assert len({row["label"] for row in rows}) == len(rows)


_CHARS = list("ab.#[]%()'_/\\0 \x1b\n层")
_NAME_CHARS = st.sampled_from([*_CHARS, "__metadata__"])
_PATHS = st.lists(st.one_of(st.integers(0, 3).map(lambda i: f"[{i}]"),
                            st.text(st.sampled_from(_CHARS), max_size=4).map(lambda k: f"[{k!r}]"),
                            st.sampled_from([".logits", ".b", ".x"])), max_size=2).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(_NAME_CHARS, max_size=6).map("".join), st.integers(0, 12), _PATHS),
                min_size=2, max_size=8, unique=True))
def test_feature_keys_are_injective(calls: list[tuple[str, int, str]]) -> None:
    counts: dict[str, int] = {}
    for name, call, _ in calls:
        counts[name] = max(counts.get(name, 1), call + 1)
    keys = [feature_key(name, call, counts[name], path) for name, call, path in calls]
    assert len(set(keys)) == len(keys)
    assert "__metadata__" not in keys


# --------------------------------------------------------------------------- MODEL targets

SENTINEL = "hookcli-sentinel"


def _write_mymod(folder: Path) -> None:
    (folder / "mymod.py").write_text(
        "import functools, os\n"
        "from os import system\n"
        "from subprocess import run as launch\n"
        f"later = functools.partial(os.system, 'touch {SENTINEL}')\n"
        "class Settings:\n"
        f"    def __init__(self, **kw):\n        open({SENTINEL!r}, 'w').close()\n",
        encoding="utf-8")


REFUSED = ["os:system", "os:popen", "subprocess:run", "builtins:eval", "builtins:exec", "shutil:rmtree",
           "functools:partial", "this:d", "mymod:system", "mymod:launch", "mymod:later", "mymod:Settings",
           "mymod.py:system", "torch:load", "torch.hub:load",
           importlib.util.find_spec("this").origin + ":d"]  # a standard-library file: never executed


@pytest.mark.parametrize("spec", REFUSED)
def test_model_targets_from_python_itself_are_refused_before_the_call(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.chdir(tmp_path)
    _write_mymod(tmp_path)
    sys.modules.pop("mymod", None)
    arg = f"command=\"touch {SENTINEL}\"" if "eval" not in spec and "exec" not in spec else \
        f"source=\"open('{SENTINEL}', 'w')\""
    out = cli("shapes", spec, "--model-arg", arg)
    sys.modules.pop("mymod", None)
    assert out.exit_code == 2, out.output
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("Error: ") and spec in lines[0]
    assert lines[1] == ("  hint: the MODEL import path must name an nn.Module class or a factory function from "
                        "your own code (package.module:Net or path/to/net.py:build)")
    assert not (tmp_path / SENTINEL).exists()


@pytest.mark.parametrize("target", ["os:system", "mymod:system"])
@pytest.mark.parametrize("where", ["config", "pyproject"])
def test_os_system_from_a_config_runs_nothing(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str,
                                              target: str) -> None:
    monkeypatch.chdir(tmp_path)
    _write_mymod(tmp_path)
    sys.modules.pop("mymod", None)
    body = f'model = "{target}"\nmodel_args = {{ command = "touch {SENTINEL}" }}\n'
    if where == "config":
        (tmp_path / "cfg.toml").write_text(body)
        out = cli("check", "--config", "cfg.toml")
    else:
        (tmp_path / "pyproject.toml").write_text("[tool.hookcli]\n" + body)
        out = cli("check")  # bare: reads ./pyproject.toml by itself
    sys.modules.pop("mymod", None)
    assert out.exit_code == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and target in lines[0] and "own code" in lines[1]
    if target == "os:system":  # refused as the file is read, naming it
        assert lines[0].startswith(f"Error: {tmp_path / ('cfg.toml' if where == 'config' else 'pyproject.toml')}")
    else:  # a re-export: refused once resolved, before the call
        assert ".system from Python" in lines[0]
    assert not (tmp_path / SENTINEL).exists()


def test_python_api_refuses_too_and_own_factories_still_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="standard library"):
        hookcli.shapes("subprocess:run", model_args={"args": ["touch", SENTINEL]})
    assert not (tmp_path / SENTINEL).exists()
    # a user package whose name is also a standard-library name is the user's own code
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "__init__.py").write_text(
        "import functools\nfrom torch import nn\n"
        "def build(width=3):\n    return nn.Linear(width, 2)\n"
        "half = functools.partial(build, width=5)\n")
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "test" or k.startswith("test.")}
    try:
        report = hookcli.shapes("test:half", input_shapes=["1x5"])
        assert report.model.class_name == "Linear" and report.layers[0].shape == [1, 2]
        report = hookcli.shapes("torch.nn:Linear", model_args={"in_features": 3, "out_features": 2},
                                input_shapes=["1x3"])  # an nn.Module class from anywhere is fine
        assert report.layers[0].shape == [1, 2]
    finally:
        for k in [k for k in sys.modules if k == "test" or k.startswith("test.")]:
            sys.modules.pop(k)
        sys.modules.update(saved)
    assert os.listdir(tmp_path) == ["test"]


# --------------------------------------------------------------------------- any text, every renderer


@settings(max_examples=60, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=4),
       text=st.text(max_size=30), command=st.sampled_from(["stats", "grads", "shapes"]))
def test_any_text_in_a_report_renders_inert(names: list[str], text: str, command: str) -> None:
    """Records built by hand (renderers never need torch): whatever strings the model supplies, the
    table and Markdown hold no control character, CSV string cells start no formula, JSON is exact."""
    from hookcli.records import FailureInfo, LayerRecord, ModelInfo, ParamRecord, Report
    from hookcli.render import render

    stats = {"mean": -0.5, "std": 1.0, "min": -2.0, "max": 3.0, "norm": 4.0, "zero_fraction": 0.0,
             "nan_count": 0, "inf_count": 0}
    layers = [LayerRecord(name=n, call=0, type=text or "T", output=f"[{text!r}]", shape=[2, 3], dtype="float32",
                          stats=stats if command == "stats" else None, grad=stats if command == "grads" else None)
              for n in names]
    params = [ParamRecord(name=f"{names[0]}.weight", shape=[3], requires_grad=True, norm=1.0, grad=stats)]
    report = Report(command=command, model=ModelInfo(spec=text or "m:N", source="argument", class_name=names[-1]),
                    layers=layers, params=params if command == "grads" else None, notes=[text],
                    failure=FailureInfo("forward", names[0], text, [[2, 3]], "RuntimeError", text))
    for fmt in ("table", "markdown"):
        out = render(report, fmt, width=100)
        assert control_chars(out, allow="\n\u00a0" if fmt == "markdown" else "\n") == [], fmt
    rows = list(csv.reader(io.StringIO(render(report, "csv"))))
    header, body = rows[0], rows[1:]
    assert body and all(control_chars(cell, allow="") == [] for row in body for cell in row)
    numeric = {i for i, key in enumerate(header) if key.startswith(("stat_", "grad_")) and key != "grad_input_norms"}
    for row in body:
        for i, cell in enumerate(row):
            if i in numeric and cell:
                float(cell)  # numbers stay numbers (negative ones too)
            elif cell.startswith(("=", "+", "@", "\t", "\r")) or (cell.startswith("-") and not re.fullmatch(
                    r"-[0-9.e+-]*(?:[x;]-?\d+)*|-inf|-nan", cell)):
                raise AssertionError(f"formula-like CSV cell {cell!r}")
    data = json.loads(render(report, "json"))
    assert [row["name"] for row in data["layers"]] == names and data["model"]["spec"] == (text or "m:N")
