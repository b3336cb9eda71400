"""``hookcli check``: rules on healthy and broken models, config validation, CI outputs, the API.

Expected offenders and values come from plain-torch computations on the same model instance and the
same input tensor (saved to a .pt file that hookcli reads), never from hookcli's own output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import broken_models as bm
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli.render.ci import annotations, escape_data, escape_property
from hookcli.commands.check.schema import DEFAULTS, OVERRIDE_KEYS, parse_checks
from hookcli.errors import ConfigError
from reference import finished_outputs
from timeouts import scaled_timeout

DEFAULT_RULES = ["runs", "finite", "max_abs_activation", "max_zero_fraction", "dead_channels", "grad_norm",
                 "params_change"]


# --------------------------------------------------------------------------- plain-torch helpers





def param_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Gradients of cross-entropy (target 0) w.r.t. every trainable parameter (torch.autograd.grad)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = model(x)
    loss = nn.functional.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: g for (n, _), g in zip(named, grads)}


def check_on(model: nn.Module, x: torch.Tensor, tmp_path: Path, **kwargs):
    """hookcli.check on ``model`` with exactly ``x`` as input (through a .pt file)."""
    path = tmp_path / "x.pt"
    torch.save(x, path)
    return hookcli.check(model, inputs=[path], **kwargs)


def as_json(result) -> dict:
    return json.loads(result.stdout)


# --------------------------------------------------------------------------- healthy


def test_healthy_resnet18_passes_every_default_rule(cli) -> None:
    result = cli("check", "resnet18", "--input-shape", "2x3x64x64", "-f", "json")
    assert result.exit_code == 0, result.output
    data = as_json(result)
    assert data["ok"] is True and data["command"] == "check" and data["report"]["mode"] == "train"
    assert [(r["rule"], r["status"]) for r in data["rules"]] == [(r, "PASS") for r in DEFAULT_RULES]
    report = data["report"]
    names = {layer["name"] for layer in report["layers"]}
    assert {"layer4.1.bn2", "layer1.0.conv1", "fc"} <= names  # every module, not only children
    assert len(report["params"]) == 62  # every parameter of resnet18


def test_resnet18_numbers_match_plain_torch(tmp_path: Path) -> None:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(weights=None).train()  # check runs in train mode: BatchNorm uses batch statistics
    x = torch.randn(2, 3, 64, 64)
    result = check_on(model, x, tmp_path)
    assert result.ok, result
    assert result.report.mode == "train"
    outputs = finished_outputs(model, x)
    peak = max(o.abs().max().item() for _, o in outputs)
    assert result.rule("max_abs_activation").value == pytest.approx(peak, rel=1e-5)
    zero = max((o == 0).float().mean().item() for _, o in outputs)
    assert result.rule("max_zero_fraction").value == pytest.approx(zero, rel=1e-6)
    norms = {n: g.double().norm().item() for n, g in param_grads(model, x).items()}
    biggest = max(norms, key=norms.get)
    grad = result.rule("grad_norm")
    assert grad.offender == biggest and grad.value == pytest.approx(norms[biggest], rel=1e-4)


# --------------------------------------------------------------------------- broken models


def test_nan_names_the_first_layer_in_execution_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = bm.NestedNaN(), torch.randn(4, 4)
    first = next(n for n, o in finished_outputs(model, x) if not torch.isfinite(o).all())
    assert first == "block.1"  # the log inside the Sequential, which starts before it but ends after
    result = check_on(model, x, tmp_path)
    finite = result.rule("finite")
    assert not result.ok and finite.status == "FAIL" and finite.offender == first
    nan_count = int(torch.isnan(dict(finished_outputs(model, x))[first]).sum())
    assert finite.value == nan_count


def test_nan_model_exits_1_through_cli(cli) -> None:
    result = cli("check", "broken_models:NestedNaN", "--input-shape", "4x4")
    assert result.exit_code == 1
    assert "finite at block.1" in result.stderr and "FAIL" in result.stdout


def test_dead_layer_fails_max_zero_fraction(cli, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = bm.DeadLayer(), torch.randn(4, 4)
    dead = [n for n, o in finished_outputs(model, x) if bool((o == 0).all())]
    result = check_on(model, x, tmp_path)
    rule = result.rule("max_zero_fraction")
    assert rule.status == "FAIL" and rule.offender == dead[0] == "act" and rule.value == 1.0
    out = cli("check", "broken_models:DeadLayer", "--input-shape", "4x4", "-f", "json")
    assert out.exit_code == 1 and as_json(out)["rules"][3]["offender"] == "act"


def test_dead_channels_counts_channels_zero_over_the_batch(cli, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = bm.DeadChannels(), torch.randn(2, 3, 8, 8)
    relu = dict(finished_outputs(model, x))["relu"]
    expected = (relu.abs().amax(dim=(0, 2, 3)) == 0).float().mean().item()
    result = check_on(model, x, tmp_path)
    rule = result.rule("dead_channels")
    assert rule.status == "WARN" and result.ok  # warn by default: reported, the run passes
    assert rule.offender == "relu" and rule.value == pytest.approx(expected) and expected == 0.75
    strict = tmp_path / "strict.toml"
    strict.write_text('[checks.dead_channels]\nseverity = "error"\nvalue = 0.5\n')
    out = cli("check", "broken_models:DeadChannels", "--input-shape", "2x3x8x8", "--config", strict)
    assert out.exit_code == 1 and "dead_channels at relu" in out.stderr


def dead_fraction(t: torch.Tensor, dim: int) -> float:
    """The fraction of ``t``'s slices along ``dim`` that are zero everywhere (plain torch)."""
    others = [i for i in range(t.dim()) if i != dim % t.dim()]
    return (t.abs().amax(dim=others) == 0).float().mean().item()


def test_dead_channels_of_a_1d_convolution_are_dim_1(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = bm.DeadChannels1d(), torch.randn(2, 4, 16)
    relu = dict(finished_outputs(model, x))["relu"]
    assert dead_fraction(relu, 1) == 0.75 and dead_fraction(relu, -1) < 0.5  # channels dead, positions not
    rule = check_on(model, x, tmp_path).rule("dead_channels")
    assert rule.status == "WARN" and rule.offender == "relu" and rule.value == pytest.approx(0.75)
    assert "6 of 8 channels (dim 1) of relu" in rule.violations[0]["message"]


class IdentityThenReLU(nn.Module):
    """``relu(x)`` exactly (an identity Linear over the last dim first: parameters for the gradients)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(width))
            self.fc.bias.zero_()
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.fc(x))


@settings(max_examples=20, deadline=None)
@given(shape=st.lists(st.integers(2, 3), min_size=2, max_size=5), dim=st.integers(-7, 7), data=st.data())
def test_dead_channels_dim_out_of_range_is_refused_and_in_range_is_judged(tmp_path_factory, shape: list[int],
                                                                          dim: int, data) -> None:
    """A dim no checked output has would judge nothing and pass: ConfigError (exit 2) naming the rule,
    the dim and the outputs' dims; a dim they have is judged as plain torch sees it."""
    tmp_path = tmp_path_factory.mktemp("dims")
    dead = data.draw(st.integers(0, len(shape) - 1), label="dead dim")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).abs() + 0.1
    x.select(dead, 0).neg_()  # the first slice along ``dead`` is negative: zero after the ReLU
    model = IdentityThenReLU(shape[-1])
    checks = {"dead_channels": {"dim": dim, "min_values": 1, "value": 1.0}, "params_change": False}
    if -len(shape) <= dim < len(shape):
        rule = check_on(model, x, tmp_path, checks=checks).rule("dead_channels")
        assert rule.status == "PASS" and "out of range" not in rule.message
        assert rule.value == pytest.approx(dead_fraction(torch.relu(x), dim))
    else:
        with pytest.raises(ConfigError) as err:
            check_on(model, x, tmp_path, checks=checks)
        assert f"[checks.dead_channels] dim = {dim} is out of range" in err.value.message
        assert f"({len(shape)}-D)" in err.value.message and err.value.hint


def test_dead_channels_dim_some_outputs_lack_skips_them_and_says_so(cli, tmp_path: Path) -> None:
    gate = tmp_path / "gate.toml"
    gate.write_text('[checks.dead_channels]\ndim = 3\nseverity = "error"\n')
    torch.manual_seed(0)
    model, x = bm.DeadChannels(), torch.randn(2, 3, 8, 8)
    relu = dict(finished_outputs(model, x))["relu"]
    assert dead_fraction(relu, 3) == 0  # along the width nothing is dead; fc's output has no dim 3
    out = cli("check", "broken_models:DeadChannels", "--input-shape", "2x3x8x8", "--config", gate, "-f", "json")
    assert out.exit_code == 0, out.stderr
    rule = next(r for r in as_json(out)["rules"] if r["rule"] == "dead_channels")
    assert rule["status"] == "PASS" and "dim 3 out of range, not judged: fc (2-D)" in rule["message"]
    gate.write_text("[checks.dead_channels]\ndim = -5\n")  # no output has 5 dims
    out = cli("check", "broken_models:DeadChannels", "--input-shape", "2x3x8x8", "--config", gate)
    assert out.exit_code == 2 and out.stdout == ""
    first, hint = out.stderr.splitlines()
    assert first.startswith(f"Error: {gate}: [checks.dead_channels] dim = -5 is out of range for every output")
    assert "(2-D/4-D)" in first and hint.startswith("  hint: ") and "Traceback" not in out.stderr


def test_dead_channels_of_a_transformer_are_its_last_dim(cli, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # 96 of the 128 MLP features of block 0 are pushed far below zero: GELU gives 0
        model.transformer.h[0].mlp.c_fc.bias[32:] = -100.0
    model.save_pretrained(tmp_path / "gpt2")
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    act = dict(finished_outputs(model.transformer.h[0].mlp, model.transformer.h[0].ln_2(
        model.transformer.wpe(torch.arange(20)) + model.transformer.wte(ids))))["act"]
    assert list(act.shape) == [1, 20, 128]
    assert dead_fraction(act, -1) == 0.75 and dead_fraction(act, 1) == 0  # features dead, no position
    out = cli("check", f"hf:{tmp_path / 'gpt2'}", "--seq-len", "20", "-f", "json")
    assert out.exit_code == 0, out.stderr  # a warning
    rule = next(r for r in as_json(out)["rules"] if r["rule"] == "dead_channels")
    assert rule["status"] == "WARN" and rule["offender"] == "transformer.h.0.mlp.act"
    assert rule["value"] == pytest.approx(0.75)
    assert "96 of 128 channels (dim 2)" in rule["message"] or \
        any("96 of 128 channels (dim 2)" in v["message"] for v in rule.get("violations", []))


def test_cut_off_parameter_fails_params_change_but_frozen_is_fine(cli, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = bm.DetachedBranch(), torch.randn(4, 4)
    no_grad = sorted(n for n, g in param_grads(model, x).items() if g is None)
    assert no_grad == ["unused.bias", "unused.weight"]
    result = check_on(model, x, tmp_path)
    change, grad = result.rule("params_change"), result.rule("grad_norm")
    assert change.status == grad.status == "FAIL"
    assert sorted(v["where"] for v in change.violations) == no_grad  # frozen.* is not trainable: not listed
    assert sorted(v["where"] for v in grad.violations) == no_grad
    assert "cut off" in grad.message
    out = cli("check", "broken_models:DetachedBranch", "--input-shape", "4x4")
    assert out.exit_code == 1 and "params_change at unused" in out.stderr


def test_never_called_parameter_is_a_warning(cli, tmp_path: Path) -> None:
    """Issue 13: a module the forward never calls is reported (WARN), not a failure."""
    torch.manual_seed(0)
    model, x = bm.UnusedParam(), torch.randn(4, 4)
    result = check_on(model, x, tmp_path)
    grad = result.rule("grad_norm")
    assert grad.status == "WARN" and "never called" in grad.message
    assert sorted(v["where"] for v in grad.violations) == ["unused.bias", "unused.weight"]
    assert result.rule("params_change").status == "PASS"
    out = cli("check", "broken_models:UnusedParam", "--input-shape", "4x4")
    assert out.exit_code == 0


def test_exploding_model_fails_grad_norm_and_activations(cli, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = bm.Explodes(), torch.randn(4, 4)
    norms = {n: g.double().norm().item() for n, g in param_grads(model, x).items()}
    worst = max(norms, key=norms.get)
    assert norms[worst] > 1e4
    peaks = {n: o.abs().max().item() for n, o in finished_outputs(model, x)}
    result = check_on(model, x, tmp_path)
    grad, act = result.rule("grad_norm"), result.rule("max_abs_activation")
    assert grad.status == "FAIL" and grad.offender == worst and grad.value == pytest.approx(norms[worst], rel=1e-4)
    assert {v["where"] for v in grad.violations} == {n for n, v in norms.items() if v > 1e4}
    # a warning by default (large activations depend on the input's scale); the exploding gradients fail the run
    assert act.status == "WARN" and act.value == pytest.approx(max(peaks.values()), rel=1e-5)
    out = cli("check", "broken_models:Explodes", "--input-shape", "4x4")
    assert out.exit_code == 1 and "grad_norm" in out.stderr and "max_abs_activation" not in out.stderr


def test_wrong_output_shape_from_config(cli, tmp_path: Path) -> None:
    expected = list(bm.Healthy()(torch.zeros(2, 3, 8, 8)).shape)
    config = tmp_path / "shape.toml"
    config.write_text('model = "broken_models:Healthy"\ninput_shape = "2x3x8x8"\n[checks]\noutput_shape = [2, 5]\n')
    out = cli("check", "--config", config, "-f", "json")
    assert out.exit_code == 1
    rule = next(r for r in as_json(out)["rules"] if r["rule"] == "output_shape")
    assert rule["status"] == "FAIL" and rule["value"] == expected and rule["limit"] == [2, 5]
    config.write_text(config.read_text().replace("[2, 5]", "[-1, 4]"))
    assert cli("check", "--config", config).exit_code == 0


def test_model_that_raises_fails_runs_and_still_writes_junit(cli, tmp_path: Path) -> None:
    junit = tmp_path / "out" / "check.xml"
    junit.parent.mkdir()
    out = cli("check", "tiny_models:Raises", "--input-shape", "2x4", "-f", "json", "--junit", junit)
    assert out.exit_code == 1 and "bad (CheckedLinear)" in out.stderr
    data = as_json(out)
    assert data["rules"][0]["rule"] == "runs" and data["rules"][0]["status"] == "FAIL"
    assert {r["status"] for r in data["rules"][1:]} == {"SKIP"}
    assert data["report"]["failure"]["module"] == "bad"
    assert [r["name"] for r in data["report"]["layers"] if r["called"]] == ["good", "act", "bad"]
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "1" and suite.get("skipped") == str(len(DEFAULT_RULES) - 1)


def test_scope_and_mode_defaults_can_be_narrowed(cli, tmp_path: Path) -> None:
    args = ("check", "broken_models:Healthy", "--input-shape", "2x3x8x8", "-f", "json")
    report = as_json(cli(*args))["report"]
    assert report["mode"] == "train" and len(report["params"]) == 4
    narrow = as_json(cli(*args, "--layers", "fc", "--params", "selected", "--eval"))["report"]
    assert narrow["mode"] == "eval" and [p["name"] for p in narrow["params"]] == ["fc.weight", "fc.bias"]
    assert [layer["name"] for layer in narrow["layers"]] == ["fc"]
    config = tmp_path / "eval.toml"
    config.write_text('mode = "eval"\n')
    assert as_json(cli(*args, "--config", config))["report"]["mode"] == "eval"


# --------------------------------------------------------------------------- baseline


def test_baseline_lists_differences(cli, tmp_path: Path) -> None:
    base = tmp_path / "base.json"
    made = cli("shapes", "broken_models:Healthy", "--input-shape", "2x3x8x8", "-f", "json", "-o", base)
    assert made.exit_code == 0
    same = cli("check", "broken_models:Healthy", "--input-shape", "2x3x8x8", "--baseline", base)
    assert same.exit_code == 0, same.output
    changed = bm.Healthy(classes=6)
    new_shape = list(changed(torch.zeros(2, 3, 8, 8)).shape)
    new_params = sum(p.numel() for p in changed.parameters())
    old_params = sum(p.numel() for p in bm.Healthy().parameters())
    out = cli("check", "broken_models:Healthy", "--model-arg", "classes=6", "--input-shape", "2x3x8x8",
              "--baseline", base, "-f", "json")
    assert out.exit_code == 1
    rule = next(r for r in as_json(out)["rules"] if r["rule"] == "baseline")
    diffs = {(v["where"], json.dumps(v["limit"]), json.dumps(v["value"])) for v in rule["violations"]}
    assert ("fc", json.dumps([2, 4]), json.dumps(new_shape)) in diffs
    assert ("(model)", str(old_params), str(new_params)) in diffs
    assert "fc: shape [2, 4] -> [2, 6]" in out.stdout


# --------------------------------------------------------------------------- config validation


def documented_defaults() -> dict[str, dict[str, object]]:
    """The "Rules and defaults" table of docs/check.md, per rule: enabled, severity and every
    `key = value` it states."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text()
    table = text.split("## Rules and defaults", 1)[1].split("\n\n", 2)[1]
    out: dict[str, dict[str, object]] = {}
    for line in table.splitlines()[2:]:
        name, default = (c.strip() for c in line.strip("|").split("|")[:2])
        name = name.strip("`")
        if name == "runs":
            continue
        words = default.replace("*", "")
        entry: dict[str, object] = {"enabled": re.match(r"on\b", words) is not None,
                                    "severity": "warn" if ", warn" in words else "error"}
        for key, value in re.findall(r"`(\w+) = ([^`]+)`", default):
            entry[key] = json.loads(value) if value[0] in '"[{' else float(value) if any(c in value for c in ".e") else int(value)
        out[name] = entry
    return out


def test_each_rule_is_one_spec_and_its_docs_row_is_the_specs() -> None:
    """Issue #21 part 5: ``schema.SPECS`` is the only list of rules; every other view (the enum, the
    defaults, the keys, the evaluators) is derived from it, and docs/check.md's rule table is its rows."""
    from hookcli.commands.check import rules, schema

    names = [spec.name for spec in schema.SPECS]
    assert len(set(names)) == len(names)
    assert list(schema.RULES) == list(schema.DEFAULTS) == list(schema.RULE_KEYS) == list(rules.EVALUATORS) == names
    assert all(rules.EVALUATORS[spec.name].__name__ == spec.evaluator for spec in schema.SPECS)
    text = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text()
    table = text.split("## Rules and defaults", 1)[1].split("\n\n", 2)[1].splitlines()[2:]
    assert [row for row in table if not row.startswith("| `runs`")] == [spec.doc_row() for spec in schema.SPECS]


def test_documented_defaults_are_the_schemas() -> None:
    from hookcli.commands.check.schema import DEFAULTS

    documented = documented_defaults()
    assert set(documented) == set(DEFAULTS)
    for rule, defaults in DEFAULTS.items():
        stated = {k: v for k, v in defaults.items() if v is not None and k not in ("file",)}
        assert documented[rule] == stated, rule




@pytest.mark.parametrize("text, needles", [
    ("[checks.max_abs_activation]\nvalu = 3\n", ["'valu'", "value"]),
    ("[checks.grad_norm]\nmin = 'small'\n", ["'min'", "number"]),
    ("[checks]\nfinit = true\n", ["'finit'", "finite"]),
    ("[checks.finite]\nseverity = 'fatal'\n", ["'severity'", "warn"]),
    ("[checks.max_zero_fraction]\nvalue = 1.5\n", ["'value'", "0 to 1"]),
    ("[checks.grad_norm]\noverrides = { fc = 3 }\n", ["'fc'", "min"]),
    ("[checks.output_shape]\nout = [1, 2]\n", ["'out'", "value"]),
])
def test_bad_checks_table_exits_2_naming_key_and_file(cli, tmp_path: Path, text: str, needles: list[str]) -> None:
    config = tmp_path / "bad_checks.toml"
    config.write_text('model = "broken_models:Healthy"\ninput_shape = "2x3x8x8"\n' + text)
    out = cli("check", "--config", config)
    assert out.exit_code == 2 and out.stdout == ""
    assert "bad_checks.toml" in out.stderr and "Traceback" not in out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr


def test_pyproject_tool_hookcli_checks(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a config names its repository's own code: a module of tmp_path
    (tmp_path / "check_repo_models.py").write_text("from broken_models import Healthy\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.hookcli]\nmodel = "check_repo_models:Healthy"\ninput_shape = "2x3x8x8"\n'
        '[tool.hookcli.checks]\noutput_shape = [2, 3]\n[tool.hookcli.checks.grad_norm]\nmax = 1e3\n')
    out = cli("check")
    assert out.exit_code == 1 and "output_shape at (model)" in out.stderr
    (tmp_path / "pyproject.toml").write_text('[tool.hookcli]\n[tool.hookcli.checks.grad_norm]\nmaxx = 1\n')
    out = cli("check", "broken_models:Healthy")
    assert out.exit_code == 2 and "pyproject.toml" in out.stderr and "tool.hookcli.checks.grad_norm" in out.stderr


# --------------------------------------------------------------------------- CI outputs


def test_junit_xml(cli, tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    out = cli("check", "broken_models:DetachedBranch", "--input-shape", "4x4", "--junit", junit)
    assert out.exit_code == 1
    root = ET.parse(junit).getroot()
    cases = root.findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == DEFAULT_RULES
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert failed == ["grad_norm", "params_change"] and root.get("failures") == "2"
    assert "unused.weight" in cases[DEFAULT_RULES.index("params_change")].find("failure").get("message")
    assert [p.name for p in tmp_path.iterdir()] == ["junit.xml"]  # atomic: no temp file left


def test_escape_functions() -> None:
    assert escape_data("50%,\na:b") == "50%25,%0Aa:b"
    assert escape_property("50%,\na:b") == "50%25%2C%0Aa%3Ab"
    assert escape_data("x\r\ny") == "x%0D%0Ay"


def test_github_annotations_on_stderr(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    out = cli("check", "broken_models:DetachedBranch", "--input-shape", "4x4", "-f", "json")
    assert out.exit_code == 1
    json.loads(out.stdout)  # stdout stays pure JSON
    lines = [line for line in out.stderr.splitlines() if line.startswith("::")]
    assert [line.split(" ", 1)[0] for line in lines] == ["::error", "::error"]
    title, message = lines[0].split("::", 2)[1:]
    assert title.startswith("error title=hookcli check grad_norm at unused.weight (broken_models%3ADetachedBranch)")
    assert "%0A- unused.bias" in message and "\n" not in message
    assert cli("check", "broken_models:DetachedBranch", "--input-shape", "4x4", "--no-github").stderr.count("::") == 0


def test_step_summary_is_appended(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("previous step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    out = cli("check", "broken_models:DeadLayer", "--input-shape", "4x4")
    assert out.exit_code == 1
    text = summary.read_text()
    assert text.startswith("previous step\n")
    assert "### hookcli check: broken_models:DeadLayer: FAILED" in text
    assert "| max_zero_fraction | FAIL | error | act |" in text


# --------------------------------------------------------------------------- Python API


def test_api_check_result_and_overrides(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = bm.DeadLayer(), torch.randn(4, 4)
    result = check_on(model, x, tmp_path, checks={"max_zero_fraction": {"ignore": ["act"]}})
    assert result.rule("max_zero_fraction").status == "PASS"
    result = check_on(model, x, tmp_path, checks={
        "max_zero_fraction": {"overrides": {"act": 1.0, "nope*": 0.5}},
        "grad_norm": False, "params_change": {"enabled": False}})
    assert result.ok and [r.rule for r in result.rules] == ["runs", "finite", "max_abs_activation",
                                                             "max_zero_fraction", "dead_channels"]
    assert any("'nope*' matches nothing" in n for n in result.notes)
    healthy = hookcli.check(bm.Healthy(), input_shapes=["2x3x8x8"], checks={"output_shape": [2, 5]})
    assert not healthy.ok and [r.rule for r in healthy.failures] == ["output_shape"]
    assert "output_shape" in str(healthy) and healthy.to_dict()["ok"] is False
    with pytest.raises(ConfigError, match="bogus"):
        hookcli.check(bm.Healthy(), checks={"bogus": 1})


def test_api_reads_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('model = "broken_models:Healthy"\ninput_shape = "2x3x8x8"\n[checks]\noutput_shape = [2, 4]\n')
    result = hookcli.check(config=config)
    assert result.ok and result.config == str(config) and result.model.source == "config"


def test_users_model_is_unchanged(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    model[0].weight.grad = torch.ones_like(model[0].weight)
    model.train()
    params = {n: (p, p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: (b, b.clone()) for n, b in model.named_buffers()}
    grad = model[0].weight.grad
    result = hookcli.check(model, input_shapes=["2x3x8x8"], train=True)
    assert result.rule("params_change").status == "PASS"  # the copy was stepped ...
    for n, p in model.named_parameters():  # ... the model was not
        obj, before, requires_grad = params[n]
        assert p is obj and torch.equal(p, before) and p.requires_grad == requires_grad
    for n, b in model.named_buffers():
        assert b is buffers[n][0] and torch.equal(b, buffers[n][1])
    assert model[0].weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "0.weight")
    assert model.training and not model._forward_hooks and not model[0]._forward_hooks


def test_train_mode_run_is_seeded_and_leaves_the_global_rng_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 3))
    state = torch.get_rng_state()
    first = hookcli.check(model, input_shapes=["4x8"]).to_dict()
    assert torch.equal(torch.get_rng_state(), state)
    torch.rand(5)  # move the global RNG: the check must not depend on it
    again = hookcli.check(model, input_shapes=["4x8"]).to_dict()
    assert first["report"]["layers"] == again["report"]["layers"] and first["rules"] == again["rules"]
    other = hookcli.check(model, input_shapes=["4x8"], seed=1).to_dict()
    assert other["report"]["layers"] != first["report"]["layers"]  # --seed drives input and dropout


# --------------------------------------------------------------------------- renderers


def test_check_renders_in_every_format_without_torch() -> None:
    code = textwrap.dedent("""
        import sys
        from hookcli.records import CheckResult, ModelInfo, Report, RuleResult
        from hookcli.render import OutputFormat, render
        report = Report(command="check", model=ModelInfo(spec="net", source="argument", class_name="Net"))
        rules = [RuleResult("runs", "PASS", "error", "ran"),
                 RuleResult("finite", "FAIL", "error", "3 NaN in log", "log", 3, 0,
                            [{"where": "log", "value": 3, "limit": 0, "message": "3 NaN in log"}]),
                 RuleResult("grad_norm", "WARN", "warn", "big", "fc.weight", 2e4, [1e-12, 1e4]),
                 RuleResult("output_shape", "PASS", "error", "ok", "(model)", [2, 10], [-1, 10])]
        result = CheckResult(report, rules)
        out = {fmt.value: render(result, fmt, width=100, color=True) for fmt in OutputFormat}
        assert "\\x1b[1;31mFAIL" in out["table"] and "\\x1b[33mWARN" in out["table"], out["table"]
        assert "[1e-12, 1e+04]" in out["table"] and "[-1, 10]" in out["table"]
        assert "| finite | FAIL | error | log | 3 | 0 | 3 NaN in log |" in out["markdown"]
        assert out["csv"].splitlines()[0] == "rule,status,severity,offender,value,limit,message"
        assert "output_shape,PASS,error,(model),2x10,-1x10,ok" in out["csv"]
        assert '"ok": false' in out["json"]
        assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=scaled_timeout(60))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_annotations_point_at_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookcli.records import CheckResult, ModelInfo, Report, RuleResult

    monkeypatch.chdir(tmp_path)
    report = Report(command="check", model=ModelInfo(spec="a:b", source="config", class_name="B"))
    result = CheckResult(report, [RuleResult("finite", "WARN", "warn", "50%,\na:b", "x")],
                         config=str(tmp_path / "ci" / "gate.toml"))
    # a newline inside one message (from a name or an exception) is shown as \n, not a line break
    assert annotations(result) == ["::warning file=ci/gate.toml,title=hookcli check finite at x (a%3Ab)::50%25,\\na:b"]


# --------------------------------------------------------------------------- numeric thresholds



def _numeric_keys() -> list[tuple[str, str]]:
    """Every (rule, key) whose default is a number: read from the schema, so a new threshold is covered."""
    keys = [(rule, key) for rule, settings in DEFAULTS.items() for key, value in settings.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)]
    assert ("params_change", "lr") in keys and ("grad_norm", "max") in keys and ("max_abs_activation", "value") in keys
    return keys


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("rule, key", _numeric_keys())
def test_every_numeric_threshold_must_be_finite(rule: str, key: str, bad: float) -> None:
    with pytest.raises(ConfigError) as info:
        parse_checks({rule: {key: bad}}, source="h.toml")
    assert f"'{key}'" in str(info.value) and "h.toml" in str(info.value) and info.value.exit_code == 2
    for pattern_key in OVERRIDE_KEYS.get(rule, ()):  # and through a per-layer override
        with pytest.raises(ConfigError, match=pattern_key):
            parse_checks({rule: {"overrides": {"fc": {pattern_key: bad}}}}, source="h.toml")


def test_params_change_steps_are_bounded() -> None:
    with pytest.raises(ConfigError, match="'steps'"):
        parse_checks({"params_change": {"steps": 10**9}})
    assert parse_checks({"params_change": {"steps": 1000}}).rules["params_change"]["steps"] == 1000


def test_infinite_lr_from_a_config_is_refused_not_passed(cli, tmp_path: Path) -> None:
    """Issue #20: ``lr = inf`` turned a failing gate into PASSED (``nan`` was already refused)."""
    config = tmp_path / "inf.toml"
    config.write_text('model = "broken_models:DetachedBranch"\ninput_shape = "4x4"\n'
                      "[checks.params_change]\nlr = inf\n")
    out = cli("check", "--config", config)
    assert out.exit_code == 2 and out.stdout == "", out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and lines[1].startswith("  hint: "), out.stderr
    assert lines[0].startswith("Error: ") and "'lr'" in lines[0] and "finite" in lines[0]


@settings(max_examples=60, deadline=None)
@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_lr_accepts_exactly_the_finite_positive_numbers(value: float) -> None:
    if 0 < value < float("inf"):
        assert parse_checks({"params_change": {"lr": value}}).rules["params_change"]["lr"] == value
    else:
        with pytest.raises(ConfigError):
            parse_checks({"params_change": {"lr": value}})


# --------------------------------------------------------------------------- params_change: the SGD steps


class _SquaredLoss(nn.Module):
    """A model whose output is its own scalar loss (what check differentiates as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.calls = 0  # a plain attribute: copy.deepcopy copies it with the model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (self.lin(x) ** 2).mean()


@settings(max_examples=8, deadline=None)
@given(steps=st.integers(1, 4), lr=st.sampled_from([1e-3, 0.05, 0.3]))
def test_params_change_is_what_torch_sgd_does_to_a_copy(tmp_path_factory, steps: int, lr: float) -> None:
    """params_change's value is the smallest (over parameters) largest |change| that ``steps`` plain
    torch SGD steps give a copy of the model; the user's model is not stepped."""
    torch.manual_seed(0)
    model, x = _SquaredLoss(), torch.randn(5, 4)
    reference = __import__("copy").deepcopy(model)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    sgd = torch.optim.SGD(reference.parameters(), lr=lr)
    for _ in range(steps):
        sgd.zero_grad()
        reference(x).backward()
        sgd.step()
    changes = {n: float((p.detach() - before[n]).abs().max()) for n, p in reference.named_parameters()}
    smallest = min(changes, key=changes.get)
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = check_on(model, x, tmp_path_factory.mktemp("sgd"),
                      checks={"params_change": {"steps": steps, "lr": lr}})
    rule = result.rule("params_change")
    assert rule.status == "PASS" and rule.offender == smallest
    assert rule.value == pytest.approx(changes[smallest], rel=1e-5)
    assert all(torch.equal(p, mine[n]) for n, p in model.named_parameters())


class _FailsOnTheCopy(_SquaredLoss):
    """Runs once (the checked run), then raises or exits on every later call: the copy's SGD step."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls >= 1:
            if self.how == "exit":
                raise SystemExit(7)
            raise ValueError("boom on the copy")
        return super().forward(x)


@pytest.mark.parametrize("how, message", [
    ("raise", "the SGD step on the copy raised ValueError: boom on the copy"),
    ("exit", "the model exited with code 7 during the SGD step on the copy"),
])
def test_a_copy_that_fails_its_sgd_step_fails_params_change_only(cli, tmp_path: Path, how: str, message: str) -> None:
    """The checked run passed; the copy's step raising (or exiting) is params_change's FAIL, said once."""
    torch.manual_seed(0)
    result = check_on(_FailsOnTheCopy(how), torch.randn(5, 4), tmp_path)
    rule = result.rule("params_change")
    assert result.rule("runs").status == "PASS"
    assert rule.status == "FAIL" and rule.violations[0]["message"] == message
